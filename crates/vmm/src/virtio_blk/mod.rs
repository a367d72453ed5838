//! A virtio-blk device with the legacy (virtio 0.9.5) register layout, as
//! QEMU's `virtio-blk-pci,disable-modern=on` shows it on its I/O BAR:
//!
//! | offset | register |
//! |---|---|
//! | 0x00 | device features (32) |
//! | 0x04 | driver features (32) |
//! | 0x08 | queue address, in 4 KiB pages (32) |
//! | 0x0C | queue size (16, read-only) |
//! | 0x0E | queue select (16) |
//! | 0x10 | queue notify (16) |
//! | 0x12 | device status (8) |
//! | 0x13 | ISR status (8, reading clears it) |
//! | 0x14 | capacity in 512-byte sectors (64), then size_max, seg_max, geometry, blk_size |
//!
//! One queue. A notify processes every available request at once, on the
//! vCPU thread that wrote the notify register: when the vCPU is paused no
//! request is in flight, by construction. Rings and descriptors are
//! `virtio-queue`'s; every byte written into guest memory (read data,
//! status, used ring) goes through vm-memory, so it lands in the VMM's
//! dirty bitmap for migration.

mod request;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tsubame_block::cache::CacheStatsHandle;
use tsubame_block::{BlockCache, BlockError, CacheStats, DiskSpec};
use virtio_bindings::virtio_blk::VIRTIO_BLK_F_FLUSH;
use virtio_queue::{Queue, QueueOwnedT, QueueT};

use crate::memory::GuestMemory;
use crate::pci_state::{copy_out, PciFunctionState};

/// Bytes of the register block (BAR0 is this rounded up to a power of 2).
pub const REGISTERS_LEN: u16 = 0x2C;
/// Entries of the queue (QEMU's default for virtio-blk too).
pub const QUEUE_SIZE: u16 = 256;
/// The ring alignment of the legacy layout.
const VRING_ALIGN: u64 = 4096;
/// What GET_ID answers (QEMU: `-device virtio-blk-pci,serial=...`).
pub const DISK_ID: &[u8] = b"tsubame-disk";

const REG_DEVICE_FEATURES: u16 = 0x00;
const REG_DRIVER_FEATURES: u16 = 0x04;
const REG_QUEUE_PFN: u16 = 0x08;
const REG_QUEUE_SIZE: u16 = 0x0C;
const REG_QUEUE_SELECT: u16 = 0x0E;
const REG_QUEUE_NOTIFY: u16 = 0x10;
const REG_STATUS: u16 = 0x12;
const REG_ISR: u16 = 0x13;
const REG_CONFIG: u16 = 0x14;

/// Features this device offers.
const DEVICE_FEATURES: u32 = 1 << VIRTIO_BLK_F_FLUSH;
/// ISR bit: the device used buffers.
const ISR_QUEUE: u8 = 1;

/// Why a disk could not be attached or its state loaded.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// Opening or flushing the storage.
    #[error(transparent)]
    Storage(#[from] BlockError),
    /// The storage here is not the size the guest knows.
    #[error("disk {disk} is {here} bytes here but {expected} bytes in the VM's state: give the destination the same storage")]
    SizeMismatch {
        /// The storage.
        disk: String,
        /// Its size here.
        here: u64,
        /// The size the guest was using.
        expected: u64,
    },
    /// The saved queue does not load.
    #[error("disk state: the saved queue is not valid ({0})")]
    BadQueue(String),
}

/// The disk's saved state: what the guest set up, where the queue stands,
/// and which storage it uses (shared storage: the data itself is not in
/// the state; the destination opens the same storage).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtioBlkState {
    /// The storage.
    pub disk: DiskSpec,
    /// Its size in bytes, checked by whoever opens it next.
    pub size_bytes: u64,
    /// The host block cache's capacity in bytes.
    pub cache_bytes: u64,
    /// The PCI function's settings.
    pub pci: PciFunctionState,
    /// Features the driver accepted.
    pub driver_features: u32,
    /// The device status register.
    pub status: u8,
    /// The ISR register.
    pub isr: u8,
    /// The queue select register.
    pub queue_select: u16,
    /// The queue's address in 4 KiB pages (0: not set up).
    pub queue_pfn: u32,
    /// The next available-ring entry to take.
    pub next_avail: u16,
    /// The next used-ring entry to fill.
    pub next_used: u16,
}

