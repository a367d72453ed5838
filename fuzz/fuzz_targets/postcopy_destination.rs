//! Post-copy's destination end on bytes from a peer: the switch's missing
//! set (POSTCOPY), page frames plain and compressed, ERROR and DIGEST on
//! channel 0, then a reconnecting source's RESUME handshake and what
//! follows it (channel 0's frames, or the request connection's pages),
//! installed into memory registered for missing-page faults (no KVM).
//! Layout of an input: `tsubame_migrate::destination::postcopy::fuzz`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tsubame_migrate::destination::postcopy::fuzz::feed;

fuzz_target!(|data: &[u8]| {
    let _ = feed(data);
});
