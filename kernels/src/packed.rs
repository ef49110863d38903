//! The output layer laid out for the micro-kernels, at each precision.
//!
//! Items are grouped in panels of 8; inside a panel the weights are stored feature-major
//! (`panel[j * 8 + l]` is feature j of item 8p + l), so one 8-wide load fetches feature j of 8 items
//! and the kernel never needs a horizontal sum. The last panel is zero-padded; padded items are never
//! offered to the top-k selection.

use super::bf16::round_rows_to_bf16_both;
pub use super::bf16::{bf16_to_f32, round_to_bf16, to_bf16_bits};
use super::shared::Shared;

/// Storage of the packed weights (owned, or mapped from the engine's kernels file).
#[derive(Clone, Debug)]
pub enum PanelData {
    F32(Shared<f32>),
    /// IEEE half bits, widened to f32 in registers (F16C).
    F16(Shared<u16>),
    /// bfloat16 bits laid out in feature pairs as int8 is (`panel[(pair * 8 + l) * 2 + t]` is
    /// feature `2 * pair + t` of item 8p + l, an odd last feature padded with zero), so one 32-bit
    /// lane holds the pair `vdpbf16ps` multiplies; the activations are rounded to bfloat16 too
    /// ([`round_to_bf16`]).
    Bf16(Shared<u16>),
    /// A bf16 layer's values widened exactly to f32 for CPUs without `vdpbf16ps`
    /// ([`PackedOutput::widened_bf16`]): laid out as an f32 layer `2 * pairs` features wide whose
    /// features come pair by pair, odd then even (`panel[(2 * pair) * 8 + l]` is feature
    /// `2 * pair + 1` of item 8p + l, `panel[(2 * pair + 1) * 8 + l]` feature `2 * pair`), and
    /// multiplied by the fp32 kernels with the activations rounded to bfloat16 in the same order
    /// ([`crate::Bf16Rows::wide`]): the fused multiply-adds of the bf16 kernels in their order,
    /// so the same bits, at fp32's speed (no widening in the kernels' loop). Twice the bytes of
    /// [`PanelData::Bf16`]: for the small, compute-bound dense layers.
    Bf16Wide(Shared<f32>),
    /// Symmetric int8 with one scale per item (output row).
    I8 {
        q: Shared<i8>,
        scales: Shared<f32>,
    },
}

/// Precision of a packed output layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputPrecision {
    F32,
    F16,
    Bf16,
    Int8,
}

#[derive(Clone, Debug)]
pub struct PackedOutput {
    /// Items (N + 1 with PAD).
    pub n: usize,
    /// Hidden size.
    pub d: usize,
    pub data: PanelData,
    /// Padded to a whole number of panels with -inf, so padding items never score above any bar.
    pub bias: Shared<f32>,
    /// int8 only: a calibrated static activation scale (W8A8: activations rounded to levels of it,
    /// saturating to [-128, 127]). `None`: each request's activations get their own int16 scale.
    pub activation_scale: Option<f32>,
}

/// Packed weights as the micro-kernels read them, borrowed: from a [`PackedOutput`], or from
/// buffers a caller packs into and reuses (attention's per-head keys and values), so running a
/// layer needs no storage of its own.
#[derive(Clone, Copy, Debug)]
pub enum PanelRef<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    Bf16(&'a [u16]),
    Bf16Wide(&'a [f32]),
    I8 { q: &'a [i8], scales: &'a [f32] },
}

/// A packed layer, borrowed (see [`PanelRef`]).
#[derive(Clone, Copy, Debug)]
pub struct LayerRef<'a> {
    /// Outputs (items).
    pub n: usize,
    /// Inputs (hidden size).
    pub d: usize,
    pub data: PanelRef<'a>,
    /// At least one per item of every panel (padding lanes may hold anything for a dense layer:
    /// their outputs are never written).
    pub bias: &'a [f32],
    pub activation_scale: Option<f32>,
}

impl<'a> LayerRef<'a> {
    pub fn panels(&self) -> usize {
        self.n.div_ceil(8)
    }

    pub fn precision(&self) -> OutputPrecision {
        match self.data {
            PanelRef::F32(_) => OutputPrecision::F32,
            PanelRef::F16(_) => OutputPrecision::F16,
            PanelRef::Bf16(_) | PanelRef::Bf16Wide(_) => OutputPrecision::Bf16,
            PanelRef::I8 { .. } => OutputPrecision::Int8,
        }
    }

    /// Panels per micro-kernel call for row groups of 1, 2 and 4 rows: those of the kernels that
    /// run this layer (fp32's for a widened bf16 layer).
    pub fn panels_per_call(&self, table: &crate::KernelTable) -> [usize; 4] {
        match self.data {
            PanelRef::Bf16Wide(_) => table.panels_per_call.f32,
            _ => table.panels_per_call.of(self.precision()),
        }
    }

