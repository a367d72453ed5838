//! The client against a server the tests play: handshakes, replies in and
//! out of order, error codes, a server that hangs, a broken connection.

use super::super::handshake::fake;
use super::*;
use std::net::TcpListener;
use std::thread::{self, JoinHandle};

const SIZE: u64 = 1 << 20;
const ALL: u16 = flags::HAS_FLAGS | flags::SEND_FLUSH | flags::SEND_TRIM | flags::SEND_CACHE;

/// A server thread on a fresh port running `serve` on the first
/// connection; the URI names export "e".
fn server<T: Send + 'static>(serve: impl FnOnce(TcpStream) -> T + Send + 'static) -> (NbdUri, JoinHandle<T>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let thread = thread::spawn(move || serve(listener.accept().unwrap().0));
    (NbdUri::parse(&format!("nbd://127.0.0.1:{port}/e")).unwrap(), thread)
}

struct Request {
    command: u16,
    cookie: u64,
    offset: u64,
    len: u32,
    data: Vec<u8>,
}

fn request(s: &mut TcpStream) -> Option<Request> {
    let mut head = [0u8; 28];
    s.read_exact(&mut head).ok()?;
    assert_eq!(u32::from_be_bytes(head[0..4].try_into().unwrap()), REQUEST_MAGIC);
    let command = u16::from_be_bytes(head[6..8].try_into().unwrap());
    let len = u32::from_be_bytes(head[24..28].try_into().unwrap());
    let mut data = Vec::new();
    if command == Command::Write as u16 {
        data = vec![0; len as usize];
        s.read_exact(&mut data).unwrap();
    }
    Some(Request {
        command,
        cookie: u64::from_be_bytes(head[8..16].try_into().unwrap()),
        offset: u64::from_be_bytes(head[16..24].try_into().unwrap()),
        len,
        data,
    })
}

fn reply(s: &mut TcpStream, errno: u32, cookie: u64, data: &[u8]) {
    let mut out = SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
    out.extend_from_slice(&errno.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(data);
    s.write_all(&out).unwrap();
}

/// Serves a RAM disk until DISC or EOF; returns the commands seen.
fn ram_disk(s: &mut TcpStream) -> Vec<u16> {
    let mut disk = vec![0u8; SIZE as usize];
    let mut seen = Vec::new();
    while let Some(req) = request(s) {
        seen.push(req.command);
        let range = req.offset as usize..(req.offset + u64::from(req.len)) as usize;
        match req.command {
            0 => reply(s, 0, req.cookie, &disk[range]),
            1 => {
                disk[range].copy_from_slice(&req.data);
                reply(s, 0, req.cookie, &[]);
            }
            2 => break,
            _ => reply(s, 0, req.cookie, &[]),
        }
    }
    seen
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| (i.wrapping_mul(31) ^ seed) as u8).collect()
}

#[test]
fn good_handshake_then_reads_writes_flush_cache() {
    let (uri, thread) = server(|mut s| {
        let name = fake::serve_go(&mut s, SIZE, ALL);
        (name, ram_disk(&mut s))
    });
    let mut client = NbdClient::connect(&uri, Duration::from_secs(5)).unwrap();
    assert_eq!(client.size(), SIZE);
    let data = pattern(1, 3 * 4096);
    client.write_at(8192, &data).unwrap();
    let mut back = vec![0; data.len()];
    client.read_at(8192, &mut back).unwrap();
    assert_eq!(back, data);
    client.flush().unwrap();
    client.cache(0, 4096).unwrap();
    client.trim(0, 4096).unwrap();
    // More reads than the window holds, in one call.
    let mut bufs: Vec<Vec<u8>> = vec![vec![0xFF; 4096]; MAX_IN_FLIGHT * 2 + 3];
    let mut reads: Vec<(u64, &mut [u8])> =
        bufs.iter_mut().enumerate().map(|(i, b)| ((i as u64 % 3 + 2) * 4096, &mut b[..])).collect();
    client.read_many(&mut reads).unwrap();
    for (i, buf) in bufs.iter().enumerate() {
        let start = (i % 3) * 4096;
        assert_eq!(buf[..], data[start..start + 4096], "buffer {i}");
    }
    let handle = client.submit_write(0, &[7; 512]).unwrap();
    assert!(client.wait(handle).unwrap().is_empty());
    let handle = client.submit_read(0, 512).unwrap();
    assert_eq!(client.wait(handle).unwrap(), vec![7; 512]);
    assert!(matches!(client.read_at(SIZE, &mut [0; 1]), Err(BlockError::OutOfRange { .. })));
    drop(client);
    let (name, seen) = thread.join().unwrap();
    assert_eq!(name, "e");
    assert!(seen.contains(&5) && seen.contains(&3) && seen.contains(&4), "{seen:?}");
    assert_eq!(seen.last(), Some(&2), "disconnect on drop");
}

