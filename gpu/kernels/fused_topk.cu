// Fused output-layer scoring + top-k for recsys, compiled at model load by NVRTC.
//
// Stage 1 (score_tile_topk_*): block (group, tile) scores TILE items of the catalogue for a group of
// up to MAX_ROWS rows of the batch (one thread per item, so each weight row is read once per group
// rather than once per row), applies bias and exclusions, and keeps each row's best `keep` tile
// candidates, sorted; only those leave the chip.
// Stage 2 (merge_topk): blocks of TILE candidates are sorted and cut to `keep` until one block
// remains.
// The threshold scan (sample_tile_topk_*, reset_survivors, score_above_*) replaces stage 1 on large
// catalogues: stage 1 and the merges over a strided sample give each row the sample's k-th best, a
// score at most the true k-th best; the full scan then keeps only the scores at or above it (about
// k x N / sample of them), which the merge passes finish. Order: higher score first, ties to the lower item index (the engine's rule); excluded
// items and padding carry -inf and index 0xFFFFFFFF and sort last.
//
// Weights are row-major [n_items, pitch]: f32, f16 bits (u16) or int8 with one f32 scale per row
// (applied to the finished dot product, as the CPU engine does). The host pads each row with
// zeros from dim to pitch, a multiple of 16 bytes, so every row starts 16-byte aligned and is read
// 16 bytes at a time whatever dim is (d = 600 int8 rows are 600 bytes).
// Exclusions are CSR per batch row (offsets [rows + 1], sorted item indices).
// No headers: fp16 conversion is one PTX instruction, so NVRTC needs no include path. The same
// source also compiles as host C++ in front of gpu/emulator/cuda_emulation.hpp, which runs the
// kernels on the CPU for the tests of machines without a GPU (RECSYS_CUDA_EMULATION).

#define TILE 2048
#define THREADS 256
#define MAX_ROWS 4
#define WARPS (THREADS / 32)
// Stage-1 blocks resident per multiprocessor that register allocation plans for. Left to itself,
// ptxas plans for as many as shared memory admits (4 on Hopper: 64 registers a thread), and the
// int8 body then spills; 3 gives it 85 registers and still keeps 24 warps of loads in flight.
#define STAGE1_MIN_BLOCKS 3
// Blocks per multiprocessor the coalesced scans' register allocation plans for: 4 gives them 64
// registers a thread (the int8 body with four rows needs about 50) and 32 warps of loads in
// flight; left without a minimum, ptxas packed them into 32-40 registers and spilled.
#define GEMV_MIN_BLOCKS 4
// The tiled scan's block: GEMM_ROWS batch rows x GEMM_ITEMS positions, GEMM_K columns staged per
// step (THREADS threads of 4 x 8 scores each), and the blocks per multiprocessor its registers plan
// for (2: up to 128 registers for the 32 accumulators and the staged operands).
#define GEMM_ROWS 64
#define GEMM_ITEMS 128
#define GEMM_K 32
#define GEMM_MIN_BLOCKS 2
// Hidden columns the tensor-core tiles stage per step (as f16 pairs, a high and a low part).
#define MMA_K 64
// Up to this k, a tile's candidates are chosen by warp-level selection; above it, by sorting.
#define WARP_SELECT_MAX 32
// Tile entries each lane holds during warp selection (a warp covers TILE / WARPS entries).
#define PER_LANE (TILE / THREADS)
#define NONE_INDEX 0xFFFFFFFFu
#define NEG_INF __int_as_float(0xff800000)

typedef unsigned int u32;
typedef unsigned short u16;

