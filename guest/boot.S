/*
 * tsubame test guest: ring-0 boot path.
 *
 * Entered by a multiboot v1 loader (tsubame or QEMU -kernel) in 32-bit
 * protected mode with paging off, EAX = 0x2BADB002 and EBX = the info struct.
 * Ring 0 on this machine is emulated (slow), so it does the least it can:
 * identity-map the first GiB, switch to long mode, load GDT/TSS/IDT, call
 * ring0_setup() (maps the rest of RAM, fills IDT and TSS), then iretq to
 * ring 3 where all real work runs.
 */

#define MB_MAGIC        0x1BADB002
#define MB_FLAGS        0x00010003 /* page-align, mem info, address fields */

#define KERNEL_CS       0x08
#define KERNEL_DS       0x10
#define USER_DS         0x1B
#define USER_CS         0x23
#define TSS_SEL         0x28

    .section .multiboot, "a"
    .align 4
mb_header:
    .long MB_MAGIC
    .long MB_FLAGS
    .long -(MB_MAGIC + MB_FLAGS)
    .long mb_header        /* header_addr */
    .long _load_start      /* load_addr */
    .long _load_end        /* load_end_addr */
    .long _bss_end         /* bss_end_addr */
    .long _start32         /* entry_addr */

    .section .text.boot, "ax"
    .code32
    .global _start32
_start32:
    cli
    cld
    movl %eax, mb_magic
    movl %ebx, mb_info
    movl $boot_stack_top, %esp

    /* PML4[0] -> PDPT, PDPT[0] -> PD0; PD0 maps 0..1 GiB with 2 MiB pages. */
    movl $pdpt, %eax
    orl $0x7, %eax
    movl %eax, pml4
    movl $pd_tables, %eax
    orl $0x7, %eax
    movl %eax, pdpt
    movl $pd_tables, %edi
    movl $0x87, %eax            /* present | writable | user | 2 MiB */
    movl $512, %ecx
1:  movl %eax, (%edi)
    movl $0, 4(%edi)
    addl $0x200000, %eax
    addl $8, %edi
    loop 1b

    /* PAE | OSFXSR | OSXMMEXCPT */
    movl %cr4, %eax
    orl $((1 << 5) | (1 << 9) | (1 << 10)), %eax
    movl %eax, %cr4
    movl $pml4, %eax
    movl %eax, %cr3
    /* EFER.LME */
    movl $0xC0000080, %ecx
    rdmsr
    orl $(1 << 8), %eax
    wrmsr
    /* PG | PE | MP, clear EM */
    movl %cr0, %eax
    andl $~(1 << 2), %eax
    orl $0x80000003, %eax
    movl %eax, %cr0

    lgdt gdt_ptr
    ljmp $KERNEL_CS, $start64

    .code64
start64:
    movw $KERNEL_DS, %ax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    xorw %ax, %ax
    movw %ax, %fs
    movw %ax, %gs
    movq $boot_stack_top, %rsp

    call ring0_setup            /* fills IDT, TSS descriptor, high map */
    lidt idt_ptr
    movw $TSS_SEL, %ax
    ltr %ax

    /* Drop to ring 3 with IOPL=3 so `out` to 0xE9 works from user mode. */
    pushq $USER_DS
    pushq $user_stack_top
    pushq $0x3002
    pushq $USER_CS
    pushq $user_entry
    iretq

user_entry:
    movw $USER_DS, %ax
    movw %ax, %ds
    movw %ax, %es
    movl mb_info, %edi
    call guest_main
    /* guest_main returned: ask ring 0 to stop. */
    int $0x80
2:  jmp 2b

/* Exception and stop entry points. Each pushes (error code, vector). */
.macro ISR_NOERR n
    .global isr\n
isr\n:
    pushq $0
    pushq $\n
    jmp isr_common
.endm
.macro ISR_ERR n
    .global isr\n
isr\n:
    pushq $\n
    jmp isr_common
.endm

    .align 16
ISR_NOERR 0
ISR_NOERR 1
ISR_NOERR 2
ISR_NOERR 3
ISR_NOERR 4
ISR_NOERR 5
ISR_NOERR 6
ISR_NOERR 7
ISR_ERR   8
ISR_NOERR 9
ISR_ERR   10
ISR_ERR   11
ISR_ERR   12
ISR_ERR   13
ISR_ERR   14
ISR_NOERR 15
ISR_NOERR 16
ISR_ERR   17
ISR_NOERR 18
ISR_NOERR 19
ISR_NOERR 20
ISR_ERR   21
ISR_NOERR 22
ISR_NOERR 23
ISR_NOERR 24
ISR_NOERR 25
ISR_NOERR 26
ISR_NOERR 27
ISR_NOERR 28
ISR_ERR   29
ISR_ERR   30
ISR_NOERR 31
ISR_NOERR 128

isr_common:
    movq %rsp, %rdi             /* struct exception_frame * */
    call exception_handler      /* never returns */
3:  cli
    hlt
    jmp 3b

    .section .data
    .align 16
gdt:
    .quad 0
    .quad 0x00AF9A000000FFFF    /* 0x08 kernel code, 64-bit */
    .quad 0x00CF92000000FFFF    /* 0x10 kernel data */
    .quad 0x00CFF2000000FFFF    /* 0x18 user data (DPL 3) */
    .quad 0x00AFFA000000FFFF    /* 0x20 user code, 64-bit (DPL 3) */
    .global gdt_tss
gdt_tss:
    .quad 0                     /* 0x28 TSS, filled by ring0_setup */
    .quad 0
gdt_end:
gdt_ptr:
    .word gdt_end - gdt - 1
    .quad gdt

    .align 16
idt_ptr:
    .word 256 * 16 - 1
    .quad idt

    .global mb_magic, mb_info
mb_magic: .long 0
mb_info:  .long 0

    .section .bss
    .align 4096
    .global pml4, pdpt, pd_tables, idt
pml4:      .skip 4096
pdpt:      .skip 4096
pd_tables: .skip 4096 * 64      /* one PD per GiB: RAM up to 64 GiB */
idt:       .skip 256 * 16
    .align 16
boot_stack: .skip 16384
boot_stack_top:
    .align 16
user_stack: .skip 65536
user_stack_top:
