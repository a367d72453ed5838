//! The device driven the way the guest drives it, over plain guest memory
//! and an image file: good requests, every kind of bad chain, state.

use std::path::PathBuf;

use tsubame_block::{Backend, RawFile};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::memory;

const PFN: u64 = 0x100; // rings at 1 MiB
const BUFFERS: u64 = 0x20_0000; // request headers, data and status from 2 MiB
const DISK_BYTES: u64 = 1 << 20;
const NEXT: u16 = 1;
const WRITE: u16 = 2;

fn image(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("tsubame-blk-{name}-{}.img", std::process::id()));
    RawFile::create(&path, DISK_BYTES).unwrap();
    path
}

/// A guest driver in miniature: lays out the legacy ring at PFN and
/// submits chains one at a time.
struct Driver {
    mem: Arc<GuestMemory>,
    dev: VirtioBlk,
    avail_idx: u16,
    path: PathBuf,
}

/// One descriptor: address, length, device-writable.
type Desc = (u64, u32, bool);

impl Driver {
    fn new(name: &str, cache_bytes: u64) -> Driver {
        let path = image(name);
        let mem = Arc::new(memory::create(16 << 20, false).unwrap());
        let dev = VirtioBlk::open(mem.clone(), &DiskSpec::File(path.clone()), cache_bytes).unwrap();
        let mut d = Driver { mem, dev, avail_idx: 0, path };
        d.dev.write_register(REG_STATUS, &[0]);
        d.dev.write_register(REG_STATUS, &[3]);
        d.dev.write_register(REG_DRIVER_FEATURES, &DEVICE_FEATURES.to_le_bytes());
        d.dev.write_register(REG_QUEUE_SELECT, &0u16.to_le_bytes());
        d.dev.write_register(REG_QUEUE_PFN, &(PFN as u32).to_le_bytes());
        d.dev.write_register(REG_STATUS, &[7]);
        d
    }

    fn desc_addr(i: u16) -> GuestAddress {
        GuestAddress(PFN * 4096 + 16 * u64::from(i))
    }
    fn avail() -> u64 {
        PFN * 4096 + 16 * u64::from(QUEUE_SIZE)
    }
    fn used() -> u64 {
        (Self::avail() + 6 + 2 * u64::from(QUEUE_SIZE)).next_multiple_of(4096)
    }

