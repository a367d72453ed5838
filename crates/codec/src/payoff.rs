//! Whether a codec pays for its time at the link's bandwidth, judged
//! over windows of its input; one that does not sits out a while.

/// Input per payoff judgement: 256 pages, or one batch.
const WINDOW_BYTES: u64 = 1 << 20;
/// Input a codec sits out after it did not pay, before it is tried
/// again: 4096 pages, or four 1024-page batches; twice as long each time
/// it again did not pay, up to [`MAX_BENCH_BYTES`] (lz4 over a kv guest's
/// text-like pages, which it never shrinks, compressed 82 MiB of 1 GiB
/// with a fixed bench).
const BENCH_BYTES: u64 = 16 << 20;
const MAX_BENCH_BYTES: u64 = 256 << 20;
/// The least share of the bytes a codec must save while the bandwidth is
/// unknown (lz4 over a kv guest's text-like pages saves 1-3 %: it ran
/// over the first 100 MiB of 1 GiB before the link was measured).
pub const UNKNOWN_SAVING: f64 = 1.0 / 8.0;

/// Tracks whether a codec pays for its time at the current bandwidth and
/// benches it for a while when it does not.
///
/// Over each window of about 1 MiB of input it compares the estimated
/// encode time plus the time to send the output with the time to send the
/// input raw; when `encode + out / bw >= in / bw` the codec sits out about
/// 16 MiB of input (counted in items of the window's average size), then
/// gets another window. A bandwidth that is not finite and positive means
/// "unknown": then only a codec that saves less than [`UNKNOWN_SAVING`] of
/// the bytes sits out (at any bandwidth where it would pay, its time
/// could have sent what it saved several times over).
#[derive(Debug, Default, Clone, Copy)]
pub struct Payoff {
    window_in: u64,
    window_out: u64,
    window_items: u64,
    timed_in: u64,
    timed_seconds: f64,
    off_for: u64,
    switched_off: u64,
    /// Times in a row it did not pay.
    misses: u32,
    /// Never judged: the codec stays on (see [`Payoff::always_on`]).
    always_on: bool,
}

impl Payoff {
    /// A payoff that never benches its codec: the GPU encoder keeps every
    /// codec on, and its CPU reference must too.
    pub fn always_on() -> Payoff {
        Payoff { always_on: true, ..Payoff::default() }
    }

    /// Whether to use the codec for the next item (counts down a bench).
    pub fn enabled(&mut self) -> bool {
        if self.off_for > 0 {
            self.off_for -= 1;
            return false;
        }
        true
    }

    /// Whether the codec is in use now (does not count down).
    pub fn is_on(&self) -> bool {
        self.off_for == 0
    }

    /// Times the codec was switched off.
    pub fn switched_off(&self) -> u64 {
        self.switched_off
    }

    /// Records one timed use; judges at the end of a window.
    pub fn record(&mut self, seconds: f64, bytes_in: usize, bytes_out: usize, bandwidth: f64) {
        self.timed_in += bytes_in as u64;
        self.timed_seconds += seconds;
        self.record_untimed(bytes_in, bytes_out, bandwidth);
    }

    /// Records one use that was not timed (its time is estimated from the
    /// timed ones); judges at the end of a window.
    pub fn record_untimed(&mut self, bytes_in: usize, bytes_out: usize, bandwidth: f64) {
        if self.always_on {
            return;
        }
        self.window_in += bytes_in as u64;
        self.window_out += bytes_out as u64;
        self.window_items += 1;
        if self.window_in < WINDOW_BYTES || self.timed_in == 0 {
            return;
        }
        let (bytes_in, bytes_out) = (self.window_in as f64, self.window_out as f64);
        let pays = if bandwidth.is_finite() && bandwidth > 0.0 {
            let encode = self.timed_seconds * bytes_in / self.timed_in as f64;
            encode + bytes_out / bandwidth < bytes_in / bandwidth
        } else {
            bytes_out <= (1.0 - UNKNOWN_SAVING) * bytes_in
        };
        if pays {
            self.misses = 0;
        } else {
            let item = (self.window_in / self.window_items).max(1);
            let bench = (BENCH_BYTES << self.misses.min(8)).min(MAX_BENCH_BYTES);
            self.off_for = (bench / item).max(1);
            self.switched_off += 1;
            self.misses += 1;
        }
        *self =
            Payoff { off_for: self.off_for, switched_off: self.switched_off, misses: self.misses, ..Payoff::default() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PAGE_SIZE;

    #[test]
    fn payoff_benches_a_slow_codec_and_tries_it_again() {
        let mut p = Payoff::default();
        let pages = (WINDOW_BYTES / PAGE_SIZE as u64) as usize;
        for _ in 0..pages {
            assert!(p.enabled());
            p.record(1e-6, PAGE_SIZE, PAGE_SIZE - 1, 1e9); // 1 µs to save 1 ns of wire
        }
        assert!(!p.is_on());
        let benched = (0..100_000).take_while(|_| !p.enabled()).count();
        assert_eq!(benched, (BENCH_BYTES / PAGE_SIZE as u64) as usize);
        assert_eq!(p.switched_off(), 1);
        // Not paying again benches it twice as long, until it pays.
        let miss = |p: &mut Payoff, saves: usize| {
            for _ in 0..pages {
                p.record(1e-6, PAGE_SIZE, PAGE_SIZE - saves, 1e9);
            }
            (0..1_000_000).take_while(|_| !p.enabled()).count()
        };
        assert_eq!(miss(&mut p, 1), 2 * (BENCH_BYTES / PAGE_SIZE as u64) as usize);
        assert_eq!(miss(&mut p, 1), 4 * (BENCH_BYTES / PAGE_SIZE as u64) as usize);
        assert_eq!(miss(&mut p, PAGE_SIZE / 2), 0, "it paid: on");
        assert_eq!(miss(&mut p, 1), (BENCH_BYTES / PAGE_SIZE as u64) as usize, "a fresh bench after it paid");
        for _ in 0..10 {
            miss(&mut p, 1);
        }
        assert_eq!(miss(&mut p, 1), (MAX_BENCH_BYTES / PAGE_SIZE as u64) as usize);
    }

    #[test]
    fn payoff_keeps_a_codec_that_pays_and_waits_for_a_bandwidth() {
        // Halves the bytes at 1 µs a page: pays on a 1 Gbit/s link (4 µs
        // saved per page), not on a 100 Gbit/s one (40 ns saved).
        for (bw, pays) in [(125e6, true), (12.5e9, false), (f64::INFINITY, true), (0.0, true)] {
            let mut p = Payoff::default();
            for i in 0..2 * WINDOW_BYTES as usize / PAGE_SIZE {
                if i % 8 == 0 {
                    p.record(1e-6, PAGE_SIZE, PAGE_SIZE / 2, bw);
                } else {
                    p.record_untimed(PAGE_SIZE, PAGE_SIZE / 2, bw);
                }
            }
            assert_eq!(p.is_on(), pays, "bandwidth {bw}");
        }
        // With the bandwidth unknown, a codec saving 1 % sits out.
        let mut p = Payoff::default();
        for _ in 0..2 * WINDOW_BYTES as usize / PAGE_SIZE {
            p.record(1e-7, PAGE_SIZE, PAGE_SIZE * 99 / 100, f64::INFINITY);
        }
        assert!(!p.is_on());
    }
}
