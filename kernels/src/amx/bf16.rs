//! bf16 on tiles: weights in B tiles, activations rounded into A tiles, the product and the
//! 32 x 32 blocks a scan selects from (`TDPBF16PS`).

#[cfg(target_arch = "x86_64")]
use std::arch::asm;

use super::{check_blocks, BTiles, TileBuffer, TileClaim, TileConfig, BLOCK_OUTPUTS, TILE_ROWS};

/// bf16 values in a row of an A tile: the depth one `TDPBF16PS` adds up.
pub const TILE_DEPTH_BF16: usize = 32;

/// A weight matrix in bf16 B tiles ([`BTiles`]): per block of 16 outputs and 32 inputs, tile row
/// `p` holds the 16 outputs' weights of inputs `2p` and `2p + 1` side by side.
pub type AmxBf16Weights = BTiles<u16>;

/// bf16 values in one B tile.
const TILE_BF16: usize = TILE_ROWS * TILE_DEPTH_BF16;
const _: () = assert!(AmxBf16Weights::DEPTH == TILE_DEPTH_BF16);

impl AmxBf16Weights {
    /// Rounds `w` (`[n, k]`, row-major) to bf16 (nearest, ties to even) and packs it.
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weights are [{n}, {k}]");
        Self::pack_bits(n, k, |j, i| crate::bf16::round_to_bf16(w[j * k + i]))
    }

    /// Packs the bf16 bits `value(output, input)` of an `[n, k]` matrix.
    pub fn pack_bits(n: usize, k: usize, value: impl Fn(usize, usize) -> u16) -> Self {
        Self::pack_with(n, k, value)
    }
}

/// `x` (`[m, k]` f32) as bf16 rows of [`AmxBf16Weights::padded_k`] values (nearest, ties to
/// even; the padding zeros), the activations [`gemm_bf16`] takes, each row on a cache line.
pub fn bf16_rows(x: &[f32], m: usize, k: usize, padded_k: usize) -> TileBuffer<u16> {
    assert_eq!(x.len(), m * k, "activations are [{m}, {k}]");
    assert!(padded_k >= k);
    let mut rows = TileBuffer::zeroed(m * padded_k);
    // A dense layer's whole input comes through here (a BERT4Rec batch: millions of values per
    // layer; scalar, this was an eighth of its time on tiles), so it runs vectorised.
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512bw") {
        // SAFETY: AVX-512 F and BW were detected on this CPU just above (every CPU with AMX
        // has them).
        unsafe { round_rows_avx512(x, k, padded_k, &mut rows) };
        return rows;
    }
    crate::bf16::round_rows_padded(x, k, padded_k, &mut rows);
    rows
}

/// [`crate::bf16::round_rows_padded`] compiled for AVX-512.
///
/// # Safety
/// The CPU must have AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn round_rows_avx512(x: &[f32], k: usize, padded_k: usize, out: &mut [u16]) {
    crate::bf16::round_rows_padded(x, k, padded_k, out)
}

/// `out[m, n] = x[m, k] . w^T` on AMX tiles: `x` as [`bf16_rows`] gives it, `out` row-major.
/// Errors (never a tile instruction) when AMX is not [`available`](super::available) or a slice has the wrong size.
pub fn gemm_bf16(x: &[u16], m: usize, w: &AmxBf16Weights, out: &mut [f32]) -> Result<(), String> {
    let claim = TileClaim::new()?;
    let padded_k = w.padded_k();
    if x.len() != m * padded_k {
        return Err(format!(
            "activations hold {} bf16, [{m}, {padded_k}] needs {}",
            x.len(),
            m * padded_k
        ));
    }
    if out.len() != m * w.n {
        return Err(format!(
            "the output holds {} floats, [{m}, {}] needs {}",
            out.len(),
            w.n,
            m * w.n
        ));
    }
    #[cfg(target_arch = "x86_64")]
    gemm_bf16_tiles(&claim, x, m, w, out);
    drop(claim);
    Ok(())
}