    fn put_desc(&self, i: u16, (addr, len, write): Desc, next: Option<u16>) {
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        let flags = if write { WRITE } else { 0 } | if next.is_some() { NEXT } else { 0 };
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..16].copy_from_slice(&next.unwrap_or(0).to_le_bytes());
        self.mem.write_slice(&raw, Self::desc_addr(i)).unwrap();
    }

    /// Makes `head` available and notifies.
    fn kick(&mut self, heads: &[u16]) {
        for &head in heads {
            let slot = Self::avail() + 4 + 2 * u64::from(self.avail_idx % QUEUE_SIZE);
            self.mem.write_obj(head, GuestAddress(slot)).unwrap();
            self.avail_idx = self.avail_idx.wrapping_add(1);
        }
        self.mem.write_obj(self.avail_idx, GuestAddress(Self::avail() + 2)).unwrap();
        self.dev.write_register(REG_QUEUE_NOTIFY, &0u16.to_le_bytes());
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(Self::used() + 2)).unwrap()
    }

    /// The used entry `n` (id, len).
    fn used_entry(&self, n: u16) -> (u32, u32) {
        let at = Self::used() + 4 + 8 * u64::from(n % QUEUE_SIZE);
        (self.mem.read_obj(GuestAddress(at)).unwrap(), self.mem.read_obj(GuestAddress(at + 4)).unwrap())
    }

    /// Submits a chain of descriptors 0.. and returns (used len, status).
    fn submit(&mut self, chain: &[Desc]) -> (u32, u8) {
        for (i, &d) in chain.iter().enumerate() {
            let next = (i + 1 < chain.len()).then_some(i as u16 + 1);
            self.put_desc(i as u16, d, next);
        }
        let status = chain.last().unwrap().0 + u64::from(chain.last().unwrap().1) - 1;
        self.mem.write_obj(0xEEu8, GuestAddress(status)).unwrap();
        let before = self.used_idx();
        self.kick(&[0]);
        assert_eq!(self.used_idx(), before.wrapping_add(1), "one request used");
        let (id, len) = self.used_entry(before);
        assert_eq!(id, 0);
        (len, self.mem.read_obj(GuestAddress(status)).unwrap())
    }

    /// A request header at BUFFERS.
    fn header(&self, kind: u32, sector: u64) -> Desc {
        let mut raw = [0u8; 16];
        raw[0..4].copy_from_slice(&kind.to_le_bytes());
        raw[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&raw, GuestAddress(BUFFERS)).unwrap();
        (BUFFERS, 16, false)
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

const DATA: u64 = BUFFERS + 0x1000;
const STATUS: Desc = (BUFFERS + 0x100, 1, true);
const S_OK: u8 = 0;
const S_IOERR: u8 = 1;
const S_UNSUPP: u8 = 2;

#[test]
fn registers_show_the_disk() {
    let mut d = Driver::new("regs", 0);
    let mut capacity = [0u8; 8];
    d.dev.read_register(REG_CONFIG, &mut capacity);
    assert_eq!(u64::from_le_bytes(capacity), DISK_BYTES / 512);
    let mut size = [0u8; 2];
    d.dev.read_register(REG_QUEUE_SIZE, &mut size);
    assert_eq!(u16::from_le_bytes(size), QUEUE_SIZE);
    let mut features = [0u8; 4];
    d.dev.read_register(REG_DEVICE_FEATURES, &mut features);
    assert_eq!(u32::from_le_bytes(features), 1 << 9, "FLUSH");
    // ISR is set by a completion and cleared by reading it.
    let h = d.header(VIRTIO_BLK_T_FLUSH, 0);
    d.submit(&[h, STATUS]);
    let mut isr = [0u8];
    d.dev.read_register(REG_ISR, &mut isr);
    assert_eq!(isr, [1]);
    d.dev.read_register(REG_ISR, &mut isr);
    assert_eq!(isr, [0]);
}

#[test]
fn read_write_flush_get_id() {
    let mut d = Driver::new("rw", 64 << 10);
    let pattern: Vec<u8> = (0..2048u32).map(|i| (i * 13 % 256) as u8).collect();
    d.mem.write_slice(&pattern, GuestAddress(DATA)).unwrap();
    // A write of two buffers from sector 9.
    let h = d.header(VIRTIO_BLK_T_OUT, 9);
    assert_eq!(d.submit(&[h, (DATA, 1024, false), (DATA + 1024, 1024, false), STATUS]), (1, S_OK));
    let h = d.header(VIRTIO_BLK_T_FLUSH, 0);
    assert_eq!(d.submit(&[h, STATUS]), (1, S_OK));
    // Storage holds it.
    let mut on_disk = vec![0u8; 2048];
    RawFile::open(&d.path).unwrap().read_at(9 * 512, &mut on_disk).unwrap();
    assert_eq!(on_disk, pattern);
    // Read it back elsewhere in guest memory, in one buffer.
    let h = d.header(VIRTIO_BLK_T_IN, 9);
    assert_eq!(d.submit(&[h, (DATA + 0x10000, 2048, true), STATUS]), (2049, S_OK));
    let mut back = vec![0u8; 2048];
    d.mem.read_slice(&mut back, GuestAddress(DATA + 0x10000)).unwrap();
    assert_eq!(back, pattern);
    let h = d.header(VIRTIO_BLK_T_GET_ID, 0);
    assert_eq!(d.submit(&[h, (DATA, 20, true), STATUS]), (21, S_OK));
    let mut id = [0u8; 20];
    d.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id[..DISK_ID.len()], DISK_ID);
    let stats = d.dev.stats_handle().get();
    assert_eq!((stats.reads, stats.writes, stats.flushes, stats.errors), (1, 1, 1, 0));
    assert_eq!((stats.bytes_read, stats.bytes_written), (2048, 2048));
    assert_eq!(stats.cache.bytes_written, 2048);
}

