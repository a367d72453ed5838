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
    if std::env::var_os("TSUBAME_RECORD_SEED").is_none() || !tsubame_vmm::kvm::kvm_tests_enabled() {
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
        ..Default::default()
    };
    let stats = source::migrate(&vm, &to_proxy, &options, &ProgressCell::default());
    assert_eq!(stats.status, Status::Completed, "{:?}", stats.error);
    assert!(dest.join().unwrap().unwrap());
    let recorded = proxy.join().unwrap();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/corpus/receiver/migration-8M-idle-codecs");
    std::fs::write(path, &recorded).unwrap();
    println!("recorded {} bytes into {path}", recorded.len());
}
