// GM-Dedup against a GPU-resident chunk cache (crates/codec/src/dedup.rs).
//
// One thread per 256-byte chunk hashes it (SuperFastHash, seed 256) and
// finds its set, `(hash * sets) >> 32`. The cache: `dhash`/`dvalid` per
// slot (`set*2+way`), `dlru` per set (the way to evict next), `ddata` the
// chunks. As for XBZRLE, the first chunk of the batch in a set owns the
// set and replays, in batch order (page, then chunk), every chunk of the
// batch in that set: a chunk equal (hash and all 256 bytes) to a way's
// chunk becomes a reference and marks the way used; otherwise it goes to
// the LRU way. A way's chunk may be one inserted earlier in this batch:
// the owner tracks, per way, whether it holds the chunk from before the
// batch or which chunk of the batch, and compares against that. Then the
// record is written (one thread per chunk) and each slot takes its last
// writer's chunk.

__device__ __forceinline__ u32 sfh_get16(const u8* d) { return (u32)d[0] | (u32)d[1] << 8; }

__device__ u32 superfasthash256(const u8* d) {
    u32 h = CHUNK;
    for (u32 i = 0; i < CHUNK; i += 4) {
        h += sfh_get16(d + i);
        u32 tmp = (sfh_get16(d + i + 2) << 11) ^ h;
        h = (h << 16) ^ tmp;
        h += h >> 11;
    }
    h ^= h << 3;
    h += h >> 5;
    h ^= h << 4;
    h += h >> 17;
    h ^= h << 25;
    h += h >> 6;
    return h;
}

__device__ __forceinline__ u32 dd_set_of(u32 hash, u32 sets) { return (u32)(((u64)hash * sets) >> 32); }

__device__ __forceinline__ int dd_equal(const u8* a, const u8* b) {
    const u32* x = (const u32*)a;
    const u32* y = (const u32*)b;
    for (u32 k = 0; k < CHUNK / 4; ++k)
        if (x[k] != y[k]) return 0;
    return 1;
}

extern "C" __global__ void dd_hash(const u8* pages, u32 n, const u8* done, u32 sets, u32* dset, u32* dhv,
                                   u32* claim) {
    u32 c = global_id();
    if (c >= n * CHUNKS) return;
    if (done[c / CHUNKS]) {
        dset[c] = NONE;
        return;
    }
    u32 h = superfasthash256(pages + (u64)c * CHUNK);
    u32 s = dd_set_of(h, sets);
    dhv[c] = h;
    dset[c] = s;
    atomicMin(&claim[s], c);
}

// The encoder's replay. dref[c]: the slot a chunk refers to, or NONE for a
// literal; fin[c]: the slot a literal is the last writer of, or NONE.
extern "C" __global__ void dd_plan(const u8* pages, u32 n, const u32* dset, const u32* dhv, u32* claim, u32* dhash,
                                   u8* dvalid, u8* dlru, const u8* ddata, u32* dref, u32* fin) {
    u32 c = global_id();
    if (c >= n * CHUNKS) return;
    u32 s = dset[c];
    if (s == NONE || claim[s] != c) return;
    u32 hh[2] = {dhash[s * 2], dhash[s * 2 + 1]};
    u32 v[2] = {dvalid[s * 2], dvalid[s * 2 + 1]};
    u32 src[2] = {NONE, NONE};
    u32 lru = dlru[s];
    for (u32 j = c; j < n * CHUNKS; ++j) {
        if (dset[j] != s) continue;
        fin[j] = NONE;
        const u8* chunk = pages + (u64)j * CHUNK;
        u32 h = dhv[j], w = 2;
        for (u32 k = 0; k < 2 && w == 2; ++k) {
            const u8* held = src[k] == NONE ? ddata + (u64)(s * 2 + k) * CHUNK : pages + (u64)src[k] * CHUNK;
            if (v[k] && hh[k] == h && dd_equal(chunk, held)) w = k;
        }
        if (w < 2) {
            dref[j] = s * 2 + w;
        } else {
            w = lru;
            v[w] = 1;
            hh[w] = h;
            src[w] = j;
            dref[j] = NONE;
        }
        lru = 1 - w;
    }
    for (u32 w = 0; w < 2; ++w)
        if (src[w] != NONE) fin[src[w]] = s * 2 + w;
    dhash[s * 2] = hh[0];
    dhash[s * 2 + 1] = hh[1];
    dvalid[s * 2] = (u8)v[0];
    dvalid[s * 2 + 1] = (u8)v[1];
    dlru[s] = (u8)lru;
    claim[s] = NONE;
}

// Offset of chunk i's item in its page's record.
__device__ __forceinline__ u32 dd_item_offset(const u32* dref, u32 p, u32 i) {
    u32 off = 2;
    for (u32 k = 0; k < i; ++k) off += dref[p * CHUNKS + k] != NONE ? 4 : CHUNK;
    return off;
}

// One thread per chunk writes its item: a u32 slot or the 256 bytes.
extern "C" __global__ void dd_encode(const u8* pages, u32 n, const u8* done, const u32* dref, u8* rec) {
    u32 c = global_id();
    if (c >= n * CHUNKS) return;
    u32 p = c / CHUNKS, i = c % CHUNKS;
    if (done[p]) return;
    u8* out = rec + (u64)p * REC_STRIDE + dd_item_offset(dref, p, i);
    if (dref[c] != NONE) {
        for (u32 k = 0; k < 4; ++k) out[k] = (u8)(dref[c] >> (8 * k));
    } else {
        const u8* chunk = pages + (u64)c * CHUNK;
        for (u32 k = 0; k < CHUNK; ++k) out[k] = chunk[k];
    }
}

