//! A live catalogue: items added, replaced and retired on a converted engine between its versions.
//!
//! A [`CatalogueDelta`] holds every change since the engine was converted (each publish carries
//! them all, so one delta is the catalogue's whole state, never a change on top of another), and
//! [`apply`] builds from the engine's stored tensors what conversion would have stored with those
//! rows:
//! - an upserted item the engine lacks is appended (indices N+1, N+2, ... in the delta's order), so
//!   every index the engine had stays where it was, and with it the item sets, the popularity
//!   counts and every mask over them;
//! - an upserted item the engine has gets its rows replaced;
//! - a retired item keeps its rows (a history that holds it still reads its input row: the user
//!   did click it) and leaves every answer through the engine's filters
//!   ([`crate::filters::Filters::retiring`]).
//!
//! Rows are stored at the engine's precision by conversion's own rules (fp16 and bf16 rounded to
//! nearest even, int8 per row with the row's own scale), so a delta row is quantized as the same
//! row converted would be; the model, its packed output layer and its screen are then built from
//! the edited tensors as loading builds them. An engine with a delta therefore answers as the
//! engine converted with those rows, up to the order of exact ties (a new item's index is after
//! every item the engine had).

use std::collections::HashMap;

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::idmap::{ExternalId, IdMap, IdType};
use crate::kernels::packed::{quantize_int8_per_row, to_bf16_bits, to_f16_bits};
use crate::models::{ItemTensors, Model};
use crate::tensor::Tensor;
use crate::weights::{scale_name, RawTensor, Weights};

/// What a delta row does to its item.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ItemOp {
    /// Adds the item, or replaces its rows.
    #[default]
    Upsert,
    /// Never returns the item again; histories that hold it still read its input row. A row that
    /// carries vectors also sets the item's rows, as an upsert does.
    Retire,
}

impl ItemOp {
    /// The name the `op` column holds.
    pub fn name(self) -> &'static str {
        match self {
            ItemOp::Upsert => "upsert",
            ItemOp::Retire => "retire",
        }
    }
}

impl std::str::FromStr for ItemOp {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, String> {
        match text {
            "upsert" | "" => Ok(ItemOp::Upsert),
            "retire" => Ok(ItemOp::Retire),
            other => Err(format!("op {other:?} is neither \"upsert\" nor \"retire\"")),
        }
    }
}

/// One item's change.
#[derive(Clone, Debug, PartialEq)]
pub struct ItemRow {
    pub id: ExternalId,
    pub op: ItemOp,
    /// `[output embedding (d values), bias]`, the layout `recsys export-items` writes. Required
    /// for an upsert; a retirement may leave it out (the item keeps its rows).
    pub vector: Option<Vec<f32>>,
    /// The item's input row, for a model whose input and output rows differ (Mult-VAE's first
    /// encoder layer: required there for a new item). A model that ties the two takes it from
    /// `vector` and refuses a different one.
    pub input_vector: Option<Vec<f32>>,
}

/// Every change to an engine's catalogue since it was converted.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CatalogueDelta {
    /// Counts up from 1 with each publish (0: a table never published).
    pub version: u64,
    pub rows: Vec<ItemRow>,
}

/// What the catalogue in force changed on the engine as converted.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CatalogueSummary {
    pub version: u64,
    /// Items of the engine as converted.
    pub base_items: usize,
    /// Rows of the delta.
    pub delta_items: usize,
    pub added: usize,
    pub replaced: usize,
    pub retired: usize,
}

/// An engine's tensors, ids and config with a delta applied.
pub(crate) struct Applied {
    pub config: ModelConfig,
    pub weights: Weights,
    pub ids: IdMap,
    /// Internal indices of the retired items, ascending.
    pub retired: Vec<u32>,
    /// Internal indices of the converted items the delta upserts, ascending: an item a compacted
    /// engine keeps retired is offered again when a later delta upserts it.
    pub upserted: Vec<u32>,
    /// Internal indices of the converted items whose input row the delta replaces, ascending:
    /// the states a prefix cache holds for histories with them are no longer the model's.
    pub changed_inputs: Vec<u32>,
    pub summary: CatalogueSummary,
}