    /// Outputs `outputs` of the layer as a layer of their own, borrowed: whole panels, so the
    /// range starts at a multiple of 8 (one of the projections packed side by side in a
    /// [`PackedOutput::side_by_side`] layer). Each output is computed as in the whole layer.
    pub fn outputs(self, outputs: std::ops::Range<usize>) -> LayerRef<'a> {
        assert!(
            outputs.start.is_multiple_of(8)
                && outputs.start <= outputs.end
                && outputs.end <= self.n,
            "outputs {outputs:?} of a layer of {} are not whole panels",
            self.n
        );
        let (first, last) = (outputs.start / 8, outputs.end.div_ceil(8));
        let per_panel = |bytes_per_value: usize| self.panel_bytes() / bytes_per_value;
        let data = match self.data {
            PanelRef::F32(w) => PanelRef::F32(&w[first * per_panel(4)..last * per_panel(4)]),
            PanelRef::F16(w) => PanelRef::F16(&w[first * per_panel(2)..last * per_panel(2)]),
            PanelRef::Bf16(w) => PanelRef::Bf16(&w[first * per_panel(2)..last * per_panel(2)]),
            PanelRef::Bf16Wide(w) => {
                PanelRef::Bf16Wide(&w[first * per_panel(4)..last * per_panel(4)])
            }
            PanelRef::I8 { q, scales } => PanelRef::I8 {
                q: &q[first * per_panel(1)..last * per_panel(1)],
                scales: &scales[first * 8..last * 8],
            },
        };
        LayerRef {
            n: outputs.len(),
            d: self.d,
            data,
            bias: &self.bias[first * 8..last * 8],
            activation_scale: self.activation_scale,
        }
    }

    /// Bytes of one panel's weights as the micro-kernels read them (8 items x d).
    pub fn panel_bytes(&self) -> usize {
        match self.data {
            PanelRef::F32(_) => self.d * 8 * 4,
            PanelRef::F16(_) => self.d * 8 * 2,
            PanelRef::Bf16(_) => self.d.div_ceil(2) * 16 * 2,
            PanelRef::Bf16Wide(_) => self.d.div_ceil(2) * 16 * 4,
            PanelRef::I8 { .. } => self.d.div_ceil(2) * 16,
        }
    }

    /// Bytes of weights streamed per full pass over the items.
    pub fn weight_bytes(&self) -> usize {
        match self.data {
            PanelRef::F32(v) | PanelRef::Bf16Wide(v) => v.len() * 4,
            PanelRef::F16(v) | PanelRef::Bf16(v) => v.len() * 2,
            PanelRef::I8 { q, scales } => q.len() + scales.len() * 4,
        }
    }
}

/// Row `i` of the rows being packed: `table`'s row `i`, or its row `rows[i]` when only some rows
/// are packed (a request's candidates), read in place rather than gathered into a copy first.
fn row_of<'a, T>(table: &'a [T], d: usize, rows: Option<&'a [u32]>) -> impl Fn(usize) -> &'a [T] {
    move |i| {
        let r = rows.map_or(i, |rows| rows[i] as usize);
        &table[r * d..(r + 1) * d]
    }
}

/// Packs `n` rows of `d` values (`row(i)`), panel after panel in storage order, so the output is
/// written sequentially while 8 rows are read side by side.
fn pack<'a, T: Copy + Default + 'a>(n: usize, d: usize, row: impl Fn(usize) -> &'a [T]) -> Vec<T> {
    let mut out = Vec::new();
    pack_into(&mut out, n, d, row);
    out
}

/// [`pack`] into `out`, replacing what it held (its capacity is reused).
fn pack_into<'a, T: Copy + Default + 'a>(
    out: &mut Vec<T>,
    n: usize,
    d: usize,
    row: impl Fn(usize) -> &'a [T],
) {
    let panels = n.div_ceil(8);
    // Every value is written below (whole panels by feature, the last one cleared first), so the
    // buffer is only resized, not cleared: filling it would cost a pass of its own.
    out.resize(panels * d * 8, T::default());
    for (p, panel) in out.chunks_exact_mut((d * 8).max(1)).enumerate() {
        let lanes = (n - p * 8).min(8);
        if lanes == 8 {
            // A whole panel: each feature's 8 values gathered from the 8 rows (8 sequential
            // read streams) and written as one contiguous run.
            let rows: [&[T]; 8] = std::array::from_fn(|lane| &row(p * 8 + lane)[..d]);
            for (j, slot) in panel.chunks_exact_mut(8).enumerate() {
                let run: [T; 8] = std::array::from_fn(|lane| rows[lane][j]);
                slot.copy_from_slice(&run);
            }
            continue;
        }
        // The last, partial panel: row by row into its lane, padding lanes left at the default.
        panel.fill(T::default());
        for lane in 0..lanes {
            let values = &row(p * 8 + lane)[..d];
            for (slot, &v) in panel.chunks_exact_mut(8).zip(values) {
                slot[lane] = v;
            }
        }
    }
}

