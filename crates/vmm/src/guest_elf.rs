//! The test guest, built from `guest/` by build.rs and embedded here so the
//! binary needs no file next to it.

/// The multiboot v1 ELF32 image of the test guest.
pub static GUEST_ELF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/guest.elf"));
