//! Reads a catalogue delta from a Parquet table in the schema `recsys export-items --format
//! parquet` writes: `item_id` (int64 or string), `vector` (`[embedding, bias]`), and optionally
//! `input_vector` (the item's input row, `--with-input-rows`) and `op` (`upsert`, the default, or
//! `retire`). Lists may be fixed-size or variable (pandas and pyarrow write the latter), of float32
//! or float64 values (narrowed to f32, as conversion narrows a float64 checkpoint). A retirement
//! may leave its vectors null. Every problem is reported with the row it is in. [`write_delta`]
//! writes rows in that schema (fixed-size lists of float32, `op` spelled out).

use std::path::Path;

use recsys_engine::catalogue::{CatalogueDelta, ItemOp, ItemRow};
use recsys_engine::idmap::ExternalId;

use crate::error::{CliError, Result};

#[cfg(not(feature = "parquet"))]
pub fn read_delta(path: &Path) -> Result<CatalogueDelta> {
    Err(CliError::Usage(format!(
        "cannot read {}: this recsys was built without Parquet support (cargo feature \"parquet\")",
        path.display()
    )))
}

#[cfg(feature = "parquet")]
pub fn read_delta(path: &Path) -> Result<CatalogueDelta> {
    use arrow_array::cast::AsArray;
    use arrow_array::types::Int64Type;
    use arrow_array::Array;
    use arrow_schema::DataType;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    let bad =
        |reason: String| CliError::Input(format!("catalogue table {}: {reason}", path.display()));
    let file = std::fs::File::open(path).map_err(CliError::io(format!(
        "cannot open catalogue table {}",
        path.display()
    )))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| bad(format!("not a Parquet file ({e})")))?;
    let schema = builder.schema().clone();
    for required in ["item_id", "vector"] {
        if schema.field_with_name(required).is_err() {
            let columns: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            return Err(bad(format!(
                "no {required:?} column (columns: {}); the table is recsys export-items \
                 --format parquet's: item_id, vector [embedding, bias], optional input_vector \
                 and op",
                columns.join(", ")
            )));
        }
    }
    let reader = builder
        .with_batch_size(8192)
        .build()
        .map_err(|e| bad(e.to_string()))?;
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| bad(e.to_string()))?;
        let first = rows.len();
        let ids = batch.column_by_name("item_id").expect("checked above");
        let vectors = batch.column_by_name("vector").expect("checked above");
        let inputs = batch.column_by_name("input_vector");
        let ops = batch.column_by_name("op");
        for r in 0..batch.num_rows() {
            let at = first + r;
            if ids.is_null(r) {
                return Err(bad(format!("row {at}: item_id is null")));
            }
            let id = match ids.data_type() {
                DataType::Int64 => ExternalId::Int(ids.as_primitive::<Int64Type>().value(r)),
                DataType::Int32 => ExternalId::Int(i64::from(
                    ids.as_primitive::<arrow_array::types::Int32Type>().value(r),
                )),
                DataType::Utf8 => ExternalId::Str(ids.as_string::<i32>().value(r).to_string()),
                DataType::LargeUtf8 => ExternalId::Str(ids.as_string::<i64>().value(r).to_string()),
                other => {
                    return Err(bad(format!(
                        "item_id is {other}; it must be int64 or string"
                    )))
                }
            };
            let op = match ops {
                None => ItemOp::Upsert,
                Some(ops) if ops.is_null(r) || ops.data_type() == &DataType::Null => ItemOp::Upsert,
                Some(ops) => {
                    let text = match ops.data_type() {
                        DataType::Utf8 => ops.as_string::<i32>().value(r),
                        DataType::LargeUtf8 => ops.as_string::<i64>().value(r),
                        other => return Err(bad(format!("op is {other}; it must be a string"))),
                    };
                    text.parse::<ItemOp>()
                        .map_err(|e| bad(format!("row {at} (item {id}): {e}")))?
                }
            };
            let vector = floats_at(vectors, r)
                .map_err(|e| bad(format!("row {at} (item {id}): vector {e}")))?;
            let input_vector = match inputs {
                None => None,
                Some(inputs) => floats_at(inputs, r)
                    .map_err(|e| bad(format!("row {at} (item {id}): input_vector {e}")))?,
            };
            rows.push(ItemRow {
                id,
                op,
                vector,
                input_vector,
            });
        }
    }
    Ok(CatalogueDelta { version: 0, rows })
}

/// Row `r` of a list column of floats (`None` where it is null).
#[cfg(feature = "parquet")]
fn floats_at(
    column: &arrow_array::ArrayRef,
    r: usize,
) -> std::result::Result<Option<Vec<f32>>, String> {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Float32Type, Float64Type};
    use arrow_array::Array;
    use arrow_schema::DataType;

    // A column of nulls only (a writer that could not tell its type) is Arrow's null type.
    if column.is_null(r) || column.data_type() == &DataType::Null {
        return Ok(None);
    }
    let values = match column.data_type() {
        DataType::FixedSizeList(..) => column.as_fixed_size_list().value(r),
        DataType::List(_) => column.as_list::<i32>().value(r),
        DataType::LargeList(_) => column.as_list::<i64>().value(r),
        other => return Err(format!("is {other}; it must be a list of floats")),
    };
    if values.null_count() > 0 {
        return Err("holds a null value".into());
    }
    match values.data_type() {
        DataType::Float32 => Ok(Some(values.as_primitive::<Float32Type>().values().to_vec())),
        DataType::Float64 => Ok(Some(
            values
                .as_primitive::<Float64Type>()
                .values()
                .iter()
                .map(|&v| v as f32)
                .collect(),
        )),
        other => Err(format!(
            "holds {other} values; they must be float32 or float64"
        )),
    }
}

