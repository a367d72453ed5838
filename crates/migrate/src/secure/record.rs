//! The AEAD record layer under a secured connection, in one of two
//! formats that share the sealing and opening code:
//!
//! - [`RecordFormat::Tsubame`] (pre-shared-key mode): `length u32 LE`
//!   then AES-256-GCM ciphertext and tag, up to [`MAX_RECORD`] bytes of
//!   plaintext; the length is the additional data, the nonce the record's
//!   sequence number (`0000 ‖ seq LE`).
//! - [`RecordFormat::Tls13`] (TLS mode, after rustls's handshake): genuine
//!   TLS 1.3 records (RFC 8446 §5.2) of TLS_AES_256_GCM_SHA384: header
//!   `0x17 0x03 0x03 ‖ length u16 BE` (the additional data), then
//!   AES-256-GCM of `plaintext (≤ 16 KiB) ‖ content type`, nonce
//!   `iv XOR seq (BE)`. Alerts and post-handshake messages are recognised
//!   and end the connection with an error naming them; close_notify is an
//!   end of stream.
//!
//! Each direction has its own state and key, so one thread can read while
//! another writes without a shared lock.

use std::io::{Read, Write};

use ring::aead::{Aad, LessSafeKey, UnboundKey, AES_256_GCM};

use super::record_format::*;

/// Plaintext sealed into one buffer before it is written (one system
/// call for up to sixteen TLS records).
const BATCH: usize = 256 * 1024;
/// Bytes read from the connection at most at once when opening.
const READ_AHEAD: usize = 256 * 1024;

fn key(bytes: &[u8; 32]) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, bytes).expect("32-byte AES-256 key"))
}

/// Sealing state of one direction.
pub struct Sealer {
    key: LessSafeKey,
    format: RecordFormat,
    seq: u64,
    buf: Vec<u8>,
}

impl Sealer {
    /// Seals tsubame-format records with `key`, from sequence number 0.
    pub fn new(k: &[u8; 32]) -> Sealer {
        Sealer::with_format(k, RecordFormat::Tsubame, 0)
    }

    /// Seals records of `format` with `key`, the first numbered `seq`.
    pub fn with_format(k: &[u8; 32], format: RecordFormat, seq: u64) -> Sealer {
        Sealer { key: key(k), format, seq, buf: Vec::new() }
    }

    /// Writes `data` as records to `w`, several records per write.
    pub fn write_all(&mut self, w: &mut impl Write, data: &[u8]) -> std::io::Result<()> {
        for batch in data.chunks(BATCH) {
            // Sealed in place in one reused buffer: no allocation per record.
            self.buf.clear();
            // 16 KiB records in both formats: the peer opens and hands on
            // each record as it lands, so smaller ones overlap decryption
            // with the transfer (256 KiB PSK records cost 1.6x plain
            // against TLS's 1.3x on a 2 GiB kv migration).
            for chunk in batch.chunks(self.format.max_plaintext().min(TLS_MAX_PLAINTEXT)) {
                self.seal(CONTENT_APPLICATION_DATA, chunk)?;
            }
            w.write_all(&self.buf)?;
        }
        Ok(())
    }

    /// Appends one sealed record of `chunk` (a TLS record of inner
    /// `content_type`) to the buffer.
    fn seal(&mut self, content_type: u8, chunk: &[u8]) -> std::io::Result<()> {
        if self.seq >= self.format.record_limit() {
            return Err(RecordError::Exhausted.io());
        }
        let tls = matches!(self.format, RecordFormat::Tls13 { .. });
        let body = chunk.len() + usize::from(tls) + TAG_LEN;
        let header = self.format.header(body);
        let header = &header[..self.format.header_len()];
        let start = self.buf.len() + header.len();
        self.buf.extend_from_slice(header);
        self.buf.extend_from_slice(chunk);
        if tls {
            self.buf.push(content_type);
        }
        let tag = self
            .key
            .seal_in_place_separate_tag(self.format.nonce(self.seq), Aad::from(header), &mut self.buf[start..])
            .map_err(|_| RecordError::Seal.io())?;
        self.seq += 1;
        self.buf.extend_from_slice(tag.as_ref());
        Ok(())
    }
}

