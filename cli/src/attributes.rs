//! Reading item attribute tables (`recsys convert --item-attributes FILE`): Parquet through the
//! Arrow project's reader, CSV and TSV through the engine's.

use std::path::Path;

use crate::error::{CliError, Result};
use recsys_engine::AttributeTable;

/// The table in `path`: Parquet when the file starts with Parquet's magic (`PAR1`), else CSV
/// (`.csv`) or TSV. The first column is the external item id; every other is an attribute of
/// strings, integers or lists of them.
pub fn read(path: &Path) -> Result<AttributeTable> {
    let mut magic = [0u8; 4];
    let is_parquet = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == b"PAR1";
    if is_parquet {
        return read_parquet(path);
    }
    if !path.exists() {
        return Err(CliError::Input(format!(
            "item attributes {}: no such file",
            path.display()
        )));
    }
    AttributeTable::read_delimited(path).map_err(CliError::Input)
}

#[cfg(not(feature = "parquet"))]
fn read_parquet(path: &Path) -> Result<AttributeTable> {
    Err(CliError::Input(format!(
        "{} is Parquet, and this recsys was built without Parquet support; write the table as \
         CSV or TSV",
        path.display()
    )))
}

#[cfg(feature = "parquet")]
fn read_parquet(path: &Path) -> Result<AttributeTable> {
    use arrow_array::RecordBatchReader;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    let bad = |reason: String| CliError::Input(format!("{}: {reason}", path.display()));
    let file = std::fs::File::open(path).map_err(CliError::io(format!(
        "cannot open item attributes {}",
        path.display()
    )))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .and_then(|b| b.build())
        .map_err(|e| bad(e.to_string()))?;
    let schema = reader.schema();
    if schema.fields().len() < 2 {
        return Err(bad(format!(
            "{} column(s); the table needs the item id column and at least one attribute",
            schema.fields().len()
        )));
    }
    let columns: Vec<String> = schema
        .fields()
        .iter()
        .skip(1)
        .map(|f| f.name().clone())
        .collect();
    let mut table = AttributeTable {
        columns,
        rows: Vec::new(),
    };
    for batch in reader {
        let batch = batch.map_err(|e| bad(e.to_string()))?;
        let ids = cell_values(batch.column(0).as_ref(), schema.field(0).name()).map_err(&bad)?;
        let attributes = (1..batch.num_columns())
            .map(|c| cell_values(batch.column(c).as_ref(), schema.field(c).name()))
            .collect::<std::result::Result<Vec<_>, String>>()
            .map_err(&bad)?;
        for (row, id) in ids.into_iter().enumerate() {
            let [id] = <[String; 1]>::try_from(id).map_err(|v| {
                bad(format!(
                    "row {row}: the item id column holds {} values; it must hold one",
                    v.len()
                ))
            })?;
            let values = attributes
                .iter()
                .map(|column| column[row].clone())
                .collect();
            table.rows.push((id, values));
        }
    }
    table.check().map_err(bad)?;
    Ok(table)
}

/// Each row's value of a primitive column as text (`None` for a null).
#[cfg(feature = "parquet")]
fn primitive_text<T: arrow_array::ArrowPrimitiveType>(
    array: &dyn arrow_array::Array,
) -> Vec<Option<String>>
where
    T::Native: std::fmt::Display,
{
    use arrow_array::cast::AsArray;
    use arrow_array::Array;
    let a = array.as_primitive::<T>();
    (0..a.len())
        .map(|i| a.is_valid(i).then(|| a.value(i).to_string()))
        .collect()
}

/// Each row's value of a string column as text (`None` for a null).
#[cfg(feature = "parquet")]
fn string_text<O: arrow_array::OffsetSizeTrait>(
    array: &dyn arrow_array::Array,
) -> Vec<Option<String>> {
    use arrow_array::cast::AsArray;
    use arrow_array::Array;
    let a = array.as_string::<O>();
    (0..a.len())
        .map(|i| a.is_valid(i).then(|| a.value(i).to_owned()))
        .collect()
}

