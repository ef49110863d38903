//! Reading trained checkpoints: safetensors, PyTorch `torch.save` zip archives and RecBole
//! checkpoints, and the item list of a dataset RecBole saved. Nothing in a checkpoint or a saved
//! dataset is executed (see [`pickle`]).

pub mod pickle;
pub mod recbole_dataset;
mod torch_zip;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::error::{EngineError, Result};
use crate::tensor::Tensor;

/// Element types a checkpoint tensor may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementType {
    F32,
    F64,
    F16,
    BF16,
    /// Any other element type (integers, bools, ...): kept so that an unused buffer does not stop the
    /// import, refused if a model asks for it as a weight.
    Other(&'static str, usize),
}

impl ElementType {
    pub fn size(self) -> usize {
        match self {
            ElementType::F32 => 4,
            ElementType::F64 => 8,
            ElementType::F16 | ElementType::BF16 => 2,
            ElementType::Other(_, size) => size,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ElementType::F32 => "F32",
            ElementType::F64 => "F64",
            ElementType::F16 => "F16",
            ElementType::BF16 => "BF16",
            ElementType::Other(name, _) => name,
        }
    }
}

/// A tensor as stored in the checkpoint: contiguous little-endian bytes of `dtype`.
#[derive(Clone, Debug)]
pub struct CheckpointTensor {
    pub dtype: ElementType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointFormat {
    Safetensors,
    /// `torch.save(model.state_dict())`.
    TorchStateDict,
    /// RecBole's trainer checkpoint: a dict with `state_dict` and a pickled `Config`.
    Recbole,
}

/// The tensors of a checkpoint, plus the hyper-parameters a RecBole checkpoint carries.
#[derive(Debug)]
pub struct Checkpoint {
    pub format: CheckpointFormat,
    pub tensors: BTreeMap<String, CheckpointTensor>,
    /// RecBole's `final_config_dict`, with every plain value (numbers, strings, lists) kept.
    pub embedded_config: Option<serde_json::Map<String, serde_json::Value>>,
    /// SHA-256 of the checkpoint file, recorded in the engine manifest.
    pub sha256: String,
}

/// Largest checkpoint file read by default (it is read into memory whole): 16 GiB.
pub const DEFAULT_MAX_CHECKPOINT_BYTES: u64 = 16 << 30;

impl Checkpoint {
    /// Reads a checkpoint, choosing the reader from the file's magic bytes rather than its name;
    /// files over [`DEFAULT_MAX_CHECKPOINT_BYTES`] are refused.
    pub fn load(path: &Path) -> Result<Checkpoint> {
        Checkpoint::load_limited(path, DEFAULT_MAX_CHECKPOINT_BYTES)
    }

    /// [`Checkpoint::load`] with an explicit size limit, checked before anything is read.
    pub fn load_limited(path: &Path, max_bytes: u64) -> Result<Checkpoint> {
        let mut file = EngineError::open(path)?;
        let size = file
            .metadata()
            .map_err(|e| EngineError::io(format!("cannot stat {}", path.display()), e))?
            .len();
        if size > max_bytes {
            return Err(EngineError::checkpoint(
                path,
                format!(
                    "the file is {size} bytes, more than the limit of {max_bytes} \
                     (raise it with --max-checkpoint-bytes if the file is trusted)"
                ),
            ));
        }
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(|e| EngineError::io(format!("cannot read {}", path.display()), e))?;
        Checkpoint::from_bytes(path, &bytes)
    }

    /// Parses checkpoint bytes (`path` only names the file in messages). Nothing in them is run.
    /// A state dict saved from a data-parallel wrapper (every name prefixed `module.`, as
    /// `DistributedDataParallel` saves it) is read under the model's own names.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Checkpoint> {
        let mut checkpoint = Checkpoint::parse(path, bytes)?;
        checkpoint.tensors = without_data_parallel_prefix(std::mem::take(&mut checkpoint.tensors));
        Ok(checkpoint)
    }

