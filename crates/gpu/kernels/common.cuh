// Shared definitions for tsubame's GPU codec kernels.
//
// Every kernel is one phase: no __syncthreads, no shared memory. Work that
// must follow other work is a later kernel on the same stream. That keeps
// each kernel free of races (its threads write disjoint bytes, or the same
// value), and lets the host-side emulator (emu.cpp) run them one thread at
// a time to check the logic against the CPU codecs without a GPU.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define PAGE 4096u
#define CHUNK 256u
#define CHUNKS 16u
#define WORDS 512u
#define LINES 64u
// Bytes reserved per page for its record before packing (dedup: 4098).
#define REC_STRIDE 4352u
#define NONE 0xFFFFFFFFu
#define EMPTY_TAG 0xFFFFFFFFFFFFFFFFull

#define TAG_RAW 0
#define TAG_ZERO 1
#define TAG_RLE 3
#define TAG_XBZRLE 4
#define TAG_DEDUP 5

// Decode errors, per page (the host turns them into CodecError).
#define ERR_NONE 0
#define ERR_TRUNCATED 1
#define ERR_MALFORMED 2
#define ERR_OVERRUN 3
#define ERR_TRAILING 4
#define ERR_CACHE_MISS 5

__device__ __forceinline__ u32 global_id() { return blockIdx.x * blockDim.x + threadIdx.x; }

// LEB128 length and writer, as crates/codec/src/varint.rs.
__device__ __forceinline__ u32 vlen(u32 v) { return v < 0x80u ? 1u : (v < 0x4000u ? 2u : 3u); }

__device__ __forceinline__ u32 vput(u8* out, u32 v) {
    u32 n = 0;
    while (v >= 0x80u) {
        out[n++] = (u8)(v | 0x80u);
        v >>= 7;
    }
    out[n++] = (u8)v;
    return n;
}

// Reads a varint of at most 3 bytes from in[*pos..len); 0 when cut short.
__device__ __forceinline__ int vget(const u8* in, u32 len, u32* pos, u32* value) {
    u32 v = 0;
    for (u32 shift = 0; shift <= 14; shift += 7) {
        if (*pos >= len) return 0;
        u8 b = in[(*pos)++];
        v |= (u32)(b & 0x7F) << shift;
        if ((b & 0x80) == 0) {
            *value = v;
            return 1;
        }
    }
    return 0;
}

__device__ __forceinline__ u64 ld64(const u8* p) {
    u64 v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

__device__ __forceinline__ void st64(u8* p, u64 v) {
    for (int i = 0; i < 8; ++i) p[i] = (u8)(v >> (8 * i));
}

// Fills a flag/length array.
extern "C" __global__ void fill_u32(u32* dst, u32 n, u32 value) {
    u32 i = global_id();
    if (i < n) dst[i] = value;
}
