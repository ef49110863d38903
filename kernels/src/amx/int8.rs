//! int8 on tiles: weights in B tiles, int16 activations split into their low and high bytes,
//! both products exact (`TDPBUSD`, `TDPBSSD`), and the blocks the exact screen selects from.

#[cfg(target_arch = "x86_64")]
use std::arch::asm;

use super::{check_blocks, BTiles, TileBuffer, TileClaim, TileConfig, BLOCK_OUTPUTS, TILE_ROWS};

/// int8 values in a row of an A tile: the depth one `TDPBUSD` / `TDPBSSD` adds up.
pub const TILE_DEPTH_I8: usize = 64;

/// An int8 weight matrix in B tiles ([`BTiles`]): per block of 16 outputs and 64 inputs, tile row
/// `p` holds each output's weights of inputs `4p .. 4p + 4` side by side.
pub type AmxI8Weights = BTiles<i8>;

/// int8 values in one B tile.
const TILE_I8: usize = TILE_ROWS * TILE_DEPTH_I8;
const _: () = assert!(AmxI8Weights::DEPTH == TILE_DEPTH_I8);

impl AmxI8Weights {
    pub fn pack(w: &[i8], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weights are [{n}, {k}]");
        Self::pack_values(n, k, |j, i| w[j * k + i])
    }

    /// Packs the int8 weights `value(output, input)` of an `[n, k]` matrix.
    pub fn pack_values(n: usize, k: usize, value: impl Fn(usize, usize) -> i8) -> Self {
        Self::pack_with(n, k, value)
    }
}

/// int16 activations as AMX-INT8 multiplies them: each value split exactly into a low byte
/// (unsigned, `TDPBUSD`'s A operand) and a high byte (signed, `TDPBSSD`'s), `x = 256 hi + lo`, in
/// rows of `padded_k` (zeros past `k`), each on a cache line. The products of both halves with int8 weights add up to
/// the int16 x int8 dot product exactly, so a screen's certified bound is unchanged.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitI16Rows {
    pub m: usize,
    pub padded_k: usize,
    low: TileBuffer<u8>,
    high: TileBuffer<i8>,
}

impl SplitI16Rows {
    /// Rows of zeros follow the `m` rows up to a whole number of A tiles, so every tile routine
    /// loads 16-row tiles whatever the batch.
    pub fn new(x: &[i16], m: usize, k: usize, padded_k: usize) -> Self {
        assert_eq!(x.len(), m * k, "activations are [{m}, {k}]");
        assert!(padded_k >= k);
        let stored = m.div_ceil(TILE_ROWS) * TILE_ROWS * padded_k;
        let (mut low, mut high) = (TileBuffer::zeroed(stored), TileBuffer::zeroed(stored));
        for r in 0..m {
            for (i, &v) in x[r * k..(r + 1) * k].iter().enumerate() {
                low[r * padded_k + i] = (v & 0xff) as u8;
                high[r * padded_k + i] = (v >> 8) as i8;
            }
        }
        SplitI16Rows {
            m,
            padded_k,
            low,
            high,
        }
    }
}

/// Rows of one row group of [`for_each_block_i8`]: one A tile (its low and high bytes take two).
pub const I8_BLOCK_ROWS: usize = TILE_ROWS;

/// One row group's sums of one block of [`for_each_block_i8`], each
/// `[I8_BLOCK_ROWS][BLOCK_OUTPUTS]` i32 (rows past the activations' are zeros): the low bytes'
/// products and the high bytes' (to be taken 256 times). The int16 x int8 dot product of the
/// group's row `r` and the block's output `c` is `256 high[32 r + c] + low[32 r + c]` (wrapping,
/// as the SIMD kernels' i32 accumulators).
#[repr(C, align(64))]
pub struct I8Block {
    pub low: [i32; I8_BLOCK_ROWS * BLOCK_OUTPUTS],
    pub high: [i32; I8_BLOCK_ROWS * BLOCK_OUTPUTS],
}

