/* Freestanding helpers for the guest: text lines, memory, math. */
#include "guest.h"

void *memset(void *dst, int c, size_t n)
{
    void *d = dst;
    __asm__ volatile("rep stosb" : "+D"(d), "+c"(n) : "a"(c) : "memory");
    return dst;
}

void *memcpy(void *dst, const void *src, size_t n)
{
    void *d = dst;
    __asm__ volatile("rep movsb" : "+D"(d), "+S"(src), "+c"(n) : : "memory");
    return dst;
}

size_t strlen(const char *s)
{
    size_t n = 0;
    while (s[n])
        n++;
    return n;
}

void line_str(struct line *l, const char *s)
{
    while (*s && l->len < sizeof(l->buf) - 1)
        l->buf[l->len++] = *s++;
}

void line_u64(struct line *l, u64 v)
{
    char tmp[24];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n && l->len < sizeof(l->buf) - 1)
        l->buf[l->len++] = tmp[--n];
}

void line_hex(struct line *l, u64 v)
{
    line_str(l, "0x");
    char tmp[16];
    int n = 0;
    do {
        tmp[n++] = "0123456789abcdef"[v & 15];
        v >>= 4;
    } while (v);
    while (n && l->len < sizeof(l->buf) - 1)
        l->buf[l->len++] = tmp[--n];
}

void line_flush(struct line *l)
{
    l->buf[l->len++] = '\n';
    debug_write(l->buf, l->len);
    l->len = 0;
}
