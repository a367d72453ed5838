//! The NBD client against a hostile server: the fuzzer's bytes are all
//! the server ever says, through negotiation (GO, the EXPORT_NAME
//! fallback, option replies) and then replies to reads, writes, a flush,
//! a cache hint and a pipelined batch. Nothing may panic or allocate
//! without bound.
#![no_main]

use std::io::{Read, Write};

use libfuzzer_sys::fuzz_target;
use tsubame_block::nbd::{NbdClient, NbdUri};

/// The server: reads come from the fuzzer's bytes, writes vanish.
struct Server<'a>(&'a [u8]);

impl Read for Server<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Server<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let uri = NbdUri::parse("nbd://fuzz/export").unwrap();
    let Ok(mut client) = NbdClient::handshake(Server(data), &uri) else { return };
    let size = client.size();
    let mut buf = [0u8; 4096];
    let _ = client.read_at(0, &mut buf);
    let _ = client.write_at(size - 4096, &buf);
    let _ = client.flush();
    let _ = client.cache(0, 4096);
    if let (Ok(a), Ok(b)) = (client.submit_read(0, 512), client.submit_read(512, 512)) {
        let _ = client.wait(b);
        let _ = client.wait(a);
    }
    let (mut x, mut y) = ([0u8; 512], [0u8; 1024]);
    let _ = client.read_many(&mut [(0, &mut x[..]), (4096, &mut y[..])]);
    let _ = client.trim(0, 4096);
});
