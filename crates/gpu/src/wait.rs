//! How the host waits for the GPU (GMigrate's question: without burning a
//! core). The policy only changes how the waiting thread spends its time,
//! never what is computed.

use std::time::Duration;

/// How to wait for a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WaitPolicy {
    /// Poll the completion event in a loop (a core at 100 %).
    Spin,
    /// GMigrate: sleep for the shortest batch time sampled over the first
    /// batches, then synchronize.
    SleepMin,
    /// Block in the driver on an event created with
    /// `CU_EVENT_BLOCKING_SYNC` (the thread sleeps until an interrupt).
    #[default]
    Blocking,
}

impl std::str::FromStr for WaitPolicy {
    type Err = String;

    /// `spin`, `sleep-min` or `blocking` (the `--gpu-wait` values).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "spin" => Ok(WaitPolicy::Spin),
            "sleep-min" => Ok(WaitPolicy::SleepMin),
            "blocking" => Ok(WaitPolicy::Blocking),
            _ => Err(format!("unknown GPU wait policy '{s}' (known: spin, sleep-min, blocking)")),
        }
    }
}

impl std::fmt::Display for WaitPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WaitPolicy::Spin => "spin",
            WaitPolicy::SleepMin => "sleep-min",
            WaitPolicy::Blocking => "blocking",
        })
    }
}

/// Batches sampled before [`SleepMin`] starts sleeping.
pub const SAMPLES: usize = 32;

/// The sleep-min policy's state: while sampling, the caller spins and
/// reports each batch's time from submit to completion; afterwards it
/// sleeps for the shortest sample minus the time already passed, then
/// synchronizes.
#[derive(Debug, Clone, Default)]
pub struct SleepMin {
    samples: usize,
    shortest: Option<Duration>,
}

impl SleepMin {
    /// True while batches are still being sampled.
    pub fn sampling(&self) -> bool {
        self.samples < SAMPLES
    }

    /// Records one sampled batch time.
    pub fn record(&mut self, batch: Duration) {
        self.samples += 1;
        self.shortest = Some(self.shortest.map_or(batch, |s| s.min(batch)));
    }

    /// How long to sleep for a batch submitted `elapsed` ago; None while
    /// sampling.
    pub fn sleep_for(&self, elapsed: Duration) -> Option<Duration> {
        if self.sampling() {
            return None;
        }
        Some(self.shortest.unwrap_or_default().saturating_sub(elapsed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sleep_min_samples_then_sleeps_the_shortest_time_left() {
        let mut s = SleepMin::default();
        for i in 0..SAMPLES {
            assert!(s.sampling());
            assert_eq!(s.sleep_for(Duration::ZERO), None);
            s.record(Duration::from_micros(500 - i as u64));
        }
        assert!(!s.sampling());
        let shortest = Duration::from_micros(500 - (SAMPLES as u64 - 1));
        assert_eq!(s.sleep_for(Duration::ZERO), Some(shortest));
        assert_eq!(s.sleep_for(Duration::from_micros(100)), Some(shortest - Duration::from_micros(100)));
        assert_eq!(s.sleep_for(Duration::from_secs(1)), Some(Duration::ZERO));
    }

    #[test]
    fn policies_parse_and_print() {
        for p in [WaitPolicy::Spin, WaitPolicy::SleepMin, WaitPolicy::Blocking] {
            assert_eq!(p.to_string().parse::<WaitPolicy>(), Ok(p));
        }
        assert!("busy".parse::<WaitPolicy>().unwrap_err().contains("known: spin, sleep-min, blocking"));
    }
}
