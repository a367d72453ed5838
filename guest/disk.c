/*
 * The virtio-blk disk, driven from ring 3 by port I/O (IOPL 3): found on
 * PCI bus 0 through configuration mechanism #1 (ports 0xCF8/0xCFC), set
 * up with the legacy (virtio 0.9.5) interface on its I/O BAR, one request
 * at a time, completion polled (interrupts stay off). The same code drives
 * tsubame's device and QEMU's `virtio-blk-pci,disable-modern=on`.
 *
 * And the disk workloads:
 * - disk-seq: 16 KiB reads, one after another over the region, paced at
 *   `rate` MB/s (160 by default: the I/O paper's 16 KB every ~100 us);
 * - disk-random: 4 KiB reads of Zipf(0.99)-popular blocks, scattered;
 * - disk-mixed: 4 KiB records (crates/block/src/records.rs) written to a
 *   scattered log, 3 reads per write that check a recent record in full,
 *   a FLUSH every 64 writes. `ack` is the last write completed.
 * - disk-bad (for tests): hands the device malformed requests, checks
 *   each is refused, then reads on like disk-seq.
 */
#include "workload.h"

static inline void outl(u16 port, u32 v) { __asm__ volatile("outl %0, %1" : : "a"(v), "Nd"(port)); }
static inline void outw(u16 port, u16 v) { __asm__ volatile("outw %0, %1" : : "a"(v), "Nd"(port)); }
static inline void outb(u16 port, u8 v) { __asm__ volatile("outb %0, %1" : : "a"(v), "Nd"(port)); }
static inline u32 inl(u16 port)
{
    u32 v;
    __asm__ volatile("inl %1, %0" : "=a"(v) : "Nd"(port));
    return v;
}
static inline u16 inw(u16 port)
{
    u16 v;
    __asm__ volatile("inw %1, %0" : "=a"(v) : "Nd"(port));
    return v;
}
static inline u8 inb(u16 port)
{
    u8 v;
    __asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port));
    return v;
}
static inline void barrier(void) { __asm__ volatile("" : : : "memory"); }

#define PCI_ADDRESS 0xCF8
#define PCI_DATA 0xCFC

static u32 pci_read(u32 dev, u32 reg)
{
    outl(PCI_ADDRESS, 0x80000000u | dev << 11 | (reg & 0xFC));
    return inl(PCI_DATA);
}

static void pci_write(u32 dev, u32 reg, u32 v)
{
    outl(PCI_ADDRESS, 0x80000000u | dev << 11 | (reg & 0xFC));
    outl(PCI_DATA, v);
}

/* Legacy virtio registers, offsets in BAR0. */
#define REG_DEVICE_FEATURES 0x00
#define REG_DRIVER_FEATURES 0x04
#define REG_QUEUE_PFN 0x08
#define REG_QUEUE_SIZE 0x0C
#define REG_QUEUE_SELECT 0x0E
#define REG_QUEUE_NOTIFY 0x10
#define REG_STATUS 0x12
#define REG_CAPACITY 0x14
#define STATUS_ACKNOWLEDGE 1
#define STATUS_DRIVER 2
#define STATUS_DRIVER_OK 4
#define F_BLK_FLUSH (1u << 9)

#define DESC_NEXT 1
#define DESC_WRITE 2
#define AVAIL_NO_INTERRUPT 1

#define REQ_IN 0
#define REQ_OUT 1
#define REQ_FLUSH 4
#define REQ_GET_ID 8

struct desc {
    u64 addr;
    u32 len;
    u16 flags, next;
};

struct used_elem {
    u32 id, len;
};

struct req_header {
    u32 type, reserved;
    u64 sector;
};

/* Largest data buffer of one request. */
#define MAX_REQUEST (64 * 1024UL)

static struct {
    u16 io;
    u16 qsize;
    u64 capacity; /* bytes */
    int can_flush;
    struct desc *desc;
    volatile u16 *avail; /* flags, idx, ring[qsize] */
    volatile u16 *used;  /* flags, idx, then the elements */
    u16 next_avail, last_used;
    struct req_header *header;
    volatile u8 *status;
    u8 *buf;
} disk;

