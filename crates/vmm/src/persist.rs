//! The VM's migratable state apart from its memory, and its one encoding
//! (postcard): what the STATE frame of a migration carries. Each part's
//! state type lives beside the part (`VcpuState` in vcpu.rs); this file
//! gathers them and says how they travel.

use serde::{Deserialize, Serialize};

use crate::vcpu::VcpuState;
use crate::virtio_blk::VirtioBlkState;

/// The whole migratable state of a VM apart from its memory.
#[derive(Clone, Serialize, Deserialize)]
pub struct VmState {
    /// Guest memory size the state belongs to.
    pub memory_bytes: u64,
    /// TSC frequency the guest was calibrated for.
    pub tsc_khz: u32,
    /// One entry per vCPU.
    pub vcpus: Vec<VcpuState>,
    /// The virtio-blk disk, when the VM has one: its registers, queue
    /// position and which storage to open (`VirtioBlkState` beside it).
    pub disk: Option<VirtioBlkState>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::{kvm_msr_entry, kvm_xsave};
    use proptest::prelude::*;

    fn state(rip: u64, rax: u64, cr3: u64, tsc: u64, xsave_word: u32, tsc_khz: u32) -> VmState {
        let mut vcpu = VcpuState {
            msrs: vec![kvm_msr_entry { index: 0x10, data: tsc, ..Default::default() }],
            regs: Default::default(),
            sregs: Default::default(),
            xsave: kvm_xsave::default(),
            xcrs: Default::default(),
            debugregs: Default::default(),
            mp_state: Default::default(),
            events: Default::default(),
        };
        vcpu.regs.rip = rip;
        vcpu.regs.rax = rax;
        vcpu.sregs.cr3 = cr3;
        vcpu.xsave.region[7] = xsave_word;
        VmState { memory_bytes: 1 << 30, tsc_khz, vcpus: vec![vcpu], disk: None }
    }

    proptest! {
        /// The STATE frame's payload decodes to the state that was saved.
        #[test]
        fn state_round_trips(rip in any::<u64>(), rax in any::<u64>(), cr3 in any::<u64>(), tsc in any::<u64>(),
                             word in any::<u32>(), khz in any::<u32>()) {
            let saved = state(rip, rax, cr3, tsc, word, khz);
            let back = VmState::decode(&saved.encode()).unwrap();
            prop_assert_eq!(back.encode(), saved.encode());
            prop_assert_eq!(back.vcpus[0].regs.rip, rip);
            prop_assert_eq!(back.vcpus[0].msr(0x10), Some(tsc));
        }
    }

    #[test]
    fn disk_state_round_trips() {
        let mut saved = state(1, 2, 3, 4, 5, 6);
        saved.disk = Some(VirtioBlkState {
            disk: "nbd://storage:10809/vm1".parse().unwrap(),
            size_bytes: 1 << 30,
            cache_bytes: 64 << 20,
            pci: Default::default(),
            driver_features: 1 << 9,
            status: 7,
            isr: 1,
            queue_select: 0,
            queue_pfn: 0x1234,
            next_avail: 65535,
            next_used: 3,
        });
        let back = VmState::decode(&saved.encode()).unwrap();
        assert_eq!(back.disk, saved.disk);
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(VmState::decode(&[0xFF; 7]).is_err());
    }
}
