//! Far memory (the remote-swap paper, issue 19): at most a set amount of
//! a VM's memory stays resident; colder pages are written to a memory host
//! (an NBD export, e.g. `nbdkit memory`) and dropped, and a guest access to
//! one faults (userfaultfd) and reads it back.
//!
//! Two threads share the [`pager`]'s state: the fault thread installs
//! pages the guest touches (from the export, from a write still in flight,
//! or zeros for a page never sent away) and reads ahead along sequential
//! and strided runs; the evictor keeps residency under the limit. To take
//! a page away race-free it stops the vCPU for the moment of choosing,
//! copying and dropping a batch (so no write can slip between the copy and
//! the drop), then writes the batch back while the guest runs; until that
//! write is done a fault on one of its pages is served from the copy.
//!
//! Victims come from a CLOCK over resident pages whose reference bits are
//! what the VMM can observe: a page faulted in, and KVM's dirty log. A
//! victim whose contents still hash to its far copy's is dropped without a
//! write.

mod pager;
mod store;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tsubame_block::DiskSpec;
use tsubame_vmm::{uffd::PageFaults, DirtyBitmap, Vm, PAGE_SIZE};

pub use store::StoreStatus;

/// Why far memory cannot start or went away.
#[derive(Debug, thiserror::Error)]
pub enum FarError {
    /// An export could not be opened.
    #[error("far memory {0}: {1}")]
    Store(String, String),
    /// An export smaller than guest memory.
    #[error("far memory {uri} holds {size} bytes; this VM's memory needs {needed}")]
    TooSmall {
        /// The export.
        uri: String,
        /// Its size.
        size: u64,
        /// Guest memory's size.
        needed: u64,
    },
    /// Bad limits.
    #[error("{0}")]
    Config(String),
    /// Every export failed: pages that live there cannot come back.
    #[error("far memory lost (every memory host failed: {0}); the VM is paused")]
    Lost(String),
    /// userfaultfd or the VM refused.
    #[error("{0}")]
    Vm(String),
}

/// What far memory is asked to do.
#[derive(Debug, Clone)]
pub struct FarConfig {
    /// Most guest memory kept resident, in bytes.
    pub local_bytes: u64,
    /// One export, or two mirrored.
    pub stores: Vec<DiskSpec>,
}

/// Counters, on the control socket (`query-memory`) and in the summary.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FarStats {
    /// The limit on resident memory.
    pub local_limit_bytes: u64,
    /// Resident pages now.
    pub resident_pages: u64,
    /// The most pages resident at once.
    pub resident_max_pages: u64,
    /// Pages whose only copy is far.
    pub far_pages: u64,
    /// Guest (and VMM) accesses that faulted.
    pub faults: u64,
    /// Of those, pages never sent away (installed as zeros).
    pub zero_fills: u64,
    /// Faults served from a write-back still in flight.
    pub inflight_hits: u64,
    /// Fault service time (read to installed), µs.
    pub fault_latency_p50_us: u64,
    /// 99th percentile, µs.
    pub fault_latency_p99_us: u64,
    /// Pages read ahead of a fault.
    pub readahead_pages: u64,
    /// Read-ahead pages the dirty log later named (this KVM logs a page
    /// when the guest first touches it; elsewhere only writes would count).
    pub readahead_hits: u64,
    /// Pages taken away.
    pub evicted_pages: u64,
    /// Evicted pages whose far copy was still equal: no write.
    pub clean_drops: u64,
    /// Times the vCPU was stopped to evict.
    pub evictions: u64,
    /// Sum of those stops, ms.
    pub eviction_pause_ms: f64,
    /// Bytes read from the memory host(s).
    pub bytes_read: u64,
    /// Bytes written (counted once, however many mirrors).
    pub bytes_written: u64,
    /// Each export's state.
    pub stores: Vec<StoreStatus>,
    /// Set once every export failed.
    pub error: Option<String>,
}

/// Far memory prepared for a VM that has not started yet: the exports are
/// open (and, once [`FarSetup::register`] ran, guest memory is registered).
pub struct FarSetup {
    config: FarConfig,
    /// Guest memory's size.
    bytes: u64,
    faults: Option<Arc<PageFaults>>,
    fault_stores: store::Stores,
    write_stores: store::Stores,
    health: store::Health,
    /// A migrated VM's far pages and their copies' hashes.
    arrived: Option<(DirtyBitmap, Vec<u128>)>,
}

