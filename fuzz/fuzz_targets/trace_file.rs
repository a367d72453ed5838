//! The trace loader on arbitrary files.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tsubame_trace::Trace::read(data);
});