/// One row of an edited item table: the stored row it keeps, or new values.
#[derive(Clone, Copy)]
enum NewRow<'a> {
    Kept(usize),
    Values(&'a [f32]),
}

fn refused(reason: String) -> EngineError {
    EngineError::Catalogue(reason)
}

/// `id` as the catalogue's id type: digits name an item of an int64 catalogue, and an integer
/// names a string catalogue's item by its decimal text.
fn normalized(id: &ExternalId, id_type: IdType) -> Result<ExternalId> {
    match (id, id_type) {
        (ExternalId::Int(_), IdType::Int64) | (ExternalId::Str(_), IdType::String) => {
            Ok(id.clone())
        }
        (ExternalId::Int(i), IdType::String) => Ok(ExternalId::Str(i.to_string())),
        (ExternalId::Str(s), IdType::Int64) => {
            s.parse::<i64>().map(ExternalId::Int).map_err(|_| {
                refused(format!(
                    "item id {s:?} is not an integer; this engine's item ids are int64"
                ))
            })
        }
    }
}

fn check_values(id: &ExternalId, column: &str, values: &[f32], expected: usize) -> Result<()> {
    if values.len() != expected {
        return Err(refused(format!(
            "item {id}: {column} holds {} values, the engine's rows take {expected}",
            values.len()
        )));
    }
    if let Some(at) = values.iter().position(|v| !v.is_finite()) {
        return Err(refused(format!(
            "item {id}: {column}[{at}] is {} (rows must be finite)",
            values[at]
        )));
    }
    Ok(())
}

/// Columns of a stored 2-D table, whatever its precision.
fn table_cols(weights: &Weights, name: &str) -> Result<usize> {
    let shape = match (weights.f32.get(name), weights.raw.get(name)) {
        (Some(t), _) => t.shape().to_vec(),
        (None, Some(raw)) => raw.shape.clone(),
        (None, None) => {
            return Err(EngineError::MissingTensor {
                name: name.to_string(),
            })
        }
    };
    match shape.as_slice() {
        [_, cols] => Ok(*cols),
        other => Err(refused(format!(
            "{name} has shape {other:?}, not a table of rows"
        ))),
    }
}

