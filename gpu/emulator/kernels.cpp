// The kernels of ../kernels/*.cu, compiled for the host with the CUDA emulation and exported with
// C linkage for the emulated tests (gpu/tests/emulated/mod.rs is the caller). Each entry point
// takes the launch geometry and then exactly the kernel's parameters; 0 means success, otherwise
// recsys_emu_failure() says what went wrong.
#include "cuda_emulation.hpp"

#include "../kernels/fused_topk.cu"
#include "../kernels/encoders.cu"

extern "C" {

const char* recsys_emu_failure() { return emu::failure.c_str(); }

#define STAGE1_ENTRY(NAME, WEIGHT_PARAMS, WEIGHT_ARGS)                                               \
    int recsys_emu_##NAME(unsigned grid_x, unsigned grid_y, unsigned shared_bytes,                   \
                          const float* hidden, WEIGHT_PARAMS, const float* bias,                     \
                          const u32* exclude_offsets, const u32* exclude_ids, u32 batch,             \
                          u32 rows_per_block, u32 n_items, u32 dim, u32 pitch, u32 keep,             \
                          float* out_scores, u32* out_index) {                                       \
        return emu::launch(#NAME, dim3(grid_x, grid_y), dim3(THREADS), shared_bytes, [=] {          \
            NAME(hidden, WEIGHT_ARGS, bias, exclude_offsets, exclude_ids, batch, rows_per_block,     \
                 n_items, dim, pitch, keep, out_scores, out_index);                                  \
        });                                                                                          \
    }

#define COMMA ,
STAGE1_ENTRY(score_tile_topk_f32, const float* weights, weights)
STAGE1_ENTRY(score_tile_topk_f16, const u16* weights, weights)
STAGE1_ENTRY(score_tile_topk_i8,
             const signed char* weights COMMA const float* row_scales COMMA float activation_scale,
             weights COMMA row_scales COMMA activation_scale)

#define SAMPLE_ENTRY(NAME, WEIGHT_PARAMS, WEIGHT_ARGS)                                               \
    int recsys_emu_##NAME(unsigned grid_x, unsigned grid_y, unsigned shared_bytes,                   \
                          const float* hidden, WEIGHT_PARAMS, const float* bias,                     \
                          const u32* exclude_offsets, const u32* exclude_ids, u32 batch,             \
                          u32 rows_per_block, u32 n_items, u32 dim, u32 pitch, u32 keep,             \
                          u32 stride, float* out_scores, u32* out_index) {                           \
        return emu::launch(#NAME, dim3(grid_x, grid_y), dim3(THREADS), shared_bytes, [=] {          \
            NAME(hidden, WEIGHT_ARGS, bias, exclude_offsets, exclude_ids, batch, rows_per_block,     \
                 n_items, dim, pitch, keep, stride, out_scores, out_index);                          \
        });                                                                                          \
    }

SAMPLE_ENTRY(sample_tile_topk_f32, const float* weights, weights)
SAMPLE_ENTRY(sample_tile_topk_f16, const u16* weights, weights)
SAMPLE_ENTRY(sample_tile_topk_i8,
             const signed char* weights COMMA const float* row_scales COMMA float activation_scale,
             weights COMMA row_scales COMMA activation_scale)

#define ABOVE_ENTRY(NAME, WEIGHT_PARAMS, WEIGHT_ARGS)                                                \
    int recsys_emu_##NAME(unsigned grid_x, unsigned grid_y, unsigned shared_bytes,                   \
                          const float* hidden, WEIGHT_PARAMS, const float* bias,                     \
                          const u32* exclude_offsets, const u32* exclude_ids, u32 batch,             \
                          u32 rows_per_block, u32 n_items, u32 dim, u32 pitch,                       \
                          const float* thresholds, u32 threshold_pitch, u32 threshold_at,            \
                          u32 capacity, u32* counts, float* out_scores, u32* out_index) {            \
        return emu::launch(#NAME, dim3(grid_x, grid_y), dim3(THREADS), shared_bytes, [=] {          \
            NAME(hidden, WEIGHT_ARGS, bias, exclude_offsets, exclude_ids, batch, rows_per_block,     \
                 n_items, dim, pitch, thresholds, threshold_pitch, threshold_at, capacity, counts,   \
                 out_scores, out_index);                                                             \
        });                                                                                          \
    }