/// What is wrong, the header's type and sector, the chain, the status.
type Case = (&'static str, (u32, u64), Vec<Desc>, u8);

#[test]
fn bad_requests_get_error_statuses() {
    let mut d = Driver::new("bad", 0);
    let past_memory = 16 << 20;
    let hdr: Desc = (BUFFERS, 16, false);
    let last_sector = DISK_BYTES / 512 - 1;
    let cases: Vec<Case> = vec![
        ("writable header", (VIRTIO_BLK_T_IN, 0), vec![(BUFFERS, 16, true), (DATA, 512, true), STATUS], S_IOERR),
        ("short header", (VIRTIO_BLK_T_IN, 0), vec![(BUFFERS, 8, false), (DATA, 512, true), STATUS], S_IOERR),
        ("no header", (VIRTIO_BLK_T_IN, 0), vec![STATUS], S_IOERR),
        ("buffer past guest memory", (VIRTIO_BLK_T_IN, 0), vec![hdr, (past_memory - 512, 1024, true), STATUS], S_IOERR),
        ("buffer far outside", (VIRTIO_BLK_T_IN, 0), vec![hdr, (u64::MAX - 100, 512, true), STATUS], S_IOERR),
        ("read into a read-only buffer", (VIRTIO_BLK_T_IN, 0), vec![hdr, (DATA, 512, false), STATUS], S_IOERR),
        ("write from a writable buffer", (VIRTIO_BLK_T_OUT, 0), vec![hdr, (DATA, 512, true), STATUS], S_IOERR),
        ("not whole sectors", (VIRTIO_BLK_T_IN, 0), vec![hdr, (DATA, 100, true), STATUS], S_IOERR),
        ("past the disk's end", (VIRTIO_BLK_T_IN, last_sector), vec![hdr, (DATA, 1024, true), STATUS], S_IOERR),
        ("sector overflows", (VIRTIO_BLK_T_OUT, u64::MAX / 256), vec![hdr, (DATA, 512, false), STATUS], S_IOERR),
        (
            "get-id in two buffers",
            (VIRTIO_BLK_T_GET_ID, 0),
            vec![hdr, (DATA, 10, true), (DATA + 10, 10, true), STATUS],
            S_IOERR,
        ),
        ("unknown type", (99, 0), vec![hdr, STATUS], S_UNSUPP),
    ];
    let count = cases.len() as u64;
    for (what, (kind, sector), chain, want) in cases {
        d.header(kind, sector);
        assert_eq!(d.submit(&chain), (1, want), "{what}");
    }
    assert_eq!(d.dev.stats_handle().get().errors, count);
    // The device still serves good requests.
    let h = d.header(VIRTIO_BLK_T_IN, 0);
    assert_eq!(d.submit(&[h, (DATA, 512, true), STATUS]), (513, S_OK));
}

#[test]
fn chains_without_a_status_are_returned_unanswered() {
    let mut d = Driver::new("nostatus", 0);
    let h = d.header(VIRTIO_BLK_T_IN, 0);
    // The status descriptor is not writable: nothing is written anywhere.
    d.mem.write_slice(&[0x55; 512], GuestAddress(DATA)).unwrap();
    assert_eq!(d.submit(&[h, (DATA, 512, true), (STATUS.0, 1, false)]), (0, 0xEE));
    let mut data = [0u8; 512];
    d.mem.read_slice(&mut data, GuestAddress(DATA)).unwrap();
    assert_eq!(data, [0x55; 512], "no data moved for an unanswerable request");
    // A loop: descriptor 1 points to itself.
    d.put_desc(0, h, Some(1));
    d.put_desc(1, (DATA, 512, true), Some(1));
    let before = d.used_idx();
    d.kick(&[0]);
    assert_eq!(d.used_idx(), before.wrapping_add(1));
    assert_eq!(d.used_entry(before), (0, 0));
    // A next index past the table.
    d.put_desc(1, (DATA, 512, true), Some(QUEUE_SIZE + 40));
    d.kick(&[0]);
    assert_eq!(d.used_entry(before.wrapping_add(1)), (0, 0));
    // A head index past the table cannot be returned at all; the request
    // after it still is.
    let h = d.header(VIRTIO_BLK_T_IN, 0);
    d.put_desc(0, h, Some(1));
    d.put_desc(1, (DATA, 512, true), Some(2));
    d.put_desc(2, STATUS, None);
    let before = d.used_idx();
    d.kick(&[QUEUE_SIZE + 1, 0]);
    assert_eq!(d.used_idx(), before.wrapping_add(1));
    assert_eq!(d.used_entry(before), (0, 513));
    assert!(d.dev.stats_handle().get().errors >= 4);
}

#[test]
fn a_runaway_avail_index_stops_the_queue_not_the_vmm() {
    let mut d = Driver::new("runaway", 0);
    d.avail_idx = QUEUE_SIZE + 10;
    let before = d.used_idx();
    d.kick(&[]);
    assert_eq!(d.used_idx(), before, "nothing served");
    assert_eq!(d.dev.stats_handle().get().errors, 1);
    // A queue outside guest memory is refused the same way.
    d.dev.write_register(REG_QUEUE_PFN, &0x10_0000u32.to_le_bytes());
    d.dev.write_register(REG_QUEUE_NOTIFY, &0u16.to_le_bytes());
    assert_eq!(d.dev.stats_handle().get().errors, 2);
}

#[test]
fn data_and_rings_written_by_the_device_are_dirty_pages() {
    let mut d = Driver::new("dirty", 0);
    memory::take_vmm_dirty(&d.mem);
    let h = d.header(VIRTIO_BLK_T_IN, 0);
    d.submit(&[h, (DATA + 0x5000, 4096, true), STATUS]);
    let dirty = memory::take_vmm_dirty(&d.mem);
    let page = |a: u64| a / 4096;
    for (what, addr) in [("data", DATA + 0x5000), ("status", STATUS.0), ("used ring", Driver::used())] {
        assert!(dirty.get(page(addr)), "{what} page not marked");
    }
}

#[test]
fn state_carries_the_queue_to_a_new_device() {
    let mut d = Driver::new("state", 0);
    d.mem.write_slice(&[0xA7; 512], GuestAddress(DATA)).unwrap();
    let h = d.header(VIRTIO_BLK_T_OUT, 3);
    d.submit(&[h, (DATA, 512, false), STATUS]);
    d.dev.flush().unwrap();
    let state = d.dev.state(PciFunctionState::default());
    assert_eq!((state.next_avail, state.next_used, state.queue_pfn), (1, 1, PFN as u32));
    // Another device on the same storage and memory carries on.
    let mut moved = VirtioBlk::open(d.mem.clone(), &state.disk, 0).unwrap();
    moved.restore(&state).unwrap();
    assert_eq!(moved.state(PciFunctionState::default()), state);
    d.dev = moved;
    let h = d.header(VIRTIO_BLK_T_IN, 3);
    assert_eq!(d.submit(&[h, (DATA + 4096, 512, true), STATUS]), (513, S_OK));
    let mut back = [0u8; 512];
    d.mem.read_slice(&mut back, GuestAddress(DATA + 4096)).unwrap();
    assert_eq!(back, [0xA7; 512]);
    assert_eq!(d.used_idx(), 2);
    // Storage of another size is refused.
    let other = image("state-other");
    std::fs::OpenOptions::new().write(true).open(&other).unwrap().set_len(2 * DISK_BYTES).unwrap();
    let mut wrong = VirtioBlk::open(d.mem.clone(), &DiskSpec::File(other.clone()), 0).unwrap();
    let err = wrong.restore(&state).unwrap_err();
    assert!(err.to_string().contains("2097152 bytes here but 1048576"), "{err}");
    std::fs::remove_file(other).unwrap();
}

#[test]
fn the_recent_read_rate_forgets_with_time() {
    let t0 = Instant::now();
    let mut rate = DecayingRate::default();
    assert_eq!(rate.decayed(t0), 0.0);
    rate.add(1_000_000, t0);
    assert_eq!(rate.decayed(t0), 1e6, "a second's memory: bytes per second");
    let later = t0 + RATE_MEMORY;
    assert!((rate.decayed(later) - 1e6 / std::f64::consts::E).abs() < 1.0);
    // A steady reader converges on its rate: 100 reads of 10 kB per 10 ms.
    let mut steady = DecayingRate::default();
    for i in 0..1000u32 {
        steady.add(10_000, t0 + Duration::from_millis(10) * i);
    }
    let at = t0 + Duration::from_millis(9990);
    assert!((steady.decayed(at) - 1e6).abs() < 0.01e6, "{}", steady.decayed(at));
}