/// Builds the engine's tensors, ids and config with `delta` applied (see the module's comment);
/// any row that cannot apply is refused, naming the item and what is wrong, and nothing changes.
pub(crate) fn apply(
    config: &ModelConfig,
    weights: &Weights,
    ids: &IdMap,
    delta: &CatalogueDelta,
) -> Result<Applied> {
    let tables: ItemTensors = Model::item_tensors(config);
    let kind = config.kind();
    let n = config.n_items();
    let d = table_cols(weights, &tables.output)?;
    let input_cols = match &tables.input {
        Some(name) => table_cols(weights, name)?,
        None => d,
    };
    let id_type = ids.id_type();

    let mut seen: HashMap<ExternalId, usize> = HashMap::with_capacity(delta.rows.len());
    let mut replaced: Vec<(usize, &ItemRow)> = Vec::new();
    let mut added: Vec<(ExternalId, &ItemRow)> = Vec::new();
    let mut retired: Vec<u32> = Vec::new();
    let mut upserted: Vec<u32> = Vec::new();
    for (r, row) in delta.rows.iter().enumerate() {
        let id = normalized(&row.id, id_type)?;
        if let Some(first) = seen.insert(id.clone(), r) {
            return Err(refused(format!(
                "item {id} appears twice (rows {first} and {r}); a delta holds each item once"
            )));
        }
        if let Some(vector) = &row.vector {
            check_values(&id, "vector", vector, d + 1)?;
            if tables.output_bias.is_none() && vector[d] != 0.0 {
                return Err(refused(format!(
                    "item {id}: the vector's last value (the bias) is {}, but {kind} scores \
                     without a bias; it must be 0",
                    vector[d]
                )));
            }
        }
        if let Some(input) = &row.input_vector {
            check_values(&id, "input_vector", input, input_cols)?;
            if tables.input.is_none() {
                let same = row.vector.as_ref().is_none_or(|v| {
                    v[..d]
                        .iter()
                        .zip(input)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                });
                if !same || row.vector.is_none() {
                    return Err(refused(format!(
                        "item {id}: {kind} reads an item's input row from its output embedding, \
                         so input_vector must equal the vector's embedding (or be left out)"
                    )));
                }
            }
        }
        match ids.index_of(&id) {
            Some(index) => {
                if row.op == ItemOp::Upsert && row.vector.is_none() {
                    return Err(refused(format!(
                        "item {id}: an upsert needs its vector ([embedding, bias])"
                    )));
                }
                if row.vector.is_some() || row.input_vector.is_some() {
                    replaced.push((index as usize, row));
                }
                match row.op {
                    ItemOp::Retire => retired.push(index),
                    ItemOp::Upsert => upserted.push(index),
                }
            }
            None => {
                if row.vector.is_none() {
                    return Err(refused(format!(
                        "item {id} is not in the engine, and its row carries no vector: a new \
                         item needs its rows (retiring an item the engine never had changes \
                         nothing; leave it out)"
                    )));
                }
                if tables.input.is_some() && row.input_vector.is_none() {
                    return Err(refused(format!(
                        "item {id} is new, and its row has no input_vector: {kind} reads a new \
                         item's input row from it (recsys export-items --with-input-rows writes it)"
                    )));
                }
                let index = n + 1 + added.len();
                let index = u32::try_from(index)
                    .map_err(|_| refused(format!("item {id}: index {index} does not fit u32")))?;
                if row.op == ItemOp::Retire {
                    retired.push(index);
                }
                added.push((id, row));
            }
        }
    }
    retired.sort_unstable();
    upserted.sort_unstable();

    let mut edited = weights.clone();
    let trailing = tables.trailing_rows;
    // The output weight: items 0..=N (replaced where the delta says), the new items, then the rows
    // after the items (BERT4Rec's mask token).
    let mut output_rows: Vec<NewRow<'_>> = (0..=n).map(NewRow::Kept).collect();
    for (index, row) in &replaced {
        if let Some(vector) = &row.vector {
            output_rows[*index] = NewRow::Values(&vector[..d]);
        }
    }
    output_rows.extend(
        added
            .iter()
            .map(|(_, row)| NewRow::Values(&row.vector.as_ref().expect("checked above")[..d])),
    );
    output_rows.extend((n + 1..n + 1 + trailing).map(NewRow::Kept));
    edit_table(&mut edited, &tables.output, &output_rows, d)?;

    if let Some(bias_name) = &tables.output_bias {
        let old = weights.tensor(bias_name, &[n + 1])?;
        let mut bias = old.as_slice().to_vec();
        for (index, row) in &replaced {
            if let Some(vector) = &row.vector {
                bias[*index] = vector[d];
            }
        }
        bias.extend(
            added
                .iter()
                .map(|(_, row)| row.vector.as_ref().expect("checked above")[d]),
        );
        let len = bias.len();
        edited
            .f32
            .insert(bias_name.clone(), Tensor::from_vec(vec![len], bias));
    }

    if let Some(input_name) = &tables.input {
        let mut input_rows: Vec<NewRow<'_>> = (0..=n).map(NewRow::Kept).collect();
        for (index, row) in &replaced {
            if let Some(input) = &row.input_vector {
                input_rows[*index] = NewRow::Values(input);
            }
        }
        input_rows.extend(
            added.iter().map(|(_, row)| {
                NewRow::Values(row.input_vector.as_deref().expect("checked above"))
            }),
        );
        edit_table(&mut edited, input_name, &input_rows, input_cols)?;
    }

    let mut changed_inputs: Vec<u32> = replaced
        .iter()
        .filter(|(_, row)| match tables.input {
            None => row.vector.is_some(),
            Some(_) => row.input_vector.is_some(),
        })
        .map(|(index, _)| *index as u32)
        .collect();
    changed_inputs.sort_unstable();
    let new_ids: Vec<ExternalId> = added.iter().map(|(id, _)| id.clone()).collect();
    let ids = ids.appended(&new_ids).map_err(refused)?;
    let summary = CatalogueSummary {
        version: delta.version,
        base_items: n,
        delta_items: delta.rows.len(),
        added: added.len(),
        replaced: replaced.len(),
        retired: retired.len(),
    };
    Ok(Applied {
        config: config.with_n_items(n + added.len()),
        weights: edited,
        ids,
        retired,
        upserted,
        changed_inputs,
        summary,
    })
}

