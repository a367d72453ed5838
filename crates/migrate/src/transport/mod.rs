//! Where migration streams go: `tcp:HOST:PORT` or `unix:PATH`, and a token
//! bucket for `--max-bandwidth` ([`pacer`]).

mod pacer;

pub use pacer::{Metered, Pacer};

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Errors of addresses and connections.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The address is not `tcp:HOST:PORT` or `unix:PATH`.
    #[error("'{0}' is not an address: use tcp:HOST:PORT or unix:PATH")]
    BadAddress(String),
    /// Connecting failed.
    #[error("cannot connect to {0}")]
    Connect(String, #[source] std::io::Error),
    /// Listening failed.
    #[error("cannot listen on {0}")]
    Listen(String, #[source] std::io::Error),
    /// Accepting failed.
    #[error("accepting a connection failed")]
    Accept(#[source] std::io::Error),
    /// The secure handshake with a peer failed.
    #[error("secure connection with {peer}: {source}")]
    Secure {
        /// The peer.
        peer: String,
        /// What failed.
        #[source]
        source: crate::secure::SecureError,
    },
    /// Plain TCP with a peer that is not on this host.
    #[error("refusing unencrypted TCP with {0}, which is not a loopback address: use --psk-file or --tls-cert, --tls-key and --tls-ca on both ends, or --insecure")]
    Insecure(String),
}

/// How connections are protected: a pre-shared key, mutual TLS, or
/// neither (then plain TCP only with loopback peers unless `insecure`).
#[derive(Debug, Clone, Default)]
pub struct Security {
    /// Authenticate and encrypt with this pre-shared key.
    pub psk: Option<crate::secure::Psk>,
    /// Authenticate with these certificates (mutual TLS 1.3) and encrypt.
    pub tls: Option<crate::secure::TlsConfig>,
    /// Allow plain TCP with peers that are not on this host.
    pub insecure: bool,
}

/// How long a secure handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl Security {
    /// Protects a freshly accepted connection (the destination's end).
    pub fn accepted(&self, stream: Stream) -> Result<Stream, TransportError> {
        self.protect(stream, crate::secure::Role::Server, "")
    }

    /// True when connections are authenticated and encrypted.
    pub fn is_secure(&self) -> bool {
        self.psk.is_some() || self.tls.is_some()
    }

    /// Authenticates `stream` (plain TCP: checks the peer is local); a
    /// client checks a TLS server's certificate against `server_name`.
    fn protect(&self, stream: Stream, role: crate::secure::Role, server_name: &str) -> Result<Stream, TransportError> {
        let peer = stream.peer_name();
        if !self.is_secure() {
            if let Stream::Tcp(s) = &stream {
                let local = s.peer_addr().map(|a| a.ip().is_loopback()).unwrap_or(false);
                if !local && !self.insecure {
                    stream.shutdown();
                    return Err(TransportError::Insecure(peer));
                }
            }
            return Ok(stream);
        }
        let secure = |source| TransportError::Secure { peer: peer.clone(), source };
        let io = |e: std::io::Error| secure(crate::secure::SecureError::Io(e));
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(io)?;
        let records = match (&self.psk, &self.tls) {
            (Some(psk), None) => crate::secure::psk_handshake(&mut RawRef(&stream), psk, role)
                .map(|keys| crate::secure::RecordLayer::new(&keys)),
            (None, Some(tls)) => crate::secure::tls_handshake(&mut RawRef(&stream), tls, role, server_name),
            _ => Err(crate::secure::SecureError::BothModes),
        }
        .map_err(|e| {
            stream.shutdown();
            secure(e)
        })?;
        stream.set_read_timeout(None).map_err(io)?;
        Ok(Stream::Secure(Arc::new(Secured { raw: stream, records })))
    }
}

/// A connection under the secure record layer.
pub struct Secured {
    raw: Stream,
    records: crate::secure::RecordLayer,
}

/// Reads and writes a plain stream through a shared reference.
struct RawRef<'a>(&'a Stream);

impl Read for RawRef<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self.0 {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Secure(s) => RawRef(&s.raw).read(buf),
        }
    }
}

impl Write for RawRef<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self.0 {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Unix(s) => (&*s).write(buf),
            Stream::Secure(s) => RawRef(&s.raw).write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A migration endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// TCP host and port.
    Tcp(String),
    /// Unix socket path.
    Unix(PathBuf),
}

impl Address {
    /// The name a client checks a TLS server's certificate against: the
    /// host of `tcp:HOST:PORT` (a DNS name or an IP address), `localhost`
    /// for a Unix socket.
    pub fn server_name(&self) -> String {
        match self {
            Address::Tcp(hp) => {
                let host = hp.rsplit_once(':').map_or(hp.as_str(), |(h, _)| h);
                host.trim_start_matches('[').trim_end_matches(']').to_string()
            }
            Address::Unix(_) => "localhost".into(),
        }
    }
}

impl std::str::FromStr for Address {
    type Err = TransportError;

