// Runs recsys' CUDA kernels on the CPU, so their logic is tested where no GPU exists (CI and every
// developer machine). The kernel source is compiled unchanged by a host C++ compiler with this
// header in front: each CUDA thread of a block becomes a fiber on one OS thread, blocks
// run one after another, `__syncthreads()` and the warp primitives are scheduling points.
//
// All emulation state is per OS thread: launches from several threads run independently.
//
// What it checks: indexing, the selection and merge logic, bounds handling, that every thread of a
// block reaches each `__syncthreads()` (a barrier some threads skip is reported as divergence) and
// that every lane of a warp joins each full-mask warp primitive. What it cannot check: timing,
// memory-model races between unsynchronised threads (fibers only switch at barriers, so such a race
// never shows), and anything about the real hardware. The GPU test suite covers those on a GPU.
#pragma once

#include <ucontext.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

struct uint3 {
    unsigned x, y, z;
};

// CUDA's 16-byte vector types, for 16-byte loads.
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {

enum class Wait { Running, Block, Warp, Done };

// Switching fibers: on x86-64 a six-register switch (swapcontext also saves the signal mask, a
// system call per switch, which made the emulation several times slower); elsewhere ucontext.
#if defined(__x86_64__)
#define RECSYS_EMU_FAST_SWITCH 1
extern "C" void recsys_emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl recsys_emu_switch
    .type recsys_emu_switch, @function
recsys_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size recsys_emu_switch, .-recsys_emu_switch
)");
#endif

struct Fiber {
#ifdef RECSYS_EMU_FAST_SWITCH
    void* sp = nullptr;
#else
    ucontext_t context;
#endif
    std::unique_ptr<char[]> stack;
    uint3 thread;
    unsigned linear = 0;
    Wait wait = Wait::Running;
    // __syncthreads() calls so far: every thread of a block must be at the same one.
    unsigned long block_barriers = 0;
};

// Fiber stacks: kernels keep small arrays in registers/local memory, never deep recursion.
constexpr size_t kStackBytes = 64 * 1024;

struct BlockRun {
    std::vector<Fiber> fibers;
#ifdef RECSYS_EMU_FAST_SWITCH
    void* scheduler_sp = nullptr;
#else
    ucontext_t scheduler;
#endif
    Fiber* current = nullptr;
    std::vector<uint64_t> warp_slots;
    // Each lane's operands of a warp-wide matrix multiply (A: 4 words, B: 2, C: 4).
    std::vector<std::array<uint32_t, 10>> mma_slots;
    std::function<void()> body;
};

inline thread_local BlockRun* active = nullptr;
inline thread_local uint3 block_index;
inline thread_local dim3 block_dim;
inline thread_local dim3 grid_dim;
inline thread_local std::vector<unsigned char> dynamic_shared;
inline thread_local std::string failure;

// From the running fiber back to the block's scheduler.
inline void to_scheduler(Fiber* self) {
#ifdef RECSYS_EMU_FAST_SWITCH
    recsys_emu_switch(&self->sp, active->scheduler_sp);
#else
    swapcontext(&self->context, &active->scheduler);
#endif
}

// From the scheduler into fiber `f`, until it parks or finishes.
inline void resume(BlockRun& run, Fiber& f) {
    run.current = &f;
#ifdef RECSYS_EMU_FAST_SWITCH
    recsys_emu_switch(&run.scheduler_sp, f.sp);
#else
    swapcontext(&run.scheduler, &f.context);
#endif
}

inline void fiber_entry() {
    active->body();
    active->current->wait = Wait::Done;
    to_scheduler(active->current);  // never resumed
}

inline void park(Wait why) {
    Fiber* self = active->current;
    self->wait = why;
    to_scheduler(self);
}

