//! The PCI function's settings that migrate, and register reads: what
//! the bus (`pci.rs`) and the device's saved state (`virtio_blk/`) share,
//! apart from both so that neither imports the other back.

use serde::{Deserialize, Serialize};

/// Where BAR0 starts until the guest moves it.
pub const DEFAULT_BAR0: u16 = 0xC000;
/// I/O space enable in the command register.
pub(crate) const COMMAND_IO: u16 = 1;

/// The PCI function's guest-visible settings that migrate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciFunctionState {
    /// The command register.
    pub command: u16,
    /// BAR0's I/O base.
    pub bar0: u16,
}

impl Default for PciFunctionState {
    fn default() -> Self {
        PciFunctionState { command: COMMAND_IO, bar0: DEFAULT_BAR0 }
    }
}

/// Copies the bytes of `register` from `at` into `data` (0xFF past its end).
pub(crate) fn copy_out(register: &[u8], at: usize, data: &mut [u8]) {
    for (i, byte) in data.iter_mut().enumerate() {
        *byte = register.get(at + i).copied().unwrap_or(0xFF);
    }
}
