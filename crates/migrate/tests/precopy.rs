//! Pre-copy between two VMs in one process, over a real socket.

mod common;

use std::time::{Duration, Instant};

use common::{kvm_or_skip, ops_at_least, ops_until};
use tsubame_migrate::destination::{receive, ReceiveOptions};
use tsubame_migrate::options::default_codecs;
use tsubame_migrate::stats::{Status, StopReason};
use tsubame_migrate::subpage::Detector;
use tsubame_migrate::transport::{Address, Listener};
use tsubame_migrate::{source, MigrateOptions, PostcopyMode, ProgressCell};
use tsubame_vmm::{guest_elf, memory, Vm, VmConfig};

fn migrate_workload(args: &str, options: MigrateOptions) -> tsubame_migrate::MigrationStats {
    migrate_sized(128 << 20, args, options, Duration::from_millis(700))
}

fn migrate_sized(
    memory_bytes: u64,
    args: &str,
    options: MigrateOptions,
    watch: Duration,
) -> tsubame_migrate::MigrationStats {
    migrate_over(memory_bytes, args, options, watch, false)
}

fn migrate_over(
    memory_bytes: u64,
    args: &str,
    options: MigrateOptions,
    watch: Duration,
    tcp: bool,
) -> tsubame_migrate::MigrationStats {
    // Pre-copy's own machinery: the default hands a guest that outruns the
    // link to post-copy instead (tests/postcopy.rs).
    let options = MigrateOptions { postcopy: PostcopyMode::Off, ..options };
    let mut vm = Vm::create(&VmConfig { memory_bytes, hugepages: true }).unwrap();
    let cmdline = format!("{args} tsc_khz={}", vm.tsc_khz());
    vm.load_guest(guest_elf::GUEST_ELF, &cmdline).unwrap();
    let console = vm.take_console().unwrap();
    vm.start(false).unwrap();
    let before = ops_until(&console, watch);

    // Tests run in parallel threads of one process: a counter keeps paths apart.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("tsubame-precopy-{}-{n}", std::process::id()));
    let addr = if tcp { "tcp:127.0.0.1:0".parse().unwrap() } else { Address::Unix(path) };
    let listener = Listener::bind(&addr).unwrap();
    let addr = listener.local_address();
    let dest = std::thread::spawn(move || receive(&listener, &ReceiveOptions::default(), &|_| {}));
    let stats = source::migrate(&vm, &addr, &options, &ProgressCell::default());
    let received = dest.join().unwrap();
    // Both ends' errors: when one end fails, the other's says why.
    assert_eq!(
        stats.status,
        Status::Completed,
        "source: {:?}; destination: {:?}",
        stats.error,
        received.as_ref().err()
    );
    let mut incoming = received.expect("destination received the VM");
    assert!(stats.digest_verified);
    // The digest kept during pre-copy matched at once: nothing to repair
    // (unless a test forges sub-page hash collisions on purpose).
    if options.subpage_hash_mask == u64::MAX {
        assert_eq!(stats.regions_repaired, 0, "{args}");
    }
    assert!(stats.iterations >= 2);
    assert_eq!(stats.per_iteration.len() as u32, stats.iterations);
    assert!(stats.downtime_ms > 0.0 && stats.downtime_ms < stats.total_time_ms);

    // The source stays paused; the guest continues at the destination.
    let source_last = ops_until(&console, Duration::from_millis(200)).last().copied().or(before.last().copied());
    assert!(vm.status().is_stopped());
    let dest_console = incoming.vm.take_console().unwrap();
    let after = ops_at_least(&dest_console, 3, watch);
    assert!(after.len() >= 3, "{args}: destination printed {} progress lines", after.len());
    assert!(after[0] >= source_last.unwrap(), "{args}: ops restarted: {after:?} after {source_last:?}");
    assert!(after.last() > after.first());
    stats
}

#[test]
fn kv_migrates_and_continues() {
    if !kvm_or_skip() {
        return;
    }
    migrate_workload("workload=kv wss=32M", MigrateOptions::default());
}

