// XBZRLE against a GPU-resident page cache (crates/codec/src/xbzrle.rs).
//
// The cache is 2-way set-associative: `xtags[set*2+way]` holds a page
// index (EMPTY when free), `xlru[set]` the way to evict next, `xdata` the
// pages. A batch runs in phases:
//   1. events: what each page does to the cache (ZERO: a cached copy
//      becomes zeros; LOOKUP: hit, or insert on a miss; MUSTHIT: a decoder's
//      XBZRLE record, a miss is an error);
//   2. claim + plan (hit check): pages are grouped by set; the first page
//      of a set in the batch owns it and replays, in batch order, every
//      page of the batch in that set against the set's tags and LRU bit,
//      exactly as the CPU does one page after another. Threads that collide
//      on a set are thus resolved by one owner; sets with one page cost one
//      step. The plan says per page: hit (which slot) or miss, and which
//      page of the batch last writes each slot;
//   3. encode (or apply, on the decoder) against the slot's contents as
//      they were before the batch;
//   4. cache update: each slot takes its last writer's page (or zeros).
// The host splits batches so that no page index occurs twice in one
// (GpuEncoder::encode_batch): then a hit always refers to a slot's contents
// from before the batch, never to a page of the same batch.

#define EV_ZERO 0
#define EV_LOOKUP 1
#define EV_MUSTHIT 2

#define KIND_NONE 0
#define KIND_HIT 1
#define KIND_MISS 2
#define KIND_ERR 3

#define FIN_ZERO 0x80000000u

extern "C" __global__ void xb_ev_encode(u32 n, const u32* is_zero, u8* ev) {
    u32 p = global_id();
    if (p < n) ev[p] = is_zero[p] ? EV_ZERO : EV_LOOKUP;
}

extern "C" __global__ void xb_ev_decode(u32 n, const u8* tag, u8* ev) {
    u32 p = global_id();
    if (p < n) ev[p] = tag[p] == TAG_ZERO ? EV_ZERO : (tag[p] == TAG_XBZRLE ? EV_MUSTHIT : EV_LOOKUP);
}

extern "C" __global__ void xb_claim(const u64* idx, u32 n, u32 sets, u32* xset, u32* claim) {
    u32 p = global_id();
    if (p >= n) return;
    u32 s = (u32)(idx[p] % (u64)sets);
    xset[p] = s;
    atomicMin(&claim[s], p);
}

extern "C" __global__ void xb_plan(const u64* idx, u32 n, const u8* ev, const u32* xset, u32* claim, u64* xtags,
                                   u8* xlru, u32* kind, u32* slot, u32* fin) {
    u32 p = global_id();
    if (p >= n) return;
    u32 s = xset[p];
    if (claim[s] != p) return;
    u64 t[2] = {xtags[s * 2], xtags[s * 2 + 1]};
    u32 lru = xlru[s];
    u32 last[2] = {NONE, NONE};
    u32 lastzero[2] = {0, 0};
    for (u32 j = p; j < n; ++j) {
        if (xset[j] != s) continue;
        fin[j] = NONE;
        kind[j] = KIND_NONE;
        u64 page = idx[j];
        if (ev[j] == EV_ZERO) {
            for (u32 w = 0; w < 2; ++w)
                if (t[w] == page) {
                    last[w] = j;
                    lastzero[w] = 1;
                }
            continue;
        }
        u32 w = t[0] == page ? 0 : (t[1] == page ? 1 : 2);
        if (w < 2) {
            kind[j] = KIND_HIT;
        } else if (ev[j] == EV_MUSTHIT) {
            kind[j] = KIND_ERR;
            continue;
        } else {
            w = lru;
            t[w] = page;
            kind[j] = KIND_MISS;
        }
        lru = 1 - w;
        slot[j] = s * 2 + w;
        last[w] = j;
        lastzero[w] = 0;
    }
    for (u32 w = 0; w < 2; ++w)
        if (last[w] != NONE) fin[last[w]] = (s * 2 + w) | (lastzero[w] ? FIN_ZERO : 0);
    xtags[s * 2] = t[0];
    xtags[s * 2 + 1] = t[1];
    xlru[s] = (u8)lru;
    claim[s] = NONE;
}

// Per 64-byte line of each hit page: bit i set when byte i differs from
// the cached copy. One thread per line.
extern "C" __global__ void xb_masks(const u8* pages, u32 n, const u32* kind, const u32* slot, const u8* xdata,
                                    u64* masks) {
    u32 t = global_id();
    if (t >= n * LINES) return;
    u32 p = t / LINES, line = t % LINES;
    if (kind[p] != KIND_HIT) return;
    const u64* a = (const u64*)(xdata + (u64)slot[p] * PAGE + line * 64);
    const u64* b = (const u64*)(pages + (u64)p * PAGE + line * 64);
    u64 bits = 0;
    for (u32 w = 0; w < 8; ++w) {
        u64 x = a[w] ^ b[w];
        for (u32 k = 0; k < 8; ++k)
            if ((x >> (8 * k)) & 0xFF) bits |= 1ull << (w * 8 + k);
    }
    masks[t] = bits;
}

