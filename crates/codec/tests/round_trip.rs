//! One round-trip property for every codec: a sequence of pages with
//! mutations (random, zero, a few changed bytes, repeated chunks, word
//! sequences) goes through an encoder and its decoder; every page must
//! come back, and the caches on both ends must stay identical. Then
//! hostile input: random records to every decoder must give errors, not
//! panics.

use proptest::prelude::*;
use tsubame_codec::batch::{self, BatchCodec, BatchCompressor, BatchDecompressor};
use tsubame_codec::dedup::{DedupDecoder, DedupEncoder};
use tsubame_codec::rle::{self, RleCodec};
use tsubame_codec::xbzrle::{XbzrleDecoder, XbzrleEncoder};
use tsubame_codec::zero::ZeroCodec;
use tsubame_codec::{CodecList, DecodePage, EncodePage, Encoded, PageDecoder, PageEncoder, PAGE_SIZE};

/// Pages the sequences touch (more than the smallest caches hold).
const PAGES: usize = 6;

/// How a page changes from one step to the next.
fn mutate(page: &mut [u8; PAGE_SIZE], kind: u8, seed: u64) {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    match kind % 6 {
        0 => page.iter_mut().for_each(|b| *b = next() as u8),
        1 => page.fill(0),
        2 => {
            for _ in 0..1 + next() % 8 {
                let i = next() as usize % PAGE_SIZE;
                page[i] = next() as u8;
            }
        }
        3 => {
            // Repeat one 256-byte chunk elsewhere in the page.
            let dst = next() as usize % 16 * 256;
            let src = next() as usize % 16 * 256;
            page.copy_within(src..src + 256, dst);
        }
        4 => {
            for (i, w) in page.chunks_exact_mut(8).enumerate() {
                w.copy_from_slice(&(seed / 3 + (i as u64 / 7)).to_le_bytes());
            }
        }
        _ => {} // unchanged
    }
}

fn steps() -> impl Strategy<Value = Vec<(u8, u8, u64)>> {
    proptest::collection::vec((any::<u8>(), any::<u8>(), any::<u64>()), 1..48)
}