/// Feature pairs of 8 items side by side (see [`PanelData::I8`] and [`PanelData::Bf16`]),
/// written in storage order; an odd last feature's partner and padding items are zero.
fn pack_pairs<'a, T: Copy + Default + 'a>(
    n: usize,
    d: usize,
    row: impl Fn(usize) -> &'a [T],
) -> Vec<T> {
    let pairs = d.div_ceil(2);
    let panels = n.div_ceil(8);
    let mut out = Vec::with_capacity(panels * pairs * 16);
    for p in 0..panels {
        let lanes: [Option<&[T]>; 8] =
            std::array::from_fn(|l| (p * 8 + l < n).then(|| row(p * 8 + l)));
        for pair in 0..pairs {
            for lane in &lanes {
                for j in [2 * pair, 2 * pair + 1] {
                    out.push(lane.and_then(|r| r.get(j)).copied().unwrap_or_default());
                }
            }
        }
    }
    out
}

/// Largest int16 level for activations of width `d`, so that a dot product with int8 weights
/// (|q| <= 127) can never overflow the i32 accumulator: d_even * 127 * level < 2^31.
pub fn activation_levels(d: usize) -> i32 {
    let d_even = d.div_ceil(2) * 2;
    (i32::MAX as i64 / (d_even.max(1) as i64 * 127)).min(i16::MAX as i64) as i32
}

/// Quantizes each row of `hidden` (`[rows, d]`) to int16 with its own symmetric scale; rows are
/// padded to an even width. Returns the values and one scale per row (0 for an all-zero row).
pub fn quantize_activations(hidden: &[f32], d: usize) -> (Vec<i16>, Vec<f32>) {
    let mut out = QuantizedActivations::default();
    out.quantize(hidden, d, None);
    (out.values, out.scales)
}

/// Quantizes activations with one static scale to int8 levels as ONNX's QuantizeLinear (and so
/// TensorRT's explicit quantization) does: `x / scale` rounded half to even, saturated to
/// [-128, 127]; stored as int16 for the same
/// integer kernel; rows are padded to an even width.
pub fn quantize_activations_static(hidden: &[f32], d: usize, scale: f32) -> (Vec<i16>, Vec<f32>) {
    let mut out = QuantizedActivations::default();
    out.quantize(hidden, d, Some(scale));
    (out.values, out.scales)
}

/// A batch's activations as the int8 kernels read them (int16 values, rows padded to an even
/// width, one scale per row), in buffers kept from batch to batch.
#[derive(Clone, Debug, Default)]
pub struct QuantizedActivations {
    pub values: Vec<i16>,
    pub scales: Vec<f32>,
    /// A bf16 layer's input rounded to bfloat16 ([`round_to_bf16`]), rows padded to an even width.
    pub bf16: Vec<u16>,
    /// The same values widened to f32 (exactly), each pair odd value first, for the kernels that
    /// widen ([`crate::Bf16Rows`]).
    pub bf16_wide: Vec<f32>,
}

