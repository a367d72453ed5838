//! A pipeline stage's busy time, as wall time and as its threads' CPU
//! time: the wall time says how long the stage held up the pages, the
//! CPU time what the work cost without the waits for a CPU.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::stats::{thread_cpu_time, StageStats};

/// A stage's busy time, as nanoseconds of wall time (waits for a CPU
/// included) and of its threads' CPU time.
#[derive(Default)]
pub(super) struct Busy {
    wall: AtomicU64,
    cpu: AtomicU64,
}

impl Busy {
    pub(super) fn add(&self, wall: Duration, cpu: Duration) {
        self.wall.fetch_add(wall.as_nanos() as u64, Ordering::Relaxed);
        self.cpu.fetch_add(cpu.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Per thread of `threads`.
    pub(super) fn per_thread(&self, threads: u32) -> StageWork {
        let per = |c: &AtomicU64| Duration::from_nanos(c.load(Ordering::Relaxed) / threads.max(1) as u64);
        StageWork { wall: per(&self.wall), cpu: per(&self.cpu) }
    }
}

/// Busy time of a stage so far: wall and CPU.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageWork {
    pub wall: Duration,
    pub cpu: Duration,
}

impl std::ops::AddAssign for StageWork {
    fn add_assign(&mut self, more: StageWork) {
        self.wall += more.wall;
        self.cpu += more.cpu;
    }
}

impl std::ops::Sub for StageWork {
    type Output = StageWork;
    fn sub(self, before: StageWork) -> StageWork {
        StageWork { wall: self.wall.saturating_sub(before.wall), cpu: self.cpu.saturating_sub(before.cpu) }
    }
}

/// Busy time of each stage so far ([`super::engine::Engine::work`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PipelineWork {
    pub fetch: StageWork,
    pub encode: StageWork,
    pub send: StageWork,
}

impl std::ops::Sub for PipelineWork {
    type Output = PipelineWork;
    fn sub(self, before: PipelineWork) -> PipelineWork {
        PipelineWork {
            fetch: self.fetch - before.fetch,
            encode: self.encode - before.encode,
            send: self.send - before.send,
        }
    }
}

/// Both clocks of the calling thread from a start: a piece of work's
/// [`StageWork`].
pub struct Stopwatch {
    wall: Instant,
    cpu: Duration,
}

impl Stopwatch {
    pub fn start() -> Stopwatch {
        Stopwatch { wall: Instant::now(), cpu: thread_cpu_time() }
    }

    /// The work since the start (on the thread that started it).
    pub fn elapsed(&self) -> StageWork {
        StageWork { wall: self.wall.elapsed(), cpu: thread_cpu_time().saturating_sub(self.cpu) }
    }
}

/// Runs `work`, adding its time to `stats` and to the live counter.
pub(super) fn timed<T>(stats: &mut StageStats, live: &Busy, work: impl FnOnce() -> T) -> T {
    let watch = Stopwatch::start();
    let result = work();
    let took = watch.elapsed();
    stats.busy_seconds += took.wall.as_secs_f64();
    live.add(took.wall, took.cpu);
    result
}
