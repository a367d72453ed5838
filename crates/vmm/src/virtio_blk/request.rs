//! One block request: a descriptor chain of a 16-byte header (type,
//! reserved, sector; device-readable), data buffers, and a status byte
//! (the last byte of the last descriptor, device-writable). Everything the
//! guest handed over is checked before storage is touched; a request that
//! breaks a rule gets `VIRTIO_BLK_S_IOERR` (or `UNSUPP` for an unknown
//! type), and a chain with nowhere to put a status is returned unanswered.

use tsubame_block::{check_range, Backend, SECTOR_SIZE};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::DISK_ID;
use crate::memory::GuestMemory;

/// The header's size: type (u32), reserved (u32), sector (u64).
const HEADER_LEN: u32 = 16;
/// Storage is read or written in pieces of at most this much.
const CHUNK: usize = 256 << 10;

/// A request that completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Done {
    /// Bytes read into the guest.
    Read(u64),
    /// Bytes written from the guest.
    Write(u64),
    /// A flush.
    Flush,
    /// The ID was given.
    GetId,
}

/// What serving a chain did.
#[derive(Debug)]
pub(super) struct Outcome {
    /// The request, when it completed with `VIRTIO_BLK_S_OK`.
    pub done: Option<Done>,
    /// Bytes written into the chain's buffers (the used length).
    pub written: u32,
}

/// A request refused: the status it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Refused(u32);

const IOERR: Refused = Refused(VIRTIO_BLK_S_IOERR);

/// Serves the request in `chain`, writing its status.
pub(super) fn serve(
    mem: &GuestMemory,
    storage: &mut dyn Backend,
    bounce: &mut Vec<u8>,
    chain: &[Descriptor],
) -> Outcome {
    let unanswered = Outcome { done: None, written: 0 };
    // A chain cut short (a loop, an index past the table) ends in a
    // descriptor that still points onwards.
    let Some((status, body)) = chain.split_last() else { return unanswered };
    if status.has_next() || !status.is_write_only() || status.len() == 0 {
        return unanswered;
    }
    let Some(status_addr) = status.addr().0.checked_add(u64::from(status.len()) - 1).map(GuestAddress) else {
        return unanswered;
    };
    if !mem.check_range(status_addr, 1) {
        return unanswered;
    }
    let (code, done, data) = match execute(mem, storage, bounce, body) {
        Ok((done, data)) => (VIRTIO_BLK_S_OK, Some(done), data),
        Err(Refused(code)) => (code, None, 0),
    };
    if mem.write_obj(code as u8, status_addr).is_err() {
        return unanswered;
    }
    Outcome { done, written: data.saturating_add(1) }
}

/// Runs the request of `body` (the chain without its status descriptor);
/// returns what was done and the bytes written into guest buffers.
fn execute(
    mem: &GuestMemory,
    storage: &mut dyn Backend,
    bounce: &mut Vec<u8>,
    body: &[Descriptor],
) -> Result<(Done, u32), Refused> {
    let (header, data) = body.split_first().ok_or(IOERR)?;
    if header.is_write_only() || header.len() < HEADER_LEN {
        return Err(IOERR);
    }
    let mut raw = [0u8; HEADER_LEN as usize];
    mem.read_slice(&mut raw, header.addr()).map_err(|_| IOERR)?;
    let kind = u32::from_le_bytes(raw[0..4].try_into().expect("4 bytes"));
    let sector = u64::from_le_bytes(raw[8..16].try_into().expect("8 bytes"));
    match kind {
        VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
            let to_guest = kind == VIRTIO_BLK_T_IN;
            let total = transfer(mem, storage, bounce, data, sector, to_guest)?;
            Ok(if to_guest { (Done::Read(total), total as u32) } else { (Done::Write(total), 0) })
        }
        VIRTIO_BLK_T_FLUSH => {
            storage.flush().map_err(|_| IOERR)?;
            Ok((Done::Flush, 0))
        }
        VIRTIO_BLK_T_GET_ID => {
            let [buffer] = data else { return Err(IOERR) };
            if !buffer.is_write_only() {
                return Err(IOERR);
            }
            // The ID is NUL-padded to 20 bytes; a shorter buffer gets a prefix.
            let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
            id[..DISK_ID.len()].copy_from_slice(DISK_ID);
            let n = buffer.len().min(VIRTIO_BLK_ID_BYTES) as usize;
            mem.write_slice(&id[..n], buffer.addr()).map_err(|_| IOERR)?;
            Ok((Done::GetId, n as u32))
        }
        _ => Err(Refused(VIRTIO_BLK_S_UNSUPP)),
    }
}

/// Moves the data of a read (`to_guest`) or write between `data`'s
/// buffers and storage from `sector` on; returns the bytes moved.
fn transfer(
    mem: &GuestMemory,
    storage: &mut dyn Backend,
    bounce: &mut Vec<u8>,
    data: &[Descriptor],
    sector: u64,
    to_guest: bool,
) -> Result<u64, Refused> {
    let mut total = 0u64;
    for d in data {
        let sized = u64::from(d.len()).is_multiple_of(SECTOR_SIZE);
        if d.is_write_only() != to_guest || !sized || !mem.check_range(d.addr(), d.len() as usize) {
            return Err(IOERR);
        }
        total += u64::from(d.len());
    }
    let offset = sector.checked_mul(SECTOR_SIZE).ok_or(IOERR)?;
    let total_len = usize::try_from(total).map_err(|_| IOERR)?;
    check_range(offset, total_len, storage.size()).map_err(|_| IOERR)?;
    let mut at = offset;
    for d in data {
        let mut done = 0usize;
        while done < d.len() as usize {
            let n = (d.len() as usize - done).min(CHUNK);
            bounce.resize(n, 0);
            let addr = GuestAddress(d.addr().0 + done as u64);
            if to_guest {
                storage.read_at(at, bounce).map_err(|_| IOERR)?;
                mem.write_slice(bounce, addr).map_err(|_| IOERR)?;
            } else {
                mem.read_slice(bounce, addr).map_err(|_| IOERR)?;
                storage.write_at(at, bounce).map_err(|_| IOERR)?;
            }
            at += n as u64;
            done += n;
        }
    }
    Ok(total)
}
