//! tsubame's KVM micro-VM: one VM with guest memory, vCPUs running the
//! multiboot test guest, a debug console on port 0xE9, a virtio-blk disk
//! on a legacy PCI I/O BAR, pause/resume from another thread, full vCPU
//! and device state save/restore and KVM's dirty log.
//!
//! The crate never decides policy (when to pause, what to send); the
//! migration engine drives it.

pub mod bitmap;
pub mod boot;
pub mod cpu_time;
pub mod devices;
mod dirty;
pub mod guest_elf;
pub mod kvm;
pub mod memory;
pub mod pci;
mod pci_state;
pub mod persist;
pub mod uffd;
mod userfaultfd;
pub mod vcpu;
pub mod virtio_blk;
pub mod vm;

pub use bitmap::DirtyBitmap;
pub use devices::ConsoleLine;
pub use memory::{GuestMemory, PAGE_SIZE};
pub use persist::VmState;
pub use vcpu::{VcpuState, VcpuStatus, VcpuSwitchTimes};
pub use virtio_blk::{DiskStats, VirtioBlkState};
pub use vm::disk::DiskWarmList;
pub use vm::restore::PendingRestore;
pub use vm::{Vm, VmConfig, VmError};
