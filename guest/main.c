/*
 * Ring-3 entry: parse the multiboot command line and memory map, then run
 * the chosen workload forever. Everything here runs at native speed.
 */
#include "workload.h"

struct workload_def {
    const char *name;
    void (*run)(struct run *);
    u64 default_wss; /* 0 = the whole arena */
};

/* Defaults are documented in guest/README.md. */
static const struct workload_def workloads[] = {
    {"idle", workload_idle, 64 * MIB},
    {"fill-zero", workload_fill_zero, 0},
    {"fill-random", workload_fill_random, 0},
    {"kv", workload_kv, 512 * MIB},
    {"bwmem", workload_bwmem, 128 * MIB},
    {"sparse", workload_sparse, 256 * MIB},
    {"zero-clear", workload_zero_clear, 256 * MIB},
    {"stream", workload_stream, 256 * MIB},
    {"crash", workload_crash, 0},
    /* Disk workloads use little memory; wss is not theirs. */
    {"disk-seq", workload_disk_seq, 16 * MIB},
    {"disk-random", workload_disk_random, 16 * MIB},
    {"disk-mixed", workload_disk_mixed, 16 * MIB},
    {"disk-bad", workload_disk_bad, 16 * MIB},
};
#define NWORKLOADS (sizeof(workloads) / sizeof(workloads[0]))

static int str_eq(const char *a, size_t alen, const char *b)
{
    size_t i = 0;
    for (; i < alen; i++)
        if (b[i] != a[i])
            return 0;
    return b[i] == 0;
}

static char token_buf[128];

static const char *copy_token(const char *s, size_t n)
{
    if (n >= sizeof(token_buf))
        n = sizeof(token_buf) - 1;
    memcpy(token_buf, s, n);
    token_buf[n] = 0;
    return token_buf;
}

void wait_forever(void)
{
    __asm__ volatile("int $0x80");
    for (;;)
        cpu_relax();
}

/* "tsubame-guest: error: MSG 'DETAIL' (HINT)", then stop. */
__attribute__((noreturn)) static void fail_with_hint(const char *msg, const char *detail, const char *hint)
{
    struct line l = {.len = 0};
    line_str(&l, "tsubame-guest: error: ");
    line_str(&l, msg);
    if (detail) {
        line_str(&l, " '");
        line_str(&l, detail);
        line_str(&l, "'");
    }
    if (hint) {
        line_str(&l, " (");
        line_str(&l, hint);
        line_str(&l, ")");
    }
    line_flush(&l);
    wait_forever();
}

void guest_fail(const char *msg, const char *detail) { fail_with_hint(msg, detail, 0); }

/* "512M", "2G", "4096", "64K": binary multiples. */
static u64 parse_size(const char *s, size_t n, int allow_suffix)
{
    u64 v = 0;
    size_t i = 0;
    if (n == 0)
        guest_fail("empty value", 0);
    for (; i < n && s[i] >= '0' && s[i] <= '9'; i++) {
        if (v > (~0UL - 9) / 10)
            guest_fail("number too large", copy_token(s, n));
        v = v * 10 + (u64)(s[i] - '0');
    }
    if (i == 0)
        guest_fail("not a number", copy_token(s, n));
    if (i == n)
        return v;
    if (!allow_suffix || i + 1 != n)
        guest_fail("not a number", copy_token(s, n));
    int shift;
    switch (s[i]) {
    case 'K': case 'k': shift = 10; break;
    case 'M': case 'm': shift = 20; break;
    case 'G': case 'g': shift = 30; break;
    default: guest_fail("bad size suffix (use K, M or G)", copy_token(s, n));
    }
    if (v > (~0UL >> shift))
        guest_fail("size too large", copy_token(s, n));
    return v << shift;
}