#[test]
fn zeros_the_destination_holds_are_not_sent() {
    if !kvm_or_skip() {
        return;
    }
    // Whole pages, so each page sent is a record: an idle guest's memory
    // is zeros but for the guest itself, and the destination's memory
    // starts as zeros. (zero-clear, in the test below, zeroes pages sent
    // before: those still go as zero records.)
    let options = MigrateOptions { granularity: 4096, granularity_auto: false, ..Default::default() };
    let stats = migrate_workload("workload=idle", options);
    let first = &stats.per_iteration[0];
    assert_eq!(first.dirty_pages, stats.pages_total);
    assert!(first.pages_sent < stats.pages_total / 8, "sent {} of {} pages", first.pages_sent, stats.pages_total);
    assert_eq!(stats.pages_zero, 0);
}

const WORKLOADS: [&str; 8] = ["idle", "fill-zero", "fill-random", "kv", "bwmem", "sparse", "zero-clear", "stream"];

#[test]
fn every_workload_at_every_granularity_and_detector() {
    if !kvm_or_skip() {
        return;
    }
    for workload in WORKLOADS {
        for (granularity, detector) in [
            (4096, Detector::Shadow),
            (1024, Detector::Shadow),
            (1024, Detector::Hash),
            (128, Detector::Shadow),
            (128, Detector::Hash),
        ] {
            let options = MigrateOptions {
                granularity,
                granularity_auto: false,
                subpage_detector: detector,
                ..Default::default()
            };
            let args = format!("workload={workload} wss=16M");
            let stats = migrate_sized(64 << 20, &args, options, Duration::from_millis(350));
            assert_eq!(stats.subpage.is_some(), granularity < 4096, "{args}");
            assert_eq!(stats.regions_repaired, 0, "{args} at {granularity}/{detector:?} needed repair");
        }
    }
}

#[test]
fn auto_granularity_keeps_sub_pages_only_where_they_pay() {
    if !kvm_or_skip() {
        return;
    }
    let auto = |workload: &str| {
        let options = MigrateOptions {
            max_bandwidth: Some(200_000_000),
            max_iterations: 4,
            encode_threads: 1,
            ..Default::default()
        };
        let args = format!("workload={workload} wss=32M");
        let stats = migrate_sized(64 << 20, &args, options, Duration::from_millis(350));
        let choice = stats.choices.iter().find(|c| c.what == "granularity").unwrap().clone();
        (stats.subpage.unwrap(), choice)
    };
    // kv changes a few bytes of each page it writes: sub-pages stay. (How
    // much they save depends on how long an iteration left a page out: a
    // loaded host's longer iterations saw 0.16, a quiet one's over 0.5.)
    let (kv, choice) = auto("kv");
    assert!(kv.whole_pages_from.is_none() && kv.saved_share().unwrap() > 1.0 / 16.0, "{kv:?}");
    assert!(choice.why.starts_with("auto: sub-pages saved"), "{choice:?}");
    // fill-random rewrites every byte: whole pages once that shows.
    let (random, choice) = auto("fill-random");
    assert!(random.whole_pages_from.is_some_and(|i| i >= 1), "{random:?}");
    assert!(choice.chose.contains("whole pages from iteration"), "{choice:?}");
}

#[test]
fn forged_hash_collisions_are_repaired_by_verification() {
    if !kvm_or_skip() {
        return;
    }
    // Every sub-page hash is 0: after iteration 0 the detector sees no
    // change at all, so only the digest comparison can catch what moved.
    let options = MigrateOptions {
        granularity: 128,
        subpage_detector: Detector::Hash,
        subpage_hash_mask: 0,
        ..Default::default()
    };
    let stats = migrate_workload("workload=sparse wss=16M", options);
    assert!(stats.digest_verified);
    assert!(stats.regions_repaired > 0, "no region needed repair: {:?}", stats.subpage);
    assert_eq!(stats.subpage.unwrap().regions_repaired, stats.regions_repaired);
}

