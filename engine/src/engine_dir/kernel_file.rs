//! `kernels.bin`: the output layer already laid out for the kernels (and the int8 screen of a
//! screened engine), stored next to the weights so loading maps it instead of building an owned
//! copy: resident memory is the pages the kernels touch, shared by every instance and every loaded
//! version of the same file, and load time does not grow with the catalogue beyond the checksum.
//!
//! The file is a concatenation of sections, each starting at a multiple of 64 bytes (a cache line,
//! and every element type's alignment); the manifest's `kernel_layout` names each section's offset
//! and length, and the file's size and SHA-256 are in `files` like every other file. Engines
//! without it (written before it existed) pack at load, as they always did.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::manifest::{FileEntry, KernelLayout, Precision, Section};
use crate::error::{EngineError, Result};
use crate::kernels::packed::{PackedOutput, PanelData};
use crate::kernels::screen::ScreenTable;
use crate::kernels::shared::{Backing, Shared};

pub const KERNELS_FILE: &str = "kernels.bin";
/// The layout of the sections below; a reader refuses layouts it does not know. Version 2 stores
/// a screen's four per-item bound terms side by side in one section (`screen.bounds`); version 1
/// (one section per term) still loads.
pub const LAYOUT_VERSION: u32 = 2;
const ALIGN: u64 = 64;

/// The sections of a packed output layer under `prefix` ("output" or "screen").
fn output_sections<'a>(prefix: &str, packed: &'a PackedOutput) -> Vec<(String, &'a [u8])> {
    let mut out = vec![(format!("{prefix}.bias"), packed.bias.as_bytes())];
    match &packed.data {
        PanelData::F32(w) => out.push((format!("{prefix}.f32"), w.as_bytes())),
        PanelData::F16(w) => out.push((format!("{prefix}.f16"), w.as_bytes())),
        PanelData::Bf16(w) => out.push((format!("{prefix}.bf16"), w.as_bytes())),
        // Widened at load for CPUs without `vdpbf16ps` and only for dense layers: an engine's
        // file keeps the bf16 layout. Written under a name of its own, no reader takes it.
        PanelData::Bf16Wide(w) => out.push((format!("{prefix}.bf16wide"), w.as_bytes())),
        PanelData::I8 { q, scales } => {
            out.push((format!("{prefix}.i8"), q.as_bytes()));
            out.push((format!("{prefix}.scales"), scales.as_bytes()));
        }
    }
    out
}

/// Writes `dir/kernels.bin` for `packed` (and `screen`); returns its layout and file entry.
pub fn write(
    dir: &Path,
    packed: &PackedOutput,
    screen: Option<&ScreenTable>,
) -> Result<(KernelLayout, FileEntry)> {
    let mut sections = output_sections("output", packed);
    if let Some(screen) = screen {
        sections.extend(output_sections("screen", &screen.packed));
        sections.push(("screen.bounds".to_string(), screen.bound_terms().as_bytes()));
    }
    let path = dir.join(KERNELS_FILE);
    let io = |e| EngineError::io(format!("cannot write {}", path.display()), e);
    let mut file =
        std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&path).map_err(io)?);
    let mut hash = Sha256::new();
    let mut layout = BTreeMap::new();
    let mut at = 0u64;
    for (name, bytes) in sections {
        let pad = at.next_multiple_of(ALIGN) - at;
        let zeros = vec![0u8; pad as usize];
        file.write_all(&zeros).map_err(io)?;
        hash.update(&zeros);
        at += pad;
        file.write_all(bytes).map_err(io)?;
        hash.update(bytes);
        layout.insert(
            name,
            Section {
                offset: at,
                bytes: bytes.len() as u64,
            },
        );
        at += bytes.len() as u64;
    }
    file.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)?;
    Ok((
        KernelLayout {
            layout_version: LAYOUT_VERSION,
            sections: layout,
        },
        FileEntry {
            bytes: at,
            sha256: hex::encode(hash.finalize()),
        },
    ))
}

