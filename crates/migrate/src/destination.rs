//! The receiving side: accept one stream, build the VM from it, verify,
//! and resume the guest only when the source commits.
//!
//! Every byte from the peer is checked before use (wire.rs, pages.rs);
//! on any failure the half-built VM is dropped and the source told why.

use std::io::{BufReader, Read, Write};
use std::time::{Duration, Instant};

use tsubame_vmm::{memory, Vm, VmConfig, VmState, PAGE_SIZE};

use crate::digest;
use crate::pages::{for_each_record, for_each_subpage, Encoding};
use crate::stats::process_cpu_seconds;
use crate::transport::{Listener, Stream, TransportError};
use crate::wire::{self, FrameKind, Hello, WireError};
use tsubame_codec::batch::BatchDecompressor;
use tsubame_codec::{CodecList, PageDecoder};

/// What the receiver may insist on.
#[derive(Debug, Clone)]
pub struct ReceiveOptions {
    /// Refuse a VM whose memory size differs.
    pub expect_memory: Option<u64>,
    /// Give up when the source is silent this long.
    pub io_timeout: Duration,
    /// Back guest memory with transparent huge pages.
    pub hugepages: bool,
}

impl Default for ReceiveOptions {
    fn default() -> Self {
        ReceiveOptions { expect_memory: None, io_timeout: Duration::from_secs(30), hugepages: true }
    }
}

/// Why an incoming migration failed.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    /// Accepting.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The stream.
    #[error("migration stream: {0}")]
    Wire(#[from] WireError),
    /// Building the VM.
    #[error("VM: {0}")]
    Vm(#[from] tsubame_vmm::VmError),
    /// The source's setup does not fit this destination.
    #[error("{0}")]
    Mismatch(String),
    /// The source gave up and said why.
    #[error("source aborted: {0}")]
    SourceAborted(String),
    /// The memory does not match the source's digest.
    #[error("memory digest mismatch in {count} of {total} regions (first at byte {first:#x})")]
    DigestMismatch {
        /// Regions that differ.
        count: usize,
        /// Regions compared.
        total: usize,
        /// Address of the first differing region.
        first: u64,
    },
    /// The VM state blob did not decode.
    #[error("VM state frame does not decode: {0}")]
    BadState(String),
}

impl From<std::io::Error> for ReceiveError {
    fn from(e: std::io::Error) -> Self {
        ReceiveError::Wire(WireError::Io(e))
    }
}

/// A VM that arrived and runs here now.
pub struct Incoming {
    /// The running VM.
    pub vm: Vm,
    /// Iterations received (stop-and-copy included).
    pub iterations: u32,
    /// Bytes read from the stream.
    pub bytes: u64,
    /// CPU-seconds this process spent from connection to resume.
    pub cpu_seconds: f64,
    /// Connection to resume.
    pub duration: Duration,
}

/// Counts bytes read.
struct Counted<R> {
    inner: R,
    bytes: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }
}

/// Decompresses a PAGES_COMPRESSED payload (compressor u8, length u32,
/// bytes) into `out`, never past the frame size limit. The decompressor
/// keeps its context: creating a zstd context per batch cost ~1 ms each.
fn unpack(frame: &[u8], decompressor: &mut BatchDecompressor, out: &mut Vec<u8>) -> Result<(), ReceiveError> {
    let mut f = crate::wire::Fields::new(FrameKind::PagesCompressed, frame);
    let id = f.u8()?;
    let len = f.u32()? as usize;
    decompressor
        .decompress(id, f.rest(), len, wire::MAX_PAYLOAD, out)
        .map_err(|e| WireError::BadField { field: "pages_compressed", detail: e.to_string() })?;
    Ok(())
}

/// Times a destination asks for mismatched regions before giving up.
const MAX_REPAIR_ROUNDS: u32 = 2;