impl QuantizedActivations {
    /// Replaces the held bfloat16 activations with `hidden` (`[rows, d]`) rounded to bfloat16,
    /// each row padded to an even width with zeros (what the bf16 kernels read).
    pub fn round_to_bf16(&mut self, hidden: &[f32], d: usize) {
        let width = d.div_ceil(2) * 2;
        let rows = hidden.len() / d.max(1);
        // Sized only: every value is written below, padding included (clearing first cost a
        // pass of its own, 2-3 % of a BERT4Rec batch).
        self.bf16.resize(rows * width, 0);
        self.bf16_wide.resize(rows * width, 0.0);
        // A dense layer's whole input goes through here (a BERT4Rec batch of 64: millions of
        // values per layer), so it runs vectorised: compiled for AVX2 where the CPU has it.
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected on this CPU just above.
            return unsafe {
                crate::avx2::round_rows_to_bf16(hidden, d, &mut self.bf16, &mut self.bf16_wide)
            };
        }
        round_rows_to_bf16_both(hidden, d, &mut self.bf16, &mut self.bf16_wide);
    }

    /// Rows `rows` of the bf16 activations (rows `width` wide), both forms.
    pub fn bf16_rows(&self, rows: std::ops::Range<usize>, width: usize) -> crate::Bf16Rows<'_> {
        let span = rows.start * width..rows.end * width;
        crate::Bf16Rows {
            bits: &self.bf16[span.clone()],
            wide: &self.bf16_wide[span],
        }
    }

    /// Replaces the held activations with `hidden` (`[rows, d]`): each row at its own symmetric
    /// int16 scale (`static_scale` `None`), or at int8 levels of the calibrated static scale.
    pub fn quantize(&mut self, hidden: &[f32], d: usize, static_scale: Option<f32>) {
        let width = d.div_ceil(2) * 2;
        let rows = hidden.len() / d;
        self.values.clear();
        self.values.resize(rows * width, 0);
        self.scales.clear();
        match static_scale {
            None => {
                let levels = activation_levels(d) as f32;
                for (r, row) in hidden.chunks_exact(d).enumerate() {
                    let max = row.iter().fold(0f32, |m, &h| m.max(h.abs()));
                    let scale = max / levels;
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    for (q, &h) in self.values[r * width..].iter_mut().zip(row) {
                        *q = (h * inv).round().clamp(-levels, levels) as i16;
                    }
                    self.scales.push(scale);
                }
            }
            Some(scale) => {
                self.scales.resize(rows, scale);
                if scale <= 0.0 {
                    return;
                }
                for (r, row) in hidden.chunks_exact(d).enumerate() {
                    for (q, &h) in self.values[r * width..].iter_mut().zip(row) {
                        // QuantizeLinear's arithmetic exactly: x / scale, ties to even, saturate.
                        *q = (h / scale).round_ties_even().clamp(-128.0, 127.0) as i16;
                    }
                }
            }
        }
    }
}

/// Packs rows `rows` of the row-major f32 table `table` (rows `stride` long), restricted to the
/// columns `cols` (`d = cols.len()`), as items, into `out` (replacing what it held; its capacity
/// is reused): the panels [`PackedOutput::from_f32`] makes of that sub-matrix, read in place
/// (attention's per-head keys).
pub fn pack_columns_into(
    out: &mut Vec<f32>,
    table: &[f32],
    stride: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) {
    assert!(cols.end <= stride && rows.end * stride <= table.len());
    let (n, d) = (rows.len(), cols.len());
    let row = |i: usize| {
        let start = (rows.start + i) * stride + cols.start;
        &table[start..start + d]
    };
    pack_into(out, n, d, row);
}

/// [`pack_columns_into`] with the rows given one by one: item `i` is `row(i)` restricted to the
/// columns `cols` (attention's keys when they lie in several buffers: carried and new).
pub fn pack_rows_into<'a>(
    out: &mut Vec<f32>,
    n: usize,
    cols: std::ops::Range<usize>,
    row: impl Fn(usize) -> &'a [f32],
) {
    let d = cols.len();
    pack_into(out, n, d, |i| &row(i)[cols.clone()]);
}

/// The transpose of that sub-matrix as items, into `out` (replacing what it held): item `c` is
/// column `cols.start + c`, its features the rows `rows` (`d = rows.len()`), so the panels of the
/// transposed copy without making it (attention's per-head values).
pub fn pack_columns_transposed_into(
    out: &mut Vec<f32>,
    table: &[f32],
    stride: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) {
    assert!(cols.end <= stride && rows.end * stride <= table.len());
    let first = rows.start;
    pack_rows_transposed_into(out, rows.len(), cols, |j| {
        &table[(first + j) * stride..(first + j + 1) * stride]
    });
}

/// [`pack_columns_transposed_into`] with the rows given one by one: feature `j` of every item is
/// `row(j)`'s columns `cols` (attention's values when they lie in several buffers).
pub fn pack_rows_transposed_into<'a>(
    out: &mut Vec<f32>,
    d: usize,
    cols: std::ops::Range<usize>,
    row: impl Fn(usize) -> &'a [f32],
) {
    let n = cols.len();
    // Resized, not cleared: every value is written below.
    out.resize(n.div_ceil(8) * d * 8, 0.0);
    for (p, panel) in out.chunks_exact_mut((d * 8).max(1)).enumerate() {
        let lanes = (n - p * 8).min(8);
        for (j, slot) in panel.chunks_exact_mut(8).enumerate() {
            // Feature j of items 8p.. is row j's run of columns: contiguous in that row.
            let start = cols.start + p * 8;
            let values = row(j);
            if lanes == 8 {
                // A fixed-size copy: two vector moves, not a call to memcpy.
                let run: &[f32; 8] = values[start..start + 8].try_into().expect("8 lanes");
                slot.copy_from_slice(run);
            } else {
                slot[..lanes].copy_from_slice(&values[start..start + lanes]);
                slot[lanes..].fill(0.0);
            }
        }
    }
}