static void parse_cmdline(const char *cmd, struct config *cfg)
{
    const char *p = cmd;
    int first = 1;
    while (*p) {
        while (*p == ' ')
            p++;
        if (!*p)
            break;
        const char *tok = p;
        while (*p && *p != ' ')
            p++;
        size_t n = (size_t)(p - tok), eq = 0;
        while (eq < n && tok[eq] != '=')
            eq++;
        if (eq == n) {
            /* QEMU puts the kernel's file name first; skip that one. */
            if (first) {
                first = 0;
                continue;
            }
            guest_fail("expected key=value, got", copy_token(tok, n));
        }
        first = 0;
        const char *val = tok + eq + 1;
        size_t vlen = n - eq - 1;
        if (str_eq(tok, eq, "workload")) {
            cfg->workload = 0;
            for (size_t i = 0; i < NWORKLOADS; i++)
                if (str_eq(val, vlen, workloads[i].name))
                    cfg->workload = workloads[i].name;
            if (!cfg->workload)
                fail_with_hint("unknown workload", copy_token(val, vlen),
                               "known: idle fill-zero fill-random kv bwmem sparse zero-clear stream crash disk-seq "
                               "disk-random disk-mixed disk-bad");
        } else if (str_eq(tok, eq, "wss")) {
            cfg->wss = parse_size(val, vlen, 1);
            if (cfg->wss < PAGE_SIZE)
                guest_fail("wss must be at least 4K, got", copy_token(val, vlen));
        } else if (str_eq(tok, eq, "rate")) {
            cfg->rate_mbs = parse_size(val, vlen, 0);
            cfg->rate_set = 1;
        } else if (str_eq(tok, eq, "disk")) {
            cfg->disk_bytes = parse_size(val, vlen, 1);
        } else if (str_eq(tok, eq, "seed")) {
            cfg->seed = parse_size(val, vlen, 0);
        } else if (str_eq(tok, eq, "tsc_khz")) {
            cfg->tsc_khz = parse_size(val, vlen, 0);
            if (cfg->tsc_khz == 0)
                guest_fail("tsc_khz must be positive", 0);
        } else {
            fail_with_hint("unknown parameter", copy_token(tok, eq), "known: workload wss rate seed disk tsc_khz");
        }
    }
}

static void cpuid(u32 leaf, u32 *a, u32 *b, u32 *c, u32 *d)
{
    __asm__ volatile("cpuid" : "=a"(*a), "=b"(*b), "=c"(*c), "=d"(*d) : "a"(leaf), "c"(0));
}

/* TSC frequency from CPUID 0x15 (crystal ratio) or 0x16 (base MHz). */
static u64 tsc_khz_from_cpuid(void)
{
    u32 a, b, c, d, max;
    cpuid(0, &max, &b, &c, &d);
    if (max >= 0x15) {
        cpuid(0x15, &a, &b, &c, &d);
        if (a && b && c)
            return (u64)c * b / a / 1000;
    }
    if (max >= 0x16) {
        cpuid(0x16, &a, &b, &c, &d);
        if (a)
            return (u64)a * 1000;
    }
    return 0;
}

static struct arena find_arena(const struct mb_info *mbi)
{
    u64 image_end = ((u64)_bss_end + 2 * MIB - 1) & ~(2 * MIB - 1);
    struct arena best = {0, 0};
    if (!(mbi->flags & MB_INFO_MMAP)) {
        u64 end = (u64)(mbi->mem_upper + 1024) * 1024;
        if (end > image_end)
            best = (struct arena){(u8 *)image_end, (end - image_end) & ~(PAGE_SIZE - 1)};
        return best;
    }
    u64 p = mbi->mmap_addr, end = p + mbi->mmap_length;
    while (p < end) {
        const struct mb_mmap_entry *e = (const void *)p;
        p += e->size + 4;
        if (e->type != 1)
            continue;
        u64 lo = e->addr, hi = e->addr + e->len;
        if (hi > 64 * GIB)
            hi = 64 * GIB; /* what ring 0 maps */
        if (lo < image_end)
            lo = image_end;
        lo = (lo + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1);
        hi &= ~(PAGE_SIZE - 1);
        if (hi > lo && hi - lo > best.size)
            best = (struct arena){(u8 *)lo, hi - lo};
    }
    return best;
}

struct stall guest_stall;

