//! Random dedup records against a small chunk cache, twice, so the
//! second sees what the first inserted.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tsubame_codec::dedup::DedupDecoder;
use tsubame_codec::PAGE_SIZE;

fuzz_target!(|data: &[u8]| {
    let mut dec = DedupDecoder::new(16 * 256);
    let mut out = [0u8; PAGE_SIZE];
    let _ = dec.decode(0, data, &mut out);
    let _ = dec.decode(1, data, &mut out);
});
