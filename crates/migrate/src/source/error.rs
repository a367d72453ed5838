//! What can go wrong on the sending side.

use tsubame_gpu::GpuError;

use crate::protocol::WireError;
use crate::transport::TransportError;

/// Why a migration failed.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// Connecting.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The stream.
    #[error("migration stream: {0}")]
    Wire(#[from] WireError),
    /// Encoding or sending.
    #[error("migration stream: {0}")]
    Pipeline(#[from] PipelineError),
    /// The destination said no.
    #[error("destination refused: {0}")]
    Refused(String),
    /// A VM operation.
    #[error("VM: {0}")]
    Vm(#[from] tsubame_vmm::VmError),
    /// The VM is not in a state to migrate.
    #[error("the VM is {0}; only a running VM can be migrated")]
    NotRunning(&'static str),
    /// Iterating did not converge and the user asked to abort then.
    #[error("did not converge ({0}) and --abort-if-not-converged was given")]
    NotConverged(String),
    /// The options contradict each other.
    #[error("{0}")]
    BadOptions(String),
    /// Far memory could not hand over its map (a memory host failed).
    #[error("{0}")]
    FarMemory(String),
    /// Post-copy broke off: the VM ran at the destination without all its
    /// pages, and this copy is stale.
    #[error("post-copy failed ({0}): the VM is lost — it ran at the destination, which lacks pages only this paused copy holds; it is not resumed here")]
    PostcopyLost(String),
    /// The destination's memory, every page received, differs from the
    /// source's.
    #[error("post-copy: the destination's memory differs from the source's in {0} digest regions")]
    PostcopyCorrupt(u32),
    /// POSTCOPY (the switch) went out but the destination never said it
    /// runs the VM, nor came back: it may run it, or may never have had it.
    #[error("post-copy: the switch was sent but the destination never said it runs the VM ({0}); the VM stays paused here and may be running at the destination — check it before resuming")]
    SwitchUnconfirmed(String),
    /// COMMIT went out but the destination never confirmed.
    #[error("commit was sent but the destination did not confirm ({0}); the VM stays paused here and may be running at the destination — check it before resuming")]
    CommitUnconfirmed(String),
}

impl SourceError {
    /// A failure to reconnect before the destination said it runs the VM:
    /// a destination that never had POSTCOPY went back to waiting and
    /// refuses it, so the VM may never have run there and this copy is
    /// whole. It stays paused (not lost), as after an unconfirmed COMMIT.
    pub(super) fn unconfirmed(self) -> SourceError {
        match self {
            SourceError::PostcopyLost(why) => SourceError::SwitchUnconfirmed(why),
            other => other,
        }
    }
}

impl From<std::io::Error> for SourceError {
    fn from(e: std::io::Error) -> Self {
        SourceError::Wire(WireError::Io(e))
    }
}

/// What went wrong inside the pipeline.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// Writing to a channel failed.
    #[error("channel {channel}: connection lost while writing")]
    Write {
        /// Which channel.
        channel: u16,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The GPU failed to encode a batch.
    #[error("GPU encoding failed")]
    Gpu(#[from] GpuError),
    /// A stage thread is gone (it failed first: see the other error).
    #[error("a pipeline stage stopped")]
    Stopped,
}
