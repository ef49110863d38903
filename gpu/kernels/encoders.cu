// The encoders of recsys' models on the GPU (the transformers, GRU4Rec, Mult-VAE's MLP, HSTU's
// blocks), so a KIND_GPU
// instance runs the whole model on the device and only ids and top-k results cross the bus.
// Compiled at model load by NVRTC next to fused_topk.cu (and, like it, as host C++ for the emulated
// tests). All arithmetic is f32 with the CPU engine's formulas; LayerNorm statistics in f64 as on
// the CPU, because a row's mean can dwarf its variance.
//
// Weights arrive as the engine stores them: dense layers dequantised to f32 at load (they are
// small), the item tables (BERT4Rec's embedding, Mult-VAE's first layer by item) at their own
// precision, since they grow with the catalogue.

typedef unsigned int u32;
typedef unsigned short u16;

#define ENC_THREADS 256
// Square tile of the dense-layer kernel (ENC_THREADS = LINEAR_TILE^2 threads).
#define LINEAR_TILE 16
// Widest attention head (two values per lane of a warp).
#define MAX_HEAD_DIM 64

#define ACTIVATION_NONE 0
#define ACTIVATION_GELU 1
#define ACTIVATION_TANH 2
#define ACTIVATION_SILU 3

#ifdef RECSYS_CUDA_EMULATION
__device__ __forceinline__ float enc_half_to_float(u16 bits) { return emu::half_bits_to_float(bits); }
#else
__device__ __forceinline__ float enc_half_to_float(u16 bits) {
    float out;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(out) : "h"(bits));
    return out;
}
#endif

__device__ __forceinline__ float activate(float v, u32 activation) {
    if (activation == ACTIVATION_GELU) return v * 0.5f * (1.0f + erff(v * 0.70710678118654752f));
    if (activation == ACTIVATION_TANH) return tanhf(v);
    if (activation == ACTIVATION_SILU) return v / (1.0f + expf(-v));
    return v;
}

// y[m, n] = act(x[m, k] @ w[n, k]^T + bias[n]) (PyTorch's Linear layout). Block (n tile, m tile)
// of LINEAR_TILE x LINEAR_TILE threads; both operands staged through shared memory tile by tile.
extern "C" __global__ void __launch_bounds__(ENC_THREADS) linear_f32(
    const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
    float* __restrict__ y, u32 m, u32 n, u32 k, u32 activation) {
    __shared__ float x_tile[LINEAR_TILE][LINEAR_TILE + 1];
    __shared__ float w_tile[LINEAR_TILE][LINEAR_TILE + 1];
    const u32 tx = threadIdx.x % LINEAR_TILE, ty = threadIdx.x / LINEAR_TILE;
    const u32 row = blockIdx.y * LINEAR_TILE + ty;  // of x and y
    const u32 col = blockIdx.x * LINEAR_TILE + tx;  // of y (a row of w)
    const u32 w_row = blockIdx.x * LINEAR_TILE + ty;  // the w row this thread stages
    float acc = 0.0f;
    for (u32 k0 = 0; k0 < k; k0 += LINEAR_TILE) {
        x_tile[ty][tx] = (row < m && k0 + tx < k) ? x[(size_t)row * k + k0 + tx] : 0.0f;
        w_tile[ty][tx] = (w_row < n && k0 + tx < k) ? w[(size_t)w_row * k + k0 + tx] : 0.0f;
        __syncthreads();
        for (u32 j = 0; j < LINEAR_TILE; ++j) acc += x_tile[ty][j] * w_tile[tx][j];
        __syncthreads();
    }
    if (row < m && col < n) y[(size_t)row * n + col] = activate(acc + bias[col], activation);
}

