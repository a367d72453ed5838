//! Transmission flags of an export (`NBD_FLAG_*`).

/// The other flags are valid.
pub const HAS_FLAGS: u16 = 1;
/// Writes are refused.
pub const READ_ONLY: u16 = 1 << 1;
/// The server understands `NBD_CMD_FLUSH`.
pub const SEND_FLUSH: u16 = 1 << 2;
/// The server understands the FUA flag on writes.
pub const SEND_FUA: u16 = 1 << 3;
/// The server understands `NBD_CMD_TRIM`.
pub const SEND_TRIM: u16 = 1 << 5;
/// The server understands `NBD_CMD_CACHE`.
pub const SEND_CACHE: u16 = 1 << 10;