#[test]
fn capped_bandwidth_bwmem_does_not_converge() {
    if !kvm_or_skip() {
        return;
    }
    // 8 MB/s link: 300 ms carries 2.4 MB; bwmem rewrites 8 MiB again and again.
    let options = MigrateOptions {
        max_bandwidth: Some(8_000_000),
        max_iterations: 3,
        postcopy: PostcopyMode::Off,
        // Whole pages: bwmem writes the same bytes each pass, which
        // sub-pages would find unchanged; raw: lz4 shrinks them 200 times.
        granularity: 4096,
        codecs: "zero".parse().unwrap(),
        ..Default::default()
    };
    let memory_bytes = 64 << 20;
    let mut vm = Vm::create(&VmConfig { memory_bytes, hugepages: true }).unwrap();
    let cmdline = format!("workload=bwmem wss=8M tsc_khz={}", vm.tsc_khz());
    vm.load_guest(guest_elf::GUEST_ELF, &cmdline).unwrap();
    vm.start(false).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let addr = Address::Unix(std::env::temp_dir().join(format!("tsubame-precopy-nc-{}", std::process::id())));
    let listener = Listener::bind(&addr).unwrap();
    let dest = std::thread::spawn(move || receive(&listener, &ReceiveOptions::default(), &|_| {}));
    let stats = source::migrate(&vm, &addr, &options, &ProgressCell::default());
    dest.join().unwrap().unwrap();
    assert_eq!(stats.status, Status::Completed, "{:?}", stats.error);
    assert!(!stats.converged);
    assert_eq!(stats.stop_reason, StopReason::MaxIterations);
    assert_eq!(stats.iterations, 4);
}

#[test]
fn auto_converge_throttles_and_a_failed_migration_lets_the_guest_run_freely() {
    if !kvm_or_skip() {
        return;
    }
    // 16 MB/s: 300 ms carries 4.8 MB, and bwmem rewrites its 8 MiB even at
    // 99 % throttle, so this never converges; it aborts after 6 iterations.
    let options = MigrateOptions {
        max_bandwidth: Some(16_000_000),
        max_iterations: 6,
        auto_converge: true,
        abort_if_not_converged: true,
        postcopy: PostcopyMode::Off,
        granularity: 4096,
        // Raw: lz4 shrinks bwmem's pages 200 times.
        codecs: "zero".parse().unwrap(),
        ..Default::default()
    };
    let mut vm = Vm::create(&VmConfig { memory_bytes: 64 << 20, hugepages: true }).unwrap();
    let cmdline = format!("workload=bwmem wss=8M tsc_khz={}", vm.tsc_khz());
    vm.load_guest(guest_elf::GUEST_ELF, &cmdline).unwrap();
    let console = vm.take_console().unwrap();
    vm.start(false).unwrap();
    ops_until(&console, Duration::from_millis(300));
    let addr = Address::Unix(std::env::temp_dir().join(format!("tsubame-precopy-ac-{}", std::process::id())));
    let listener = Listener::bind(&addr).unwrap();
    let dest = std::thread::spawn(move || receive(&listener, &ReceiveOptions::default(), &|_| {}));
    let stats = source::migrate(&vm, &addr, &options, &ProgressCell::default());
    let _ = dest.join().unwrap();
    assert_eq!(stats.status, Status::Failed);
    assert!(stats.error.as_deref().unwrap_or("").contains("keeps running here"), "{:?}", stats.error);
    let throttles: Vec<f64> = stats.per_iteration.iter().map(|i| i.throttle).collect();
    assert_eq!(throttles[..2], [0.0, 0.0], "never before two iterations that dirtied too much: {throttles:?}");
    assert!(throttles.windows(2).all(|w| w[0] <= w[1]) && throttles[5] >= 0.2, "{throttles:?}");
    // The guest runs here again, unthrottled.
    assert_eq!(vm.throttle(), 0.0);
    assert!(!vm.status().is_stopped());
    let ops = ops_until(&console, Duration::from_millis(500));
    assert!(ops.len() >= 2 && ops.last() > ops.first(), "{ops:?}");
}

#[test]
fn every_codec_list_migrates_and_verifies() {
    if !kvm_or_skip() {
        return;
    }
    for codecs in [
        "none",
        "zero",
        "zero,rle",
        "zero,xbzrle=16M",
        "zero,dedup=8M",
        "zero,lz4",
        "zero,zstd",
        "zero,xbzrle=16M,dedup=8M,zstd",
    ] {
        // Each codec list crosses 1, 2 and 4 channels, with more codec
        // shards (encode threads) than channels in two of them.
        for (workload, channels, encode_threads) in [("kv", 1, 1), ("stream", 2, 3), ("fill-random", 4, 4)] {
            let options = MigrateOptions {
                codecs: codecs.parse().unwrap(),
                // A slow link keeps every codec switched on (they pay there).
                max_bandwidth: Some(200_000_000),
                channels,
                encode_threads,
                ..Default::default()
            };
            let args = format!("workload={workload} wss=16M");
            let stats = migrate_sized(64 << 20, &args, options, Duration::from_millis(350));
            assert!(stats.digest_verified, "{codecs} {workload}");
            let pipeline = stats.pipeline.as_ref().unwrap();
            assert_eq!((pipeline.channels, pipeline.shards), (channels, encode_threads.max(channels)));
        }
    }
}