ABOVE_ENTRY(score_above_f32, const float* weights, weights)
ABOVE_ENTRY(score_above_f16, const u16* weights, weights)
ABOVE_ENTRY(score_above_i8,
            const signed char* weights COMMA const float* row_scales COMMA float activation_scale,
            weights COMMA row_scales COMMA activation_scale)

#define GEMV_SAMPLE_ENTRY(NAME, WEIGHT_PARAMS, WEIGHT_ARGS)                                          \
    int recsys_emu_##NAME(unsigned blocks, unsigned shared_bytes, const float* hidden,              \
                          WEIGHT_PARAMS, const float* bias, const u32* exclude_offsets,              \
                          const u32* exclude_ids, u32 batch, u32 n_items, u32 dim, u32 pitch,        \
                          u32 lanes, u32 stride, u32 positions, float* out_scores, u32* out_index) { \
        return emu::launch(#NAME, dim3(blocks), dim3(THREADS), shared_bytes, [=] {                  \
            NAME(hidden, WEIGHT_ARGS, bias, exclude_offsets, exclude_ids, batch, n_items, dim,       \
                 pitch, lanes, stride, positions, out_scores, out_index);                            \
        });                                                                                          \
    }

GEMV_SAMPLE_ENTRY(gemv_sample_f32, const float* weights, weights)
GEMV_SAMPLE_ENTRY(gemv_sample_f16, const u16* weights, weights)
GEMV_SAMPLE_ENTRY(gemv_sample_i8,
                  const signed char* weights COMMA const float* row_scales COMMA float activation_scale,
                  weights COMMA row_scales COMMA activation_scale)

#define GEMV_ABOVE_ENTRY(NAME, WEIGHT_PARAMS, WEIGHT_ARGS)                                           \
    int recsys_emu_##NAME(unsigned blocks, unsigned shared_bytes, const float* hidden,              \
                          WEIGHT_PARAMS, const float* bias, const u32* exclude_offsets,              \
                          const u32* exclude_ids, u32 batch, u32 n_items, u32 dim, u32 pitch,        \
                          u32 lanes, const float* thresholds, u32 threshold_pitch,                   \
                          u32 threshold_at, u32 capacity, u32* counts, float* out_scores,            \
                          u32* out_index) {                                                          \
        return emu::launch(#NAME, dim3(blocks), dim3(THREADS), shared_bytes, [=] {                  \
            NAME(hidden, WEIGHT_ARGS, bias, exclude_offsets, exclude_ids, batch, n_items, dim,       \
                 pitch, lanes, thresholds, threshold_pitch, threshold_at, capacity, counts,          \
                 out_scores, out_index);                                                             \
        });                                                                                          \
    }

GEMV_ABOVE_ENTRY(gemv_above_f32, const float* weights, weights)
GEMV_ABOVE_ENTRY(gemv_above_f16, const u16* weights, weights)
GEMV_ABOVE_ENTRY(gemv_above_i8,
                 const signed char* weights COMMA const float* row_scales COMMA float activation_scale,
                 weights COMMA row_scales COMMA activation_scale)

#define GEMM_SAMPLE_ENTRY(NAME, WEIGHT_PARAMS, WEIGHT_ARGS)                                          \
    int recsys_emu_##NAME(unsigned grid_x, unsigned grid_y, const float* hidden, WEIGHT_PARAMS,    \
                          const float* bias, const u32* exclude_offsets, const u32* exclude_ids,     \
                          u32 batch, u32 n_items, u32 dim, u32 pitch, u32 stride, u32 positions,     \
                          float* out_scores, u32* out_index) {                                       \
        return emu::launch(#NAME, dim3(grid_x, grid_y), dim3(THREADS), 0, [=] {                     \
            NAME(hidden, WEIGHT_ARGS, bias, exclude_offsets, exclude_ids, batch, n_items, dim,       \
                 pitch, stride, positions, out_scores, out_index);                                   \
        });                                                                                          \
    }

GEMM_SAMPLE_ENTRY(gemm_sample_f32, const float* weights, weights)
GEMM_SAMPLE_ENTRY(gemm_sample_f16, const u16* weights, weights)
GEMM_SAMPLE_ENTRY(gemm_sample_i8,
                  const signed char* weights COMMA const float* row_scales COMMA float activation_scale,
                  weights COMMA row_scales COMMA activation_scale)

