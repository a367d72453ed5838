//! Random lz4/zstd batches. Input: compressor u8, claimed length u32 LE,
//! bytes; the cap is 1 MiB.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tsubame_codec::batch::BatchDecompressor;

fuzz_target!(|data: &[u8]| {
    if data.len() < 5 {
        return;
    }
    let len = u32::from_le_bytes(data[1..5].try_into().unwrap()) as usize;
    let mut out = Vec::new();
    let _ = BatchDecompressor::default().decompress(data[0], &data[5..], len, 1 << 20, &mut out);
    assert!(out.len() <= 1 << 20);
});
