//! The VM's migratable state apart from its memory, and its one encoding
//! (postcard): what the STATE frame of a migration carries. Each part's
//! state type lives beside the part (`VcpuState` in vcpu.rs); this file
//! gathers them and says how they travel.

use serde::{Deserialize, Serialize};

use crate::vcpu::VcpuState;

/// The whole migratable state of a VM apart from its memory.
#[derive(Clone, Serialize, Deserialize)]
pub struct VmState {
    /// Guest memory size the state belongs to.
    pub memory_bytes: u64,
    /// TSC frequency the guest was calibrated for.
    pub tsc_khz: u32,
    /// One entry per vCPU.
    pub vcpus: Vec<VcpuState>,
}

/// A state blob that does not decode.
#[derive(Debug, thiserror::Error)]
#[error("VM state does not decode: {0}")]
pub struct PersistError(String);

impl VmState {
    /// The bytes of the STATE frame.
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_stdvec(self).expect("VM state serializes")
    }

    /// Reads a STATE frame's bytes (a peer's: checked, never trusted).
    pub fn decode(bytes: &[u8]) -> Result<VmState, PersistError> {
        postcard::from_bytes(bytes).map_err(|e| PersistError(e.to_string()))
    }
}
