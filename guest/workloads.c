/*
 * The memory-dirtying workloads. Each loops forever, counting `ops` and
 * `pass` (sweeps over its working set) and printing progress every ~50 ms.
 */
#include "workload.h"

/* Fill one page with 8-byte stores of `v`, v+step, ... */
static inline void write_page_words(u8 *page, u64 v, u64 step)
{
    u64 *w = (u64 *)page;
    for (int i = 0; i < 512; i++, v += step)
        w[i] = v;
}

static inline void clear_page(u8 *page)
{
    size_t n = PAGE_SIZE / 8;
    __asm__ volatile("rep stosq" : "+D"(page), "+c"(n) : "a"(0UL) : "memory");
}

/* Reads only: sweeps the working set, dirtying nothing. */
void workload_idle(struct run *r)
{
    u64 pages = r->wss / PAGE_SIZE, sum = 0;
    for (;;) {
        for (u64 p = 0; p < pages; p++) {
            sum += *(volatile u64 *)(r->arena.base + p * PAGE_SIZE);
            r->progress.ops++;
            if ((p & 255) == 0)
                progress_tick(&r->progress);
        }
        r->progress.pass++;
    }
}

/* GMigrate's "Best": zero runs everywhere, then a light trickle of 8-byte
 * writes (1000/s, or rate= MB/s). */
void workload_fill_zero(struct run *r)
{
    u64 pages = r->wss / PAGE_SIZE;
    for (u64 p = 0; p < pages; p++) {
        clear_page(r->arena.base + p * PAGE_SIZE);
        r->progress.ops++;
        throttle_account(&r->throttle, PAGE_SIZE);
        if ((p & 255) == 0)
            progress_tick(&r->progress);
    }
    r->progress.pass = 1;
    u64 gap = r->progress.interval_tsc / 50; /* 1 ms */
    u64 next = rdtsc();
    for (;;) {
        u64 off = rng_below(&r->rng, r->wss / 8) * 8;
        *(volatile u64 *)(r->arena.base + off) = rng_next(&r->rng) | 1;
        r->progress.ops++;
        if (r->throttle.tsc_per_byte != 0) {
            throttle_account(&r->throttle, 8);
        } else {
            next += gap;
            u64 now;
            while ((now = rdtsc()) < next) {
                stall_note(now);
                cpu_relax();
            }
        }
        progress_tick(&r->progress);
    }
}

/* GMigrate's "Worst": incompressible random bytes, page after page. */
void workload_fill_random(struct run *r)
{
    u64 pages = r->wss / PAGE_SIZE;
    for (;;) {
        for (u64 p = 0; p < pages; p++) {
            u64 *w = (u64 *)(r->arena.base + p * PAGE_SIZE);
            for (int i = 0; i < 512; i++)
                w[i] = rng_next(&r->rng);
            r->progress.ops++;
            throttle_account(&r->throttle, PAGE_SIZE);
            if ((p & 63) == 0)
                progress_tick(&r->progress);
        }
        r->progress.pass++;
    }
}

/* LMbench bw_mem `wr`: store the same words over the window again and
 * again. The contents stop changing after the first pass; the pages still
 * get dirty. */
void workload_bwmem(struct run *r)
{
    u64 pages = r->wss / PAGE_SIZE;
    for (;;) {
        for (u64 p = 0; p < pages; p++) {
            write_page_words(r->arena.base + p * PAGE_SIZE, 1, 0);
            r->progress.ops++;
            throttle_account(&r->throttle, PAGE_SIZE);
            if ((p & 63) == 0)
                progress_tick(&r->progress);
        }
        r->progress.pass++;
    }
}

/* 8-byte writes at random offsets: a few bytes change per dirty page. */
void workload_sparse(struct run *r)
{
    u64 words = r->wss / 8;
    for (;;) {
        for (int i = 0; i < 1024; i++) {
            u64 off = rng_below(&r->rng, words) * 8;
            *(volatile u64 *)(r->arena.base + off) = rng_next(&r->rng);
        }
        r->progress.ops += 1024;
        throttle_account(&r->throttle, 8 * 1024);
        progress_tick(&r->progress);
        if (r->progress.ops % words < 1024)
            r->progress.pass++;
    }
}

/* Like the kernel's clear_page: whole pages zeroed with `rep stosq`, after
 * the working set was filled with data; an 8-byte write to another random
 * page keeps some pages non-zero. */
void workload_zero_clear(struct run *r)
{
    u64 pages = r->wss / PAGE_SIZE;
    for (u64 p = 0; p < pages; p++) {
        u64 *w = (u64 *)(r->arena.base + p * PAGE_SIZE);
        for (int i = 0; i < 512; i++)
            w[i] = rng_next(&r->rng);
        throttle_account(&r->throttle, PAGE_SIZE);
        if ((p & 63) == 0)
            progress_tick(&r->progress);
    }
    r->progress.pass = 1;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            clear_page(r->arena.base + rng_below(&r->rng, pages) * PAGE_SIZE);
            u64 off = rng_below(&r->rng, r->wss / 8) * 8;
            *(volatile u64 *)(r->arena.base + off) = rng_next(&r->rng);
        }
        r->progress.ops += 64;
        throttle_account(&r->throttle, 64 * (PAGE_SIZE + 8));
        progress_tick(&r->progress);
        if (r->progress.ops % pages < 64)
            r->progress.pass++;
    }
}

/* Sequential full-page rewrites whose contents change every pass. */
void workload_stream(struct run *r)
{
    u64 pages = r->wss / PAGE_SIZE;
    for (;;) {
        u64 salt = (r->progress.pass + 1) * 0x9E3779B97F4A7C15UL;
        for (u64 p = 0; p < pages; p++) {
            write_page_words(r->arena.base + p * PAGE_SIZE, salt ^ (p << 12), 1);
            r->progress.ops++;
            throttle_account(&r->throttle, PAGE_SIZE);
            if ((p & 63) == 0)
                progress_tick(&r->progress);
        }
        r->progress.pass++;
    }
}

/* For tests of the exception path: a write far beyond mapped memory. */
void workload_crash(struct run *r)
{
    (void)r;
    *(volatile u64 *)(100 * GIB) = 1;
}