/// Far memory serving a running VM.
pub struct FarMemory {
    config: FarConfig,
    state: Arc<Mutex<pager::State>>,
    faults: Arc<PageFaults>,
    health: store::Health,
    stop: Arc<AtomicBool>,
    wake: Arc<pager::Wake>,
    threads: Vec<JoinHandle<()>>,
}

/// Reads far pages for a fault thread that is not far memory's own (a
/// post-copy destination's, while pages still arrive from the source).
pub struct FarReader {
    stores: store::Stores,
}

impl FarReader {
    /// Reads page `page`'s far copy, which must hash (xxh3-128) to `hash`,
    /// what it was when it went away.
    pub fn read_page(&mut self, page: u64, hash: u128, buf: &mut [u8; PAGE_SIZE]) -> Result<(), FarError> {
        let check = |bytes: &[u8]| xxhash_rust::xxh3::xxh3_128(bytes) == hash;
        self.stores.read_checked(page * PAGE_SIZE as u64, buf, &check)
    }
}

/// What a migration hands the destination: the exports and which pages
/// live there. Ownership of the exports passes with the migration's commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FarMap {
    /// The limit on resident memory, in bytes.
    pub local_bytes: u64,
    /// The exports, as `--far-memory` names them.
    pub stores: Vec<String>,
    /// Pages whose only copy is far.
    pub far: DirtyBitmap,
    /// Per page (valid where `far`), the hash (xxh3-128) of its far copy.
    pub hashes: Vec<u128>,
}

impl FarSetup {
    /// Opens the exports (two connections to each: faults and write-back)
    /// and registers guest memory for missing-page faults. Call before the
    /// vCPU starts, so every page it populates is counted.
    pub fn prepare(vm: &Vm, config: FarConfig) -> Result<FarSetup, FarError> {
        if vm.hugepages() {
            return Err(FarError::Config("far memory pages 4 KiB at a time: boot with --no-hugepages".into()));
        }
        let mut setup = FarSetup::open(config, vm.memory_bytes())?;
        setup.register(vm)?;
        Ok(setup)
    }

    /// For a migrated VM: opens the exports `map` names, to serve its far
    /// pages once [`FarSetup::register`] and [`FarSetup::start`] ran.
    pub fn arrived(map: FarMap, memory_bytes: u64) -> Result<FarSetup, FarError> {
        let stores = map
            .stores
            .iter()
            .map(|uri| uri.parse().map_err(|e: tsubame_block::BlockError| FarError::Store(uri.clone(), e.to_string())))
            .collect::<Result<_, _>>()?;
        let pages = memory_bytes.div_ceil(PAGE_SIZE as u64);
        if map.far.pages() != pages || map.hashes.len() as u64 != pages {
            return Err(FarError::Config(format!("the far page map covers {} pages, not {pages}", map.far.pages())));
        }
        let mut setup = FarSetup::open(FarConfig { local_bytes: map.local_bytes, stores }, memory_bytes)?;
        setup.arrived = Some((map.far, map.hashes));
        Ok(setup)
    }

    /// Checks the limits and opens the exports.
    fn open(config: FarConfig, bytes: u64) -> Result<FarSetup, FarError> {
        if config.stores.is_empty() || config.stores.len() > 2 {
            return Err(FarError::Config("--far-memory takes one export, or two to mirror".into()));
        }
        let min = 4 << 20;
        if config.local_bytes < min || config.local_bytes >= bytes {
            return Err(FarError::Config(format!(
                "--local-memory must be at least 4 MiB and less than the VM's memory ({} MiB)",
                bytes >> 20
            )));
        }
        let health: store::Health = Arc::new(Mutex::new(
            config.stores.iter().map(|s| StoreStatus { uri: s.to_string(), ok: true, error: None }).collect(),
        ));
        let fault_stores = store::Stores::open(&config.stores, bytes, health.clone())?;
        let write_stores = store::Stores::open(&config.stores, bytes, health.clone())?;
        Ok(FarSetup { config, bytes, faults: None, fault_stores, write_stores, health, arrived: None })
    }

