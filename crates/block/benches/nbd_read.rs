//! The physical floor under a far-memory fault: one 4 KiB NBD read over a
//! Unix socket to `nbdkit memory`, one request in flight, measured alone
//! (no VM, no userfaultfd). The far-memory summary's fault latency (the
//! fault seen, the page read, installed and the vCPU woken) compares with
//! this. Prints p50, p99 and the mean of 20,000 reads at random offsets.
//!
//! `cargo bench -p tsubame-block --bench nbd_read` (needs nbdkit).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tsubame_block::{NbdClient, NbdUri};

const READS: usize = 20_000;
const EXPORT: u64 = 256 << 20;

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() {
    let dir = std::env::temp_dir().join(format!("tsb-nbd-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let sock = dir.join("mem.sock");
    let server = match Command::new("nbdkit")
        .args(["-f", "-U"])
        .arg(&sock)
        .args(["memory", &EXPORT.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(child) => Server(child),
        Err(e) => {
            eprintln!("nbd_read: skipped: cannot run nbdkit ({e}); scripts/setup.sh installs it");
            return;
        }
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !sock.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let uri: NbdUri = format!("nbd+unix:///?socket={}", sock.display()).parse().expect("a valid URI");
    let mut client = NbdClient::connect_unix(&uri, &sock, Duration::from_secs(5)).expect("nbdkit answers");
    let mut page = vec![0u8; 4096];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next_offset = || {
        // xorshift: random pages over the export, no allocation in the loop.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % (EXPORT / 4096)) * 4096
    };
    for _ in 0..1000 {
        client.read_at(next_offset(), &mut page).expect("read");
    }
    let mut took: Vec<Duration> = Vec::with_capacity(READS);
    for _ in 0..READS {
        let offset = next_offset();
        let start = Instant::now();
        client.read_at(offset, &mut page).expect("read");
        took.push(start.elapsed());
    }
    took.sort();
    let mean = took.iter().sum::<Duration>() / READS as u32;
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "nbd_read: 4 KiB over a Unix socket to nbdkit memory, one in flight, {READS} reads: \
         p50 {:.1} µs, p99 {:.1} µs, mean {:.1} µs",
        us(took[READS / 2]),
        us(took[READS * 99 / 100]),
        us(mean)
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