// Prepares `f` to start in fiber_entry on its own stack.
inline void start_fiber(Fiber& f) {
#ifdef RECSYS_EMU_FAST_SWITCH
    // The first switch pops six zero registers, then `ret`s into fiber_entry with the stack
    // aligned as after a call (the return-address slot is 16-byte aligned).
    uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack.get()) + kStackBytes) & ~uintptr_t(15);
    void** slot = reinterpret_cast<void**>(top - 16);
    slot[1] = nullptr;  // fiber_entry's own return address: it never returns
    slot[0] = reinterpret_cast<void*>(&fiber_entry);
    for (int r = 1; r <= 6; ++r) slot[-r] = nullptr;
    f.sp = slot - 6;
#else
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_entry, 0);
#endif
}

// Releases the threads parked at a barrier that all live threads of its scope have reached.
// Warps first (a warp primitive completes within its warp); the block barrier only once every
// thread waits at it, at the same __syncthreads() call. Returns nullptr when threads moved, or why
// nothing can move: the barrier is divergent, which CUDA leaves undefined.
inline const char* release(BlockRun& run) {
    bool any = false;
    const size_t n = run.fibers.size();
    for (size_t warp_start = 0; warp_start < n; warp_start += 32) {
        size_t end = warp_start + 32 < n ? warp_start + 32 : n;
        bool all_warp = true, some_warp = false;
        for (size_t i = warp_start; i < end; ++i) {
            Wait w = run.fibers[i].wait;
            if (w == Wait::Warp) some_warp = true;
            else if (w != Wait::Done) all_warp = false;
        }
        if (some_warp && all_warp) {
            for (size_t i = warp_start; i < end; ++i)
                if (run.fibers[i].wait == Wait::Warp) run.fibers[i].wait = Wait::Running;
            any = true;
        }
    }
    if (any) return nullptr;
    bool all_block = true, some_block = false, some_done = false, same_call = true;
    for (auto& f : run.fibers) {
        if (f.wait == Wait::Block) {
            some_block = true;
            same_call = same_call && f.block_barriers == run.fibers[0].block_barriers;
        } else if (f.wait == Wait::Done) {
            some_done = true;
        } else {
            all_block = false;
        }
    }
    if (!some_block || !all_block)
        return "divergent barrier (some threads wait at __syncthreads, others at a warp primitive)";
    if (some_done) return "divergent barrier (threads exited while others wait at __syncthreads)";
    if (!same_call) return "divergent barrier (threads wait at different __syncthreads calls)";
    for (auto& f : run.fibers) f.wait = Wait::Running;
    return nullptr;
}

// Runs one block to completion; false (with `failure` set) on a divergent barrier.
inline bool run_block(const std::function<void()>& body, const char* kernel) {
    BlockRun run;
    const unsigned threads = block_dim.x * block_dim.y * block_dim.z;
    run.fibers.resize(threads);
    run.warp_slots.assign((threads + 31) / 32 * 32, 0);
    run.mma_slots.assign((threads + 31) / 32 * 32, {});
    run.body = body;
    active = &run;
    for (unsigned t = 0; t < threads; ++t) {
        Fiber& f = run.fibers[t];
        f.linear = t;
        f.thread = {t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x * block_dim.y)};
        f.stack.reset(new char[kStackBytes]);
        start_fiber(f);
    }
    for (;;) {
        for (auto& f : run.fibers) {
            if (f.wait == Wait::Running) resume(run, f);
        }
        bool done = true;
        for (auto& f : run.fibers) done = done && f.wait == Wait::Done;
        if (done) break;
        if (const char* why = release(run)) {
            char msg[320];
            snprintf(msg, sizeof msg, "%s, block (%u, %u, %u): %s", kernel, block_index.x,
                     block_index.y, block_index.z, why);
            failure = msg;
            active = nullptr;
            return false;  // the parked fibers are abandoned with their stacks
        }
    }
    active = nullptr;
    return true;
}

// Launches `kernel` over the grid; 0 on success, 1 with `failure` set otherwise.
template <class Kernel>
int launch(const char* name, dim3 grid, dim3 block, size_t shared_bytes, Kernel kernel) {
    failure.clear();
    if (block.x * block.y * block.z == 0 || block.x * block.y * block.z > 1024) {
        failure = std::string(name) + ": invalid block size";
        return 1;
    }
    grid_dim = grid;
    block_dim = block;
    dynamic_shared.assign(shared_bytes, 0xA5);  // poisoned, as real shared memory is undefined
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                block_index = {x, y, z};
                if (!run_block(kernel, name)) return 1;
            }
    return 0;
}

