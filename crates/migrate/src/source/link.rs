//! The link to the destination as every phase takes it: where it goes,
//! the session that names it, its channels (channel 0's reader, the
//! pipeline that writes them, post-copy's request connection), the pacer
//! they share, and one rule for the link's rate ([`LinkRate`]).

use std::io::{BufReader, BufWriter, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tsubame_vmm::PAGE_SIZE;

use super::choices;
use super::encode::EncoderSetup;
use super::engine::{Engine, EngineSetup};
use super::error::SourceError;
use super::migration::Migration;
use super::send::{tcp_fd, write_frame_flushed, Writer};
use super::zerocopy::{self, GuestPages};
use crate::options::{Granularity, MigrateOptions, PostcopyMode};
use crate::protocol::far::FarPages;
use crate::protocol::{
    self, ChannelOpen, ErrorMessage, FrameKind, Hello, ShardLayout, HELLO_FAR_MEMORY, HELLO_POSTCOPY,
};
use crate::stats::MigrationStats;
use crate::transport::{Address, Metered, Pacer, Stream};

/// The link's rate, by one rule for every phase: `--max-bandwidth`, where
/// given, is what the link carries. The pacer holds the data channels to
/// it; pre-copy's watch and post-copy take it instead of a measure; the
/// pre-copy policy takes the lower of it and what it measured.
#[derive(Debug, Clone, Copy)]
pub struct LinkRate {
    /// `--max-bandwidth`, bytes per second.
    cap: Option<u64>,
}

impl LinkRate {
    /// The rate the options set: the one place `--max-bandwidth`
    /// ([`MigrateOptions::max_bandwidth`]) is read.
    pub fn of(options: &MigrateOptions) -> LinkRate {
        LinkRate { cap: options.max_bandwidth }
    }

    /// What the pacer holds the link to, bytes per second (None: unpaced).
    pub fn pacer_rate(self) -> Option<u64> {
        self.cap
    }

    /// The link's rate where it is known without a measure: the cap.
    pub fn known(self) -> Option<f64> {
        self.cap.map(|cap| cap as f64)
    }

    /// The link's rate: the cap where one is set, else `measured`.
    pub fn known_or(self, measured: f64) -> f64 {
        self.known().unwrap_or(measured)
    }

    /// `measured`, but never above the cap.
    pub fn at_most_cap(self, measured: f64) -> f64 {
        self.known().map_or(measured, |cap| measured.min(cap))
    }
}

/// The connections to the destination and what they share.
pub(super) struct Link {
    /// Where the VM goes (a post-copy resume may name another address).
    pub(super) to: Address,
    /// Names this migration on its extra channels and on a resume.
    pub(super) session: u64,
    /// The link's rate, by the one rule every phase uses.
    pub(super) rate: LinkRate,
    /// The data channels' shared pacer.
    pub(super) pacer: Arc<Pacer>,
    /// The link's capacity for the codecs' payoff checks (f64 bits; 0:
    /// unknown), from pre-copy's first look and each iteration after.
    pub(super) capacity: Arc<AtomicU64>,
    /// Channel 0's reading half: replies, and a last ERROR frame.
    pub(super) reader: Option<BufReader<Stream>>,
    /// The encode and send stages, which hold the data channels' writers.
    pub(super) engine: Option<Engine>,
    /// The connection kept for the pages a post-copy destination asks for.
    pub(super) urgent: Option<Stream>,
}

impl Link {
    /// A link to `to`, not connected yet, paced at the options' rate.
    pub(super) fn new(to: &Address, options: &MigrateOptions) -> Link {
        let rate = LinkRate::of(options);
        Link {
            to: to.clone(),
            session: session_id(),
            rate,
            pacer: Pacer::new(rate.pacer_rate()),
            capacity: Arc::new(AtomicU64::new(0)),
            reader: None,
            engine: None,
            urgent: None,
        }
    }

    /// Connects every channel: the handshake, HELLO and ACCEPT on channel 0,
    /// then the others, which name the session.
    pub(super) fn connect(
        &mut self,
        m: &Migration,
        layout: ShardLayout,
        granularity: Granularity,
    ) -> Result<Vec<Writer>, SourceError> {
        let options = m.options;
        let to = &self.to;
        let stream = Stream::connect_with(to, options.connect_timeout, &options.security)?;
        stream.set_read_timeout(Some(options.io_timeout))?;
        let reader = self.reader.insert(BufReader::new(stream.try_clone()?));
        let mut writer: Writer = BufWriter::with_capacity(1 << 20, Metered::new(stream, self.pacer.clone()));
        let mut frame = Vec::new();

        protocol::write_preamble(&mut writer, protocol::VERSION)?;
        protocol::read_preamble(reader)?;
        let session = self.session;
        let hello = Hello {
            memory_bytes: m.vm.memory_bytes(),
            page_size: PAGE_SIZE as u32,
            vcpus: 1,
            digest_region: options.digest_region,
            granularity: granularity.bytes,
            codecs: options.codecs.to_string(),
            session,
            channels: layout.channels,
            shards: layout.shards,
            flags: if options.postcopy == PostcopyMode::Off { 0 } else { HELLO_POSTCOPY }
                | if m.far.is_some() { HELLO_FAR_MEMORY } else { 0 },
        };
        write_frame_flushed(&mut writer, FrameKind::Hello, &hello.encode())?;
        let kind = protocol::read_frame(reader, &mut frame)?;
        m.state.check(kind)?;
        if kind == FrameKind::Error {
            return Err(SourceError::Refused(ErrorMessage::decode(&frame).0));
        }
        if let Some(far) = &m.far {
            // Before any page, and before the other channels open: the
            // destination must know which pages live far before it lands one.
            protocol::write_frame(&mut writer, FrameKind::FarMemory, &far.frame.encode())?;
            for run in FarPages::split(&far.pages.far, &far.pages.hashes) {
                protocol::write_frame(&mut writer, FrameKind::FarPages, &run.encode())?;
            }
            writer.flush()?;
        }
        // The other channels name the session; the destination accepts
        // them only after its ACCEPT.
        let mut writers = vec![writer];
        for channel in 1..layout.channels {
            let stream = self.open_channel(options, channel)?;
            writers.push(BufWriter::with_capacity(1 << 20, Metered::new(stream, self.pacer.clone())));
        }
        if options.postcopy != PostcopyMode::Off {
            // Asked-for post-copy pages pass the background push on a
            // connection of their own, unpaced.
            self.urgent = Some(self.open_channel(options, layout.channels)?);
        }
        if options.zero_copy {
            if GuestPages::of(m.vm.memory()).is_none() {
                return Err(SourceError::BadOptions("--zero-copy needs guest memory in one mapping".into()));
            }
            for w in &writers {
                let fd = tcp_fd(w).ok_or_else(|| {
                    SourceError::BadOptions(format!(
                        "--zero-copy needs a plain tcp: connection (no unix:, no --psk-file or --tls-*), not {}",
                        self.to
                    ))
                })?;
                zerocopy::enable(fd).map_err(|e| {
                    SourceError::BadOptions(format!("--zero-copy: the kernel refused SO_ZEROCOPY ({e})"))
                })?;
            }
        }
        Ok(writers)
    }

    /// Connects channel `channel` of this session.
    fn open_channel(&self, options: &MigrateOptions, channel: u16) -> Result<Stream, SourceError> {
        let stream = Stream::connect_with(&self.to, options.connect_timeout, &options.security)?;
        stream.set_read_timeout(Some(options.io_timeout))?;
        let mut w = stream.try_clone()?;
        protocol::write_preamble(&mut w, protocol::VERSION)?;
        write_frame_flushed(&mut w, FrameKind::Channel, &ChannelOpen { session: self.session, channel }.encode())?;
        protocol::read_preamble(&mut BufReader::new(stream.try_clone()?))?;
        Ok(stream)
    }

    /// Starts the encode and send stages on the connected channels'
    /// `writers`.
    pub(super) fn start_engine(
        &mut self,
        m: &Migration,
        layout: ShardLayout,
        granularity: Granularity,
        writers: Vec<Writer>,
    ) -> Result<(), SourceError> {
        let options = m.options;
        let encoder_setup = EncoderSetup {
            codecs: &options.codecs,
            granularity,
            detector: options.subpage_detector,
            hash_mask: options.subpage_hash_mask,
            pages_total: m.stats.pages_total,
            layout,
            bandwidth: self.capacity.clone(),
            gpu: options.gpu,
            far_pages: m.far.as_ref().map(|far| &far.pages.far),
        };
        let engine_setup = EngineSetup {
            pipelined: options.pipeline,
            buffers: options.buffers,
            guest: if options.zero_copy { GuestPages::of(m.vm.memory()) } else { None },
        };
        self.engine = Some(Engine::start(&engine_setup, &encoder_setup, writers, self.pacer.clone())?);
        Ok(())
    }

    /// Sets the link's capacity the codecs weigh their time against, bytes
    /// per second (0: unknown).
    pub(super) fn set_capacity(&self, bytes_per_second: f64) {
        self.capacity.store(bytes_per_second.to_bits(), Ordering::Relaxed);
    }

    /// The pipeline, while it runs.
    pub(super) fn engine(&mut self) -> &mut Engine {
        self.engine.as_mut().expect("engine runs while migrating")
    }

    /// Writes a control frame on channel 0 and flushes it.
    pub(super) fn write_control(&mut self, kind: FrameKind, payload: &[u8]) -> Result<(), SourceError> {
        let mut writer = self.engine().writer(0);
        write_frame_flushed(&mut *writer, kind, payload)?;
        Ok(())
    }

    /// Stops the pipeline's threads and adds their counters to `stats`;
    /// returns the channels' writers.
    pub(super) fn finish_engine(&mut self, stats: &mut MigrationStats, options: &MigrateOptions) -> Vec<Writer> {
        let Some(engine) = self.engine.take() else { return Vec::new() };
        stats.bytes_on_wire = engine.bytes();
        let (encoders, pipeline, writers) = engine.finish();
        for encoder in &encoders {
            stats.pages_zero += encoder.zero_pages;
            for (name, s) in encoder.codec_stats().iter() {
                let total = stats.codec.entry(name.to_string()).or_default();
                total.pages += s.pages;
                total.bytes_in += s.bytes_in;
                total.bytes_out += s.bytes_out;
            }
            if let Some(sub) = encoder.subpage_stats() {
                stats.subpage.get_or_insert_with(|| sub.clone().emptied()).add(sub);
            }
        }
        if let Some(sub) = &mut stats.subpage {
            sub.regions_repaired = stats.regions_repaired;
        }
        choices::granularity_choice(&mut stats.choices, options, stats.subpage.as_ref());
        if let Some((chose, why)) = encoders.iter().find_map(|e| e.frame_choice()) {
            let what = "frame compression".to_string();
            stats.choices.push(crate::stats::Choice { what, chose: chose.clone(), why: why.clone() });
        }
        stats.pipeline = Some(pipeline);
        writers
    }

    /// After a broken connection: the destination's ERROR frame, if it
    /// sent one before hanging up.
    pub(super) fn peer_error(&mut self) -> Option<String> {
        let reader = self.reader.as_mut()?;
        let _ = reader.get_ref().set_read_timeout(Some(Duration::from_millis(500)));
        let mut frame = Vec::new();
        for _ in 0..4 {
            match protocol::read_frame(reader, &mut frame) {
                Ok(FrameKind::Error) => return Some(ErrorMessage::decode(&frame).0),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
        None
    }
}

/// A migration's name on its extra channels: unguessable enough that a
/// stray connection cannot join another migration by accident.
fn session_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_replaces_a_measure_or_bounds_it() {
        let capped = LinkRate::of(&MigrateOptions { max_bandwidth: Some(125_000_000), ..MigrateOptions::default() });
        assert_eq!(capped.pacer_rate(), Some(125_000_000));
        assert_eq!(capped.known_or(3e8), 1.25e8);
        assert_eq!(capped.known_or(1e6), 1.25e8);
        assert_eq!(capped.at_most_cap(3e8), 1.25e8);
        assert_eq!(capped.at_most_cap(1e6), 1e6);
        let free = LinkRate::of(&MigrateOptions { max_bandwidth: None, ..MigrateOptions::default() });
        assert_eq!((free.pacer_rate(), free.known()), (None, None));
        assert_eq!((free.known_or(3e8), free.at_most_cap(3e8)), (3e8, 3e8));
    }
}
