// GM-RLE (crates/codec/src/rle.rs). One thread per 256-byte chunk (32
// words). Word g is "zero" when it equals word g-1 (word -1 is 0); tokens
// are the maximal runs of zero / non-zero words. A thread owns the tokens
// of the runs that start in its chunk and the differences of its non-zero
// words: they are contiguous in the record, in word order. Phase 1 writes
// each chunk's size; phase 2 turns the 16 sizes of a page into offsets (a
// prefix sum), raises the overflow (the page goes raw) when the total is
// not below 4096, and writes.

__device__ __forceinline__ int rle_z(const u64* w, u32 g) { return w[g] == (g ? w[g - 1] : 0ull); }

__device__ __forceinline__ int rle_starts(const u64* w, u32 g) { return g == 0 || rle_z(w, g) != rle_z(w, g - 1); }

// Length of the run starting at word g.
__device__ __forceinline__ u32 rle_run(const u64* w, u32 g) {
    int z = rle_z(w, g);
    u32 k = g + 1;
    while (k < WORDS && rle_z(w, k) == z) ++k;
    return k - g;
}

extern "C" __global__ void rle_size(const u8* pages, u32 n, const u8* done, u32* csize) {
    u32 c = global_id();
    if (c >= n * CHUNKS || done[c / CHUNKS]) return;
    const u64* w = (const u64*)(pages + (u64)(c / CHUNKS) * PAGE);
    u32 g0 = (c % CHUNKS) * 32, size = 0;
    for (u32 g = g0; g < g0 + 32; ++g) {
        int z = rle_z(w, g);
        if (rle_starts(w, g)) size += vlen(z ? (rle_run(w, g) << 1 | 1) : (rle_run(w, g) << 1));
        if (!z) size += 8;
    }
    csize[c] = size;
}

extern "C" __global__ void rle_write(const u8* pages, u32 n, const u8* done, const u32* csize, u8* rec, u8* tag,
                                     u32* len) {
    u32 c = global_id();
    if (c >= n * CHUNKS) return;
    u32 p = c / CHUNKS, i = c % CHUNKS;
    if (done[p]) return;
    u32 off = 0, total = 0;
    for (u32 k = 0; k < CHUNKS; ++k) {
        if (k < i) off += csize[p * CHUNKS + k];
        total += csize[p * CHUNKS + k];
    }
    if (total >= PAGE) return;  // overflow: stays raw
    const u64* w = (const u64*)(pages + (u64)p * PAGE);
    u8* out = rec + (u64)p * REC_STRIDE + off;
    for (u32 g = i * 32; g < i * 32 + 32; ++g) {
        int z = rle_z(w, g);
        if (rle_starts(w, g)) out += vput(out, z ? (rle_run(w, g) << 1 | 1) : (rle_run(w, g) << 1));
        if (!z) {
            st64(out, w[g] - (g ? w[g - 1] : 0ull));
            out += 8;
        }
    }
    if (i == 0) {
        tag[p] = TAG_RLE;
        len[p] = total;
    }
}

// Decoder: one thread per page with an RLE record (tokens are sequential).
extern "C" __global__ void rle_decode(u32 n, const u8* tag, const u8* data, const u64* off, const u32* len, u8* out,
                                      u32* err, u32* errv) {
    u32 p = global_id();
    if (p >= n || tag[p] != TAG_RLE) return;
    const u8* in = data + off[p];
    u32 l = len[p], pos = 0, i = 0;
    u64 prev = 0;
    u8* page = out + (u64)p * PAGE;
    while (i < WORDS) {
        u32 token;
        if (!vget(in, l, &pos, &token)) { err[p] = ERR_TRUNCATED; return; }
        u32 k = token >> 1;
        if (k == 0) { err[p] = ERR_MALFORMED; return; }
        if (i + k > WORDS) { err[p] = ERR_OVERRUN; errv[p] = (i + k) * 8; return; }
        if (token & 1) {
            for (u32 j = 0; j < k; ++j) st64(page + (i + j) * 8, prev);
        } else {
            if (l - pos < k * 8) { err[p] = ERR_TRUNCATED; return; }
            for (u32 j = 0; j < k; ++j) {
                prev += ld64(in + pos);
                pos += 8;
                st64(page + (i + j) * 8, prev);
            }
        }
        i += k;
    }
    if (pos != l) { err[p] = ERR_TRAILING; errv[p] = l - pos; }
}