/// The 16-bit panels (fp16 or bf16: the parts share one precision) of `parts`, one after the other.
/// The f32 panels of `parts` (fp32 or widened bf16, one layout for all), one after the other.
fn f32_values(parts: &[&PackedOutput]) -> Vec<f32> {
    parts
        .iter()
        .flat_map(|p| match &p.data {
            PanelData::F32(w) | PanelData::Bf16Wide(w) => w.iter().copied(),
            _ => unreachable!("the parts share a layout"),
        })
        .collect()
}

fn half_bits(parts: &[&PackedOutput]) -> Vec<u16> {
    parts
        .iter()
        .flat_map(|p| match &p.data {
            PanelData::F16(w) | PanelData::Bf16(w) => w.iter().copied(),
            _ => unreachable!("the parts share a precision"),
        })
        .collect()
}

fn padded(values: &[f32], n: usize, fill: f32) -> Vec<f32> {
    let mut out = values.to_vec();
    out.resize(n.div_ceil(8) * 8, fill);
    out
}

impl PackedOutput {
    /// The layers `parts` (same input width and precision) as one layer whose outputs are theirs
    /// side by side, each part padded to whole panels: part `i`'s output `j` is output
    /// `offset_i + j`, `offset_i` the lanes of the parts before it (padding lanes included, whose
    /// outputs are never read). The panels are the parts' own, so every output is computed with
    /// the same bits as in its part. `None` when the parts differ in width or precision. The
    /// result has no static activation scale of its own.
    pub fn side_by_side(parts: &[&PackedOutput]) -> Option<PackedOutput> {
        let first = parts.first()?;
        let layout = |p: &PackedOutput| std::mem::discriminant(&p.data);
        if parts
            .iter()
            .any(|p| p.d != first.d || layout(p) != layout(first))
        {
            return None;
        }
        let lanes = |p: &&PackedOutput| p.panels() * 8;
        let mut bias = Vec::new();
        for p in parts {
            bias.extend_from_slice(&p.bias[..lanes(p)]);
        }
        let data = match &first.data {
            PanelData::F32(_) => PanelData::F32(f32_values(parts).into()),
            PanelData::F16(_) => PanelData::F16(half_bits(parts).into()),
            PanelData::Bf16(_) => PanelData::Bf16(half_bits(parts).into()),
            PanelData::Bf16Wide(_) => PanelData::Bf16Wide(f32_values(parts).into()),
            PanelData::I8 { .. } => {
                let (mut q, mut scales) = (Vec::new(), Vec::new());
                for p in parts {
                    let PanelData::I8 { q: pq, scales: ps } = &p.data else {
                        unreachable!("the parts share a precision")
                    };
                    q.extend_from_slice(pq);
                    scales.extend_from_slice(&ps[..lanes(p)]);
                }
                PanelData::I8 {
                    q: q.into(),
                    scales: scales.into(),
                }
            }
        };
        Some(PackedOutput {
            n: bias.len(),
            d: first.d,
            data,
            bias: bias.into(),
            activation_scale: None,
        })
    }

    /// From row-major f32 weights `[n, d]`.
    pub fn from_f32(weight: &[f32], bias: &[f32], d: usize) -> Self {
        assert_eq!(weight.len(), bias.len() * d, "weight must be [n, d]");
        Self::f32_rows(weight, None, bias, d)
    }

    /// Rows `rows` of the row-major f32 table `table` (`[_, d]`), with their biases `bias`: packed
    /// as if those rows were the whole table, read in place.
    pub fn gathered_f32(table: &[f32], rows: &[u32], bias: &[f32], d: usize) -> Self {
        assert_eq!(rows.len(), bias.len(), "one bias per row");
        Self::f32_rows(table, Some(rows), bias, d)
    }

    fn f32_rows(table: &[f32], rows: Option<&[u32]>, bias: &[f32], d: usize) -> Self {
        Self::float_rows(table, rows, bias, d, |v| PanelData::F32(v.into()))
    }

    /// A float table (f32 or half bits) packed whole or at `rows`, stored by `data`.
    fn float_rows<T: Copy + Default>(
        table: &[T],
        rows: Option<&[u32]>,
        bias: &[f32],
        d: usize,
        data: fn(Vec<T>) -> PanelData,
    ) -> Self {
        let n = bias.len();
        Self::with_panels(n, d, data(pack(n, d, row_of(table, d, rows))), bias)
    }

