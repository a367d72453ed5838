//! The receiver's state machine into plain memory, fed a recorded stream
//! (the receiver fuzz target's seed): it must get all the way to COMMIT,
//! and any truncation of it must fail cleanly, never land a VM.

use tsubame_migrate::destination::{receive_stream, MemoryLanding, ReceiveOptions};
use tsubame_migrate::stats::Status;

const RECORDED: &[u8] = include_bytes!("../../../fuzz/corpus/receiver/migration-8M-idle-codecs");

fn land(stream: &[u8]) -> (Result<u32, String>, MemoryLanding) {
    let mut landing = MemoryLanding { max_bytes: 32 << 20, memory: None, started: false };
    let input = stream;
    let result =
        receive_stream(std::io::Cursor::new(input.to_vec()), Vec::new(), &mut landing, &ReceiveOptions::default())
            .map_err(|e| e.to_string());
    (result, landing)
}

#[test]
fn recorded_stream_lands_and_commits() {
    let (result, landing) = land(RECORDED);
    assert!(result.is_ok(), "{result:?}");
    assert!(landing.started);
    assert_eq!(landing.memory.map(|m| tsubame_vmm::memory::page_count(&m)), Some(2048));
}

#[test]
fn a_one_byte_buffer_budget_still_lands_the_stream() {
    // Every frame then waits until the decoders gave back all others: the
    // cap slows a receive down, it never wedges it.
    let mut landing = MemoryLanding { max_bytes: 32 << 20, memory: None, started: false };
    let options = ReceiveOptions { in_flight_limit: 1, ..ReceiveOptions::default() };
    let result = receive_stream(std::io::Cursor::new(RECORDED.to_vec()), Vec::new(), &mut landing, &options);
    assert!(result.is_ok(), "{:?}", result.err());
    assert!(landing.started);
}

#[test]
fn truncated_streams_never_commit() {
    for cut in (0..RECORDED.len() - 1).step_by(997) {
        let (result, landing) = land(&RECORDED[..cut]);
        assert!(result.is_err() && !landing.started, "cut at {cut}");
    }
}

#[test]
fn a_digest_update_without_a_digest_before_it_is_refused() {
    use tsubame_migrate::protocol::{self, FrameKind};
    // The recorded stream, frame by frame, without the DIGEST sent before
    // the pause: its DIGEST_UPDATE then has nothing to update.
    let mut rest = &RECORDED[16..];
    let mut without = RECORDED[..16].to_vec();
    let (mut buf, mut dropped) = (Vec::new(), false);
    while !rest.is_empty() {
        let before = rest;
        let kind = protocol::read_frame(&mut rest, &mut buf).unwrap();
        if kind == FrameKind::Digest && !dropped {
            dropped = true;
            continue;
        }
        without.extend_from_slice(&before[..before.len() - rest.len()]);
    }
    assert!(dropped, "the recorded stream sends DIGEST before the pause");
    let (result, landing) = land(&without);
    let err = result.unwrap_err();
    assert!(err.contains("unexpected DigestUpdate") && !landing.started, "{err}");
}

#[test]
fn memory_above_the_cap_is_refused() {
    let mut landing = MemoryLanding { max_bytes: 4 << 20, memory: None, started: false };
    let input = RECORDED;
    let err =
        receive_stream(std::io::Cursor::new(input.to_vec()), Vec::new(), &mut landing, &ReceiveOptions::default())
            .unwrap_err();
    assert!(err.to_string().contains("exceed"), "{err}");
}

/// Records the seed anew (after a change to what the stream carries):
/// `TSUBAME_RECORD_SEED=1 cargo test --release -p tsubame-migrate --test
/// receive_stream -- record_seed`. An 8 MiB VM running `idle`, every page
/// codec, one channel; the source's bytes are captured on their way to a
/// destination landing in plain memory.
#[test]
fn record_seed() {
    use std::io::{Read, Write};
    use tsubame_migrate::destination::receive_into;
    use tsubame_migrate::transport::{Address, Listener, Stream};
    use tsubame_migrate::{source, MigrateOptions, ProgressCell};
    // A recording tool run by hand, not a test: no skip to count.
    if std::env::var_os("TSUBAME_RECORD_SEED").is_none() || !tsubame_testkit::kvm() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tsubame-seed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let to_proxy = Address::Unix(dir.join("proxy.sock"));
    let to_dest = Address::Unix(dir.join("dest.sock"));
    let proxy_listener = Listener::bind(&to_proxy).unwrap();
    let dest_listener = Listener::bind(&to_dest).unwrap();
    let dest = std::thread::spawn(move || {
        let mut landing = MemoryLanding { max_bytes: 32 << 20, memory: None, started: false };
        let stream = dest_listener.accept().unwrap();
        receive_into(stream, None, &ReceiveOptions::default(), &|_| {}, &mut landing).map(|_| landing.started)
    });
    let proxy = std::thread::spawn(move || {
        let mut from_source = proxy_listener.accept().unwrap();
        let mut to_destination = Stream::connect(&to_dest, std::time::Duration::from_secs(5)).unwrap();
        let (mut back_from, mut back_to) = (to_destination.try_clone().unwrap(), from_source.try_clone().unwrap());
        let back = std::thread::spawn(move || std::io::copy(&mut back_from, &mut back_to));
        let mut recorded = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n @ 1..) = from_source.read(&mut buf) {
            recorded.extend_from_slice(&buf[..n]);
            if to_destination.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        to_destination.shutdown();
        let _ = back.join();
        recorded
    });
    let mut vm = tsubame_vmm::Vm::create(&tsubame_vmm::VmConfig { memory_bytes: 8 << 20, hugepages: false }).unwrap();
    let cmdline = format!("workload=idle tsc_khz={}", vm.tsc_khz());
    vm.load_guest(tsubame_vmm::guest_elf::GUEST_ELF, &cmdline).unwrap();
    vm.start(false).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let options = MigrateOptions {
        codecs: "zero,rle,xbzrle=1M,dedup=1M,lz4".parse().unwrap(),
        encode_threads: 1,
        // Pre-copy only: post-copy asks for a second connection, and this
        // receiver takes one.
        postcopy: tsubame_migrate::options::PostcopyMode::Off,
        ..Default::default()
    };
    let stats = source::migrate(&vm, &to_proxy, &options, &ProgressCell::default());
    assert_eq!(stats.status, Status::Completed, "{:?}", stats.error);
    assert!(dest.join().unwrap().unwrap());
    let recorded = proxy.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/corpus/receiver/migration-8M-idle-codecs");
    std::fs::write(path, &recorded).unwrap();
    println!("recorded {} bytes into {path}", recorded.len());
}