/// Requests served, as `stats` reports them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DiskStats {
    /// The storage (file path or NBD URI).
    pub disk: String,
    /// Its size in bytes.
    pub size_bytes: u64,
    /// Read requests completed.
    pub reads: u64,
    /// Write requests completed.
    pub writes: u64,
    /// Flush requests completed.
    pub flushes: u64,
    /// Bytes the guest read.
    pub bytes_read: u64,
    /// Bytes the guest wrote.
    pub bytes_written: u64,
    /// Requests answered with an error status, or dropped as unanswerable.
    pub errors: u64,
    /// Bytes per second the guest read lately (the last second or so
    /// weighs most).
    pub recent_read_bytes_per_sec: f64,
    /// The host block cache.
    pub cache: CacheStats,
}

#[derive(Debug, Default)]
struct Counters {
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    errors: AtomicU64,
    recent_reads: Mutex<DecayingRate>,
}

/// A rate that forgets: bytes counted now weigh e^(-age / [`RATE_MEMORY`])
/// later, so the rate follows what the guest does lately whatever its past.
#[derive(Debug, Default)]
struct DecayingRate {
    at: Option<Instant>,
    bytes_per_sec: f64,
}

/// How long [`DecayingRate`] remembers (its time constant).
const RATE_MEMORY: Duration = Duration::from_secs(1);

impl DecayingRate {
    fn decayed(&self, now: Instant) -> f64 {
        let age = self.at.map_or(0.0, |at| now.saturating_duration_since(at).as_secs_f64());
        self.bytes_per_sec * (-age / RATE_MEMORY.as_secs_f64()).exp()
    }

    fn add(&mut self, bytes: u64, now: Instant) {
        self.bytes_per_sec = self.decayed(now) + bytes as f64 / RATE_MEMORY.as_secs_f64();
        self.at = Some(now);
    }
}

/// Reads a disk's statistics from any thread.
#[derive(Debug, Clone)]
pub struct DiskStatsHandle {
    disk: String,
    size_bytes: u64,
    counters: Arc<Counters>,
    cache: CacheStatsHandle,
}

impl DiskStatsHandle {
    /// The statistics now.
    pub fn get(&self) -> DiskStats {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let c = &self.counters;
        DiskStats {
            disk: self.disk.clone(),
            size_bytes: self.size_bytes,
            reads: load(&c.reads),
            writes: load(&c.writes),
            flushes: load(&c.flushes),
            bytes_read: load(&c.bytes_read),
            bytes_written: load(&c.bytes_written),
            errors: load(&c.errors),
            recent_read_bytes_per_sec: c.recent_reads.lock().unwrap().decayed(Instant::now()),
            cache: self.cache.get(),
        }
    }
}

/// The virtio-blk device.
pub struct VirtioBlk {
    memory: Arc<GuestMemory>,
    storage: BlockCache,
    spec: DiskSpec,
    queue: Queue,
    queue_pfn: u32,
    queue_select: u16,
    driver_features: u32,
    status: u8,
    isr: u8,
    counters: Arc<Counters>,
    bounce: Vec<u8>,
}

impl VirtioBlk {
    /// A device in its reset state over `storage` (a cache, possibly of no
    /// capacity, in front of the backend that `spec` names).
    pub fn new(memory: Arc<GuestMemory>, storage: BlockCache, spec: DiskSpec) -> VirtioBlk {
        VirtioBlk {
            memory,
            storage,
            spec,
            queue: Queue::new(QUEUE_SIZE).expect("a power of two"),
            queue_pfn: 0,
            queue_select: 0,
            driver_features: 0,
            status: 0,
            isr: 0,
            counters: Arc::default(),
            bounce: Vec::new(),
        }
    }