    /// One more connection to each export, for a post-copy destination to
    /// read far pages before far memory starts.
    pub fn reader(&self) -> Result<FarReader, FarError> {
        Ok(FarReader { stores: store::Stores::open(&self.config.stores, self.bytes, self.health.clone())? })
    }

    /// Takes over guest memory's registration for faults from whoever
    /// served them so far (a post-copy destination), instead of
    /// [`FarSetup::register`]; dirty logging must be on already.
    pub fn adopt(&mut self, faults: Arc<PageFaults>) {
        self.faults = Some(faults);
    }

    /// Registers guest memory for missing-page faults and turns dirty
    /// logging on. Before the vCPU starts: changing a memory slot waits for
    /// every vCPU to leave KVM, and a vCPU waiting on a far page does not
    /// until the fault thread runs.
    pub fn register(&mut self, vm: &Vm) -> Result<(), FarError> {
        let faults = PageFaults::register(vm.memory()).map_err(|e| FarError::Vm(e.to_string()))?;
        self.faults = Some(Arc::new(faults));
        vm.set_dirty_logging(true).map_err(|e| FarError::Vm(e.to_string()))
    }

    /// Starts the fault thread and the evictor for the started `vm`.
    pub fn start(self, vm: Arc<Vm>) -> Result<FarMemory, FarError> {
        let faults = self.faults.ok_or_else(|| FarError::Vm("far memory started before registering".into()))?;
        let pages = faults.pages();
        let limit = self.config.local_bytes / PAGE_SIZE as u64;
        let mut state = pager::State::new(vm.memory(), pages, limit);
        if let Some((far, hashes)) = self.arrived {
            state.seed(far, hashes);
        }
        let state = Arc::new(Mutex::new(state));
        let stop = Arc::new(AtomicBool::new(false));
        let wake = Arc::new(pager::Wake::default());
        let fault_thread = {
            let mut pager = pager::FaultSide {
                state: state.clone(),
                faults: faults.clone(),
                stores: self.fault_stores,
                stop: stop.clone(),
                wake: wake.clone(),
            };
            std::thread::Builder::new()
                .name("far-faults".into())
                .spawn(move || pager.run())
                .map_err(|e| FarError::Vm(e.to_string()))?
        };
        let evictor = {
            let mut evictor = pager::Evictor {
                state: state.clone(),
                faults: faults.clone(),
                stores: self.write_stores,
                stop: stop.clone(),
                wake: wake.clone(),
                vm,
                dirty: None,
            };
            std::thread::Builder::new()
                .name("far-evict".into())
                .spawn(move || evictor.run())
                .map_err(|e| FarError::Vm(e.to_string()))?
        };
        Ok(FarMemory {
            config: self.config,
            state,
            faults,
            health: self.health,
            stop,
            wake,
            threads: vec![fault_thread, evictor],
        })
    }
}

impl FarMemory {
    /// Counters so far.
    pub fn stats(&self) -> FarStats {
        let faults = self.faults.stats();
        let mut stats = self.state.lock().unwrap().stats();
        stats.fault_latency_p50_us = faults.latency_p50_us;
        stats.fault_latency_p99_us = faults.latency_p99_us;
        stats.stores = self.health.lock().unwrap().clone();
        stats
    }

    /// A migration starts: eviction stops and the write-back drains, so
    /// that every far copy is current and stays so; pages that come back
    /// from now on are marked in guest memory's VMM dirty log, so the
    /// migration sends them. Returns the map of pages that live far.
    pub fn hand_over(&self) -> Result<FarMap, FarError> {
        self.state.lock().unwrap().handed_over = true;
        loop {
            {
                let state = self.state.lock().unwrap();
                if let Some(error) = &state.stats.error {
                    return Err(FarError::Lost(error.clone()));
                }
                if !state.evicting {
                    let (far, hashes) = state.far_map();
                    let stores = self.config.stores.iter().map(ToString::to_string).collect();
                    return Ok(FarMap { local_bytes: self.config.local_bytes, stores, far, hashes });
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The migration failed: the VM stays here, and eviction goes on.
    pub fn take_back(&self) {
        self.state.lock().unwrap().handed_over = false;
        self.wake.notify();
    }

    /// Stops both threads. The VM must be stopped for good first: a vCPU
    /// waiting on a far page would wait forever.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for FarMemory {
    fn drop(&mut self) {
        self.stop();
    }
}