/// The start of a far-memory VM's stream (HELLO with the far-memory flag,
/// FAR_MEMORY, FAR_PAGES, one page, ITERATION_END) into plain memory: the
/// map is parsed and checked (plain memory attaches no exports), and the
/// cut stream fails without landing a VM. Also the receiver fuzz target's
/// far-memory seed (`TSUBAME_RECORD_SEED=1` writes it).
#[test]
fn a_far_memory_stream_is_parsed_and_a_cut_one_never_lands() {
    use tsubame_migrate::protocol::far::{FarMemory, FarPages};
    use tsubame_migrate::protocol::{self, FrameKind, Hello, IterationEnd, HELLO_FAR_MEMORY};
    let pages = (8u64 << 20) / 4096;
    let mut far = tsubame_vmm::DirtyBitmap::new(pages);
    [3, 64, 65, pages - 1].into_iter().for_each(|p| far.set(p));
    let hashes: Vec<u128> = (0..pages as u128).map(|p| p * 0x9e37_79b9).collect();
    let hello = Hello {
        memory_bytes: 8 << 20,
        page_size: 4096,
        vcpus: 1,
        digest_region: 256 << 10,
        granularity: 4096,
        codecs: "zero".into(),
        session: 7,
        channels: 1,
        shards: 1,
        flags: HELLO_FAR_MEMORY,
    };
    let mut stream = Vec::new();
    protocol::write_preamble(&mut stream, protocol::VERSION).unwrap();
    protocol::write_frame(&mut stream, FrameKind::Hello, &hello.encode()).unwrap();
    let setup = FarMemory { local_bytes: 4 << 20, far_pages: 4, stores: vec!["nbd://127.0.0.1:1/x".into()] };
    protocol::write_frame(&mut stream, FrameKind::FarMemory, &setup.encode()).unwrap();
    for run in FarPages::split(&far, &hashes) {
        protocol::write_frame(&mut stream, FrameKind::FarPages, &run.encode()).unwrap();
    }
    let mut pages_frame = tsubame_migrate::protocol::pages::PagesBuilder::new(16);
    pages_frame.reset(0, 0);
    pages_frame.push(5, tsubame_migrate::protocol::pages::Encoding::Raw, &[0x5a; 4096]);
    protocol::write_frame(&mut stream, FrameKind::Pages, pages_frame.payload()).unwrap();
    let end = IterationEnd { iteration: 0, records: 1 };
    protocol::write_frame(&mut stream, FrameKind::IterationEnd, &end.encode()).unwrap();
    if std::env::var_os("TSUBAME_RECORD_SEED").is_some() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/corpus/receiver/far-memory-start");
        std::fs::write(path, &stream).unwrap();
    }
    // Cut after the map: the receiver got past it to the pages.
    let (result, landing) = land(&stream);
    let err = result.unwrap_err();
    assert!(!landing.started);
    assert!(!err.contains("far"), "the map was refused: {err}");
    // A map that names more pages than it carries is refused by name.
    let mut short = Vec::new();
    protocol::write_preamble(&mut short, protocol::VERSION).unwrap();
    protocol::write_frame(&mut short, FrameKind::Hello, &hello.encode()).unwrap();
    let lying = FarMemory { far_pages: 5, ..setup };
    protocol::write_frame(&mut short, FrameKind::FarMemory, &lying.encode()).unwrap();
    for run in FarPages::split(&far, &hashes) {
        protocol::write_frame(&mut short, FrameKind::FarPages, &run.encode()).unwrap();
    }
    protocol::write_frame(&mut short, FrameKind::IterationEnd, &end.encode()).unwrap();
    let (result, landing) = land(&short);
    assert!(!landing.started);
    assert!(result.unwrap_err().contains("FAR_PAGES"));
}
