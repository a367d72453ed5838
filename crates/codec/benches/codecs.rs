//! Codec throughput against memcpy of the same pages, in one run.
//! `cargo bench -p tsubame-codec -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;
use tsubame_codec::dedup::{DedupDecoder, DedupEncoder};
use tsubame_codec::xbzrle::{XbzrleDecoder, XbzrleEncoder};
use tsubame_codec::{rle, zero, PAGE};

const PAGES: usize = 1024;

fn pages(seed: u64) -> Vec<[u8; PAGE]> {
    let mut x = seed | 1;
    (0..PAGES)
        .map(|p| {
            let mut page = [0u8; PAGE];
            // kv-like: text-ish values with runs of structure.
            for (i, b) in page.iter_mut().enumerate() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = if i % 512 < 64 { (p + i) as u8 } else { 0x20 + (x as u8 & 0x3F) };
            }
            page
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let src = pages(1);
    let mut changed = src.clone();
    for (p, page) in changed.iter_mut().enumerate() {
        page[(p * 37) % PAGE] ^= 0xFF; // a few bytes per page change
        page[(p * 91) % PAGE] ^= 0x0F;
    }
    let zeros = vec![[0u8; PAGE]; PAGES];
    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Bytes((PAGES * PAGE) as u64));
    let mut dst = vec![[0u8; PAGE]; PAGES];
    g.bench_function("memcpy", |b| b.iter(|| dst.copy_from_slice(black_box(&src))));
    g.bench_function("zero-detect", |b| b.iter(|| zeros.iter().filter(|p| zero::is_zero(p)).count()));
    g.bench_function("zero-detect-portable", |b| b.iter(|| zeros.iter().filter(|p| zero::is_zero_portable(p)).count()));
    let mut out = Vec::with_capacity(2 * PAGE);
    g.bench_function("rle-encode", |b| b.iter(|| src.iter().map(|p| rle::encode(p, &mut out) as usize).sum::<usize>()));
    let rle_records: Vec<Vec<u8>> = src
        .iter()
        .map(|p| {
            let mut o = Vec::new();
            rle::encode(p, &mut o);
            o
        })
        .collect();
    g.bench_function("rle-decode", |b| {
        let mut page = [0u8; PAGE];
        b.iter(|| rle_records.iter().enumerate().filter(|(i, r)| rle::decode(r, *i as u64, &mut page).is_ok()).count())
    });
    // XBZRLE hits: the cache holds `src`, pages arrive as `changed`.
    let mut enc = XbzrleEncoder::new(64 << 20);
    for (i, p) in src.iter().enumerate() {
        enc.encode(i as u64, p, &mut out);
    }
    let mut flip = false;
    g.bench_function("xbzrle-encode-hit", |b| {
        b.iter(|| {
            flip = !flip;
            let set = if flip { &changed } else { &src };
            set.iter().enumerate().map(|(i, p)| enc.encode(i as u64, p, &mut out) as usize).sum::<usize>()
        })
    });
    let mut denc = XbzrleEncoder::new(64 << 20);
    let mut ddec = XbzrleDecoder::new(64 << 20);
    for (i, p) in src.iter().enumerate() {
        denc.encode(i as u64, p, &mut out);
        ddec.observe(i as u64, p);
    }
    let records: Vec<Vec<u8>> = changed
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut o = Vec::new();
            tsubame_codec::xbzrle::encode_delta(&src[i], p, &mut o, PAGE);
            let _ = &denc;
            o
        })
        .collect();
    g.bench_function("xbzrle-decode", |b| {
        let mut page = [0u8; PAGE];
        b.iter(|| {
            for (i, r) in records.iter().enumerate() {
                page.copy_from_slice(&src[i]);
                let _ = tsubame_codec::xbzrle::decode_delta(r, i as u64, &mut page);
            }
        })
    });
    let mut dedup = DedupEncoder::new(64 << 20);
    g.bench_function("dedup-encode", |b| b.iter(|| src.iter().map(|p| dedup.encode(p, &mut out)).sum::<usize>()));
    let mut fresh = DedupEncoder::new(64 << 20);
    let dedup_records: Vec<Vec<u8>> = src
        .iter()
        .map(|p| {
            let mut o = Vec::new();
            fresh.encode(p, &mut o);
            o
        })
        .collect();
    g.bench_function("dedup-decode", |b| {
        b.iter(|| {
            let mut dec = DedupDecoder::new(64 << 20);
            let mut page = [0u8; PAGE];
            dedup_records.iter().enumerate().filter(|(i, r)| dec.decode(*i as u64, r, &mut page).is_ok()).count()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