// One thread per page: the header, the tag and the length.
extern "C" __global__ void dd_finish(u32 n, const u32* dref, u8* rec, u8* tag, u32* len, u8* done) {
    u32 p = global_id();
    if (p >= n || done[p]) return;
    u32 refs = 0;
    for (u32 i = 0; i < CHUNKS; ++i)
        if (dref[p * CHUNKS + i] != NONE) refs |= 1u << i;
    u8* out = rec + (u64)p * REC_STRIDE;
    out[0] = (u8)refs;
    out[1] = (u8)(refs >> 8);
    tag[p] = TAG_DEDUP;
    len[p] = dd_item_offset(dref, p, CHUNKS);
    done[p] = 1;
}

// Cache update: each slot takes its last writer's chunk.
extern "C" __global__ void dd_update(const u8* src, u32 n, const u32* fin, u8* ddata) {
    u32 c = global_id();
    if (c >= n * CHUNKS || fin[c] == NONE) return;
    u32* dst = (u32*)(ddata + (u64)fin[c] * CHUNK);
    const u32* from = (const u32*)(src + (u64)c * CHUNK);
    for (u32 k = 0; k < CHUNK / 4; ++k) dst[k] = from[k];
}

// Decoder, phase 1 (one thread per chunk of a dedup record; the host has
// checked the record's length against its bitmap): literals go to their
// place in `out` and are hashed; references name their slot.
extern "C" __global__ void dd_dec_prep(u32 n, const u8* tag, const u8* data, const u64* off, u8* out, u32 sets,
                                       u32* dset, u32* dhv, u32* dref, u32* claim, u32* err) {
    u32 c = global_id();
    if (c >= n * CHUNKS) return;
    u32 p = c / CHUNKS, i = c % CHUNKS;
    dset[c] = NONE;
    dref[c] = NONE;
    if (tag[p] != TAG_DEDUP) return;
    const u8* in = data + off[p];
    u32 refs = (u32)in[0] | (u32)in[1] << 8;
    u32 at = 2;
    for (u32 k = 0; k < i; ++k) at += (refs >> k) & 1 ? 4 : CHUNK;
    if ((refs >> i) & 1) {
        u32 slot = (u32)in[at] | (u32)in[at + 1] << 8 | (u32)in[at + 2] << 16 | (u32)in[at + 3] << 24;
        if (slot >= 2 * sets) {
            err[p] = ERR_CACHE_MISS;
            return;
        }
        dref[c] = slot;
        dset[c] = slot / 2;
    } else {
        u8* dst = out + (u64)c * CHUNK;
        for (u32 k = 0; k < CHUNK; ++k) dst[k] = in[at + k];
        u32 h = superfasthash256(dst);
        dhv[c] = h;
        dset[c] = dd_set_of(h, sets);
    }
    atomicMin(&claim[dset[c]], c);
}

// Decoder, phase 2: the owner of each set replays its chunks in order. A
// reference takes its way's chunk: from before the batch (dsrc = NONE) or
// a literal of this batch (dsrc = that chunk).
extern "C" __global__ void dd_plan_dec(u32 n, const u32* dset, const u32* dhv, const u32* dref, u32* claim,
                                       u32* dhash, u8* dvalid, u8* dlru, u32* dsrc, u32* fin, u32* err) {
    u32 c = global_id();
    if (c >= n * CHUNKS) return;
    u32 s = dset[c];
    if (s == NONE || claim[s] != c) return;
    u32 hh[2] = {dhash[s * 2], dhash[s * 2 + 1]};
    u32 v[2] = {dvalid[s * 2], dvalid[s * 2 + 1]};
    u32 src[2] = {NONE, NONE};
    u32 lru = dlru[s];
    for (u32 j = c; j < n * CHUNKS; ++j) {
        if (dset[j] != s) continue;
        fin[j] = NONE;
        u32 w;
        if (dref[j] != NONE) {
            w = dref[j] % 2;
            if (!v[w]) {
                err[j / CHUNKS] = ERR_CACHE_MISS;
                continue;
            }
            dsrc[j] = src[w];
        } else {
            w = lru;
            v[w] = 1;
            hh[w] = dhv[j];
            src[w] = j;
        }
        lru = 1 - w;
    }
    for (u32 w = 0; w < 2; ++w)
        if (src[w] != NONE) fin[src[w]] = s * 2 + w;
    dhash[s * 2] = hh[0];
    dhash[s * 2 + 1] = hh[1];
    dvalid[s * 2] = (u8)v[0];
    dvalid[s * 2 + 1] = (u8)v[1];
    dlru[s] = (u8)lru;
    claim[s] = NONE;
}

// Decoder, phase 3: references copy their chunk (before the cache update).
extern "C" __global__ void dd_dec_refs(u32 n, const u32* dref, const u32* dsrc, const u8* ddata, u8* out) {
    u32 c = global_id();
    if (c >= n * CHUNKS || dref[c] == NONE) return;
    const u8* from = dsrc[c] == NONE ? ddata + (u64)dref[c] * CHUNK : out + (u64)dsrc[c] * CHUNK;
    u8* dst = out + (u64)c * CHUNK;
    for (u32 k = 0; k < CHUNK; ++k) dst[k] = from[k];
}
