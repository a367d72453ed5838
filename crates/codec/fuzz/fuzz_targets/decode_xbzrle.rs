//! Random XBZRLE records against a cached page.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tsubame_codec::xbzrle::XbzrleDecoder;
use tsubame_codec::PAGE_SIZE;

fuzz_target!(|data: &[u8]| {
    let mut dec = XbzrleDecoder::new(4 * PAGE_SIZE);
    dec.observe(1, &[0x5A; PAGE_SIZE]);
    let mut out = [0u8; PAGE_SIZE];
    let _ = dec.decode(1, data, &mut out);
    let _ = dec.decode(2, data, &mut out);
});
