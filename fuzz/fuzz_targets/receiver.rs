//! The whole receiving state machine — handshake, HELLO checks, pages of
//! every encoding through the shard decoders, STATE, digest, repair
//! requests, COMMIT — fed by the fuzzer and landing in plain memory (no
//! KVM). Fuzz builds skip the frame CRC so mutations get past it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tsubame_migrate::destination::{receive_stream, MemoryLanding, ReceiveOptions};

fuzz_target!(|data: &[u8]| {
    let input = std::io::Cursor::new(data.to_vec());
    // Small memory only: each run maps what HELLO asks for.
    let mut landing = MemoryLanding { max_bytes: 32 << 20, memory: None, started: false };
    let _ = receive_stream(input, std::io::sink(), &mut landing, &ReceiveOptions::default());
});
