// A host emulator for the kernels: compiled by the C++ compiler with the
// CUDA built-ins defined below, it runs a launch as a loop over blocks and
// threads, one thread at a time. The kernels have no __syncthreads and no
// shared memory (each is one phase), so this gives the results a GPU gives
// whenever the kernels are free of races, which the design keeps them; it
// does not prove that they are. Used by the crate's tests to check the
// kernels' output against the CPU codecs on machines without a GPU.

#include <cstring>

struct EmuDim {
    unsigned x, y, z;
};
// thread_local: several emulated GPUs (one per encoder thread) run at once.
static thread_local EmuDim threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline

static inline unsigned atomicMin(unsigned* a, unsigned v) {
    unsigned old = *a;
    if (v < old) *a = v;
    return old;
}
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }

#include "common.cuh"
#include "zero.cu"
#include "rle.cu"
#include "xbzrle.cu"
#include "dedup.cu"
#include "pack.cu"

typedef void (*Trampoline)(void**);
#define A(i, T) (*(T*)params[i])

struct Entry {
    const char* name;
    Trampoline run;
};

static const Entry KERNELS[] = {
    {"fill_u32", [](void** params) { fill_u32(A(0, u32*), A(1, u32), A(2, u32)); }},
    {"zero_detect", [](void** params) { zero_detect(A(0, const u8*), A(1, u32), A(2, u32*)); }},
    {"batch_init",
     [](void** params) { batch_init(A(0, u32), A(1, const u32*), A(2, u8*), A(3, u32*), A(4, u8*)); }},
    {"rle_size", [](void** params) { rle_size(A(0, const u8*), A(1, u32), A(2, const u8*), A(3, u32*)); }},
    {"rle_write",
     [](void** params) {
         rle_write(A(0, const u8*), A(1, u32), A(2, const u8*), A(3, const u32*), A(4, u8*), A(5, u8*), A(6, u32*));
     }},
    {"rle_decode",
     [](void** params) {
         rle_decode(A(0, u32), A(1, const u8*), A(2, const u8*), A(3, const u64*), A(4, const u32*), A(5, u8*),
                    A(6, u32*), A(7, u32*));
     }},
    {"xb_ev_encode", [](void** params) { xb_ev_encode(A(0, u32), A(1, const u32*), A(2, u8*)); }},
    {"xb_ev_decode", [](void** params) { xb_ev_decode(A(0, u32), A(1, const u8*), A(2, u8*)); }},
    {"xb_claim",
     [](void** params) { xb_claim(A(0, const u64*), A(1, u32), A(2, u32), A(3, u32*), A(4, u32*)); }},
    {"xb_plan",
     [](void** params) {
         xb_plan(A(0, const u64*), A(1, u32), A(2, const u8*), A(3, const u32*), A(4, u32*), A(5, u64*), A(6, u8*),
                 A(7, u32*), A(8, u32*), A(9, u32*));
     }},
    {"xb_masks",
     [](void** params) {
         xb_masks(A(0, const u8*), A(1, u32), A(2, const u32*), A(3, const u32*), A(4, const u8*), A(5, u64*));
     }},
    {"xb_encode",
     [](void** params) {
         xb_encode(A(0, const u8*), A(1, u32), A(2, const u32*), A(3, const u64*), A(4, u8*), A(5, u8*), A(6, u32*),
                   A(7, u8*));
     }},
    {"xb_update", [](void** params) { xb_update(A(0, const u8*), A(1, u32), A(2, const u32*), A(3, u8*)); }},
    {"xb_apply",
     [](void** params) {
         xb_apply(A(0, u32), A(1, const u8*), A(2, const u8*), A(3, const u64*), A(4, const u32*), A(5, const u32*),
                  A(6, const u32*), A(7, const u8*), A(8, u8*), A(9, u32*), A(10, u32*));
     }},
    {"dd_hash",
     [](void** params) {
         dd_hash(A(0, const u8*), A(1, u32), A(2, const u8*), A(3, u32), A(4, u32*), A(5, u32*), A(6, u32*));
     }},
    {"dd_plan",
     [](void** params) {
         dd_plan(A(0, const u8*), A(1, u32), A(2, const u32*), A(3, const u32*), A(4, u32*), A(5, u32*), A(6, u8*),
                 A(7, u8*), A(8, const u8*), A(9, u32*), A(10, u32*));
     }},
    {"dd_encode",
     [](void** params) { dd_encode(A(0, const u8*), A(1, u32), A(2, const u8*), A(3, const u32*), A(4, u8*)); }},
    {"dd_finish",
     [](void** params) { dd_finish(A(0, u32), A(1, const u32*), A(2, u8*), A(3, u8*), A(4, u32*), A(5, u8*)); }},
    {"dd_update", [](void** params) { dd_update(A(0, const u8*), A(1, u32), A(2, const u32*), A(3, u8*)); }},
    {"dd_dec_prep",
     [](void** params) {
         dd_dec_prep(A(0, u32), A(1, const u8*), A(2, const u8*), A(3, const u64*), A(4, u8*), A(5, u32), A(6, u32*),
                     A(7, u32*), A(8, u32*), A(9, u32*), A(10, u32*));
     }},
    {"dd_plan_dec",
     [](void** params) {
         dd_plan_dec(A(0, u32), A(1, const u32*), A(2, const u32*), A(3, const u32*), A(4, u32*), A(5, u32*),
                     A(6, u8*), A(7, u8*), A(8, u32*), A(9, u32*), A(10, u32*));
     }},
    {"dd_dec_refs",
     [](void** params) {
         dd_dec_refs(A(0, u32), A(1, const u32*), A(2, const u32*), A(3, const u8*), A(4, u8*));
     }},
    {"scan_parts", [](void** params) { scan_parts(A(0, u32), A(1, const u32*), A(2, u64*)); }},
    {"scan_sums", [](void** params) { scan_sums(A(0, u32), A(1, u64*)); }},
    {"scan_write",
     [](void** params) { scan_write(A(0, u32), A(1, const u32*), A(2, const u64*), A(3, u64*)); }},
    {"pack",
     [](void** params) {
         pack(A(0, u32), A(1, const u8*), A(2, const u32*), A(3, const u64*), A(4, const u8*), A(5, const u8*),
              A(6, u8*));
     }},
    {"dec_copy",
     [](void** params) { dec_copy(A(0, u32), A(1, const u8*), A(2, const u8*), A(3, const u64*), A(4, u8*)); }},
};

// Runs kernel `name` over grid x block threads; -1 when there is no such
// kernel.
extern "C" int tsubame_emu_launch(const char* name, unsigned grid, unsigned block, void** params) {
    for (const Entry& e : KERNELS) {
        if (std::strcmp(e.name, name) != 0) continue;
        gridDim = {grid, 1, 1};
        blockDim = {block, 1, 1};
        for (unsigned b = 0; b < grid; ++b)
            for (unsigned t = 0; t < block; ++t) {
                blockIdx = {b, 0, 0};
                threadIdx = {t, 0, 0};
                e.run(params);
            }
        return 0;
    }
    return -1;
}

// The kernel names the emulator knows, for a test that every kernel in the
// sources has a trampoline.
extern "C" unsigned tsubame_emu_kernel_count() { return sizeof(KERNELS) / sizeof(KERNELS[0]); }
extern "C" const char* tsubame_emu_kernel_name(unsigned i) { return KERNELS[i].name; }
