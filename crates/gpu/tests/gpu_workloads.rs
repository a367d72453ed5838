//! On a GPU: the kernels against the CPU codecs on pages recorded from
//! every guest workload (`TSUBAME_GPU_PAGES`: the folder
//! bench/device/gpu_prepare.sh fills), and the race check: each codec
//! list's kernels, run many times over the same input, must give the same
//! bytes every time. Without a CUDA driver both are skipped, or fail under
//! `TSUBAME_REQUIRE_GPU=1`.

mod common;

use common::recorded::{identical_to_cpu, recorded, same_every_time};
use common::*;
use tsubame_codec::CodecList;
use tsubame_gpu::{GpuDecoder, GpuEncoder, WaitPolicy};

/// The synthetic lists, and every codec the CPU chooser can pick at once.
fn workload_lists() -> Vec<CodecList> {
    let mut all = lists();
    all.push("zero,xbzrle=4M,dedup=1M,rle".parse().unwrap());
    all
}

#[test]
fn gpu_matches_the_cpu_codecs_on_every_workloads_pages() {
    let Some(mut encode_gpu) = gpu(WaitPolicy::Blocking) else { return };
    let Some(dir) = std::env::var_os("TSUBAME_GPU_PAGES") else {
        tsubame_testkit::skip_unless_required(
            "TSUBAME_REQUIRE_GPU",
            "TSUBAME_GPU_PAGES is unset (bench/device/gpu_prepare.sh records the workloads' pages)",
        );
        return;
    };
    let mut decode_gpu = gpu(WaitPolicy::Blocking).unwrap();
    let workloads = recorded(std::path::Path::new(&dir));
    let mut failures = Vec::new();
    for (name, batches) in &workloads {
        for list in workload_lists() {
            let mut encoder = GpuEncoder::new(&mut encode_gpu, &list, 1024).unwrap();
            let mut decoder = GpuDecoder::new(&mut decode_gpu, &list, 1024).unwrap();
            match identical_to_cpu(&mut encoder, &mut decoder, &list, batches) {
                Ok((records, pages)) => {
                    let mut tags = [0usize; 8];
                    records.iter().flat_map(|b| b.tags.iter()).for_each(|&t| tags[usize::from(t).min(7)] += 1);
                    println!("{name} {list}: {pages} pages identical, round trips ok (records per tag {tags:?})");
                }
                Err(e) => {
                    println!("{name}: FAILED {e}");
                    failures.push(format!("{name}: {e}"));
                }
            }
        }
    }
    assert!(workloads.len() >= 8, "{} workloads recorded", workloads.len());
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn every_kernel_gives_the_same_bytes_on_every_run() {
    if gpu(WaitPolicy::Blocking).is_none() {
        return;
    }
    let trials = std::env::var("TSUBAME_RACE_TRIALS").ok().and_then(|t| t.parse().ok()).unwrap_or(100);
    for (k, list) in workload_lists().into_iter().enumerate() {
        // A fresh device per list: each trial's caches stay allocated
        // until the device is dropped.
        let mut device = gpu(WaitPolicy::Blocking).unwrap();
        let batches = workload(k as u64 + 31, 2000, 3);
        same_every_time(&mut device, &list, &batches, 1024, trials).unwrap_or_else(|e| panic!("{e}"));
        println!("{list}: {trials} runs of 3 batches of ~2000 pages, every record and page identical");
    }
}
