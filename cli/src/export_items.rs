//! `recsys export-items`: the output layer's item table for an ANN index (FAISS, Milvus, ScaNN).
//!
//! Row `r` is item `r + 1` of the catalogue as `[embedding (d values), bias]`, in f32; the ids file
//! holds its external id on line `r + 1`. With a user's final hidden vector `h` extended by a
//! trailing 1, `[h, 1] . row` is the model's score for that item, so an inner-product index over
//! the rows returns the model's ranking. The rows are the engine's stored weights widened to f32:
//! exact for fp32 and fp16 engines; an int8 engine's own scores also quantize `h`, so theirs can
//! differ from the inner product by that rounding.

use crate::output::say;
use std::io::Write;
use std::path::{Path, PathBuf};

use recsys_engine::{Engine, ExternalId};

use crate::cli::{ExportItemsArgs, ItemTableFormat};
use crate::error::{CliError, Result};

/// The header of a NumPy `.npy` file (format 1.0) for a C-order little-endian f32 array of
/// `shape`, padded so the data starts on a 64-byte boundary as the format asks.
fn npy_header(shape: (usize, usize)) -> Vec<u8> {
    let dict = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}",
        shape.0, shape.1
    );
    let unpadded = 6 + 2 + 2 + dict.len() + 1;
    let padding = unpadded.div_ceil(64) * 64 - unpadded;
    let header_len = (dict.len() + padding + 1) as u16;
    let mut out = Vec::with_capacity(unpadded + padding);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&header_len.to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out.extend(std::iter::repeat_n(b' ', padding));
    out.push(b'\n');
    out
}

/// The paths written for `--output FILE`: FILE.npy with FILE.ids.txt beside it, and FILE.parquet
/// (a trailing `.npy` or `.parquet` on FILE is its own).
pub struct OutputPaths {
    pub npy: PathBuf,
    pub ids: PathBuf,
    pub parquet: PathBuf,
}

pub fn output_paths(output: &Path) -> OutputPaths {
    let stem = if output
        .extension()
        .is_some_and(|e| e == "npy" || e == "parquet")
    {
        output.with_extension("")
    } else {
        output.to_path_buf()
    };
    let with = |ext: &str| {
        let mut name = stem.clone().into_os_string();
        name.push(ext);
        PathBuf::from(name)
    };
    OutputPaths {
        npy: with(".npy"),
        ids: with(".ids.txt"),
        parquet: with(".parquet"),
    }
}

/// The item table of a loaded engine, row by row.
struct ItemTable<'a> {
    engine: &'a Engine,
    /// Items (the catalogue without PAD).
    rows: usize,
    /// Values per row: the embedding's d, then the bias.
    columns: usize,
    /// Values per input row, when the table carries them (`--with-input-rows`).
    input_columns: Option<usize>,
}

impl<'a> ItemTable<'a> {
    fn new(engine: &'a Engine, with_input_rows: bool) -> Self {
        let output = engine.model.output();
        ItemTable {
            engine,
            rows: output.n_outputs() - 1,
            columns: output.input_size() + 1,
            input_columns: with_input_rows.then(|| engine.model.input_rows().cols()),
        }
    }

    /// Item `r + 1`'s input row into `row` (`input_columns` long).
    fn input_row_into(&self, r: usize, row: &mut [f32]) {
        row.iter_mut().for_each(|v| *v = 0.0);
        self.engine.model.input_rows().add_row_into(r + 1, row);
    }

    /// Row `r` (item `r + 1`: item 0 is PAD, never an item) into `row` (`columns` long).
    fn row_into(&self, r: usize, row: &mut [f32]) {
        let output = self.engine.model.output();
        let (embedding, bias) = row.split_at_mut(self.columns - 1);
        embedding.iter_mut().for_each(|v| *v = 0.0);
        output.weight.add_row_into(r + 1, embedding);
        bias[0] = output.bias.as_slice()[r + 1];
    }

    fn external_id(&self, r: usize) -> ExternalId {
        self.engine
            .external_id(r as u32 + 1)
            .expect("1..=N are the catalogue's indices")
    }
}

