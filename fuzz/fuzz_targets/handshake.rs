//! The connection setup a destination runs before any memory moves: the
//! pre-shared-key handshake (HELLO, proofs, status bytes), the first
//! encrypted records, then the migration preamble, HELLO and CHANNEL
//! frames, on bytes from a peer that holds no key.
#![no_main]

use std::io::{Read, Write};

use libfuzzer_sys::fuzz_target;
use tsubame_migrate::secure::{self, Opener, Psk, Role};
use tsubame_migrate::wire;

/// The peer: reads come from the fuzzer's bytes, writes vanish.
struct Peer<'a>(&'a [u8]);

impl Read for Peer<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Peer<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let psk = Psk::new(b"fuzzing-pre-shared-key".to_vec()).unwrap();
    for role in [Role::Server, Role::Client] {
        let _ = secure::psk_handshake(&mut Peer(data), &psk, role);
    }
    // Records under a key the peer does not know: none may open, none may
    // allocate past the record cap.
    let mut opener = Opener::new(&[7u8; 32]);
    let mut input = data;
    let mut buf = [0u8; 4096];
    for _ in 0..4 {
        if opener.read(&mut input, &mut buf).map_or(true, |n| n == 0) {
            break;
        }
    }
    // What follows the handshake in the clear of the record layer.
    let mut input = data;
    let _ = wire::read_preamble(&mut input);
    let mut frame = Vec::new();
    for _ in 0..2 {
        match wire::read_frame(&mut input, &mut frame) {
            Ok(wire::FrameKind::Hello) => drop(wire::Hello::decode(&frame)),
            Ok(wire::FrameKind::Channel) => drop(wire::decode_channel(&frame)),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let _ = wire::Hello::decode(data);
    let _ = wire::decode_channel(data);
});