#define GEMM_ABOVE_ENTRY(NAME, WEIGHT_PARAMS, WEIGHT_ARGS)                                           \
    int recsys_emu_##NAME(unsigned grid_x, unsigned grid_y, const float* hidden, WEIGHT_PARAMS,    \
                          const float* bias, const u32* exclude_offsets, const u32* exclude_ids,     \
                          u32 batch, u32 n_items, u32 dim, u32 pitch, const float* thresholds,       \
                          u32 threshold_pitch, u32 threshold_at, u32 capacity, u32* counts,          \
                          float* out_scores, u32* out_index) {                                       \
        return emu::launch(#NAME, dim3(grid_x, grid_y), dim3(THREADS), 0, [=] {                     \
            NAME(hidden, WEIGHT_ARGS, bias, exclude_offsets, exclude_ids, batch, n_items, dim,       \
                 pitch, thresholds, threshold_pitch, threshold_at, capacity, counts, out_scores,     \
                 out_index);                                                                         \
        });                                                                                          \
    }

GEMM_ABOVE_ENTRY(gemm_above_f32, const float* weights, weights)
GEMM_ABOVE_ENTRY(gemm_above_f16, const u16* weights, weights)
GEMM_ABOVE_ENTRY(gemm_above_i8,
                 const signed char* weights COMMA const float* row_scales COMMA float activation_scale,
                 weights COMMA row_scales COMMA activation_scale)

int recsys_emu_reset_survivors(unsigned rows, u32* counts, float* scores, u32* index,
                               u32 capacity) {
    return emu::launch("reset_survivors", dim3(rows), dim3(THREADS), 0,
                       [=] { reset_survivors(counts, scores, index, capacity); });
}

int recsys_emu_sample_threshold(unsigned rows, const float* sample, u32 count, u32 k,
                                float* thresholds, u32* counts, float* survivor_scores,
                                u32* survivor_index, u32 capacity) {
    return emu::launch("sample_threshold", dim3(rows), dim3(THREADS), 0, [=] {
        sample_threshold(sample, count, k, thresholds, counts, survivor_scores, survivor_index,
                         capacity);
    });
}

int recsys_emu_finalize_survivors(unsigned rows, u32* counts, const float* scores,
                                  const u32* index, u32 capacity, u32 k, float* out_scores,
                                  u32* out_index) {
    return emu::launch("finalize_survivors", dim3(rows), dim3(THREADS), 0, [=] {
        finalize_survivors(counts, scores, index, capacity, k, out_scores, out_index);
    });
}

int recsys_emu_merge_topk(unsigned grid_x, unsigned grid_y, const float* in_scores,
                          const u32* in_index, u32 count, u32 keep, float* out_scores,
                          u32* out_index) {
    return emu::launch("merge_topk", dim3(grid_x, grid_y), dim3(THREADS), 0, [=] {
        merge_topk(in_scores, in_index, count, keep, out_scores, out_index);
    });
}

int recsys_emu_linear_f32(unsigned grid_x, unsigned grid_y, const float* x, const float* w,
                          const float* bias, float* y, u32 m, u32 n, u32 k, u32 activation) {
    return emu::launch("linear_f32", dim3(grid_x, grid_y), dim3(ENC_THREADS), 0,
                       [=] { linear_f32(x, w, bias, y, m, n, k, activation); });
}

int recsys_emu_add_layer_norm(unsigned rows, const float* x, const float* residual,
                              const float* gamma, const float* beta, float* y, u32 width,
                              double eps) {
    return emu::launch("add_layer_norm", dim3(rows), dim3(ENC_THREADS), 0,
                       [=] { add_layer_norm(x, residual, gamma, beta, y, width, eps); });
}

