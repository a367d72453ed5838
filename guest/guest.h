/* tsubame test guest: shared declarations. Freestanding, no libc. */
#ifndef TSUBAME_GUEST_H
#define TSUBAME_GUEST_H

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long u64;
typedef long i64;
typedef unsigned long size_t;

#define DEBUG_PORT 0xE9
#define PAGE_SIZE 4096UL
#define MIB (1024UL * 1024UL)
#define GIB (1024UL * MIB)

/* Multiboot v1 info structure (the fields we read). */
struct mb_info {
    u32 flags;
    u32 mem_lower, mem_upper;
    u32 boot_device;
    u32 cmdline;
    u32 mods_count, mods_addr;
    u32 syms[4];
    u32 mmap_length, mmap_addr;
} __attribute__((packed));

struct mb_mmap_entry {
    u32 size; /* of the rest of the entry, not counting this field */
    u64 addr;
    u64 len;
    u32 type; /* 1 = available RAM */
} __attribute__((packed));

#define MB_INFO_CMDLINE (1u << 2)
#define MB_INFO_MMAP (1u << 6)

extern char _load_start[], _bss_end[];

/* One `rep outsb`: a whole line costs a single VM exit. */
static inline void debug_write(const char *buf, size_t len)
{
    __asm__ volatile("rep outsb"
                     : "+S"(buf), "+c"(len)
                     : "d"((u16)DEBUG_PORT)
                     : "memory");
}

static inline u64 rdtsc(void)
{
    u32 lo, hi;
    __asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
    return ((u64)hi << 32) | lo;
}

static inline void cpu_relax(void) { __asm__ volatile("pause"); }

/* Small formatting buffer: lines are built here and written at once. */
struct line {
    char buf[256];
    size_t len;
};

void line_str(struct line *l, const char *s);
void line_u64(struct line *l, u64 v);
void line_hex(struct line *l, u64 v);
void line_flush(struct line *l);

void *memset(void *dst, int c, size_t n);
void *memcpy(void *dst, const void *src, size_t n);
size_t strlen(const char *s);

#endif
