//! Post-copy's connections at the destination: channel 0's reader, the
//! request connection's, and taking back a cut link.

use std::io::{Read, Write};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use super::shared::{Ending, PostcopyShared, Unpacker};
use crate::destination::error::ReceiveError;
use crate::protocol::{self, ErrorMessage, FrameKind, Resume, ResumeAck, WireError};
use crate::transport::{Listener, Security, Stream};

/// How a cut link comes back: the source reconnects to this listener and
/// names its session.
pub(crate) struct Reconnect {
    /// A handle on the listener the migration came in on.
    pub(crate) listener: Listener,
    /// What a reconnecting source must pass.
    pub(crate) security: Security,
    /// The migration's HELLO session.
    pub(crate) session: u64,
    /// The request connection's channel number.
    pub(crate) urgent_channel: u16,
}

/// When every page is here, tells a reconnected source the outcome again,
/// then takes whatever it still sends (its DIGEST) until it closes; false
/// while the phase goes on.
fn tell_done(shared: &PostcopyShared, io: &mut (impl Read + Write)) -> Result<bool, ReceiveError> {
    let Some(done) = shared.done() else { return Ok(false) };
    tell(io, &done)?;
    Ok(true)
}

/// POSTCOPY_DONE (`done`'s bytes) on `io`, then whatever the source still
/// sends until it closes: closing with its DIGEST unread could reset the
/// connection before it reads the outcome.
fn tell(io: &mut (impl Read + Write), done: &[u8]) -> Result<(), ReceiveError> {
    protocol::write_frame(&mut *io, FrameKind::PostcopyDone, done)?;
    io.flush()?;
    let _ = std::io::copy(io, &mut std::io::sink());
    Ok(())
}

/// [`tell`] on a thread of its own, for a link the phase took too late.
pub(super) fn tell_done_apart(mut stream: Stream, done: Vec<u8>) {
    let _ = std::thread::Builder::new().name("postcopy-done".into()).spawn(move || {
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let _ = tell(&mut stream, &done);
    });
}

/// Gives a reconnected channel 0 to the phase while it takes links; once
/// it takes no more (every page and the digest are here), the source is
/// told the outcome instead, as soon as it is known.
fn hand_over(shared: &PostcopyShared, events: &Sender<Event>, mut stream: Stream) {
    loop {
        // The ending cannot change while a link is queued: the phase looks
        // at the queue once more after closing.
        let ending = shared.ending();
        if *ending != Ending::Open {
            break;
        }
        let Err(refused) = events.try_send(Event::Resumed(stream)) else { return };
        let full = refused.is_full();
        let Event::Resumed(back) = refused.into_inner() else { return };
        stream = back;
        if !full {
            break; // the phase is gone: its ending is known
        }
        drop(ending);
        // The phase reads the queue all the time: room comes soon.
        std::thread::sleep(Duration::from_millis(1));
    }
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    if let Some(done) = shared.wait_done() {
        let _ = tell(&mut stream, &done);
    }
}

/// What a reconnection turned out to be.
pub(super) enum Answer {
    /// Another session's, or none: refused with an ERROR.
    Refused,
    /// The request connection's: its pages are read on a thread of its own.
    Urgent,
    /// Channel 0's, acknowledged with the pages still missing: the phase
    /// goes on over it.
    Channel0,
    /// Channel 0's after every page arrived: told POSTCOPY_DONE again.
    Done,
}

/// The destination's side of a RESUME handshake on `io`: preamble, RESUME
/// of `session` (refused otherwise), then for channel 0 RESUME_ACK with the
/// pages still missing (and POSTCOPY_DONE again once all are here).
pub(super) fn answer_resume(
    shared: &PostcopyShared,
    io: &mut (impl Read + Write),
    session: u64,
    urgent_channel: u16,
) -> Result<Answer, ReceiveError> {
    protocol::read_preamble(&mut *io)?;
    protocol::write_preamble(&mut *io, protocol::VERSION)?;
    let mut frame = Vec::new();
    let resume = match protocol::read_frame(&mut *io, &mut frame)? {
        FrameKind::Resume => Resume::decode(&frame)?,
        other => return Err(WireError::Unexpected { got: other, expected: "RESUME" }.into()),
    };
    if resume.session != session {
        let refusal = ErrorMessage("no post-copy migration of that session here".into()).encode();
        let _ = protocol::write_frame(&mut *io, FrameKind::Error, &refusal);
        return Ok(Answer::Refused);
    }
    if resume.channel == urgent_channel {
        return Ok(Answer::Urgent);
    }
    let ack = ResumeAck { missing: shared.missing_now() }.encode();
    protocol::write_frame(&mut *io, FrameKind::ResumeAck, &ack)?;
    io.flush()?;
    if tell_done(shared, io)? {
        return Ok(Answer::Done);
    }
    Ok(Answer::Channel0)
}

/// What channel 0's reader threads and the acceptor tell the phase.
pub(super) enum Event {
    Frame(FrameKind, Vec<u8>),
    /// Channel 0 of the given link (0 first, 1 after the first resume...)
    /// broke.
    Lost(u64, String),
    /// A reconnected channel 0: its stream.
    Resumed(Stream),
}

/// Reads channel 0's frames on a thread of its own, so the phase can wait
/// for frames, a reconnection and its deadlines at once.
pub(super) fn spawn_reader(mut reader: Box<dyn Read + Send>, link: u64, events: Sender<Event>) {
    let _ = std::thread::Builder::new().name("postcopy-ch0".into()).spawn(move || loop {
        let mut frame = Vec::new();
        match protocol::read_frame(&mut reader, &mut frame) {
            Ok(kind) => {
                if events.send(Event::Frame(kind, frame)).is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = events.send(Event::Lost(link, format!("link to the source lost: {e}")));
                return;
            }
        }
    });
}

