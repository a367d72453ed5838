// Packing a batch's records into one buffer for the copy back, and the
// decoder's raw/zero pages.

// Exclusive prefix sum of the record lengths (off has n + 1 entries), in
// three launches without shared memory: each thread of scan_parts sums a
// run of SCAN_RUN lengths, one thread scans those sums (a 4096-page batch
// has 128), and each thread of scan_write writes its run's offsets. One
// thread walking every length took a dependent global load per page.
#define SCAN_RUN 32u

extern "C" __global__ void scan_parts(u32 n, const u32* len, u64* part) {
    u32 t = global_id();
    if (t * SCAN_RUN >= n) return;
    u32 end = (t + 1) * SCAN_RUN < n ? (t + 1) * SCAN_RUN : n;
    u64 sum = 0;
    for (u32 p = t * SCAN_RUN; p < end; ++p) sum += len[p];
    part[t] = sum;
}

extern "C" __global__ void scan_sums(u32 n, u64* part) {
    if (global_id() != 0) return;
    u32 parts = (n + SCAN_RUN - 1) / SCAN_RUN;
    u64 sum = 0;
    for (u32 t = 0; t < parts; ++t) {
        u64 here = part[t];
        part[t] = sum;
        sum += here;
    }
}

extern "C" __global__ void scan_write(u32 n, const u32* len, const u64* part, u64* off) {
    u32 t = global_id();
    if (t * SCAN_RUN >= n) return;
    u32 end = (t + 1) * SCAN_RUN < n ? (t + 1) * SCAN_RUN : n;
    u64 sum = part[t];
    for (u32 p = t * SCAN_RUN; p < end; ++p) {
        off[p] = sum;
        sum += len[p];
    }
    if (end == n) off[n] = sum;
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
