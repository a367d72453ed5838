//! GPU vs one CPU core: encode and decode GB/s (host↔device copies
//! included) per codec list, and CPU-seconds per GB for each wait policy.
//!
//! cargo run --release -p tsubame-gpu --example gpu_bench [-- PAGES [--nvcomp-only]]
//!
//! Prints one JSON object per line. Without a CUDA driver it prints
//! `skipped: no CUDA driver` and exits 0.
//!
//! Then nvCOMP's batched LZ4 and zstd on the same pages, one line each
//! (`{"nvcomp":"lz4",...}`): GB/s both ways with the copies, compression
//! alone on the device, one CPU core (lz4_flex blocks, zstd level 1 frames,
//! one per page) and the ratio. Without libnvcomp each line is
//! `{"nvcomp":"lz4","skipped":"<why>"}` and the exit status stays 0; a
//! failure on the GPU prints `"error"` instead and exits 1. `--nvcomp-only`
//! prints only these (a process of their own: a fault of our kernels
//! would poison the context nvCOMP shares).

use std::time::Instant;

use tsubame_codec::{CodecList, Encoded, PageDecoder, PageEncoder, PAGE_SIZE};
use tsubame_gpu::nvcomp::{Nvcomp, NvcompAlgo, NvcompBatch};
use tsubame_gpu::{cuda, Backend, Cuda, CudaOptions, EncodedBatch, GpuDecoder, GpuEncoder, GpuError, WaitPolicy};

/// This process's CPU seconds (user + system), from /proc/self/stat.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // After the command's closing parenthesis: state, then fields 4..;
    // utime and stime are fields 14 and 15 (indices 11 and 12 here).
    // Counted by position: tpgid is -1 without a terminal, so parsing every
    // field as a number would shift them.
    let f: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let field = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    (field(11) + field(12)) as f64 / 100.0
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
    let specs = ["zero,rle", "zero,xbzrle,rle", "zero,xbzrle,dedup,rle", "dedup"];
    let nvcomp_only = std::env::args().any(|a| a == "--nvcomp-only");
    for spec in if nvcomp_only { &specs[..0] } else { &specs[..] } {
        let list: CodecList = spec.parse().unwrap();
        // One CPU core.
        let mut cpu = PageEncoder::new(&list);
        cpu.keep_codecs_on(); // as the GPU does: the same records
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
            let RoundTrip { same, enc_s, enc_cpu, dec_s, dec_cpu } = round_trip(&mut enc, &mut dec, &inputs, &batches);
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
        for batch in [1024, 4096] {
            profile_line(spec, &list, &inputs, &batches, batch, cpu_enc_s, gb);
        }
    }
    if !nvcomp_lines(&inputs, gb) {
        std::process::exit(1);
    }
}

/// One pass of the GPU both ways over the inputs: seconds and CPU-seconds
/// each way, and whether every record and page came out as `want`.
struct RoundTrip {
    same: bool,
    enc_s: f64,
    enc_cpu: f64,
    dec_s: f64,
    dec_cpu: f64,
}