    fn from_str(s: &str) -> Result<Address, TransportError> {
        if let Some(rest) = s.strip_prefix("tcp:") {
            match rest.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                    Ok(Address::Tcp(rest.to_string()))
                }
                _ => Err(TransportError::BadAddress(s.to_string())),
            }
        } else if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(TransportError::BadAddress(s.to_string()));
            }
            Ok(Address::Unix(PathBuf::from(path)))
        } else {
            Err(TransportError::BadAddress(s.to_string()))
        }
    }
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Tcp(hp) => write!(f, "tcp:{hp}"),
            Address::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// A connected stream of either kind.
pub enum Stream {
    /// TCP.
    Tcp(TcpStream),
    /// Unix socket.
    Unix(UnixStream),
    /// Either, authenticated and encrypted (docs/security.md).
    Secure(Arc<Secured>),
}

impl Stream {
    /// Waits up to `limit` for bytes to read, looking every 20 µs rather
    /// than sleeping until they come: for the moment of a switch, when the
    /// next message is a fraction of a millisecond away and waking a thread
    /// whose CPU went idle took 2-3 ms on this host (a CPU that sleeps only
    /// 50 µs stays in the idle loop's polling). Other threads run between
    /// the looks.
    pub fn wait_readable_closely(&self, limit: Duration) {
        self.look_until_readable(limit, Some(Duration::from_micros(20)));
    }

    /// Looks for bytes to read without sleeping, for up to `limit`: for an
    /// answer a fraction of a millisecond away that must be read at once.
    pub fn spin_until_readable(&self, limit: Duration) {
        self.look_until_readable(limit, None);
    }

    /// Looks for bytes to read until `limit` passes, napping `nap` between
    /// looks (or not at all).
    fn look_until_readable(&self, limit: Duration, nap: Option<Duration>) {
        let deadline = Instant::now() + limit;
        let mut poll = libc::pollfd { fd: self.raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd that lives across the call, timeout 0.
        while unsafe { libc::poll(&mut poll, 1, 0) } == 0 && Instant::now() < deadline {
            match nap {
                Some(nap) => std::thread::sleep(nap),
                None => std::hint::spin_loop(),
            }
        }
    }

    fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Secure(s) => s.raw.raw_fd(),
        }
    }

    /// Connects to `addr` as [`Stream::connect`] does, then protects the
    /// connection as `security` says.
    pub fn connect_with(addr: &Address, patience: Duration, security: &Security) -> Result<Stream, TransportError> {
        let name = addr.server_name();
        security.protect(Stream::connect(addr, patience)?, crate::secure::Role::Client, &name)
    }

    /// The peer, for messages.
    pub fn peer_name(&self) -> String {
        match self {
            Stream::Tcp(s) => s.peer_addr().map(|a| format!("tcp:{a}")).unwrap_or_else(|_| "tcp peer".into()),
            Stream::Unix(_) => "a unix socket peer".into(),
            Stream::Secure(s) => s.raw.peer_name(),
        }
    }

    /// Connects to `addr`, retrying for up to `patience` while the peer is
    /// not listening yet.
    pub fn connect(addr: &Address, patience: Duration) -> Result<Stream, TransportError> {
        let deadline = Instant::now() + patience;
        loop {
            let attempt = match addr {
                Address::Tcp(hp) => TcpStream::connect(hp).map(|s| {
                    let _ = s.set_nodelay(true);
                    Stream::Tcp(s)
                }),
                Address::Unix(p) => UnixStream::connect(p).map(Stream::Unix),
            };
            match attempt {
                Ok(s) => return Ok(s),
                Err(e) if Instant::now() < deadline && retryable(&e) => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => return Err(TransportError::Connect(addr.to_string(), e)),
            }
        }
    }

    /// A second handle to the same connection (one reads, one writes).
    pub fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Secure(s) => Stream::Secure(s.clone()),
        })
    }

    /// Bounds how long a read may wait.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Secure(s) => s.raw.set_read_timeout(t),
        }
    }

    /// Closes both directions.
    pub fn shutdown(&self) {
        self.shutdown_how(std::net::Shutdown::Both);
    }

    /// Wakes blocked reads but keeps the sending half open, so a last
    /// ERROR frame can still go out.
    pub fn shutdown_read(&self) {
        self.shutdown_how(std::net::Shutdown::Read);
    }

    fn shutdown_how(&self, how: std::net::Shutdown) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) => s.shutdown(how),
            Stream::Secure(s) => {
                s.raw.shutdown_how(how);
                Ok(())
            }
        };
    }
}

fn retryable(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound)
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
            Stream::Secure(s) => s.records.rx.lock().unwrap().read(&mut RawRef(&s.raw), buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
            Stream::Secure(s) => {
                s.records.tx.lock().unwrap().write_all(&mut RawRef(&s.raw), buf)?;
                Ok(buf.len())
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
            Stream::Secure(_) => Ok(()),
        }
    }
}

/// A bound listener of either kind.
pub enum Listener {
    /// TCP.
    Tcp(TcpListener),
    /// Unix socket (its file is removed once every handle is dropped).
    Unix(UnixListener, Arc<SocketFile>),
}