    /// Opens the storage `spec` names behind a cache of `cache_bytes`.
    pub fn open(memory: Arc<GuestMemory>, spec: &DiskSpec, cache_bytes: u64) -> Result<VirtioBlk, DiskError> {
        let backend = tsubame_block::open(spec)?;
        Ok(VirtioBlk::new(memory, BlockCache::new(backend, cache_bytes), spec.clone()))
    }

    /// Statistics, readable from other threads.
    pub fn stats_handle(&self) -> DiskStatsHandle {
        DiskStatsHandle {
            disk: self.spec.to_string(),
            size_bytes: self.size_bytes(),
            counters: self.counters.clone(),
            cache: self.storage.stats_handle(),
        }
    }

    /// The storage's size in bytes.
    pub fn size_bytes(&self) -> u64 {
        tsubame_block::Backend::size(&self.storage)
    }

    /// The block cache.
    pub fn cache(&self) -> &BlockCache {
        &self.storage
    }

    /// The block cache, to change (a warm migration tracks writes in it).
    pub fn cache_mut(&mut self) -> &mut BlockCache {
        &mut self.storage
    }

    /// The storage this disk uses.
    pub fn spec(&self) -> &DiskSpec {
        &self.spec
    }

    fn reset(&mut self) {
        self.queue.reset();
        self.queue_pfn = 0;
        self.queue_select = 0;
        self.driver_features = 0;
        self.status = 0;
        self.isr = 0;
    }

