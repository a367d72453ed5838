//! Any record, any tag, through the stream decoder with every codec on
//! and warm caches: errors are fine, panics are not.
//! Input: tag u8, page index u8, record bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tsubame_codec::{CodecList, Encoded, PageDecoder, PageEncoder, PAGE_SIZE};

fn warm() -> PageDecoder {
    let list: CodecList = "zero,xbzrle=64K,dedup=64K,rle".parse().unwrap();
    let (mut enc, mut dec) = (PageEncoder::new(&list), PageDecoder::new(&list));
    let (mut out, mut back) = (Vec::new(), [0u8; PAGE_SIZE]);
    for i in 0..16u64 {
        let page: [u8; PAGE_SIZE] =
            std::array::from_fn(|b| if b % 512 < 256 { (b / 256) as u8 } else { (i * 7 + b as u64 / 64) as u8 });
        match enc.encode(i % 8, &page, &mut out) {
            Encoded::Record(tag) => dec.decode(i % 8, tag, &out, &mut back).unwrap(),
            Encoded::Raw => dec.observe(i % 8, &page),
            Encoded::Zero => dec.observe_zero(i % 8),
        }
    }
    dec
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let mut out = [0u8; PAGE_SIZE];
    let _ = warm().decode(u64::from(data[1] % 16), data[0] % 8, &data[2..], &mut out);
});
