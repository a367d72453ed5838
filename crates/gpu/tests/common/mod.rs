//! Test pages and the CPU reference, shared by the emulated and GPU tests.
#![allow(dead_code)]

pub mod recorded;

use tsubame_codec::{CodecList, Encoded, PageDecoder, PageEncoder, PAGE_SIZE};
use tsubame_gpu::{cuda, Cuda, CudaOptions, EncodedBatch, WaitPolicy};

/// The GPU, opened with `wait`; None (the test skipped) without a CUDA
/// driver, which fails it under `TSUBAME_REQUIRE_GPU=1`.
pub fn gpu(wait: WaitPolicy) -> Option<Cuda> {
    if !cuda::driver_present() {
        tsubame_testkit::skip_unless_required("TSUBAME_REQUIRE_GPU", "no CUDA driver");
        return None;
    }
    Some(Cuda::open(CudaOptions { wait, ..Default::default() }).unwrap_or_else(|e| panic!("{e}")))
}

/// A deterministic generator (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A page of one of several kinds: zero, random, structured (runs of equal
/// words, counters), kv-like (records with repeated keys and zero padding),
/// and chunk-repeating (for dedup).
pub fn page(rng: &mut Rng, kind: u64) -> Vec<u8> {
    let mut p = vec![0u8; PAGE_SIZE];
    match kind % 5 {
        0 => {}
        1 => p.iter_mut().for_each(|b| *b = rng.next() as u8),
        2 => {
            let mut w = rng.next();
            for (i, c) in p.chunks_exact_mut(8).enumerate() {
                if rng.below(8) == 0 {
                    w = if i % 2 == 0 { rng.next() } else { w.wrapping_add(8) };
                }
                c.copy_from_slice(&w.to_le_bytes());
            }
        }
        3 => {
            let mut at = 0;
            while at + 64 <= PAGE_SIZE {
                let key = rng.below(16);
                p[at..at + 8].copy_from_slice(&key.to_le_bytes());
                let vlen = 8 + rng.below(40) as usize;
                for b in &mut p[at + 8..at + 8 + vlen] {
                    *b = rng.next() as u8;
                }
                at += 64;
            }
        }
        _ => {
            let seeds: Vec<u64> = (0..3).map(|_| rng.below(4)).collect();
            for (i, c) in p.chunks_exact_mut(256).enumerate() {
                let s = seeds[i % 3] + 1;
                c.iter_mut().enumerate().for_each(|(j, b)| *b = (j as u64 * s) as u8);
            }
        }
    }
    p
}

/// Rounds of dirty pages: each round rewrites some pages a little (hits
/// for XBZRLE), some wholly, zeroes some; indices repeat across rounds and
/// sometimes within a batch.
pub fn workload(seed: u64, pages: usize, rounds: usize) -> Vec<(Vec<u64>, Vec<u8>)> {
    let mut rng = Rng(seed | 1);
    let mut memory: Vec<Vec<u8>> = (0..pages).map(|i| page(&mut rng, i as u64)).collect();
    let mut out = Vec::new();
    for round in 0..rounds {
        let mut indices: Vec<u64> = (0..pages as u64).filter(|_| round == 0 || rng.below(3) != 0).collect();
        if round > 0 {
            for _ in 0..4 {
                let i = rng.below(pages as u64);
                indices.push(i); // an index twice in one batch
            }
        }
        let mut data = Vec::new();
        for &i in &indices {
            let p = &mut memory[i as usize];
            match rng.below(6) {
                0 => {
                    let kind = rng.next();
                    *p = page(&mut rng, kind)
                }
                1 => p.fill(0),
                _ => {
                    for _ in 0..rng.below(20) {
                        let at = rng.below(PAGE_SIZE as u64) as usize;
                        p[at] = rng.next() as u8;
                    }
                }
            }
            data.extend_from_slice(p);
        }
        out.push((indices, data));
    }
    out
}

/// The CPU encoder's records for a batch.
pub fn cpu_encode(enc: &mut PageEncoder, indices: &[u64], pages: &[u8]) -> EncodedBatch {
    let mut b = EncodedBatch::default();
    let mut out = Vec::new();
    for (i, &index) in indices.iter().enumerate() {
        let page: &[u8; PAGE_SIZE] = pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE].try_into().unwrap();
        match enc.encode(index, page, &mut out) {
            Encoded::Zero => b.push(index, 1, &[]),
            Encoded::Raw => b.push(index, 0, page),
            Encoded::Record(tag) => b.push(index, tag, &out),
        }
    }
    b
}

/// The CPU decoder's pages for a batch.
pub fn cpu_decode(dec: &mut PageDecoder, b: &EncodedBatch) -> Vec<u8> {
    let mut pages = Vec::new();
    let mut page = [0u8; PAGE_SIZE];
    for i in 0..b.len() {
        let (index, tag, rec) = b.record(i);
        dec.decode(index, tag, rec, &mut page).unwrap();
        pages.extend_from_slice(&page);
    }
    pages
}

/// The first record where two batches differ, for a readable failure.
pub fn first_difference(a: &EncodedBatch, b: &EncodedBatch) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("{} vs {} records", a.len(), b.len()));
    }
    (0..a.len()).find(|&i| a.record(i) != b.record(i)).map(|i| {
        let (x, y) = (a.record(i), b.record(i));
        format!("record {i} (page {}): tag {} len {} vs tag {} len {}", x.0, x.1, x.2.len(), y.1, y.2.len())
    })
}

pub fn lists() -> Vec<CodecList> {
    ["zero,rle", "zero,xbzrle=64K,dedup=16K,rle", "xbzrle=1M", "dedup=8K", "zero,xbzrle,dedup,rle", "rle,dedup=1M"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect()
}