#define TABLE_ENTRIES(PREFIX, TAIL_PARAMS, TAIL_ARGS)                                              \
    int recsys_emu_##PREFIX##_f32(unsigned blocks, const float* table, TAIL_PARAMS) {              \
        return emu::launch(#PREFIX "_f32", dim3(blocks), dim3(ENC_THREADS), 0,                     \
                           [=] { PREFIX##_f32(table, TAIL_ARGS); });                               \
    }                                                                                              \
    int recsys_emu_##PREFIX##_f16(unsigned blocks, const u16* table, TAIL_PARAMS) {                \
        return emu::launch(#PREFIX "_f16", dim3(blocks), dim3(ENC_THREADS), 0,                     \
                           [=] { PREFIX##_f16(table, TAIL_ARGS); });                               \
    }                                                                                              \
    int recsys_emu_##PREFIX##_i8(unsigned blocks, const signed char* table,                        \
                                 const float* row_scales, TAIL_PARAMS) {                           \
        return emu::launch(#PREFIX "_i8", dim3(blocks), dim3(ENC_THREADS), 0,                      \
                           [=] { PREFIX##_i8(table, row_scales, TAIL_ARGS); });                    \
    }

TABLE_ENTRIES(embed_tokens,
              const u32* items COMMA const u32* positions COMMA const float* position_table
                  COMMA float* x COMMA u32 width,
              items COMMA positions COMMA position_table COMMA x COMMA width)
TABLE_ENTRIES(embedding_bag,
              const u32* items COMMA const u32* offsets COMMA const float* bias COMMA float* y
                  COMMA u32 width,
              items COMMA offsets COMMA bias COMMA y COMMA width)

int recsys_emu_attention(unsigned sequences, unsigned heads, const float* q, const float* k,
                         const float* v, const u32* seq_offsets, float* out, u32 head_dim,
                         u32 width, u32 causal) {
    return emu::launch("attention", dim3(sequences, heads), dim3(ENC_THREADS), 0,
                       [=] { attention(q, k, v, seq_offsets, out, head_dim, width, causal); });
}

int recsys_emu_gru_gates(unsigned rows, const float* input_gates, const float* state_gates,
                         float* state, float* outputs, u32 first_token, u32 hidden) {
    return emu::launch("gru_gates", dim3(rows), dim3(ENC_THREADS), 0, [=] {
        gru_gates(input_gates, state_gates, state, outputs, first_token, hidden);
    });
}

int recsys_emu_gather_rows(unsigned count, const float* src, const u32* rows, float* dst,
                           u32 width) {
    return emu::launch("gather_rows", dim3(count), dim3(ENC_THREADS), 0,
                       [=] { gather_rows(src, rows, dst, width); });
}

int recsys_emu_hstu_attention(unsigned sequences, unsigned heads, const float* uvqk,
                              const u32* seq_offsets, const u16* buckets,
                              const u32* bucket_offsets, const float* position_bias,
                              const float* time_bias, float* out, u32 dqk, u32 dv, u32 width,
                              u32 attention_width) {
    return emu::launch("hstu_attention", dim3(sequences, heads), dim3(ENC_THREADS), 0, [=] {
        hstu_attention(uvqk, seq_offsets, buckets, bucket_offsets, position_bias, time_bias, out,
                       dqk, dv, width, attention_width);
    });
}

int recsys_emu_hstu_gate(unsigned rows, const float* uvqk, const float* normed, float* gated,
                         u32 values, u32 width) {
    return emu::launch("hstu_gate", dim3(rows), dim3(ENC_THREADS), 0,
                       [=] { hstu_gate(uvqk, normed, gated, values, width); });
}

int recsys_emu_add_rows(unsigned rows, float* y, const float* x, u32 width) {
    return emu::launch("add_rows", dim3(rows), dim3(ENC_THREADS), 0,
                       [=] { add_rows(y, x, width); });
}

int recsys_emu_l2_normalize_rows(unsigned rows, float* x, u32 width, float eps) {
    return emu::launch("l2_normalize_rows", dim3(rows), dim3(ENC_THREADS), 0,
                       [=] { l2_normalize_rows(x, width, eps); });
}

}  // extern "C"

// Probes of the emulation itself, so its tests can show that it models what the kernels rely on.
namespace probes {

// Every lane ends with the sum over its warp of (lane + 1), through __shfl_down_sync + __shfl_sync.
__global__ void warp_sums(u32* out) {
    u32 v = threadIdx.x % 32 + 1;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, offset);
    out[threadIdx.x] = __shfl_sync(0xFFFFFFFFu, v, 0);
}

// Half the block skips a barrier: undefined on a GPU, reported by the emulation.
__global__ void divergent_barrier(u32* out) {
    if (threadIdx.x < 64) __syncthreads();
    out[threadIdx.x] = 1;
}

}  // namespace probes

extern "C" {

int recsys_emu_probe_warp_sums(u32* out /* 64 values */) {
    return emu::launch("warp_sums", dim3(1), dim3(64), 0, [=] { probes::warp_sums(out); });
}

int recsys_emu_probe_divergent_barrier(u32* out /* 128 values */) {
    return emu::launch("divergent_barrier", dim3(1), dim3(128), 0,
                       [=] { probes::divergent_barrier(out); });
}

}  // extern "C"
