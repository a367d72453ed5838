//! The transmission phase: requests with cookies, simple replies matched
//! back to them in any order, a bounded window of requests in flight.
//!
//! Deadlock rule: a client that only writes while the server only writes
//! stalls both once the socket buffers fill. Requests without data are
//! 28 bytes and at most [`MAX_IN_FLIGHT`] are outstanding, so a window of
//! reads never blocks us; a WRITE carries data, so it is only sent once no
//! READ (whose reply data could be filling the other direction) is in
//! flight.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::handshake::{negotiate, Export};
use super::{flags, io_error, NbdError, NbdUri};
use crate::{check_range, Backend, BlockError};

/// Connect, handshake and per-request timeout for `--disk nbd://...`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(15);

/// Requests outstanding at once; more wait for a reply first.
pub const MAX_IN_FLIGHT: usize = 64;

/// The largest single request; longer reads and writes are split (the
/// protocol advises servers to accept at least 32 MiB).
pub const MAX_REQUEST: usize = 32 << 20;

const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Requests queued before they are pushed to the socket anyway.
const QUEUE_LIMIT: usize = 256 << 10;
/// Write payloads at least this large skip the queue's copy.
const DIRECT_WRITE: usize = 64 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Command {
    Read = 0,
    Write = 1,
    Disc = 2,
    Flush = 3,
    Trim = 4,
    Cache = 5,
}

impl Command {
    fn name(self) -> &'static str {
        match self {
            Command::Read => "read",
            Command::Write => "write",
            Command::Disc => "disconnect",
            Command::Flush => "flush",
            Command::Trim => "trim",
            Command::Cache => "cache",
        }
    }
}

/// Where a reply goes.
enum Dest {
    /// Kept for [`NbdClient::wait`].
    Keep,
    /// Into the `read_many` buffer at this index.
    Batch(usize),
    /// Nowhere: a hint whose outcome nobody waits for.
    Discard,
}

struct Pending {
    command: Command,
    offset: u64,
    len: u32,
    dest: Dest,
}

/// A reply to a `read_many` buffer: its index and outcome.
type BatchReply = Option<(usize, Result<(), NbdError>)>;

/// A request in flight, to give to [`NbdClient::wait`].
#[must_use = "wait on every handle, or its reply is kept until the client is dropped"]
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct Handle(u64);

/// A connection to one NBD export.
pub struct NbdClient<S: Read + Write = TcpStream> {
    stream: S,
    uri: String,
    export: Export,
    next_cookie: u64,
    in_flight: HashMap<u64, Pending>,
    reads_in_flight: usize,
    done: HashMap<u64, Result<Vec<u8>, NbdError>>,
    /// Requests not yet written to the stream.
    queued: Vec<u8>,
    broken: bool,
}

impl NbdClient<TcpStream> {
    /// Connects to `uri` and negotiates its export. `timeout` bounds the
    /// TCP connect, the whole negotiation, and then every socket read or
    /// write, so a dead server gives [`NbdError::TimedOut`], not a hang.
    pub fn connect(uri: &NbdUri, timeout: Duration) -> Result<NbdClient, BlockError> {
        let wrap = |source| BlockError::Nbd { uri: uri.to_string(), source };
        // A zero timeout means "none" to the socket calls; refuse that.
        let timeout = timeout.max(Duration::from_millis(1));
        let addrs: Vec<SocketAddr> = (uri.host.as_str(), uri.port)
            .to_socket_addrs()
            .map_err(|source| wrap(NbdError::Resolve { host: uri.host.clone(), source }))?
            .collect();
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "the name has no address");
        let mut connected = None;
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(stream) => {
                    connected = Some(stream);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let stream = connected.ok_or_else(|| wrap(NbdError::Connect { addr: uri.authority(), source: last }))?;
        // Small requests must not wait for Nagle.
        stream
            .set_nodelay(true)
            .and_then(|()| stream.set_read_timeout(Some(timeout)))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(|source| wrap(NbdError::Io { during: "setting up the socket", source }))?;
        negotiate_within(stream, uri, timeout)
    }
}