void progress_emit(struct progress *p)
{
    struct line l = {.len = 0};
    line_str(&l, "tsb ops=");
    line_u64(&l, p->ops);
    line_str(&l, " pass=");
    line_u64(&l, p->pass);
    /* The largest gap since the last line, in us. The line's own exit is
       not excluded from the next gap: a stop that catches the vCPU in it
       is a stall like any other. */
    line_str(&l, " gap_us=");
    line_u64(&l, guest_stall.max_gap_tsc * 1000 / p->tsc_khz);
    guest_stall.max_gap_tsc = 0;
    if (p->disk) {
        line_str(&l, " rd=");
        line_u64(&l, p->rd);
        line_str(&l, " wr=");
        line_u64(&l, p->wr);
    }
    if (p->has_ack) {
        line_str(&l, " ack=");
        line_u64(&l, p->ack);
    }
    line_flush(&l);
    p->next_tsc = rdtsc() + p->interval_tsc;
}

void throttle_wait(struct throttle *t)
{
    u64 due = t->start_tsc + (u64)((double)t->bytes * t->tsc_per_byte);
    u64 now;
    while ((now = rdtsc()) < due) {
        stall_note(now);
        cpu_relax();
    }
    stall_note(now);
}

static void line_size(struct line *l, u64 bytes)
{
    if (bytes % MIB == 0) {
        line_u64(l, bytes / MIB);
        line_str(l, "M");
    } else {
        line_u64(l, bytes);
    }
}

void guest_main(u32 mbi_addr)
{
    const struct mb_info *mbi = (const void *)(u64)mbi_addr;
    static struct run r;
    r.cfg.seed = 1;
    if (mbi->flags & MB_INFO_CMDLINE)
        parse_cmdline((const char *)(u64)mbi->cmdline, &r.cfg);
    if (!r.cfg.workload)
        guest_fail("no workload given (workload=NAME)", 0);

    const struct workload_def *def = 0;
    for (size_t i = 0; i < NWORKLOADS; i++)
        if (workloads[i].name == r.cfg.workload)
            def = &workloads[i];

    r.arena = find_arena(mbi);
    if (r.arena.size < 2 * MIB)
        guest_fail("too little memory for a workload (need 2 MiB past the image)", 0);
    r.wss = r.cfg.wss ? r.cfg.wss : def->default_wss;
    if (r.wss == 0 || (!r.cfg.wss && r.wss > r.arena.size))
        r.wss = r.arena.size;
    if (r.wss > r.arena.size)
        guest_fail("wss is larger than the usable memory; lower wss= or give the VM more memory", 0);
    r.wss &= ~(PAGE_SIZE - 1);

    u64 khz = r.cfg.tsc_khz;
    const char *khz_source = "cmdline";
    if (!khz) {
        khz = tsc_khz_from_cpuid();
        khz_source = "cpuid";
    }
    if (!khz) {
        khz = 2000000;
        khz_source = "assumed";
    }
    r.rng = r.cfg.seed * 0x2545F4914F6CDD1DUL + 1;
    r.progress.interval_tsc = 50 * khz; /* 50 ms */
    r.progress.tsc_khz = khz;
    r.progress.next_tsc = rdtsc() + r.progress.interval_tsc;
    guest_stall.last_tsc = rdtsc();
    r.throttle.start_tsc = rdtsc();
    if (!r.cfg.rate_set && str_eq(r.cfg.workload, strlen(r.cfg.workload), "disk-seq"))
        r.cfg.rate_mbs = 160; /* the I/O paper's 16 KB per ~100 us */
    if (r.cfg.rate_mbs)
        r.throttle.tsc_per_byte = (double)khz * 1000.0 / ((double)r.cfg.rate_mbs * 1e6);

    struct line l = {.len = 0};
    line_str(&l, "tsubame-guest: workload=");
    line_str(&l, r.cfg.workload);
    line_str(&l, " wss=");
    line_size(&l, r.wss);
    line_str(&l, " rate=");
    line_u64(&l, r.cfg.rate_mbs);
    line_str(&l, " seed=");
    line_u64(&l, r.cfg.seed);
    line_str(&l, " tsc_khz=");
    line_u64(&l, khz);
    line_str(&l, " (");
    line_str(&l, khz_source);
    line_str(&l, ") arena=");
    line_hex(&l, (u64)r.arena.base);
    line_str(&l, "+");
    line_size(&l, r.arena.size);
    line_flush(&l);

    def->run(&r);
    wait_forever();
}