#[test]
fn sub_pages_and_xbzrle_combine() {
    if !kvm_or_skip() {
        return;
    }
    // XBZRLE codes the pages whose every sub-page changed; both caches
    // take in the pages sent in sub-pages, or its deltas would be against
    // stale bytes and the digest would differ.
    let (mut subpages, mut xbzrle) = (0, 0);
    for workload in ["kv", "stream", "sparse", "zero-clear"] {
        for granularity in [128, 1024] {
            let options = MigrateOptions {
                granularity,
                codecs: "zero,xbzrle=16M".parse().unwrap(),
                max_bandwidth: Some(200_000_000),
                ..Default::default()
            };
            let args = format!("workload={workload} wss=16M");
            let stats = migrate_sized(64 << 20, &args, options, Duration::from_millis(350));
            assert_eq!(stats.regions_repaired, 0, "{args} at {granularity}");
            subpages += stats.subpage.as_ref().unwrap().subpages_sent;
            xbzrle += stats.codec.get("xbzrle").map_or(0, |c| c.pages);
        }
    }
    assert!(subpages > 0 && xbzrle > 0, "sub-pages {subpages}, xbzrle pages {xbzrle}");
}

#[test]
fn sequential_mode_migrates_with_channels() {
    if !kvm_or_skip() {
        return;
    }
    for channels in [1, 2] {
        let options = MigrateOptions {
            pipeline: false,
            channels,
            codecs: "zero,xbzrle=16M".parse().unwrap(),
            ..Default::default()
        };
        let stats = migrate_workload("workload=kv wss=32M", options);
        assert_eq!(stats.pipeline.unwrap().mode, "sequential");
    }
}

#[test]
fn zero_copy_sends_verify_under_concurrent_writes() {
    if !kvm_or_skip() {
        return;
    }
    // stream rewrites whole pages nonstop: pages change while the kernel
    // still holds them for a zero-copy send.
    for (pipeline, channels, codec) in [(true, 1, "none"), (true, 2, "zero"), (false, 2, "none")] {
        let options = MigrateOptions {
            zero_copy: true,
            pipeline,
            channels,
            codecs: codec.parse().unwrap(),
            ..Default::default()
        };
        let stats = migrate_over(128 << 20, "workload=stream wss=16M", options, Duration::from_millis(700), true);
        let zc = stats.pipeline.unwrap().zero_copy.expect("zero-copy counters");
        // Every PAGES frame went by reference; only control frames did not.
        assert!(zc.sends > 0 && zc.bytes as f64 > 0.95 * stats.bytes_on_wire as f64, "{zc:?} {}", stats.bytes_on_wire);
        assert_eq!(zc.completed, zc.sends, "{zc:?}");
    }
}

#[test]
fn zero_copy_goes_on_counting_when_the_stop_runs_in_turn() {
    if !kvm_or_skip() {
        return;
    }
    // 32 pages rewritten nonstop: the stop has a few pages and runs the
    // stages in turn (every time), with new send stages
    // on sockets that already carried zero-copy sends: the kernel numbers
    // their completions on from there (a fresh count waited 30 s for a
    // completion reported long before, and the destination gave up).
    for _ in 0..3 {
        let options = MigrateOptions {
            zero_copy: true,
            pipeline: true,
            channels: 2,
            codecs: "none".parse().unwrap(),
            ..Default::default()
        };
        let stats = migrate_over(64 << 20, "workload=sparse wss=128K", options, Duration::from_millis(300), true);
        let zc = stats.pipeline.unwrap().zero_copy.expect("zero-copy counters");
        assert_eq!(zc.completed, zc.sends, "{zc:?}");
    }
}

