//! Reads a catalogue delta from a Parquet table in the schema `recsys export-items --format
//! parquet` writes: `item_id` (int64 or string), `vector` (`[embedding, bias]`), and optionally
//! `input_vector` (the item's input row, `--with-input-rows`) and `op` (`upsert`, the default, or
//! `retire`). Lists may be fixed-size or variable (pandas and pyarrow write the latter), of float32
//! or float64 values (narrowed to f32, as conversion narrows a float64 checkpoint). A retirement
//! may leave its vectors null. Every problem is reported with the row it is in.

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
