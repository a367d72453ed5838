//! The engine migrating a trace replay into plain memory: no KVM needed,
//! so this runs everywhere (and is how a GPU machine without /dev/kvm runs
//! real migrations).

use std::time::Duration;

use tsubame_migrate::destination::{receive_into, MemoryLanding, ReceiveOptions};
use tsubame_migrate::replay::TraceReplay;
use tsubame_migrate::stats::Status;
use tsubame_migrate::transport::{Address, Listener};
use tsubame_migrate::{source, MigrateOptions, PostcopyMode, ProgressCell};
use tsubame_trace::format::{PageChange, Setup, Trace, TraceWriter};

/// 16 MiB, the first half non-zero; every 10 ms a few hundred pages change
/// in one or two sub-pages, and some pages are zeroed.
fn synthetic_trace() -> Trace {
    let pages = 4096u64;
    let setup = Setup {
        memory_bytes: pages * 4096,
        granularity: 128,
        interval_us: 10_000,
        workload: "synthetic".into(),
        native_ops_per_sec: 0,
        huge_pages: false,
    };
    let nonzero: Vec<u64> = (0..pages / 64).map(|w| if w < pages / 128 { u64::MAX } else { 0 }).collect();
    let mut writer = TraceWriter::new(Vec::new(), &setup, &nonzero).unwrap();
    for tick in 0..100u64 {
        let changes: Vec<PageChange> = (0..300u64)
            .map(|i| (i * 13 + tick * 7) % pages)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|page| PageChange { page, mask: 1 << (page % 32) | 1, xbzrle_bytes: 20, zero: page % 97 == 0 })
            .collect();
        writer.interval((tick + 1) * 10_000, 0, &changes).unwrap();
    }
    Trace::read(writer.finish().unwrap().as_slice()).unwrap()
}

#[test]
fn replayed_trace_migrates_with_every_pipeline_shape() {
    for (n, (channels, encode_threads, pipeline, codecs)) in [
        (1, 1, true, "zero"),
        (2, 3, true, "zero,xbzrle=4M,rle"),
        (4, 4, true, "zero,dedup=2M,zstd"),
        (1, 1, false, "none"),
    ]
    .into_iter()
    .enumerate()
    {
        let replay = TraceReplay::start(synthetic_trace(), 1.0).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let addr = Address::Unix(std::env::temp_dir().join(format!("tsubame-replay-test-{}-{n}", std::process::id())));
        let listener = Listener::bind(&addr).unwrap();
        let dest = std::thread::spawn(move || {
            let stream = listener.accept().unwrap();
            let mut landing = MemoryLanding { max_bytes: 64 << 20, memory: None, started: false };
            let r = receive_into(stream, Some(&listener), &ReceiveOptions::default(), &|_| {}, &mut landing);
            (r.map_err(|e| e.to_string()), landing.started)
        });
        let options = MigrateOptions {
            channels,
            encode_threads,
            pipeline,
            codecs: codecs.parse().unwrap(),
            // Slow enough that the replay dirties pages during iterations,
            // and pre-copy's: a replay that outruns the link would go to
            // post-copy after its first iteration's look.
            max_bandwidth: Some(40_000_000),
            postcopy: PostcopyMode::Off,
            ..Default::default()
        };
        let before = replay.progress();
        let stats = source::migrate(&replay, &addr, &options, &ProgressCell::default());
        let (received, started) = dest.join().unwrap();
        assert_eq!(stats.status, Status::Completed, "{:?}", stats.error);
        assert!(stats.digest_verified && received.is_ok() && started, "{received:?}");
        assert!(stats.iterations >= 2, "{channels} channels: {} iterations", stats.iterations);
        assert!(replay.progress().page_writes > before.page_writes, "the replay kept dirtying memory");
        // With extra channels a detached accepting thread keeps a handle
        // on the socket file.
        if let Address::Unix(path) = &addr {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[test]
fn a_vm_destination_refuses_a_replay_clearly() {
    // The empty STATE frame of a replay must not pass for a VM's state.
    let replay = TraceReplay::start(synthetic_trace(), 1.0).unwrap();
    let addr = Address::Unix(std::env::temp_dir().join(format!("tsubame-replay-refuse-{}", std::process::id())));
    let listener = Listener::bind(&addr).unwrap();
    let dest = std::thread::spawn(move || {
        let stream = listener.accept().unwrap();
        // A memory-only landing that insists on a state, as a VM does.
        struct Strict(MemoryLanding);
        impl tsubame_migrate::destination::Landing for Strict {
            fn create(
                &mut self,
                b: u64,
            ) -> Result<std::sync::Arc<tsubame_vmm::memory::GuestMemory>, tsubame_migrate::destination::ReceiveError>
            {
                self.0.create(b)
            }
            fn restore(
                &mut self,
                s: &[u8],
                _disk: Option<tsubame_migrate::destination::WarmDisk>,
            ) -> Result<(), tsubame_migrate::destination::ReceiveError> {
                if s.is_empty() {
                    return Err(tsubame_migrate::destination::ReceiveError::BadState("empty".into()));
                }
                Ok(())
            }
            fn start(&mut self) -> Result<(), tsubame_migrate::destination::ReceiveError> {
                self.0.start()
            }
        }
        let mut landing = Strict(MemoryLanding { max_bytes: 64 << 20, memory: None, started: false });
        receive_into(stream, Some(&listener), &ReceiveOptions::default(), &|_| {}, &mut landing).is_err()
    });
    let stats = source::migrate(&replay, &addr, &MigrateOptions::default(), &ProgressCell::default());
    assert!(dest.join().unwrap());
    assert_eq!(stats.status, Status::Failed);
    // The source resumes: the replay goes on.
    let before = replay.progress().page_writes;
    std::thread::sleep(Duration::from_millis(100));
    assert!(replay.progress().page_writes > before);
}
