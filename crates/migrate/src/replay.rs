//! A migration source without KVM: plain memory whose pages a thread
//! changes as a recorded dirty trace says, in real time, with a dirty log
//! kept in software. The real engine (pipeline, codecs, channels, GPU)
//! migrates it like a VM, e.g. on a machine with a GPU but no /dev/kvm.
//!
//! Contents: pages that were non-zero when the trace started get
//! structured data (records with counters, text, zero runs), and each
//! changed sub-page of a trace interval gets one 8-byte word rewritten —
//! what a key-value store's update looks like — so the codecs see
//! realistic pages. A page the trace saw zeroed is zeroed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tsubame_trace::format::Trace;
use tsubame_vmm::memory::{self, GuestMemory};
use tsubame_vmm::{DirtyBitmap, VcpuStatus, VmError, PAGE_SIZE};

use crate::source::SourceVm;

/// Counters of the replay, for "the guest continues".
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplayProgress {
    /// Trace intervals replayed (the trace loops).
    pub intervals: u64,
    /// Page changes applied.
    pub page_writes: u64,
}

struct Shared {
    /// Its writes mark the pages they dirty in the memory's bitmap, which
    /// `dirty_log` takes.
    memory: Arc<GuestMemory>,
    paused: Mutex<bool>,
    resumed: std::sync::Condvar,
    stop: AtomicBool,
    intervals: AtomicU64,
    page_writes: AtomicU64,
}

/// A trace replaying into plain memory.
pub struct TraceReplay {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Why a replay cannot start.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Mapping the memory.
    #[error("cannot map {bytes} bytes of memory for the replay: {detail}")]
    Memory {
        /// Size asked for.
        bytes: u64,
        /// Why it failed.
        detail: String,
    },
    /// Nothing to replay.
    #[error("the trace has no intervals to replay")]
    Empty,
}

impl TraceReplay {
    /// Fills memory as the trace's start and replays it at `speed` × real
    /// time (looping at the end) until dropped.
    pub fn start(trace: Trace, speed: f64) -> Result<TraceReplay, ReplayError> {
        if trace.intervals.is_empty() {
            return Err(ReplayError::Empty);
        }
        let bytes = trace.setup.memory_bytes.next_multiple_of(2 << 20);
        let memory = memory::create(bytes, true).map_err(|e| ReplayError::Memory { bytes, detail: e.to_string() })?;
        let pages = memory::page_count(&memory);
        let mut page = [0u8; PAGE_SIZE];
        for index in DirtyBitmap::from_words(trace.nonzero.clone(), pages).iter() {
            initial_page(index, &mut page);
            let _ = memory::write(&memory, index * PAGE_SIZE as u64, &page);
        }
        let shared = Arc::new(Shared {
            memory: Arc::new(memory),
            paused: Mutex::new(false),
            resumed: std::sync::Condvar::new(),
            stop: AtomicBool::new(false),
            intervals: AtomicU64::new(0),
            page_writes: AtomicU64::new(0),
        });
        let worker = shared.clone();
        let speed = if speed > 0.0 { speed } else { 1.0 };
        let thread = std::thread::Builder::new()
            .name("trace-replay".into())
            .spawn(move || replay_loop(&worker, &trace, speed))
            .expect("spawn replay thread");
        Ok(TraceReplay { shared, thread: Some(thread) })
    }

    /// How far the replay got.
    pub fn progress(&self) -> ReplayProgress {
        ReplayProgress {
            intervals: self.shared.intervals.load(Ordering::Relaxed),
            page_writes: self.shared.page_writes.load(Ordering::Relaxed),
        }
    }
}

