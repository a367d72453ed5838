//! The control socket's migrate request: JSON bytes as a client sends
//! them, decoded to a `serde_json::Value` as the control socket does, then
//! `MigrateRequest::parse` (unknown keys refused, types checked) and
//! `MigrateRequest::options` (every option's own parser: address, codecs,
//! granularity, sub-page detector, post-copy mode, GPU offload).
//!
//! crates/cli is a binary crate: its `request.rs` (std, serde and
//! tsubame-migrate only) is compiled into this target as it stands. The
//! keys naming files (`psk_file`, `tls_*`) are dropped first: reading
//! files named by the fuzzer is not the parser's work.
#![no_main]

#[allow(dead_code)]
#[path = "../../crates/cli/src/request.rs"]
mod request;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    if let Some(object) = value.as_object_mut() {
        for key in ["psk_file", "tls_cert", "tls_key", "tls_ca"] {
            object.remove(key);
        }
    }
    if let Ok(request) = request::MigrateRequest::parse(&value) {
        let _ = request.options();
    }
});
