//! Every protocol message survives encode → decode unchanged, for any
//! field values its decoder accepts; the frame layer carries any payload.

use proptest::prelude::*;
use tsubame_migrate::protocol::pages::{
    for_each_record, for_each_subpage, CompressedHeader, Encoding, PagesBuilder, MAX_UNPACKED,
};
use tsubame_migrate::protocol::{
    self, ChannelOpen, Digest, DigestUpdate, ErrorMessage, FrameKind, Hello, IterationEnd, Mismatch, PageRequest,
    PostcopyDone, PostcopyInstalled, PostcopyRunning, PostcopyStart, Resume, ResumeAck, Resumed, HELLO_POSTCOPY,
    MAX_CHANNELS, MAX_SHARDS,
};

fn hello() -> impl Strategy<Value = Hello> {
    (
        1u64..=32 * 1024, // memory in 2 MiB units: 2 MiB .. 64 GiB
        12u32..=26,       // digest region 4 KiB .. 64 MiB
        6u32..=12,        // granularity 64 .. 4096
        "[a-z0-9=,]{0,64}",
        any::<u64>(),
        1u16..=MAX_CHANNELS,
        0u16..=MAX_SHARDS,
        any::<bool>(),
    )
        .prop_map(|(mem, region, g, codecs, session, channels, extra, postcopy)| Hello {
            memory_bytes: (mem * (2 << 20)).max(8 << 20),
            page_size: 4096,
            vcpus: 1,
            digest_region: 1 << region,
            granularity: 1 << g,
            codecs,
            session,
            channels,
            shards: (channels + extra).min(MAX_SHARDS),
            flags: if postcopy { HELLO_POSTCOPY } else { 0 },
        })
}