inline unsigned lane() { return active->current->linear & 31; }

inline void check_full_mask(unsigned mask, const char* what) {
    if (mask != 0xFFFFFFFFu) {
        fprintf(stderr, "%s with a partial mask is not emulated\n", what);
        abort();
    }
}

template <class T>
T shuffle_from(unsigned mask, T value, unsigned source_lane, bool in_range) {
    check_full_mask(mask, "a warp shuffle");
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    unsigned self = active->current->linear;
    unsigned base = self & ~31u;
    uint64_t bits = 0;
    memcpy(&bits, &value, sizeof(T));
    active->warp_slots[self] = bits;
    park(Wait::Warp);
    T out = value;
    if (in_range) memcpy(&out, &active->warp_slots[base + source_lane], sizeof(T));
    park(Wait::Warp);  // nobody overwrites a slot before every lane has read
    return out;
}

inline float half_bits_to_float(unsigned short h) {
    unsigned sign = (h >> 15) & 1, exponent = (h >> 10) & 31, mantissa = h & 1023;
    float magnitude;
    if (exponent == 0) magnitude = std::ldexp((float)mantissa, -24);
    else if (exponent == 31) magnitude = mantissa ? NAN : INFINITY;
    else magnitude = std::ldexp((float)(mantissa | 1024), (int)exponent - 25);
    return sign ? -magnitude : magnitude;
}

// f32 to f16 bits, rounding to nearest even (PTX cvt.rn.f16.f32): overflow to infinity from 65520
// on, subnormal halves below 2^-14.
inline unsigned short float_to_half_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, magnitude = x & 0x7FFFFFFFu;
    if (magnitude >= 0x7F800000u) return sign | (magnitude > 0x7F800000u ? 0x7E00u : 0x7C00u);
    if (magnitude >= 0x477FF000u) return sign | 0x7C00u;
    if (magnitude >= 0x38800000u) {
        // Rebias the exponent (127 to 15) and keep 10 mantissa bits; a carry may reach the exponent.
        uint32_t half = (magnitude - 0x38000000u) >> 13;
        const uint32_t rest = magnitude & 0x1FFFu;
        if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half += 1;
        return (unsigned short)(sign | half);
    }
    float value;
    memcpy(&value, &magnitude, 4);
    // Units of 2^-24, the smallest subnormal; 1024 of them is the smallest normal's encoding.
    return (unsigned short)(sign | (uint32_t)std::nearbyint(value * 16777216.0f));
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 for the calling lane: every lane of the warp
// posts its fragments, then each computes its own four results from everyone's: D = A B + C with A
// 16 x 16 and B 16 x 8 laid out over the lanes as the PTX ISA specifies (g = lane / 4, t = lane % 4;
// A word w of a lane holds row g + 8 (w & 1), columns 2t + 8 (w >> 1) and + 1; B word w holds
// rows 2t + 8 w and + 1 of column g; D element i is row g + 8 (i >> 1), column 2t + (i & 1)).
// Products of f16 values are exact in f32; the sums run in k order with fmaf, where the tensor
// cores use their own order, so results agree with a GPU to rounding, not to the bit.
inline void mma_m16n8k16_f32_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    const unsigned self = active->current->linear, base = self & ~31u;
    if (base + 32 > active->fibers.size()) {
        fprintf(stderr, "mma.sync needs a whole warp\n");
        abort();
    }
    auto& mine = active->mma_slots[self];
    for (int w = 0; w < 4; ++w) mine[w] = a[w];
    mine[4] = b0;
    mine[5] = b1;
    for (int i = 0; i < 4; ++i) memcpy(&mine[6 + i], &d[i], 4);
    park(Wait::Warp);
    auto half_at = [&](unsigned lane, int word, unsigned high) {
        const uint32_t bits = active->mma_slots[base + lane][word];
        return half_bits_to_float((unsigned short)(high ? bits >> 16 : bits & 0xFFFFu));
    };
    // A(row, k) and B(k, column) from the lane and word that hold them.
    auto a_at = [&](unsigned row, unsigned k) {
        const unsigned lane = (row % 8) * 4 + (k % 8) / 2;
        return half_at(lane, (int)((row / 8) + 2 * (k / 8)), k & 1);
    };
    auto b_at = [&](unsigned k, unsigned column) {
        const unsigned lane = column * 4 + (k % 8) / 2;
        return half_at(lane, 4 + (int)(k / 8), k & 1);
    };
    const unsigned lane = self & 31, g = lane / 4, t = lane % 4;
    float out[4];
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned row = g + 8 * (i >> 1), column = 2 * t + (i & 1);
        float sum;
        memcpy(&sum, &active->mma_slots[self][6 + i], 4);
        for (unsigned k = 0; k < 16; ++k) sum = std::fma(a_at(row, k), b_at(k, column), sum);
        out[i] = sum;
    }
    park(Wait::Warp);  // nobody posts again before every lane has read
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

}  // namespace emu