#[test]
fn gpu_path_on_the_kernel_emulator_migrates_and_verifies() {
    if !kvm_or_skip() {
        return;
    }
    if !tsubame_gpu::emu::available() {
        tsubame_testkit::skip_unless_required(
            "TSUBAME_REQUIRE_TOOLS",
            "the GPU kernel emulator was not built (no C++ compiler)",
        );
        return;
    }
    // The GPU kernels compiled for the host, through the pipeline's GPU
    // path; the destination decodes the records with the CPU codecs.
    //
    // XBZRLE hits only when a page is still cached as it is sent again.
    // On this slow path kv rewrites nearly all of its 32 MiB each
    // iteration, and an iteration sends the dirty pages in ascending order.
    // The cache is split between the two codec shards, each of which sees
    // 16 MiB of the working set: with less cache than that per shard, each
    // 2-way LRU set sees a cyclic scan of more pages than it holds, every
    // page is evicted before it comes round again, and nothing hits (on the
    // GPU and the CPU codecs alike) unless an iteration happens to be short
    // enough to leave much of the working set clean. 64M: 32 MiB a shard.
    for channels in [1, 2] {
        let options = MigrateOptions {
            gpu: Some(tsubame_migrate::GpuOffload::Emulator),
            channels,
            encode_threads: 2,
            codecs: "zero,xbzrle=64M,dedup=4M,rle".parse().unwrap(),
            ..Default::default()
        };
        let stats = migrate_workload("workload=kv wss=32M", options);
        assert!(stats.codec.get("xbzrle").is_some_and(|c| c.pages > 0), "{:?}", stats.codec);
    }
}

#[test]
fn zero_copy_refuses_what_it_cannot_do() {
    let options = MigrateOptions { zero_copy: true, codecs: "zero,xbzrle".parse().unwrap(), ..Default::default() };
    assert!(options.check().unwrap_err().contains("--zero-copy"));
    let options = MigrateOptions { zero_copy: true, granularity: 128, granularity_auto: false, ..Default::default() };
    assert!(options.check().is_err());
    // `--granularity auto` sends whole pages with zero-copy instead (and
    // the CLI's default codecs leave lz4 out).
    let options = MigrateOptions { zero_copy: true, codecs: default_codecs(true, false), ..Default::default() };
    assert_eq!((options.check(), options.start_granularity().bytes), (Ok(()), 4096));
}

/// Forwards every connection to `to`; bytes from the source on every
/// connection but the first are held back in random slices, so channel 0's
/// STATE and DIGEST arrive while other channels still carry the last pages.
fn shuffling_proxy(listener: Listener, to: Address, seed: u64) {
    use std::io::{Read, Write};
    let mut rng = seed;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for index in 0.. {
        let Ok(Some(client)) = listener.accept_until(&|| false) else { return };
        let server = tsubame_migrate::transport::Stream::connect(&to, Duration::from_secs(5)).unwrap();
        let (mut c_read, mut s_write) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let (mut s_read, mut c_write) = (server, client);
        let delays: Vec<u64> = (0..64).map(|_| next() % 4).collect();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 << 10];
            let mut i = 0;
            while let Ok(n) = c_read.read(&mut buf) {
                if n == 0 || s_write.write_all(&buf[..n]).is_err() {
                    break;
                }
                if index > 0 {
                    std::thread::sleep(Duration::from_millis(delays[i % delays.len()]));
                }
                i += 1;
            }
            s_write.shutdown();
        });
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 << 10];
            while let Ok(n) = s_read.read(&mut buf) {
                if n == 0 || c_write.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            c_write.shutdown();
        });
    }
}

