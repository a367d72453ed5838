//! The CUDA kernels, run on the host by the emulator, against the CPU
//! codecs: byte-identical records and round trips both ways (GPU encoder
//! → CPU decoder, CPU encoder → GPU decoder). Runs everywhere.

mod common;

/// True when the emulator was built; otherwise the test is skipped (it
/// fails where the set-up installed a C++ compiler: TSUBAME_REQUIRE_TOOLS).
fn emulator_or_skip() -> bool {
    if tsubame_gpu::emu::available() {
        return true;
    }
    tsubame_testkit::skip_unless_required(
        "TSUBAME_REQUIRE_TOOLS",
        "the GPU kernel emulator was not built (no C++ compiler)",
    );
    false
}

use common::recorded::{identical_to_cpu, same_every_time};
use common::*;
use tsubame_codec::{PageDecoder, PageEncoder, PAGE_SIZE, TAG_RLE, TAG_XBZRLE};
use tsubame_gpu::{kernels, Emulator, GpuDecoder, GpuEncoder, GpuError};

#[test]
fn every_kernel_has_an_emulator_trampoline_and_a_name_in_the_list() {
    if !emulator_or_skip() {
        return;
    }
    let declared = kernels::declared();
    assert_eq!(declared, kernels::KERNELS.to_vec());
    assert_eq!(tsubame_gpu::emu::kernel_names(), declared);
}

#[test]
fn emulated_kernels_match_the_cpu_codecs_byte_for_byte() {
    if !emulator_or_skip() {
        return;
    }
    for (k, list) in lists().into_iter().enumerate() {
        let mut cpu = PageEncoder::new(&list);
        let mut cpu_dec = PageDecoder::new(&list);
        // Batches of 64 pages: several per round, so caches carry over.
        let mut gpu = GpuEncoder::new(Emulator::new(2), &list, 64).unwrap();
        let mut gpu_dec = GpuDecoder::new(Emulator::new(1), &list, 64).unwrap();
        let mut pages_seen = 0;
        let mut tags = [0usize; 6];
        for (round, (indices, data)) in workload(k as u64 + 7, 300, 4).into_iter().enumerate() {
            let want = cpu_encode(&mut cpu, &indices, &data);
            let got = gpu.encode_batch(&data, &indices).unwrap();
            if let Some(d) = first_difference(&want, &got) {
                panic!("list {list}, round {round}: {d}");
            }
            assert_eq!(got.data, want.data);
            // GPU records decode on the CPU, and on the GPU.
            assert_eq!(cpu_decode(&mut cpu_dec, &got), data, "list {list}: CPU decode");
            let back = gpu_dec.decode_batch(&want).unwrap();
            if let Some(i) = (0..indices.len())
                .find(|&i| back[i * PAGE_SIZE..(i + 1) * PAGE_SIZE] != data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE])
            {
                panic!(
                    "list {list}, round {round}: GPU decode differs at record {i} (page {}, tag {})",
                    indices[i], want.tags[i]
                );
            }
            got.tags.iter().for_each(|&t| tags[t as usize] += 1);
            pages_seen += indices.len();
        }
        assert!(pages_seen > 800, "{pages_seen}");
        if list.xbzrle.is_some_and(|b| b >= 1 << 20) {
            assert!(tags[TAG_XBZRLE as usize] > 50, "list {list}: xbzrle hits {tags:?}");
        }
        if list.rle && list.dedup.is_none() {
            assert!(tags[TAG_RLE as usize] > 50, "list {list}: rle records {tags:?}");
        }
    }
}

#[test]
fn hostile_records_fail_cleanly_on_the_gpu_decoder() {
    if !emulator_or_skip() {
        return;
    }
    let list = "zero,xbzrle=64K,dedup=16K,rle".parse().unwrap();
    // A decoder that has failed has undefined caches: a fresh one each time.
    let bad = |tag: u8, rec: &[u8]| {
        let mut dec = GpuDecoder::new(Emulator::new(1), &list, 16).unwrap();
        let mut b = tsubame_gpu::EncodedBatch::default();
        b.push(17, tag, rec);
        match dec.decode_batch(&b) {
            Err(GpuError::Codec(e)) => e.to_string(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(bad(TAG_RLE, &[]), "rle record for page 17 is truncated");
    assert_eq!(bad(TAG_RLE, &[0x83, 0x08]), "rle record for page 17 overruns the page at offset 4104");
    assert_eq!(bad(TAG_RLE, &[0x81, 0x08, 0]), "rle record for page 17 has 1 trailing bytes");
    assert_eq!(bad(TAG_XBZRLE, &[]), "xbzrle record for page 17 refers to a cache entry this side does not hold");
    assert_eq!(bad(0, &[0; 100]), "raw record for page 17 is truncated");
    assert_eq!(bad(5, &[0xFF, 0xFF]), "dedup record for page 17 is truncated");
    let mut refs = vec![0xFF, 0xFF];
    (0..16).for_each(|_| refs.extend_from_slice(&u32::MAX.to_le_bytes()));
    assert_eq!(bad(5, &refs), "dedup record for page 17 refers to a cache entry this side does not hold");
    assert_eq!(bad(2, &[]), "page 17 uses codec tag 2, which this stream did not enable");
    let _ = PAGE_SIZE;
}

#[test]
fn the_gpu_checks_helpers_pass_on_the_emulator() {
    if !emulator_or_skip() {
        return;
    }
    // The byte-identity and race checks the GPU check runs on recorded
    // pages, here on a few synthetic ones (two trials: the emulator runs
    // one thread at a time, so it cannot race).
    let list = "zero,xbzrle=64K,dedup=16K,rle".parse().unwrap();
    let batches = workload(5, 200, 2);
    let mut encoder = GpuEncoder::new(Emulator::new(2), &list, 64).unwrap();
    let mut decoder = GpuDecoder::new(Emulator::new(1), &list, 64).unwrap();
    let (_, pages) = identical_to_cpu(&mut encoder, &mut decoder, &list, &batches).unwrap();
    assert!(pages >= 300, "{pages}");
    same_every_time(&mut Emulator::new(2), &list, &batches, 64, 2).unwrap();
}
