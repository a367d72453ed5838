//! The ranges both ends hold each other to.

/// Most channels of one migration.
pub const MAX_CHANNELS: u16 = 16;
/// Most codec shards of one migration.
pub const MAX_SHARDS: u16 = 64;
/// Times a destination asks for mismatched digest regions (and a source
/// re-sends them) before the migration fails.
pub const MAX_REPAIR_ROUNDS: u32 = 2;

/// Checks a sub-page granularity: a power of two from 64 to 4096 bytes.
pub fn check_granularity(bytes: u32) -> Result<(), String> {
    if bytes.is_power_of_two() && (64..=tsubame_codec::PAGE_SIZE as u32).contains(&bytes) {
        Ok(())
    } else {
        Err(format!("granularity {bytes} must be a power of two from 64 to 4096"))
    }
}