proptest! {
    #[test]
    fn hello_round_trips(h in hello()) {
        prop_assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn small_messages_round_trip(session in any::<u64>(), channel in any::<u16>(), iteration in any::<u32>(),
                                 records in any::<u64>(), micros in any::<u64>()) {
        let open = ChannelOpen { session, channel };
        prop_assert_eq!(ChannelOpen::decode(&open.encode()).unwrap(), open);
        let end = IterationEnd { iteration, records };
        prop_assert_eq!(IterationEnd::decode(&end.encode()).unwrap(), end);
        let resumed = Resumed { cpu_micros: micros };
        prop_assert_eq!(Resumed::decode(&resumed.encode()).unwrap(), resumed);
        let header = CompressedHeader { shard: channel, compressor: iteration as u8, unpacked_len: (micros % MAX_UNPACKED as u64) as u32 };
        let mut bytes = Vec::new();
        header.write(&mut bytes);
        bytes.extend_from_slice(b"packed");
        let (back, rest) = CompressedHeader::parse(&bytes).unwrap();
        prop_assert_eq!(back, header);
        prop_assert_eq!(rest, b"packed");
    }

    #[test]
    fn postcopy_messages_round_trip(pages in 1u64..5000, set in prop::collection::vec(any::<u64>(), 0..64),
                                    last in prop::option::of(any::<u32>().prop_filter("not all ones", |&l| l != u32::MAX)),
                                    requested in prop::collection::vec(0u64..5000, 1..100), n in any::<u64>(), x in any::<u32>()) {
        let mut missing = tsubame_vmm::DirtyBitmap::new(pages);
        for p in &set {
            missing.set(p % pages);
        }
        let start = PostcopyStart { last_iteration: last, timeout_ms: x, missing: missing.clone() };
        prop_assert_eq!(PostcopyStart::decode(&start.encode(), pages).unwrap(), start);
        let ack = ResumeAck { missing };
        prop_assert_eq!(ResumeAck::decode(&ack.encode(), pages).unwrap(), ack);
        let request = PageRequest { pages: requested.iter().map(|p| p % pages).collect() };
        prop_assert_eq!(PageRequest::decode(&request.encode(), pages).unwrap(), request);
        let running = PostcopyRunning { cpu_micros: n };
        prop_assert_eq!(PostcopyRunning::decode(&running.encode()).unwrap(), running);
        let installed = PostcopyInstalled { pages: n };
        prop_assert_eq!(PostcopyInstalled::decode(&installed.encode()).unwrap(), installed);
        let done = PostcopyDone {
            mismatched: x, faults: n, requested: n / 2, latency_p50_us: n % 1000, latency_p99_us: n % 7,
            latency_max_us: n, cpu_micros: n / 3, guest_ops_per_sec: x as f64 * 1.5,
        };
        prop_assert_eq!(PostcopyDone::decode(&done.encode()).unwrap(), done);
        let resume = Resume { session: n, channel: x as u16 };
        prop_assert_eq!(Resume::decode(&resume.encode()).unwrap(), resume);
    }

    #[test]
    fn error_messages_round_trip(text in "\\PC{0,300}") {
        prop_assert_eq!(ErrorMessage::decode(&ErrorMessage(text.clone()).encode()), ErrorMessage(text));
    }

    #[test]
    fn digests_and_mismatches_round_trip(region in 12u32..=26, hashes in prop::collection::vec(any::<u64>(), 1..300),
                                         picks in prop::collection::btree_set(0usize..300, 1..40)) {
        let digest = Digest { region: 1 << region, hashes: hashes.clone() };
        prop_assert_eq!(Digest::decode(&digest.encode(), 1 << region, hashes.len()).unwrap(), digest);
        let regions: Vec<u32> = picks.into_iter().filter(|&r| r < hashes.len()).map(|r| r as u32).collect();
        prop_assume!(!regions.is_empty());
        let mismatch = Mismatch { regions };
        prop_assert_eq!(Mismatch::decode(&mismatch.encode(), hashes.len()).unwrap(), mismatch);
    }

    #[test]
    fn a_digest_update_carries_exactly_the_changed_regions(before in prop::collection::vec(any::<u64>(), 1..300),
                                                           changes in prop::collection::vec((0usize..300, any::<u64>()), 0..40)) {
        let mut now = before.clone();
        for &(i, h) in &changes {
            if i < now.len() {
                now[i] = h;
            }
        }
        let update = DigestUpdate::between(1 << 18, &before, &now);
        prop_assert!(update.changed.len() <= changes.len());
        let decoded = DigestUpdate::decode(&update.encode(), 1 << 18, before.len()).unwrap();
        prop_assert_eq!(&decoded, &update);
        prop_assert_eq!(decoded.apply(before.clone()), now);
        // Another region size, or an index past the end, is refused.
        prop_assert!(DigestUpdate::decode(&update.encode(), 1 << 19, before.len()).is_err());
        let past = DigestUpdate { region: 1 << 18, changed: vec![(before.len() as u32, 0)] };
        prop_assert!(DigestUpdate::decode(&past.encode(), 1 << 18, before.len()).is_err());
    }

    #[test]
    fn page_records_round_trip(iteration in any::<u32>(), shard in any::<u16>(),
                               records in prop::collection::vec((0u64..1 << 20, 0u8..6, any::<u8>(), 1u64..), 0..40)) {
        let granularity = 128;
        let mut builder = PagesBuilder::new(records.len());
        builder.reset(iteration, shard);
        let mut sent = Vec::new();
        for &(index, kind, fill, mask) in &records {
            let (encoding, data) = match kind {
                0 => (Encoding::Raw, vec![fill; 4096]),
                1 => (Encoding::Zero, Vec::new()),
                2 => {
                    let mask = mask & 0xFFFF_FFFF; // 32 sub-pages of 128 bytes
                    let mask = if mask == 0 { 1 } else { mask };
                    let mut data = mask.to_le_bytes().to_vec();
                    data.extend(std::iter::repeat_n(fill, mask.count_ones() as usize * granularity));
                    (Encoding::Subpage, data)
                }
                3 => (Encoding::Rle, vec![fill; (mask % 4098) as usize]),
                4 => (Encoding::Xbzrle, vec![fill; (mask % 4098) as usize]),
                _ => (Encoding::Dedup, vec![fill; (mask % 4098) as usize]),
            };
            builder.push(index, encoding, &data);
            sent.push((index, encoding, data));
        }
        let mut got = Vec::new();
        let it = for_each_record(builder.payload(), 1 << 20, granularity, |r| {
            if r.encoding == Encoding::Subpage {
                let mut n = 0;
                for_each_subpage(r.data, granularity, |_, bytes| n += bytes.len());
                assert_eq!(n + 8, r.data.len());
            }
            got.push((r.page_index, r.encoding, r.data.to_vec()));
            Ok(())
        }).unwrap();
        prop_assert_eq!(it, iteration);
        prop_assert_eq!(got, sent);
    }

    #[test]
    fn frames_carry_any_payload(payload in prop::collection::vec(any::<u8>(), 0..5000), kind in 1u16..=21) {
        let kind = FrameKind::from_u16(kind).unwrap();
        prop_assume!(kind != FrameKind::PagesZeroCopy);
        let mut wire = Vec::new();
        protocol::write_preamble(&mut wire, protocol::VERSION).unwrap();
        protocol::write_frame(&mut wire, kind, &payload).unwrap();
        let mut input = wire.as_slice();
        protocol::read_preamble(&mut input).unwrap();
        let mut buf = Vec::new();
        prop_assert_eq!(protocol::read_frame(&mut input, &mut buf).unwrap(), kind);
        prop_assert_eq!(buf, payload);
    }
}
