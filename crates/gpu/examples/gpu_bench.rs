//! GPU vs one CPU core: encode and decode GB/s (host↔device copies
//! included) per codec list, and CPU-seconds per GB for each wait policy.
//!
//! cargo run --release -p tsubame-gpu --example gpu_bench [-- PAGES]
//!
//! Prints one JSON object per line. Without a CUDA driver it prints
//! `skipped: no CUDA driver` and exits 0.

use std::time::Instant;

use tsubame_codec::{CodecList, Encoded, PageDecoder, PageEncoder, PAGE_SIZE};
use tsubame_gpu::{cuda, Cuda, CudaOptions, EncodedBatch, GpuDecoder, GpuEncoder, WaitPolicy};

/// This process's CPU seconds (user + system), from /proc/self/stat.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<u64> = rest.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    // After the command: state (not a number, dropped), then fields 4..; utime
    // and stime are the 14th and 15th fields overall.
    (f.get(10).copied().unwrap_or(0) + f.get(11).copied().unwrap_or(0)) as f64 / 100.0
}

fn data(pages: usize, round: u64) -> (Vec<u64>, Vec<u8>) {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ round;
    let mut out = vec![0u8; pages * PAGE_SIZE];
    for (i, p) in out.chunks_exact_mut(PAGE_SIZE).enumerate() {
        match i % 4 {
            0 => {}
            1 => p
                .chunks_exact_mut(8)
                .enumerate()
                .for_each(|(j, w)| w.copy_from_slice(&((j / 64) as u64 + round).to_le_bytes())),
            2 => {
                for w in p.chunks_exact_mut(8).step_by(8) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    w.copy_from_slice(&x.to_le_bytes());
                }
            }
            _ => p.iter_mut().enumerate().for_each(|(j, b)| *b = (j as u64 * (i as u64 % 7 + 1) + round) as u8),
        }
    }
    ((0..pages as u64).collect(), out)
}

fn main() {
    let pages: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(65536);
    if !cuda::driver_present() {
        println!("skipped: no CUDA driver");
        return;
    }
    let rounds = 4;
    let gb = (pages * PAGE_SIZE * rounds) as f64 / 1e9;
    let inputs: Vec<_> = (0..rounds as u64).map(|r| data(pages, r)).collect();
    for spec in ["zero,rle", "zero,xbzrle,rle", "zero,xbzrle,dedup,rle", "dedup"] {
        let list: CodecList = spec.parse().unwrap();
        // One CPU core.
        let mut cpu = PageEncoder::new(&list);
        let (t0, c0) = (Instant::now(), cpu_seconds());
        let mut batches = Vec::new();
        for (idx, d) in &inputs {
            let mut b = EncodedBatch::default();
            let mut out = Vec::new();
            for (i, &index) in idx.iter().enumerate() {
                let page: &[u8; PAGE_SIZE] = d[i * PAGE_SIZE..(i + 1) * PAGE_SIZE].try_into().unwrap();
                match cpu.encode(index, page, &mut out) {
                    Encoded::Zero => b.push(index, 1, &[]),
                    Encoded::Raw => b.push(index, 0, page),
                    Encoded::Record(t) => b.push(index, t, &out),
                }
            }
            batches.push(b);
        }
        let (cpu_enc_s, cpu_enc_cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        let mut cpu_dec = PageDecoder::new(&list);
        let t0 = Instant::now();
        let mut page = [0u8; PAGE_SIZE];
        for b in &batches {
            for i in 0..b.len() {
                let (index, tag, rec) = b.record(i);
                cpu_dec.decode(index, tag, rec, &mut page).unwrap();
            }
        }
        let cpu_dec_s = t0.elapsed().as_secs_f64();
        for wait in [WaitPolicy::Spin, WaitPolicy::SleepMin, WaitPolicy::Blocking] {
            let open = || Cuda::open(CudaOptions { wait, ..Default::default() }).unwrap();
            let mut enc = GpuEncoder::new(open(), &list, 1024).unwrap();
            let mut dec = GpuDecoder::new(open(), &list, 1024).unwrap();
            let device = enc.backend().name().to_string();
            let (t0, c0) = (Instant::now(), cpu_seconds());
            let mut same = true;
            for ((idx, d), want) in inputs.iter().zip(&batches) {
                same &= enc.encode_batch(d, idx).unwrap() == *want;
            }
            let (enc_s, enc_cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
            let (t0, c0) = (Instant::now(), cpu_seconds());
            for ((_, d), b) in inputs.iter().zip(&batches) {
                same &= dec.decode_batch(b).unwrap() == *d;
            }
            let (dec_s, dec_cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
            println!(
                "{{\"device\":\"{device}\",\"codecs\":\"{spec}\",\"wait\":\"{wait}\",\"gb\":{gb:.3},\"identical\":{same},\
                 \"cpu_encode_gbps\":{:.3},\"cpu_decode_gbps\":{:.3},\"gpu_encode_gbps\":{:.3},\"gpu_decode_gbps\":{:.3},\
                 \"encode_speedup\":{:.2},\"cpu_s_per_gb_cpu_codecs\":{:.3},\"cpu_s_per_gb_gpu_encode\":{:.3},\"cpu_s_per_gb_gpu_decode\":{:.3}}}",
                gb / cpu_enc_s,
                gb / cpu_dec_s,
                gb / enc_s,
                gb / dec_s,
                cpu_enc_s / enc_s,
                cpu_enc_cpu / gb,
                enc_cpu / gb,
                dec_cpu / gb,
            );
        }
    }
}