/// Reads sections of a mapped kernels file, checking each against the shape it must have.
struct Reader<'a> {
    backing: &'a Backing,
    layout: &'a KernelLayout,
}

impl Reader<'_> {
    fn section<T: bytemuck::Pod>(
        &self,
        name: &str,
        len: usize,
    ) -> std::result::Result<Shared<T>, String> {
        let section = self
            .layout
            .sections
            .get(name)
            .ok_or_else(|| format!("{KERNELS_FILE} has no section {name}"))?;
        let size = std::mem::size_of::<T>() as u64;
        if section.bytes != len as u64 * size {
            return Err(format!(
                "{KERNELS_FILE} section {name} holds {} bytes; the model needs {len} values of {size} bytes",
                section.bytes
            ));
        }
        Shared::mapped(self.backing.clone(), section.offset as usize, len)
            .map_err(|e| format!("{KERNELS_FILE} section {name}: {e}"))
    }

    fn output(
        &self,
        prefix: &str,
        n: usize,
        d: usize,
        precision: Precision,
    ) -> std::result::Result<PackedOutput, String> {
        let panels = n.div_ceil(8);
        let data = match precision {
            Precision::Fp32 => {
                PanelData::F32(self.section(&format!("{prefix}.f32"), panels * d * 8)?)
            }
            Precision::Fp16 => {
                PanelData::F16(self.section(&format!("{prefix}.f16"), panels * d * 8)?)
            }
            Precision::Bf16 => PanelData::Bf16(
                self.section(&format!("{prefix}.bf16"), panels * d.div_ceil(2) * 16)?,
            ),
            Precision::Int8 => PanelData::I8 {
                q: self.section(&format!("{prefix}.i8"), panels * d.div_ceil(2) * 16)?,
                scales: self.section(&format!("{prefix}.scales"), panels * 8)?,
            },
        };
        Ok(PackedOutput {
            n,
            d,
            data,
            bias: self.section(&format!("{prefix}.bias"), panels * 8)?,
            activation_scale: None,
        })
    }
}

fn check_version(layout: &KernelLayout) -> std::result::Result<(), String> {
    if !(1..=LAYOUT_VERSION).contains(&layout.layout_version) {
        return Err(format!(
            "kernel layout version {} is not supported by this recsys (it reads versions 1 to \
             {LAYOUT_VERSION}); re-convert the model with this version",
            layout.layout_version
        ));
    }
    Ok(())
}

/// The output layer of `n` items of width `d` at `precision`, mapped from the kernels file.
pub fn map_output(
    backing: &Backing,
    layout: &KernelLayout,
    n: usize,
    d: usize,
    precision: Precision,
) -> std::result::Result<PackedOutput, String> {
    check_version(layout)?;
    Reader { backing, layout }.output("output", n, d, precision)
}

/// The int8 screen of `n` items of width `d`, mapped from the kernels file.
pub fn map_screen(
    backing: &Backing,
    layout: &KernelLayout,
    n: usize,
    d: usize,
) -> std::result::Result<ScreenTable, String> {
    check_version(layout)?;
    let reader = Reader { backing, layout };
    let packed = reader.output("screen", n, d, Precision::Int8)?;
    if layout.layout_version >= 2 {
        return Ok(ScreenTable::from_parts(
            packed,
            reader.section::<[f32; 4]>("screen.bounds", n)?,
        ));
    }
    // Layout 1 stored each bound term in a section of its own; they are read side by side, so
    // they are interleaved into memory (16 bytes per item) as the table is built.
    let term = |name: &str| reader.section::<f32>(&format!("screen.{name}"), n);
    let columns = [
        term("weight_error")?,
        term("scaled_q_l1")?,
        term("max_weight")?,
        term("abs_bias")?,
    ];
    let interleaved: Vec<[f32; 4]> = (0..n)
        .map(|i| std::array::from_fn(|t| columns[t][i]))
        .collect();
    Ok(ScreenTable::from_parts(packed, interleaved.into()))
}