// y[r] = LayerNorm(x[r] + residual[r]) * gamma + beta, one block per row (residual may be null).
extern "C" __global__ void __launch_bounds__(ENC_THREADS) add_layer_norm(
    const float* __restrict__ x, const float* __restrict__ residual, const float* __restrict__ gamma,
    const float* __restrict__ beta, float* __restrict__ y, u32 width, double eps) {
    __shared__ double partial[ENC_THREADS];
    const size_t base = (size_t)blockIdx.x * width;
    double sum = 0.0;
    for (u32 c = threadIdx.x; c < width; c += ENC_THREADS) {
        float v = x[base + c] + (residual ? residual[base + c] : 0.0f);
        y[base + c] = v;
        sum += v;
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (u32 s = ENC_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    const double mean = partial[0] / width;
    __syncthreads();
    double squares = 0.0;
    for (u32 c = threadIdx.x; c < width; c += ENC_THREADS) {
        double d = (double)y[base + c] - mean;
        squares += d * d;
    }
    partial[threadIdx.x] = squares;
    __syncthreads();
    for (u32 s = ENC_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    const double inv_std = 1.0 / sqrt(partial[0] / width + eps);
    for (u32 c = threadIdx.x; c < width; c += ENC_THREADS)
        y[base + c] = (float)(((double)y[base + c] - mean) * inv_std) * gamma[c] + beta[c];
}

// BERT4Rec's input: x[t] = position_table[positions[t]] + item_row(items[t]), one block per token.
#define EMBED_TOKENS_BODY(ITEM_VALUE)                                                              \
    const u32 t = blockIdx.x;                                                                     \
    const u32 item = items[t], position = positions[t];                                           \
    for (u32 c = threadIdx.x; c < width; c += ENC_THREADS)                                        \
        x[(size_t)t * width + c] = position_table[(size_t)position * width + c] + (ITEM_VALUE);

extern "C" __global__ void __launch_bounds__(ENC_THREADS) embed_tokens_f32(
    const float* __restrict__ table, const u32* __restrict__ items, const u32* __restrict__ positions,
    const float* __restrict__ position_table, float* __restrict__ x, u32 width) {
    EMBED_TOKENS_BODY(table[(size_t)item * width + c])
}

extern "C" __global__ void __launch_bounds__(ENC_THREADS) embed_tokens_f16(
    const u16* __restrict__ table, const u32* __restrict__ items, const u32* __restrict__ positions,
    const float* __restrict__ position_table, float* __restrict__ x, u32 width) {
    EMBED_TOKENS_BODY(enc_half_to_float(table[(size_t)item * width + c]))
}

extern "C" __global__ void __launch_bounds__(ENC_THREADS) embed_tokens_i8(
    const signed char* __restrict__ table, const float* __restrict__ row_scales,
    const u32* __restrict__ items, const u32* __restrict__ positions,
    const float* __restrict__ position_table, float* __restrict__ x, u32 width) {
    EMBED_TOKENS_BODY((float)table[(size_t)item * width + c] * row_scales[item])
}

__device__ __forceinline__ float enc_warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    return v;
}

// Self-attention within each sequence: out = softmax(q k^T / sqrt(d)) v per head, over every key
// of the sequence (BERT4Rec) or, when `causal` (SASRec), over the keys up to the query's own slot
// (RecBole's -10000 on the later ones weighs exactly 0 after its softmax).
// Block (sequence, head); each warp takes one query at a time, its lanes splitting the head's
// dimensions (two each at most), and walks the sequence's keys with a running (online) softmax.
// Rows are tokens of the stacked batch, [tokens, width] with width = heads * head_dim;
// seq_offsets[s]..seq_offsets[s + 1] are sequence s's tokens.
extern "C" __global__ void __launch_bounds__(ENC_THREADS) attention(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const u32* __restrict__ seq_offsets, float* __restrict__ out, u32 head_dim, u32 width,
    u32 causal) {
    const u32 seq = blockIdx.x, head = blockIdx.y;
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u32 begin = seq_offsets[seq], end = seq_offsets[seq + 1];
    const u32 c0 = head * head_dim + lane, c1 = c0 + 32;
    const bool has0 = lane < head_dim, has1 = lane + 32 < head_dim;
    const float scale = 1.0f / sqrtf((float)head_dim);
    for (u32 query = begin + warp; query < end; query += ENC_THREADS / 32) {
        const float q0 = has0 ? q[(size_t)query * width + c0] : 0.0f;
        const float q1 = has1 ? q[(size_t)query * width + c1] : 0.0f;
        float running_max = __int_as_float(0xff800000), denominator = 0.0f, acc0 = 0.0f, acc1 = 0.0f;
        const u32 keys_end = causal ? query + 1 : end;
        for (u32 key = begin; key < keys_end; ++key) {
            float part = (has0 ? q0 * k[(size_t)key * width + c0] : 0.0f) +
                         (has1 ? q1 * k[(size_t)key * width + c1] : 0.0f);
            const float score = enc_warp_sum(part) * scale;
            const float next_max = fmaxf(running_max, score);
            const float rescale = expf(running_max - next_max);  // 0 on the first key
            const float weight = expf(score - next_max);
            denominator = denominator * rescale + weight;
            acc0 = acc0 * rescale + (has0 ? weight * v[(size_t)key * width + c0] : 0.0f);
            acc1 = acc1 * rescale + (has1 ? weight * v[(size_t)key * width + c1] : 0.0f);
            running_max = next_max;
        }
        if (has0) out[(size_t)query * width + c0] = acc0 / denominator;
        if (has1) out[(size_t)query * width + c1] = acc1 / denominator;
    }
}

// One GRU step (GRU4Rec) for the histories still running, rows 0..gridDim.x of `state`, in
// PyTorch's gate order (reset, update, new): r = sigmoid(i_r + h_r), z = sigmoid(i_z + h_z),
// n = tanh(i_n + r h_n), h = (1 - z) n + z h. `input_gates` holds the input side of every token's
// gates ([tokens, 3 hidden], biases included), this step's rows from `first_token` on;
// `state_gates` the state side of the running rows ([rows, 3 hidden]). The new state is also
// written to outputs[first_token + row] (the next layer's input). One block per row.
extern "C" __global__ void __launch_bounds__(ENC_THREADS) gru_gates(
    const float* __restrict__ input_gates, const float* __restrict__ state_gates,
    float* __restrict__ state, float* __restrict__ outputs, u32 first_token, u32 hidden) {
    const u32 row = blockIdx.x;
    const float* i = input_gates + (size_t)(first_token + row) * 3 * hidden;
    const float* g = state_gates + (size_t)row * 3 * hidden;
    for (u32 c = threadIdx.x; c < hidden; c += ENC_THREADS) {
        const float reset = 1.0f / (1.0f + expf(-(i[c] + g[c])));
        const float update = 1.0f / (1.0f + expf(-(i[hidden + c] + g[hidden + c])));
        const float candidate = tanhf(i[2 * hidden + c] + reset * g[2 * hidden + c]);
        const size_t at = (size_t)row * hidden + c;
        const float next = (1.0f - update) * candidate + update * state[at];
        state[at] = next;
        outputs[(size_t)(first_token + row) * hidden + c] = next;
    }
}

// dst[i] = src[rows[i]] (the answer rows of the transformers, GRU4Rec's batch order), one block
// per row.
extern "C" __global__ void __launch_bounds__(ENC_THREADS) gather_rows(
    const float* __restrict__ src, const u32* __restrict__ rows, float* __restrict__ dst, u32 width) {
    const size_t from = (size_t)rows[blockIdx.x] * width, to = (size_t)blockIdx.x * width;
    for (u32 c = threadIdx.x; c < width; c += ENC_THREADS) dst[to + c] = src[from + c];
}

// Mult-VAE's first layer without the multi-hot input: y[r] = tanh(sum of the by-item rows of the
// history's distinct items / sqrt(count) + bias), one block per history; items[offsets[r]..
// offsets[r + 1]] are sorted and distinct, summed in that order (as the CPU does).
#define EMBEDDING_BAG_BODY(ITEM_VALUE)                                                             \
    const u32 r = blockIdx.x;                                                                     \
    const u32 first = offsets[r], last = offsets[r + 1];                                          \
    const float scale = 1.0f / fmaxf(sqrtf((float)(last - first)), 1e-12f);                      \
    for (u32 c = threadIdx.x; c < width; c += ENC_THREADS) {                                      \
        float acc = 0.0f;                                                                         \
        for (u32 i = first; i < last; ++i) {                                                      \
            const u32 item = items[i];                                                            \
            acc += (ITEM_VALUE);                                                                  \
        }                                                                                         \
        y[(size_t)r * width + c] = tanhf(acc * scale + bias[c]);                                  \
    }

extern "C" __global__ void __launch_bounds__(ENC_THREADS) embedding_bag_f32(
    const float* __restrict__ table, const u32* __restrict__ items, const u32* __restrict__ offsets,
    const float* __restrict__ bias, float* __restrict__ y, u32 width) {
    EMBEDDING_BAG_BODY(table[(size_t)item * width + c])
}

extern "C" __global__ void __launch_bounds__(ENC_THREADS) embedding_bag_f16(
    const u16* __restrict__ table, const u32* __restrict__ items, const u32* __restrict__ offsets,
    const float* __restrict__ bias, float* __restrict__ y, u32 width) {
    EMBEDDING_BAG_BODY(enc_half_to_float(table[(size_t)item * width + c]))
}

extern "C" __global__ void __launch_bounds__(ENC_THREADS) embedding_bag_i8(
    const signed char* __restrict__ table, const float* __restrict__ row_scales,
    const u32* __restrict__ items, const u32* __restrict__ offsets, const float* __restrict__ bias,
    float* __restrict__ y, u32 width) {
    EMBEDDING_BAG_BODY((float)table[(size_t)item * width + c] * row_scales[item])
}

// HSTU's pointwise attention (no softmax): for each query row i of a history and each key j <= i,
// w = silu(q_i . k_j + position_bias[NA - 1 - i + j] + time_bias[bucket(i, j)]) / NA, and the
// output is sum_j w v_j per head. `uvqk` holds every token's [u | v | q | k] after the SiLU
// (`width` wide: u and v are heads x dv, q and k heads x dqk); the tokens of history s are
// seq_offsets[s]..seq_offsets[s + 1], oldest first (local index 0). Its time-gap buckets are the
// [n, n] block at bucket_offsets[s] (row i against keys 0..=i; the host computes them with the
// CPU engine's function, so both bucket the same gaps alike). out is [tokens, heads x dv].
// Block (history, head); each warp takes one query at a time, its lanes splitting the head's
// dimensions (two each at most), as `attention` does.
extern "C" __global__ void __launch_bounds__(ENC_THREADS) hstu_attention(
    const float* __restrict__ uvqk, const u32* __restrict__ seq_offsets,
    const u16* __restrict__ buckets, const u32* __restrict__ bucket_offsets,
    const float* __restrict__ position_bias, const float* __restrict__ time_bias,
    float* __restrict__ out, u32 dqk, u32 dv, u32 width, u32 attention_width) {
    const u32 seq = blockIdx.x, head = blockIdx.y, heads = gridDim.y;
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u32 begin = seq_offsets[seq], n = seq_offsets[seq + 1] - begin;
    const u32 values = heads * dv;
    // This lane's columns of a row: its (at most two) query/key and value dimensions of the head.
    const float* rows = uvqk + (size_t)begin * width;
    const u32 q_col = 2 * values + head * dqk + lane, k_col = q_col + heads * dqk;
    const u32 v_col = values + head * dv + lane;
    const bool qk0 = lane < dqk, qk1 = lane + 32 < dqk;
    const bool v0 = lane < dv, v1 = lane + 32 < dv;
    const float divisor = (float)attention_width;
    for (u32 i = warp; i < n; i += ENC_THREADS / 32) {
        const float* query = rows + (size_t)i * width;
        const float q0 = qk0 ? query[q_col] : 0.0f, q1 = qk1 ? query[q_col + 32] : 0.0f;
        // Key j's biases: the position offset's weight and its time gap's bucket.
        const float* positions = position_bias + (attention_width - 1 - i);
        const u16* gaps = buckets + bucket_offsets[seq] + (size_t)i * n;
        float acc0 = 0.0f, acc1 = 0.0f;
        const float* key = rows;
        for (u32 j = 0; j <= i; ++j, key += width) {
            const float part = (qk0 ? q0 * key[k_col] : 0.0f) + (qk1 ? q1 * key[k_col + 32] : 0.0f);
            const float score = enc_warp_sum(part) + positions[j] + time_bias[gaps[j]];
            const float weight = score / (1.0f + expf(-score)) / divisor;
            if (v0) acc0 += weight * key[v_col];
            if (v1) acc1 += weight * key[v_col + 32];
        }
        float* o = out + (size_t)(begin + i) * values + head * dv + lane;
        if (v0) o[0] = acc0;
        if (v1) o[32] = acc1;
    }
}

// HSTU's gate: gated[r, c] = u[r, c] * normed[r, c], u being the first `values` columns of row r
// of uvqk (`width` wide). One block per row.
extern "C" __global__ void __launch_bounds__(ENC_THREADS) hstu_gate(
    const float* __restrict__ uvqk, const float* __restrict__ normed, float* __restrict__ gated,
    u32 values, u32 width) {
    const u32 r = blockIdx.x;
    for (u32 c = threadIdx.x; c < values; c += ENC_THREADS)
        gated[(size_t)r * values + c] = uvqk[(size_t)r * width + c] * normed[(size_t)r * values + c];
}

// y[r] += x[r] (a residual connection), one block per row of `width`.
extern "C" __global__ void __launch_bounds__(ENC_THREADS) add_rows(
    float* __restrict__ y, const float* __restrict__ x, u32 width) {
    const size_t base = (size_t)blockIdx.x * width;
    for (u32 c = threadIdx.x; c < width; c += ENC_THREADS) y[base + c] += x[base + c];
}

// x[r] /= max(||x[r]||, eps) (HSTU's user embedding, scored by the cosine), one block per row.
// The squares are summed in f64, so the norm is the row's to f32 rounding whatever the order.
extern "C" __global__ void __launch_bounds__(ENC_THREADS) l2_normalize_rows(
    float* __restrict__ x, u32 width, float eps) {
    __shared__ double partial[ENC_THREADS];
    const size_t base = (size_t)blockIdx.x * width;
    double squares = 0.0;
    for (u32 c = threadIdx.x; c < width; c += ENC_THREADS) squares += (double)x[base + c] * x[base + c];
    partial[threadIdx.x] = squares;
    __syncthreads();
    for (u32 s = ENC_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    const float divisor = fmaxf((float)sqrt(partial[0]), eps);
    for (u32 c = threadIdx.x; c < width; c += ENC_THREADS) x[base + c] /= divisor;
}
