//! Codec throughput against memcpy of the same batch of pages, in one run
//! (compare ratios, not bare numbers, across machines).
//! `cargo bench -p tsubame-codec -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;
use tsubame_codec::batch::{BatchCodec, BatchCompressor, BatchDecompressor};
use tsubame_codec::dedup::{DedupDecoder, DedupEncoder};
use tsubame_codec::superfasthash::{superfasthash_chunks, superfasthash_many};
use tsubame_codec::xbzrle::{Outcome, XbzrleDecoder, XbzrleEncoder};
use tsubame_codec::zero::{self, ZeroImpl};
use tsubame_codec::{rle, PAGE_SIZE};

/// Pages per batch, as the migration pipeline sends them.
const PAGES: usize = 1024;

type Page = [u8; PAGE_SIZE];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// kv-store-like values: printable bytes, every chunk distinct.
fn text_pages(seed: u64) -> Vec<Page> {
    let mut rng = Rng(seed | 1);
    (0..PAGES)
        .map(|_| {
            let mut page = [0u8; PAGE_SIZE];
            page.iter_mut().for_each(|b| *b = 0x20 + (rng.next() % 0x5F) as u8);
            page
        })
        .collect()
}

/// 512-byte segments of zeros, repeated words, text, and 256-byte chunks
/// from a small pool: something for every codec.
fn mixed_pages(seed: u64) -> Vec<Page> {
    let mut rng = Rng(seed | 1);
    let pool: Vec<u8> = (0..8 * 256).map(|_| rng.next() as u8).collect();
    (0..PAGES)
        .map(|p| {
            let mut page = [0u8; PAGE_SIZE];
            for (s, seg) in page.chunks_exact_mut(512).enumerate() {
                match (p + s) % 4 {
                    0 => {}
                    1 => {
                        let w = rng.next().to_le_bytes();
                        seg.chunks_exact_mut(8).for_each(|c| c.copy_from_slice(&w));
                    }
                    2 => seg.iter_mut().for_each(|b| *b = 0x20 + (rng.next() % 0x5F) as u8),
                    _ => {
                        for half in seg.chunks_exact_mut(256) {
                            let k = (rng.next() % 8) as usize * 256;
                            half.copy_from_slice(&pool[k..k + 256]);
                        }
                    }
                }
            }
            page
        })
        .collect()
}