/// Opening state of one direction: what was read from the connection and
/// not yet opened, and the opened plaintext not yet handed on.
pub struct Opener {
    key: LessSafeKey,
    format: RecordFormat,
    seq: u64,
    /// Bytes read from the connection, opened in place: `buf[start..end]`
    /// is plaintext not yet read, `buf[pos..filled]` bytes not yet opened.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    pos: usize,
    filled: usize,
    closed: bool,
}

impl Opener {
    /// Opens tsubame-format records with `key`, from sequence number 0.
    pub fn new(k: &[u8; 32]) -> Opener {
        Opener::with_format(k, RecordFormat::Tsubame, 0)
    }

    /// Opens records of `format` with `key`, the first numbered `seq`.
    pub fn with_format(k: &[u8; 32], format: RecordFormat, seq: u64) -> Opener {
        Opener { key: key(k), format, seq, buf: Vec::new(), start: 0, end: 0, pos: 0, filled: 0, closed: false }
    }

    /// Reads plaintext, opening the next records from `r` when needed.
    /// 0 is the end of the stream: a clean end of the connection before a
    /// record, or a TLS close_notify.
    pub fn read(&mut self, r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        // A TLS record may carry no data (or an alert): open until one does.
        while self.start == self.end {
            if self.closed || !self.open_next(r)? {
                self.closed = true;
                return Ok(0);
            }
        }
        let n = buf.len().min(self.end - self.start);
        buf[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }

    /// Everything up to the end of the stream (tests).
    #[cfg(test)]
    pub(crate) fn read_to_end(&mut self, r: &mut impl Read) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut buf = [0u8; 7000];
        loop {
            let n = self.read(r, &mut buf)?;
            if n == 0 {
                return Ok(out);
            }
            out.extend_from_slice(&buf[..n]);
        }
    }

