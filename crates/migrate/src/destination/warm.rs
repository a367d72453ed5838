//! The destination's half of a warm migration: opens the storage the
//! source named in WARM_BLOCKS and reads those blocks into a fresh block
//! cache on a thread of its own (with a connection of its own, so the
//! cache is locked only to insert), takes the contents the source sends
//! (WARM_DATA), drops what DISK_WRITTEN says went stale, and hands the
//! cache to the VM's disk at STATE. Warming is an optimization: a block it
//! has not reached by then is read on the guest's first access.
//!
//! Stale data never gets in: a block named in DISK_WRITTEN is dropped and
//! never inserted again by the warm paths. A read (from storage, or at the
//! source for WARM_DATA) that began before the guest's write is either
//! inserted before that DISK_WRITTEN arrives (and dropped by it) or finds
//! the block named already (and skips it); the cache's lock orders the
//! two.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Receiver, Sender};
use tsubame_block::{Backend, BlockCache, CacheStats, DiskSpec, BLOCK_SIZE};

use super::error::ReceiveError;
use crate::protocol::{DiskWritten, WarmBlocks, WarmData};

/// Longest run of neighbouring blocks read in one storage request.
const MAX_RUN: usize = 64;

/// The cache being filled, and the blocks the guest wrote meanwhile.
struct Warm {
    cache: BlockCache,
    stale: HashSet<u64>,
}

impl Warm {
    fn insert(&mut self, block: u64, data: &[u8]) {
        if !self.stale.contains(&block) {
            self.cache.warm_with(block, data);
        }
    }
}

/// A cache being filled ahead of the VM.
pub(super) struct WarmFill {
    spec: DiskSpec,
    size_bytes: u64,
    cache_bytes: u64,
    /// Taken by [`WarmFill::finish`].
    shared: Option<Arc<Mutex<Warm>>>,
    lists: Option<Sender<Vec<u64>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    listed: u64,
}

impl WarmFill {
    /// Opens the storage a first WARM_BLOCKS names and starts filling.
    pub(super) fn start(first: WarmBlocks, log: &dyn Fn(&str)) -> Result<WarmFill, ReceiveError> {
        let spec: DiskSpec = first.disk.parse().map_err(|e| ReceiveError::BadState(format!("warm cache: {e}")))?;
        let open = || tsubame_block::open(&spec).map_err(|e| ReceiveError::BadState(format!("warm cache: {e}")));
        let (backend, reader) = (open()?, open()?);
        let here = backend.size();
        if here != first.size_bytes {
            return Err(ReceiveError::Mismatch(format!(
                "disk {spec} is {here} bytes here and {} bytes at the source",
                first.size_bytes
            )));
        }
        let shared =
            Arc::new(Mutex::new(Warm { cache: BlockCache::new(backend, first.cache_bytes), stale: HashSet::new() }));
        let (tx, rx) = unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::Builder::new().name("warm-cache".into()).spawn(move || fill(reader, &shared, &rx, &stop))?
        };
        log(&format!("warm cache: reading the source's hot blocks of {spec} ahead"));
        let mut fill = WarmFill {
            spec,
            size_bytes: first.size_bytes,
            cache_bytes: first.cache_bytes,
            shared: Some(shared),
            lists: Some(tx),
            stop,
            thread: Some(thread),
            listed: 0,
        };
        fill.add(first)?;
        Ok(fill)
    }

    /// The storage's size, for the disk frames' checks.
    pub(super) fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// More blocks of the same list.
    pub(super) fn add(&mut self, more: WarmBlocks) -> Result<(), ReceiveError> {
        if more.disk != self.spec.to_string()
            || more.size_bytes != self.size_bytes
            || more.cache_bytes != self.cache_bytes
        {
            return Err(ReceiveError::BadState("WARM_BLOCKS names another disk than before".into()));
        }
        self.listed += more.blocks.len() as u64;
        if let Some(lists) = &self.lists {
            let _ = lists.send(more.blocks);
        }
        Ok(())
    }

    /// Installs contents the source sent (WARM_DATA).
    pub(super) fn data(&self, data: &WarmData) {
        let Some(shared) = &self.shared else { return };
        let mut warm = shared.lock().unwrap();
        for (block, bytes) in &data.blocks {
            warm.insert(*block, bytes);
        }
    }

    /// Drops the early copies of blocks the guest wrote at the source, and
    /// keeps them out from now on.
    pub(super) fn written(&self, written: &DiskWritten) {
        let Some(shared) = &self.shared else { return };
        let mut warm = shared.lock().unwrap();
        for &block in &written.blocks {
            warm.stale.insert(block);
            warm.cache.invalidate(block);
        }
    }

    /// Stops filling and hands the cache over, with what the fill did.
    pub(super) fn finish(mut self) -> (DiskSpec, BlockCache, u64, CacheStats) {
        self.stop.store(true, Ordering::Relaxed);
        self.lists = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let shared = self.shared.take().expect("finished once");
        let warm = match Arc::try_unwrap(shared) {
            Ok(warm) => warm.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner()),
            Err(_) => unreachable!("the fill thread, the only other owner, has ended"),
        };
        let stats = warm.cache.stats_handle().get();
        (self.spec.clone(), warm.cache, self.listed, stats)
    }
}

impl Drop for WarmFill {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Reads listed blocks from storage until the lists end, the cache is
/// full, or `stop`.
fn fill(mut reader: Box<dyn Backend>, shared: &Mutex<Warm>, lists: &Receiver<Vec<u64>>, stop: &AtomicBool) {
    let mut buf = vec![0u8; MAX_RUN * BLOCK_SIZE];
    for blocks in lists {
        let mut i = 0;
        while i < blocks.len() {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            // Neighbours in the list (a sequential reader's blocks) go in
            // one request; blocks already there (sent by the source) are
            // not read again.
            let first = blocks[i];
            let mut run = 1;
            while i + run < blocks.len() && run < MAX_RUN && blocks[i + run] == first + run as u64 {
                run += 1;
            }
            i += run;
            {
                let warm = shared.lock().unwrap();
                if warm.cache.is_full() {
                    return;
                }
                if (first..first + run as u64).all(|b| warm.cache.contains(b)) {
                    continue;
                }
            }
            let bytes = &mut buf[..run * BLOCK_SIZE];
            if let Err(e) = reader.read_at(first * BLOCK_SIZE as u64, bytes) {
                eprintln!("tsubame: warm cache: reading ahead stopped: {e}");
                return;
            }
            let mut warm = shared.lock().unwrap();
            for (k, data) in bytes.chunks_exact(BLOCK_SIZE).enumerate() {
                warm.insert(first + k as u64, data);
            }
        }
    }
}
