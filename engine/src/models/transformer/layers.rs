//! The transformer's layer primitives: a dense layer loaded by name, LayerNorm, the key, value and
//! query projections packed as one layer, a projection's columns, and one projection run.

use super::{DenseLayer, Tiles, Widened};
use crate::error::Result;
use crate::kernels::fused_amx::AmxLayer;
use crate::kernels::packed::{LayerRef, PackedOutput, PanelRef, QuantizedActivations};
use crate::kernels::{dense, KernelTable};
use crate::tensor::Tensor;
use crate::weights::Weights;

#[derive(Clone, Debug)]
pub(super) struct Dense(pub(super) DenseLayer);

impl Dense {
    pub(super) fn load(t: &Weights, prefix: &str, out_dim: usize, in_dim: usize) -> Result<Dense> {
        Ok(Dense(DenseLayer::new(
            prefix,
            &t.matrix(&format!("{prefix}.weight"), [out_dim, in_dim])?,
            &t.tensor(&format!("{prefix}.bias"), &[out_dim])?,
        )))
    }
}

#[derive(Clone, Debug)]
pub(super) struct LayerNorm {
    pub(super) gamma: Tensor,
    pub(super) beta: Tensor,
}

impl LayerNorm {
    pub(super) fn load(t: &Weights, prefix: &str, width: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            gamma: t.tensor(&format!("{prefix}.weight"), &[width])?,
            beta: t.tensor(&format!("{prefix}.bias"), &[width])?,
        })
    }

    pub(super) fn apply(&self, kernels: &KernelTable, x: &mut [f32], eps: f64) {
        (kernels.elementwise.layer_norm)(
            x,
            self.gamma.len(),
            self.gamma.as_slice(),
            self.beta.as_slice(),
            eps,
        );
    }
}

/// A layer's key, value and query projections packed side by side as one layer (keys, values,
/// then queries, each padded to whole panels): one kernel pass over a block of tokens computes
/// all three, reading the tokens once instead of three times. The panels are each projection's
/// own, so every output has the bits of its own layer.
#[derive(Clone, Debug)]
pub(super) struct Projections {
    pub(super) packed: PackedOutput,
    /// A bf16 layer widened for kernels without native bf16 ([`Widened`]).
    widened: Widened,
    /// A bf16 layer in AMX tiles for tiled kernel tables ([`Tiles`]).
    tiles: Tiles,
    /// Lanes per projection: the hidden size rounded up to a whole panel.
    pub(super) width: usize,
    /// W8A8: the static scale the keys' and values' input is quantized at (they read the same
    /// rows, so calibration gives them the same scale), and the queries'. The queries of the last
    /// layer read only the [MASK] rows, so theirs may differ.
    pub(super) kv_scale: Option<f32>,
    pub(super) q_scale: Option<f32>,
}

impl Projections {
    pub(super) fn new(
        key: &DenseLayer,
        value: &DenseLayer,
        query: &DenseLayer,
    ) -> Result<Projections> {
        let packed = PackedOutput::side_by_side(&[&key.packed, &value.packed, &query.packed])
            .ok_or_else(|| {
                crate::error::EngineError::Config(format!(
                    "{}, {} and {} differ in shape or precision",
                    key.name(),
                    value.name(),
                    query.name()
                ))
            })?;
        let (kv_scale, q_scale) = (
            key.static_activation_scale(),
            query.static_activation_scale(),
        );
        if value.static_activation_scale() != kv_scale {
            return Err(crate::error::EngineError::Config(format!(
                "{} and {} read the same input but have different static activation scales",
                key.name(),
                value.name()
            )));
        }
        Ok(Projections {
            width: key.packed.panels() * 8,
            packed,
            widened: Widened::default(),
            tiles: Tiles::default(),
            kv_scale,
            q_scale,
        })
    }

    /// Bytes of the packed weights held in memory (the widened copy included, once made).
    pub(super) fn packed_bytes(&self) -> usize {
        self.packed.weight_bytes()
            + 4 * self.packed.bias.len()
            + self.widened.bytes()
            + self.tiles.bytes()
    }

