//! The receiving side: accept one stream, build the VM from it, verify,
//! and resume the guest only when the source commits. docs/architecture.md
//! follows a page through these files: [`dispatch`] reads channels and
//! hands frames to the decoders in [`apply`]; [`receiver`] is the state
//! machine on channel 0; [`landing`] is where the VM lands.
//!
//! Every byte from the peer is checked before use (crate::protocol); on
//! any failure the half-built VM is dropped and the source told why.

mod apart;
mod apply;
mod dispatch;
mod error;
pub mod landing;
mod leftovers;
mod options;
pub mod postcopy;
mod receiver;
mod warm;

use std::io::{BufReader, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tsubame_farmem::FarSetup;
use tsubame_vmm::Vm;

pub use error::ReceiveError;
pub use landing::{Landing, MemoryLanding, WarmDisk};
pub use options::ReceiveOptions;
pub use postcopy::{PostcopyHandle, PostcopyOutcome};

use self::dispatch::{ChannelSource, Counted};
use self::landing::VmLanding;
use self::postcopy::BackChannel;
use self::receiver::StreamReceiver;
use crate::protocol::{self, ErrorMessage, FrameKind};
use crate::stats::process_cpu_seconds;
use crate::transport::{Listener, Stream};

/// A VM that arrived and runs here now.
pub struct Incoming {
    /// The running VM.
    pub vm: Vm,
    /// Iterations received (stop-and-copy included).
    pub iterations: u32,
    /// Bytes read from the stream (every channel).
    pub bytes: u64,
    /// CPU-seconds this process spent from connection to resume.
    pub cpu_seconds: f64,
    /// Connection to resume.
    pub duration: Duration,
    /// Post-copy: the VM runs while the rest of its memory arrives; wait
    /// on this (if it fails, the VM is lost: it cannot go on).
    pub postcopy: Option<PostcopyHandle>,
    /// Far memory attached and registered: start it with the VM in an
    /// `Arc` ([`FarSetup::start`]); until then a vCPU that touches a far
    /// page waits.
    pub far: Option<FarSetup>,
}

/// Accepts one connection and receives a VM over it (and over the extra
/// channels it announces, accepted from the same listener). `log` hears
/// the milestones (for the CLI's stderr).
pub fn receive(listener: &Listener, options: &ReceiveOptions, log: &dyn Fn(&str)) -> Result<Incoming, ReceiveError> {
    let stream = listener.accept()?;
    receive_on(stream, Some(listener), options, log)
}

/// Receives a VM over an accepted connection; extra channels, if the
/// source asks for them, come from `listener`.
pub fn receive_on(
    stream: Stream,
    listener: Option<&Listener>,
    options: &ReceiveOptions,
    log: &dyn Fn(&str),
) -> Result<Incoming, ReceiveError> {
    let mut landing = VmLanding { vm: None, restoring: None, hugepages: options.hugepages, far: None };
    let received = receive_into(stream, listener, options, log, &mut landing)?;
    Ok(Incoming {
        vm: landing.vm.expect("a received VM exists"),
        iterations: received.iterations,
        bytes: received.bytes,
        cpu_seconds: received.cpu_seconds,
        duration: received.duration,
        postcopy: received.postcopy,
        far: landing.far,
    })
}

/// What a receive cost.
#[derive(Debug)]
pub struct Received {
    /// Iterations received (stop-and-copy included).
    pub iterations: u32,
    /// Bytes read from the stream (every channel).
    pub bytes: u64,
    /// CPU-seconds this process spent from connection to resume.
    pub cpu_seconds: f64,
    /// Connection to resume.
    pub duration: Duration,
    /// The post-copy phase, when the source switched to it.
    pub postcopy: Option<PostcopyHandle>,
}

/// Receives over an accepted connection into `landing` (a VM, or plain
/// memory for `receive --memory-only`).
pub fn receive_into(
    stream: Stream,
    listener: Option<&Listener>,
    options: &ReceiveOptions,
    log: &dyn Fn(&str),
    landing: &mut dyn Landing,
) -> Result<Received, ReceiveError> {
    let started = Instant::now();
    let cpu_start = process_cpu_seconds();
    stream.set_read_timeout(Some(options.io_timeout))?;
    let writer: BackChannel = Arc::new(Mutex::new(Box::new(stream.try_clone()?)));
    let bytes = Arc::new(AtomicU64::new(0));
    let reader = Counted { inner: BufReader::with_capacity(1 << 20, stream.try_clone()?), bytes: bytes.clone() };
    let channels = ChannelSource { listener, first: stream, bytes: bytes.clone() };
    let result = StreamReceiver::new(options, log).run(Box::new(reader), &writer, landing, Some(&channels));
    let mut w = writer.lock().unwrap();
    match result {
        Ok(outcome) => {
            let cpu = process_cpu_seconds() - cpu_start;
            drop(outcome.leftovers);
            Ok(Received {
                iterations: outcome.iterations,
                bytes: bytes.load(Ordering::Relaxed),
                cpu_seconds: cpu,
                duration: started.elapsed(),
                postcopy: outcome.postcopy,
            })
        }
        Err(e) => {
            if !matches!(e, ReceiveError::SourceAborted(_)) {
                let payload = ErrorMessage(e.to_string()).encode();
                let _ = protocol::write_frame(&mut *w, FrameKind::Error, &payload).and_then(|_| w.flush());
            }
            Err(e)
        }
    }
}

/// Runs the receiver's state machine over one byte stream into `landing`
/// (no extra channels): the fuzz target's entry, and tests'. A post-copy
/// phase, if the stream switches to one, is waited for.
pub fn receive_stream(
    reader: impl Read + Send + 'static,
    writer: impl Write + Send + 'static,
    landing: &mut dyn Landing,
    options: &ReceiveOptions,
) -> Result<u32, ReceiveError> {
    let writer: BackChannel = Arc::new(Mutex::new(Box::new(writer)));
    let outcome = StreamReceiver::new(options, &|_| {}).run(Box::new(reader), &writer, landing, None)?;
    if let Some(postcopy) = outcome.postcopy {
        postcopy.wait()?;
    }
    Ok(outcome.iterations)
}