#define RECSYS_CUDA_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Per OS thread, so launches from concurrent test threads never share a block's memory.
#define __shared__ static thread_local
#define threadIdx (emu::active->current->thread)
#define blockIdx (emu::block_index)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define RECSYS_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(emu::dynamic_shared.data())

inline void __syncthreads() {
    emu::active->current->block_barriers += 1;
    emu::park(emu::Wait::Block);
}
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) {
    emu::check_full_mask(mask, "__syncwarp");
    emu::park(emu::Wait::Warp);
}

template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    unsigned lane = emu::lane();
    unsigned segment = lane & ~(unsigned)(width - 1);
    return emu::shuffle_from(mask, v, segment + ((unsigned)src & (unsigned)(width - 1)), true);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    unsigned lane = emu::lane();
    unsigned in_segment = (lane & (unsigned)(width - 1)) + delta;
    return emu::shuffle_from(mask, v, lane + delta, in_segment < (unsigned)width);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    unsigned lane = emu::lane();
    bool in_range = (lane & (unsigned)(width - 1)) >= delta;
    return emu::shuffle_from(mask, v, in_range ? lane - delta : lane, in_range);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    unsigned lane = emu::lane();
    unsigned src = lane ^ (unsigned)lane_mask;
    bool in_range = (src & ~(unsigned)(width - 1)) == (lane & ~(unsigned)(width - 1));
    return emu::shuffle_from(mask, v, src, in_range);
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    emu::check_full_mask(mask, "__ballot_sync");
    unsigned self = emu::active->current->linear, base = self & ~31u;
    emu::active->warp_slots[self] = predicate ? 1 : 0;
    emu::park(emu::Wait::Warp);
    unsigned bits = 0;
    for (unsigned l = 0; l < 32 && base + l < emu::active->fibers.size(); ++l)
        if (emu::active->fibers[base + l].wait != emu::Wait::Done && emu::active->warp_slots[base + l])
            bits |= 1u << l;
    emu::park(emu::Wait::Warp);
    return bits;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }

// Fibers switch only at barriers, so a read-modify-write is already indivisible.
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    unsigned old = *p;
    *p = old + v;
    return old;
}
inline int atomicAdd(int* p, int v) {
    int old = *p;
    *p = old + v;
    return old;
}

inline float __int_as_float(int v) {
    float f;
    memcpy(&f, &v, 4);
    return f;
}
inline int __float_as_int(float f) {
    int v;
    memcpy(&v, &f, 4);
    return v;
}
inline unsigned __float_as_uint(float f) {
    unsigned v;
    memcpy(&v, &f, 4);
    return v;
}
inline float __uint_as_float(unsigned v) {
    float f;
    memcpy(&f, &v, 4);
    return f;
}
template <class T>
T __ldg(const T* p) {
    return *p;
}
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
