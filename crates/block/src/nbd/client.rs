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

use super::error::{io_error, NbdError};
use super::flags;
use super::handshake::{negotiate, Export};
use super::uri::NbdUri;
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
#[path = "client_tests.rs"]
mod tests;