// The first byte at or after pos whose "differs" bit is !flip's, or PAGE.
__device__ __forceinline__ u32 xb_next(const u64* m, u32 pos, u64 flip) {
    u32 line = pos / 64;
    if (line >= LINES) return PAGE;
    u64 x = (m[line] ^ flip) & (~0ull << (pos % 64));
    for (;;) {
        if (x) return line * 64 + (u32)(__ffsll((long long)x) - 1);
        if (++line == LINES) return PAGE;
        x = m[line] ^ flip;
    }
}

// One thread per hit page: the runs, as encode_runs on the CPU, limit 4095.
extern "C" __global__ void xb_encode(const u8* pages, u32 n, const u32* kind, const u64* masks, u8* rec, u8* tag,
                                     u32* len, u8* done) {
    u32 p = global_id();
    if (p >= n || kind[p] != KIND_HIT) return;
    const u64* m = masks + (u64)p * LINES;
    const u8* page = pages + (u64)p * PAGE;
    u8* out = rec + (u64)p * REC_STRIDE;
    const u64 DIFF = 0, SAME = ~0ull;
    u32 o = 0, prev_end = 0;
    u32 start = xb_next(m, 0, DIFF);
    while (start < PAGE) {
        u32 end = xb_next(m, start, SAME);
        u32 following = xb_next(m, end, DIFF);
        while (following < PAGE && following - end <= 2) {
            end = xb_next(m, following, SAME);
            following = xb_next(m, end, DIFF);
        }
        u32 literal = end - start;
        if (o + vlen(start - prev_end) + vlen(literal) + literal > PAGE - 1) return;  // overflow
        o += vput(out + o, start - prev_end);
        o += vput(out + o, literal);
        for (u32 k = 0; k < literal; ++k) out[o + k] = page[start + k];
        o += literal;
        prev_end = end;
        start = following;
    }
    tag[p] = TAG_XBZRLE;
    len[p] = o;
    done[p] = 1;
}

// Cache update: the last writer of each slot copies its page in (or
// zeros). One block per page, 16 bytes per thread.
extern "C" __global__ void xb_update(const u8* src, u32 n, const u32* fin, u8* xdata) {
    u32 p = blockIdx.x;
    if (p >= n || fin[p] == NONE) return;
    u32 s = fin[p] & ~FIN_ZERO;
    u64* dst = (u64*)(xdata + (u64)s * PAGE);
    const u64* from = (const u64*)(src + (u64)p * PAGE);
    for (u32 k = threadIdx.x * 2; k < PAGE / 8; k += blockDim.x * 2) {
        dst[k] = (fin[p] & FIN_ZERO) ? 0 : from[k];
        dst[k + 1] = (fin[p] & FIN_ZERO) ? 0 : from[k + 1];
    }
}

// Decoder: one thread per XBZRLE record; the page starts as the cached
// copy (from before the batch) and the runs are applied.
extern "C" __global__ void xb_apply(u32 n, const u8* tag, const u8* data, const u64* off, const u32* len,
                                    const u32* kind, const u32* slot, const u8* xdata, u8* out, u32* err, u32* errv) {
    u32 p = global_id();
    if (p >= n || tag[p] != TAG_XBZRLE) return;
    if (kind[p] != KIND_HIT) { err[p] = ERR_CACHE_MISS; return; }
    u8* page = out + (u64)p * PAGE;
    const u8* cached = xdata + (u64)slot[p] * PAGE;
    for (u32 k = 0; k < PAGE; ++k) page[k] = cached[k];
    const u8* in = data + off[p];
    u32 l = len[p], pos = 0, offset = 0;
    while (pos < l) {
        u32 unchanged, literal;
        if (!vget(in, l, &pos, &unchanged) || !vget(in, l, &pos, &literal)) { err[p] = ERR_TRUNCATED; return; }
        if (literal == 0) { err[p] = ERR_MALFORMED; return; }
        u32 start = offset + unchanged, end = start + literal;
        if (end > PAGE) { err[p] = ERR_OVERRUN; errv[p] = end; return; }
        if (l - pos < literal) { err[p] = ERR_TRUNCATED; return; }
        for (u32 k = 0; k < literal; ++k) page[start + k] = in[pos + k];
        pos += literal;
        offset = end;
    }
}