/// Writes `path` through a temporary file moved into place, so a reader never sees half a file.
pub(crate) fn write_atomically(
    path: &Path,
    bytes: &mut dyn FnMut(&mut (dyn Write + Send)) -> std::result::Result<(), CliError>,
) -> Result<()> {
    let tmp = path.with_extension("partial");
    let file = std::fs::File::create(&tmp)
        .map_err(CliError::io(format!("cannot create {}", tmp.display())))?;
    let mut out = std::io::BufWriter::new(file);
    let written = bytes(&mut out).and_then(|_| {
        out.flush()
            .map_err(CliError::io(format!("cannot write {}", tmp.display())))
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(CliError::io(format!(
        "cannot move {} into place",
        path.display()
    )))
}

fn write_npy(table: &ItemTable<'_>, path: &Path) -> Result<()> {
    write_atomically(path, &mut |out| {
        let io = |source| CliError::Io {
            context: format!("cannot write {}", path.display()),
            source,
        };
        out.write_all(&npy_header((table.rows, table.columns)))
            .map_err(&io)?;
        let mut row = vec![0f32; table.columns];
        for r in 0..table.rows {
            table.row_into(r, &mut row);
            for v in &row {
                out.write_all(&v.to_le_bytes()).map_err(&io)?;
            }
        }
        Ok(())
    })
}

fn write_ids(table: &ItemTable<'_>, path: &Path) -> Result<()> {
    write_atomically(path, &mut |out| {
        let io = |source| CliError::Io {
            context: format!("cannot write {}", path.display()),
            source,
        };
        for r in 0..table.rows {
            match table.external_id(r) {
                ExternalId::Int(id) => writeln!(out, "{id}"),
                ExternalId::Str(id) => writeln!(out, "{id}"),
            }
            .map_err(&io)?;
        }
        Ok(())
    })
}

#[cfg(feature = "parquet")]
/// Rows per Parquet row group: about 64 MiB of vectors, so memory stays bounded at any catalogue
/// size while readers still get large, well-compressed groups.
fn rows_per_group(columns: usize) -> usize {
    ((64 << 20) / (4 * columns)).clamp(1024, 1 << 20)
}

#[cfg(not(feature = "parquet"))]
fn write_parquet(_: &ItemTable<'_>, _: &Path, _: &str) -> Result<()> {
    Err(CliError::Usage(
        "this recsys was built without Parquet support (cargo feature \"parquet\"); use --format npy"
            .into(),
    ))
}

#[cfg(feature = "parquet")]
fn write_parquet(table: &ItemTable<'_>, path: &Path, precision: &str) -> Result<()> {
    use arrow_array::builder::StringBuilder;
    use arrow_array::{ArrayRef, FixedSizeListArray, Float32Array, Int64Array, RecordBatch};
    use arrow_schema::{DataType, Field, Schema};
    use parquet::arrow::ArrowWriter;
    use parquet::basic::Compression;
    use parquet::file::properties::WriterProperties;
    use std::sync::Arc;

    let string_ids = matches!(table.external_id(0), ExternalId::Str(_));
    let id_type = if string_ids {
        DataType::Utf8
    } else {
        DataType::Int64
    };
    let value_field = Arc::new(Field::new("item", DataType::Float32, false));
    let columns = i32::try_from(table.columns)
        .map_err(|_| CliError::Input(format!("{} columns do not fit Arrow", table.columns)))?;
    // Said in the schema, which every Arrow reader shows: what the vector holds.
    let metadata = [
        (
            "recsys.vector".to_string(),
            format!(
                "[embedding ({} values), bias]: [h, 1] . vector is the model's score",
                table.columns - 1
            ),
        ),
        ("recsys.precision".to_string(), precision.to_string()),
    ];
    let input_columns = table
        .input_columns
        .map(|c| {
            i32::try_from(c)
                .map_err(|_| CliError::Input(format!("{c} input columns do not fit Arrow")))
        })
        .transpose()?;
    let mut fields = vec![
        Field::new("item_id", id_type, false),
        Field::new(
            "vector",
            DataType::FixedSizeList(Arc::clone(&value_field), columns),
            false,
        ),
    ];
    if let Some(input_columns) = input_columns {
        fields.push(Field::new(
            "input_vector",
            DataType::FixedSizeList(Arc::clone(&value_field), input_columns),
            false,
        ));
    }
    let schema = Arc::new(
        Schema::new(fields).with_metadata(
            metadata
                .into_iter()
                .collect::<std::collections::HashMap<_, _>>(),
        ),
    );
    let properties = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(rows_per_group(table.columns)))
        .build();
    let parquet_error = |e: parquet::errors::ParquetError| {
        CliError::Input(format!("cannot write {}: {e}", path.display()))
    };
    let arrow_error = |e: arrow_schema::ArrowError| {
        CliError::Input(format!("cannot write {}: {e}", path.display()))
    };
    write_atomically(path, &mut |out| {
        let mut writer = ArrowWriter::try_new(out, Arc::clone(&schema), Some(properties.clone()))
            .map_err(parquet_error)?;
        let group = rows_per_group(table.columns);
        let mut row = vec![0f32; table.columns];
        for start in (0..table.rows).step_by(group) {
            let end = (start + group).min(table.rows);
            let mut values = Vec::with_capacity((end - start) * table.columns);
            for r in start..end {
                table.row_into(r, &mut row);
                values.extend_from_slice(&row);
            }
            let ids: ArrayRef = if string_ids {
                let mut builder = StringBuilder::new();
                for r in start..end {
                    match table.external_id(r) {
                        ExternalId::Str(id) => builder.append_value(id),
                        ExternalId::Int(id) => builder.append_value(id.to_string()),
                    }
                }
                Arc::new(builder.finish()) as ArrayRef
            } else {
                Arc::new(Int64Array::from_iter_values((start..end).map(|r| {
                    match table.external_id(r) {
                        ExternalId::Int(id) => id,
                        ExternalId::Str(_) => unreachable!("one id type per catalogue"),
                    }
                })))
            };
            let vectors = FixedSizeListArray::try_new(
                Arc::clone(&value_field),
                columns,
                Arc::new(Float32Array::from(values)),
                None,
            )
            .map_err(arrow_error)?;
            let mut arrays: Vec<ArrayRef> = vec![ids, Arc::new(vectors)];
            if let (Some(width), Some(input_columns)) = (table.input_columns, input_columns) {
                let mut input = vec![0f32; width];
                let mut values = Vec::with_capacity((end - start) * width);
                for r in start..end {
                    table.input_row_into(r, &mut input);
                    values.extend_from_slice(&input);
                }
                arrays.push(Arc::new(
                    FixedSizeListArray::try_new(
                        Arc::clone(&value_field),
                        input_columns,
                        Arc::new(Float32Array::from(values)),
                        None,
                    )
                    .map_err(arrow_error)?,
                ));
            }
            let batch = RecordBatch::try_new(Arc::clone(&schema), arrays).map_err(arrow_error)?;
            writer.write(&batch).map_err(parquet_error)?;
        }
        writer.close().map_err(parquet_error)?;
        Ok(())
    })
}

pub fn run(args: &ExportItemsArgs) -> Result<i32> {
    let paths = output_paths(&args.output);
    let (npy, parquet) = match args.format {
        ItemTableFormat::Npy => (true, false),
        ItemTableFormat::Parquet => (false, true),
        ItemTableFormat::Both => (true, true),
    };
    let mut targets: Vec<&Path> = Vec::new();
    if npy {
        targets.extend([paths.npy.as_path(), paths.ids.as_path()]);
    }
    if parquet {
        targets.push(&paths.parquet);
    }
    if args.with_input_rows && !parquet {
        return Err(CliError::Usage(
            "--with-input-rows adds the input_vector column of the Parquet table; pass --format \
             parquet (or both)"
                .into(),
        ));
    }
    for path in &targets {
        if path.exists() && !args.force {
            return Err(CliError::Usage(format!(
                "{} already exists; pass --force to replace it",
                path.display()
            )));
        }
    }
    let engine = Engine::load(&args.engine)?;
    let table = ItemTable::new(&engine, args.with_input_rows);
    let precision = serde_json::to_value(engine.manifest.precision)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    if npy {
        write_npy(&table, &paths.npy)?;
        write_ids(&table, &paths.ids)?;
    }
    if parquet {
        write_parquet(&table, &paths.parquet, &precision)?;
    }
    let summary = serde_json::json!({
        "table": npy.then_some(&paths.npy),
        "ids": npy.then_some(&paths.ids),
        "parquet": parquet.then_some(&paths.parquet),
        "items": table.rows,
        "columns": table.columns,
        "input_columns": table.input_columns,
        "precision": engine.manifest.precision,
    });
    if args.json {
        say!("{summary}");
    } else {
        let written: Vec<String> = targets.iter().map(|p| p.display().to_string()).collect();
        say!(
            "wrote {} ({} items x {} columns: embedding, bias; external ids in item order)",
            written.join(", "),
            table.rows,
            table.columns,
        );
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_headers_are_64_byte_aligned_and_well_formed() {
        for shape in [(1, 1), (2000, 65), (1_000_000, 601)] {
            let h = npy_header(shape);
            assert_eq!(h.len() % 64, 0, "{shape:?}");
            assert_eq!(&h[..8], b"\x93NUMPY\x01\x00");
            assert_eq!(u16::from_le_bytes([h[8], h[9]]) as usize, h.len() - 10);
            assert_eq!(*h.last().unwrap(), b'\n');
            let text = std::str::from_utf8(&h[10..]).unwrap();
            assert!(
                text.contains(&format!("'shape': ({}, {})", shape.0, shape.1)),
                "{text}"
            );
        }
    }

    #[test]
    fn output_paths_share_one_stem() {
        let paths = output_paths(Path::new("out/items"));
        assert_eq!(
            (
                paths.npy.to_str(),
                paths.ids.to_str(),
                paths.parquet.to_str()
            ),
            (
                Some("out/items.npy"),
                Some("out/items.ids.txt"),
                Some("out/items.parquet")
            )
        );
        for given in ["items.npy", "items.parquet"] {
            let paths = output_paths(Path::new(given));
            assert_eq!(paths.npy.to_str(), Some("items.npy"));
            assert_eq!(paths.parquet.to_str(), Some("items.parquet"));
        }
        // A dot inside the name is not an extension to replace.
        assert_eq!(
            output_paths(Path::new("v1.2")).parquet.to_str(),
            Some("v1.2.parquet")
        );
    }
}