#ifdef RECSYS_CUDA_EMULATION
__device__ __forceinline__ float half_bits_to_float(u16 bits) { return emu::half_bits_to_float(bits); }
__device__ __forceinline__ u16 float_to_half_bits(float f) { return emu::float_to_half_bits(f); }
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    emu::mma_m16n8k16_f32_f16(d, a, b0, b1);
}
#define TENSOR_CORES 1
// Host memory in the emulation may hold rows that do not start 16-byte aligned (the coalesced and
// tiled scans then read one value at a time, to the same values).
#define ROWS_ALIGNED(test) (test)
#else
// On a device every row starts 16-byte aligned (the host pads them), so the coalesced and tiled
// scans compile without their one-value-at-a-time path.
#define ROWS_ALIGNED(test) true
#define RECSYS_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
__device__ __forceinline__ float half_bits_to_float(u16 bits) {
    float out;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(out) : "h"(bits));
    return out;
}
// Round to nearest even, as the emulation's conversion.
__device__ __forceinline__ u16 float_to_half_bits(float f) {
    u16 out;
    asm("{ .reg .f16 h; cvt.rn.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(out) : "f"(f));
    return out;
}
// mma.sync m16n8k16 (f16 inputs, f32 accumulators) needs sm_80; older GPUs run the FFMA tiles.
#if __CUDA_ARCH__ >= 800
#define TENSOR_CORES 1
// D += A B on the tensor cores for one warp: A 16 x 16 (row-major), B 16 x 8 (column-major), the
// fragments as the PTX ISA lays them out over the lanes (see MMA_LOOP).
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#else
#define TENSOR_CORES 0
#endif
#endif
__device__ __forceinline__ u32 pack_halves(u16 low, u16 high) { return (u32)low | ((u32)high << 16); }

// True when (sa, ia) ranks before (sb, ib).
__device__ __forceinline__ bool ranks_before(float sa, u32 ia, float sb, u32 ib) {
    return sa > sb || (sa == sb && ia < ib);
}

__device__ bool is_excluded(const u32* __restrict__ ids, u32 begin, u32 end, u32 item) {
    while (begin < end) {
        u32 mid = begin + (end - begin) / 2;
        u32 v = ids[mid];
        if (v == item) return true;
        if (v < item) begin = mid + 1; else end = mid;
    }
    return false;
}

// Sorts TILE (score, index) pairs in shared memory, best first (bitonic network).
__device__ void sort_tile(float* scores, u32* index) {
    for (u32 size = 2; size <= TILE; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
            for (u32 i = threadIdx.x; i < TILE; i += THREADS) {
                u32 j = i ^ stride;
                if (j > i) {
                    bool descending = (i & size) == 0;
                    bool swap = descending ? ranks_before(scores[j], index[j], scores[i], index[i])
                                           : ranks_before(scores[i], index[i], scores[j], index[j]);
                    if (swap) {
                        float s = scores[i]; scores[i] = scores[j]; scores[j] = s;
                        u32 t = index[i]; index[i] = index[j]; index[j] = t;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// The best (score, index) of the warp, in every lane: butterfly reduction over the lanes' own.
__device__ __forceinline__ void warp_best(float& score, u32& index) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other_score = __shfl_xor_sync(0xFFFFFFFFu, score, offset);
        const u32 other_index = __shfl_xor_sync(0xFFFFFFFFu, index, offset);
        if (ranks_before(other_score, other_index, score, index)) {
            score = other_score;
            index = other_index;
        }
    }
}

// Takes the warp's `count` best of the PER_LANE entries each lane holds, best first: the warp
// agrees on its best, the lane holding it drops it, `count` times. Lane 0 writes them to
// out_scores/out_index[0..count). Indices are unique except NONE_INDEX (-inf padding), which is
// never dropped and so repeats once the real entries run out.
__device__ __forceinline__ void warp_take_best(float (&scores)[PER_LANE], u32 (&index)[PER_LANE],
                                               u32 count, float* out_scores, u32* out_index) {
    const u32 lane = threadIdx.x % 32;
    for (u32 n = 0; n < count; ++n) {
        float best = scores[0];
        u32 best_index = index[0];
        _Pragma("unroll") for (u32 j = 1; j < PER_LANE; ++j) {
            if (ranks_before(scores[j], index[j], best, best_index)) {
                best = scores[j];
                best_index = index[j];
            }
        }
        warp_best(best, best_index);
        _Pragma("unroll") for (u32 j = 0; j < PER_LANE; ++j) {
            if (best_index != NONE_INDEX && index[j] == best_index) {
                scores[j] = NEG_INF;
                index[j] = NONE_INDEX;
            }
        }
        if (lane == 0) {
            out_scores[n] = best;
            out_index[n] = best_index;
        }
    }
}

// Shared scratch of the selection: the sort's index array, or the warps' candidates.
union SelectScratch {
    u32 index[TILE];
    struct {
        float scores[WARPS * WARP_SELECT_MAX];
        u32 index[WARPS * WARP_SELECT_MAX];
    } candidates;
};

// Writes the best `keep` of TILE entries in shared memory (scores; their indices are `index` or,
// when it is null, (tile_start + position) x stride, NONE_INDEX for -inf) to out_scores/out_index,
// best first.
// keep <= WARP_SELECT_MAX: each warp selects its slice's best `keep` into shared memory, then
// warp 0 selects the block's best from those (no sort, 2 barriers). Larger keep: bitonic sort of
// the whole tile in place (so `scores` is reordered). Every thread of the block must call it.
__device__ void select_tile(float* scores, const u32* index, u32 tile_start, u32 stride, u32 keep,
                            SelectScratch& scratch, float* out_scores, u32* out_index) {
    if (keep <= WARP_SELECT_MAX) {
        const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        float mine[PER_LANE];
        u32 ids[PER_LANE];
        _Pragma("unroll") for (u32 j = 0; j < PER_LANE; ++j) {
            const u32 pos = warp * (TILE / WARPS) + j * 32 + lane;
            mine[j] = scores[pos];
            ids[j] = index ? index[pos] : (mine[j] == NEG_INF ? NONE_INDEX : (tile_start + pos) * stride);
        }
        warp_take_best(mine, ids, keep, scratch.candidates.scores + warp * WARP_SELECT_MAX,
                       scratch.candidates.index + warp * WARP_SELECT_MAX);
        __syncthreads();
        if (warp == 0) {
            _Pragma("unroll") for (u32 j = 0; j < PER_LANE; ++j) {
                const u32 c = j * 32 + lane;  // WARPS * WARP_SELECT_MAX == THREADS slots
                const bool valid = c % WARP_SELECT_MAX < keep;
                mine[j] = valid ? scratch.candidates.scores[c] : NEG_INF;
                ids[j] = valid ? scratch.candidates.index[c] : NONE_INDEX;
            }
            warp_take_best(mine, ids, keep, out_scores, out_index);
        }
        __syncthreads();
        return;
    }
    for (u32 t = threadIdx.x; t < TILE; t += THREADS)
        scratch.index[t] = index ? index[t] : (scores[t] == NEG_INF ? NONE_INDEX : (tile_start + t) * stride);
    __syncthreads();
    sort_tile(scores, scratch.index);
    for (u32 i = threadIdx.x; i < keep; i += THREADS) {
        out_scores[i] = scores[i];
        out_index[i] = scratch.index[i];
    }
    __syncthreads();
}

// 16 bytes of a weight row (the row start must be 16-byte aligned): 4 f32, 8 f16 or 16 int8 values,
// kept packed; four4(raw, q, w) unpacks the q-th group of four as floats, only when it is used, so
// an int8 chunk holds 4 registers instead of 16. Little-endian: the lower bits are the earlier
// element.
__device__ __forceinline__ uint4 load16(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ u32 word_of(const uint4& v, u32 i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ void four4(const float*, const uint4& raw, u32, float (&w)[4]) {
    w[0] = __uint_as_float(raw.x); w[1] = __uint_as_float(raw.y);
    w[2] = __uint_as_float(raw.z); w[3] = __uint_as_float(raw.w);
}
__device__ __forceinline__ void four4(const u16*, const uint4& raw, u32 q, float (&w)[4]) {
    const u32 lo = word_of(raw, 2 * q), hi = word_of(raw, 2 * q + 1);
    w[0] = half_bits_to_float((u16)(lo & 0xFFFFu)); w[1] = half_bits_to_float((u16)(lo >> 16));
    w[2] = half_bits_to_float((u16)(hi & 0xFFFFu)); w[3] = half_bits_to_float((u16)(hi >> 16));
}
__device__ __forceinline__ void four4(const signed char*, const uint4& raw, u32 q, float (&w)[4]) {
    const u32 word = word_of(raw, q);
    _Pragma("unroll") for (u32 b = 0; b < 4; ++b)
        w[b] = (float)(signed char)((word >> (8 * b)) & 0xFFu);
}

// The scoring loop shared by every scan and weight type; WEIGHT(item, col) reads one weight as
// float, and CHUNK weights are read at once by load16 where rows are aligned. Block (group, tile)
// scores the TILE positions of its tile for up to MAX_ROWS rows of the batch, so each weight row is
// read once per group of rows instead of once per row: one thread per position (item = position x
// `stride`: 1 for the full scans, more for the sample of the threshold scan), the group's hidden
// vectors in shared memory (read as 16-byte broadcasts). Groups are the grid's x, so the blocks
// that run at the same time share their tiles and a tile crosses from HBM once for all groups, the
// others finding it in L2. EPILOGUE runs for each (row r of the group, position t) with `item`,
// `real` (a catalogue item other than PAD) and the finished dot product acc[r].
#define SCORE_TILE_LOOP(WEIGHT, CHUNK, EPILOGUE)                                                  \
    RECSYS_DYNAMIC_SHARED(float4, group_hidden_vectors);                                          \
    float* group_hidden = reinterpret_cast<float*>(group_hidden_vectors);                         \
    const u32 row0 = blockIdx.x * rows_per_block;                                                 \
    const u32 rows = min(rows_per_block, batch - row0);                                           \
    const u32 tile_start = blockIdx.y * TILE;                                                     \
    /* The group's hidden rows at the weights' pitch, zero past dim like the weights. */         \
    for (u32 i = threadIdx.x; i < rows * pitch; i += THREADS) {                                   \
        const u32 r = i / pitch, c = i % pitch;                                                   \
        group_hidden[i] = c < dim ? LOAD_HIDDEN(hidden[(size_t)(row0 + r) * dim + c]) : 0.0f;     \
    }                                                                                             \
    __syncthreads();                                                                              \
    for (u32 t = threadIdx.x; t < TILE; t += THREADS) {                                           \
        const u32 item = (tile_start + t) * stride;                                               \
        float acc[MAX_ROWS];                                                                      \
        _Pragma("unroll") for (u32 r = 0; r < MAX_ROWS; ++r) acc[r] = 0.0f;                      \
        if (item < n_items) {                                                                     \
            /* 16-byte loads when every row starts 16-byte aligned (always on a device: the host  \
               pads rows; host memory in the emulation may not be), over the zero padding too,   \
               which adds nothing; else one value at a time up to dim. Same summation order. */   \
            const u32 vector_end = (pitch % CHUNK == 0 && (size_t)weights % 16 == 0) ? pitch : 0; \
            for (u32 c = 0; c < vector_end; c += CHUNK) {                                         \
                const uint4 raw = load16(weights + (size_t)item * pitch + c);                     \
                /* pitch % 4 == 0, so each row's slice of shared memory is 16-byte aligned. */    \
                _Pragma("unroll") for (u32 q = 0; q < CHUNK / 4; ++q) {                           \
                    float w[4];                                                                   \
                    four4(weights, raw, q, w);                                                    \
                    _Pragma("unroll") for (u32 r = 0; r < MAX_ROWS; ++r) {                        \
                        if (r < rows) {                                                           \
                            const float4 v = reinterpret_cast<const float4*>(                     \
                                group_hidden + r * pitch + c)[q];                                 \
                            acc[r] += v.x * w[0];                                                 \
                            acc[r] += v.y * w[1];                                                 \
                            acc[r] += v.z * w[2];                                                 \
                            acc[r] += v.w * w[3];                                                 \
                        }                                                                         \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (u32 c = vector_end; c < dim; ++c) {                                              \
                const float w = WEIGHT(item, c);                                                  \
                _Pragma("unroll") for (u32 r = 0; r < MAX_ROWS; ++r)                              \
                    if (r < rows) acc[r] += group_hidden[r * pitch + c] * w;                      \
            }                                                                                     \
        }                                                                                         \
        const bool real = item < n_items && item != 0;                                            \
        _Pragma("unroll") for (u32 r = 0; r < MAX_ROWS; ++r) {                                    \
            if (r < rows) {                                                                       \
                const u32 row = row0 + r;                                                         \
                EPILOGUE                                                                          \
            }                                                                                     \
        }                                                                                         \
    }

// Stage 1: the tile's scores (bias added, exclusions applied) into shared memory, then, one row at
// a time, the tile's best `keep` selected on chip (select_tile); only they leave it.
#define SCORE_TILE_BODY(WEIGHT, CHUNK)                                                            \
    __shared__ float tile_scores[MAX_ROWS * TILE];                                                \
    __shared__ SelectScratch scratch;                                                             \
    SCORE_TILE_LOOP(WEIGHT, CHUNK,                                                                \
        const bool keep_item = real &&                                                            \
            !is_excluded(exclude_ids, exclude_offsets[row], exclude_offsets[row + 1], item);      \
        tile_scores[r * TILE + t] = keep_item ? FINISH(acc[r], item) + bias[item] : NEG_INF;)     \
    __syncthreads();                                                                              \
    for (u32 r = 0; r < rows; ++r) {                                                              \
        const size_t out = ((size_t)(row0 + r) * gridDim.y + blockIdx.y) * keep;                  \
        select_tile(tile_scores + r * TILE, nullptr, tile_start, stride, keep, scratch,           \
                    out_scores + out, out_index + out);                                           \
    }

// The threshold scan: every score at least its row's threshold (the k-th best of a sample, so a
// lower bound of the k-th best of all) is appended to the row's survivors, `capacity` slots at
// row x capacity, through one atomic per warp and ballot; counts[row] ends as the number of
// survivors, which may exceed the capacity (the host then answers that row exactly another way).
// Exclusions are looked up for survivors only. No selection and no shared score tile.
#define SCORE_ABOVE_BODY(WEIGHT, CHUNK)                                                           \
    const u32 stride = 1;                                                                         \
    float tau[MAX_ROWS];                                                                          \
    _Pragma("unroll") for (u32 r = 0; r < MAX_ROWS; ++r)                                          \
        tau[r] = r < min(rows_per_block, batch - blockIdx.x * rows_per_block)                     \
            ? thresholds[(size_t)(blockIdx.x * rows_per_block + r) * threshold_pitch + threshold_at] \
            : 0.0f;                                                                               \
    const u32 lane = threadIdx.x % 32;                                                            \
    SCORE_TILE_LOOP(WEIGHT, CHUNK,                                                                \
        const float score = real ? FINISH(acc[r], item) + bias[item] : NEG_INF;                   \
        const bool take = real && score >= tau[r] &&                                              \
            !is_excluded(exclude_ids, exclude_offsets[row], exclude_offsets[row + 1], item);      \
        const unsigned ballot = __ballot_sync(0xFFFFFFFFu, take);                                 \
        if (ballot != 0) {                                                                        \
            u32 base = 0;                                                                         \
            if (lane == 0) base = atomicAdd(counts + row, (u32)__popc(ballot));                   \
            base = __shfl_sync(0xFFFFFFFFu, base, 0);                                             \
            const u32 slot = base + (u32)__popc(ballot & ((1u << lane) - 1u));                    \
            if (take && slot < capacity) {                                                        \
                out_scores[(size_t)row * capacity + slot] = score;                                \
                out_index[(size_t)row * capacity + slot] = item;                                  \
            }                                                                                     \
        })

extern "C" __global__ void __launch_bounds__(THREADS, STAGE1_MIN_BLOCKS) score_tile_topk_f32(
    const float* __restrict__ hidden, const float* __restrict__ weights, const float* __restrict__ bias,
    const u32* __restrict__ exclude_offsets, const u32* __restrict__ exclude_ids,
    u32 batch, u32 rows_per_block, u32 n_items, u32 dim, u32 pitch, u32 keep,
    float* __restrict__ out_scores,
    u32* __restrict__ out_index) {
#define FINISH(acc, item) (acc)
#define LOAD_HIDDEN(h) (h)
#define W_F32(item, c) weights[(size_t)(item) * pitch + (c)]
    const u32 stride = 1;
    SCORE_TILE_BODY(W_F32, 4)
#undef W_F32
#undef FINISH
#undef LOAD_HIDDEN
}

extern "C" __global__ void __launch_bounds__(THREADS, STAGE1_MIN_BLOCKS) score_tile_topk_f16(
    const float* __restrict__ hidden, const u16* __restrict__ weights, const float* __restrict__ bias,
    const u32* __restrict__ exclude_offsets, const u32* __restrict__ exclude_ids,
    u32 batch, u32 rows_per_block, u32 n_items, u32 dim, u32 pitch, u32 keep,
    float* __restrict__ out_scores,
    u32* __restrict__ out_index) {
#define FINISH(acc, item) (acc)
#define LOAD_HIDDEN(h) (h)
#define W_F16(item, c) half_bits_to_float(weights[(size_t)(item) * pitch + (c)])
    const u32 stride = 1;
    SCORE_TILE_BODY(W_F16, 8)
#undef W_F16
#undef FINISH
#undef LOAD_HIDDEN
}

// W8A8 engines quantize the hidden vector to int8 levels with their calibrated static scale before
// the int8 dot product, as the CPU engine does and ONNX's QuantizeLinear specifies: h / scale
// rounded half to even (rintf in the default rounding mode), saturated to [-128, 127].
__device__ __forceinline__ float quantize_activation(float h, float scale) {
    return fminf(fmaxf(rintf(h / scale), -128.0f), 127.0f) * scale;
}

// int8: the row's scale is applied once to the dot product (sum_c h_c q_c) * s, as the engine does.
extern "C" __global__ void __launch_bounds__(THREADS, STAGE1_MIN_BLOCKS) score_tile_topk_i8(
    const float* __restrict__ hidden, const signed char* __restrict__ weights,
    const float* __restrict__ row_scales, float activation_scale, const float* __restrict__ bias,
    const u32* __restrict__ exclude_offsets, const u32* __restrict__ exclude_ids,
    u32 batch, u32 rows_per_block, u32 n_items, u32 dim, u32 pitch, u32 keep,
    float* __restrict__ out_scores,
    u32* __restrict__ out_index) {
#define FINISH(acc, item) ((acc) * row_scales[item])
#define LOAD_HIDDEN(h) (activation_scale > 0.0f ? quantize_activation(h, activation_scale) : (h))
#define W_I8(item, c) ((float)weights[(size_t)(item) * pitch + (c)])
    const u32 stride = 1;
    SCORE_TILE_BODY(W_I8, 16)
#undef W_I8
#undef FINISH
#undef LOAD_HIDDEN
}

// The threshold scan's two kernels per weight type. sample_tile_topk_*: stage 1 over every
// `stride`-th item (positions 0, 1, ... are items 0, stride, ...), whose merged top-k gives each
// row its threshold. score_above_*: the full scan against the thresholds, thresholds[row x
// threshold_pitch + threshold_at] (the sample's k-th best, or -inf where the sample held fewer
// than k items the row may get).
#define SAMPLE_KERNEL(NAME, WEIGHT_PARAMS)                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS, STAGE1_MIN_BLOCKS) NAME(                \
        const float* __restrict__ hidden, WEIGHT_PARAMS, const float* __restrict__ bias,          \
        const u32* __restrict__ exclude_offsets, const u32* __restrict__ exclude_ids, u32 batch,  \
        u32 rows_per_block, u32 n_items, u32 dim, u32 pitch, u32 keep, u32 stride,                \
        float* __restrict__ out_scores, u32* __restrict__ out_index)

#define ABOVE_KERNEL(NAME, WEIGHT_PARAMS)                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS, STAGE1_MIN_BLOCKS) NAME(                \
        const float* __restrict__ hidden, WEIGHT_PARAMS, const float* __restrict__ bias,          \
        const u32* __restrict__ exclude_offsets, const u32* __restrict__ exclude_ids, u32 batch,  \
        u32 rows_per_block, u32 n_items, u32 dim, u32 pitch, const float* __restrict__ thresholds, \
        u32 threshold_pitch, u32 threshold_at, u32 capacity, u32* __restrict__ counts,            \
        float* __restrict__ out_scores, u32* __restrict__ out_index)

#define F32_PARAMS const float* __restrict__ weights
#define F16_PARAMS const u16* __restrict__ weights
#define I8_PARAMS                                                                                 \
    const signed char* __restrict__ weights, const float* __restrict__ row_scales,                \
        float activation_scale

#define FINISH(acc, item) (acc)
#define LOAD_HIDDEN(h) (h)
#define W_F32(item, c) weights[(size_t)(item) * pitch + (c)]
#define W_F16(item, c) half_bits_to_float(weights[(size_t)(item) * pitch + (c)])
SAMPLE_KERNEL(sample_tile_topk_f32, F32_PARAMS) { SCORE_TILE_BODY(W_F32, 4) }
SAMPLE_KERNEL(sample_tile_topk_f16, F16_PARAMS) { SCORE_TILE_BODY(W_F16, 8) }
ABOVE_KERNEL(score_above_f32, F32_PARAMS) { SCORE_ABOVE_BODY(W_F32, 4) }
ABOVE_KERNEL(score_above_f16, F16_PARAMS) { SCORE_ABOVE_BODY(W_F16, 8) }
#undef FINISH
#undef LOAD_HIDDEN
#define FINISH(acc, item) ((acc) * row_scales[item])
#define LOAD_HIDDEN(h) (activation_scale > 0.0f ? quantize_activation(h, activation_scale) : (h))
#define W_I8(item, c) ((float)weights[(size_t)(item) * pitch + (c)])
SAMPLE_KERNEL(sample_tile_topk_i8, I8_PARAMS) { SCORE_TILE_BODY(W_I8, 16) }
ABOVE_KERNEL(score_above_i8, I8_PARAMS) { SCORE_ABOVE_BODY(W_I8, 16) }
#undef FINISH
#undef LOAD_HIDDEN
#undef W_F32
#undef W_F16
#undef W_I8

// The coalesced scan, for batches of at most MAX_ROWS rows (batch 1 is the common serving case):
// a warp reads `lanes` consecutive 16-byte chunks of one item's row at a time (lanes per item: a
// power of two up to 32, chosen by the host from the row's width), so the warp's 32 / lanes items
// are consecutive rows and every load of the warp is one contiguous span, where the tile scan's
// one thread per item reads rows a whole row apart. Each lane sums its chunks with fused
// multiply-adds in chunk order and the item's lanes then add theirs by a butterfly, so an item's
// score depends only on `lanes`, never on where the item falls: the sample and the full scan of
// the threshold scan compute the very same bits, and a sampled item's score always reaches the
// threshold it set. The whole batch's hidden rows sit in shared memory (read once per 16-byte
// chunk by each lane; at most 4 x 2048 f32, 32 KiB), and the grid is the blocks the device keeps
// resident at once, striding over the catalogue. Positions are items 0, stride, 2 x stride, ...;
// EPILOGUE runs for every (row, position) with `position`, `item`, `in_range` (a position of the
// catalogue), `real` (in range and not PAD), `leader` (the one lane of the item that acts) and
// the finished dot product acc[r]. Every lane of a warp runs the same iterations, so the warp
// primitives of the butterfly and the epilogue see full warps.
#define GEMV_LOOP(WEIGHT, CHUNK, EPILOGUE)                                                        \
    RECSYS_DYNAMIC_SHARED(float4, batch_hidden_vectors);                                          \
    float* batch_hidden = reinterpret_cast<float*>(batch_hidden_vectors);                         \
    const u32 rows = min(batch, (u32)MAX_ROWS);                                                   \
    for (u32 i = threadIdx.x; i < rows * pitch; i += THREADS) {                                   \
        const u32 r = i / pitch, c = i % pitch;                                                   \
        batch_hidden[i] = c < dim ? LOAD_HIDDEN(hidden[(size_t)r * dim + c]) : 0.0f;             \
    }                                                                                             \
    __syncthreads();                                                                              \
    const u32 lane = threadIdx.x % 32;                                                            \
    const u32 per_warp = 32 / lanes, part = lane % lanes, group = lane / lanes;                   \
    const u32 chunks = pitch / CHUNK;                                                             \
    /* On a device rows always start 16-byte aligned (the host pads them); host memory in the    \
       emulation may not be: then one value at a time, in the same order, to the same bits. */  \
    const bool aligned = ROWS_ALIGNED(pitch % CHUNK == 0 && (size_t)weights % 16 == 0);           \
    const u32 warps_in_grid = gridDim.x * WARPS;                                                  \
    for (u32 first = (blockIdx.x * WARPS + threadIdx.x / 32) * per_warp; first < positions;       \
         first += warps_in_grid * per_warp) {                                                     \
        const u32 position = first + group;                                                       \
        const bool in_range = position < positions;                                               \
        const u32 item = in_range ? position * stride : 0;                                        \
        float acc[MAX_ROWS];                                                                      \
        _Pragma("unroll") for (u32 r = 0; r < MAX_ROWS; ++r) acc[r] = 0.0f;                      \
        if (in_range) {                                                                           \
            for (u32 chunk = part; chunk < chunks; chunk += lanes) {                              \
                const u32 c = chunk * CHUNK;                                                      \
                if (aligned) {                                                                    \
                    const uint4 raw = load16(weights + (size_t)item * pitch + c);                 \
                    _Pragma("unroll") for (u32 q = 0; q < CHUNK / 4; ++q) {                       \
                        float w[4];                                                               \
                        four4(weights, raw, q, w);                                                \
                        _Pragma("unroll") for (u32 r = 0; r < MAX_ROWS; ++r) {                    \
                            if (r < rows) {                                                       \
                                const float4 v = reinterpret_cast<const float4*>(                 \
                                    batch_hidden + r * pitch + c)[q];                             \
                                acc[r] = fmaf(v.x, w[0], acc[r]);                                 \
                                acc[r] = fmaf(v.y, w[1], acc[r]);                                 \
                                acc[r] = fmaf(v.z, w[2], acc[r]);                                 \
                                acc[r] = fmaf(v.w, w[3], acc[r]);                                 \
                            }                                                                     \
                        }                                                                         \
                    }                                                                             \
                } else {                                                                          \
                    for (u32 e = c; e < min(c + CHUNK, dim); ++e) {                               \
                        const float w = WEIGHT(item, e);                                          \
                        _Pragma("unroll") for (u32 r = 0; r < MAX_ROWS; ++r)                      \
                            if (r < rows) acc[r] = fmaf(batch_hidden[r * pitch + e], w, acc[r]);  \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        /* Unrolled, the offsets a warp-uniform test: every lane shuffles alike. */              \
        _Pragma("unroll") for (u32 offset = 16; offset > 0; offset >>= 1) {                      \
            if (offset < lanes) {                                                                 \
                _Pragma("unroll") for (u32 r = 0; r < MAX_ROWS; ++r)                              \
                    acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], offset);                       \
            }                                                                                     \
        }                                                                                         \
        const bool leader = part == 0;                                                            \
        const bool real = in_range && item < n_items && item != 0;                                \
        _Pragma("unroll") for (u32 r = 0; r < MAX_ROWS; ++r) {                                    \
            if (r < rows) {                                                                       \
                const u32 row = r;                                                                \
                EPILOGUE                                                                          \
            }                                                                                     \
        }                                                                                         \
    }

// gemv_sample_*: every sampled position's score for each row, in position order, into
// out[row x positions + position] (-inf and NONE_INDEX for PAD and exclusions), for the merge
// passes to select the sample's top-k from.
#define GEMV_SAMPLE_BODY(WEIGHT, CHUNK)                                                           \
    GEMV_LOOP(WEIGHT, CHUNK,                                                                      \
        if (leader && in_range) {                                                                 \
            const bool keep_item = real &&                                                        \
                !is_excluded(exclude_ids, exclude_offsets[row], exclude_offsets[row + 1], item);  \
            out_scores[(size_t)row * positions + position] =                                      \
                keep_item ? FINISH(acc[r], item) + bias[item] : NEG_INF;                          \
            out_index[(size_t)row * positions + position] = keep_item ? item : NONE_INDEX;        \
        })

// gemv_above_*: the threshold scan's full pass through the coalesced scan; survivors appended as
// in score_above_*.
#define GEMV_ABOVE_BODY(WEIGHT, CHUNK)                                                            \
    const u32 stride = 1, positions = n_items;                                                    \
    float tau[MAX_ROWS];                                                                          \
    _Pragma("unroll") for (u32 r = 0; r < MAX_ROWS; ++r)                                          \
        tau[r] = r < batch ? thresholds[(size_t)r * threshold_pitch + threshold_at] : 0.0f;      \
    GEMV_LOOP(WEIGHT, CHUNK,                                                                      \
        const float score = real ? FINISH(acc[r], item) + bias[item] : NEG_INF;                   \
        const bool take = leader && real && score >= tau[r] &&                                    \
            !is_excluded(exclude_ids, exclude_offsets[row], exclude_offsets[row + 1], item);      \
        const unsigned ballot = __ballot_sync(0xFFFFFFFFu, take);                                 \
        if (ballot != 0) {                                                                        \
            u32 base = 0;                                                                         \
            if (lane == 0) base = atomicAdd(counts + row, (u32)__popc(ballot));                   \
            base = __shfl_sync(0xFFFFFFFFu, base, 0);                                             \
            const u32 slot = base + (u32)__popc(ballot & ((1u << lane) - 1u));                    \
            if (take && slot < capacity) {                                                        \
                out_scores[(size_t)row * capacity + slot] = score;                                \
                out_index[(size_t)row * capacity + slot] = item;                                  \
            }                                                                                     \
        })

#define GEMV_SAMPLE_KERNEL(NAME, WEIGHT_PARAMS)                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, GEMV_MIN_BLOCKS) NAME(                                   \
        const float* __restrict__ hidden, WEIGHT_PARAMS, const float* __restrict__ bias,          \
        const u32* __restrict__ exclude_offsets, const u32* __restrict__ exclude_ids, u32 batch,  \
        u32 n_items, u32 dim, u32 pitch, u32 lanes, u32 stride, u32 positions,                    \
        float* __restrict__ out_scores, u32* __restrict__ out_index)

#define GEMV_ABOVE_KERNEL(NAME, WEIGHT_PARAMS)                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, GEMV_MIN_BLOCKS) NAME(                                   \
        const float* __restrict__ hidden, WEIGHT_PARAMS, const float* __restrict__ bias,          \
        const u32* __restrict__ exclude_offsets, const u32* __restrict__ exclude_ids, u32 batch,  \
        u32 n_items, u32 dim, u32 pitch, u32 lanes, const float* __restrict__ thresholds,         \
        u32 threshold_pitch, u32 threshold_at, u32 capacity, u32* __restrict__ counts,            \
        float* __restrict__ out_scores, u32* __restrict__ out_index)

#define FINISH(acc, item) (acc)
#define LOAD_HIDDEN(h) (h)
#define W_F32(item, c) weights[(size_t)(item) * pitch + (c)]
#define W_F16(item, c) half_bits_to_float(weights[(size_t)(item) * pitch + (c)])
GEMV_SAMPLE_KERNEL(gemv_sample_f32, F32_PARAMS) { GEMV_SAMPLE_BODY(W_F32, 4) }
GEMV_SAMPLE_KERNEL(gemv_sample_f16, F16_PARAMS) { GEMV_SAMPLE_BODY(W_F16, 8) }
GEMV_ABOVE_KERNEL(gemv_above_f32, F32_PARAMS) { GEMV_ABOVE_BODY(W_F32, 4) }
GEMV_ABOVE_KERNEL(gemv_above_f16, F16_PARAMS) { GEMV_ABOVE_BODY(W_F16, 8) }
#undef FINISH
#undef LOAD_HIDDEN
#define FINISH(acc, item) ((acc) * row_scales[item])
#define LOAD_HIDDEN(h) (activation_scale > 0.0f ? quantize_activation(h, activation_scale) : (h))
#define W_I8(item, c) ((float)weights[(size_t)(item) * pitch + (c)])
GEMV_SAMPLE_KERNEL(gemv_sample_i8, I8_PARAMS) { GEMV_SAMPLE_BODY(W_I8, 16) }
GEMV_ABOVE_KERNEL(gemv_above_i8, I8_PARAMS) { GEMV_ABOVE_BODY(W_I8, 16) }
#undef FINISH
#undef LOAD_HIDDEN
#undef W_F32
#undef W_F16
#undef W_I8

// The tiled scan, for batches of more than MAX_ROWS rows: scores as a matrix product, block
// (item tile, row group) computing GEMM_ITEMS positions x GEMM_ROWS rows, so with a batch of up to
// 64 rows every weight crosses from HBM once per call (the stage-1 tile scan reads each once per
// group of 4 rows). Each step stages GEMM_K columns of the group's hidden rows and of the tile's
// item rows in shared memory (weight rows read 16 bytes a lane, consecutive lanes along a row, and
// converted to f32 once), then each thread accumulates a 4 x 8 block of scores from registers
// (rows ty x 4 .. + 3, positions tx + 16 j), one fmaf per column in column order: an item's score
// depends on nothing but its row and the hidden row, so the sample and the full scan of the
// threshold scan compute the same bits. Columns past the pitch, positions past the catalogue and
// rows past the batch stage as zeros. EPILOGUE runs for every (row, position) of the thread
// within the batch and the catalogue with `row`, `position`, `item`, `real` and `score_acc`.
#define GEMM_LOOP(WEIGHT, CHUNK, EPILOGUE)                                                        \
    __shared__ float hidden_tile[GEMM_ROWS][GEMM_K + 1];                                          \
    __shared__ float weight_tile[GEMM_ITEMS][GEMM_K + 1];                                         \
    const u32 row0 = blockIdx.y * GEMM_ROWS, tile_start = blockIdx.x * GEMM_ITEMS;                \
    const u32 tx = threadIdx.x % 16, ty = threadIdx.x / 16;                                       \
    const bool aligned = ROWS_ALIGNED((size_t)weights % 16 == 0);                                  \
    float acc[4][8];                                                                              \
    _Pragma("unroll") for (u32 i = 0; i < 4; ++i)                                                 \
        _Pragma("unroll") for (u32 j = 0; j < 8; ++j) acc[i][j] = 0.0f;                          \
    for (u32 k0 = 0; k0 < pitch; k0 += GEMM_K) {                                                  \
        for (u32 at = threadIdx.x; at < GEMM_ROWS * GEMM_K; at += THREADS) {                      \
            const u32 r = at / GEMM_K, kk = at % GEMM_K, row = row0 + r, col = k0 + kk;           \
            hidden_tile[r][kk] =                                                                  \
                row < batch && col < dim ? LOAD_HIDDEN(hidden[(size_t)row * dim + col]) : 0.0f;  \
        }                                                                                         \
        for (u32 at = threadIdx.x; at < GEMM_ITEMS * (GEMM_K / CHUNK); at += THREADS) {           \
            const u32 it = at / (GEMM_K / CHUNK), col = (at % (GEMM_K / CHUNK)) * CHUNK;           \
            const u32 position = tile_start + it, item = position * stride;                       \
            float* into = &weight_tile[it][col];                                                  \
            if (position < positions && k0 + col < pitch) {                                       \
                if (aligned) {                                                                    \
                    const uint4 raw = load16(weights + (size_t)item * pitch + k0 + col);          \
                    _Pragma("unroll") for (u32 q = 0; q < CHUNK / 4; ++q) {                       \
                        float w[4];                                                               \
                        four4(weights, raw, q, w);                                                \
                        _Pragma("unroll") for (u32 e = 0; e < 4; ++e) into[4 * q + e] = w[e];     \
                    }                                                                             \
                } else {                                                                          \
                    for (u32 e = 0; e < CHUNK; ++e)                                               \
                        into[e] = k0 + col + e < dim ? WEIGHT(item, k0 + col + e) : 0.0f;         \
                }                                                                                 \
            } else {                                                                              \
                for (u32 e = 0; e < CHUNK; ++e) into[e] = 0.0f;                                   \
            }                                                                                     \
        }                                                                                         \
        __syncthreads();                                                                          \
        _Pragma("unroll 4") for (u32 kk = 0; kk < GEMM_K; ++kk) {                                 \
            float a[4], b[8];                                                                     \
            _Pragma("unroll") for (u32 i = 0; i < 4; ++i) a[i] = hidden_tile[ty * 4 + i][kk];    \
            _Pragma("unroll") for (u32 j = 0; j < 8; ++j) b[j] = weight_tile[tx + 16 * j][kk];   \
            _Pragma("unroll") for (u32 i = 0; i < 4; ++i)                                         \
                _Pragma("unroll") for (u32 j = 0; j < 8; ++j)                                     \
                    acc[i][j] = fmaf(a[i], b[j], acc[i][j]);                                      \
        }                                                                                         \
        __syncthreads();                                                                          \
    }                                                                                             \
    _Pragma("unroll") for (u32 i = 0; i < 4; ++i) {                                               \
        const u32 row = row0 + ty * 4 + i;                                                        \
        _Pragma("unroll") for (u32 j = 0; j < 8; ++j) {                                           \
            const u32 position = tile_start + tx + 16 * j;                                        \
            if (row < batch && position < positions) {                                            \
                const u32 item = position * stride;                                               \
                const bool real = item < n_items && item != 0;                                    \
                const float score_acc = acc[i][j];                                                \
                EPILOGUE                                                                          \
            }                                                                                     \
        }                                                                                         \
    }

// The tiled scan on the tensor cores, for f16 and int8 weights (int8 values are f16 numbers
// exactly): the same blocks of GEMM_ITEMS positions x GEMM_ROWS rows, each warp 16 positions (the
// A operand, read as pairs of columns straight from the weight rows) against every 8-row slice
// of the batch (the B operand, from shared memory) with mma.sync m16n8k16 and f32 accumulators.
// Fragments as the PTX ISA lays them out, g = lane / 4 and t = lane % 4: A's registers hold
// (row g, columns 2t and 2t + 1), (row g + 8, the same), (row g, columns 2t + 8, + 9), (row g + 8,
// the same); B's (columns 2t, 2t + 1 of batch row g) and (columns 2t + 8, + 9); D's (position g,
// rows 2t and 2t + 1) and (position g + 8, the same). A hidden value is not an f16 number, so each
// row is first scaled by a power of two (its largest magnitude over 2^14, inside f16's range,
// exactly undone on the scores) and split into a high f16 part and the f16 of what it leaves,
// each multiplied in: 22 bits of it reach the f32 sums, where one f16 part would keep 11 and miss
// the tests' score tolerance at d = 600. The tensor cores sum in their own order, so these scores
// are not the FFMA tiles' bits; the sample and the full scan run the same instructions and agree.
#define MMA_LOOP(PAIR, UNUSED, EPILOGUE)                                                          \
    __shared__ u32 hidden_high[GEMM_ROWS][MMA_K / 2 + 4];                                         \
    __shared__ u32 hidden_low[GEMM_ROWS][MMA_K / 2 + 4];                                          \
    __shared__ float row_scale[GEMM_ROWS];                                                        \
    const u32 row0 = blockIdx.y * GEMM_ROWS, tile_start = blockIdx.x * GEMM_ITEMS;                \
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;       \
    for (u32 r = warp; r < GEMM_ROWS; r += WARPS) {                                               \
        float most = 0.0f;                                                                        \
        if (row0 + r < batch) {                                                                   \
            for (u32 c = lane; c < dim; c += 32)                                                  \
                most = fmaxf(most, fabsf(LOAD_HIDDEN(hidden[(size_t)(row0 + r) * dim + c])));    \
        }                                                                                         \
        for (u32 offset = 16; offset > 0; offset >>= 1)                                           \
            most = fmaxf(most, __shfl_xor_sync(0xFFFFFFFFu, most, offset));                       \
        if (lane == 0) row_scale[r] = most > 0.0f ? ldexpf(1.0f, ilogbf(most) - 14) : 1.0f;      \
    }                                                                                             \
    __syncthreads();                                                                              \
    const u32 pos_a = tile_start + warp * 16 + g, pos_b = pos_a + 8;                              \
    const bool in_a = pos_a < positions, in_b = pos_b < positions;                                \
    const u32 item_a = in_a ? pos_a * stride : 0, item_b = in_b ? pos_b * stride : 0;             \
    float acc[GEMM_ROWS / 8][4];                                                                  \
    _Pragma("unroll") for (u32 j = 0; j < GEMM_ROWS / 8; ++j)                                     \
        _Pragma("unroll") for (u32 i = 0; i < 4; ++i) acc[j][i] = 0.0f;                          \
    for (u32 k0 = 0; k0 < pitch; k0 += MMA_K) {                                                   \
        for (u32 at = threadIdx.x; at < GEMM_ROWS * (MMA_K / 2); at += THREADS) {                 \
            const u32 r = at / (MMA_K / 2), p = at % (MMA_K / 2), col = k0 + 2 * p;               \
            float h[2] = {0.0f, 0.0f};                                                            \
            if (row0 + r < batch) {                                                               \
                _Pragma("unroll") for (u32 e = 0; e < 2; ++e) if (col + e < dim) h[e] =           \
                    LOAD_HIDDEN(hidden[(size_t)(row0 + r) * dim + col + e]) / row_scale[r];       \
            }                                                                                     \
            u16 high[2], low[2];                                                                  \
            _Pragma("unroll") for (u32 e = 0; e < 2; ++e) {                                       \
                high[e] = float_to_half_bits(h[e]);                                               \
                low[e] = float_to_half_bits(h[e] - half_bits_to_float(high[e]));                  \
            }                                                                                     \
            hidden_high[r][p] = pack_halves(high[0], high[1]);                                    \
            hidden_low[r][p] = pack_halves(low[0], low[1]);                                       \
        }                                                                                         \
        __syncthreads();                                                                          \
        for (u32 kk = 0; kk < MMA_K && k0 + kk < pitch; kk += 16) {                               \
            const u32 c0 = k0 + kk + 2 * t, c1 = c0 + 8;                                          \
            u32 a[4];                                                                             \
            a[0] = in_a && c0 < pitch ? PAIR(item_a, c0) : 0u;                                    \
            a[1] = in_b && c0 < pitch ? PAIR(item_b, c0) : 0u;                                    \
            a[2] = in_a && c1 < pitch ? PAIR(item_a, c1) : 0u;                                    \
            a[3] = in_b && c1 < pitch ? PAIR(item_b, c1) : 0u;                                    \
            const u32 p0 = kk / 2 + t, p1 = p0 + 4;                                               \
            _Pragma("unroll") for (u32 j = 0; j < GEMM_ROWS / 8; ++j) {                           \
                if (row0 + j * 8 < batch) {                                                       \
                    mma_16x8x16(acc[j], a, hidden_high[j * 8 + g][p0], hidden_high[j * 8 + g][p1]); \
                    mma_16x8x16(acc[j], a, hidden_low[j * 8 + g][p0], hidden_low[j * 8 + g][p1]); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        __syncthreads();                                                                          \
    }                                                                                             \
    _Pragma("unroll") for (u32 j = 0; j < GEMM_ROWS / 8; ++j) {                                   \
        _Pragma("unroll") for (u32 i = 0; i < 4; ++i) {                                           \
            const u32 row = row0 + j * 8 + 2 * t + (i & 1);                                       \
            const u32 position = i < 2 ? pos_a : pos_b;                                           \
            if (row < batch && position < positions) {                                            \
                const u32 item = position * stride;                                               \
                const bool real = item < n_items && item != 0;                                    \
                const float score_acc = acc[j][i] * row_scale[row - row0];                        \
                EPILOGUE                                                                          \
            }                                                                                     \
        }                                                                                         \
    }

// Two adjacent weights of a row (col even) as an f16 pair, the earlier in the low half.
#ifdef RECSYS_CUDA_EMULATION
#define PAIR_F16(item, col)                                                                       \
    pack_halves(weights[(size_t)(item) * pitch + (col)], weights[(size_t)(item) * pitch + (col) + 1])
#else
#define PAIR_F16(item, col) (*reinterpret_cast<const u32*>(weights + (size_t)(item) * pitch + (col)))
#endif
#define PAIR_I8(item, col)                                                                        \
    pack_halves(float_to_half_bits((float)weights[(size_t)(item) * pitch + (col)]),              \
                float_to_half_bits((float)weights[(size_t)(item) * pitch + (col) + 1]))

// gemm_sample_*: as gemv_sample_*, for any batch.
#define GEMM_SAMPLE_BODY(LOOP, WEIGHT, CHUNK)                                                     \
    LOOP(WEIGHT, CHUNK,                                                                           \
        const bool keep_item = real &&                                                            \
            !is_excluded(exclude_ids, exclude_offsets[row], exclude_offsets[row + 1], item);      \
        out_scores[(size_t)row * positions + position] =                                          \
            keep_item ? FINISH(score_acc, item) + bias[item] : NEG_INF;                           \
        out_index[(size_t)row * positions + position] = keep_item ? item : NONE_INDEX;)

// gemm_above_*: the threshold scan's full pass for any batch. Survivors are rare (about a quarter
// of the slots over the whole catalogue), so each takes its slot with its own atomic.
#define GEMM_ABOVE_BODY(LOOP, WEIGHT, CHUNK)                                                      \
    const u32 stride = 1, positions = n_items;                                                    \
    LOOP(WEIGHT, CHUNK,                                                                           \
        const float score = real ? FINISH(score_acc, item) + bias[item] : NEG_INF;                \
        if (real && score >= thresholds[(size_t)row * threshold_pitch + threshold_at] &&          \
            !is_excluded(exclude_ids, exclude_offsets[row], exclude_offsets[row + 1], item)) {    \
            const u32 slot = atomicAdd(counts + row, 1u);                                         \
            if (slot < capacity) {                                                                \
                out_scores[(size_t)row * capacity + slot] = score;                                \
                out_index[(size_t)row * capacity + slot] = item;                                  \
            }                                                                                     \
        })

#define GEMM_SAMPLE_KERNEL(NAME, WEIGHT_PARAMS)                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, GEMM_MIN_BLOCKS) NAME(                  \
        const float* __restrict__ hidden, WEIGHT_PARAMS, const float* __restrict__ bias,          \
        const u32* __restrict__ exclude_offsets, const u32* __restrict__ exclude_ids, u32 batch,  \
        u32 n_items, u32 dim, u32 pitch, u32 stride, u32 positions,                               \
        float* __restrict__ out_scores, u32* __restrict__ out_index)

#define GEMM_ABOVE_KERNEL(NAME, WEIGHT_PARAMS)                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, GEMM_MIN_BLOCKS) NAME(                  \
        const float* __restrict__ hidden, WEIGHT_PARAMS, const float* __restrict__ bias,          \
        const u32* __restrict__ exclude_offsets, const u32* __restrict__ exclude_ids, u32 batch,  \
        u32 n_items, u32 dim, u32 pitch, const float* __restrict__ thresholds,                    \
        u32 threshold_pitch, u32 threshold_at, u32 capacity, u32* __restrict__ counts,            \
        float* __restrict__ out_scores, u32* __restrict__ out_index)

#define FINISH(acc, item) (acc)
#define LOAD_HIDDEN(h) (h)
#define W_F32(item, c) weights[(size_t)(item) * pitch + (c)]
#define W_F16(item, c) half_bits_to_float(weights[(size_t)(item) * pitch + (c)])
// f32 weights on the FFMA tiles everywhere (3xTF32 is for a GPU run to weigh); f16 and int8 on
// the tensor cores where the architecture has m16n8k16.
#if TENSOR_CORES
#define HALF_TILES(WEIGHT, PAIR, CHUNK) MMA_LOOP, PAIR, CHUNK
#else
#define HALF_TILES(WEIGHT, PAIR, CHUNK) GEMM_LOOP, WEIGHT, CHUNK
#endif
#define EXPAND(...) __VA_ARGS__
#define GEMM_SAMPLE(ARGS) EXPAND(GEMM_SAMPLE_BODY(ARGS))
#define GEMM_ABOVE(ARGS) EXPAND(GEMM_ABOVE_BODY(ARGS))
GEMM_SAMPLE_KERNEL(gemm_sample_f32, F32_PARAMS) { GEMM_SAMPLE_BODY(GEMM_LOOP, W_F32, 4) }
GEMM_SAMPLE_KERNEL(gemm_sample_f16, F16_PARAMS) { GEMM_SAMPLE(HALF_TILES(W_F16, PAIR_F16, 8)) }
GEMM_ABOVE_KERNEL(gemm_above_f32, F32_PARAMS) { GEMM_ABOVE_BODY(GEMM_LOOP, W_F32, 4) }
GEMM_ABOVE_KERNEL(gemm_above_f16, F16_PARAMS) { GEMM_ABOVE(HALF_TILES(W_F16, PAIR_F16, 8)) }
#undef FINISH
#undef LOAD_HIDDEN
#define FINISH(acc, item) ((acc) * row_scales[item])
#define LOAD_HIDDEN(h) (activation_scale > 0.0f ? quantize_activation(h, activation_scale) : (h))
#define W_I8(item, c) ((float)weights[(size_t)(item) * pitch + (c)])
GEMM_SAMPLE_KERNEL(gemm_sample_i8, I8_PARAMS) { GEMM_SAMPLE(HALF_TILES(W_I8, PAIR_I8, 16)) }
GEMM_ABOVE_KERNEL(gemm_above_i8, I8_PARAMS) { GEMM_ABOVE(HALF_TILES(W_I8, PAIR_I8, 16)) }
#undef FINISH
#undef LOAD_HIDDEN
#undef W_F32
#undef W_F16
#undef W_I8

// Before a threshold scan: each row's survivor count to 0 and its `capacity` slots to the padding
// the merge passes skip (-inf, NONE_INDEX). One block per row.
extern "C" __global__ void __launch_bounds__(THREADS) reset_survivors(
    u32* __restrict__ counts, float* __restrict__ scores, u32* __restrict__ index, u32 capacity) {
    const u32 row = blockIdx.x;
    if (threadIdx.x == 0) counts[row] = 0;
    for (u32 i = threadIdx.x; i < capacity; i += THREADS) {
        scores[(size_t)row * capacity + i] = NEG_INF;
        index[(size_t)row * capacity + i] = NONE_INDEX;
    }
}

// A float's bits as an unsigned key in the same order (larger float, larger key; -0 below +0).
__device__ __forceinline__ u32 order_key(float f) {
    const u32 bits = __float_as_uint(f);
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

// The key of the `rank`-th best (1-based) of `n` scores, exactly: a radix select over the keys,
// one byte a pass from the top, each pass counting in `histogram` the keys that share the prefix
// chosen so far. Every thread of the block must call it; n >= rank.
__device__ u32 select_key(const float* values, u32 n, u32 rank, u32* histogram, u32& chosen_prefix,
                          u32& chosen_rank) {
    u32 prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        histogram[threadIdx.x] = 0;  // THREADS == 256 bins
        __syncthreads();
        for (u32 i = threadIdx.x; i < n; i += THREADS) {
            const u32 key = order_key(values[i]);
            if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 above = 0, digit = 255;
            while (above + histogram[digit] < rank) above += histogram[digit--];
            chosen_prefix = prefix | (digit << shift);
            chosen_rank = rank - above;
        }
        __syncthreads();
        prefix = chosen_prefix;
        rank = chosen_rank;
        mask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}

// The float whose order_key is `key`.
__device__ __forceinline__ float key_value(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? key & 0x7FFFFFFFu : ~key);
}

// The coalesced strategy's threshold, one block per row: the k-th best of the row's `count`
// sampled scores (-inf where fewer than k of them are items the row may get, since excluded and
// PAD positions carry -inf) into thresholds[row], found by radix select where the tile strategy
// merges; and, in the same launch, the row's survivor count to 0 and its slots to padding, as
// reset_survivors does.
extern "C" __global__ void __launch_bounds__(THREADS) sample_threshold(
    const float* __restrict__ sample, u32 count, u32 k, float* __restrict__ thresholds,
    u32* __restrict__ counts, float* __restrict__ survivor_scores, u32* __restrict__ survivor_index,
    u32 capacity) {
    __shared__ u32 histogram[256];
    __shared__ u32 chosen_prefix, chosen_rank;
    const u32 row = blockIdx.x;
    for (u32 i = threadIdx.x; i < capacity; i += THREADS) {
        survivor_scores[(size_t)row * capacity + i] = NEG_INF;
        survivor_index[(size_t)row * capacity + i] = NONE_INDEX;
    }
    const float tau = count >= k
        ? key_value(select_key(sample + (size_t)row * count, count, k, histogram, chosen_prefix,
                               chosen_rank))
        : NEG_INF;
    if (threadIdx.x == 0) {
        thresholds[row] = tau;
        counts[row] = 0;
    }
}

// The threshold scan's finish, one block per row, in one launch: a row's survivors (the first
// min(count, capacity) slots) hold its top-k among more; the radix select finds the k-th best
// score exactly, then every survivor at or above it (k plus its ties) is gathered into shared
// memory, sorted (best first, ties to the lower index) and the first k written to
// out[row x k ...]. Rows of at most TILE survivors skip the select. A row with more than TILE
// survivors at or above its k-th best (a tie as wide as the tile) cannot be sorted here: its
// count is set past the capacity, the host's sign to answer it another way, as for survivors
// that overflowed their slots.
extern "C" __global__ void __launch_bounds__(THREADS) finalize_survivors(
    u32* __restrict__ counts, const float* __restrict__ scores, const u32* __restrict__ index,
    u32 capacity, u32 k, float* __restrict__ out_scores, u32* __restrict__ out_index) {
    __shared__ float tile_scores[TILE];
    __shared__ u32 tile_index[TILE];
    __shared__ u32 histogram[256];
    __shared__ u32 chosen_prefix, chosen_rank, gathered;
    const u32 row = blockIdx.x;
    const u32 n = min(counts[row], capacity);
    const float* row_scores = scores + (size_t)row * capacity;
    const u32* row_index = index + (size_t)row * capacity;
    const bool select = n > TILE;
    const u32 kth = select ? select_key(row_scores, n, k, histogram, chosen_prefix, chosen_rank) : 0;
    for (u32 i = threadIdx.x; i < TILE; i += THREADS) {
        tile_scores[i] = NEG_INF;
        tile_index[i] = NONE_INDEX;
    }
    if (threadIdx.x == 0) gathered = 0;
    __syncthreads();
    for (u32 i = threadIdx.x; i < n; i += THREADS) {
        if (!select || order_key(row_scores[i]) >= kth) {
            const u32 slot = atomicAdd(&gathered, 1u);
            if (slot < TILE) {
                tile_scores[slot] = row_scores[i];
                tile_index[slot] = row_index[i];
            }
        }
    }
    __syncthreads();
    const bool too_many = gathered > TILE;
    if (too_many) {
        if (threadIdx.x == 0) counts[row] = capacity + 1;
    } else {
        sort_tile(tile_scores, tile_index);
    }
    for (u32 i = threadIdx.x; i < k; i += THREADS) {
        out_scores[(size_t)row * k + i] = too_many ? NEG_INF : tile_scores[i];
        out_index[(size_t)row * k + i] = too_many ? NONE_INDEX : tile_index[i];
    }
}

// One merge pass: block (chunk, row) selects the best `keep` of TILE of the row's `count`
// candidates (padding -inf) and writes them to out[row][chunk].
extern "C" __global__ void __launch_bounds__(THREADS) merge_topk(
    const float* __restrict__ in_scores, const u32* __restrict__ in_index, u32 count, u32 keep,
    float* __restrict__ out_scores, u32* __restrict__ out_index) {
    __shared__ float tile_scores[TILE];
    __shared__ u32 tile_index[TILE];
    __shared__ SelectScratch scratch;
    const u32 row = blockIdx.y;
    const u32 start = blockIdx.x * TILE;
    for (u32 i = threadIdx.x; i < TILE; i += THREADS) {
        u32 src = start + i;
        bool valid = src < count;
        tile_scores[i] = valid ? in_scores[(size_t)row * count + src] : NEG_INF;
        tile_index[i] = valid ? in_index[(size_t)row * count + src] : NONE_INDEX;
    }
    __syncthreads();
    const size_t out = ((size_t)row * gridDim.x + blockIdx.x) * keep;
    select_tile(tile_scores, tile_index, 0, 1, keep, scratch, out_scores + out, out_index + out);
}