impl NbdClient<UnixStream> {
    /// Connects to the server's Unix socket `path` and negotiates
    /// `uri.export`, with the same timeouts as [`NbdClient::connect`].
    pub fn connect_unix(
        uri: &NbdUri,
        path: &std::path::Path,
        timeout: Duration,
    ) -> Result<NbdClient<UnixStream>, BlockError> {
        let wrap = |source| BlockError::Nbd { uri: uri.to_string(), source };
        let timeout = timeout.max(Duration::from_millis(1));
        let stream =
            UnixStream::connect(path).map_err(|source| wrap(NbdError::Connect { addr: uri.authority(), source }))?;
        stream
            .set_write_timeout(Some(timeout))
            .map_err(|source| wrap(NbdError::Io { during: "setting up the socket", source }))?;
        negotiate_within(stream, uri, timeout)
    }
}

/// A stream whose reads can time out (TCP and Unix sockets).
trait ReadTimeout {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()>;
}

impl ReadTimeout for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
}

impl ReadTimeout for UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
}

/// A socket whose reads all end by one instant: a server that trickles
/// its greeting a byte at a time still cannot stretch the negotiation.
struct Deadline<S> {
    stream: S,
    until: Instant,
}

impl<S: Read + ReadTimeout> Read for Deadline<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

impl<S: Write> Write for Deadline<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

/// Negotiates `uri.export` on a connected socket: the whole negotiation
/// ends within `timeout`, and so does every later read.
fn negotiate_within<S: Read + Write + ReadTimeout>(
    stream: S,
    uri: &NbdUri,
    timeout: Duration,
) -> Result<NbdClient<S>, BlockError> {
    let wrap = |source| BlockError::Nbd { uri: uri.to_string(), source };
    let mut deadline = Deadline { stream, until: Instant::now() + timeout };
    let export = negotiate(&mut deadline, uri).map_err(wrap)?;
    let stream = deadline.stream;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|source| wrap(NbdError::Io { during: "setting up the socket", source }))?;
    Ok(NbdClient::new(stream, uri, export))
}

impl<S: Read + Write> NbdClient<S> {
    /// Negotiates `uri.export` over an already connected stream (timeouts
    /// are the stream's business).
    pub fn handshake(mut stream: S, uri: &NbdUri) -> Result<NbdClient<S>, BlockError> {
        let export = negotiate(&mut stream, uri).map_err(|source| BlockError::Nbd { uri: uri.to_string(), source })?;
        Ok(NbdClient::new(stream, uri, export))
    }

    fn new(stream: S, uri: &NbdUri, export: Export) -> NbdClient<S> {
        NbdClient {
            stream,
            uri: uri.to_string(),
            export,
            next_cookie: 1,
            in_flight: HashMap::new(),
            reads_in_flight: 0,
            done: HashMap::new(),
            queued: Vec::new(),
            broken: false,
        }
    }

    /// The export's size in bytes (a non-zero multiple of 4 KiB).
    pub fn size(&self) -> u64 {
        self.export.size
    }

    /// What negotiation learnt: size and transmission flags.
    pub fn export(&self) -> Export {
        self.export
    }

