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
//!
//! This file holds what every tile routine shares (the permission, the configuration, the
//! per-thread claim, the packing of B tiles); `bf16.rs` and `int8.rs` the weights, products and
//! scan blocks of each precision.

#[cfg(target_arch = "x86_64")]
use std::arch::asm;
use std::sync::OnceLock;

/// Rows of a tile, and f32 columns of a C tile.
pub const TILE_ROWS: usize = 16;
/// Outputs of one block of a scan: two B tiles.
pub const BLOCK_OUTPUTS: usize = 32;

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

/// A weight matrix `[n outputs, k inputs]` (a layer's, row-major as PyTorch keeps it) in B tiles
/// of 16 rows x 16 outputs x the values one 32-bit lane holds (2 bf16 for `TDPBF16PS`, 4 int8 for
/// `TDPBUSD` / `TDPBSSD`): per block of 16 outputs and one tile's depth of inputs, a 1 KiB tile
/// whose row `p` holds each output's inputs `lane p ..` side by side. Outputs and inputs past the
/// matrix are zeros, and the blocks of 16 outputs come in whole pairs (a zero block after an odd
/// count), as the scans read two at a time. Every tile starts a cache line ([`TileBuffer`]).
/// [`AmxBf16Weights`] and [`AmxI8Weights`] are its two precisions.
#[derive(Clone, Debug, PartialEq)]
pub struct BTiles<T: bytemuck::Pod> {
    pub n: usize,
    pub k: usize,
    /// `[n blocks][k blocks][16 rows][16 outputs][lane]`.
    tiles: TileBuffer<T>,
}

impl<T: bytemuck::Pod> BTiles<T> {
    /// Values of `T` in one 32-bit lane.
    const LANE: usize = 4 / std::mem::size_of::<T>();
    /// Inputs one tile spans (a row of an A tile).
    pub const DEPTH: usize = TILE_ROWS * Self::LANE;
    /// Values in one tile.
    const TILE_LEN: usize = TILE_ROWS * 16 * Self::LANE;

    /// Packs the values `value(output, input)` of an `[n, k]` matrix.
    fn pack_with(n: usize, k: usize, value: impl Fn(usize, usize) -> T) -> Self {
        let (n_blocks, k_blocks) = (n.div_ceil(16).next_multiple_of(2), k.div_ceil(Self::DEPTH));
        let mut tiles = TileBuffer::zeroed(n_blocks * k_blocks * Self::TILE_LEN);
        for (tile_index, tile) in tiles.chunks_exact_mut(Self::TILE_LEN).enumerate() {
            let (jb, kb) = (tile_index / k_blocks, tile_index % k_blocks);
            for p in 0..TILE_ROWS {
                for col in 0..16 {
                    for lane in 0..Self::LANE {
                        let (j, i) = (jb * 16 + col, kb * Self::DEPTH + Self::LANE * p + lane);
                        if j < n && i < k {
                            tile[(p * 16 + col) * Self::LANE + lane] = value(j, i);
                        }
                    }
                }
            }
        }
        BTiles { n, k, tiles }
    }

    /// Blocks of 32 outputs, the scans' unit (the last padded with zeros).
    pub fn output_blocks(&self) -> usize {
        self.n.div_ceil(BLOCK_OUTPUTS)
    }

    /// Bytes of the packed tiles.
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val::<[T]>(&self.tiles)
    }

    /// Inputs per row of the activations the products take: `k` rounded up to whole tiles.
    pub fn padded_k(&self) -> usize {
        self.k.div_ceil(Self::DEPTH) * Self::DEPTH
    }

    /// Tiles along the depth of one block of 16 outputs.
    fn k_blocks(&self) -> usize {
        self.k.div_ceil(Self::DEPTH)
    }

    /// B tile `(output block jb, input block kb)`.
    fn tile(&self, jb: usize, kb: usize) -> &[T] {
        &self.tiles[(jb * self.k_blocks() + kb) * Self::TILE_LEN..][..Self::TILE_LEN]
    }
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

mod bf16;
mod int8;
mod tile_buffer;

pub use bf16::*;
pub use int8::*;
pub use tile_buffer::TileBuffer;

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