/// The one helper every codec goes through.
fn round_trip<E: EncodePage, D: DecodePage>(
    enc: &mut E,
    dec: &mut D,
    in_sync: impl Fn(&E, &D) -> bool,
    steps: &[(u8, u8, u64)],
) -> Result<(), TestCaseError> {
    let mut pages = [[0u8; PAGE_SIZE]; PAGES];
    let mut out = Vec::new();
    for &(which, kind, seed) in steps {
        let index = u64::from(which) % PAGES as u64;
        let page = &mut pages[index as usize];
        mutate(page, kind, seed);
        let mut back = [0x55u8; PAGE_SIZE];
        match enc.encode(index, page, &mut out) {
            Encoded::Zero => {
                prop_assert!(page.iter().all(|&b| b == 0), "zero record for a non-zero page");
                dec.observe_zero(index);
                back = [0u8; PAGE_SIZE];
            }
            Encoded::Raw => {
                back = *page;
                dec.observe(index, &back);
            }
            Encoded::Record(tag) => {
                prop_assert!(out.len() <= PAGE_SIZE + 2, "record of {} bytes", out.len());
                dec.decode(index, tag, &out, &mut back).map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
        }
        prop_assert_eq!(&back[..], &page[..], "page {} after mutation {}", index, kind % 6);
        prop_assert!(in_sync(enc, dec), "caches differ after page {}", index);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn zero_round_trips(steps in steps()) {
        round_trip(&mut ZeroCodec, &mut ZeroCodec, |_, _| true, &steps)?;
    }

    #[test]
    fn rle_round_trips(steps in steps()) {
        round_trip(&mut RleCodec, &mut RleCodec, |_, _| true, &steps)?;
    }

    #[test]
    fn xbzrle_round_trips(steps in steps(), pages in 2usize..8) {
        // Small caches, so ways get evicted.
        let (mut e, mut d) = (XbzrleEncoder::new(pages * PAGE_SIZE), XbzrleDecoder::new(pages * PAGE_SIZE));
        round_trip(&mut e, &mut d, |e, d| e.cache.same_state(&d.cache), &steps)?;
    }

    #[test]
    fn dedup_round_trips(steps in steps(), chunks in 2usize..64) {
        let (mut e, mut d) = (DedupEncoder::new(chunks * 256), DedupDecoder::new(chunks * 256));
        round_trip(&mut e, &mut d, |e, d| e.cache.same_state(&d.cache), &steps)?;
    }

    #[test]
    fn every_chooser_list_round_trips(steps in steps(), bandwidth in prop_oneof![Just(f64::INFINITY), Just(1e15), Just(1e8)]) {
        for list in ["none", "zero", "zero,rle", "xbzrle=8K", "zero,xbzrle=16K", "zero,dedup=8K", "dedup=64K,rle", "zero,xbzrle=16K,dedup=16K,rle,lz4"] {
            let list: CodecList = list.parse().unwrap();
            let (mut e, mut d) = (PageEncoder::new(&list), PageDecoder::new(&list));
            e.set_bandwidth(bandwidth); // 1e15: codecs get benched, caches must still agree
            round_trip(&mut e, &mut d, |e, d| e.same_caches(d), &steps)?;
        }
    }

    #[test]
    fn batches_round_trip(steps in steps(), zstd in any::<bool>()) {
        let codec = if zstd { BatchCodec::Zstd(1) } else { BatchCodec::Lz4 };
        let mut page = [0u8; PAGE_SIZE];
        let mut input = Vec::new();
        for &(_, kind, seed) in &steps {
            mutate(&mut page, kind, seed);
            input.extend_from_slice(&page);
        }
        let (mut packed, mut back) = (Vec::new(), Vec::new());
        BatchCompressor::new(codec).compress(&input, &mut packed);
        BatchDecompressor::default().decompress(codec.id(), &packed, input.len(), input.len(), &mut back).unwrap();
        prop_assert_eq!(back, input);
    }
}

/// A decoder side warmed with a few pages, so references can hit.
fn warm_decoder() -> PageDecoder {
    let list: CodecList = "zero,xbzrle=64K,dedup=64K,rle".parse().unwrap();
    let mut enc = PageEncoder::new(&list);
    let mut dec = PageDecoder::new(&list);
    let mut page = [0u8; PAGE_SIZE];
    let mut out = Vec::new();
    for i in 0..32u64 {
        mutate(&mut page, i as u8, i);
        if let Encoded::Record(tag) = enc.encode(i % 8, &page, &mut out) {
            let mut back = [0u8; PAGE_SIZE];
            dec.decode(i % 8, tag, &out, &mut back).unwrap();
        } else {
            dec.observe(i % 8, &page);
        }
    }
    dec
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn hostile_records_never_panic(tag in 0u8..8, index in 0u64..16, data in proptest::collection::vec(any::<u8>(), 0..4200)) {
        let mut out = [0u8; PAGE_SIZE];
        let _ = warm_decoder().decode(index, tag, &data, &mut out);
        let _ = rle::decode(&data, index, &mut out);
        let _ = XbzrleDecoder::new(8 * PAGE_SIZE).decode(index, &data, &mut out);
        let _ = tsubame_codec::xbzrle::decode_delta(&data, index, &mut out);
        let _ = DedupDecoder::new(1 << 12).decode(index, &data, &mut out);
    }

    #[test]
    fn hostile_dedup_records_of_the_right_length_never_panic(refs in any::<u16>(), fill in any::<u8>(), slot in any::<u32>()) {
        // Random bytes rarely have the exact length; build ones that do.
        let mut data = refs.to_le_bytes().to_vec();
        for i in 0..16 {
            if refs & (1 << i) != 0 {
                data.extend_from_slice(&(slot % 600).to_le_bytes());
            } else {
                data.extend_from_slice(&[fill; 256]);
            }
        }
        let mut out = [0u8; PAGE_SIZE];
        let _ = warm_decoder().decode(1, tsubame_codec::TAG_DEDUP, &data, &mut out);
    }

    #[test]
    fn hostile_batches_never_panic(id in 0u8..4, len in 0usize..1 << 16, data in proptest::collection::vec(any::<u8>(), 0..2000)) {
        let mut out = Vec::new();
        let _ = batch::decompress(id, &data, len, 1 << 15, &mut out);
        prop_assert!(out.len() <= 1 << 15);
    }
}