/// Writes the records of a PAGES frame into guest memory. `touched` marks
/// pages ever written: a zero record for an untouched page writes nothing,
/// so fresh memory stays unbacked. Codec records are decoded, and the
/// codecs' caches see every page as the sender's did.
fn apply_pages(
    frame: &[u8],
    vm: &Vm,
    granularity: usize,
    touched: &mut [u64],
    decoder: &mut PageDecoder,
) -> Result<(), ReceiveError> {
    let mem = vm.memory();
    let page_count = memory::page_count(mem);
    let zero_page = [0u8; PAGE_SIZE];
    let mut page = [0u8; PAGE_SIZE];
    for_each_record(frame, page_count, granularity, |record| {
        let word = &mut touched[(record.page_index / 64) as usize];
        let bit = 1u64 << (record.page_index % 64);
        let index = record.page_index;
        let addr = index * PAGE_SIZE as u64;
        let result = match record.encoding {
            Encoding::Raw => {
                *word |= bit;
                page.copy_from_slice(record.data);
                decoder.observe(index, &page);
                memory::write(mem, addr, record.data)
            }
            Encoding::Zero => {
                decoder.observe_zero(index);
                if *word & bit != 0 {
                    memory::write(mem, addr, &zero_page)
                } else {
                    Ok(())
                }
            }
            Encoding::Subpage => {
                *word |= bit;
                let mut result = Ok(());
                for_each_subpage(record.data, granularity, |offset, bytes| {
                    if result.is_ok() {
                        result = memory::write(mem, addr + offset as u64, bytes);
                    }
                });
                result
            }
            Encoding::Rle | Encoding::Xbzrle | Encoding::Dedup => {
                *word |= bit;
                let tag = record.encoding.codec_tag().expect("codec encodings have tags");
                if let Err(e) = decoder.decode(index, tag, record.data, &mut page) {
                    return Err(WireError::BadField { field: "pages.codec_record", detail: e.to_string() });
                }
                memory::write(mem, addr, &page)
            }
        };
        result.map_err(|e| WireError::BadField { field: "pages.page_index", detail: e.to_string() })
    })?;
    Ok(())
}

/// Accepts one connection and receives a VM over it. `log` hears the
/// milestones (for the CLI's stderr).
pub fn receive(listener: &Listener, options: &ReceiveOptions, log: &dyn Fn(&str)) -> Result<Incoming, ReceiveError> {
    let stream = listener.accept()?;
    receive_on(stream, options, log)
}

/// Receives a VM over an accepted connection.
pub fn receive_on(stream: Stream, options: &ReceiveOptions, log: &dyn Fn(&str)) -> Result<Incoming, ReceiveError> {
    let started = Instant::now();
    let cpu_start = process_cpu_seconds();
    stream.set_read_timeout(Some(options.io_timeout))?;
    let mut writer = stream.try_clone()?;
    let mut reader = Counted { inner: BufReader::with_capacity(1 << 20, stream), bytes: 0 };
    let result = Receiver { options, log, frame: Vec::new(), iterations: 0 }.run(&mut reader, &mut writer);
    match result {
        Ok((vm, iterations)) => {
            let cpu = process_cpu_seconds() - cpu_start;
            // Tell the source we run, and what it cost us.
            let micros = ((cpu * 1e6) as u64).to_le_bytes();
            let _ = wire::write_frame(&mut writer, FrameKind::Resumed, &micros).and_then(|_| writer.flush());
            Ok(Incoming { vm, iterations, bytes: reader.bytes, cpu_seconds: cpu, duration: started.elapsed() })
        }
        Err(e) => {
            if !matches!(e, ReceiveError::SourceAborted(_)) {
                let message = e.to_string();
                let mut payload = message.as_bytes().to_vec();
                payload.truncate(wire::MAX_ERROR_MESSAGE);
                let _ = wire::write_frame(&mut writer, FrameKind::Error, &payload).and_then(|_| writer.flush());
            }
            Err(e)
        }
    }
}

struct Receiver<'a> {
    options: &'a ReceiveOptions,
    log: &'a dyn Fn(&str),
    frame: Vec<u8>,
    iterations: u32,
}

