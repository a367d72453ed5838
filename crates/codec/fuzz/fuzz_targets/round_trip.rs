//! Pages built from the input go through the chooser with every codec;
//! each must decode to itself and the caches must stay equal.
//! Input: repeated `page index u8, op u8, bytes...`, one op per step.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tsubame_codec::{CodecList, Encoded, PageDecoder, PageEncoder, PAGE_SIZE};

fuzz_target!(|data: &[u8]| {
    let list: CodecList = "zero,xbzrle=16K,dedup=8K,rle".parse().unwrap();
    let (mut enc, mut dec) = (PageEncoder::new(&list), PageDecoder::new(&list));
    let mut pages = [[0u8; PAGE_SIZE]; 6];
    let mut out = Vec::new();
    for step in data.chunks(8) {
        let [which, op, rest @ ..] = step else { return };
        let index = usize::from(*which) % pages.len();
        let page = &mut pages[index];
        match op % 4 {
            // Write the rest of the step at an offset.
            0 => {
                let at = usize::from(*op) * 16 % (PAGE_SIZE - 8);
                page[at..at + rest.len()].copy_from_slice(rest);
            }
            1 => page.fill(0),
            // Copy one 256-byte chunk over another.
            2 => {
                let (src, dst) =
                    (usize::from(*op / 4 % 16) * 256, usize::from(rest.first().copied().unwrap_or(0) % 16) * 256);
                page.copy_within(src..src + 256, dst);
            }
            _ => page
                .iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = rest.get(i % rest.len().max(1)).copied().unwrap_or(0)),
        }
        let mut back = [0u8; PAGE_SIZE];
        match enc.encode(index as u64, page, &mut out) {
            Encoded::Zero => dec.observe_zero(index as u64),
            Encoded::Raw => {
                back = *page;
                dec.observe(index as u64, &back);
            }
            Encoded::Record(tag) => dec.decode(index as u64, tag, &out, &mut back).expect("own record decodes"),
        }
        assert_eq!(&back[..], &page[..]);
        assert!(enc.same_caches(&dec));
    }
});