#[test]
fn channel_barrier_holds_when_channels_lag() {
    if !kvm_or_skip() {
        return;
    }
    for seed in [1u64, 7, 42] {
        let mut vm = Vm::create(&VmConfig { memory_bytes: 64 << 20, hugepages: true }).unwrap();
        let cmdline = format!("workload=stream wss=16M tsc_khz={}", vm.tsc_khz());
        vm.load_guest(guest_elf::GUEST_ELF, &cmdline).unwrap();
        vm.start(false).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let base = std::env::temp_dir().join(format!("tsubame-shuffle-{}-{seed}", std::process::id()));
        let dest_addr = Address::Unix(base.with_extension("dest"));
        let proxy_addr = Address::Unix(base.with_extension("proxy"));
        let dest_listener = Listener::bind(&dest_addr).unwrap();
        let proxy_listener = Listener::bind(&proxy_addr).unwrap();
        let dest = std::thread::spawn(move || receive(&dest_listener, &ReceiveOptions::default(), &|_| {}));
        let to = dest_addr.clone();
        std::thread::spawn(move || shuffling_proxy(proxy_listener, to, seed));
        let options =
            MigrateOptions { channels: 4, encode_threads: 4, postcopy: PostcopyMode::Off, ..Default::default() };
        let stats = source::migrate(&vm, &proxy_addr, &options, &ProgressCell::default());
        let incoming = dest.join().unwrap().expect("destination received the VM");
        assert_eq!(stats.status, Status::Completed, "{:?}", stats.error);
        // Hashing before a lagging channel's last pages landed would show
        // as a mismatch and a repair.
        assert!(stats.digest_verified);
        assert_eq!(stats.regions_repaired, 0, "seed {seed}: a channel's pages were applied after the digest");
        drop(incoming);
        // The proxy's thread keeps its listener (and so its file) for good.
        let _ = std::fs::remove_file(base.with_extension("proxy"));
    }
}

/// Pages the VMM itself writes into guest memory while pre-copy runs (as
/// a device does) reach the destination through the dirty set, not
/// through the final digest's repair pass: KVM's log never sees them.
#[test]
fn pages_the_vmm_writes_during_precopy_reach_the_destination() {
    if !kvm_or_skip() {
        return;
    }
    let mut vm = Vm::create(&VmConfig { memory_bytes: 64 << 20, hugepages: false }).unwrap();
    let cmdline = format!("workload=idle wss=8M tsc_khz={}", vm.tsc_khz());
    vm.load_guest(guest_elf::GUEST_ELF, &cmdline).unwrap();
    // 40 MiB of data beyond the idle guest's 8 MiB: ~2.5 s of pre-copy at
    // 16 MB/s.
    for addr in ((16 << 20)..(56 << 20)).step_by(4096) {
        memory::write(vm.memory(), addr, &[0x5A; 4096]).unwrap();
    }
    let console = vm.take_console().unwrap();
    vm.start(false).unwrap();
    ops_until(&console, Duration::from_millis(300));

    let path = std::env::temp_dir().join(format!("tsubame-vmm-writes-{}", std::process::id()));
    let listener = Listener::bind(&Address::Unix(path)).unwrap();
    let addr = listener.local_address();
    let dest = std::thread::spawn(move || receive(&listener, &ReceiveOptions::default(), &|_| {}));
    // 16 pages just past the idle guest's working set, which iteration 0
    // reads first, rewritten 20 times in the ~200 ms after that.
    let pages: Vec<u64> = (0..16).map(|i| (12 << 20) + i * 4096).collect();
    let vm = std::sync::Arc::new(vm);
    let writer = {
        let (vm, pages) = (vm.clone(), pages.clone());
        std::thread::spawn(move || {
            for round in 0..20u8 {
                for &addr in &pages {
                    memory::write(vm.memory(), addr, &[round + 1; 4096]).unwrap();
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Instant::now()
        })
    };
    let started = Instant::now();
    // Raw pages: lz4 would send the 0x5A pages in a blink.
    let options = MigrateOptions {
        max_bandwidth: Some(16_000_000),
        postcopy: PostcopyMode::Off,
        codecs: "zero".parse().unwrap(),
        ..MigrateOptions::default()
    };
    let stats = source::migrate(&*vm, &addr, &options, &ProgressCell::default());
    let incoming = dest.join().unwrap().expect("destination received the VM");
    let writes_done = writer.join().unwrap();
    assert_eq!(stats.status, Status::Completed, "{:?}", stats.error);
    let paused_at = started + Duration::from_secs_f64((stats.total_time_ms - stats.downtime_ms) / 1e3);
    assert!(writes_done < paused_at, "the writer outlasted pre-copy; the test needs a slower link");
    assert_eq!(stats.regions_repaired, 0, "the VMM's writes were found only by the digest check");
    for &addr in &pages {
        let (mut here, mut there) = ([0u8; 4096], [0u8; 4096]);
        memory::read(vm.memory(), addr, &mut here).unwrap();
        memory::read(incoming.vm.memory(), addr, &mut there).unwrap();
        assert_eq!(here[0], 20);
        assert!(here == there, "page at {addr:#x} differs at the destination");
    }
}