fn round_trip<B: Backend>(
    enc: &mut GpuEncoder<B>,
    dec: &mut GpuDecoder<B>,
    inputs: &[(Vec<u64>, Vec<u8>)],
    want: &[EncodedBatch],
) -> RoundTrip {
    // Compared after the clock stops: a comparison of 1 GiB is host time
    // the GPU path would not spend.
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let encoded: Vec<_> = inputs.iter().map(|(idx, d)| enc.encode_batch(d, idx).unwrap()).collect();
    let (enc_s, enc_cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
    let mut same = encoded == want;
    drop(encoded);
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let decoded: Vec<_> = want.iter().map(|b| dec.decode_batch(b).unwrap()).collect();
    let (dec_s, dec_cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
    same &= decoded.iter().zip(inputs).all(|(p, (_, d))| p == d);
    RoundTrip { same, enc_s, enc_cpu, dec_s, dec_cpu }
}

/// Where the time goes with `batch` pages per submit: each kernel and copy
/// timed on the device, the host's staging copies and waits; the kernels'
/// own throughput (the pages already on the device) against one CPU core.
fn profile_line(
    spec: &str,
    list: &CodecList,
    inputs: &[(Vec<u64>, Vec<u8>)],
    want: &[EncodedBatch],
    batch: usize,
    cpu_enc_s: f64,
    gb: f64,
) {
    let open = || {
        Cuda::open(CudaOptions { wait: WaitPolicy::Blocking, max_pages: batch, profile: true, ..Default::default() })
    };
    let (mut enc, mut dec) = match (open(), open()) {
        (Ok(a), Ok(b)) => (GpuEncoder::new(a, list, batch).unwrap(), GpuDecoder::new(b, list, batch).unwrap()),
        (Err(e), _) | (_, Err(e)) => return println!("{{\"profile\":\"{spec}\",\"error\":\"{e}\"}}"),
    };
    let RoundTrip { same, enc_s, dec_s, .. } = round_trip(&mut enc, &mut dec, inputs, want);
    let (ep, dp) = (enc.backend().profile().unwrap(), dec.backend().profile().unwrap());
    println!(
        "{{\"profile\":\"{spec}\",\"batch_pages\":{batch},\"identical\":{same},\"encode_gbps\":{:.3},\"decode_gbps\":{:.3},\
         \"encode_kernel_gbps\":{:.3},\"encode_kernel_speedup\":{:.2},\"decode_kernel_gbps\":{:.3},\"encode\":{},\"decode\":{}}}",
        gb / enc_s,
        gb / dec_s,
        gb / ep.kernel_seconds(),
        cpu_enc_s / ep.kernel_seconds(),
        gb / dp.kernel_seconds(),
        ep.to_json(),
        dp.to_json(),
    );
}

/// nvCOMP's shapes: (chunk bytes, chunks per call). One page per chunk,
/// 64 MiB per call (nvCOMP's own best case); and a pipeline batch (1024
/// pages, 4 MiB) in 64-KiB chunks per call, as the migration would hand
/// it over.
const NVCOMP_SHAPES: [(usize, usize); 2] = [(PAGE_SIZE, 16384), (65536, 64)];

/// A string as a JSON string's contents.
fn json_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// nvCOMP's lines; false when one failed on the GPU.
fn nvcomp_lines(inputs: &[(Vec<u64>, Vec<u8>)], gb: f64) -> bool {
    let nvcomp = match Nvcomp::load() {
        Ok(n) => n,
        Err(e) => {
            for algo in NvcompAlgo::ALL {
                println!("{{\"nvcomp\":\"{algo}\",\"skipped\":\"{}\"}}", json_escape(&e.to_string()));
            }
            return true;
        }
    };
    let mut ok = true;
    for (chunk_bytes, chunks) in NVCOMP_SHAPES {
        for algo in NvcompAlgo::ALL {
            match nvcomp_line(&nvcomp, algo, inputs, gb, chunk_bytes, chunks) {
                Ok(line) => println!("{line}"),
                Err(e) => {
                    ok = false;
                    println!(
                        "{{\"nvcomp\":\"{algo}\",\"chunk_bytes\":{chunk_bytes},\"error\":\"{}\"}}",
                        json_escape(&e.to_string())
                    );
                }
            }
        }
    }
    ok
}

fn nvcomp_line(
    nvcomp: &Nvcomp,
    algo: NvcompAlgo,
    inputs: &[(Vec<u64>, Vec<u8>)],
    gb: f64,
    chunk_bytes: usize,
    chunks: usize,
) -> Result<String, GpuError> {
    let mut batch = NvcompBatch::open(nvcomp, algo, 0, chunks, chunk_bytes)?;
    let call_bytes = chunks * chunk_bytes;
    let device = json_escape(batch.device_name());
    // One untimed call each way (first-call costs).
    let first = &inputs[0].1;
    let warm = &first[..first.len().min(call_bytes)];
    let c = batch.compress(warm)?;
    let mut same = batch.decompress(&c)? == warm;
    let t0 = Instant::now();
    let mut packed = Vec::new();
    for (_, d) in inputs {
        for call in d.chunks(call_bytes) {
            packed.push(batch.compress(call)?);
        }
    }
    let compress_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let calls = inputs.iter().flat_map(|(_, d)| d.chunks(call_bytes));
    for (call, c) in calls.zip(&packed) {
        same &= batch.decompress(c)? == call;
    }
    let decompress_s = t0.elapsed().as_secs_f64();
    // The device alone: the input already resident, the compress call and
    // the stream's synchronization timed.
    let mut kernel_s = 0.0;
    for (_, d) in inputs {
        for group in d.chunks(call_bytes) {
            let n = batch.stage(group)?;
            let t0 = Instant::now();
            batch.compress_staged(n)?;
            kernel_s += t0.elapsed().as_secs_f64();
        }
    }
    let compressed: usize = packed.iter().map(|c| c.compressed_bytes()).sum();
    let original: usize = packed.iter().map(|c| c.uncompressed_bytes()).sum();
    let (cpu_compress_s, cpu_decompress_s) = cpu_baseline(algo, inputs, chunk_bytes);
    Ok(format!(
        "{{\"nvcomp\":\"{algo}\",\"device\":\"{device}\",\"chunk_bytes\":{chunk_bytes},\"call_bytes\":{call_bytes},\"gb\":{gb:.3},\"identical\":{same},\"ratio\":{:.4},\
         \"compress_gbps\":{:.3},\"decompress_gbps\":{:.3},\"compress_kernel_gbps\":{:.3},\
         \"cpu_compress_gbps\":{:.3},\"cpu_decompress_gbps\":{:.3},\"speedup\":{:.2}}}",
        compressed as f64 / original as f64,
        gb / compress_s,
        gb / decompress_s,
        gb / kernel_s,
        gb / cpu_compress_s,
        gb / cpu_decompress_s,
        cpu_compress_s / compress_s,
    ))
}

/// One CPU core, one chunk at a time: lz4_flex raw blocks or zstd level-1
/// frames (one reused context each way). Seconds to compress, then to
/// decompress, every chunk of `inputs`.
fn cpu_baseline(algo: NvcompAlgo, inputs: &[(Vec<u64>, Vec<u8>)], chunk_bytes: usize) -> (f64, f64) {
    let mut buf = vec![0u8; 2 * chunk_bytes];
    let (mut data, mut ends) = (Vec::new(), Vec::new());
    let mut zc = zstd::bulk::Compressor::new(1).expect("a zstd context");
    let t0 = Instant::now();
    for (_, d) in inputs {
        for page in d.chunks_exact(chunk_bytes) {
            let n = match algo {
                NvcompAlgo::Lz4 => lz4_flex::block::compress_into(page, &mut buf).expect("lz4 compresses"),
                NvcompAlgo::Zstd => zc.compress_to_buffer(page, &mut buf[..]).expect("zstd compresses"),
            };
            data.extend_from_slice(&buf[..n]);
            ends.push(data.len());
        }
    }
    let compress_s = t0.elapsed().as_secs_f64();
    let mut zd = zstd::bulk::Decompressor::new().expect("a zstd context");
    let mut page = vec![0u8; chunk_bytes];
    let t0 = Instant::now();
    let mut start = 0;
    for &end in &ends {
        let n = match algo {
            NvcompAlgo::Lz4 => lz4_flex::block::decompress_into(&data[start..end], &mut page).expect("lz4 decodes"),
            NvcompAlgo::Zstd => zd.decompress_to_buffer(&data[start..end], &mut page[..]).expect("zstd decodes"),
        };
        assert_eq!(n, chunk_bytes);
        start = end;
    }
    (compress_s, t0.elapsed().as_secs_f64())
}
