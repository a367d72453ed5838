//! The NBD client against a real server: `nbdkit memory`. Without nbdkit
//! these tests are skipped (scripts/setup.sh installs it); under
//! TSUBAME_REQUIRE_TOOLS, as `cargo xtask test` runs them, they fail, so
//! CI cannot pass by not running them.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use tsubame_block::nbd::{flags, NbdClient, NbdUri, MAX_IN_FLIGHT};
use tsubame_block::DiskSpec;

const TIMEOUT: Duration = Duration::from_secs(10);

/// An nbdkit process on a free port, killed on drop.
struct Nbdkit {
    child: Child,
    port: u16,
}

impl Nbdkit {
    /// Starts `nbdkit [filters] PLUGIN ARGS...` on localhost.
    fn start(args: &[&str]) -> Nbdkit {
        let port = unused_port();
        let child = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-i", "127.0.0.1", "-p", &port.to_string()])
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run nbdkit ({e}): install it (apt-get install nbdkit); the NBD tests need a real server")
            });
        let mut server = Nbdkit { child, port };
        let start = Instant::now();
        // Ready once nbdkit greets: a bare TCP connect succeeded while it
        // was still starting, and the test's first client was then reset
        // (CI saw it twice).
        while !greets(port) {
            if let Some(status) = server.child.try_wait().unwrap() {
                panic!("nbdkit {args:?} exited: {status}");
            }
            assert!(start.elapsed() < TIMEOUT, "nbdkit did not serve on port {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    fn uri(&self, export: &str) -> NbdUri {
        NbdUri::parse(&format!("nbd://127.0.0.1:{}/{export}", self.port)).unwrap()
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// True when a server on `port` sends the NBD greeting.
fn greets(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let mut magic = [0u8; 8];
    stream.read_exact(&mut magic).is_ok() && &magic == b"NBDMAGIC"
}

/// A port for one nbdkit of this process. Not "bind port 0 and let go":
/// two tests running at once could be handed the same ephemeral port, and
/// one test's client then talked to the other test's server (CI saw it).
/// Ports below the ephemeral range, a distinct one per call, offset by the
/// process id so that two test processes do not meet; a port some other
/// program holds is skipped by trying to bind it first.
fn unused_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20_000 + (std::process::id() % 500) as u16 * 20;
    (0..100)
        .map(|_| base + NEXT.fetch_add(1, Ordering::Relaxed) % 20)
        .find(|&port| TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("no free port for nbdkit")
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| (i.wrapping_mul(131) ^ seed.wrapping_mul(7)) as u8).collect()
}

#[test]
fn memory_export_round_trips_and_is_shared() {
    if !tsubame_testkit::program("nbdkit") {
        return;
    }
    let server = Nbdkit::start(&["memory", "64M"]);
    let mut client = NbdClient::connect(&server.uri(""), TIMEOUT).unwrap();
    assert_eq!(client.size(), 64 << 20);
    let export = client.export();
    assert!(export.has(flags::SEND_FLUSH) && export.has(flags::SEND_CACHE), "flags {:#x}", export.flags);

    // Plain writes and reads, including one split over several requests.
    let small = pattern(1, 4096);
    client.write_at(4096, &small).unwrap();
    let big = pattern(2, 40 << 20);
    client.write_at(16 << 20, &big).unwrap();
    let mut back = vec![0; small.len()];
    client.read_at(4096, &mut back).unwrap();
    assert_eq!(back, small);
    let mut back = vec![0; big.len()];
    client.read_at(16 << 20, &mut back).unwrap();
    assert!(back == big, "40 MiB read back differs");
    client.flush().unwrap();
    client.cache(0, 1 << 20).unwrap();
    client.trim(8 << 20, 4096).unwrap();

    // Many requests in flight: pipelined writes, then reads into buffers.
    let count = MAX_IN_FLIGHT * 4;
    let handles: Vec<_> =
        (0..count).map(|i| client.submit_write(i as u64 * 8192, &pattern(i as u64 + 10, 4096)).unwrap()).collect();
    for handle in handles {
        client.wait(handle).unwrap();
    }
    let mut bufs = vec![vec![0u8; 4096]; count];
    let mut reads: Vec<(u64, &mut [u8])> =
        bufs.iter_mut().enumerate().map(|(i, b)| (i as u64 * 8192, &mut b[..])).collect();
    client.read_many(&mut reads).unwrap();
    for (i, buf) in bufs.iter().enumerate() {
        assert!(*buf == pattern(i as u64 + 10, 4096), "buffer {i}");
    }

    // A second connection (through the Backend path) sees the writes.
    let mut other = tsubame_block::open(&DiskSpec::Nbd(server.uri("").to_string())).unwrap();
    let mut seen = vec![0; 4096];
    other.read_at(8192 * 3, &mut seen).unwrap();
    assert_eq!(seen, pattern(13, 4096));
    other.write_at(0, &[0xAB; 4096]).unwrap();
    let mut back = [0; 4096];
    client.read_at(0, &mut back).unwrap();
    assert_eq!(back, [0xAB; 4096]);
}

#[test]
fn named_exports_and_errors_from_nbdkit() {
    if !tsubame_testkit::program("nbdkit") {
        return;
    }
    // The exportname filter lists one export and refuses others.
    let server = Nbdkit::start(&["--filter=exportname", "memory", "1M", "exportname=vm1", "exportname-strict=true"]);
    let client = NbdClient::connect(&server.uri("vm1"), TIMEOUT).unwrap();
    assert_eq!(client.size(), 1 << 20);
    let err = NbdClient::connect(&server.uri("vm2"), TIMEOUT).err().unwrap();
    let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
    assert!(chain.contains("export 'vm2' not found on 127.0.0.1:"), "{chain}");

    // A size that is not whole 4 KiB blocks.
    let odd = Nbdkit::start(&["memory", "10000"]);
    let err = NbdClient::connect(&odd.uri(""), TIMEOUT).err().unwrap();
    let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
    assert!(chain.contains("multiple of 4 KiB"), "{chain}");

    // Server-side errors: the error filter fails every read with EIO.
    let failing = Nbdkit::start(&["--filter=error", "memory", "1M", "error=EIO", "error-pread-rate=100%"]);
    let mut client = NbdClient::connect(&failing.uri(""), TIMEOUT).unwrap();
    let err = client.read_at(0, &mut [0; 4096]).unwrap_err();
    let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
    assert!(chain.contains("EIO"), "{chain}");
    client.write_at(0, &[1; 4096]).unwrap();
}

#[test]
fn pipelined_reads_beat_sequential_ones_on_a_slow_server() {
    if !tsubame_testkit::program("nbdkit") {
        return;
    }
    // Every read takes 5 ms on the server; nbdkit runs requests of one
    // connection on several threads, so requests in flight overlap.
    let server = Nbdkit::start(&["--filter=delay", "memory", "64M", "rdelay=5ms"]);
    let mut client = NbdClient::connect(&server.uri(""), TIMEOUT).unwrap();
    const READS: usize = 64;
    let mut buf = vec![0u8; 4096];
    let start = Instant::now();
    for i in 0..READS {
        client.read_at(i as u64 * 4096, &mut buf).unwrap();
    }
    let sequential = start.elapsed();
    let mut bufs = vec![vec![0u8; 4096]; READS];
    let mut reads: Vec<(u64, &mut [u8])> =
        bufs.iter_mut().enumerate().map(|(i, b)| (i as u64 * 4096, &mut b[..])).collect();
    let start = Instant::now();
    client.read_many(&mut reads).unwrap();
    let pipelined = start.elapsed();
    eprintln!("{READS} reads of 4 KiB at 5 ms each: sequential {sequential:?}, pipelined {pipelined:?}");
    assert!(sequential >= Duration::from_millis(5 * READS as u64));
    assert!(pipelined * 3 < sequential, "pipelined {pipelined:?} vs sequential {sequential:?}");
}

#[test]
fn a_unix_socket_export_opens_from_its_uri() {
    if !tsubame_testkit::program("nbdkit") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tsubame-nbd-unix-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("nbd.sock");
    let mut child = Command::new("nbdkit")
        .args(["-f", "--exit-with-parent", "-U"])
        .arg(&socket)
        .args(["memory", "8M"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run nbdkit ({e}): install it (apt-get install nbdkit)"));
    let start = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(start.elapsed() < TIMEOUT, "nbdkit did not listen on {}", socket.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    let spec: DiskSpec = format!("nbd+unix:///?socket={}", socket.display()).parse().unwrap();
    let mut disk = tsubame_block::open(&spec).unwrap();
    assert_eq!(disk.size(), 8 << 20);
    let data = pattern(9, 8192);
    disk.write_at(4096, &data).unwrap();
    let mut second = tsubame_block::open(&spec).unwrap();
    let mut back = vec![0; data.len()];
    second.read_at(4096, &mut back).unwrap();
    assert_eq!(back, data, "a second connection sees the first's writes");
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
