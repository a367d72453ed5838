//! Reconnecting a cut post-copy link: both ends keep what they have, the
//! source connects again (RESUME) and hears what the destination still
//! lacks (RESUME_ACK), until `--postcopy-timeout` has passed.

use std::io::{BufReader, BufWriter};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tsubame_vmm::memory;

use super::link::{Connections, Counters, Outstanding, Packing, PostcopyLink};
use crate::digest::DigestFeed;
use crate::protocol::{self, ErrorMessage, FrameKind, Resume, ResumeAck, WireError};
use crate::source::error::SourceError;
use crate::source::link::Link;
use crate::source::migration::Migration;
use crate::source::send::write_frame_flushed;
use crate::transport::{Address, Metered, Stream, TransportError};

/// Reconnects to the destination after a cut, trying every half second
/// (or at once when `tsubame migrate --resume` asks) until
/// `--postcopy-timeout` has passed: then the VM is lost. A new address
/// that worked replaces the link's.
pub(super) fn reconnect(
    m: &Migration,
    link: &mut Link,
    why: &str,
    outstanding: &Arc<Mutex<Outstanding>>,
    counters: &Counters,
    digest: Option<DigestFeed>,
    packing: Packing,
) -> Result<PostcopyLink, SourceError> {
    let vm = m.vm;
    let deadline = Instant::now() + m.options.postcopy_timeout;
    loop {
        let asked = m.progress.take_resume_request();
        // A new address is kept only once it worked: a wrong one
        // changes nothing.
        let to = match &asked {
            Some((Some(to), _)) => to.clone(),
            _ => link.to.clone(),
        };
        match resume_link(m, link, &to, outstanding) {
            Ok(connections) => {
                link.to = to;
                if let Some((_, reply)) = asked {
                    let _ = reply.send(Ok(()));
                }
                let pacer = Some(link.pacer.clone());
                return Ok(PostcopyLink::start(vm, connections, outstanding, counters, pacer, digest, packing));
            }
            Err(e) => {
                if let Some((_, reply)) = asked {
                    let _ = reply.send(Err(format!("cannot resume: {e}")));
                }
                if Instant::now() >= deadline {
                    return Err(SourceError::PostcopyLost(format!(
                        "{why}; the destination did not come back within {} s ({e})",
                        m.options.postcopy_timeout.as_secs()
                    )));
                }
                m.progress.wait_resume_request(Duration::from_millis(500));
            }
        }
    }
}

/// One attempt: channel 0 again (RESUME, RESUME_ACK: what the
/// destination still lacks), then the request connection.
fn resume_link(
    m: &Migration,
    link: &Link,
    to: &Address,
    outstanding: &Mutex<Outstanding>,
) -> Result<Connections, SourceError> {
    let options = m.options;
    let stream = Stream::connect_with(to, Duration::from_secs(1), &options.security)?;
    stream.set_read_timeout(Some(options.io_timeout))?;
    let mut io = stream.try_clone()?;
    protocol::write_preamble(&mut io, protocol::VERSION)?;
    write_frame_flushed(&mut io, FrameKind::Resume, &Resume { session: link.session, channel: 0 }.encode())?;
    let mut reader = BufReader::new(stream.try_clone()?);
    protocol::read_preamble(&mut reader)?;
    let mut frame = Vec::new();
    let pages = memory::page_count(m.vm.memory());
    match protocol::read_frame(&mut reader, &mut frame)? {
        FrameKind::ResumeAck => {
            let ack = ResumeAck::decode(&frame, pages)?;
            let mut outstanding = outstanding.lock().unwrap();
            outstanding.unsent = ack.missing;
            outstanding.cursor = 0;
            outstanding.link += 1;
        }
        FrameKind::Error => return Err(SourceError::Refused(ErrorMessage::decode(&frame).0)),
        other => return Err(WireError::Unexpected { got: other, expected: "RESUME_ACK" }.into()),
    }
    let pacer = link.pacer.clone();
    let writers = vec![BufWriter::with_capacity(1 << 20, Metered::new(stream, pacer))];
    let urgent = Stream::connect_with(to, Duration::from_secs(1), &options.security).and_then(|s| {
        let mut io = s.try_clone().map_err(|e| TransportError::Connect(to.to_string(), e))?;
        let channel = options.channels;
        protocol::write_preamble(&mut io, protocol::VERSION)
            .and_then(|_| {
                write_frame_flushed(&mut io, FrameKind::Resume, &Resume { session: link.session, channel }.encode())
            })
            .map_err(|e| TransportError::Connect(to.to_string(), e))?;
        Ok(s)
    });
    Ok((writers, reader, urgent.ok()))
}
