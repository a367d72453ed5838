//! Opening /dev/kvm with errors a user can act on.

use kvm_ioctls::{Cap, Kvm};

/// Why KVM could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    /// The device node is missing.
    #[error("/dev/kvm does not exist — load the kvm module or run on a host with virtualization enabled")]
    Missing,
    /// The device node exists but we may not open it.
    #[error("/dev/kvm: permission denied — run as root or add yourself to the kvm group")]
    PermissionDenied,
    /// Any other failure to open the device.
    #[error("cannot open /dev/kvm")]
    Open(#[source] std::io::Error),
    /// The kernel's KVM is too old for us.
    #[error("KVM lacks a capability tsubame needs: {0}")]
    MissingCapability(&'static str),
}

/// Opens /dev/kvm and checks the capabilities every VM needs.
pub fn open() -> Result<Kvm, KvmError> {
    let kvm = Kvm::new().map_err(|e| match e.errno() {
        libc::ENOENT => KvmError::Missing,
        libc::EACCES | libc::EPERM => KvmError::PermissionDenied,
        _ => KvmError::Open(std::io::Error::from_raw_os_error(e.errno())),
    })?;
    for (cap, name) in [
        (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
        (Cap::ImmediateExit, "KVM_CAP_IMMEDIATE_EXIT"),
        (Cap::ExtCpuid, "KVM_CAP_EXT_CPUID"),
    ] {
        if !kvm.check_extension(cap) {
            return Err(KvmError::MissingCapability(name));
        }
    }
    Ok(kvm)
}