/// Tiles: C in tmm0, A in tmm1, B in tmm2; per block of up to 16 rows and 16 outputs, the depth
/// in steps of 32, the C tile stored into a block buffer and its live part copied out.
#[cfg(target_arch = "x86_64")]
fn gemm_bf16_tiles(claim: &TileClaim, x: &[u16], m: usize, w: &AmxBf16Weights, out: &mut [f32]) {
    let padded_k = w.padded_k();
    let k_blocks = padded_k / TILE_DEPTH_BF16;
    let mut block = [0f32; TILE_ROWS * 16];
    for row0 in (0..m).step_by(TILE_ROWS) {
        let rows = (m - row0).min(TILE_ROWS);
        let config = TileConfig::new()
            .with_tile(0, rows, 64)
            .with_tile(1, rows, 64)
            .with_tile(2, TILE_ROWS, 64);
        claim.configure(&config);
        for jb in 0..w.n.div_ceil(16) {
            // SAFETY: tile 0 is configured above (`claim.configure`).
            unsafe { asm!("tilezero tmm0", options(nostack, nomem)) };
            for kb in 0..k_blocks {
                let a = &x[row0 * padded_k + kb * TILE_DEPTH_BF16..];
                let b = w.tile(jb, kb);
                // A tile `rows` x 64 bytes from rows `padded_k` bf16 apart: the last row read
                // ends at (rows - 1) * padded_k + 32 bf16, within `x` ([m, padded_k]); the B
                // tile is 16 x 64 contiguous bytes, all of `b`.
                debug_assert!(a.len() >= (rows - 1) * padded_k + TILE_DEPTH_BF16);
                debug_assert_eq!(b.len(), TILE_BF16);
                // SAFETY: the bounds above: every byte the loads read lies in `x` or `b`; tiles
                // 1 and 2 are configured for these shapes; tdpbf16ps's operands agree with the
                // configuration (C rows = A rows, A bytes = 4 x B rows, C bytes = B bytes).
                unsafe {
                    asm!(
                        "tileloadd tmm1, [{a} + {lda}*1]",
                        "tileloadd tmm2, [{b} + {ldb}*1]",
                        "tdpbf16ps tmm0, tmm1, tmm2",
                        a = in(reg) a.as_ptr(),
                        lda = in(reg) padded_k * 2,
                        b = in(reg) b.as_ptr(),
                        ldb = in(reg) 64usize,
                        options(nostack, readonly),
                    )
                };
            }
            // SAFETY: tile 0 holds `rows` rows of 64 bytes: the store writes rows x 64 bytes,
            // within `block` (16 x 64 bytes).
            unsafe {
                asm!(
                    "tilestored [{c} + {ldc}*1], tmm0",
                    c = in(reg) block.as_mut_ptr(),
                    ldc = in(reg) 64usize,
                    options(nostack),
                )
            };
            let cols = (w.n - jb * 16).min(16);
            for r in 0..rows {
                out[(row0 + r) * w.n + jb * 16..][..cols].copy_from_slice(&block[r * 16..][..cols]);
            }
        }
    }
}

/// Rows of the activations one [`for_each_block_bf16`] call multiplies: two A tiles.
pub const BLOCK_ROWS: usize = 2 * TILE_ROWS;
/// One block's products, `[BLOCK_ROWS][BLOCK_OUTPUTS]` f32 (rows past the call's are garbage).
pub type Bf16Block = [f32; BLOCK_ROWS * BLOCK_OUTPUTS];

