// Zero detection: one thread per 256-byte chunk. `is_zero` starts at 1 for
// every page (the host fills it); a thread that sees a non-zero word writes
// 0. Every writer writes the same value, so the order does not matter.
extern "C" __global__ void zero_detect(const u8* pages, u32 n, u32* is_zero) {
    u32 c = global_id();
    if (c >= n * CHUNKS) return;
    const u64* w = (const u64*)(pages + (u64)c * CHUNK);
    u64 acc = 0;
    for (u32 i = 0; i < CHUNK / 8; ++i) acc |= w[i];
    if (acc != 0) is_zero[c / CHUNKS] = 0;
}

// First phase of every batch: zero pages get their record, the others
// start as raw (4096 bytes) and not done.
extern "C" __global__ void batch_init(u32 n, const u32* is_zero, u8* tag, u32* len, u8* done) {
    u32 p = global_id();
    if (p >= n) return;
    if (is_zero[p]) {
        tag[p] = TAG_ZERO;
        len[p] = 0;
        done[p] = 1;
    } else {
        tag[p] = TAG_RAW;
        len[p] = PAGE;
        done[p] = 0;
    }
}
