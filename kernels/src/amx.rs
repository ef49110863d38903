//! AMX tiles: the matrix unit of Intel Xeons since Sapphire Rapids (eight 1 KiB tile registers
//! and a multiplier of bf16 or int8 tiles into f32 or i32 tiles).
//!
//! Rust's AMX intrinsics are not stable, so the instructions are inline assembly behind a small
//! safe layer: [`availability`] (CPUID and Linux's permission for the tile data, asked once per
//! process), [`TileConfig`] and the bf16 product [`gemm_bf16`], which checks every slice and
//! shape before a tile is touched. The layout follows the instruction set: an A tile holds up to
//! 16 rows of 32 bf16 (64 bytes), a B tile 16 rows of 16 column pairs (each pair two consecutive
//! `k` of one output column: [`AmxBf16Weights`]), a C tile 16 rows of 16 f32.
//!
//! `TDPBF16PS` multiplies bf16 pairs exactly (a bf16 product fits an f32) and adds them into
//! f32 accumulators, flushing denormal inputs and results to zero; its order of additions within
//! a pair is the hardware's, so results are checked against f64 within a bound on f32
//! accumulation, not bit for bit (`tests/amx.rs`). Without an AMX CPU the tests run on an
//! emulated Sapphire Rapids (`scripts/amx-emulator.sh`).

#[cfg(target_arch = "x86_64")]
use std::arch::asm;
use std::sync::OnceLock;

/// Rows of a tile, and f32 columns of a C tile.
pub const TILE_ROWS: usize = 16;
/// bf16 values in a row of an A tile: the depth one `TDPBF16PS` adds up.
pub const TILE_DEPTH_BF16: usize = 32;

/// Whether this process can run AMX tiles: `Ok` or the reason it cannot, decided once (CPUID,
/// then Linux's `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, which every process must
/// ask before its first tile instruction).
pub fn availability() -> &'static Result<(), String> {
    static AVAILABILITY: OnceLock<Result<(), String>> = OnceLock::new();
    AVAILABILITY.get_or_init(request_tiles)
}

/// [`availability`] is `Ok`.
pub fn available() -> bool {
    availability().is_ok()
}

/// This thread's tile state, held by one tile routine at a time: the configuration a routine
/// loads is what its tile instructions rely on, so a nested routine (one called from a block
/// callback of [`for_each_block_bf16`]) would silently reconfigure or release it. Claiming
/// refuses that instead, and the guard releases the tiles when the routine ends, panics included.
struct TileClaim {
    /// Tile state is per thread: the claim must not move to another.
    _per_thread: std::marker::PhantomData<*const ()>,
}