/* Bytes disk_setup takes from the end of the arena. */
#define DISK_RESERVE (256 * 1024UL)

static void disk_fail(const char *what, u64 value)
{
    struct line l = {.len = 0};
    line_str(&l, "tsubame-guest: error: virtio-blk: ");
    line_str(&l, what);
    line_str(&l, " ");
    line_u64(&l, value);
    line_flush(&l);
    wait_forever();
}

/* Puts `n` descriptors in the table as one chain, makes it available,
 * notifies and waits; returns the length the device says it wrote. */
static u32 disk_chain(const struct desc *chain, u16 n)
{
    for (u16 i = 0; i < n; i++) {
        disk.desc[i] = chain[i];
        disk.desc[i].next = (u16)(i + 1);
    }
    disk.avail[2 + disk.next_avail % disk.qsize] = 0;
    barrier();
    disk.next_avail++;
    disk.avail[1] = disk.next_avail;
    barrier();
    outw(disk.io + REG_QUEUE_NOTIFY, 0);
    while (disk.used[1] == disk.last_used)
        cpu_relax();
    barrier();
    const struct used_elem *used = (const struct used_elem *)(disk.used + 2);
    u32 len = used[disk.last_used % disk.qsize].len;
    disk.last_used++;
    return len;
}

/* One request: header, optional data, status; waits for its completion. */
static void disk_request(u32 type, u64 offset, void *data, u32 len)
{
    disk.header->type = type;
    disk.header->reserved = 0;
    disk.header->sector = offset / 512;
    *disk.status = 0xFF;
    struct desc d[3];
    u16 n = 0;
    d[n++] = (struct desc){(u64)disk.header, sizeof(struct req_header), DESC_NEXT, 0};
    if (len) {
        u16 writable = (type == REQ_IN || type == REQ_GET_ID) ? DESC_WRITE : 0;
        d[n++] = (struct desc){(u64)data, len, (u16)(DESC_NEXT | writable), 0};
    }
    d[n++] = (struct desc){(u64)disk.status, 1, DESC_WRITE, 0};
    disk_chain(d, n);
    if (*disk.status != 0)
        disk_fail(type == REQ_IN ? "read failed, status" : type == REQ_OUT ? "write failed, status"
                                                                            : "request failed, status",
                  *disk.status);
}

static void disk_read(u64 offset, void *buf, u32 len) { disk_request(REQ_IN, offset, buf, len); }
static void disk_write(u64 offset, const void *buf, u32 len) { disk_request(REQ_OUT, offset, (void *)buf, len); }
static void disk_flush(void)
{
    if (disk.can_flush)
        disk_request(REQ_FLUSH, 0, 0, 0);
}