impl Drop for TraceReplay {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        *self.shared.paused.lock().unwrap() = false;
        self.shared.resumed.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Structured, kv-like contents for a page that starts non-zero: 64-byte
/// records of a key, a counter, some text and a zero tail.
fn initial_page(index: u64, page: &mut [u8; PAGE_SIZE]) {
    page.fill(0);
    for (r, record) in page.chunks_exact_mut(64).enumerate() {
        let key = index * 64 + r as u64;
        record[..8].copy_from_slice(&key.to_le_bytes());
        record[8..16].copy_from_slice(&(key.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
        record[16..40].copy_from_slice(b"tsubame-replay-value-txt");
    }
}

fn replay_loop(shared: &Shared, trace: &Trace, speed: f64) {
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let g = trace.setup.granularity as usize;
    let zeros = [0u8; PAGE_SIZE];
    let pages = memory::page_count(&shared.memory);
    loop {
        let lap = Instant::now();
        for interval in &trace.intervals {
            // Wait for this interval's time, in slices, so stop acts fast.
            let due = lap + Duration::from_secs_f64(interval.at_us as f64 / 1e6 / speed);
            loop {
                if shared.stop.load(Ordering::Acquire) {
                    return;
                }
                let now = Instant::now();
                if now >= due {
                    break;
                }
                std::thread::sleep((due - now).min(Duration::from_millis(5)));
            }
            // Writes happen under the pause lock: once pause() returns, memory
            // holds still (the source hashes it next).
            let mut paused = shared.paused.lock().unwrap();
            while *paused {
                if shared.stop.load(Ordering::Acquire) {
                    return;
                }
                paused = shared.resumed.wait(paused).unwrap();
            }
            for change in &interval.changes {
                if change.page >= pages {
                    continue;
                }
                let base = change.page * PAGE_SIZE as u64;
                if change.zero {
                    let _ = memory::write(&shared.memory, base, &zeros);
                } else {
                    let mut bits = if change.mask == 0 { 1 } else { change.mask };
                    while bits != 0 {
                        let sub = bits.trailing_zeros() as usize;
                        bits &= bits - 1;
                        let word = (next() as usize % (g / 8).max(1)) * 8;
                        let at = base + (sub * g + word) as u64;
                        let _ = memory::write(&shared.memory, at, &next().to_le_bytes());
                    }
                }
                shared.page_writes.fetch_add(1, Ordering::Relaxed);
            }
            drop(paused);
            shared.intervals.fetch_add(1, Ordering::Relaxed);
        }
        // Loop the trace: its end is one interval before the next lap.
        let step = trace.intervals.last().map_or(0, |i| i.at_us) / trace.intervals.len().max(1) as u64;
        std::thread::sleep(Duration::from_micros(step).div_f64(speed));
    }
}

impl SourceVm for TraceReplay {
    fn memory(&self) -> &Arc<GuestMemory> {
        &self.shared.memory
    }
    fn memory_bytes(&self) -> u64 {
        memory::page_count(&self.shared.memory) * PAGE_SIZE as u64
    }
    fn status(&self) -> VcpuStatus {
        if *self.shared.paused.lock().unwrap() {
            VcpuStatus::Paused
        } else {
            VcpuStatus::Running
        }
    }
    fn set_dirty_logging(&self, on: bool) -> Result<(), VmError> {
        if on {
            memory::take_vmm_dirty(&self.shared.memory); // the initial fill
        }
        Ok(())
    }
    fn manual_dirty_protect(&self) -> bool {
        false
    }
    fn dirty_bitmap(&self) -> DirtyBitmap {
        DirtyBitmap::new(memory::page_count(&self.shared.memory))
    }
    /// Takes and clears the bits, as KVM's log without manual protect.
    fn dirty_log(&self, bitmap: &mut DirtyBitmap) -> Result<(), VmError> {
        *bitmap = memory::take_vmm_dirty(&self.shared.memory);
        Ok(())
    }
    fn clear_dirty_log(&self, _first_page: u64, _bits: &[u64]) -> Result<(), VmError> {
        Ok(()) // dirty_log already cleared them
    }
    fn pause(&self) -> Result<(), VmError> {
        *self.shared.paused.lock().unwrap() = true;
        Ok(())
    }
    fn resume(&self) -> Result<(), VmError> {
        *self.shared.paused.lock().unwrap() = false;
        self.shared.resumed.notify_all();
        Ok(())
    }
    /// No vCPU: an empty STATE frame (a memory-only receiver takes it).
    fn state_blob(&self) -> Result<Vec<u8>, VmError> {
        Ok(Vec::new())
    }
}
