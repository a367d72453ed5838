//! `--max-bandwidth`: a token bucket every channel of a migration shares,
//! and the writer that draws from it.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A token bucket shared by every channel of a migration: `--max-bandwidth`
/// caps their sum. Also counts the bytes they wrote.
pub struct Pacer {
    /// Bytes per second; 0 = unlimited.
    rate: AtomicU64,
    /// Bucket depth in microseconds: how far ahead of the rate a burst may run.
    burst_us: AtomicU64,
    bucket: Mutex<Bucket>,
    bytes: AtomicU64,
}

struct Bucket {
    tokens: f64,
    last: Instant,
}

/// Bucket depth by default: how far ahead of the rate a burst may run.
const BURST: Duration = Duration::from_millis(10);

impl Pacer {
    /// A pacer for `rate` bytes per second (None = unlimited).
    pub fn new(rate: Option<u64>) -> Arc<Pacer> {
        Arc::new(Pacer {
            rate: AtomicU64::new(rate.unwrap_or(0)),
            burst_us: AtomicU64::new(BURST.as_micros() as u64),
            bucket: Mutex::new(Bucket { tokens: 0.0, last: Instant::now() }),
            bytes: AtomicU64::new(0),
        })
    }

    /// Changes the rate (None = unlimited) from now on.
    pub fn set_rate(&self, rate: Option<u64>) {
        self.rate.store(rate.unwrap_or(0), Ordering::Relaxed);
    }

    /// Changes how far ahead of the rate a burst may run: shorter bursts
    /// keep a shaped link's queue short (post-copy's asked-for pages pass
    /// it on another connection).
    pub fn set_burst(&self, burst: Duration) {
        self.burst_us.store(burst.as_micros().max(1) as u64, Ordering::Relaxed);
    }

    fn burst(&self) -> f64 {
        self.burst_us.load(Ordering::Relaxed) as f64 / 1e6
    }

    fn rate(&self) -> Option<u64> {
        Some(self.rate.load(Ordering::Relaxed)).filter(|&r| r > 0)
    }

    /// Bytes written through this pacer so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Waits until `n` bytes may go and counts them: for writes that
    /// bypass [`Metered`] (zero-copy sends).
    pub fn pace(&self, n: usize) {
        self.wait_for(n);
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Takes `n` bytes out of the bucket without waiting: bytes that went
    /// on the same link another way (post-copy's asked-for pages), which
    /// the paced writers then leave room for. Not counted in [`bytes`].
    ///
    /// [`bytes`]: Pacer::bytes
    pub fn charge(&self, n: usize) {
        let Some(rate) = self.rate() else { return };
        let rate = rate as f64;
        let mut b = self.bucket.lock().unwrap();
        let now = Instant::now();
        b.tokens = (b.tokens + now.duration_since(b.last).as_secs_f64() * rate).min(rate * self.burst());
        b.last = now;
        b.tokens -= n as f64;
    }

    /// The largest write that may go in one step.
    fn slice(&self, len: usize) -> usize {
        match self.rate() {
            Some(rate) => len.min(((rate as f64 * self.burst()) as usize).max(4096)),
            None => len,
        }
    }

    /// Sleeps until `n` bytes may go.
    fn wait_for(&self, n: usize) {
        let Some(rate) = self.rate() else { return };
        let rate = rate as f64;
        let cap = (rate * self.burst()).max(n as f64);
        let debt = {
            let mut b = self.bucket.lock().unwrap();
            let now = Instant::now();
            b.tokens = (b.tokens + now.duration_since(b.last).as_secs_f64() * rate).min(cap);
            b.last = now;
            b.tokens -= n as f64;
            -b.tokens
        };
        if debt > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(debt / rate));
        }
    }
}

/// A writer that counts bytes and holds them to its pacer's rate.
pub struct Metered<W> {
    inner: W,
    /// Bytes written through this writer.
    pub bytes: u64,
    pacer: Arc<Pacer>,
}

impl<W: Write> Metered<W> {
    /// Wraps `inner`, paced by `pacer` (shared with the other channels).
    pub fn new(inner: W, pacer: Arc<Pacer>) -> Self {
        Metered { inner, bytes: 0, pacer }
    }

    /// The wrapped writer.
    pub fn get_ref(&self) -> &W {
        &self.inner
    }
}

impl<W: Write> Write for Metered<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // Pace in slices so a big buffer does not burst past the rate.
        let slice = self.pacer.slice(buf.len());
        self.pacer.wait_for(slice);
        let n = self.inner.write(&buf[..slice])?;
        self.bytes += n as u64;
        self.pacer.bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metered_writer_holds_the_rate() {
        let mut w = Metered::new(std::io::sink(), Pacer::new(Some(10_000_000)));
        let start = Instant::now();
        let chunk = vec![0u8; 100_000];
        for _ in 0..20 {
            w.write_all(&chunk).unwrap();
        }
        let secs = start.elapsed().as_secs_f64();
        assert_eq!(w.bytes, 2_000_000);
        // 2 MB at 10 MB/s: 0.2 s, less the one burst allowance.
        assert!(secs > 0.17, "2 MB at 10 MB/s took only {secs:.3} s");
    }

    #[test]
    fn charged_bytes_slow_the_paced_writers() {
        let pacer = Pacer::new(Some(10_000_000));
        let mut w = Metered::new(std::io::sink(), pacer.clone());
        let start = Instant::now();
        // 1 MB charged (went another way) and 1 MB written: 0.2 s.
        pacer.charge(1_000_000);
        w.write_all(&vec![0u8; 1_000_000]).unwrap();
        let secs = start.elapsed().as_secs_f64();
        assert!(secs > 0.17, "2 MB at 10 MB/s took only {secs:.3} s");
        assert_eq!(pacer.bytes(), 1_000_000, "charged bytes are not the writers'");
    }
}
