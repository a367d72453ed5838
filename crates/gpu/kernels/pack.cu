// Packing a batch's records into one buffer for the copy back, and the
// decoder's raw/zero pages.

// Exclusive prefix sum of the record lengths (off has n+1 entries). One
// thread: a batch is at most a few thousand pages, a few microseconds.
extern "C" __global__ void scan_lens(u32 n, const u32* len, u64* off) {
    if (global_id() != 0) return;
    u64 sum = 0;
    for (u32 p = 0; p < n; ++p) {
        off[p] = sum;
        sum += len[p];
    }
    off[n] = sum;
}

// One block per page copies its record (the page itself when raw).
extern "C" __global__ void pack(u32 n, const u8* tag, const u32* len, const u64* off, const u8* pages,
                                const u8* rec, u8* out) {
    u32 p = blockIdx.x;
    if (p >= n) return;
    const u8* src = tag[p] == TAG_RAW ? pages + (u64)p * PAGE : rec + (u64)p * REC_STRIDE;
    u8* dst = out + off[p];
    for (u32 b = threadIdx.x; b < len[p]; b += blockDim.x) dst[b] = src[b];
}

// Decoder: raw records are copied, zero records become zero pages (the
// host has checked their lengths). One block per page.
extern "C" __global__ void dec_copy(u32 n, const u8* tag, const u8* data, const u64* off, u8* out) {
    u32 p = blockIdx.x;
    if (p >= n || (tag[p] != TAG_RAW && tag[p] != TAG_ZERO)) return;
    u8* dst = out + (u64)p * PAGE;
    const u8* src = data + off[p];
    for (u32 b = threadIdx.x; b < PAGE; b += blockDim.x) dst[b] = tag[p] == TAG_RAW ? src[b] : 0;
}
