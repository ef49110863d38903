//! `recsys export-items`: the output layer's item table for an ANN index (FAISS, Milvus, ScaNN).
//!
//! Row `r` is item `r + 1` of the catalogue as `[embedding (d values), bias]`, in f32; the ids file
//! holds its external id on line `r + 1`. With a user's final hidden vector `h` extended by a
//! trailing 1, `[h, 1] . row` is the model's score for that item, so an inner-product index over
//! the rows returns the model's ranking. The rows are the engine's stored weights widened to f32:
//! exact for fp32 and fp16 engines; an int8 engine's own scores also quantize `h`, so theirs can
//! differ from the inner product by that rounding.

use std::io::Write;
use std::path::{Path, PathBuf};

use recsys_engine::{Engine, ExternalId};

use crate::cli::ExportItemsArgs;
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

/// The paths written for `--output FILE`: FILE (made to end in .npy) and its ids file beside it.
pub fn output_paths(output: &Path) -> (PathBuf, PathBuf) {
    let npy = if output.extension().is_some_and(|e| e == "npy") {
        output.to_path_buf()
    } else {
        output.with_extension("npy")
    };
    let ids = npy.with_extension("ids.txt");
    (npy, ids)
}

pub fn run(args: &ExportItemsArgs) -> Result<i32> {
    let (npy, ids_path) = output_paths(&args.output);
    for path in [&npy, &ids_path] {
        if path.exists() && !args.force {
            return Err(CliError::Usage(format!(
                "{} already exists; pass --force to replace it",
                path.display()
            )));
        }
    }
    let engine = Engine::load(&args.engine)?;
    let output = engine.model.output();
    let (rows, d) = (output.n_outputs() - 1, output.input_size());
    let bias = output.bias.as_slice();

    let write = |path: &Path, bytes: &mut dyn FnMut(&mut dyn Write) -> std::io::Result<()>| {
        let tmp = path.with_extension("partial");
        let file = std::fs::File::create(&tmp)
            .map_err(CliError::io(format!("cannot create {}", tmp.display())))?;
        let mut out = std::io::BufWriter::new(file);
        bytes(&mut out)
            .and_then(|_| out.flush())
            .map_err(CliError::io(format!("cannot write {}", tmp.display())))?;
        std::fs::rename(&tmp, path).map_err(CliError::io(format!(
            "cannot move {} into place",
            path.display()
        )))
    };
    write(&npy, &mut |out| {
        out.write_all(&npy_header((rows, d + 1)))?;
        let mut row = vec![0f32; d];
        // Item 0 is PAD, never an item: the table starts at 1.
        for (item, item_bias) in bias.iter().enumerate().skip(1) {
            row.iter_mut().for_each(|v| *v = 0.0);
            output.weight.add_row_into(item, &mut row);
            for v in row.iter().chain(std::iter::once(item_bias)) {
                out.write_all(&v.to_le_bytes())?;
            }
        }
        Ok(())
    })?;
    write(&ids_path, &mut |out| {
        for item in 1..=rows {
            match engine.external_id(item as u32) {
                Some(ExternalId::Int(id)) => writeln!(out, "{id}")?,
                Some(ExternalId::Str(id)) => writeln!(out, "{id}")?,
                None => unreachable!("1..=N are the catalogue's indices"),
            }
        }
        Ok(())
    })?;
    let summary = serde_json::json!({
        "table": npy,
        "ids": ids_path,
        "items": rows,
        "columns": d + 1,
        "precision": engine.manifest.precision,
    });
    if args.json {
        println!("{summary}");
    } else {
        println!(
            "wrote {} ({} items x {} columns: embedding, bias) and {} (external ids, one per row)",
            npy.display(),
            rows,
            d + 1,
            ids_path.display()
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
    fn output_paths_end_in_npy_with_the_ids_beside() {
        let (npy, ids) = output_paths(Path::new("out/items"));
        assert_eq!(
            (npy.to_str(), ids.to_str()),
            (Some("out/items.npy"), Some("out/items.ids.txt"))
        );
        let (npy, _) = output_paths(Path::new("items.npy"));
        assert_eq!(npy.to_str(), Some("items.npy"));
    }
}
