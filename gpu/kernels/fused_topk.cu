// Fused output-layer scoring + top-k for recsys, compiled at model load by NVRTC.
//
// Stage 1 (score_tile_topk_*): block (tile, row) scores TILE items of the catalogue for one hidden
// vector (one warp per item at a time: the lanes split the hidden dimension, so every weight row is
// read with coalesced loads and exactly once per row of the batch), applies bias and exclusions,
// and keeps the tile's best `keep` candidates, sorted, in shared memory; only those leave the chip.
// Stage 2 (merge_topk): blocks of TILE candidates are sorted and cut to `keep` until one block
// remains. Order: higher score first, ties to the lower item index (the engine's rule); excluded
// items and padding carry -inf and index 0xFFFFFFFF and sort last.
//
// Weights are row-major [n_items, dim]: f32, f16 bits (u16) or int8 with one f32 scale per row.
// Exclusions are CSR per batch row (offsets [rows + 1], sorted item indices).
// No headers: fp16 conversion is one PTX instruction, so NVRTC needs no include path.

#define TILE 2048
#define THREADS 256
#define WARPS (THREADS / 32)
#define NONE_INDEX 0xFFFFFFFFu
#define NEG_INF __int_as_float(0xff800000)

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float half_bits_to_float(u16 bits) {
    float out;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(out) : "h"(bits));
    return out;
}

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

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, offset);
    return v;
}

// The body shared by the three weight types; WEIGHT(item, col) reads one weight as float.
#define SCORE_TILE_BODY(WEIGHT)                                                                   \
    extern __shared__ float hidden_row[];                                                         \
    __shared__ float tile_scores[TILE];                                                           \
    __shared__ u32 tile_index[TILE];                                                              \
    const u32 row = blockIdx.y;                                                                   \
    const u32 tile_start = blockIdx.x * TILE;                                                     \
    for (u32 c = threadIdx.x; c < dim; c += THREADS) hidden_row[c] = hidden[(size_t)row * dim + c]; \
    __syncthreads();                                                                              \
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;                                   \
    const u32 ex_begin = exclude_offsets[row], ex_end = exclude_offsets[row + 1];                 \
    for (u32 t = warp; t < TILE; t += WARPS) {                                                    \
        u32 item = tile_start + t;                                                                \
        float acc = 0.0f;                                                                         \
        if (item < n_items) {                                                                     \
            for (u32 c = lane; c < dim; c += 32) acc += hidden_row[c] * (WEIGHT(item, c));        \
        }                                                                                         \
        acc = warp_sum(acc);                                                                      \
        if (lane == 0) {                                                                          \
            bool keep = item < n_items && item != 0 && !is_excluded(exclude_ids, ex_begin, ex_end, item); \
            tile_scores[t] = keep ? acc + bias[item] : NEG_INF;                                 \
            tile_index[t] = keep ? item : NONE_INDEX;                                             \
        }                                                                                         \
    }                                                                                             \
    __syncthreads();                                                                              \
    sort_tile(tile_scores, tile_index);                                                           \
    const size_t out = ((size_t)row * gridDim.x + blockIdx.x) * keep;                             \
    for (u32 i = threadIdx.x; i < keep; i += THREADS) {                                           \
        out_scores[out + i] = tile_scores[i];                                                     \
        out_index[out + i] = tile_index[i];                                                       \
    }

extern "C" __global__ void __launch_bounds__(THREADS) score_tile_topk_f32(
    const float* __restrict__ hidden, const float* __restrict__ weights, const float* __restrict__ bias,
    const u32* __restrict__ exclude_offsets, const u32* __restrict__ exclude_ids,
    u32 n_items, u32 dim, u32 keep, float* __restrict__ out_scores, u32* __restrict__ out_index) {
#define W_F32(item, c) weights[(size_t)(item) * dim + (c)]
    SCORE_TILE_BODY(W_F32)
#undef W_F32
}

extern "C" __global__ void __launch_bounds__(THREADS) score_tile_topk_f16(
    const float* __restrict__ hidden, const u16* __restrict__ weights, const float* __restrict__ bias,
    const u32* __restrict__ exclude_offsets, const u32* __restrict__ exclude_ids,
    u32 n_items, u32 dim, u32 keep, float* __restrict__ out_scores, u32* __restrict__ out_index) {
#define W_F16(item, c) half_bits_to_float(weights[(size_t)(item) * dim + (c)])
    SCORE_TILE_BODY(W_F16)
#undef W_F16
}

// int8: the row's scale is applied once to the dot product (sum_c h_c q_c) * s, as the engine does.
extern "C" __global__ void __launch_bounds__(THREADS) score_tile_topk_i8(
    const float* __restrict__ hidden, const signed char* __restrict__ weights,
    const float* __restrict__ row_scales, const float* __restrict__ bias,
    const u32* __restrict__ exclude_offsets, const u32* __restrict__ exclude_ids,
    u32 n_items, u32 dim, u32 keep, float* __restrict__ out_scores, u32* __restrict__ out_index) {
#define W_I8(item, c) ((float)weights[(size_t)(item) * dim + (c)] * row_scales[item])
    SCORE_TILE_BODY(W_I8)
#undef W_I8
}

// One merge pass: block (chunk, row) sorts TILE of the row's `count` candidates (padding -inf) and
// writes its best `keep` to out[row][chunk].
extern "C" __global__ void __launch_bounds__(THREADS) merge_topk(
    const float* __restrict__ in_scores, const u32* __restrict__ in_index, u32 count, u32 keep,
    float* __restrict__ out_scores, u32* __restrict__ out_index) {
    __shared__ float tile_scores[TILE];
    __shared__ u32 tile_index[TILE];
    const u32 row = blockIdx.y;
    const u32 start = blockIdx.x * TILE;
    for (u32 i = threadIdx.x; i < TILE; i += THREADS) {
        u32 src = start + i;
        bool valid = src < count;
        tile_scores[i] = valid ? in_scores[(size_t)row * count + src] : NEG_INF;
        tile_index[i] = valid ? in_index[(size_t)row * count + src] : NONE_INDEX;
    }
    __syncthreads();
    sort_tile(tile_scores, tile_index);
    const size_t out = ((size_t)row * gridDim.x + blockIdx.x) * keep;
    for (u32 i = threadIdx.x; i < keep; i += THREADS) {
        out_scores[out + i] = tile_scores[i];
        out_index[out + i] = tile_index[i];
    }
}