impl Receiver<'_> {
    fn next(&mut self, reader: &mut impl Read) -> Result<FrameKind, ReceiveError> {
        match wire::read_frame(reader, &mut self.frame)? {
            FrameKind::Error => Err(ReceiveError::SourceAborted(
                String::from_utf8_lossy(&self.frame[..self.frame.len().min(wire::MAX_ERROR_MESSAGE)]).into_owned(),
            )),
            kind => Ok(kind),
        }
    }

    fn run(mut self, reader: &mut impl Read, writer: &mut impl Write) -> Result<(Vm, u32), ReceiveError> {
        wire::write_preamble(writer, wire::VERSION)?;
        wire::read_preamble(reader)?;
        let hello = match self.next(reader)? {
            FrameKind::Hello => Hello::decode(&self.frame)?,
            other => return Err(WireError::Unexpected { got: other, expected: "HELLO" }.into()),
        };
        if let Some(expected) = self.options.expect_memory {
            if expected != hello.memory_bytes {
                return Err(ReceiveError::Mismatch(format!(
                    "memory size mismatch: the source VM has {} bytes, this destination takes {} (--memory)",
                    hello.memory_bytes, expected
                )));
            }
        }
        let codecs: CodecList = hello
            .codecs
            .parse()
            .map_err(|e| ReceiveError::Mismatch(format!("source's codecs '{}': {e}", hello.codecs)))?;
        let mut decoder = PageDecoder::new(&codecs);
        let mut decompressor = BatchDecompressor::default();
        let mut unpacked = Vec::new();
        let mut vm = Vm::create(&VmConfig { memory_bytes: hello.memory_bytes, hugepages: self.options.hugepages })?;
        wire::write_frame(writer, FrameKind::Accept, &[])?;
        writer.flush()?;
        (self.log)(&format!("receiving a VM with {} MiB of memory", hello.memory_bytes >> 20));

        let page_count = memory::page_count(vm.memory());
        let granularity = hello.granularity as usize;
        let mut touched = vec![0u64; page_count.div_ceil(64) as usize];
        let state: VmState;
        loop {
            match self.next(reader)? {
                FrameKind::Pages => apply_pages(&self.frame, &vm, granularity, &mut touched, &mut decoder)?,
                FrameKind::PagesCompressed => {
                    unpack(&self.frame, &mut decompressor, &mut unpacked)?;
                    apply_pages(&unpacked, &vm, granularity, &mut touched, &mut decoder)?
                }
                FrameKind::IterationEnd => {
                    self.iterations += 1;
                }
                FrameKind::State => {
                    state = postcard::from_bytes(&self.frame).map_err(|e| ReceiveError::BadState(e.to_string()))?;
                    break;
                }
                other => {
                    return Err(WireError::Unexpected { got: other, expected: "PAGES, ITERATION_END or STATE" }.into())
                }
            }
        }
        // STATE ends the pages: hash our memory while the source hashes its own.
        let mem = vm.memory().clone();
        let region = hello.digest_region;
        let hasher = std::thread::spawn(move || {
            let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
            digest::memory_digest(&mem, region, threads)
        });
        let next = self.next(reader);
        let mut ours = hasher.join().expect("digest thread");
        match next? {
            FrameKind::Digest => {}
            other => return Err(WireError::Unexpected { got: other, expected: "DIGEST" }.into()),
        }
        // Verify; on a mismatch ask for those regions again (the repair
        // pass), then compare anew.
        let mut rounds = 0;
        loop {
            let mismatched = digest::compare(&self.frame, region, &ours)?;
            let Some(&first) = mismatched.first() else { break };
            if rounds == MAX_REPAIR_ROUNDS || mismatched.len() > digest::MAX_MISMATCH {
                return Err(ReceiveError::DigestMismatch {
                    count: mismatched.len(),
                    total: ours.len(),
                    first: first as u64 * region as u64,
                });
            }
            rounds += 1;
            (self.log)(&format!("memory differs in {} regions; asking for them again", mismatched.len()));
            wire::write_frame(writer, FrameKind::Mismatch, &digest::encode_mismatch(&mismatched))?;
            writer.flush()?;
            loop {
                match self.next(reader)? {
                    FrameKind::Pages => apply_pages(&self.frame, &vm, granularity, &mut touched, &mut decoder)?,
                    FrameKind::Digest => break,
                    other => return Err(WireError::Unexpected { got: other, expected: "PAGES or DIGEST" }.into()),
                }
            }
            let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
            ours = digest::memory_digest(vm.memory(), region, threads);
        }
        vm.restore_state(&state)?;
        wire::write_frame(writer, FrameKind::Ready, &[])?;
        writer.flush()?;
        (self.log)("memory verified; ready, waiting for commit");
        match self.next(reader)? {
            FrameKind::Commit => {}
            other => return Err(WireError::Unexpected { got: other, expected: "COMMIT" }.into()),
        }
        vm.start(false)?;
        (self.log)("committed; the VM runs here now");
        Ok((vm, self.iterations))
    }
}
