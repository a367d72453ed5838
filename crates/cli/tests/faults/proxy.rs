//! The man in the middle: relays every connection of a migration (Unix
//! sockets) and strikes once at a chosen point: kill -9 of an end, or a
//! cut of every connection. Plain streams are relayed frame by frame, so
//! the point is a frame; encrypted ones (TLS, PSK) byte by byte, so the
//! point is a byte count.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tsubame_migrate::protocol::{self as wire, FrameKind, PREAMBLE_LEN};

use crate::common::read_raw_frame;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Action {
    KillSource,
    KillDestination,
    Cut,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Point {
    /// The Nth PAGES frame of an iteration (or that iteration's end).
    Pages { iteration: u32, nth: u32 },
    /// STATE, before it is delivered.
    State,
    /// DIGEST, before it is delivered.
    Digest,
    /// READY, before it reaches the source.
    Ready,
    /// COMMIT: delivered first, or dropped.
    Commit { delivered: bool },
    /// RESUMED, before it reaches the source.
    Resumed,
    /// POSTCOPY (the switch), before it is delivered.
    Switch,
    /// POSTCOPY_RUNNING, before it reaches the source.
    Running,
    /// The Nth page frame of the post-copy phase (pushed or asked for).
    PostcopyPages { nth: u32 },
    /// The Nth PAGE_REQUEST, before it reaches the source.
    Request { nth: u32 },
    /// POSTCOPY_DONE, before it reaches the source.
    Done,
    /// Encrypted streams: once `at` bytes went that way (all connections
    /// together); the bytes beyond are not delivered.
    Bytes { to_dest: bool, at: u64 },
}

impl Point {
    /// The point's name in the campaign's table (without its random part).
    pub fn name(&self) -> String {
        match self {
            Point::Pages { iteration: 0, .. } => "PAGES of iteration 0".into(),
            Point::Pages { .. } => "PAGES of a later iteration".into(),
            Point::Commit { delivered: true } => "COMMIT, delivered".into(),
            Point::Commit { delivered: false } => "COMMIT, dropped".into(),
            Point::PostcopyPages { .. } => "post-copy page frame".into(),
            Point::Request { .. } => "PAGE_REQUEST".into(),
            Point::Switch => "POSTCOPY (the switch)".into(),
            Point::Running => "POSTCOPY_RUNNING".into(),
            Point::Done => "POSTCOPY_DONE".into(),
            Point::Bytes { to_dest: false, .. } => "bytes to the source".into(),
            Point::Bytes { at, .. } if *at < 4096 => "bytes to the destination: handshake".into(),
            Point::Bytes { at, .. } if *at < 1 << 20 => "bytes to the destination: first MiB".into(),
            Point::Bytes { .. } => "bytes to the destination: later".into(),
            other => format!("{other:?}").to_uppercase(),
        }
    }
}

/// What the proxy saw and did.
#[derive(Default, Debug)]
pub struct Seen {
    pub struck: bool,
    pub commit_sent: bool,
    pub commit_delivered: bool,
    /// POSTCOPY reached the destination.
    pub switched: bool,
    /// POSTCOPY_RUNNING reached the source.
    pub running: bool,
    counted: u32,
    bytes_to_dest: u64,
    bytes_to_source: u64,
}

pub struct Proxy {
    pub action: Action,
    pub point: Point,
    pub source_pid: u32,
    pub dest_pid: u32,
    /// After a cut, relay new connections untouched: the link comes back
    /// (post-copy's source reconnects by itself).
    pub heal: bool,
    pub seen: Mutex<Seen>,
    conns: Mutex<Vec<UnixStream>>,
    pub stop: AtomicBool,
}

impl Proxy {
    pub fn new(action: Action, point: Point, source_pid: u32, dest_pid: u32, heal: bool) -> Arc<Proxy> {
        Arc::new(Proxy {
            action,
            point,
            source_pid,
            dest_pid,
            heal,
            seen: Mutex::new(Seen::default()),
            conns: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        })
    }

    fn strike(&self, seen: &mut Seen) {
        if seen.struck {
            return;
        }
        seen.struck = true;
        let pid = match self.action {
            Action::KillSource => Some(self.source_pid),
            Action::KillDestination => Some(self.dest_pid),
            Action::Cut => None,
        };
        if let Some(pid) = pid {
            // SIGKILL, as `kill -9`.
            let _ = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        if !self.heal {
            self.stop.store(true, Ordering::Release);
        }
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Decides what to do with one frame: forward it (true) or not.
    fn on_frame(&self, kind: FrameKind, payload: &[u8], to_dest: bool, to: &mut UnixStream) -> bool {
        let mut seen = self.seen.lock().unwrap();
        if seen.struck {
            return self.heal;
        }
        let iteration = || payload.get(..4).map_or(0, |b| u32::from_le_bytes(b.try_into().unwrap()));
        let mut nth = |n: u32| {
            seen.counted += 1;
            seen.counted >= n
        };
        let hit = match (self.point, kind, to_dest) {
            (Point::Pages { iteration: target, nth: n }, FrameKind::Pages, true) => {
                let it = iteration();
                it > target || (it == target && nth(n))
            }
            (Point::Pages { iteration: target, .. }, FrameKind::IterationEnd, true) => iteration() >= target,
            (Point::Pages { .. }, FrameKind::State, true) => true,
            (Point::State, FrameKind::State, true) => true,
            (Point::Digest, FrameKind::Digest, true) => true,
            (Point::Ready, FrameKind::Ready, false) => true,
            (Point::Resumed, FrameKind::Resumed, false) => true,
            (Point::Switch, FrameKind::Postcopy, true) => true,
            (Point::Running, FrameKind::PostcopyRunning, false) => true,
            (Point::PostcopyPages { nth: n }, FrameKind::PostcopyPages | FrameKind::PostcopyPagesCompressed, true) => {
                nth(n)
            }
            (Point::Request { nth: n }, FrameKind::PageRequest, false) => nth(n),
            (Point::Done, FrameKind::PostcopyDone, false) => true,
            (Point::Commit { delivered }, FrameKind::Commit, true) => {
                seen.commit_sent = true;
                if delivered {
                    let header = wire::frame_header(FrameKind::Commit, &[]);
                    if to.write_all(&header).is_ok() {
                        seen.commit_delivered = true;
                    }
                }
                true
            }
            _ => false,
        };
        if kind == FrameKind::Commit && to_dest {
            seen.commit_sent = true;
        }
        if hit {
            self.strike(&mut seen);
            return false;
        }
        if kind == FrameKind::Commit && to_dest {
            seen.commit_delivered = true; // forwarded below
        }
        if kind == FrameKind::Postcopy && to_dest {
            seen.switched = true;
        }
        if kind == FrameKind::PostcopyRunning && !to_dest {
            seen.running = true;
        }
        true
    }

    /// How many of `n` bytes going that way may pass before the strike
    /// (all of them once struck and healed, none once struck otherwise).
    fn on_bytes(&self, n: usize, to_dest: bool) -> usize {
        let mut seen = self.seen.lock().unwrap();
        if seen.struck {
            return if self.heal { n } else { 0 };
        }
        let Point::Bytes { to_dest: target, at } = self.point else { return n };
        let count = if to_dest { &mut seen.bytes_to_dest } else { &mut seen.bytes_to_source };
        let before = *count;
        *count += n as u64;
        if to_dest != target || *count < at {
            return n;
        }
        let pass = (at - before.min(at)) as usize;
        self.strike(&mut seen);
        pass
    }

    fn relay(self: &Arc<Self>, mut from: UnixStream, mut to: UnixStream, to_dest: bool) {
        if matches!(self.point, Point::Bytes { .. }) {
            let mut buf = vec![0u8; 64 << 10];
            while let Ok(n @ 1..) = from.read(&mut buf) {
                let pass = self.on_bytes(n, to_dest);
                if to.write_all(&buf[..pass]).is_err() || pass < n {
                    break;
                }
            }
        } else {
            let mut preamble = [0u8; PREAMBLE_LEN];
            if from.read_exact(&mut preamble).is_ok() && to.write_all(&preamble).is_ok() {
                while let Some((header, kind, payload)) = read_raw_frame(&mut from) {
                    if !self.on_frame(kind, &payload, to_dest, &mut to) {
                        break;
                    }
                    if to.write_all(&header).is_err() || to.write_all(&payload).is_err() {
                        break;
                    }
                }
            }
        }
        // One side closed: close the other, as a network would.
        let _ = from.shutdown(std::net::Shutdown::Both);
        let _ = to.shutdown(std::net::Shutdown::Both);
    }

    /// Relays every connection to `listen` on to `target` until stopped.
    pub fn start(self: &Arc<Self>, listen: &Path, target: PathBuf) -> std::thread::JoinHandle<()> {
        let listener = UnixListener::bind(listen).unwrap();
        listener.set_nonblocking(true).unwrap();
        let proxy = self.clone();
        std::thread::spawn(move || {
            let mut relays = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(120);
            while !proxy.stop.load(Ordering::Acquire) && Instant::now() < deadline {
                let client = match listener.accept() {
                    Ok((c, _)) => c,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                };
                client.set_nonblocking(false).unwrap();
                let Ok(server) = UnixStream::connect(&target) else {
                    continue;
                };
                {
                    let mut conns = proxy.conns.lock().unwrap();
                    conns.push(client.try_clone().unwrap());
                    conns.push(server.try_clone().unwrap());
                }
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let p = proxy.clone();
                relays.push(std::thread::spawn(move || p.relay(s2, c2, false)));
                let p = proxy.clone();
                relays.push(std::thread::spawn(move || p.relay(client, server, true)));
            }
            // Stopped: what is still open is cut (a healed link included).
            for c in proxy.conns.lock().unwrap().drain(..) {
                let _ = c.shutdown(std::net::Shutdown::Both);
            }
            for r in relays {
                let _ = r.join();
            }
        })
    }
}
