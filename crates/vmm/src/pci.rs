//! A PCI bus reached through configuration mechanism #1 (address on port
//! 0xCF8, data on 0xCFC..=0xCFF), with one function at 00:01.0: the legacy
//! virtio-blk device, whose registers are an I/O BAR. That is all the
//! ring-3 guest needs to find the disk the way it finds QEMU's
//! `virtio-blk-pci,disable-modern=on`; there is no firmware, so BAR0 comes
//! already placed (as SeaBIOS leaves it under QEMU) and interrupts are not
//! wired (the guest polls).

use crate::pci_state::{copy_out, COMMAND_IO};
pub use crate::pci_state::{PciFunctionState, DEFAULT_BAR0};
use crate::virtio_blk::{VirtioBlk, REGISTERS_LEN};

/// The configuration address port.
pub const CONFIG_ADDRESS: u16 = 0xCF8;
/// The first configuration data port.
pub const CONFIG_DATA: u16 = 0xCFC;

/// The disk's slot on bus 0.
pub const DISK_DEVICE: u8 = 1;

/// Red Hat's virtio vendor ID, and the legacy (transitional) block device.
const VIRTIO_VENDOR: u16 = 0x1AF4;
const VIRTIO_BLK_LEGACY_DEVICE: u16 = 0x1001;
/// Mass storage, SCSI: what QEMU reports for virtio-blk.
const CLASS_STORAGE_SCSI: u32 = 0x0100;

/// BAR0's size: the legacy registers rounded up to a power of two.
const BAR0_SIZE: u16 = REGISTERS_LEN.next_power_of_two();

impl PciFunctionState {
    /// The 32-bit configuration register at `reg` (a multiple of 4).
    fn config_read(&self, reg: u8, sizing_bar: bool) -> u32 {
        match reg {
            0x00 => u32::from(VIRTIO_BLK_LEGACY_DEVICE) << 16 | u32::from(VIRTIO_VENDOR),
            0x04 => u32::from(self.command),
            // Class code, subclass, prog-if 0, revision 0.
            0x08 => CLASS_STORAGE_SCSI << 16,
            0x10 if sizing_bar => !(u32::from(BAR0_SIZE) - 1) | 1,
            0x10 => u32::from(self.bar0) | 1,
            // Legacy virtio: the subsystem ID is the device type.
            0x2C => virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK << 16 | u32::from(VIRTIO_VENDOR),
            // Interrupt pin A, no line routed.
            0x3C => 0x0000_01FF,
            _ => 0,
        }
    }

    /// A write of `value` to the 32-bit register at `reg`, merged from a
    /// narrower access. Returns whether the BAR is being sized.
    fn config_write(&mut self, reg: u8, value: u32) -> bool {
        match reg {
            0x04 => self.command = value as u16 & COMMAND_IO,
            0x10 if value == u32::MAX => return true,
            0x10 => self.bar0 = (value as u16) & !(BAR0_SIZE - 1),
            _ => {}
        }
        false
    }

    /// The BAR0 offset of `port`, when the guest decodes I/O there.
    fn bar_offset(&self, port: u16, len: usize) -> Option<u16> {
        let offset = port.checked_sub(self.bar0)?;
        let decoding = self.command & COMMAND_IO != 0 && self.bar0 != 0;
        (decoding && offset as usize + len <= BAR0_SIZE as usize).then_some(offset)
    }
}

/// The bus: the configuration address latch and the one device.
#[derive(Default)]
pub struct PciBus {
    address: u32,
    sizing_bar: bool,
    function: PciFunctionState,
    disk: Option<VirtioBlk>,
}

impl PciBus {
    /// Plugs the disk in at 00:01.0 with its PCI settings.
    pub fn attach_disk(&mut self, disk: VirtioBlk, function: PciFunctionState) {
        self.disk = Some(disk);
        self.function = function;
    }

    /// The disk, when one is plugged in.
    pub fn disk(&self) -> Option<&VirtioBlk> {
        self.disk.as_ref()
    }