    /// Keys, values and queries of the same rows in one call, as `kernels` run them: when their
    /// input is quantized alike.
    pub(super) fn all(&self, kernels: &KernelTable) -> Option<Projection<'_>> {
        (self.kv_scale == self.q_scale).then(|| Projection {
            layer: LayerRef {
                activation_scale: self.kv_scale,
                ..self.widened.view(&self.packed, kernels)
            },
            tiles: self.tiles_of(kernels, 0..3 * self.width),
        })
    }

    /// Keys and values (`[rows, 2 x width]`).
    pub(super) fn keys_values(&self, kernels: &KernelTable) -> Projection<'_> {
        Projection {
            layer: LayerRef {
                activation_scale: self.kv_scale,
                ..self
                    .widened
                    .view(&self.packed, kernels)
                    .outputs(0..2 * self.width)
            },
            tiles: self.tiles_of(kernels, 0..2 * self.width),
        }
    }

    /// Queries (`[rows, width]`).
    pub(super) fn queries(&self, kernels: &KernelTable) -> Projection<'_> {
        Projection {
            layer: LayerRef {
                activation_scale: self.q_scale,
                ..self
                    .widened
                    .view(&self.packed, kernels)
                    .outputs(2 * self.width..3 * self.width)
            },
            tiles: self.tiles_of(kernels, 2 * self.width..3 * self.width),
        }
    }

    /// The tiles of outputs `outputs` where `kernels` run bf16 layers on tiles, the layer is bf16
    /// and the range starts at a block of tile outputs (a hidden size that is a multiple of 32
    /// puts every projection there; others run the SIMD kernels).
    fn tiles_of(
        &self,
        kernels: &KernelTable,
        outputs: std::ops::Range<usize>,
    ) -> Option<(&AmxLayer, std::ops::Range<usize>)> {
        if !outputs
            .start
            .is_multiple_of(crate::kernels::amx::BLOCK_OUTPUTS)
        {
            return None;
        }
        self.tiles
            .for_kernels(&self.packed, kernels)
            .map(|tiles| (tiles, outputs))
    }
}

/// Some of a layer's projections as one layer: its panels for the SIMD kernels, and its tiles
/// with the outputs they hold where the kernel table runs bf16 layers on AMX tiles.
#[derive(Clone, Debug)]
pub(super) struct Projection<'a> {
    pub(super) layer: LayerRef<'a>,
    tiles: Option<(&'a AmxLayer, std::ops::Range<usize>)>,
}

impl Projection<'_> {
    /// `x @ W^T + b` into `y` (`[rows, n]`), on this thread: on tiles where the projection has
    /// them (and the process may run them), else by the SIMD kernels; accounted as dense work
    /// either way (the tiles account their own).
    pub(super) fn rows_into(
        &self,
        kernels: &KernelTable,
        x: &[f32],
        y: &mut [f32],
        quantized: &mut QuantizedActivations,
    ) {
        if !self.on_tiles(x, y, 1) {
            crate::profile::account(crate::profile::Work::Dense, || {
                dense::linear_into(kernels, self.layer, x, y, quantized)
            })
        }
    }

    /// Whether the projection ran on its tiles (false: it has none, or they refused; nothing
    /// written).
    fn on_tiles(&self, x: &[f32], y: &mut [f32], threads: usize) -> bool {
        self.tiles.as_ref().is_some_and(|(tiles, outputs)| {
            crate::kernels::dense_amx::linear_outputs_into_then(
                tiles,
                outputs.clone(),
                x,
                y,
                threads,
                |_| {},
            )
            .is_ok()
        })
    }
}

/// One projection (keys, values or queries) in a row-major matrix whose rows are `stride` long:
/// the projection's columns start at `offset`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Columns<'a> {
    pub(super) data: &'a [f32],
    pub(super) stride: usize,
    pub(super) offset: usize,
}

impl<'a> Columns<'a> {
    /// Rows `rows` only (row 0 of the result is row `rows.start`).
    pub(super) fn rows(self, rows: std::ops::Range<usize>) -> Columns<'a> {
        Columns {
            data: &self.data[rows.start * self.stride..rows.end * self.stride],
            ..self
        }
    }

    /// Row `r`'s columns `cols` of the projection.
    pub(super) fn row(&self, r: usize, cols: std::ops::Range<usize>) -> &'a [f32] {
        let start = r * self.stride + self.offset;
        &self.data[start + cols.start..start + cols.end]
    }
}

/// `x @ W^T + b` of some of a layer's projections into `y` (resized to `[rows, n]`), on tiles
/// where they have them, accounted as dense work.
pub(super) fn project(
    kernels: &KernelTable,
    projection: &Projection<'_>,
    x: &[f32],
    y: &mut Vec<f32>,
    quantized: &mut QuantizedActivations,
    threads: usize,
) {
    let layer = projection.layer;
    y.resize(x.len() / layer.d * layer.n, 0.0);
    if projection.on_tiles(x, y, threads) {
        return;
    }
    dense::linear_into_threads(
        kernels,
        layer,
        x,
        y,
        quantized,
        threads,
        crate::profile::Work::Dense,
    );
}

/// `n` items of width `d` packed in `panels` (f32), with no bias, as the kernels take them.
pub(super) fn dense_panels<'a>(
    panels: &'a [f32],
    n: usize,
    d: usize,
    zeros: &'a [f32],
) -> LayerRef<'a> {
    LayerRef {
        n,
        d,
        data: PanelRef::F32(panels),
        bias: &zeros[..n.div_ceil(8) * 8],
        activation_scale: None,
    }
}