    /// `n` items of width `d` already packed in `data`, with their biases (padded with -inf).
    fn with_panels(n: usize, d: usize, data: PanelData, bias: &[f32]) -> Self {
        PackedOutput {
            n,
            d,
            data,
            bias: padded(bias, n, f32::NEG_INFINITY).into(),
            activation_scale: None,
        }
    }

    /// From row-major half-precision bits `[n, d]`.
    pub fn from_f16_bits(bits: &[u16], bias: &[f32], d: usize) -> Self {
        assert_eq!(bits.len(), bias.len() * d, "weight must be [n, d]");
        Self::f16_rows(bits, None, bias, d)
    }

    /// [`Self::gathered_f32`] for a half-precision table.
    pub fn gathered_f16_bits(table: &[u16], rows: &[u32], bias: &[f32], d: usize) -> Self {
        assert_eq!(rows.len(), bias.len(), "one bias per row");
        Self::f16_rows(table, Some(rows), bias, d)
    }

    fn f16_rows(table: &[u16], rows: Option<&[u32]>, bias: &[f32], d: usize) -> Self {
        Self::float_rows(table, rows, bias, d, |v| PanelData::F16(v.into()))
    }

    /// From row-major bfloat16 bits `[n, d]` (laid out in feature pairs, see [`PanelData::Bf16`]).
    pub fn from_bf16_bits(bits: &[u16], bias: &[f32], d: usize) -> Self {
        assert_eq!(bits.len(), bias.len() * d, "weight must be [n, d]");
        Self::bf16_rows(bits, None, bias, d)
    }

    /// [`Self::gathered_f32`] for a bfloat16 table.
    pub fn gathered_bf16_bits(table: &[u16], rows: &[u32], bias: &[f32], d: usize) -> Self {
        assert_eq!(rows.len(), bias.len(), "one bias per row");
        Self::bf16_rows(table, Some(rows), bias, d)
    }

    fn bf16_rows(table: &[u16], rows: Option<&[u32]>, bias: &[f32], d: usize) -> Self {
        let n = bias.len();
        let data = PanelData::Bf16(pack_pairs(n, d, row_of(table, d, rows)).into());
        Self::with_panels(n, d, data, bias)
    }

    /// From row-major int8 weights `[n, d]` and their per-row scales `[n]`.
    pub fn from_i8(q: &[i8], scales: &[f32], bias: &[f32], d: usize) -> Self {
        let n = bias.len();
        assert_eq!(q.len(), n * d, "weight must be [n, d]");
        assert_eq!(scales.len(), n, "one scale per row");
        Self::i8_rows(q, None, scales, bias, d)
    }

    /// [`Self::gathered_f32`] for an int8 table; `scales` are the gathered rows' own.
    pub fn gathered_i8(table: &[i8], rows: &[u32], scales: &[f32], bias: &[f32], d: usize) -> Self {
        assert_eq!(rows.len(), bias.len(), "one bias per row");
        assert_eq!(scales.len(), rows.len(), "one scale per row");
        Self::i8_rows(table, Some(rows), scales, bias, d)
    }

    fn i8_rows(table: &[i8], rows: Option<&[u32]>, scales: &[f32], bias: &[f32], d: usize) -> Self {
        let n = bias.len();
        let data = PanelData::I8 {
            q: pack_pairs(n, d, row_of(table, d, rows)).into(),
            scales: padded(scales, n, 0.0).into(),
        };
        Self::with_panels(n, d, data, bias)
    }

    /// A bf16 layer widened exactly to f32 ([`PanelData::Bf16Wide`]): the same outputs, bit for
    /// bit, computed by the fp32 kernels; `None` for other precisions.
    pub fn widened_bf16(&self) -> Option<PackedOutput> {
        let PanelData::Bf16(bits) = &self.data else {
            return None;
        };
        let pairs = self.d.div_ceil(2);
        let mut wide = Vec::with_capacity(bits.len());
        // Each panel's pair `jp` holds (even, odd) per lane, 16 values: out come the 8 odd ones,
        // then the 8 even ones.
        for pair in bits.chunks_exact(16) {
            wide.extend((0..8).map(|l| bf16_to_f32(pair[2 * l + 1])));
            wide.extend((0..8).map(|l| bf16_to_f32(pair[2 * l])));
        }
        debug_assert_eq!(wide.len(), self.panels() * pairs * 16);
        Some(PackedOutput {
            n: self.n,
            d: self.d,
            data: PanelData::Bf16Wide(wide.into()),
            bias: self.bias.clone(),
            activation_scale: None,
        })
    }

