//! `tsubame trace`: record what a running VM dirties, interval by interval,
//! without pausing it: at each tick, read KVM's dirty log, clear each
//! chunk's bits, then diff those pages against a shadow copy.

use std::io::Write;
use std::time::{Duration, Instant};

use tsubame_trace::format::{xbzrle_size, PageChange, Setup, TraceError, TraceWriter};
use tsubame_vmm::{memory, Vm, PAGE_SIZE};

use tsubame_codec::zero::is_zero;
use tsubame_vmm::DirtyBitmap;

/// Bitmap words cleared and read per step.
const WORDS_PER_CHUNK: usize = 16;

/// What to record.
#[derive(Debug, Clone)]
pub struct RecordOptions {
    /// Time between dirty-log reads.
    pub interval: Duration,
    /// How long to record.
    pub duration: Duration,
    /// Sub-page size of the recorded masks.
    pub granularity: u32,
    /// The guest's workload command line, for the header.
    pub workload: String,
    /// How long to time the guest's undisturbed speed before dirty logging
    /// starts (zero: not at all, and the trace replays on wall time).
    pub baseline: Duration,
}

/// Why recording failed.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Writing the trace.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A VM operation.
    #[error("VM: {0}")]
    Vm(#[from] tsubame_vmm::VmError),
    /// Options out of range.
    #[error("{0}")]
    BadOptions(String),
}

/// What was recorded.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RecordSummary {
    /// Intervals written.
    pub intervals: u64,
    /// Page changes written.
    pub changes: u64,
    /// Pages non-zero at the start.
    pub nonzero_pages: u64,
    /// Longest time one tick took (reading log and pages), milliseconds.
    pub longest_tick_ms: f64,
}