/// For each block `b` of `blocks` (32 outputs each: outputs `32 b ..`) and each group of 16 rows
/// of `x` (rows `16 g ..`), the int16 x int8 sums of the group's rows with the block's outputs,
/// handed to `each(b, g, &block)` as [`I8Block`] lays them out. No sum leaves the tiles but the
/// block, so a scan can select from it as it goes.
///
/// The A tiles (a group's low and high bytes) by two B tiles make four accumulators. The blocks
/// are the outer loop: a block's weights come from memory or L2 once and from L1 for every
/// later row group (with the groups outside, each group read them from L2 again, and the
/// multiplier waited on those loads: 128 ns a block at d = 64, 4x its arithmetic). `prefetch`:
/// how many bytes of weights ahead of each block to request into the cache (0: none), for
/// weights read from memory. The tile configuration is loaded once per call. Errors (never a
/// tile instruction) when AMX is not [`available`](super::available), this thread's tiles are already in use, or
/// the shapes disagree.
pub fn for_each_block_i8(
    x: &SplitI16Rows,
    w: &AmxI8Weights,
    blocks: std::ops::Range<usize>,
    prefetch: usize,
    mut each: impl FnMut(usize, usize, &I8Block),
) -> Result<(), String> {
    let claim = TileClaim::new()?;
    if x.padded_k != w.padded_k() || x.padded_k == 0 {
        return Err(format!(
            "activations of {} inputs a row, weights of {} (padded; both must be above 0)",
            x.padded_k,
            w.padded_k()
        ));
    }
    check_blocks(&blocks, w.output_blocks())?;
    #[cfg(target_arch = "x86_64")]
    {
        let mut config = TileConfig::new();
        for tile in 0..8 {
            config = config.with_tile(tile, TILE_ROWS, 64);
        }
        claim.configure(&config);
        let k_blocks = x.padded_k / TILE_DEPTH_I8;
        let groups = x.m.div_ceil(TILE_ROWS);
        // The A tiles read 16 rows of 64 bytes `padded_k` apart, k_blocks steps along them, from
        // each group's first row: within the stored rows (whole groups of 16).
        assert!(x.low.len() >= groups * TILE_ROWS * x.padded_k);
        assert!(x.high.len() >= groups * TILE_ROWS * x.padded_k);
        let mut block = I8Block {
            low: [0; I8_BLOCK_ROWS * BLOCK_OUTPUTS],
            high: [0; I8_BLOCK_ROWS * BLOCK_OUTPUTS],
        };
        let block_bytes = 2 * k_blocks * TILE_I8;
        for b in blocks {
            // Each B pointer walks `k_blocks` consecutive 1 KiB tiles (one output block's depth).
            assert!(w.tiles.len() >= (2 * b + 2) * k_blocks * TILE_I8);
            if prefetch > 0 {
                let ahead = 2 * b * k_blocks * TILE_I8 + prefetch;
                if let Some(lines) = w.tiles.get(ahead..(ahead + block_bytes).min(w.tiles.len())) {
                    for line in lines.chunks(64) {
                        // SAFETY: a prefetch reads nothing architecturally; the address is
                        // within `w.tiles` all the same.
                        unsafe {
                            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                                line.as_ptr(),
                            )
                        };
                    }
                }
            }
            let (b0, b1) = (w.tile(2 * b, 0), w.tile(2 * b + 1, 0));
            if k_blocks == 1 {
                // One tile of depth: the block's two B tiles serve every row group as loaded
                // once (tile registers are not renamed, so reloading them per group waited for
                // the previous group's products to finish reading them).
                // SAFETY: tiles 6 and 7 are configured as 16 rows of 64 bytes; each load reads
                // one 1 KiB tile of `w.tiles` (asserted above). `each` cannot touch the tiles in
                // between: a tile routine it calls is refused by the claim before any tile
                // instruction.
                unsafe {
                    asm!(
                        "tileloadd tmm6, [{b0} + {ldb}*1]",
                        "tileloadd tmm7, [{b1} + {ldb}*1]",
                        b0 = in(reg) b0.as_ptr(),
                        b1 = in(reg) b1.as_ptr(),
                        ldb = in(reg) 64usize,
                        options(nostack, readonly),
                    )
                };
                for g in 0..groups {
                    let at = g * TILE_ROWS * x.padded_k;
                    // SAFETY: as in the general loop below, with B in tiles 6 and 7 already.
                    unsafe {
                        asm!(
                            "tileloadd tmm4, [{lo} + {lda}*1]",
                            "tileloadd tmm5, [{hi} + {lda}*1]",
                            "tilezero tmm0",
                            "tilezero tmm1",
                            "tilezero tmm2",
                            "tilezero tmm3",
                            "tdpbusd tmm0, tmm4, tmm6",
                            "tdpbusd tmm1, tmm4, tmm7",
                            "tdpbssd tmm2, tmm5, tmm6",
                            "tdpbssd tmm3, tmm5, tmm7",
                            "tilestored [{cl} + {ldc}*1], tmm0",
                            "tilestored [{cl} + {ldc}*1 + 64], tmm1",
                            "tilestored [{ch} + {ldc}*1], tmm2",
                            "tilestored [{ch} + {ldc}*1 + 64], tmm3",
                            lo = in(reg) x.low[at..].as_ptr(),
                            hi = in(reg) x.high[at..].as_ptr(),
                            lda = in(reg) x.padded_k,
                            cl = in(reg) block.low.as_mut_ptr(),
                            ch = in(reg) block.high.as_mut_ptr(),
                            ldc = in(reg) 128usize,
                            options(nostack),
                        )
                    };
                    each(b, g, &block);
                }
                continue;
            }
            for g in 0..groups {
                let at = g * TILE_ROWS * x.padded_k;
                // SAFETY: all eight tiles are configured above as 16 rows of 64 bytes, so both
                // products' shapes agree (C rows = A rows, A bytes = 4 x B rows, C bytes = B
                // bytes). Loads: the A tiles stay within the stored rows (asserted above), the B
                // tiles within output blocks 2b and 2b + 1's tiles (asserted). Stores: four C
                // tiles of 16 rows of 64 bytes, 128 bytes apart, at columns 0 and 16 of
                // `block.low` and `block.high` (16 x 32 i32 each).
                unsafe {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tilezero tmm2",
                        "tilezero tmm3",
                        "2:",
                        "tileloadd tmm4, [{lo} + {lda}*1]",
                        "tileloadd tmm6, [{b0} + {ldb}*1]",
                        "tileloadd tmm7, [{b1} + {ldb}*1]",
                        "tdpbusd tmm0, tmm4, tmm6",
                        "tdpbusd tmm1, tmm4, tmm7",
                        "tileloadd tmm5, [{hi} + {lda}*1]",
                        "tdpbssd tmm2, tmm5, tmm6",
                        "tdpbssd tmm3, tmm5, tmm7",
                        "add {lo}, 64",
                        "add {hi}, 64",
                        "add {b0}, 1024",
                        "add {b1}, 1024",
                        "dec {kb}",
                        "jnz 2b",
                        "tilestored [{cl} + {ldc}*1], tmm0",
                        "tilestored [{cl} + {ldc}*1 + 64], tmm1",
                        "tilestored [{ch} + {ldc}*1], tmm2",
                        "tilestored [{ch} + {ldc}*1 + 64], tmm3",
                        lo = inout(reg) x.low[at..].as_ptr() => _,
                        hi = inout(reg) x.high[at..].as_ptr() => _,
                        b0 = inout(reg) b0.as_ptr() => _,
                        b1 = inout(reg) b1.as_ptr() => _,
                        kb = inout(reg) k_blocks => _,
                        lda = in(reg) x.padded_k,
                        ldb = in(reg) 64usize,
                        cl = in(reg) block.low.as_mut_ptr(),
                        ch = in(reg) block.high.as_mut_ptr(),
                        ldc = in(reg) 128usize,
                        options(nostack),
                    )
                };
                each(b, g, &block);
            }
        }
    }
    drop(claim);
    Ok(())
}