    /// Makes `need` unopened bytes available, reading ahead as much as
    /// the connection has (one system call for many records, not two for
    /// each); false when the connection ended cleanly before any.
    fn fill(&mut self, r: &mut impl Read, need: usize) -> std::io::Result<bool> {
        if self.buf.is_empty() {
            // A fixed size that holds the largest record, never one the
            // peer chooses.
            self.buf = vec![0; READ_AHEAD.max(self.format.header_len() + self.format.max_plaintext() + TAG_LEN + 1)];
        }
        if self.pos + need > self.buf.len() {
            self.buf.copy_within(self.pos..self.filled, 0);
            self.filled -= self.pos;
            self.pos = 0;
        }
        while self.filled - self.pos < need {
            let n = r.read(&mut self.buf[self.filled..])?;
            if n == 0 {
                if self.filled == self.pos {
                    return Ok(false);
                }
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            self.filled += n;
        }
        Ok(true)
    }

    /// Opens the next record; false at the end of the stream.
    fn open_next(&mut self, r: &mut impl Read) -> std::io::Result<bool> {
        let header_len = self.format.header_len();
        // A clean end of stream before a record is an end of stream.
        if !self.fill(r, header_len)? {
            return Ok(false);
        }
        let mut header = [0u8; 5];
        header[..header_len].copy_from_slice(&self.buf[self.pos..self.pos + header_len]);
        let n = self.format.body_len(&header).map_err(RecordError::io)?;
        if self.seq >= self.format.record_limit() {
            return Err(RecordError::Exhausted.io());
        }
        if !self.fill(r, header_len + n)? {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let body = self.pos + header_len;
        let plain = self
            .key
            .open_in_place(self.format.nonce(self.seq), Aad::from(&header[..header_len]), &mut self.buf[body..body + n])
            .map_err(|_| RecordError::Forged.io())?
            .len();
        self.seq += 1;
        self.pos = body + n;
        self.start = body;
        self.end = body + plain;
        if let RecordFormat::Tls13 { .. } = self.format {
            return self.inner_content();
        }
        Ok(true)
    }

    /// Finds a TLS 1.3 record's inner content type (after any zero
    /// padding) and acts on it; false at close_notify.
    fn inner_content(&mut self) -> std::io::Result<bool> {
        let Some(at) = self.buf[self.start..self.end].iter().rposition(|&b| b != 0) else {
            return Err(RecordError::NoContentType.io());
        };
        let at = self.start + at;
        let content = self.buf[at];
        self.end = at;
        match content {
            CONTENT_APPLICATION_DATA => Ok(true),
            CONTENT_ALERT => {
                let alert = &self.buf[self.start..at];
                self.end = self.start;
                if alert.len() != 2 {
                    return Err(RecordError::BadAlert(alert.len()).io());
                }
                if alert[1] == 0 {
                    return Ok(false); // close_notify
                }
                Err(RecordError::Alert { name: alert_name(alert[1]), code: alert[1] }.io())
            }
            CONTENT_HANDSHAKE => {
                let name = match self.buf[self.start..at].first() {
                    Some(4) => "NewSessionTicket",
                    Some(24) => "KeyUpdate",
                    Some(13) => "CertificateRequest",
                    _ => "a handshake message",
                };
                self.end = self.start;
                Err(RecordError::PostHandshake(name).io())
            }
            other => {
                self.end = self.start;
                Err(RecordError::ContentType(other).io())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: [u8; 32] = [0x42; 32];
    const TLS: RecordFormat = RecordFormat::Tls13 { iv: [7; 12] };

    fn read_all(opener: &mut Opener, mut wire: &[u8]) -> std::io::Result<Vec<u8>> {
        opener.read_to_end(&mut wire)
    }

    fn data() -> Vec<u8> {
        (0..600_000u32).map(|i| (i % 251) as u8).collect()
    }

    /// A writer that counts its write calls.
    struct Calls(Vec<u8>, usize);
    impl Write for Calls {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.extend_from_slice(b);
            self.1 += 1;
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn both_formats_round_trip_and_hide_the_plaintext() {
        let data = data();
        for (format, seq) in [(RecordFormat::Tsubame, 0), (TLS, 1), (TLS, 5)] {
            let mut wire = Calls(Vec::new(), 0);
            let mut sealer = Sealer::with_format(&KEY, format, seq);
            sealer.write_all(&mut wire, &data).unwrap();
            sealer.write_all(&mut wire, b"tail").unwrap();
            assert!(!wire.0.windows(64).any(|w| w == &data[1000..1064]), "plaintext visible on the wire");
            // Records are batched: 600 KB go out in 3 writes, not 37.
            assert_eq!(wire.1, 4);
            let out = read_all(&mut Opener::with_format(&KEY, format, seq), &wire.0).unwrap();
            assert_eq!(out.len(), data.len() + 4);
            assert!(out.starts_with(&data) && out.ends_with(b"tail"));
        }
    }

    /// A reader that hands out at most `step` bytes per call and counts calls.
    struct Trickle<'a>(&'a [u8], usize, usize);
    impl Read for Trickle<'_> {
        fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
            self.2 += 1;
            let n = b.len().min(self.1).min(self.0.len());
            b[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    #[test]
    fn records_open_from_reads_of_any_size() {
        let data = data();
        for format in [RecordFormat::Tsubame, TLS] {
            let mut wire = Vec::new();
            Sealer::with_format(&KEY, format, 0).write_all(&mut wire, &data).unwrap();
            let records = data.len().div_ceil(TLS_MAX_PLAINTEXT);
            for step in [1, 7, 4096, usize::MAX] {
                let mut reader = Trickle(&wire, step, 0);
                let out = Opener::with_format(&KEY, format, 0).read_to_end(&mut reader).unwrap();
                assert!(out == data, "{step}-byte reads");
                if step == usize::MAX {
                    // Read ahead: a few calls for the 37 records, not two each.
                    assert!(reader.2 < records / 4, "{} reads for {records} records", reader.2);
                }
            }
        }
    }

    #[test]
    fn tls_records_are_tls_1_3_application_data() {
        let mut wire = Vec::new();
        Sealer::with_format(&KEY, TLS, 0).write_all(&mut wire, &vec![1u8; 40_000]).unwrap();
        // 16384 + 16384 + 7232 bytes, each + content type + tag.
        let mut at = 0;
        for len in [16384usize, 16384, 7232] {
            assert_eq!(wire[at..at + 3], [0x17, 0x03, 0x03]);
            assert_eq!(u16::from_be_bytes([wire[at + 3], wire[at + 4]]) as usize, len + 17);
            at += 5 + len + 17;
        }
        assert_eq!(at, wire.len());
    }

    #[test]
    fn tampered_reordered_or_wrongly_numbered_records_do_not_open() {
        let data = data();
        for format in [RecordFormat::Tsubame, TLS] {
            let mut wire = Vec::new();
            Sealer::with_format(&KEY, format, 0).write_all(&mut wire, &data).unwrap();
            let mut flipped = wire.clone();
            flipped[100] ^= 1;
            let e = read_all(&mut Opener::with_format(&KEY, format, 0), &flipped).unwrap_err();
            assert_eq!(e.to_string(), "encrypted record failed authentication");
            // Another sequence number (a replayed or dropped record).
            assert!(read_all(&mut Opener::with_format(&KEY, format, 1), &wire).is_err());
            // A header altered to a different length.
            let mut header = wire.clone();
            header[1] ^= 0x01;
            assert!(read_all(&mut Opener::with_format(&KEY, format, 0), &header).is_err());
            // Cut in the middle of a record: not a clean end.
            let e = read_all(&mut Opener::with_format(&KEY, format, 0), &wire[..wire.len() - 3]).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        }
        // The wrong IV.
        let mut wire = Vec::new();
        Sealer::with_format(&KEY, TLS, 0).write_all(&mut wire, b"hello").unwrap();
        assert!(read_all(&mut Opener::with_format(&KEY, RecordFormat::Tls13 { iv: [8; 12] }, 0), &wire).is_err());
    }

    #[test]
    fn tls_alerts_and_handshake_messages_end_the_stream_clearly() {
        let seal = |records: &[(u8, &[u8])]| {
            let mut sealer = Sealer::with_format(&KEY, TLS, 0);
            for (content, body) in records {
                sealer.seal(*content, body).unwrap();
            }
            sealer.buf
        };
        // Data, an empty record, data with zero padding after its content
        // type, then close_notify: the data, then the end.
        let mut wire = seal(&[(0x17, b"abc"), (0x17, b""), (0x00, b"de\x17\0\0")]);
        let mut close = Sealer::with_format(&KEY, TLS, 3);
        close.seal(0x15, &[1, 0]).unwrap();
        wire.extend_from_slice(&close.buf);
        wire.extend_from_slice(b"ignored after close_notify");
        let mut opener = Opener::with_format(&KEY, TLS, 0);
        assert_eq!(read_all(&mut opener, &wire).unwrap(), b"abcde");
        assert_eq!(opener.read(&mut &b"more"[..], &mut [0u8; 4]).unwrap(), 0);

        let e = read_all(&mut Opener::with_format(&KEY, TLS, 0), &seal(&[(0x15, &[2, 48])])).unwrap_err();
        assert_eq!(e.to_string(), "the peer sent TLS alert unknown_ca (48)");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionAborted);
        let e = read_all(&mut Opener::with_format(&KEY, TLS, 0), &seal(&[(0x16, &[24, 0, 0, 1, 0])])).unwrap_err();
        assert!(e.to_string().contains("post-handshake TLS message (KeyUpdate)"), "{e}");
        let e = read_all(&mut Opener::with_format(&KEY, TLS, 0), &seal(&[(0x15, &[2])])).unwrap_err();
        assert_eq!(e.to_string(), "malformed TLS alert (1 bytes)");
        let e = read_all(&mut Opener::with_format(&KEY, TLS, 0), &seal(&[(0x00, b"x")])).unwrap_err();
        assert_eq!(e.to_string(), "unexpected TLS content type 120");
        // A plaintext record after the handshake is refused before decryption.
        let e = read_all(&mut Opener::with_format(&KEY, TLS, 0), &[0x15, 3, 3, 0, 2, 2, 40]).unwrap_err();
        assert!(e.to_string().starts_with("not a TLS 1.3 application-data record"), "{e}");
        // Oversized records are refused before anything is allocated.
        let e = read_all(&mut Opener::with_format(&KEY, TLS, 0), &[0x17, 3, 3, 0xff, 0xff]).unwrap_err();
        assert_eq!(e.to_string(), "encrypted record length 65535 out of range");
    }

    #[test]
    fn a_tls_key_stops_at_its_record_limit() {
        let mut sealer = Sealer::with_format(&KEY, TLS, TLS_MAX_RECORDS - 1);
        let mut wire = Vec::new();
        sealer.write_all(&mut wire, b"last").unwrap();
        let e = sealer.write_all(&mut wire, b"one too many").unwrap_err();
        assert!(e.to_string().starts_with("TLS record limit"), "{e}");
        let mut opener = Opener::with_format(&KEY, TLS, TLS_MAX_RECORDS - 1);
        let mut buf = [0u8; 16];
        assert_eq!(opener.read(&mut &wire[..], &mut buf).unwrap(), 4);
    }
}