/// Replaces the stored table `name` (`cols` wide) by `rows`, at its stored precision: kept rows
/// keep their stored bits (and int8 scale), new ones are stored as conversion stores a row.
fn edit_table(weights: &mut Weights, name: &str, rows: &[NewRow<'_>], cols: usize) -> Result<()> {
    if let Some(table) = weights.f32.get(name) {
        let old = table.as_slice();
        let mut values = Vec::with_capacity(rows.len() * cols);
        for row in rows {
            match *row {
                NewRow::Kept(i) => values.extend_from_slice(&old[i * cols..(i + 1) * cols]),
                NewRow::Values(v) => values.extend_from_slice(v),
            }
        }
        let table = Tensor::from_vec(vec![rows.len(), cols], values);
        weights.f32.insert(name.to_string(), table);
        return Ok(());
    }
    let raw = weights
        .raw
        .get(name)
        .ok_or_else(|| EngineError::MissingTensor {
            name: name.to_string(),
        })?;
    let old = raw.bytes.as_slice();
    let dtype = raw.dtype;
    let bytes: Vec<u8> = match dtype {
        safetensors::Dtype::F16 | safetensors::Dtype::BF16 => {
            let row_bytes = 2 * cols;
            let mut bytes = Vec::with_capacity(rows.len() * row_bytes);
            for row in rows {
                match *row {
                    NewRow::Kept(i) => {
                        bytes.extend_from_slice(&old[i * row_bytes..(i + 1) * row_bytes])
                    }
                    NewRow::Values(v) => {
                        let bits = if dtype == safetensors::Dtype::F16 {
                            to_f16_bits(v)
                        } else {
                            to_bf16_bits(v)
                        };
                        bytes.extend(bits.iter().flat_map(|b| b.to_le_bytes()));
                    }
                }
            }
            bytes
        }
        safetensors::Dtype::I8 => {
            let scales_name = scale_name(name);
            let old_scales = weights
                .f32
                .get(&scales_name)
                .ok_or_else(|| EngineError::MissingTensor {
                    name: scales_name.clone(),
                })?
                .as_slice();
            let mut bytes = Vec::with_capacity(rows.len() * cols);
            let mut scales = Vec::with_capacity(rows.len());
            for row in rows {
                match *row {
                    NewRow::Kept(i) => {
                        bytes.extend_from_slice(&old[i * cols..(i + 1) * cols]);
                        scales.push(old_scales[i]);
                    }
                    NewRow::Values(v) => {
                        let (q, scale) = quantize_int8_per_row(v, cols);
                        bytes.extend(q.iter().map(|&b| b as u8));
                        scales.extend(scale);
                    }
                }
            }
            let len = scales.len();
            weights
                .f32
                .insert(scales_name, Tensor::from_vec(vec![len], scales));
            bytes
        }
        other => {
            return Err(refused(format!(
                "{name} is stored as {other:?}, which a delta cannot edit"
            )))
        }
    };
    weights.raw.insert(
        name.to_string(),
        RawTensor {
            dtype,
            shape: vec![rows.len(), cols],
            bytes: bytes.into(),
        },
    );
    Ok(())
}