/// A Unix socket's file, removed when the last listener handle on it goes:
/// a post-copy destination's handle may outlive the one it was cloned from
/// while a cut-off source may still reconnect.
pub struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// How often [`Listener::accept_until`] asks whether to stop waiting.
const STOP_EVERY_MS: libc::c_int = 50;

impl Listener {
    fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        match self {
            Listener::Tcp(l) => l.as_raw_fd(),
            Listener::Unix(l, _) => l.as_raw_fd(),
        }
    }

    /// Binds `addr`. A stale Unix socket file is replaced.
    pub fn bind(addr: &Address) -> Result<Listener, TransportError> {
        let err = |e| TransportError::Listen(addr.to_string(), e);
        match addr {
            Address::Tcp(hp) => {
                let resolved = hp.to_socket_addrs().map_err(err)?.next().ok_or_else(|| {
                    err(std::io::Error::new(std::io::ErrorKind::NotFound, "host name has no address"))
                })?;
                Ok(Listener::Tcp(TcpListener::bind(resolved).map_err(err)?))
            }
            Address::Unix(path) => {
                if path.exists() && UnixStream::connect(path).is_err() {
                    let _ = std::fs::remove_file(path);
                }
                Ok(Listener::Unix(UnixListener::bind(path).map_err(err)?, Arc::new(SocketFile(path.clone()))))
            }
        }
    }

    /// Waits for one connection.
    pub fn accept(&self) -> Result<Stream, TransportError> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept().map_err(TransportError::Accept)?;
                let _ = s.set_nodelay(true);
                Ok(Stream::Tcp(s))
            }
            Listener::Unix(l, _) => Ok(Stream::Unix(l.accept().map_err(TransportError::Accept)?.0)),
        }
    }

    /// Waits for one connection, giving up (None) once `stop` says so;
    /// `stop` is asked every [`STOP_EVERY_MS`] ms.
    pub fn accept_until(&self, stop: &dyn Fn() -> bool) -> Result<Option<Stream>, TransportError> {
        let set_nonblocking = |on| match self {
            Listener::Tcp(l) => l.set_nonblocking(on),
            Listener::Unix(l, _) => l.set_nonblocking(on),
        };
        set_nonblocking(true).map_err(TransportError::Accept)?;
        let result = loop {
            if stop() {
                break Ok(None);
            }
            match self.accept() {
                Ok(stream) => break Ok(Some(stream)),
                Err(TransportError::Accept(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // Until a connection comes or `stop` is due, not a fixed
                    // sleep: sleeping 50 ms between looks delayed every
                    // migration's start by 25 ms on average (up to 50).
                    let mut poll = libc::pollfd { fd: self.raw_fd(), events: libc::POLLIN, revents: 0 };
                    // SAFETY: one pollfd that lives across the call.
                    unsafe { libc::poll(&mut poll, 1, STOP_EVERY_MS) };
                }
                Err(e) => break Err(e),
            }
        };
        set_nonblocking(false).map_err(TransportError::Accept)?;
        // Accepted sockets inherit nothing from the listener on Linux, but
        // make sure the stream blocks (reads rely on timeouts, not polling).
        if let Ok(Some(stream)) = &result {
            match stream {
                Stream::Tcp(s) => s.set_nonblocking(false),
                Stream::Unix(s) => s.set_nonblocking(false),
                Stream::Secure(_) => Ok(()),
            }
            .map_err(TransportError::Accept)?;
        }
        result
    }

    /// The bound address (with the real port for `tcp:HOST:0`).
    pub fn local_address(&self) -> Address {
        match self {
            Listener::Tcp(l) => Address::Tcp(l.local_addr().map(|a| a.to_string()).unwrap_or_default()),
            Listener::Unix(_, file) => Address::Unix(file.0.clone()),
        }
    }

    /// A second handle on the same listening socket (for a post-copy
    /// destination waiting for a cut link to come back).
    pub fn try_clone(&self) -> std::io::Result<Listener> {
        Ok(match self {
            Listener::Tcp(l) => Listener::Tcp(l.try_clone()?),
            Listener::Unix(l, file) => Listener::Unix(l.try_clone()?, file.clone()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!("tcp:127.0.0.1:4444".parse::<Address>().unwrap(), Address::Tcp("127.0.0.1:4444".into()));
        assert_eq!("unix:/tmp/x".parse::<Address>().unwrap(), Address::Unix("/tmp/x".into()));
        for bad in ["tcp:nohost", "tcp::1", "tcp:h:99999", "unix:", "udp:1.2.3.4:5", "file"] {
            assert!(bad.parse::<Address>().is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn unix_connect_and_accept() {
        let path = std::env::temp_dir().join(format!("tsubame-transport-{}", std::process::id()));
        let addr = Address::Unix(path.clone());
        let listener = Listener::bind(&addr).unwrap();
        let t = std::thread::spawn(move || {
            let mut s = listener.accept().unwrap();
            let mut b = [0u8; 2];
            s.read_exact(&mut b).unwrap();
            b
        });
        let mut c = Stream::connect(&addr, Duration::from_secs(1)).unwrap();
        c.write_all(b"hi").unwrap();
        assert_eq!(&t.join().unwrap(), b"hi");
        assert!(!path.exists());
    }
}