/// Reads a request connection's POSTCOPY_PAGES (plain or compressed)
/// until it closes.
pub(super) fn spawn_urgent(shared: Arc<PostcopyShared>, stream: Stream) {
    let _ = std::thread::Builder::new().name("postcopy-urgent".into()).spawn(move || {
        // A vCPU waiting on a page waits for this thread: it runs first
        // (it blocks on the socket between frames).
        let _realtime = tsubame_vmm::cpu_time::realtime_thread();
        let mut reader = std::io::BufReader::with_capacity(256 << 10, stream);
        let mut frame = Vec::new();
        let mut unpacker = Unpacker::default();
        while !shared.stop.load(Ordering::Acquire) {
            let installed = match protocol::read_frame(&mut reader, &mut frame) {
                Ok(FrameKind::PostcopyPages) => shared.install_frame(&frame),
                Ok(FrameKind::PostcopyPagesCompressed) => shared.install_compressed(&frame, &mut unpacker),
                Ok(other) => {
                    shared.fail(format!("request connection: unexpected {other:?}"));
                    Ok(0)
                }
                // The source closes it when done; channel 0 tells a cut.
                Err(_) => return,
            };
            if let Err(e) = installed {
                shared.fail(format!("request connection: {e}"));
            }
        }
    });
}

/// Takes reconnections: a RESUME of channel 0 goes to the phase (after
/// RESUME_ACK with the pages still missing), one of the request channel
/// gets a reader; anything else is refused. Once the phase is done, a
/// source that was cut off before it heard POSTCOPY_DONE may still come
/// back within the post-copy timeout: it is told again (without it, it
/// would give the VM up although the VM runs here whole).
pub(super) fn spawn_acceptor(shared: Arc<PostcopyShared>, reconnect: Reconnect, events: Sender<Event>) {
    let _ = std::thread::Builder::new().name("postcopy-accept".into()).spawn(move || {
        let mut linger_until = None;
        loop {
            if shared.stop.load(Ordering::Acquire) {
                if shared.done().is_none() {
                    return; // failed: nothing to tell
                }
                let until = *linger_until.get_or_insert_with(|| Instant::now() + shared.timeout);
                if Instant::now() >= until {
                    return;
                }
            }
            let give_up = || match linger_until {
                Some(until) => Instant::now() >= until,
                None => shared.stop.load(Ordering::Acquire),
            };
            let Ok(Some(stream)) = reconnect.listener.accept_until(&give_up) else { continue };
            let Ok(stream) = reconnect.security.accepted(stream) else { continue };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
            let result = (|| -> Result<Option<Stream>, ReceiveError> {
                let mut io = stream.try_clone()?;
                match answer_resume(&shared, &mut io, reconnect.session, reconnect.urgent_channel)? {
                    Answer::Urgent => spawn_urgent(shared.clone(), stream.try_clone()?),
                    Answer::Channel0 => return Ok(Some(stream.try_clone()?)),
                    Answer::Refused | Answer::Done => {}
                }
                Ok(None)
            })();
            if let Ok(Some(stream)) = result {
                let _ = stream.set_read_timeout(None);
                hand_over(&shared, &events, stream);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    use std::sync::Mutex;

    use tsubame_vmm::{memory, DirtyBitmap, PAGE_SIZE};

    use super::*;

    /// A phase with nothing missing, on the smallest memory.
    fn shared() -> Arc<PostcopyShared> {
        let pages = memory::MIN_MEMORY / PAGE_SIZE as u64;
        let mem = Arc::new(memory::create(memory::MIN_MEMORY, false).unwrap());
        let back: super::super::BackChannel = Arc::new(Mutex::new(Box::new(std::io::sink())));
        PostcopyShared::start(mem, &DirtyBitmap::new(pages), vec![0; pages as usize], back, Duration::ZERO, None, false)
            .unwrap()
    }

    /// A reconnected channel 0, and the source's end of it.
    fn link() -> (Stream, UnixStream) {
        let (here, there) = UnixStream::pair().unwrap();
        (Stream::Unix(here), there)
    }

    #[test]
    fn a_link_back_while_the_phase_closes_waits_for_the_outcome_and_hears_it() {
        let shared = shared();
        let (events, queue) = crossbeam_channel::bounded(1);
        shared.close_links();
        let (stream, mut source) = link();
        let teller = {
            let shared = shared.clone();
            std::thread::spawn(move || hand_over(&shared, &events, stream))
        };
        std::thread::sleep(Duration::from_millis(20));
        assert!(queue.try_recv().is_err(), "a closing phase was handed a link it would never read");
        shared.end(Some(b"outcome".to_vec()));
        let mut frame = Vec::new();
        assert_eq!(protocol::read_frame(&mut source, &mut frame).unwrap(), FrameKind::PostcopyDone);
        assert_eq!(frame, b"outcome");
        drop(source);
        teller.join().unwrap();
    }

    #[test]
    fn an_open_phase_takes_the_link_and_a_failed_one_closes_it_unanswered() {
        let shared = shared();
        let (events, queue) = crossbeam_channel::bounded(1);
        let (stream, _source) = link();
        hand_over(&shared, &events, stream);
        assert!(matches!(queue.try_recv(), Ok(Event::Resumed(_))));
        shared.close_links();
        shared.end(None);
        let (stream, mut source) = link();
        hand_over(&shared, &events, stream);
        assert!(queue.try_recv().is_err());
        let mut heard = Vec::new();
        source.read_to_end(&mut heard).unwrap();
        assert!(heard.is_empty(), "{heard:?}");
    }
}