    /// The disk, to change it.
    pub fn disk_mut(&mut self) -> Option<&mut VirtioBlk> {
        self.disk.as_mut()
    }

    /// The disk's PCI settings.
    pub fn function(&self) -> PciFunctionState {
        self.function
    }

    /// The configuration register selected by the address latch: Some(reg)
    /// when it names our function and the enable bit is set.
    fn selected(&self) -> Option<u8> {
        let enabled = self.address & 0x8000_0000 != 0;
        let bus = (self.address >> 16) & 0xFF;
        let device = (self.address >> 11) & 0x1F;
        let function = (self.address >> 8) & 0x7;
        let ours = enabled && bus == 0 && device == u32::from(DISK_DEVICE) && function == 0;
        (ours && self.disk.is_some()).then_some((self.address & 0xFC) as u8)
    }

    /// Handles a guest read of `port`; false when no device answers there.
    pub fn read(&mut self, port: u16, data: &mut [u8]) -> bool {
        if port == CONFIG_ADDRESS && data.len() == 4 {
            data.copy_from_slice(&self.address.to_le_bytes());
        } else if (CONFIG_DATA..CONFIG_DATA + 4).contains(&port) {
            // A missing function reads as all ones.
            let value = self.selected().map_or(u32::MAX, |reg| self.function.config_read(reg, self.sizing_bar));
            copy_out(&value.to_le_bytes(), (port - CONFIG_DATA) as usize, data);
        } else if let (Some(offset), Some(disk)) = (self.function.bar_offset(port, data.len()), self.disk.as_mut()) {
            disk.read_register(offset, data);
        } else {
            return false;
        }
        true
    }

    /// Handles a guest write to `port`; false when no device answers there.
    pub fn write(&mut self, port: u16, data: &[u8]) -> bool {
        if port == CONFIG_ADDRESS && data.len() == 4 {
            self.address = u32::from_le_bytes(data.try_into().expect("4 bytes"));
        } else if (CONFIG_DATA..CONFIG_DATA + 4).contains(&port) {
            if let Some(reg) = self.selected() {
                let mut bytes = self.function.config_read(reg, false).to_le_bytes();
                let at = (port - CONFIG_DATA) as usize;
                let len = data.len().min(4 - at);
                bytes[at..at + len].copy_from_slice(&data[..len]);
                self.sizing_bar = self.function.config_write(reg, u32::from_le_bytes(bytes));
            }
        } else if let (Some(offset), Some(disk)) = (self.function.bar_offset(port, data.len()), self.disk.as_mut()) {
            disk.write_register(offset, data);
        } else {
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_space_decodes() {
        let mut f = PciFunctionState::default();
        assert_eq!(f.config_read(0, false), 0x1001_1AF4);
        assert_eq!(f.config_read(0x10, false), 0xC001);
        assert_eq!(f.config_read(0x2C, false) >> 16, 2);
        // Sizing BAR0: all ones in, the size mask out, then a new base.
        assert!(f.config_write(0x10, u32::MAX));
        assert_eq!(f.config_read(0x10, true), !(u32::from(BAR0_SIZE) - 1) | 1);
        assert!(!f.config_write(0x10, 0xD001));
        assert_eq!(f.bar0, 0xD000);
        assert_eq!(f.bar_offset(0xD013, 1), Some(0x13));
        assert_eq!(f.bar_offset(0xC013, 1), None);
        f.config_write(0x04, 0);
        assert_eq!(f.bar_offset(0xD013, 1), None, "I/O decode off");
    }

    #[test]
    fn empty_slots_read_all_ones() {
        let mut bus = PciBus::default();
        bus.write(CONFIG_ADDRESS, &(0x8000_0000u32 | 1 << 11).to_le_bytes());
        let mut data = [0u8; 4];
        assert!(bus.read(CONFIG_DATA, &mut data));
        assert_eq!(data, [0xFF; 4], "no disk plugged in");
        assert!(!bus.read(DEFAULT_BAR0, &mut data[..1]));
    }
}