/// The guest's ops per second over about `baseline`, timed from one step
/// of its counter to another (it moves once per progress line, ~50 ms of
/// guest work, so timing between steps leaves no partial step). 0 when the
/// counter does not move. The replay's clock rests on this figure, and the
/// guest's speed wanders ±10 % from second to second, so one second is
/// too short a sample.
fn undisturbed_speed(guest_ops: &dyn Fn() -> u64, baseline: Duration) -> u64 {
    if baseline.is_zero() {
        return 0;
    }
    // The first change of the counter after now, if it comes by `deadline`.
    let next_step = |deadline: Instant| -> Option<(Instant, u64)> {
        let before = guest_ops();
        loop {
            let ops = guest_ops();
            if ops != before {
                return Some((Instant::now(), ops));
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let Some((t0, ops0)) = next_step(Instant::now() + baseline) else {
        return 0;
    };
    std::thread::sleep((t0 + baseline).saturating_duration_since(Instant::now()));
    let Some((t1, ops1)) = next_step(t0 + baseline * 2) else {
        return 0;
    };
    (ops1.saturating_sub(ops0) as f64 / t1.duration_since(t0).as_secs_f64()) as u64
}

/// Records `vm` into `out`. The VM keeps running throughout. `guest_ops`
/// tells the guest's ops counter (its latest progress line), written with
/// each interval so that replay can follow the guest's work, which dirty
/// logging slows, rather than wall time.
pub fn record(
    vm: &Vm,
    out: impl Write,
    options: &RecordOptions,
    guest_ops: &dyn Fn() -> u64,
) -> Result<RecordSummary, RecordError> {
    crate::subpage::check_granularity(options.granularity).map_err(RecordError::BadOptions)?;
    if options.interval < Duration::from_millis(1) || options.duration < options.interval {
        return Err(RecordError::BadOptions("interval must be at least 1 ms and no longer than the recording".into()));
    }
    let pages = memory::page_count(vm.memory());
    let mut shadow = vec![0u8; pages as usize * PAGE_SIZE];
    let mut bitmap = vm.dirty_bitmap();
    let mut nonzero = DirtyBitmap::new(pages);
    let pagemap = memory::Pagemap::open().ok();
    let mut page = [0u8; PAGE_SIZE];
    let mut populated = [true; WORDS_PER_CHUNK * 64];
    let native_ops_per_sec = undisturbed_speed(guest_ops, options.baseline);

    vm.set_dirty_logging(true)?;
    let result = (|| {
        // The starting contents: every page, read after its bit is cleared.
        if vm.manual_dirty_protect() {
            vm.dirty_log(&mut bitmap)?;
        } else {
            bitmap.set_all();
        }
        for (first, chunk) in bitmap.chunks(WORDS_PER_CHUNK) {
            vm.clear_dirty_log(first, chunk)?;
            let populated = &mut populated[..chunk.len() * 64];
            if pagemap.as_ref().is_none_or(|p| p.populated(vm.memory(), first, populated).is_err()) {
                populated.fill(true);
            }
            for (offset, &is_populated) in populated.iter().enumerate() {
                let index = first + offset as u64;
                if index >= pages || !is_populated {
                    continue;
                }
                memory::read_page(vm.memory(), index, &mut page).map_err(tsubame_vmm::VmError::from)?;
                if !is_zero(&page) {
                    shadow[index as usize * PAGE_SIZE..][..PAGE_SIZE].copy_from_slice(&page);
                    nonzero.set(index);
                }
            }
        }
        let setup = Setup {
            memory_bytes: vm.memory_bytes(),
            granularity: options.granularity,
            interval_us: options.interval.as_micros() as u32,
            workload: options.workload.clone(),
            native_ops_per_sec,
            huge_pages: vm.hugepages(),
        };
        let mut writer = TraceWriter::new(out, &setup, nonzero.words())?;
        let mut summary =
            RecordSummary { intervals: 0, changes: 0, nonzero_pages: nonzero.count(), longest_tick_ms: 0.0 };
        let g = options.granularity as usize;
        let start = Instant::now();
        let mut changes = Vec::new();
        let mut tick = 1u32;
        while start.elapsed() < options.duration {
            let due = start + options.interval * tick;
            tick += 1;
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let began = Instant::now();
            let at_us = start.elapsed().as_micros() as u64;
            vm.dirty_log(&mut bitmap)?;
            changes.clear();
            for (first, chunk) in bitmap.chunks(WORDS_PER_CHUNK) {
                if chunk.iter().all(|&w| w == 0) {
                    continue;
                }
                vm.clear_dirty_log(first, chunk)?;
                for (w, &word) in chunk.iter().enumerate() {
                    let mut bits = word;
                    while bits != 0 {
                        let index = first + (w * 64) as u64 + bits.trailing_zeros() as u64;
                        bits &= bits - 1;
                        memory::read_page(vm.memory(), index, &mut page).map_err(tsubame_vmm::VmError::from)?;
                        let held = &mut shadow[index as usize * PAGE_SIZE..][..PAGE_SIZE];
                        let mut mask = 0u64;
                        for (i, (now, was)) in page.chunks_exact(g).zip(held.chunks_exact(g)).enumerate() {
                            if now != was {
                                mask |= 1 << i;
                            }
                        }
                        let held_page = (&*held).try_into().expect("a page");
                        let xbzrle_bytes = xbzrle_size(held_page, &page).unwrap_or(PAGE_SIZE as u32 + 1);
                        changes.push(PageChange { page: index, mask, xbzrle_bytes, zero: is_zero(&page) });
                        if mask != 0 {
                            held.copy_from_slice(&page);
                        }
                    }
                }
            }
            writer.interval(at_us, guest_ops(), &changes)?;
            summary.intervals += 1;
            summary.changes += changes.len() as u64;
            summary.longest_tick_ms = summary.longest_tick_ms.max(began.elapsed().as_secs_f64() * 1e3);
        }
        writer.finish()?;
        Ok(summary)
    })();
    let _ = vm.set_dirty_logging(false);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undisturbed_speed_is_timed_between_counter_steps() {
        // A guest doing 1M ops/s that reports every 50 ms, as progress lines do.
        let start = Instant::now();
        let counter = || (start.elapsed().as_millis() as u64 / 50) * 50_000;
        let speed = undisturbed_speed(&counter, Duration::from_millis(300));
        assert!((980_000..=1_020_000).contains(&speed), "{speed}");
        assert_eq!(undisturbed_speed(&|| 7, Duration::from_millis(20)), 0, "a still counter is unknown speed");
        assert_eq!(undisturbed_speed(&counter, Duration::ZERO), 0);
    }
}
