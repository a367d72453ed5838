/* The guest's workloads and what they share: config, arena, progress. */
#ifndef TSUBAME_WORKLOAD_H
#define TSUBAME_WORKLOAD_H
#include "guest.h"

struct config {
    const char *workload;
    u64 wss;      /* bytes; 0 = the workload's default */
    u64 rate_mbs; /* MB/s of bytes written; 0 = uncapped */
    u64 seed;
    u64 tsc_khz;
    u64 disk_bytes; /* disk=: bytes of the disk a disk workload uses; 0 = all */
    int rate_set;   /* rate= given (0 then means uncapped) */
};

/* The memory the workloads may use: the largest RAM region past the image. */
struct arena {
    u8 *base;
    u64 size;
};

/* Progress lines (`tsb ops=N pass=N gap_us=G`, disk workloads add
 * `rd=B wr=B` and disk-mixed `ack=SEQ`) every ~50 ms of TSC time. */
struct progress {
    u64 ops, pass;
    u64 next_tsc, interval_tsc;
    u64 tsc_khz;
    int disk, has_ack;
    u64 rd, wr, ack;
};

/* The guest's own view of a stall: the largest TSC gap between two
 * consecutive checkpoints of the work loop (each progress_tick, each turn
 * of a pacing spin), since the last progress line printed it as `gap_us`.
 * A pause or a migration's stop-and-copy lands in the gap that ends at the
 * first checkpoint after the resume, so the first line printed after it
 * carries it. One vCPU: a plain global. */
struct stall {
    u64 last_tsc, max_gap_tsc;
};
extern struct stall guest_stall;

static inline void stall_note(u64 now)
{
    i64 gap = (i64)(now - guest_stall.last_tsc);
    if (gap > (i64)guest_stall.max_gap_tsc)
        guest_stall.max_gap_tsc = (u64)gap;
    guest_stall.last_tsc = now;
}

/* Caps the rate of bytes written at rate_mbs. */
struct throttle {
    double tsc_per_byte; /* 0 = uncapped */
    u64 start_tsc;
    u64 bytes;
};

struct run {
    struct config cfg;
    struct arena arena;
    u64 wss;
    struct progress progress;
    struct throttle throttle;
    u64 rng;
};

void progress_emit(struct progress *p);
static inline void progress_tick(struct progress *p)
{
    u64 now = rdtsc();
    stall_note(now);
    if (now >= p->next_tsc)
        progress_emit(p);
}

void throttle_wait(struct throttle *t);
static inline void throttle_account(struct throttle *t, u64 bytes)
{
    t->bytes += bytes;
    if (t->tsc_per_byte != 0)
        throttle_wait(t);
}

/* MurmurHash3's finalizer: scatters keys (kv) and record words (disk-mixed;
   crates/block/src/records.rs computes the same). */
static inline u64 mix64(u64 x)
{
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDUL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53UL;
    return x ^ (x >> 33);
}

/* splitmix64: tiny, fast, and good enough to make memory contents. */
static inline u64 rng_next(u64 *s)
{
    u64 z = (*s += 0x9E3779B97F4A7C15UL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9UL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBUL;
    return z ^ (z >> 31);
}

/* Uniform in [0, n) without a division (Lemire). */
static inline u64 rng_below(u64 *s, u64 n)
{
    return (u64)(((unsigned __int128)rng_next(s) * n) >> 64);
}

/* A uniform double in [0, 1). */
static inline double rng_unit(u64 *s) { return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0); }

/* Zipf(theta) ranks in [0, n) (YCSB's generator; kv.c). */
struct zipf {
    u64 n;
    double theta, alpha, zetan, eta, half_pow_theta;
};
void zipf_init(struct zipf *z, u64 n, double theta);
u64 zipf_next(const struct zipf *z, u64 *rng);

__attribute__((noreturn)) void guest_fail(const char *msg, const char *detail);
void wait_forever(void) __attribute__((noreturn));

double guest_log(double x);
double guest_exp(double x);
double guest_pow(double x, double y);

void workload_idle(struct run *r);
void workload_fill_zero(struct run *r);
void workload_fill_random(struct run *r);
void workload_bwmem(struct run *r);
void workload_sparse(struct run *r);
void workload_zero_clear(struct run *r);
void workload_stream(struct run *r);
void workload_kv(struct run *r);
void workload_crash(struct run *r);
void workload_disk_seq(struct run *r);
void workload_disk_random(struct run *r);
void workload_disk_mixed(struct run *r);
void workload_disk_bad(struct run *r);

#endif