thread_local! {
    static TILES_CLAIMED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl TileClaim {
    fn new() -> Result<Self, String> {
        availability().clone()?;
        if TILES_CLAIMED.with(|claimed| claimed.replace(true)) {
            return Err(
                "AMX tiles are already in use on this thread (a tile routine was \
                        called from inside another's callback)"
                    .into(),
            );
        }
        Ok(TileClaim {
            _per_thread: std::marker::PhantomData,
        })
    }

    /// Loads `config` for the claiming routine's tile instructions.
    #[cfg(target_arch = "x86_64")]
    fn configure(&self, config: &TileConfig) {
        // SAFETY: `config` is a valid palette-1 configuration (TileConfig's constructors allow
        // only 1-16 rows of 4-64 bytes) in 64-byte aligned memory, and this process holds the
        // tile permission (a claim exists only where `availability` is Ok).
        unsafe { asm!("ldtilecfg [{0}]", in(reg) config, options(nostack, readonly)) };
    }
}

impl Drop for TileClaim {
    fn drop(&mut self) {
        // SAFETY: the tile permission is held (a claim exists only where `availability` is Ok);
        // TILERELEASE only returns the tile state to its initial, unconfigured state.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            asm!("tilerelease", options(nostack, nomem))
        };
        TILES_CLAIMED.with(|claimed| claimed.set(false));
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tiles() -> Result<(), String> {
    // CPUID.(EAX=7, ECX=0).EDX: AMX-BF16 is bit 22, AMX-TILE bit 24, AMX-INT8 bit 25 (leaf 0
    // says whether leaf 7 exists).
    if std::arch::x86_64::__cpuid(0).eax < 7 {
        return Err("this CPU reports no CPUID leaf 7, so no AMX".into());
    }
    let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
    let (bf16, tile, int8) = (edx >> 22 & 1, edx >> 24 & 1, edx >> 25 & 1);
    if tile == 0 || bf16 == 0 || int8 == 0 {
        return Err(format!(
            "this CPU has no AMX (CPUID AMX-TILE {tile}, AMX-BF16 {bf16}, AMX-INT8 {int8})"
        ));
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_ulong = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes a feature number and touches no user
    // memory; it only grants (or refuses) this process the tile data state.
    let granted = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    if granted != 0 {
        return Err(format!(
            "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: {}); a kernel \
             before 5.16 has no AMX support",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_tiles() -> Result<(), String> {
    Err("AMX tiles are used on Linux x86-64 only".into())
}

/// A palette-1 tile configuration (`LDTILECFG`'s 64-byte operand): each tile's rows and bytes
/// per row.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Every tile unused (0 rows).
    pub fn new() -> Self {
        TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        }
    }

    /// Tile `tile` (0-7) as `rows` (1-16) rows of `bytes` (4-64, a multiple of 4) bytes.
    pub fn with_tile(mut self, tile: usize, rows: usize, bytes: usize) -> Self {
        assert!(tile < 8, "AMX has tiles 0-7, not {tile}");
        assert!(
            (1..=TILE_ROWS).contains(&rows),
            "a tile has 1-16 rows, not {rows}"
        );
        assert!(
            (4..=64).contains(&bytes) && bytes.is_multiple_of(4),
            "a tile row has 4-64 bytes in whole dwords, not {bytes}"
        );
        self.rows[tile] = rows as u8;
        self.bytes_per_row[tile] = bytes as u16;
        self
    }
}

impl Default for TileConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// A `[n, k]` matrix as B tiles of 16 rows x 16 outputs x `per_lane` inputs (2 for bf16, 4 for
/// int8: the values one 32-bit lane holds): per block of 16 outputs and `16 per_lane` inputs, row
/// `p` holds each output's inputs `per_lane p ..` side by side; `value(j, i)` is output `j`'s
/// weight of input `i`, and outputs or inputs past the matrix are zeros.
fn pack_b_tiles<T: Copy + Default>(
    n: usize,
    k: usize,
    per_lane: usize,
    value: impl Fn(usize, usize) -> T,
) -> Vec<T> {
    let (depth, tile_len) = (TILE_ROWS * per_lane, TILE_ROWS * 16 * per_lane);
    let (n_blocks, k_blocks) = (n.div_ceil(16), k.div_ceil(depth));
    let mut tiles = vec![T::default(); n_blocks * k_blocks * tile_len];
    for (tile_index, tile) in tiles.chunks_exact_mut(tile_len).enumerate() {
        let (jb, kb) = (tile_index / k_blocks, tile_index % k_blocks);
        for p in 0..TILE_ROWS {
            for col in 0..16 {
                for lane in 0..per_lane {
                    let (j, i) = (jb * 16 + col, kb * depth + per_lane * p + lane);
                    if j < n && i < k {
                        tile[(p * 16 + col) * per_lane + lane] = value(j, i);
                    }
                }
            }
        }
    }
    tiles
}

/// A weight matrix `[n outputs, k inputs]` (a dense layer's, row-major as PyTorch keeps it) in
/// bf16 B tiles: per block of 16 outputs and 32 inputs, one 1 KiB tile of 16 rows, row `p`
/// holding the 16 outputs' weights of inputs `2p` and `2p + 1` side by side. Outputs and inputs
/// past the matrix are zeros.
#[derive(Clone, Debug, PartialEq)]
pub struct AmxBf16Weights {
    pub n: usize,
    pub k: usize,
    /// `[n blocks][k blocks][16 rows][16 outputs][2]` bf16 bits.
    tiles: Vec<u16>,
}

/// bf16 values in one B tile.
const TILE_BF16: usize = TILE_ROWS * TILE_DEPTH_BF16;

impl AmxBf16Weights {
    /// Rounds `w` (`[n, k]`, row-major) to bf16 (nearest, ties to even) and packs it.
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weights are [{n}, {k}]");
        Self::pack_bits(n, k, |j, i| crate::bf16::round_to_bf16(w[j * k + i]))
    }

    /// Packs the bf16 bits `value(output, input)` of an `[n, k]` matrix. The blocks of 16 outputs
    /// come in whole pairs (a zero block after an odd count), as [`for_each_block_bf16`] reads them.
    pub fn pack_bits(n: usize, k: usize, value: impl Fn(usize, usize) -> u16) -> Self {
        let mut tiles = pack_b_tiles(n, k, 2, value);
        if n.div_ceil(16) % 2 == 1 {
            tiles.resize(tiles.len() + k.div_ceil(TILE_DEPTH_BF16) * TILE_BF16, 0);
        }
        AmxBf16Weights { n, k, tiles }
    }

    /// Blocks of 32 outputs, [`for_each_block_bf16`]'s unit (the last padded with zeros).
    pub fn output_blocks(&self) -> usize {
        self.n.div_ceil(BLOCK_OUTPUTS)
    }

    /// Bytes of the packed tiles.
    pub fn bytes(&self) -> usize {
        self.tiles.len() * 2
    }

    /// Inputs per row of the activations [`gemm_bf16`] takes: `k` rounded up to whole tiles.
    pub fn padded_k(&self) -> usize {
        self.k.div_ceil(TILE_DEPTH_BF16) * TILE_DEPTH_BF16
    }

    fn tile(&self, jb: usize, kb: usize) -> &[u16] {
        let k_blocks = self.k.div_ceil(TILE_DEPTH_BF16);
        &self.tiles[(jb * k_blocks + kb) * TILE_BF16..][..TILE_BF16]
    }
}

/// `x` (`[m, k]` f32) as bf16 rows of [`AmxBf16Weights::padded_k`] values (nearest, ties to
/// even; the padding zeros), the activations [`gemm_bf16`] takes.
pub fn bf16_rows(x: &[f32], m: usize, k: usize, padded_k: usize) -> Vec<u16> {
    assert_eq!(x.len(), m * k, "activations are [{m}, {k}]");
    assert!(padded_k >= k);
    let mut rows = vec![0u16; m * padded_k];
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
/// Errors (never a tile instruction) when AMX is not [`available`] or a slice has the wrong size.
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
/// Outputs of one block: two B tiles.
pub const BLOCK_OUTPUTS: usize = 32;
/// One block's products, `[BLOCK_ROWS][BLOCK_OUTPUTS]` f32 (rows past the call's are garbage).
pub type Bf16Block = [f32; BLOCK_ROWS * BLOCK_OUTPUTS];

/// For each block `b` of `blocks` (32 outputs each: outputs `32 b ..`), the products of up to 32
/// activation rows with them, handed to `each(b, &block)` with row `r`'s output `32 b + c` at
/// `block[32 r + c]`. The rows are `x` ([`bf16_rows`] of `rows` rows at `w`'s padded depth);
/// no product leaves the tiles but the 4 KiB block, so a scan can select from it as it goes.
///
/// Two A tiles (rows 0-15, 16-31) by two B tiles make four accumulators, so each tile loaded
/// feeds two multiplications; the tile configuration is loaded once per call. Errors (never a
/// tile instruction) when AMX is not [`available`], this thread's tiles are already in use
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

/// Refuses a range of output blocks past the weights' `available` blocks.
fn check_blocks(blocks: &std::ops::Range<usize>, available: usize) -> Result<(), String> {
    if blocks.end > available {
        return Err(format!(
            "blocks up to {} asked of weights with {available}",
            blocks.end
        ));
    }
    Ok(())
}

/// int8 values in a row of an A tile: the depth one `TDPBUSD` / `TDPBSSD` adds up.
pub const TILE_DEPTH_I8: usize = 64;

/// An int8 weight matrix `[n outputs, k inputs]` (row-major) in B tiles: per block of 16
/// outputs and 64 inputs, one 1 KiB tile of 16 rows, row `p` holding each output's weights of
/// inputs `4p .. 4p + 4` side by side. Outputs and inputs past the matrix are zeros.
#[derive(Clone, Debug, PartialEq)]
pub struct AmxI8Weights {
    pub n: usize,
    pub k: usize,
    /// `[n blocks][k blocks][16 rows][16 outputs][4]`.
    tiles: Vec<i8>,
}

/// int8 values in one B tile.
const TILE_I8: usize = TILE_ROWS * TILE_DEPTH_I8;

impl AmxI8Weights {
    pub fn pack(w: &[i8], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weights are [{n}, {k}]");
        Self::pack_values(n, k, |j, i| w[j * k + i])
    }

    /// Packs the int8 weights `value(output, input)` of an `[n, k]` matrix. The blocks of 16
    /// outputs come in whole pairs (a zero block after an odd count), as [`for_each_block_i8`]
    /// reads them.
    pub fn pack_values(n: usize, k: usize, value: impl Fn(usize, usize) -> i8) -> Self {
        let mut tiles = pack_b_tiles(n, k, 4, value);
        if n.div_ceil(16) % 2 == 1 {
            tiles.resize(tiles.len() + k.div_ceil(TILE_DEPTH_I8) * TILE_I8, 0);
        }
        AmxI8Weights { n, k, tiles }
    }

    /// Blocks of 32 outputs, [`for_each_block_i8`]'s unit (the last padded with zeros).
    pub fn output_blocks(&self) -> usize {
        self.n.div_ceil(BLOCK_OUTPUTS)
    }

    /// Bytes of the packed tiles.
    pub fn bytes(&self) -> usize {
        self.tiles.len()
    }

    /// Inputs per row of the activations [`gemm_i16_i8`] takes: `k` rounded up to whole tiles.
    pub fn padded_k(&self) -> usize {
        self.k.div_ceil(TILE_DEPTH_I8) * TILE_DEPTH_I8
    }

    fn tile(&self, jb: usize, kb: usize) -> &[i8] {
        let k_blocks = self.k.div_ceil(TILE_DEPTH_I8);
        &self.tiles[(jb * k_blocks + kb) * TILE_I8..][..TILE_I8]
    }
}

/// int16 activations as AMX-INT8 multiplies them: each value split exactly into a low byte
/// (unsigned, `TDPBUSD`'s A operand) and a high byte (signed, `TDPBSSD`'s), `x = 256 hi + lo`, in
/// rows of `padded_k` (zeros past `k`). The products of both halves with int8 weights add up to
/// the int16 x int8 dot product exactly, so a screen's certified bound is unchanged.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitI16Rows {
    pub m: usize,
    pub padded_k: usize,
    low: Vec<u8>,
    high: Vec<i8>,
}

impl SplitI16Rows {
    /// Rows of zeros follow the `m` rows up to a whole number of A tiles, so every tile routine
    /// loads 16-row tiles whatever the batch.
    pub fn new(x: &[i16], m: usize, k: usize, padded_k: usize) -> Self {
        assert_eq!(x.len(), m * k, "activations are [{m}, {k}]");
        assert!(padded_k >= k);
        let stored = m.div_ceil(TILE_ROWS) * TILE_ROWS * padded_k;
        let (mut low, mut high) = (vec![0u8; stored], vec![0i8; stored]);
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
/// tile instruction) when AMX is not [`available`], this thread's tiles are already in use, or
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
/// (never a tile instruction) when AMX is not [`available`] or the shapes disagree.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_is_laid_out_as_ldtilecfg_reads_it() {
        let config = TileConfig::new().with_tile(0, 16, 64).with_tile(2, 3, 12);
        assert_eq!(std::mem::size_of::<TileConfig>(), 64);
        assert_eq!(std::mem::align_of::<TileConfig>(), 64);
        // SAFETY: TileConfig is repr(C), 64 bytes of integers without padding.
        let bytes: [u8; 64] = unsafe { std::mem::transmute(config) };
        assert_eq!(bytes[0], 1, "palette 1");
        assert_eq!(
            &bytes[16..18],
            &64u16.to_le_bytes(),
            "tile 0: 64 bytes a row"
        );
        assert_eq!(
            &bytes[20..22],
            &12u16.to_le_bytes(),
            "tile 2: 12 bytes a row"
        );
        assert_eq!(
            (bytes[48], bytes[49], bytes[50]),
            (16, 0, 3),
            "rows of tiles 0-2"
        );
    }

    #[test]
    fn weights_are_packed_in_pairs_of_inputs_per_output() {
        // w[j][i] = j * 100 + i, where weight (j, i) can be told from its bf16 value.
        let (n, k) = (18, 35);
        let w: Vec<f32> = (0..n * k).map(|x| ((x / k) * 100 + x % k) as f32).collect();
        let packed = AmxBf16Weights::pack(&w, n, k);
        assert_eq!(packed.padded_k(), 64);
        let value = |bits: u16| f32::from_bits(u32::from(bits) << 16);
        let rounded = |x: f32| value(crate::bf16::round_to_bf16(x));
        // Tile (output block 1, input block 1), row 1, output column 0: output 16's inputs
        // 32 + 2 = 34 and 35, the second past k (zero).
        let tile = packed.tile(1, 1);
        assert_eq!(value(tile[32]), rounded(1634.0));
        assert_eq!(value(tile[33]), 0.0);
        // Row 0, column 1: output 17's inputs 32 and 33.
        assert_eq!(value(tile[2]), rounded(1732.0));
        assert_eq!(value(tile[3]), rounded(1733.0));
        // Output 18 is past n: zeros.
        assert_eq!(value(tile[2 * 2]), 0.0);
    }

    #[test]
    fn a_wrong_shape_is_refused_before_any_tile_instruction() {
        let w = AmxBf16Weights::pack(&[1.0; 16 * 32], 16, 32);
        let mut out = vec![0.0; 16];
        let err = gemm_bf16(&[0; 10], 1, &w, &mut out).unwrap_err();
        if available() {
            assert!(err.contains("activations hold 10 bf16"), "{err}");
            let err = gemm_bf16(&[0; 32], 1, &w, &mut out[..3]).unwrap_err();
            assert!(err.contains("the output holds 3"), "{err}");
        } else {
            assert_eq!(&err, availability().as_ref().unwrap_err());
        }
    }
}
