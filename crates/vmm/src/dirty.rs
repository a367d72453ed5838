//! KVM's dirty page log: fetch into a caller's buffer, and clear chosen
//! bits (which also write-protects those pages again) when the VM uses
//! KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.
//!
//! kvm-ioctls offers KVM_GET_DIRTY_LOG only as a fresh Vec per call and no
//! KVM_CLEAR_DIRTY_LOG, so both ioctls are issued here.

use std::os::fd::AsRawFd;

use kvm_bindings::{kvm_clear_dirty_log, kvm_dirty_log};
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::{ioctl_iow_nr, ioctl_iowr_nr};

const KVMIO: u32 = 0xAE;
ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);
ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);

/// Copies the dirty bitmap of `slot` into `bitmap` (one bit per page, LSB
/// first). Without manual protection this also clears the log and
/// write-protects the pages; with it, the bits stay until cleared.
pub(crate) fn get_dirty_log(vm: &impl AsRawFd, slot: u32, bitmap: &mut [u64]) -> std::io::Result<()> {
    let mut log = kvm_dirty_log { slot, ..Default::default() };
    log.__bindgen_anon_1.dirty_bitmap = bitmap.as_mut_ptr().cast();
    // SAFETY: the caller sized `bitmap` to one bit per page of the slot
    // (Vm::dirty_log checks it), so KVM writes only inside it.
    let ret = unsafe { ioctl_with_ref(vm, KVM_GET_DIRTY_LOG(), &log) };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Clears the bits set in `mask` for pages `first_page ..` of `slot`, and
/// write-protects those pages so the next write logs them again.
/// `first_page` must be a multiple of 64.
pub(crate) fn clear_dirty_log(vm: &impl AsRawFd, slot: u32, first_page: u64, mask: &[u64]) -> std::io::Result<()> {
    let mut clear = kvm_clear_dirty_log { slot, num_pages: (mask.len() * 64) as u32, first_page, ..Default::default() };
    clear.__bindgen_anon_1.dirty_bitmap = mask.as_ptr() as *mut _;
    // SAFETY: KVM reads `num_pages` bits from `mask`, which holds exactly
    // that many; it never writes through the pointer.
    let ret = unsafe { ioctl_with_ref(vm, KVM_CLEAR_DIRTY_LOG(), &clear) };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