/// Each row's value of a scalar column as text: strings, integers and booleans.
#[cfg(feature = "parquet")]
fn scalar_text(
    array: &dyn arrow_array::Array,
    name: &str,
) -> std::result::Result<Vec<Option<String>>, String> {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{
        Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
    };
    use arrow_array::Array;
    use arrow_schema::DataType;
    Ok(match array.data_type() {
        DataType::Utf8 => string_text::<i32>(array),
        DataType::LargeUtf8 => string_text::<i64>(array),
        DataType::Utf8View => {
            let a = array.as_string_view();
            (0..a.len())
                .map(|i| a.is_valid(i).then(|| a.value(i).to_owned()))
                .collect()
        }
        DataType::Int8 => primitive_text::<Int8Type>(array),
        DataType::Int16 => primitive_text::<Int16Type>(array),
        DataType::Int32 => primitive_text::<Int32Type>(array),
        DataType::Int64 => primitive_text::<Int64Type>(array),
        DataType::UInt8 => primitive_text::<UInt8Type>(array),
        DataType::UInt16 => primitive_text::<UInt16Type>(array),
        DataType::UInt32 => primitive_text::<UInt32Type>(array),
        DataType::UInt64 => primitive_text::<UInt64Type>(array),
        DataType::Boolean => {
            let a = array.as_boolean();
            (0..a.len())
                .map(|i| a.is_valid(i).then(|| a.value(i).to_string()))
                .collect()
        }
        other => {
            return Err(format!(
                "column {name:?} is {other}; attributes are strings, integers, booleans or lists \
                 of them"
            ))
        }
    })
}

/// Each row's values of one Arrow column as text: none for a null, one for a scalar, every
/// element for a list.
#[cfg(feature = "parquet")]
fn cell_values(
    column: &dyn arrow_array::Array,
    name: &str,
) -> std::result::Result<Vec<Vec<String>>, String> {
    use arrow_array::cast::AsArray;
    use arrow_schema::DataType;
    let (offsets, values): (Vec<usize>, &dyn arrow_array::Array) = match column.data_type() {
        DataType::List(_) => {
            let a = column.as_list::<i32>();
            let offsets = a.value_offsets().iter().map(|&o| o as usize).collect();
            (offsets, a.values().as_ref())
        }
        DataType::LargeList(_) => {
            let a = column.as_list::<i64>();
            let offsets = a.value_offsets().iter().map(|&o| o as usize).collect();
            (offsets, a.values().as_ref())
        }
        _ => {
            return Ok(scalar_text(column, name)?
                .into_iter()
                .map(|v| v.into_iter().collect())
                .collect())
        }
    };
    let inner = scalar_text(values, name)?;
    Ok((0..column.len())
        .map(|row| {
            if column.is_null(row) {
                return Vec::new();
            }
            inner[offsets[row]..offsets[row + 1]]
                .iter()
                .flatten()
                .cloned()
                .collect()
        })
        .collect())
}

#[cfg(all(test, feature = "parquet"))]
mod tests {
    use super::*;
    use arrow_array::builder::{ListBuilder, StringBuilder};
    use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
    use std::sync::Arc;

    #[test]
    fn parquet_tables_read_strings_integers_lists_and_nulls() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("attrs.parquet");
        let mut tags = ListBuilder::new(StringBuilder::new());
        tags.values().append_value("sale");
        tags.values().append_value("new");
        tags.append(true);
        tags.append(false);
        tags.values().append_value("sale");
        tags.append(true);
        let batch = RecordBatch::try_from_iter([
            (
                "item_id",
                Arc::new(Int64Array::from(vec![11, 12, 13])) as ArrayRef,
            ),
            (
                "category",
                Arc::new(StringArray::from(vec![Some("shoes"), None, Some("hats")])) as ArrayRef,
            ),
            (
                "size",
                Arc::new(Int64Array::from(vec![42, 43, 42])) as ArrayRef,
            ),
            ("tags", Arc::new(tags.finish()) as ArrayRef),
        ])
        .unwrap();
        let file = std::fs::File::create(&path).unwrap();
        let mut writer = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        let table = read(&path).unwrap();
        assert_eq!(table.columns, vec!["category", "size", "tags"]);
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            table.rows[0],
            (
                "11".into(),
                vec![s(&["shoes"]), s(&["42"]), s(&["sale", "new"])]
            )
        );
        assert_eq!(
            table.rows[1],
            ("12".into(), vec![s(&[]), s(&["43"]), s(&[])])
        );
        assert_eq!(table.rows[2].1[2], s(&["sale"]));
    }
}