/// An id as a table spells it (no quotes around a string id).
pub fn id_text(id: &ExternalId) -> String {
    match id {
        ExternalId::Int(i) => i.to_string(),
        ExternalId::Str(s) => s.clone(),
    }
}

#[cfg(not(feature = "parquet"))]
pub fn write_delta(path: &Path, _: &[ItemRow]) -> Result<()> {
    Err(CliError::Usage(format!(
        "cannot write {}: this recsys was built without Parquet support (cargo feature \"parquet\")",
        path.display()
    )))
}

/// Writes `rows` (every one with a vector, all of one width, and input rows on all or none) as a
/// catalogue table at `path`, atomically.
#[cfg(feature = "parquet")]
pub fn write_delta(path: &Path, rows: &[ItemRow]) -> Result<()> {
    use arrow_array::builder::StringBuilder;
    use arrow_array::{ArrayRef, FixedSizeListArray, Float32Array, Int64Array, RecordBatch};
    use arrow_schema::{DataType, Field, Schema};
    use parquet::arrow::ArrowWriter;
    use std::sync::Arc;

    let bad =
        |reason: String| CliError::Input(format!("cannot write {}: {reason}", path.display()));
    let width = |v: Option<&Vec<f32>>| v.map_or(0, Vec::len);
    let vector_width = rows.first().map_or(0, |r| width(r.vector.as_ref()));
    let input_width = rows.first().map_or(0, |r| width(r.input_vector.as_ref()));
    if rows.iter().any(|r| {
        width(r.vector.as_ref()) != vector_width || width(r.input_vector.as_ref()) != input_width
    }) {
        return Err(bad("rows of different widths".into()));
    }
    let string_ids = rows.iter().any(|r| matches!(r.id, ExternalId::Str(_)));
    let value_field = Arc::new(Field::new("item", DataType::Float32, false));
    let list = |n: usize| -> Result<DataType> {
        let n = i32::try_from(n).map_err(|_| bad(format!("{n} values do not fit Arrow")))?;
        Ok(DataType::FixedSizeList(Arc::clone(&value_field), n))
    };
    let mut fields = vec![
        Field::new(
            "item_id",
            if string_ids {
                DataType::Utf8
            } else {
                DataType::Int64
            },
            false,
        ),
        Field::new("vector", list(vector_width)?, false),
    ];
    if input_width > 0 {
        fields.push(Field::new("input_vector", list(input_width)?, false));
    }
    fields.push(Field::new("op", DataType::Utf8, false));
    let schema = Arc::new(Schema::new(fields));
    let ids: ArrayRef = if string_ids {
        let mut builder = StringBuilder::new();
        for row in rows {
            builder.append_value(id_text(&row.id));
        }
        Arc::new(builder.finish())
    } else {
        Arc::new(Int64Array::from_iter_values(rows.iter().map(
            |r| match r.id {
                ExternalId::Int(i) => i,
                ExternalId::Str(_) => unreachable!("checked above"),
            },
        )))
    };
    let values = |pick: &dyn Fn(&ItemRow) -> Option<&Vec<f32>>, n: usize| -> Result<ArrayRef> {
        let flat: Vec<f32> = rows
            .iter()
            .flat_map(|r| pick(r).cloned().unwrap_or_default())
            .collect();
        let n = i32::try_from(n).map_err(|_| bad(format!("{n} values do not fit Arrow")))?;
        Ok(Arc::new(
            FixedSizeListArray::try_new(
                Arc::clone(&value_field),
                n,
                Arc::new(Float32Array::from(flat)),
                None,
            )
            .map_err(|e| bad(e.to_string()))?,
        ))
    };
    let mut arrays = vec![ids, values(&|r| r.vector.as_ref(), vector_width)?];
    if input_width > 0 {
        arrays.push(values(&|r| r.input_vector.as_ref(), input_width)?);
    }
    let mut ops = StringBuilder::new();
    for row in rows {
        ops.append_value(row.op.name());
    }
    arrays.push(Arc::new(ops.finish()));
    let batch =
        RecordBatch::try_new(Arc::clone(&schema), arrays).map_err(|e| bad(e.to_string()))?;
    crate::export_items::write_atomically(path, &mut |out| {
        let mut writer =
            ArrowWriter::try_new(out, Arc::clone(&schema), None).map_err(|e| bad(e.to_string()))?;
        writer.write(&batch).map_err(|e| bad(e.to_string()))?;
        writer.close().map_err(|e| bad(e.to_string()))?;
        Ok(())
    })
}