    fn parse(path: &Path, bytes: &[u8]) -> Result<Checkpoint> {
        let sha256 = hex::encode(Sha256::digest(bytes));
        if bytes.starts_with(b"PK\x03\x04") {
            let (format, tensors, embedded_config) = torch_zip::read(path, bytes)?;
            Ok(Checkpoint {
                format,
                tensors,
                embedded_config,
                sha256,
            })
        } else if bytes.len() >= 9 && bytes[8] == b'{' {
            Ok(Checkpoint {
                format: CheckpointFormat::Safetensors,
                tensors: read_safetensors(path, bytes)?,
                embedded_config: None,
                sha256,
            })
        } else if bytes.first() == Some(&0x80) {
            Err(EngineError::checkpoint(
                path,
                "this is a legacy (pre-1.6, non-zip) PyTorch file; re-save it with a current \
                 torch.save or export it to safetensors",
            ))
        } else {
            Err(EngineError::checkpoint(
                path,
                "not a safetensors file or a PyTorch zip archive (unrecognised first bytes)",
            ))
        }
    }

    /// The tensor `name` as f32, checked against the shape the model expects and for finiteness.
    pub fn tensor_f32(&self, name: &str, expected: &[usize]) -> Result<Tensor> {
        let raw = self
            .tensors
            .get(name)
            .ok_or_else(|| EngineError::MissingTensor { name: name.into() })?;
        if raw.shape != expected {
            return Err(EngineError::ShapeMismatch {
                name: name.into(),
                expected: expected.to_vec(),
                found: raw.shape.clone(),
            });
        }
        let values = to_f32(name, raw)?;
        if let Some(index) = values.iter().position(|v| !v.is_finite()) {
            return Err(EngineError::NonFiniteWeight {
                name: name.into(),
                index,
            });
        }
        Ok(Tensor::from_vec(expected.to_vec(), values))
    }

    /// The shape of `name`, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|t| t.shape.as_slice())
    }

    /// Like [`Checkpoint::shape`], but a missing tensor is an error naming it.
    pub fn require_shape(&self, name: &str) -> Result<&[usize]> {
        self.shape(name)
            .ok_or_else(|| EngineError::MissingTensor { name: name.into() })
    }
}

/// The tensors under their names without `module.` when every name has it.
fn without_data_parallel_prefix(
    tensors: BTreeMap<String, CheckpointTensor>,
) -> BTreeMap<String, CheckpointTensor> {
    const PREFIX: &str = "module.";
    if tensors.is_empty() || !tensors.keys().all(|k| k.starts_with(PREFIX)) {
        return tensors;
    }
    tensors
        .into_iter()
        .map(|(k, v)| (k[PREFIX.len()..].to_string(), v))
        .collect()
}

fn to_f32(name: &str, raw: &CheckpointTensor) -> Result<Vec<f32>> {
    let b = &raw.bytes;
    Ok(match raw.dtype {
        ElementType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect(),
        ElementType::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
            .collect(),
        ElementType::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        ElementType::BF16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        ElementType::Other(dtype, _) => {
            return Err(EngineError::UnsupportedDtype {
                name: name.into(),
                dtype: dtype.into(),
            })
        }
    })
}

fn read_safetensors(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, CheckpointTensor>> {
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| EngineError::checkpoint(path, format!("invalid safetensors file: {e}")))?;
    let mut tensors = BTreeMap::new();
    for (name, view) in st.tensors() {
        use safetensors::Dtype as S;
        let dtype = match view.dtype() {
            S::F32 => ElementType::F32,
            S::F64 => ElementType::F64,
            S::F16 => ElementType::F16,
            S::BF16 => ElementType::BF16,
            S::I64 => ElementType::Other("I64", 8),
            S::I32 => ElementType::Other("I32", 4),
            S::I16 => ElementType::Other("I16", 2),
            S::I8 => ElementType::Other("I8", 1),
            S::U8 => ElementType::Other("U8", 1),
            S::BOOL => ElementType::Other("BOOL", 1),
            _ => ElementType::Other("unknown", 1),
        };
        tensors.insert(
            name,
            CheckpointTensor {
                dtype,
                shape: view.shape().to_vec(),
                bytes: view.data().to_vec(),
            },
        );
    }
    Ok(tensors)
}