/* Finds and sets up the disk; takes DISK_RESERVE bytes off the arena's end. */
static void disk_setup(struct run *r)
{
    u32 dev = 0;
    for (u32 slot = 0; slot < 32 && !dev; slot++) {
        u32 id = pci_read(slot, 0x00);
        if ((id & 0xFFFF) == 0x1AF4 && (id >> 16) == 0x1001)
            dev = slot;
    }
    if (!dev)
        guest_fail("no virtio-blk disk (legacy, 1af4:1001) on PCI bus 0; give the VM one "
                   "(tsubame --disk FILE, QEMU -device virtio-blk-pci,disable-modern=on)",
                   0);
    u32 bar = pci_read(dev, 0x10);
    if (!(bar & 1))
        guest_fail("virtio-blk BAR0 is not an I/O BAR", 0);
    if ((bar & ~3u) == 0) {
        pci_write(dev, 0x10, 0xC000); /* no firmware placed it */
        bar = pci_read(dev, 0x10);
    }
    pci_write(dev, 0x04, pci_read(dev, 0x04) | 1); /* I/O space on */
    disk.io = (u16)(bar & ~3u);

    if (r->arena.size < DISK_RESERVE + 2 * MIB)
        guest_fail("too little memory for the disk's ring and buffers", 0);
    r->arena.size -= DISK_RESERVE;
    u8 *mem = r->arena.base + r->arena.size;
    memset(mem, 0, DISK_RESERVE);

    outb(disk.io + REG_STATUS, 0); /* reset */
    outb(disk.io + REG_STATUS, STATUS_ACKNOWLEDGE);
    outb(disk.io + REG_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
    u32 features = inl(disk.io + REG_DEVICE_FEATURES);
    disk.can_flush = (features & F_BLK_FLUSH) != 0;
    outl(disk.io + REG_DRIVER_FEATURES, features & F_BLK_FLUSH);
    outw(disk.io + REG_QUEUE_SELECT, 0);
    disk.qsize = inw(disk.io + REG_QUEUE_SIZE);
    if (disk.qsize < 4 || disk.qsize > 1024)
        disk_fail("unusable queue size", disk.qsize);
    /* The legacy layout: descriptors, the available ring, then the used
     * ring at the next 4 KiB boundary. */
    u64 avail_end = 16UL * disk.qsize + 6 + 2UL * disk.qsize;
    u64 used_at = (avail_end + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1);
    u64 ring_bytes = (used_at + 6 + 8UL * disk.qsize + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1);
    disk.desc = (struct desc *)mem;
    disk.avail = (volatile u16 *)(mem + 16UL * disk.qsize);
    disk.used = (volatile u16 *)(mem + used_at);
    disk.avail[0] = AVAIL_NO_INTERRUPT;
    disk.header = (struct req_header *)(mem + ring_bytes);
    disk.status = (volatile u8 *)(mem + ring_bytes + sizeof(struct req_header));
    disk.buf = mem + ring_bytes + PAGE_SIZE;
    if (ring_bytes + PAGE_SIZE + MAX_REQUEST > DISK_RESERVE)
        disk_fail("queue too large for the reserve, size", disk.qsize);
    outl(disk.io + REG_QUEUE_PFN, (u32)((u64)mem / PAGE_SIZE));
    outb(disk.io + REG_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_DRIVER_OK);
    disk.capacity = ((u64)inl(disk.io + REG_CAPACITY + 4) << 32 | inl(disk.io + REG_CAPACITY)) * 512;

    char id[21] = {0};
    disk_request(REQ_GET_ID, 0, disk.buf, 20);
    memcpy(id, disk.buf, 20);
    struct line l = {.len = 0};
    line_str(&l, "tsubame-guest: disk id=");
    line_str(&l, id[0] ? id : "-");
    line_str(&l, " capacity=");
    line_u64(&l, disk.capacity);
    line_str(&l, " io=");
    line_hex(&l, disk.io);
    line_str(&l, " queue=");
    line_u64(&l, disk.qsize);
    line_flush(&l);
    if (disk.capacity < 64 * 1024)
        guest_fail("the disk is smaller than 64 KiB", 0);
}

/* The part of the disk a workload uses: `disk=` or all of it, whole `unit`s. */
static u64 disk_region(const struct run *r, u64 unit)
{
    u64 region = r->cfg.disk_bytes ? r->cfg.disk_bytes : disk.capacity;
    if (region > disk.capacity)
        region = disk.capacity;
    region -= region % unit;
    if (region < unit)
        guest_fail("disk= is smaller than one request", 0);
    return region;
}

/* Paces disk bytes at rate= MB/s. Unlike throttle_wait it does not catch
 * up after the guest was stopped (paused, migrated) or the disk was slow:
 * a burst afterwards would hide what the stop or the slow disk cost. */
static u64 pace_due;

static void disk_progress(struct run *r, u64 rd, u64 wr)
{
    r->progress.rd += rd;
    r->progress.wr += wr;
    if (r->throttle.tsc_per_byte != 0) {
        u64 now = rdtsc();
        if (pace_due == 0 || now > pace_due + r->progress.interval_tsc)
            pace_due = now;
        pace_due += (u64)((double)(rd + wr) * r->throttle.tsc_per_byte);
        while ((now = rdtsc()) < pace_due) {
            stall_note(now);
            cpu_relax();
        }
    }
    progress_tick(&r->progress);
}

void workload_disk_seq(struct run *r)
{
    if (!disk.io)
        disk_setup(r);
    r->progress.disk = 1;
    const u32 chunk = 16 * 1024;
    u64 region = disk_region(r, chunk);
    for (;;) {
        for (u64 off = 0; off < region; off += chunk) {
            disk_read(off, disk.buf, chunk);
            r->progress.ops++;
            disk_progress(r, chunk, 0);
        }
        r->progress.pass++;
    }
}

/* Scatters Zipf ranks over the region's blocks (n is odd-free: any n). */
static u64 scatter(u64 rank, u64 n) { return (rank * 0x9E3779B97F4A7C15UL >> 11) % n; }

void workload_disk_random(struct run *r)
{
    disk_setup(r);
    r->progress.disk = 1;
    u64 blocks = disk_region(r, PAGE_SIZE) / PAGE_SIZE;
    struct zipf z;
    zipf_init(&z, blocks, 0.99);
    for (;;) {
        for (u64 i = 0; i < blocks; i++) {
            u64 block = scatter(zipf_next(&z, &r->rng), blocks);
            disk_read(block * PAGE_SIZE, disk.buf, PAGE_SIZE);
            r->progress.ops++;
            disk_progress(r, PAGE_SIZE, 0);
        }
        r->progress.pass++;
    }
}

/* crates/block/src/records.rs, word for word. */
#define RECORD_MAGIC 0x3130434552425354UL /* "TSBREC01" little-endian */
#define RECORD_WORDS 512
#define RECORD_HEADER 6
#define SCATTER_PRIME 2654435761UL

static inline u64 payload_word(u64 run, u64 seq, u64 i) { return mix64(run + seq * 0x9E3779B97F4A7C15UL + i); }

static u64 record_check(const u64 *w)
{
    u64 h = 0xCBF29CE484222325UL;
    for (int i = 0; i < RECORD_WORDS - 1; i++) {
        h = (h ^ w[i]) * 0x00000100000001B3UL;
        h ^= h >> 32;
    }
    return h;
}

static inline u64 block_of(u64 seq, u64 first, u64 n) { return first + ((seq - 1) % n) * SCATTER_PRIME % n; }

static void record_fill(u64 *w, u64 run, u64 seq, u64 block, u64 first, u64 n)
{
    w[0] = RECORD_MAGIC;
    w[1] = run;
    w[2] = seq;
    w[3] = block;
    w[4] = first;
    w[5] = n;
    for (u64 i = RECORD_HEADER; i < RECORD_WORDS - 1; i++)
        w[i] = payload_word(run, seq, i);
    w[RECORD_WORDS - 1] = record_check(w);
}

static void record_verify(const u64 *w, u64 run, u64 seq, u64 block, u64 first, u64 n)
{
    const char *wrong = 0;
    if (w[0] != RECORD_MAGIC)
        wrong = "no record at its block (a lost write?) seq";
    else if (w[1] != run || w[2] != seq)
        wrong = "an older record where the newest belongs (a stale read?) seq";
    else if (w[3] != block || w[4] != first || w[5] != n)
        wrong = "a record in the wrong place, seq";
    else if (w[RECORD_WORDS - 1] != record_check(w))
        wrong = "a torn record, seq";
    else
        for (u64 i = RECORD_HEADER; i < RECORD_WORDS - 1 && !wrong; i++)
            if (w[i] != payload_word(run, seq, i))
                wrong = "a record whose payload differs, seq";
    if (wrong) {
        struct line l = {.len = 0};
        line_str(&l, "tsubame-guest: error: disk-mixed: read back ");
        line_str(&l, wrong);
        line_str(&l, " ");
        line_u64(&l, seq);
        line_str(&l, " found seq ");
        line_u64(&l, w[2]);
        line_flush(&l);
        wait_forever();
    }
}

void workload_disk_mixed(struct run *r)
{
    disk_setup(r);
    r->progress.disk = 1;
    r->progress.has_ack = 1;
    u64 n = disk_region(r, PAGE_SIZE) / PAGE_SIZE;
    u64 run = mix64(rdtsc() ^ (r->cfg.seed * 0x2545F4914F6CDD1DUL));
    u64 *w = (u64 *)disk.buf;
    u64 seq = 0;
    for (;;) {
        for (int i = 0; i < 4; i++) {
            if (i == 0 || seq == 0) {
                seq++;
                u64 block = block_of(seq, 0, n);
                record_fill(w, run, seq, block, 0, n);
                disk_write(block * PAGE_SIZE, w, PAGE_SIZE);
                r->progress.ack = seq;
                r->progress.ops++;
                if (seq % 64 == 0)
                    disk_flush();
                disk_progress(r, 0, PAGE_SIZE);
            } else {
                /* A record of the last n writes: its block holds it still. */
                u64 window = seq < n ? seq : n;
                u64 j = seq - rng_below(&r->rng, window);
                u64 block = block_of(j, 0, n);
                disk_read(block * PAGE_SIZE, w, PAGE_SIZE);
                record_verify(w, run, j, block, 0, n);
                r->progress.ops++;
                disk_progress(r, PAGE_SIZE, 0);
            }
        }
        if (seq % n == 0)
            r->progress.pass++;
    }
}

/* Status of a malformed request: the byte the device wrote, or 0xFF. */
static u8 bad_request(u32 type, u64 sector, struct desc data, int has_data, int status_writable, u32 *used_len)
{
    disk.header->type = type;
    disk.header->reserved = 0;
    disk.header->sector = sector;
    *disk.status = 0xFF;
    struct desc d[3];
    u16 n = 0;
    d[n++] = (struct desc){(u64)disk.header, sizeof(struct req_header), DESC_NEXT, 0};
    if (has_data)
        d[n++] = data;
    d[n++] = (struct desc){(u64)disk.status, 1, (u16)(status_writable ? DESC_WRITE : 0), 0};
    *used_len = disk_chain(d, n);
    return *disk.status;
}

void workload_disk_bad(struct run *r)
{
    disk_setup(r);
    r->progress.disk = 1;
    u64 buf = (u64)disk.buf;
    const u16 rw = DESC_NEXT | DESC_WRITE, ro = DESC_NEXT;
    struct {
        const char *what;
        u32 type;
        u64 sector;
        struct desc data;
        int has_data, status_writable;
        u8 want; /* 0xFF: no status written, nothing used */
    } cases[] = {
        {"read past the end", REQ_IN, disk.capacity / 512, {buf, 4096, rw, 0}, 1, 1, 1},
        {"unknown type", 99, 0, {0, 0, 0, 0}, 0, 1, 2},
        {"buffer outside memory", REQ_IN, 0, {1UL << 46, 4096, rw, 0}, 1, 1, 1},
        {"read into a read-only buffer", REQ_IN, 0, {buf, 4096, ro, 0}, 1, 1, 1},
        {"not whole sectors", REQ_IN, 0, {buf, 100, rw, 0}, 1, 1, 1},
        {"no writable status", REQ_IN, 0, {buf, 4096, rw, 0}, 1, 0, 0xFF},
    };
    struct line l = {.len = 0};
    line_str(&l, "tsubame-guest: disk-bad: refused");
    for (u64 i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        u32 used = 0;
        u8 got = bad_request(cases[i].type, cases[i].sector, cases[i].data, cases[i].has_data,
                             cases[i].status_writable, &used);
        if (got != cases[i].want || (cases[i].want == 0xFF && used != 0))
            guest_fail("disk-bad: the device answered a malformed request wrongly:", cases[i].what);
        line_str(&l, " [");
        line_str(&l, cases[i].what);
        line_str(&l, "]");
    }
    line_flush(&l);
    workload_disk_seq(r);
}
