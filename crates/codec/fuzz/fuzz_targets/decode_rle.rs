//! Random GM-RLE records.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tsubame_codec::{rle, PAGE_SIZE};

fuzz_target!(|data: &[u8]| {
    let mut out = [0u8; PAGE_SIZE];
    let _ = rle::decode(data, 0, &mut out);
});