    /// Requests sent and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Fills `buf` from `offset` (any byte range inside the export),
    /// pipelining requests when `buf` is longer than [`MAX_REQUEST`].
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        let mut pieces: Vec<(u64, &mut [u8])> = Vec::new();
        for (i, chunk) in buf.chunks_mut(MAX_REQUEST).enumerate() {
            pieces.push((offset.saturating_add((i * MAX_REQUEST) as u64), chunk));
        }
        self.read_many(&mut pieces)
    }

    /// Writes `data` at `offset`, pipelining requests when it is longer
    /// than [`MAX_REQUEST`]; returns when the server acknowledged all.
    pub fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), BlockError> {
        self.check(offset, data.len(), u64::MAX)?;
        if self.export.has(flags::READ_ONLY) {
            return Err(self.fail(NbdError::ReadOnly));
        }
        let mut handles = Vec::new();
        let mut result = Ok(());
        for (i, chunk) in data.chunks(MAX_REQUEST).enumerate() {
            match self.queue(Command::Write, offset + (i * MAX_REQUEST) as u64, chunk.len(), chunk, Dest::Keep) {
                Ok(cookie) => handles.push(Handle(cookie)),
                Err(e) => {
                    result = Err(self.fail(e));
                    break;
                }
            }
        }
        // Collect every reply, even after a failure, so none is left over.
        for handle in handles {
            let outcome = self.wait(handle);
            if result.is_ok() {
                result = outcome.map(drop);
            }
        }
        result
    }

    /// Makes completed writes durable; a no-op when the server has no
    /// flush (it then has no volatile cache to flush).
    pub fn flush(&mut self) -> Result<(), BlockError> {
        if !self.export.has(flags::SEND_FLUSH) {
            return Ok(());
        }
        let handle = self.submit(Command::Flush, 0, 0, &[])?;
        self.wait(handle).map(drop)
    }

    /// Asks the server to discard `[offset, offset + len)` (reads may then
    /// return anything); a no-op when it cannot.
    pub fn trim(&mut self, offset: u64, len: u32) -> Result<(), BlockError> {
        self.check(offset, len as usize, u64::MAX)?;
        if !self.export.has(flags::SEND_TRIM) || self.export.has(flags::READ_ONLY) || len == 0 {
            return Ok(());
        }
        let handle = self.submit(Command::Trim, offset, len as usize, &[])?;
        self.wait(handle).map(drop)
    }

    /// Hints that `[offset, offset + len)` will be read soon (the server
    /// may prefetch it). Does not wait for the answer; a no-op when the
    /// export does not advertise `NBD_CMD_CACHE`.
    pub fn cache(&mut self, offset: u64, len: u32) -> Result<(), BlockError> {
        self.check(offset, len as usize, u64::MAX)?;
        if !self.export.has(flags::SEND_CACHE) || len == 0 {
            return Ok(());
        }
        self.queue(Command::Cache, offset, len as usize, &[], Dest::Discard)
            .and_then(|_| self.push_queued())
            .map_err(|e| self.fail(e))
    }

    /// Sends a read of `len` bytes (at most [`MAX_REQUEST`]) without
    /// waiting; [`NbdClient::wait`] gives the data.
    pub fn submit_read(&mut self, offset: u64, len: usize) -> Result<Handle, BlockError> {
        self.submit(Command::Read, offset, len, &[])
    }

    /// Sends a write of `data` (at most [`MAX_REQUEST`] bytes) without
    /// waiting; [`NbdClient::wait`] says whether it succeeded.
    pub fn submit_write(&mut self, offset: u64, data: &[u8]) -> Result<Handle, BlockError> {
        if self.export.has(flags::READ_ONLY) {
            return Err(self.fail(NbdError::ReadOnly));
        }
        self.submit(Command::Write, offset, data.len(), data)
    }

    /// Waits for a request's reply (others that arrive first are kept):
    /// the data of a read, empty for anything else.
    pub fn wait(&mut self, handle: Handle) -> Result<Vec<u8>, BlockError> {
        loop {
            if let Some(result) = self.done.remove(&handle.0) {
                return result.map_err(|e| self.fail(e));
            }
            if self.broken {
                return Err(self.fail(NbdError::Broken));
            }
            if !self.in_flight.contains_key(&handle.0) {
                return Err(self.fail(NbdError::UnknownHandle(handle.0)));
            }
            if let Err(e) = self.receive_one(&mut []) {
                return Err(self.fail(e));
            }
        }
    }

    /// Reads every `(offset, buffer)` with up to [`MAX_IN_FLIGHT`] requests
    /// in flight, each reply landing straight in its buffer whatever order
    /// the server answers in. Buffers are at most [`MAX_REQUEST`] bytes.
    /// On a server error the other reads still complete; the first error
    /// is returned.
    pub fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<(), BlockError> {
        for (offset, buf) in reads.iter() {
            self.check(*offset, buf.len(), MAX_REQUEST as u64)?;
        }
        let mut next = 0;
        let mut outstanding = 0usize;
        let mut first_error = None;
        loop {
            while next < reads.len() && self.in_flight.len() < MAX_IN_FLIGHT {
                let (offset, len) = (reads[next].0, reads[next].1.len());
                if len > 0 {
                    if let Err(e) = self.queue(Command::Read, offset, len, &[], Dest::Batch(next)) {
                        return Err(self.fail(e));
                    }
                    outstanding += 1;
                }
                next += 1;
            }
            if outstanding == 0 && next == reads.len() {
                break;
            }
            match self.receive_one(reads) {
                Ok(Some((_, result))) => {
                    outstanding -= 1;
                    if let Err(e) = result {
                        first_error.get_or_insert(e);
                    }
                }
                Ok(None) => {}
                Err(e) => return Err(self.fail(e)),
            }
        }
        match first_error {
            Some(e) => Err(self.fail(e)),
            None => Ok(()),
        }
    }

    /// Checks a request against the export and a length cap.
    fn check(&self, offset: u64, len: usize, cap: u64) -> Result<(), BlockError> {
        let inside = offset.checked_add(len as u64).is_some_and(|end| end <= self.export.size);
        if !inside || len as u64 > cap {
            return Err(BlockError::OutOfRange { offset, len, size: self.export.size });
        }
        Ok(())
    }

    /// Queues one request and pushes it out; the reply is kept for `wait`.
    fn submit(&mut self, command: Command, offset: u64, len: usize, data: &[u8]) -> Result<Handle, BlockError> {
        self.check(offset, len, MAX_REQUEST as u64)?;
        self.queue(command, offset, len, data, Dest::Keep)
            .and_then(|cookie| self.push_queued().map(|()| Handle(cookie)))
            .map_err(|e| self.fail(e))
    }

    /// Wraps an error with the URI; errors that leave the byte stream out
    /// of step break the connection for good.
    fn fail(&mut self, source: NbdError) -> BlockError {
        if matches!(source, NbdError::Io { .. } | NbdError::TimedOut { .. } | NbdError::Protocol(_)) {
            self.broken = true;
            self.in_flight.clear();
            self.reads_in_flight = 0;
            self.queued.clear();
        }
        BlockError::Nbd { uri: self.uri.clone(), source }
    }

    /// Adds a request to the queue once there is room in the window;
    /// returns its cookie. Callers checked the range.
    fn queue(&mut self, command: Command, offset: u64, len: usize, data: &[u8], dest: Dest) -> Result<u64, NbdError> {
        if self.broken {
            return Err(NbdError::Broken);
        }
        // DISC has no reply, so it needs no room (and `drop` must not wait).
        while command != Command::Disc
            && (self.in_flight.len() >= MAX_IN_FLIGHT || (command == Command::Write && self.reads_in_flight > 0))
        {
            // Only `read_many` has batch requests, and it never calls this
            // with a window full of its own: replies here are kept ones.
            self.receive_one(&mut [])?;
        }
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let len = len as u32; // checked against MAX_REQUEST
        self.queued.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        self.queued.extend_from_slice(&0u16.to_be_bytes());
        self.queued.extend_from_slice(&(command as u16).to_be_bytes());
        self.queued.extend_from_slice(&cookie.to_be_bytes());
        self.queued.extend_from_slice(&offset.to_be_bytes());
        self.queued.extend_from_slice(&len.to_be_bytes());
        if data.len() >= DIRECT_WRITE {
            self.push_queued()?;
            self.stream.write_all(data).map_err(io_error("sending write data"))?;
        } else {
            self.queued.extend_from_slice(data);
        }
        if command == Command::Disc {
            return Ok(cookie);
        }
        if command == Command::Read {
            self.reads_in_flight += 1;
        }
        self.in_flight.insert(cookie, Pending { command, offset, len, dest });
        if self.queued.len() >= QUEUE_LIMIT {
            self.push_queued()?;
        }
        Ok(cookie)
    }

    /// Writes the queued requests to the stream.
    fn push_queued(&mut self) -> Result<(), NbdError> {
        if !self.queued.is_empty() {
            self.stream.write_all(&self.queued).map_err(io_error("sending requests"))?;
            self.queued.clear();
        }
        self.stream.flush().map_err(io_error("sending requests"))
    }

    /// Reads one reply. Errors are fatal to the connection; a server's
    /// error code is the request's outcome, stored or returned for a
    /// `read_many` buffer.
    fn receive_one(&mut self, batch: &mut [(u64, &mut [u8])]) -> Result<BatchReply, NbdError> {
        const DURING: &str = "waiting for a reply";
        self.push_queued()?;
        let mut header = [0u8; 16];
        self.stream.read_exact(&mut header).map_err(io_error(DURING))?;
        let magic = u32::from_be_bytes(header[0..4].try_into().expect("4 bytes"));
        let errno = u32::from_be_bytes(header[4..8].try_into().expect("4 bytes"));
        let cookie = u64::from_be_bytes(header[8..16].try_into().expect("8 bytes"));
        match magic {
            SIMPLE_REPLY_MAGIC => {}
            STRUCTURED_REPLY_MAGIC => return Err(NbdError::Protocol("structured reply, never negotiated".into())),
            other => return Err(NbdError::Protocol(format!("reply magic {other:#x}"))),
        }
        let pending = self
            .in_flight
            .remove(&cookie)
            .ok_or_else(|| NbdError::Protocol(format!("reply to handle {cookie}, which is not in flight")))?;
        if pending.command == Command::Read {
            self.reads_in_flight -= 1;
        }
        let outcome = if errno != 0 {
            // No payload follows an error (the protocol forbids it).
            Err(NbdError::Server { command: pending.command.name(), offset: pending.offset, len: pending.len, errno })
        } else {
            Ok(())
        };
        let reads_data = outcome.is_ok() && pending.command == Command::Read;
        match pending.dest {
            Dest::Keep => {
                let mut data = Vec::new();
                if reads_data {
                    data = vec![0u8; pending.len as usize];
                    self.stream.read_exact(&mut data).map_err(io_error(DURING))?;
                }
                self.done.insert(cookie, outcome.map(|()| data));
                Ok(None)
            }
            Dest::Batch(index) => {
                let buf = batch
                    .get_mut(index)
                    .map(|(_, buf)| &mut **buf)
                    .filter(|buf| buf.len() == pending.len as usize)
                    .ok_or_else(|| NbdError::Protocol(format!("reply to handle {cookie} of another batch")))?;
                if reads_data {
                    self.stream.read_exact(buf).map_err(io_error(DURING))?;
                }
                Ok(Some((index, outcome)))
            }
            Dest::Discard => Ok(None),
        }
    }
}

impl<S: Read + Write> Drop for NbdClient<S> {
    /// Says goodbye (best effort: the server copes with a closed socket).
    fn drop(&mut self) {
        if !self.broken && self.queue(Command::Disc, 0, 0, &[], Dest::Discard).is_ok() {
            let _ = self.push_queued();
        }
    }
}

impl<S: Read + Write + Send> Backend for NbdClient<S> {
    fn size(&self) -> u64 {
        self.export.size
    }

    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        check_range(offset, buf.len(), self.export.size)?;
        NbdClient::read_at(self, offset, buf)
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), BlockError> {
        check_range(offset, data.len(), self.export.size)?;
        NbdClient::write_at(self, offset, data)
    }

    fn flush(&mut self) -> Result<(), BlockError> {
        NbdClient::flush(self)
    }
}

#[cfg(test)]
mod tests {
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
}