    /// W8A8: use a calibrated static activation scale (int8 weights only).
    pub fn with_static_activation_scale(mut self, scale: f32) -> Self {
        assert!(
            matches!(self.data, PanelData::I8 { .. }),
            "static activation scales need int8 weights"
        );
        self.activation_scale = Some(scale);
        self
    }

    /// Whether the weights are mapped from the engine's kernels file rather than packed in memory.
    pub fn is_mapped(&self) -> bool {
        match &self.data {
            PanelData::F32(w) | PanelData::Bf16Wide(w) => w.is_mapped(),
            PanelData::F16(w) | PanelData::Bf16(w) => w.is_mapped(),
            PanelData::I8 { q, .. } => q.is_mapped(),
        }
    }

    /// The packed weights, borrowed, as the micro-kernels take them.
    pub fn view(&self) -> LayerRef<'_> {
        LayerRef {
            n: self.n,
            d: self.d,
            data: match &self.data {
                PanelData::F32(w) => PanelRef::F32(w),
                PanelData::F16(w) => PanelRef::F16(w),
                PanelData::Bf16(w) => PanelRef::Bf16(w),
                PanelData::Bf16Wide(w) => PanelRef::Bf16Wide(w),
                PanelData::I8 { q, scales } => PanelRef::I8 { q, scales },
            },
            bias: &self.bias,
            activation_scale: self.activation_scale,
        }
    }

    pub fn panels(&self) -> usize {
        self.n.div_ceil(8)
    }

    pub fn precision(&self) -> OutputPrecision {
        self.view().precision()
    }

    /// Bytes of one panel's weights as the micro-kernels read them (8 items x d).
    pub fn panel_bytes(&self) -> usize {
        self.view().panel_bytes()
    }

    /// Bytes of weights streamed per full pass over the items (what bounds a memory-bound pass).
    pub fn weight_bytes(&self) -> usize {
        self.view().weight_bytes()
    }
}

/// Rounds every weight to the nearest half (round-to-nearest-even), as IEEE bits.
pub fn to_f16_bits(weight: &[f32]) -> Vec<u16> {
    weight
        .iter()
        .map(|&w| half::f16::from_f32(w).to_bits())
        .collect()
}

/// Symmetric per-row int8: `scale = max|w| / 127`, `q = round(w / scale)` in [-127, 127]. A row of
/// zeros gets scale 1.0 and all-zero values (it scores its bias): scales are always positive, as
/// ONNX's DequantizeLinear consumers such as TensorRT require.
pub fn quantize_int8_per_row(weight: &[f32], d: usize) -> (Vec<i8>, Vec<f32>) {
    let rows = weight.len() / d;
    let mut q = Vec::with_capacity(weight.len());
    let mut scales = Vec::with_capacity(rows);
    for row in weight.chunks_exact(d) {
        let max = row.iter().fold(0f32, |m, &w| m.max(w.abs()));
        let scale = if max > 0.0 { max / 127.0 } else { 1.0 };
        scales.push(scale);
        let inv = if max > 0.0 { 1.0 / scale } else { 0.0 };
        q.extend(
            row.iter()
                .map(|&w| (w * inv).round().clamp(-127.0, 127.0) as i8),
        );
    }
    (q, scales)
}

#[cfg(test)]
mod tests {
    use super::super::bf16::round_to_bf16_branch_free;
    use super::*;

    fn f32_panels(p: &PackedOutput) -> (&[f32], &[f32]) {
        match &p.data {
            PanelData::F32(w) => (w, &p.bias),
            _ => panic!("f32 expected"),
        }
    }

    #[test]
    fn column_windows_pack_as_their_copies_do() {
        // A 13 x 10 table; rows 2..11 (9 rows), columns 3..8 (5 columns): neither a whole panel.
        let (rows, stride) = (13, 10);
        let table: Vec<f32> = (0..rows * stride).map(|i| i as f32 * 0.5 - 7.0).collect();
        let (r, c) = (2..11, 3..8);
        let copy: Vec<f32> = r
            .clone()
            .flat_map(|i| table[i * stride + c.start..i * stride + c.end].to_vec())
            .collect();
        let row_bias: Vec<f32> = (0..r.len()).map(|i| i as f32).collect();
        let want = PackedOutput::from_f32(&copy, &row_bias, c.len());
        // Stale contents of a reused buffer must not survive.
        let mut got = vec![7.0f32; 3];
        pack_columns_into(&mut got, &table, stride, r.clone(), c.clone());
        assert_eq!(got.as_slice(), f32_panels(&want).0);

        let transposed: Vec<f32> = c
            .clone()
            .flat_map(|j| r.clone().map(move |i| (i, j)))
            .map(|(i, j)| table[i * stride + j])
            .collect();
        let col_bias: Vec<f32> = (0..c.len()).map(|j| -(j as f32)).collect();
        let want = PackedOutput::from_f32(&transposed, &col_bias, r.len());
        pack_columns_transposed_into(&mut got, &table, stride, r, c);
        assert_eq!(got.as_slice(), f32_panels(&want).0);
    }

