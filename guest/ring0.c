/*
 * Ring-0 setup, run once before dropping to ring 3, and the exception path.
 * Ring 0 is emulated on PVM hosts (~1000x slower than ring 3), so this file
 * keeps its loops short: only page-table entries for RAM that exists.
 */
#include "guest.h"

extern u64 pdpt[512];
extern u64 pd_tables[64 * 512];
extern u64 idt[256 * 2];
extern u64 gdt_tss[2];
extern u32 mb_info;
extern char isr0[], isr1[], isr2[], isr3[], isr4[], isr5[], isr6[], isr7[];
extern char isr8[], isr9[], isr10[], isr11[], isr12[], isr13[], isr14[], isr15[];
extern char isr16[], isr17[], isr18[], isr19[], isr20[], isr21[], isr22[], isr23[];
extern char isr24[], isr25[], isr26[], isr27[], isr28[], isr29[], isr30[], isr31[];
extern char isr128[];

static char *const isr_table[32] = {
    isr0,  isr1,  isr2,  isr3,  isr4,  isr5,  isr6,  isr7,  isr8,  isr9,  isr10,
    isr11, isr12, isr13, isr14, isr15, isr16, isr17, isr18, isr19, isr20, isr21,
    isr22, isr23, isr24, isr25, isr26, isr27, isr28, isr29, isr30, isr31,
};

struct tss64 {
    u32 reserved0;
    u64 rsp0, rsp1, rsp2;
    u64 reserved1;
    u64 ist[7];
    u64 reserved2;
    u16 reserved3;
    u16 iomap_base;
    /* All ports allowed: some hypervisors check the bitmap even at IOPL 3. */
    u8 iomap[8192 + 1];
} __attribute__((packed));

static struct tss64 tss __attribute__((aligned(16)));
static u8 exception_stack[16384] __attribute__((aligned(16)));

#define MAX_GIB 64

static u64 highest_ram_address(const struct mb_info *mbi)
{
    u64 top = (u64)(mbi->mem_upper + 1024) * 1024;
    if (mbi->flags & MB_INFO_MMAP) {
        u64 p = mbi->mmap_addr, end = p + mbi->mmap_length;
        while (p < end) {
            const struct mb_mmap_entry *e = (const void *)p;
            if (e->type == 1 && e->addr + e->len > top)
                top = e->addr + e->len;
            p += e->size + 4;
        }
    }
    return top;
}

static void set_gate(int vector, const void *handler, int dpl)
{
    u64 off = (u64)handler;
    idt[vector * 2] = (off & 0xFFFF) | (0x08UL << 16) |
                      ((u64)(0x8E | (dpl << 5)) << 40) |
                      ((off >> 16) & 0xFFFF) << 48;
    idt[vector * 2 + 1] = off >> 32;
}

void ring0_setup(void)
{
    const struct mb_info *mbi = (const void *)(u64)mb_info;
    u64 gib = (highest_ram_address(mbi) + GIB - 1) / GIB;
    if (gib > MAX_GIB)
        gib = MAX_GIB;
    /* GiB 0 was mapped by the 32-bit entry code. */
    for (u64 g = 1; g < gib; g++) {
        u64 *pd = &pd_tables[g * 512];
        for (u64 i = 0; i < 512; i++)
            pd[i] = (g * GIB + i * 2 * MIB) | 0x87;
        pdpt[g] = (u64)pd | 0x7;
    }

    for (int v = 0; v < 32; v++)
        set_gate(v, isr_table[v], 0);
    set_gate(0x80, isr128, 3); /* ring 3 asks to stop */

    tss.rsp0 = (u64)exception_stack + sizeof(exception_stack);
    tss.iomap_base = (u16)((u64)&tss.iomap - (u64)&tss);
    tss.iomap[8192] = 0xFF; /* the bitmap's terminator */
    u64 base = (u64)&tss, limit = sizeof(tss) - 1;
    gdt_tss[0] = (limit & 0xFFFF) | ((base & 0xFFFFFF) << 16) | (0x89UL << 40) |
                 ((limit >> 16) & 0xF) << 48 | ((base >> 24) & 0xFF) << 56;
    gdt_tss[1] = base >> 32;
}

struct exception_frame {
    u64 vector, error, rip, cs, rflags, rsp, ss;
};

/* Print the fault (vector 0x80 is a clean stop) and halt for good. */
__attribute__((noreturn)) void exception_handler(struct exception_frame *f)
{
    if (f->vector != 0x80) {
        struct line l = {.len = 0};
        line_str(&l, "tsubame-guest: exception vector=");
        line_u64(&l, f->vector);
        line_str(&l, " rip=");
        line_hex(&l, f->rip);
        line_str(&l, " error=");
        line_hex(&l, f->error);
        line_str(&l, " rflags=");
        line_hex(&l, f->rflags);
        if (f->vector == 14) {
            u64 cr2;
            __asm__ volatile("mov %%cr2, %0" : "=r"(cr2));
            line_str(&l, " cr2=");
            line_hex(&l, cr2);
        }
        line_flush(&l);
    }
    for (;;)
        __asm__ volatile("cli; hlt");
}