#[test]
fn open_gives_an_nbd_backend() {
    let (uri, thread) = server(|mut s| {
        fake::serve_go(&mut s, SIZE, flags::HAS_FLAGS);
        ram_disk(&mut s)
    });
    let mut disk = crate::open(&crate::DiskSpec::Nbd(uri.to_string())).unwrap();
    assert_eq!(disk.size(), SIZE);
    disk.write_at(512, &[3; 1024]).unwrap();
    let mut back = [0; 1024];
    disk.read_at(512, &mut back).unwrap();
    assert_eq!(back, [3; 1024]);
    disk.flush().unwrap(); // no SEND_FLUSH: a no-op
    assert!(disk.read_at(100, &mut [0; 512]).is_err(), "unaligned");
    drop(disk);
    assert!(!thread.join().unwrap().contains(&3));
}

#[test]
fn go_unsupported_falls_back_to_export_name() {
    let (uri, thread) = server(|mut s| {
        fake::greet(&mut s, fake::FIXED | fake::NO_ZEROES);
        let (option, _) = fake::read_option(&mut s, true);
        assert_eq!(option, fake::GO);
        fake::reply(&mut s, option, fake::ERR_UNSUP, b"");
        let (option, name) = fake::read_option(&mut s, false);
        assert_eq!(option, fake::EXPORT_NAME);
        s.write_all(&SIZE.to_be_bytes()).unwrap();
        s.write_all(&flags::HAS_FLAGS.to_be_bytes()).unwrap();
        ram_disk(&mut s);
        name
    });
    let mut client = NbdClient::connect(&uri, Duration::from_secs(5)).unwrap();
    client.write_at(0, &[9; 4096]).unwrap();
    let mut back = [0; 4096];
    client.read_at(0, &mut back).unwrap();
    assert_eq!(back, [9; 4096]);
    drop(client);
    assert_eq!(thread.join().unwrap(), b"e");
}

#[test]
fn unknown_export_is_a_clear_error() {
    let (uri, thread) = server(|mut s| {
        fake::greet(&mut s, fake::FIXED | fake::NO_ZEROES);
        fake::read_option(&mut s, true);
        fake::reply(&mut s, fake::GO, fake::ERR_UNKNOWN, b"no such export");
    });
    let err = NbdClient::connect(&uri, Duration::from_secs(5)).err().unwrap();
    let BlockError::Nbd { source, .. } = &err else { panic!("{err}") };
    assert_eq!(source.to_string(), format!("export 'e' not found on {}", uri.authority()));
    thread.join().unwrap();
}

#[test]
fn bad_magic_is_refused() {
    let (uri, thread) = server(|mut s| s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap());
    let err = NbdClient::connect(&uri, Duration::from_secs(5)).err().unwrap();
    let BlockError::Nbd { source, .. } = &err else { panic!("{err}") };
    assert!(source.to_string().contains("not NBDMAGIC"), "{source}");
    thread.join().unwrap();
}

#[test]
fn replies_out_of_order_reach_their_requests() {
    let (uri, thread) = server(|mut s| {
        fake::serve_go(&mut s, SIZE, flags::HAS_FLAGS);
        for round in 0..2 {
            let requests: Vec<Request> = (0..8).map(|_| request(&mut s).unwrap()).collect();
            for req in requests.iter().rev() {
                reply(&mut s, 0, req.cookie, &pattern(req.offset + round, req.len as usize));
            }
        }
        ram_disk(&mut s);
    });
    let mut client = NbdClient::connect(&uri, Duration::from_secs(5)).unwrap();
    let mut bufs = vec![vec![0u8; 1024]; 8];
    let mut reads: Vec<(u64, &mut [u8])> =
        bufs.iter_mut().enumerate().map(|(i, b)| (i as u64 * 4096, &mut b[..])).collect();
    client.read_many(&mut reads).unwrap();
    for (i, buf) in bufs.iter().enumerate() {
        assert_eq!(*buf, pattern(i as u64 * 4096, 1024));
    }
    let handles: Vec<Handle> = (0..8).map(|i| client.submit_read(i * 512, 512).unwrap()).collect();
    assert_eq!(client.in_flight(), 8);
    for (i, handle) in handles.into_iter().enumerate() {
        assert_eq!(client.wait(handle).unwrap(), pattern(i as u64 * 512 + 1, 512));
    }
    drop(client);
    thread.join().unwrap();
}

#[test]
fn server_error_codes_are_named_and_not_fatal() {
    let (uri, thread) = server(|mut s| {
        fake::serve_go(&mut s, SIZE, flags::HAS_FLAGS);
        let req = request(&mut s).unwrap();
        reply(&mut s, 5, req.cookie, &[]); // EIO, no payload
        let req = request(&mut s).unwrap();
        reply(&mut s, 28, req.cookie, &[]);
        let req = request(&mut s).unwrap();
        reply(&mut s, 4242, req.cookie, &[]);
        ram_disk(&mut s);
    });
    let mut client = NbdClient::connect(&uri, Duration::from_secs(5)).unwrap();
    let chain = |e: BlockError| format!("{e}: {}", std::error::Error::source(&e).unwrap());
    let err = chain(client.read_at(4096, &mut [0; 4096]).unwrap_err());
    assert!(err.contains("server failed read of 4096 bytes at offset 4096: EIO"), "{err}");
    let err = chain(client.write_at(0, &[1; 512]).unwrap_err());
    assert!(err.contains("ENOSPC"), "{err}");
    let err = chain(client.read_at(0, &mut [0; 512]).unwrap_err());
    assert!(err.contains("error code 4242"), "{err}");
    // The stream is still in step.
    client.write_at(0, &[2; 512]).unwrap();
    let mut back = [0; 512];
    client.read_at(0, &mut back).unwrap();
    assert_eq!(back, [2; 512]);
    drop(client);
    thread.join().unwrap();
}

