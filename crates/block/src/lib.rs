//! Storage behind tsubame's virtual disk: a [`Backend`] trait that every
//! kind of storage implements (a raw image file, an NBD export),
//! the host-side [`BlockCache`] in front of it (LRU, write-through, the
//! hypervisor's page cache of the I/O paper), the [`DiskSpec`] that names
//! storage on the command line and in a migrating VM's state, and the
//! `disk-mixed` workload's [`records`] with their checker.
//!
//! Nothing here knows about virtio or guest memory: the device in
//! `tsubame-vmm` turns guest requests into calls on a [`Backend`].

pub mod cache;
pub mod nbd;
pub mod raw;
pub mod records;
pub mod spec;

pub use cache::{BlockCache, CacheStats};
pub use nbd::{NbdClient, NbdError, NbdUri};
pub use raw::RawFile;
pub use spec::DiskSpec;

/// The unit of guest requests: offsets and lengths are multiples of it.
pub const SECTOR_SIZE: u64 = 512;

/// The unit of the cache, of O_DIRECT alignment and of image sizes.
pub const BLOCK_SIZE: usize = 4096;

/// Why storage could not be opened or accessed.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The image could not be opened.
    #[error("cannot open disk image {path}")]
    Open {
        /// The path given.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The image's size is not usable.
    #[error("disk image {path} is {size} bytes: its size must be a non-zero multiple of 4 KiB (make one with `tsubame disk-create`)")]
    BadSize {
        /// The path given.
        path: String,
        /// Its size.
        size: u64,
    },
    /// A request outside the storage or not sector-aligned (a caller bug or
    /// a guest's bad request, refused before any I/O).
    #[error("request of {len} bytes at offset {offset} is outside the {size}-byte disk or not sector-aligned")]
    OutOfRange {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: usize,
        /// Storage size.
        size: u64,
    },
    /// Reading, writing or flushing failed.
    #[error("disk {what} failed")]
    Io {
        /// read, write or flush.
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Talking to an NBD server failed.
    #[error("NBD export {uri}")]
    Nbd {
        /// The export's URI.
        uri: String,
        /// What went wrong.
        #[source]
        source: NbdError,
    },
    /// A disk spec that names storage this build cannot reach.
    #[error("{0}")]
    Unsupported(String),
    /// A disk spec that does not parse.
    #[error("bad disk '{spec}': {reason}")]
    BadSpec {
        /// What was given.
        spec: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Storage of a fixed size, read and written in whole sectors. Calls come
/// from one thread at a time (the vCPU's), hence `&mut self`.
pub trait Backend: Send {
    /// Size in bytes (a multiple of [`BLOCK_SIZE`]).
    fn size(&self) -> u64;
    /// Fills `buf` from `offset`; both multiples of [`SECTOR_SIZE`], inside
    /// the storage.
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError>;
    /// Writes `data` at `offset`, with the same rules as reads. When it
    /// returns, the data is on the storage (another opener sees it), though
    /// it may sit in the storage's volatile cache until [`Backend::flush`].
    fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), BlockError>;
    /// Makes every completed write durable.
    fn flush(&mut self) -> Result<(), BlockError>;
}

/// Checks that `[offset, offset + len)` is sector-aligned and inside `size`.
pub fn check_range(offset: u64, len: usize, size: u64) -> Result<(), BlockError> {
    let aligned = offset.is_multiple_of(SECTOR_SIZE) && (len as u64).is_multiple_of(SECTOR_SIZE);
    if aligned && offset.checked_add(len as u64).is_some_and(|end| end <= size) {
        Ok(())
    } else {
        Err(BlockError::OutOfRange { offset, len, size })
    }
}

/// Opens the storage a spec names.
pub fn open(spec: &DiskSpec) -> Result<Box<dyn Backend>, BlockError> {
    match spec {
        DiskSpec::File(path) => Ok(Box::new(RawFile::open(path)?)),
        DiskSpec::Nbd(uri) => {
            let uri = NbdUri::parse(uri)?;
            Ok(match &uri.socket {
                Some(path) => Box::new(NbdClient::connect_unix(&uri, path, nbd::DEFAULT_TIMEOUT)?),
                None => Box::new(NbdClient::connect(&uri, nbd::DEFAULT_TIMEOUT)?),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked() {
        assert!(check_range(0, 4096, 4096).is_ok());
        assert!(check_range(512, 512, 4096).is_ok());
        assert!(check_range(4096, 0, 4096).is_ok());
        assert!(check_range(4096, 512, 4096).is_err());
        assert!(check_range(100, 512, 4096).is_err());
        assert!(check_range(0, 100, 4096).is_err());
        assert!(check_range(u64::MAX - 511, 512, u64::MAX).is_err());
    }
}