/// For each block `b` of `blocks` (32 outputs each: outputs `32 b ..`), the products of up to 32
/// activation rows with them, handed to `each(b, &block)` with row `r`'s output `32 b + c` at
/// `block[32 r + c]`. The rows are `x` ([`bf16_rows`] of `rows` rows at `w`'s padded depth);
/// no product leaves the tiles but the 4 KiB block, so a scan can select from it as it goes.
///
/// Two A tiles (rows 0-15, 16-31) by two B tiles make four accumulators, so each tile loaded
/// feeds two multiplications; the tile configuration is loaded once per call. Errors (never a
/// tile instruction) when AMX is not [`available`](super::available), this thread's tiles are already in use
/// (`each` itself calling a tile routine), or the shapes disagree.
pub fn for_each_block_bf16(
    x: &[u16],
    rows: usize,
    w: &AmxBf16Weights,
    blocks: std::ops::Range<usize>,
    mut each: impl FnMut(usize, &Bf16Block),
) -> Result<(), String> {
    let claim = TileClaim::new()?;
    let padded_k = w.padded_k();
    if padded_k == 0 {
        return Err("weights of no inputs have no blocks to multiply".into());
    }
    if !(1..=BLOCK_ROWS).contains(&rows) {
        return Err(format!("a block takes 1-{BLOCK_ROWS} rows, not {rows}"));
    }
    if x.len() != rows * padded_k {
        return Err(format!(
            "activations hold {} bf16, [{rows}, {padded_k}] needs {}",
            x.len(),
            rows * padded_k
        ));
    }
    check_blocks(&blocks, w.output_blocks())?;
    #[cfg(target_arch = "x86_64")]
    {
        let (upper, lower) = (rows.min(TILE_ROWS), rows.saturating_sub(TILE_ROWS));
        let mut config = TileConfig::new()
            .with_tile(0, upper, 64)
            .with_tile(1, upper, 64)
            .with_tile(4, upper, 64)
            .with_tile(6, TILE_ROWS, 64)
            .with_tile(7, TILE_ROWS, 64);
        if lower > 0 {
            config = config
                .with_tile(2, lower, 64)
                .with_tile(3, lower, 64)
                .with_tile(5, lower, 64);
        }
        claim.configure(&config);
        let k_blocks = padded_k / TILE_DEPTH_BF16;
        let mut block: Bf16Block = [0.0; BLOCK_ROWS * BLOCK_OUTPUTS];
        for b in blocks {
            let b0 = w.tile(2 * b, 0);
            let b1 = w.tile(2 * b + 1, 0);
            // Each B pointer walks `k_blocks` consecutive 1 KiB tiles (one output block's
            // depth), each A pointer `k_blocks` steps of 64 bytes along its rows.
            debug_assert!(w.tiles.len() >= ((2 * b + 2) * k_blocks) * TILE_BF16);
            let (a0, stride) = (x.as_ptr(), padded_k * 2);
            if lower > 0 {
                // SAFETY: tiles 0-7 are configured above for these shapes (C: `upper` or
                // `lower` rows of 16 f32; A: the same rows of 32 bf16; B: 16 rows of 16 pairs),
                // so every product's shapes agree. Loads: A tile 4 reads rows 0..16 and tile 5
                // rows 16..rows of `x`, each row 64 bytes at column 32 kb (kb < k_blocks),
                // within the row's `padded_k` bf16; B tiles read output blocks 2b and 2b + 1's
                // tiles, within `w.tiles` (checked above). Stores: four C tiles of at most 16
                // rows of 64 bytes, 128 bytes apart, at (0, 0), (0, 16), (16, 0), (16, 16) of
                // `block` (32 x 32 f32).
                unsafe {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tilezero tmm2",
                        "tilezero tmm3",
                        "2:",
                        "tileloadd tmm4, [{a0} + {lda}*1]",
                        "tileloadd tmm6, [{b0} + {ldb}*1]",
                        "tileloadd tmm7, [{b1} + {ldb}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tileloadd tmm5, [{a1} + {lda}*1]",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        "add {a0}, 64",
                        "add {a1}, 64",
                        "add {b0}, 1024",
                        "add {b1}, 1024",
                        "dec {kb}",
                        "jnz 2b",
                        "tilestored [{c} + {ldc}*1], tmm0",
                        "tilestored [{c} + {ldc}*1 + 64], tmm1",
                        "tilestored [{c} + {ldc}*1 + 2048], tmm2",
                        "tilestored [{c} + {ldc}*1 + 2112], tmm3",
                        a0 = inout(reg) a0 => _,
                        a1 = inout(reg) a0.add(TILE_ROWS * padded_k) => _,
                        b0 = inout(reg) b0.as_ptr() => _,
                        b1 = inout(reg) b1.as_ptr() => _,
                        kb = inout(reg) k_blocks => _,
                        lda = in(reg) stride,
                        ldb = in(reg) 64usize,
                        c = in(reg) block.as_mut_ptr(),
                        ldc = in(reg) 128usize,
                        options(nostack),
                    )
                };
            } else {
                // SAFETY: as above, with the upper tiles only (A tile 4: `rows` rows of `x`;
                // C tiles 0 and 1 stored at (0, 0) and (0, 16) of `block`).
                unsafe {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "2:",
                        "tileloadd tmm4, [{a0} + {lda}*1]",
                        "tileloadd tmm6, [{b0} + {ldb}*1]",
                        "tileloadd tmm7, [{b1} + {ldb}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "add {a0}, 64",
                        "add {b0}, 1024",
                        "add {b1}, 1024",
                        "dec {kb}",
                        "jnz 2b",
                        "tilestored [{c} + {ldc}*1], tmm0",
                        "tilestored [{c} + {ldc}*1 + 64], tmm1",
                        a0 = inout(reg) a0 => _,
                        b0 = inout(reg) b0.as_ptr() => _,
                        b1 = inout(reg) b1.as_ptr() => _,
                        kb = inout(reg) k_blocks => _,
                        lda = in(reg) stride,
                        ldb = in(reg) 64usize,
                        c = in(reg) block.as_mut_ptr(),
                        ldc = in(reg) 128usize,
                        options(nostack),
                    )
                };
            }
            each(b, &block);
        }
    }
    drop(claim);
    Ok(())
}

