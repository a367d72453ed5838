//! Why an incoming migration failed.

use crate::protocol::WireError;
use crate::transport::TransportError;

/// Why an incoming migration failed.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    /// Accepting.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The stream.
    #[error("migration stream: {0}")]
    Wire(#[from] WireError),
    /// Building the VM.
    #[error("VM: {0}")]
    Vm(#[from] tsubame_vmm::VmError),
    /// The source's setup does not fit this destination.
    #[error("{0}")]
    Mismatch(String),
    /// A receiving thread stopped (another failed first and says why).
    #[error("a receiving thread stopped")]
    ThreadStopped,
    /// The source gave up and said why.
    #[error("source aborted: {0}")]
    SourceAborted(String),
    /// The memory does not match the source's digest.
    #[error("memory digest mismatch in {count} of {total} regions (first at byte {first:#x})")]
    DigestMismatch {
        /// Regions that differ.
        count: usize,
        /// Regions compared.
        total: usize,
        /// Address of the first differing region.
        first: u64,
    },
    /// The VM state blob did not decode.
    #[error("VM state frame does not decode: {0}")]
    BadState(String),
    /// Far memory's exports could not be attached.
    #[error("far memory: {0}")]
    FarMemory(String),
    /// The post-copy phase failed: the VM ran here without all its pages.
    #[error("post-copy: {0}")]
    Postcopy(String),
    /// An extra channel failed.
    #[error("channel {channel}: {source}")]
    Channel {
        /// Which channel.
        channel: u16,
        /// What went wrong on it.
        source: Box<ReceiveError>,
    },
}

impl From<std::io::Error> for ReceiveError {
    fn from(e: std::io::Error) -> Self {
        ReceiveError::Wire(WireError::Io(e))
    }
}