#[test]
fn a_server_that_hangs_times_out() {
    let (uri, thread) = server(|s| {
        thread::sleep(Duration::from_secs(2));
        drop(s);
    });
    let start = Instant::now();
    let err = NbdClient::connect(&uri, Duration::from_millis(200)).err().unwrap();
    assert!(matches!(err, BlockError::Nbd { source: NbdError::TimedOut { .. }, .. }), "{err:?}");
    assert!(start.elapsed() < Duration::from_secs(1));
    thread.join().unwrap();

    // Trickling the greeting a byte at a time, each within the
    // timeout: the negotiation as a whole still ends in time.
    let (uri, thread) = server(|mut s| {
        for byte in 0x4e42_444d_4147_4943u64.to_be_bytes() {
            if s.write_all(&[byte]).is_err() {
                return;
            }
            thread::sleep(Duration::from_millis(100));
        }
    });
    let start = Instant::now();
    let err = NbdClient::connect(&uri, Duration::from_millis(250)).err().unwrap();
    assert!(matches!(err, BlockError::Nbd { source: NbdError::TimedOut { .. }, .. }), "{err:?}");
    assert!(start.elapsed() < Duration::from_millis(600), "{:?}", start.elapsed());
    thread.join().unwrap();

    // Hanging mid-transmission: the request times out, then the
    // connection is refused for good.
    let (uri, thread) = server(|mut s| {
        fake::serve_go(&mut s, SIZE, flags::HAS_FLAGS);
        request(&mut s).unwrap();
        thread::sleep(Duration::from_secs(2));
    });
    let mut client = NbdClient::connect(&uri, Duration::from_millis(200)).unwrap();
    let err = client.read_at(0, &mut [0; 512]).unwrap_err();
    assert!(matches!(err, BlockError::Nbd { source: NbdError::TimedOut { .. }, .. }), "{err:?}");
    let err = client.read_at(0, &mut [0; 512]).unwrap_err();
    assert!(matches!(err, BlockError::Nbd { source: NbdError::Broken, .. }), "{err:?}");
    thread.join().unwrap();
}

#[test]
fn bad_replies_break_the_connection() {
    for (what, cookie, magic) in [
        ("not in flight", Some(999), SIMPLE_REPLY_MAGIC),
        ("structured", None, STRUCTURED_REPLY_MAGIC),
        ("magic", None, 7),
    ] {
        let (uri, thread) = server(move |mut s| {
            fake::serve_go(&mut s, SIZE, flags::HAS_FLAGS);
            let req = request(&mut s).unwrap();
            let mut out = magic.to_be_bytes().to_vec();
            out.extend_from_slice(&0u32.to_be_bytes());
            out.extend_from_slice(&cookie.unwrap_or(req.cookie).to_be_bytes());
            s.write_all(&out).unwrap();
            ram_disk(&mut s)
        });
        let mut client = NbdClient::connect(&uri, Duration::from_secs(5)).unwrap();
        let err = client.read_at(0, &mut [0; 512]).unwrap_err();
        let BlockError::Nbd { source: NbdError::Protocol(reason), .. } = &err else { panic!("{err:?}") };
        assert!(reason.contains(what), "{reason}");
        assert!(matches!(client.flush(), Ok(())), "no SEND_FLUSH: nothing sent");
        let err = client.write_at(0, &[0; 512]).unwrap_err();
        assert!(matches!(err, BlockError::Nbd { source: NbdError::Broken, .. }), "{err:?}");
        drop(client);
        // Nothing after the broken reply: no DISC either.
        assert!(thread.join().unwrap().is_empty());
    }
}

#[test]
fn read_only_exports_refuse_writes_locally() {
    let (uri, thread) = server(|mut s| {
        fake::serve_go(&mut s, SIZE, flags::HAS_FLAGS | flags::READ_ONLY | flags::SEND_TRIM);
        ram_disk(&mut s)
    });
    let mut client = NbdClient::connect(&uri, Duration::from_secs(5)).unwrap();
    let err = client.write_at(0, &[1; 512]).unwrap_err();
    assert!(matches!(err, BlockError::Nbd { source: NbdError::ReadOnly, .. }), "{err:?}");
    assert!(client.submit_write(0, &[1; 512]).is_err());
    client.trim(0, 512).unwrap();
    client.read_at(0, &mut [0; 512]).unwrap();
    drop(client);
    assert_eq!(thread.join().unwrap(), vec![0, 2]);
}
