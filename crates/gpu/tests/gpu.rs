//! On a GPU: the kernels against the CPU codecs on ≥ 10,000 pages of
//! random, structured and kv-like data, byte for byte, and round trips
//! both ways. Without a CUDA driver every test is skipped
//! (`tsubame_testkit::skip`), or fails under `TSUBAME_REQUIRE_GPU=1`.

mod common;

use common::*;
use tsubame_codec::{PageDecoder, PageEncoder, PAGE_SIZE};
use tsubame_gpu::{cuda, Cuda, CudaOptions, GpuDecoder, GpuEncoder, WaitPolicy};

fn gpu(wait: WaitPolicy) -> Option<Cuda> {
    if !cuda::driver_present() {
        tsubame_testkit::skip_unless_required("TSUBAME_REQUIRE_GPU", "no CUDA driver");
        return None;
    }
    Some(Cuda::open(CudaOptions { wait, ..Default::default() }).unwrap_or_else(|e| panic!("{e}")))
}

#[test]
fn gpu_matches_the_cpu_codecs_on_10000_pages() {
    let Some(probe) = gpu(WaitPolicy::Blocking) else { return };
    println!("device: {}", probe.name());
    drop(probe);
    for (k, list) in lists().into_iter().enumerate() {
        for wait in [WaitPolicy::Spin, WaitPolicy::SleepMin, WaitPolicy::Blocking] {
            let mut cpu = PageEncoder::new(&list);
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
