//! Portable micro-kernels: plain loops, one multiply and one add per element, in the same
//! accumulation order as the SIMD versions (over d, increasing).

use super::{Epilogue, KernelTable};
use crate::Isa;

/// Generic body: `load(panel, i)` gives the weight at element `i` of the panel group as f32.
#[inline(always)]
fn panels<const R: usize, const P: usize, T: Copy>(
    hidden: &[f32],
    d: usize,
    panels: &[T],
    epilogue: &Epilogue<'_>,
    out: &mut [f32],
    masks: &mut [u8],
    load: impl Fn(T) -> f32,
) {
    let mut acc = [[[0f32; 8]; P]; R];
    for j in 0..d {
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let h = hidden[r * d + j];
            for (p, acc_rp) in acc_r.iter_mut().enumerate() {
                let w = &panels[p * d * 8 + j * 8..p * d * 8 + j * 8 + 8];
                for l in 0..8 {
                    acc_rp[l] += h * load(w[l]);
                }
            }
        }
    }
    float_epilogue(&acc, epilogue, out, masks);
}

/// The float kernels' epilogue: each sum times the item's scale when there are scales, plus the
/// bias; stored, and flagged against the row's bar.
#[inline(always)]
fn float_epilogue<const R: usize, const P: usize>(
    acc: &[[[f32; 8]; P]; R],
    epilogue: &Epilogue<'_>,
    out: &mut [f32],
    masks: &mut [u8],
) {
    for (r, acc_r) in acc.iter().enumerate() {
        for (p, acc_rp) in acc_r.iter().enumerate() {
            let mut mask = 0u8;
            for (l, &dot) in acc_rp.iter().enumerate() {
                let item = p * 8 + l;
                let score = if epilogue.scales.is_empty() {
                    dot + epilogue.bias[item]
                } else {
                    dot * epilogue.scales[item] + epilogue.bias[item]
                };
                out[r * P * 8 + item] = score;
                if score > epilogue.bars[r] {
                    mask |= 1 << l;
                }
            }
            masks[r * P + p] = mask;
        }
    }
}

fn f32_k<const R: usize, const P: usize>(
    h: &[f32],
    d: usize,
    w: &[f32],
    e: &Epilogue<'_>,
    out: &mut [f32],
    m: &mut [u8],
) {
    panels::<R, P, f32>(h, d, w, e, out, m, |x| x)
}

fn f16_k<const R: usize, const P: usize>(
    h: &[f32],
    d: usize,
    w: &[u16],
    e: &Epilogue<'_>,
    out: &mut [f32],
    m: &mut [u8],
) {
    panels::<R, P, u16>(h, d, w, e, out, m, |x| half::f16::from_bits(x).to_f32())
}

/// bfloat16 activations x bfloat16 weight pairs: per pair, the odd feature's product and then the
/// even one's added to the f32 sum. Each product of two bfloat16 values is exact in f32, so
/// `acc + a * w` rounds once, as a fused multiply-add and `vdpbf16ps` do: the SIMD paths' bits.
fn bf16_k<const R: usize, const P: usize>(
    h: crate::Bf16Rows<'_>,
    d: usize,
    w: &[u16],
    e: &Epilogue<'_>,
    out: &mut [f32],
    m: &mut [u8],
) {
    use crate::packed::bf16_to_f32 as f;
    let pairs = d.div_ceil(2);
    let width = pairs * 2;
    let mut acc = [[[0f32; 8]; P]; R];
    for jp in 0..pairs {
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let h = h.bits;
            let (even, odd) = (f(h[r * width + 2 * jp]), f(h[r * width + 2 * jp + 1]));
            for (p, acc_rp) in acc_r.iter_mut().enumerate() {
                let base = p * pairs * 16 + jp * 16;
                for (l, a) in acc_rp.iter_mut().enumerate() {
                    *a += odd * f(w[base + 2 * l + 1]);
                    *a += even * f(w[base + 2 * l]);
                }
            }
        }
    }
    float_epilogue(&acc, e, out, m);
}

/// Exact integer dot products of int16 activations with int8 weight pairs; same epilogue arithmetic
/// as the SIMD version (`acc as f32 * (scale * row_scale) + bias`), so results are bit-identical.
fn i8_k<const R: usize, const P: usize>(
    h: &[i16],
    d: usize,
    w: &[i8],
    e: &Epilogue<'_>,
    out: &mut [f32],
    m: &mut [u8],
) {
    let pairs = d.div_ceil(2);
    let width = pairs * 2;
    let mut acc = [[[0i32; 8]; P]; R];
    for jp in 0..pairs {
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let (h0, h1) = (
                h[r * width + 2 * jp] as i32,
                h[r * width + 2 * jp + 1] as i32,
            );
            for (p, acc_rp) in acc_r.iter_mut().enumerate() {
                let base = p * pairs * 16 + jp * 16;
                for (l, a) in acc_rp.iter_mut().enumerate() {
                    *a += w[base + 2 * l] as i32 * h0 + w[base + 2 * l + 1] as i32 * h1;
                }
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (p, acc_rp) in acc_r.iter().enumerate() {
            let mut mask = 0u8;
            for (l, &dot) in acc_rp.iter().enumerate() {
                let item = p * 8 + l;
                let scale = e.scales[item] * e.row_scales[r];
                let score = dot as f32 * scale + e.bias[item];
                out[r * P * 8 + item] = score;
                if score > e.bars[r] {
                    mask |= 1 << l;
                }
            }
            m[r * P + p] = mask;
        }
    }
}

pub(super) static TABLE: KernelTable = kernel_table!(
    Isa::Scalar,
    f32_k,
    f16_k,
    bf16_k,
    i8_k,
    super::Elementwise {
        gelu: super::portable::gelu_erf_inplace,
        tanh: super::portable::tanh_inplace,
        silu: super::portable::silu_inplace,
        softmax: super::portable::softmax,
        layer_norm: super::portable::layer_norm_rows,
        add_rows: super::portable::add_rows,
        add_rows_bf16: super::portable::add_rows_bf16,
    },
    super::attention::portable
);