/// The tile unit's bf16 rate on this core, in multiply-adds a second: `iterations` rounds of
/// the scan's four products (two A tiles by two B tiles into four accumulators, as
/// [`for_each_block_bf16`] runs them) on tiles loaded once, so no memory is read in the timed
/// loop: the ceiling the scans' rates are judged against (`kernel_probe amx-peak`). Errors where
/// this CPU or process cannot run tiles.
pub fn bf16_peak_macs_per_second(iterations: usize) -> Result<f64, String> {
    let claim = TileClaim::new()?;
    #[cfg(target_arch = "x86_64")]
    {
        let config = (0..8).fold(TileConfig::new(), |c, t| c.with_tile(t, TILE_ROWS, 64));
        claim.configure(&config);
        // Small normal values (bf16 0.5 and 0.25): no denormal or overflow path in the unit.
        let a: Vec<u16> = vec![0x3f00; TILE_BF16];
        let b: Vec<u16> = vec![0x3e80; TILE_BF16];
        let rounds = iterations.max(1);
        let start = std::time::Instant::now();
        // SAFETY: tiles 0-7 are configured as 16 rows of 64 bytes; the loads read 16 rows of
        // 64 bytes, 64 bytes apart, from `a` and `b` (1 KiB each); the products' shapes agree
        // (16 x 32 bf16 by 16 pairs x 16); the loop count is at least 1.
        unsafe {
            asm!(
                "tileloadd tmm4, [{a} + {ld}*1]",
                "tileloadd tmm5, [{a} + {ld}*1]",
                "tileloadd tmm6, [{b} + {ld}*1]",
                "tileloadd tmm7, [{b} + {ld}*1]",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "dec {n}",
                "jnz 2b",
                a = in(reg) a.as_ptr(),
                b = in(reg) b.as_ptr(),
                ld = in(reg) 64usize,
                n = inout(reg) rounds => _,
                options(nostack, readonly),
            )
        };
        let seconds = start.elapsed().as_secs_f64();
        drop(claim);
        let macs = rounds as f64 * 4.0 * (TILE_ROWS * TILE_ROWS * TILE_DEPTH_BF16) as f64;
        Ok(macs / seconds)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (claim, iterations);
        Err("AMX tiles exist on x86-64 only".into())
    }
}