fn records(pages: &[Page], mut encode: impl FnMut(usize, &Page, &mut Vec<u8>) -> bool) -> Vec<Vec<u8>> {
    pages
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut out = Vec::new();
            assert!(encode(i, p, &mut out), "page {i} did not encode");
            out
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let text = text_pages(1);
    let mixed = mixed_pages(2);
    let zeros = vec![[0u8; PAGE_SIZE]; PAGES];
    // `text` with four 8-byte writes per page.
    let mut changed = text.clone();
    let mut rng = Rng(3);
    for page in changed.iter_mut() {
        for _ in 0..4 {
            let at = (rng.next() as usize % (PAGE_SIZE / 8)) * 8;
            page[at..at + 8].copy_from_slice(&rng.next().to_le_bytes());
        }
    }

    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Bytes((PAGES * PAGE_SIZE) as u64));
    let mut out = Vec::with_capacity(2 * PAGE_SIZE);
    let mut page = [0u8; PAGE_SIZE];

    let mut dst = vec![[0u8; PAGE_SIZE]; PAGES];
    g.bench_function("memcpy", |b| b.iter(|| dst.copy_from_slice(black_box(&text))));

    g.bench_function("zero-detect", |b| b.iter(|| zeros.iter().filter(|p| zero::is_zero(black_box(p))).count()));
    for (name, imp) in [
        ("zero-detect-avx512", ZeroImpl::Avx512),
        ("zero-detect-avx2", ZeroImpl::Avx2),
        ("zero-detect-portable", ZeroImpl::Portable),
    ] {
        g.bench_function(name, |b| b.iter(|| zeros.iter().filter(|p| zero::is_zero_with(imp, black_box(p))).count()));
    }

    // XBZRLE hits: the cache holds one version, the page arrives as the
    // other (alternating, so every call is a hit with a few changes).
    let mut enc = XbzrleEncoder::new(64 << 20);
    for (i, p) in text.iter().enumerate() {
        enc.encode(i as u64, p, &mut out);
    }
    let mut flip = false;
    g.bench_function("xbzrle-encode-hit", |b| {
        b.iter(|| {
            flip = !flip;
            let set = if flip { &changed } else { &text };
            set.iter().enumerate().filter(|(i, p)| enc.encode(*i as u64, p, &mut out) == Outcome::Encoded).count()
        })
    });
    let hit_records = records(&changed, |i, p, o| tsubame_codec::xbzrle::encode_delta(&text[i], p, o, PAGE_SIZE - 1));
    let mut dec = XbzrleDecoder::new(64 << 20);
    for (i, p) in text.iter().enumerate() {
        dec.observe(i as u64, p);
    }
    g.bench_function("xbzrle-decode-hit", |b| {
        b.iter(|| hit_records.iter().enumerate().for_each(|(i, r)| dec.decode(i as u64, r, &mut page).unwrap()))
    });

    g.bench_function("rle-encode", |b| b.iter(|| mixed.iter().filter(|p| rle::encode(p, &mut out)).count()));
    let rle_records = records(&mixed, |_, p, o| rle::encode(p, o));
    eprintln!("rle: mixed batch {} -> {} bytes", PAGES * PAGE_SIZE, rle_records.iter().map(Vec::len).sum::<usize>());
    g.bench_function("rle-decode", |b| {
        b.iter(|| rle_records.iter().enumerate().for_each(|(i, r)| rle::decode(r, i as u64, &mut page).unwrap()))
    });
    g.bench_function("rle-encode-overflow", |b| b.iter(|| text.iter().filter(|p| rle::encode(p, &mut out)).count()));

    let starts: Vec<usize> = (0..16).map(|k| k * 256).collect();
    g.bench_function("superfasthash-simd", |b| {
        b.iter(|| text.iter().map(|p| superfasthash_many(p, &starts)[0]).fold(0, u32::wrapping_add))
    });
    g.bench_function("superfasthash-4-lanes", |b| {
        b.iter(|| {
            text.iter()
                .map(|p| {
                    let c: Vec<&[u8; 256]> = p.chunks_exact(256).map(|c| c.try_into().unwrap()).collect();
                    (0..4)
                        .map(|k| superfasthash_chunks([c[4 * k], c[4 * k + 1], c[4 * k + 2], c[4 * k + 3]])[0])
                        .sum::<u32>()
                })
                .fold(0, u32::wrapping_add)
        })
    });

    // Dedup misses: 16384 distinct chunks through a 1 MiB cache, so each
    // is evicted before it comes round again.
    let mut dedup = DedupEncoder::new(1 << 20);
    g.bench_function("dedup-encode-miss", |b| b.iter(|| text.iter().map(|p| dedup.encode(p, &mut out)).sum::<usize>()));
    let mut fresh = DedupEncoder::new(1 << 20);
    let miss_records = records(&text, |_, p, o| fresh.encode(p, o) == 0);
    let mut ddec = DedupDecoder::new(1 << 20);
    g.bench_function("dedup-decode-miss", |b| {
        b.iter(|| miss_records.iter().enumerate().for_each(|(i, r)| ddec.decode(i as u64, r, &mut page).unwrap()))
    });
    // Dedup hits: the mixed pages again through a warm 64 MiB cache.
    let mut dedup = DedupEncoder::new(64 << 20);
    let mut ddec = DedupDecoder::new(64 << 20);
    for (i, r) in records(&mixed, |_, p, o| {
        dedup.encode(p, o);
        true
    })
    .iter()
    .enumerate()
    {
        ddec.decode(i as u64, r, &mut page).unwrap();
    }
    g.bench_function("dedup-encode-hit", |b| b.iter(|| mixed.iter().map(|p| dedup.encode(p, &mut out)).sum::<usize>()));
    let hit_records = records(&mixed, |_, p, o| {
        dedup.encode(p, o);
        true
    });
    eprintln!(
        "dedup: mixed batch, warm cache {} -> {} bytes",
        PAGES * PAGE_SIZE,
        hit_records.iter().map(Vec::len).sum::<usize>()
    );
    g.bench_function("dedup-decode-hit", |b| {
        b.iter(|| hit_records.iter().enumerate().for_each(|(i, r)| ddec.decode(i as u64, r, &mut page).unwrap()))
    });

    let batch: Vec<u8> = mixed.iter().flatten().copied().collect();
    for codec in [BatchCodec::Lz4, BatchCodec::Zstd(1)] {
        let mut packer = BatchCompressor::new(codec);
        let mut unpacker = BatchDecompressor::default();
        let (mut packed, mut back) = (Vec::new(), Vec::new());
        g.bench_function(format!("{}-compress", codec.name()), |b| b.iter(|| packer.compress(&batch, &mut packed)));
        eprintln!("{}: mixed batch {} -> {} bytes", codec.name(), batch.len(), packed.len());
        g.bench_function(format!("{}-decompress", codec.name()), |b| {
            b.iter(|| unpacker.decompress(codec.id(), &packed, batch.len(), batch.len(), &mut back).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