    /// The register block as the guest reads it.
    fn registers(&self) -> [u8; REGISTERS_LEN as usize] {
        let mut r = [0u8; REGISTERS_LEN as usize];
        let mut put = |at: u16, bytes: &[u8]| r[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
        put(REG_DEVICE_FEATURES, &DEVICE_FEATURES.to_le_bytes());
        put(REG_DRIVER_FEATURES, &self.driver_features.to_le_bytes());
        let queue_selected = self.queue_select == 0;
        put(REG_QUEUE_PFN, &(if queue_selected { self.queue_pfn } else { 0 }).to_le_bytes());
        put(REG_QUEUE_SIZE, &(if queue_selected { QUEUE_SIZE } else { 0 }).to_le_bytes());
        put(REG_QUEUE_SELECT, &self.queue_select.to_le_bytes());
        put(REG_STATUS, &[self.status]);
        put(REG_ISR, &[self.isr]);
        // Config: capacity in sectors; size_max, seg_max, geometry and
        // blk_size stay 0 (their features are not offered).
        put(REG_CONFIG, &(self.size_bytes() / tsubame_block::SECTOR_SIZE).to_le_bytes());
        r
    }

    /// A guest read of the registers at `offset`.
    pub fn read_register(&mut self, offset: u16, data: &mut [u8]) {
        copy_out(&self.registers(), offset as usize, data);
        if (offset..offset + data.len() as u16).contains(&REG_ISR) {
            self.isr = 0; // reading ISR acknowledges it (and lowers INTx)
        }
    }

    /// A guest write to the registers at `offset`; writes of the wrong
    /// width or to read-only registers are ignored.
    pub fn write_register(&mut self, offset: u16, data: &[u8]) {
        let value = data.iter().rev().fold(0u32, |v, &b| v << 8 | u32::from(b));
        match (offset, data.len()) {
            (REG_DRIVER_FEATURES, 4) => self.driver_features = value & DEVICE_FEATURES,
            (REG_QUEUE_PFN, 4) if self.queue_select == 0 => self.set_queue_pfn(value),
            (REG_QUEUE_SELECT, 2) => self.queue_select = value as u16,
            (REG_QUEUE_NOTIFY, 2) if value == 0 => self.process_queue(),
            (REG_STATUS, 1) if value == 0 => self.reset(),
            (REG_STATUS, 1) => self.status = value as u8,
            _ => {}
        }
    }

    /// Places the queue at page `pfn` in the legacy layout: descriptors,
    /// then the available ring, then the used ring on the next 4 KiB.
    fn set_queue_pfn(&mut self, pfn: u32) {
        self.queue_pfn = pfn;
        if pfn == 0 {
            self.queue.reset();
            return;
        }
        let size = u64::from(QUEUE_SIZE);
        let desc = u64::from(pfn) * VRING_ALIGN;
        let avail = desc + 16 * size;
        let used = (avail + 6 + 2 * size).next_multiple_of(VRING_ALIGN);
        let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
        let (lo, hi) = split(desc);
        self.queue.set_desc_table_address(lo, hi);
        let (lo, hi) = split(avail);
        self.queue.set_avail_ring_address(lo, hi);
        let (lo, hi) = split(used);
        self.queue.set_used_ring_address(lo, hi);
        self.queue.set_ready(true);
    }

    /// Serves every request the driver made available.
    fn process_queue(&mut self) {
        let memory = self.memory.clone();
        let mem: &GuestMemory = &memory;
        if !self.queue.ready() || !self.queue.is_valid(mem) {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut used_any = false;
        loop {
            // A driver that claims more requests than the ring holds gets
            // nothing more until it resets the device.
            let chain = match self.queue.iter(mem) {
                Ok(mut requests) => requests.next(),
                Err(_) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            };
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let written = self.serve(chain.collect());
            if self.queue.add_used(mem, head, written).is_err() {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
            }
            used_any = true;
        }
        if used_any {
            self.isr |= ISR_QUEUE;
        }
    }

    /// Serves one request; returns the bytes written into its buffers.
    fn serve(&mut self, chain: Vec<virtio_queue::desc::split::Descriptor>) -> u32 {
        let outcome = request::serve(&self.memory, &mut self.storage, &mut self.bounce, &chain);
        let c = &self.counters;
        match outcome.done {
            Some(request::Done::Read(n)) => {
                c.reads.fetch_add(1, Ordering::Relaxed);
                c.bytes_read.fetch_add(n, Ordering::Relaxed);
                c.recent_reads.lock().unwrap().add(n, Instant::now());
            }
            Some(request::Done::Write(n)) => {
                c.writes.fetch_add(1, Ordering::Relaxed);
                c.bytes_written.fetch_add(n, Ordering::Relaxed);
            }
            Some(request::Done::Flush) => {
                c.flushes.fetch_add(1, Ordering::Relaxed);
            }
            Some(request::Done::GetId) => {}
            None => {
                c.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        outcome.written
    }

    /// Makes completed writes durable (before the VM's state is taken).
    pub fn flush(&mut self) -> Result<(), DiskError> {
        Ok(tsubame_block::Backend::flush(&mut self.storage)?)
    }

    /// The device's state, with its PCI function's settings.
    pub fn state(&self, pci: PciFunctionState) -> VirtioBlkState {
        VirtioBlkState {
            disk: self.spec.clone(),
            size_bytes: self.size_bytes(),
            cache_bytes: self.storage.capacity_bytes(),
            pci,
            driver_features: self.driver_features,
            status: self.status,
            isr: self.isr,
            queue_select: self.queue_select,
            queue_pfn: self.queue_pfn,
            next_avail: self.queue.next_avail(),
            next_used: self.queue.next_used(),
        }
    }

    /// Loads a saved state into this device (opened on the same storage).
    pub fn restore(&mut self, state: &VirtioBlkState) -> Result<(), DiskError> {
        if state.size_bytes != self.size_bytes() {
            return Err(DiskError::SizeMismatch {
                disk: state.disk.to_string(),
                here: self.size_bytes(),
                expected: state.size_bytes,
            });
        }
        self.reset();
        self.set_queue_pfn(state.queue_pfn);
        self.queue.set_next_avail(state.next_avail);
        self.queue.set_next_used(state.next_used);
        self.driver_features = state.driver_features & DEVICE_FEATURES;
        self.status = state.status;
        self.isr = state.isr;
        self.queue_select = state.queue_select;
        if state.queue_pfn != 0 && !self.queue.is_valid(&*self.memory) {
            return Err(DiskError::BadQueue(format!("queue at page {:#x} is outside guest memory", state.queue_pfn)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
