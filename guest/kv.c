/*
 * kv: a memcached-like key-value store over `wss` bytes.
 *
 * A chained hash table (bucket array, then a slab of items) holds as many
 * keys as fit. Requests are generated here: keys by Zipf(0.99) popularity
 * (YCSB's generator), 90 % GET / 10 % SET, each key's value size fixed from
 * a Twitter-cache-like distribution between 100 B and 1 KiB. Popular keys
 * are scattered across the slab because items are inserted in a permuted
 * order. ops counts inserts while loading (pass 0), then requests; pass
 * goes up once per `nkeys` requests.
 */
#include "workload.h"

struct item {
    u64 key;
    u32 vlen;
    u32 check;  /* sum of value bytes, verified on GET */
    u64 next;   /* arena offset + 1 of the next item in the chain, 0 = end */
    u8 value[]; /* vlen bytes */
};

#define ITEM_HEADER 24UL

/* Value sizes: 40 % 100-199 B, 30 % 200-399, 20 % 400-699, 10 % 700-1024. */
static u32 value_size(u64 key)
{
    u64 h = mix64(key ^ 0x5bd1e995UL);
    u64 bucket = h % 100, within = (h >> 32);
    if (bucket < 40)
        return 100 + (u32)(within % 100);
    if (bucket < 70)
        return 200 + (u32)(within % 200);
    if (bucket < 90)
        return 400 + (u32)(within % 300);
    return 700 + (u32)(within % 325);
}

static inline u64 item_bytes(u32 vlen) { return (ITEM_HEADER + vlen + 7) & ~7UL; }

/* Text-like values: 6 random bits per byte, so codecs find some redundancy. */
static u32 fill_value(u8 *v, u32 len, u64 *rng)
{
    u32 sum = 0;
    for (u32 i = 0; i < len; i += 8) {
        u64 r = rng_next(rng);
        for (u32 j = 0; j < 8 && i + j < len; j++) {
            u8 b = (u8)(0x20 + ((r >> (j * 8)) & 0x3F));
            v[i + j] = b;
            sum += b;
        }
    }
    return sum;
}

/* zeta(n, theta) = sum 1/i^theta: exact for the head, Euler-Maclaurin tail. */
static double zeta(u64 n, double theta)
{
    u64 head = n < 10000 ? n : 10000;
    double sum = 0;
    for (u64 i = 1; i <= head; i++)
        sum += guest_pow((double)i, -theta);
    if (n > head) {
        double a = (double)head, b = (double)n;
        sum += (guest_pow(b, 1 - theta) - guest_pow(a, 1 - theta)) / (1 - theta);
        sum += 0.5 * (guest_pow(b, -theta) - guest_pow(a, -theta));
    }
    return sum;
}

void zipf_init(struct zipf *z, u64 n, double theta)
{
    z->n = n;
    z->theta = theta;
    z->alpha = 1.0 / (1.0 - theta);
    z->zetan = zeta(n, theta);
    double zeta2 = zeta(2, theta);
    z->eta = (1 - guest_pow(2.0 / (double)n, 1 - theta)) / (1 - zeta2 / z->zetan);
    z->half_pow_theta = guest_pow(0.5, theta);
}

u64 zipf_next(const struct zipf *z, u64 *rng)
{
    double u = rng_unit(rng), uz = u * z->zetan;
    if (uz < 1.0)
        return 0;
    if (uz < 1.0 + z->half_pow_theta)
        return 1;
    u64 k = (u64)((double)z->n * guest_pow(z->eta * u - z->eta + 1, z->alpha));
    return k < z->n ? k : z->n - 1;
}

void workload_kv(struct run *r)
{
    u8 *base = r->arena.base;
    /* ~1 bucket per 384 B of store, a power of two. */
    u64 nbuckets = 1;
    while (nbuckets * 2 * 384 <= r->wss)
        nbuckets *= 2;
    u64 *buckets = (u64 *)base, mask = nbuckets - 1;
    u64 slab_start = nbuckets * 8, slab_bytes = r->wss - slab_start;

    /* Which keys fit: sizes depend only on the key, so count in key order. */
    u64 nkeys = 0, used = 0;
    for (;;) {
        u64 b = item_bytes(value_size(nkeys));
        if (used + b > slab_bytes)
            break;
        used += b;
        nkeys++;
    }
    if (nkeys < 2)
        guest_fail("kv: wss too small for the store", 0);
    memset(buckets, 0, nbuckets * 8);

    /* Insert in a permuted order (odd multiplier mod 2^k, cycle-walking), so
     * hot keys land all over the slab, as in a store that has been running. */
    u64 span = 1;
    while (span < nkeys)
        span *= 2;
    u64 mul = (mix64(r->cfg.seed) | 1), add = mix64(r->cfg.seed + 1), x = 0, off = slab_start;
    for (u64 i = 0; i < nkeys; i++) {
        u64 key;
        do {
            key = (x * mul + add) & (span - 1);
            x++;
        } while (key >= nkeys);
        struct item *it = (struct item *)(base + off);
        it->key = key;
        it->vlen = value_size(key);
        it->check = fill_value(it->value, it->vlen, &r->rng);
        u64 *head = &buckets[mix64(key) & mask];
        it->next = *head;
        *head = off + 1;
        off += item_bytes(it->vlen);
        r->progress.ops++;
        throttle_account(&r->throttle, item_bytes(it->vlen));
        if ((i & 255) == 0)
            progress_tick(&r->progress);
    }

    struct zipf z;
    zipf_init(&z, nkeys, 0.99);
    {
        struct line l = {.len = 0};
        line_str(&l, "tsubame-guest: kv keys=");
        line_u64(&l, nkeys);
        line_str(&l, " buckets=");
        line_u64(&l, nbuckets);
        line_flush(&l);
    }

    r->progress.pass = 1;
    u64 served = 0;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            u64 key = zipf_next(&z, &r->rng);
            u64 link = buckets[mix64(key) & mask];
            struct item *it = 0;
            while (link) {
                struct item *c = (struct item *)(base + link - 1);
                if (c->key == key) {
                    it = c;
                    break;
                }
                link = c->next;
            }
            if (!it)
                guest_fail("kv: key missing from the store (memory corrupted?)", 0);
            if (rng_below(&r->rng, 10) == 0) {
                it->check = fill_value(it->value, it->vlen, &r->rng);
                throttle_account(&r->throttle, it->vlen);
            } else {
                u32 sum = 0;
                for (u32 j = 0; j < it->vlen; j++)
                    sum += it->value[j];
                if (sum != it->check)
                    guest_fail("kv: value checksum mismatch (memory corrupted?)", 0);
            }
        }
        r->progress.ops += 64;
        served += 64;
        if (served >= nkeys) {
            served = 0;
            r->progress.pass++;
        }
        progress_tick(&r->progress);
    }
}