/// `out[m, n] = x[m, k] . w^T` in i32 (wrapping, as the SIMD kernels' i32 accumulators), exact:
/// two AMX-INT8 products per tile, the low bytes' and the high bytes' (times 256). Errors
/// (never a tile instruction) when AMX is not [`available`](super::available) or the shapes disagree.
pub fn gemm_i16_i8(x: &SplitI16Rows, w: &AmxI8Weights, out: &mut [i32]) -> Result<(), String> {
    let claim = TileClaim::new()?;
    if x.padded_k != w.padded_k() {
        return Err(format!(
            "activations of {} inputs a row, weights of {} (padded)",
            x.padded_k,
            w.padded_k()
        ));
    }
    if out.len() != x.m * w.n {
        return Err(format!(
            "the output holds {} values, [{}, {}] needs {}",
            out.len(),
            x.m,
            w.n,
            x.m * w.n
        ));
    }
    #[cfg(target_arch = "x86_64")]
    gemm_i16_i8_tiles(&claim, x, w, out);
    drop(claim);
    Ok(())
}

/// Tiles: the low bytes' sums in tmm0, the high bytes' in tmm1, A's low and high bytes in tmm2
/// and tmm3, B in tmm4.
#[cfg(target_arch = "x86_64")]
fn gemm_i16_i8_tiles(claim: &TileClaim, x: &SplitI16Rows, w: &AmxI8Weights, out: &mut [i32]) {
    let k_blocks = x.padded_k / TILE_DEPTH_I8;
    let (mut low_sums, mut high_sums) = ([0i32; TILE_ROWS * 16], [0i32; TILE_ROWS * 16]);
    for row0 in (0..x.m).step_by(TILE_ROWS) {
        let rows = (x.m - row0).min(TILE_ROWS);
        let config = TileConfig::new()
            .with_tile(0, rows, 64)
            .with_tile(1, rows, 64)
            .with_tile(2, rows, 64)
            .with_tile(3, rows, 64)
            .with_tile(4, TILE_ROWS, 64);
        claim.configure(&config);
        for jb in 0..w.n.div_ceil(16) {
            // SAFETY: tiles 0 and 1 are configured above.
            unsafe { asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem)) };
            for kb in 0..k_blocks {
                let at = row0 * x.padded_k + kb * TILE_DEPTH_I8;
                let (low, high) = (&x.low[at..], &x.high[at..]);
                let b = w.tile(jb, kb);
                // The A tiles read `rows` rows of 64 bytes `padded_k` apart from `at`: the last
                // ends at (rows - 1) * padded_k + 64, within the [m, padded_k] rows.
                debug_assert!(low.len() >= (rows - 1) * x.padded_k + TILE_DEPTH_I8);
                debug_assert_eq!(b.len(), TILE_I8);
                // SAFETY: the bounds above; the configured shapes agree with both products (C
                // rows = A rows, A bytes = 4 x B rows, C bytes = B bytes).
                unsafe {
                    asm!(
                        "tileloadd tmm2, [{low} + {lda}*1]",
                        "tileloadd tmm3, [{high} + {lda}*1]",
                        "tileloadd tmm4, [{b} + {ldb}*1]",
                        "tdpbusd tmm0, tmm2, tmm4",
                        "tdpbssd tmm1, tmm3, tmm4",
                        low = in(reg) low.as_ptr(),
                        high = in(reg) high.as_ptr(),
                        lda = in(reg) x.padded_k,
                        b = in(reg) b.as_ptr(),
                        ldb = in(reg) 64usize,
                        options(nostack, readonly),
                    )
                };
            }
            // SAFETY: tiles 0 and 1 hold `rows` rows of 64 bytes, within the 16 x 64-byte
            // buffers.
            unsafe {
                asm!(
                    "tilestored [{low} + {ldc}*1], tmm0",
                    "tilestored [{high} + {ldc}*1], tmm1",
                    low = in(reg) low_sums.as_mut_ptr(),
                    high = in(reg) high_sums.as_mut_ptr(),
                    ldc = in(reg) 64usize,
                    options(nostack),
                )
            };
            let cols = (w.n - jb * 16).min(16);
            for r in 0..rows {
                let dst = &mut out[(row0 + r) * w.n + jb * 16..][..cols];
                for ((d, &lo), &hi) in dst
                    .iter_mut()
                    .zip(&low_sums[r * 16..])
                    .zip(&high_sums[r * 16..])
                {
                    *d = hi.wrapping_mul(256).wrapping_add(lo);
                }
            }
        }
    }
}
