//! On a GPU: the kernels against the CPU codecs on ≥ 10,000 pages of
//! random, structured and kv-like data, byte for byte, and round trips
//! both ways. Without a CUDA driver every test is skipped
//! (`tsubame_testkit::skip`), or fails under `TSUBAME_REQUIRE_GPU=1`.

mod common;

use common::*;
use tsubame_codec::{PageDecoder, PageEncoder, PAGE_SIZE};
use tsubame_gpu::nvcomp::{Compressed, Nvcomp, NvcompAlgo, NvcompBatch};
use tsubame_gpu::{cuda, GpuDecoder, GpuEncoder, GpuError, WaitPolicy};

#[test]
fn gpu_matches_the_cpu_codecs_on_10000_pages() {
    let Some(probe) = gpu(WaitPolicy::Blocking) else { return };
    println!("device: {}", probe.name());
    drop(probe);
    for (k, list) in lists().into_iter().enumerate() {
        for wait in [WaitPolicy::Spin, WaitPolicy::SleepMin, WaitPolicy::Blocking] {
            let mut cpu = PageEncoder::new(&list);
            cpu.keep_codecs_on();
            let mut cpu_dec = PageDecoder::new(&list);
            let mut enc = GpuEncoder::new(gpu(wait).unwrap(), &list, 1024).unwrap();
            let mut dec = GpuDecoder::new(gpu(wait).unwrap(), &list, 1024).unwrap();
            let mut pages = 0;
            for (round, (indices, data)) in workload(k as u64 + 11, 4000, 4).into_iter().enumerate() {
                let want = cpu_encode(&mut cpu, &indices, &data);
                let got = enc.encode_batch(&data, &indices).unwrap();
                if let Some(d) = first_difference(&want, &got) {
                    panic!("{list} {wait} round {round}: {d}");
                }
                assert_eq!(cpu_decode(&mut cpu_dec, &got), data, "{list} {wait}: CPU decode of GPU records");
                let back = dec.decode_batch(&want).unwrap();
                assert!(back == data, "{list} {wait}: GPU decode of CPU records");
                pages += indices.len();
            }
            assert!(pages >= 10_000, "{pages}");
            println!("{list} {wait}: {pages} pages identical, round trips ok");
        }
    }
    let _ = PAGE_SIZE;
}

/// nvCOMP's batched LZ4 and zstd on ≥ 10,000 mixed pages, one page per
/// chunk, in calls of 1024 chunks: each chunk decodes on the CPU (LZ4 as a
/// raw block with lz4_flex, zstd as a frame with libzstd) to its page, and
/// the GPU's round trip gives the pages back. Skipped without a driver;
/// with one, a missing libnvcomp fails under `TSUBAME_REQUIRE_GPU`.
#[test]
fn nvcomp_lz4_and_zstd_round_trip_10000_pages_and_decode_on_the_cpu() {
    if !cuda::driver_present() {
        tsubame_testkit::skip_unless_required("TSUBAME_REQUIRE_GPU", "no CUDA driver");
        return;
    }
    let nvcomp = match Nvcomp::load() {
        Ok(n) => n,
        Err(e) => {
            tsubame_testkit::skip_unless_required("TSUBAME_REQUIRE_GPU", e);
            return;
        }
    };
    println!("nvCOMP {} at {}", nvcomp.version_string(), nvcomp.path.display());
    for algo in NvcompAlgo::ALL {
        let mut batch = NvcompBatch::open(&nvcomp, algo, 0, 1024, PAGE_SIZE).unwrap_or_else(|e| panic!("{algo}: {e}"));
        let (mut pages, mut original, mut compressed) = (0, 0, 0);
        let mut last = None;
        for (round, (_, data)) in workload(29, 4000, 4).into_iter().enumerate() {
            let c = batch.compress(&data).unwrap_or_else(|e| panic!("{algo} round {round}: {e}"));
            assert_eq!(c.len(), data.len() / PAGE_SIZE, "{algo} round {round}");
            for (i, (chunk, page)) in c.chunks().zip(data.chunks_exact(PAGE_SIZE)).enumerate() {
                let cpu = match algo {
                    NvcompAlgo::Lz4 => lz4_flex::block::decompress(chunk, PAGE_SIZE).map_err(|e| e.to_string()),
                    NvcompAlgo::Zstd => zstd::bulk::decompress(chunk, PAGE_SIZE).map_err(|e| e.to_string()),
                };
                let cpu =
                    cpu.unwrap_or_else(|e| panic!("{algo} round {round} chunk {i}: the CPU cannot decode it: {e}"));
                assert!(cpu == page, "{algo} round {round} chunk {i}: the CPU decodes other bytes");
            }
            let back = batch.decompress(&c).unwrap_or_else(|e| panic!("{algo} round {round}: {e}"));
            assert!(back == data, "{algo} round {round}: the GPU round trip differs");
            pages += c.len();
            original += data.len();
            compressed += c.compressed_bytes();
            last = Some(c);
        }
        assert!(pages >= 10_000, "{pages}");
        println!(
            "nvCOMP {algo} on {}: {pages} pages, ratio {:.3}, CPU decodes every chunk, round trips ok",
            batch.device_name(),
            compressed as f64 / original as f64
        );
        // What the host refuses before any device work.
        let c = last.unwrap();
        let other = if algo == NvcompAlgo::Lz4 { NvcompAlgo::Zstd } else { NvcompAlgo::Lz4 };
        assert!(matches!(batch.decompress(&Compressed { algo: other, ..c.clone() }), Err(GpuError::BadBatch(_))));
        let mut too_long = Compressed::new(algo, PAGE_SIZE);
        too_long.data = vec![0; batch.max_compressed_chunk_bytes() + 1];
        too_long.offsets.push(too_long.data.len());
        assert!(matches!(batch.decompress(&too_long), Err(GpuError::BadBatch(_))));
        assert!(matches!(batch.compress(&[0; 100]), Err(GpuError::BadBatch(_))));
        assert!(batch.compress(&[]).unwrap().is_empty());
    }
}