    #[test]
    fn int8_scales_are_positive_and_a_zero_row_stays_zero() {
        let weight = [0.0, 0.0, 0.0, 0.5, -1.0, 0.25];
        let (q, scales) = quantize_int8_per_row(&weight, 3);
        assert_eq!(scales[0], 1.0);
        assert_eq!(&q[..3], &[0, 0, 0]);
        assert!((scales[1] - 1.0 / 127.0).abs() < 1e-9);
        assert_eq!(&q[3..], &[64, -127, 32]);
    }

    #[test]
    fn packing_puts_feature_j_of_8_items_together() {
        let (n, d) = (10, 3);
        let w: Vec<f32> = (0..n * d).map(|i| i as f32).collect();
        let p = PackedOutput::from_f32(&w, &vec![0.0; n], d);
        let PanelData::F32(data) = &p.data else {
            unreachable!()
        };
        assert_eq!(p.panels(), 2);
        // item 9 = panel 1, lane 1; feature 2 -> w[9*3+2]
        assert_eq!(data[d * 8 + 2 * 8 + 1], (9 * 3 + 2) as f32);
        // padded lane
        assert_eq!(data[d * 8 + 8 + 7], 0.0);
    }

    #[test]
    fn int8_roundtrip_error_is_at_most_half_a_step() {
        let w: Vec<f32> = (0..640)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let (q, s) = quantize_int8_per_row(&w, 64);
        for (row, (qr, &scale)) in w.chunks(64).zip(q.chunks(64).zip(&s)) {
            for (&x, &y) in row.iter().zip(qr) {
                assert!((x - y as f32 * scale).abs() <= scale * 0.5 + 1e-6);
            }
        }
        let (q0, s0) = quantize_int8_per_row(&[0.0; 4], 4);
        assert_eq!(
            (q0, s0),
            (vec![0; 4], vec![1.0]),
            "a zero row: zeros, scale 1.0"
        );
    }

    #[test]
    fn branch_free_bf16_rounding_matches_the_reference_for_every_kind_of_value() {
        // Every 65,537th bit pattern (all signs, exponents and mantissa regions, NaNs and
        // subnormals included) and the edges: zeros, the subnormal/normal boundary, infinities,
        // NaNs, ties and values that round into the next binade or to infinity.
        let mut patterns: Vec<u32> = (0..=u32::MAX).step_by(65_537).collect();
        patterns.extend([
            0,
            0x8000_0000,
            1,
            0x007f_ffff,
            0x0080_0000,
            0x8080_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7f80_0001,
            0x7fc0_0000,
            0xffff_ffff,
            0x3f80_8000,
            0x3f81_8000,
            0x7f7f_ffff,
            0x3fff_ffff,
        ]);
        for bits in patterns {
            let x = f32::from_bits(bits);
            assert_eq!(
                round_to_bf16_branch_free(x),
                round_to_bf16(x),
                "{bits:#010x}"
            );
        }
        // Both forms a batch's activations are prepared in: bits, and widened odd-first.
        let hidden = [1.5f32, -2.25, 3.0e-39, f32::NAN, 7.0];
        let mut prepared = QuantizedActivations::default();
        // A larger batch first: its values must not survive in the next one (padding included).
        prepared.round_to_bf16(&[9.0; 12], 6);
        prepared.round_to_bf16(&hidden, 5);
        assert_eq!(prepared.bf16.len(), 6);
        let want: Vec<u16> = hidden.iter().map(|&h| round_to_bf16(h)).collect();
        assert_eq!(&prepared.bf16[..5], &want[..]);
        assert_eq!(prepared.bf16[5], 0, "an odd row is padded with zero");
        let wide = &prepared.bf16_wide;
        assert_eq!((wide[0], wide[1]), (-2.25, 1.5));
        assert!(wide[2].is_nan(), "NaN stays NaN");
        assert_eq!(wide[3].to_bits(), 0, "a subnormal becomes zero");
        assert_eq!((wide[4], wide[5]), (0.0, 7.0));
        // The portable form (what a CPU without AVX2 runs) fills the same values.
        let (mut bits, mut wide2) = (vec![0u16; 6], vec![0f32; 6]);
        round_rows_to_bf16_both(&hidden, 5, &mut bits, &mut wide2);
        assert_eq!(bits, prepared.bf16);
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same(&wide2, wide));
    }
}
