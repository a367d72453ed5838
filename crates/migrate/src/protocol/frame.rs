//! The stream's framing: a preamble each way, then CRC-checked frames of
//! `kind u16, reserved u16, length u32, crc u32` and a payload.
//! docs/stream-format.md is the reference.

use std::io::{Read, Write};

use super::kind::{is_tls_client_hello, FrameKind, WireError, MAGIC, MAX_PAYLOAD, SECURE_MAGIC, VERSION};
use super::pages::zero_copy_covered;

/// Bytes of the preamble: magic, version, reserved.
pub const PREAMBLE_LEN: usize = 16;
/// Bytes of a frame header: kind u16, reserved u16, length u32, crc u32.
pub const FRAME_HEADER_LEN: usize = 12;

/// Writes our preamble.
pub fn write_preamble(w: &mut (impl Write + ?Sized), version: u32) -> std::io::Result<()> {
    let mut p = [0u8; PREAMBLE_LEN];
    p[..8].copy_from_slice(&MAGIC);
    p[8..12].copy_from_slice(&version.to_le_bytes());
    w.write_all(&p)?;
    w.flush()
}

/// Reads and checks the peer's preamble.
pub fn read_preamble(r: &mut (impl Read + ?Sized)) -> Result<(), WireError> {
    let mut p = [0u8; PREAMBLE_LEN];
    r.read_exact(&mut p)?;
    if p[..8] != MAGIC {
        if p[..8] == SECURE_MAGIC {
            return Err(WireError::PeerIsSecure("a tsubame secure handshake"));
        }
        if is_tls_client_hello(&p) {
            return Err(WireError::PeerIsSecure("a TLS handshake"));
        }
        return Err(WireError::BadMagic);
    }
    let peer = u32::from_le_bytes(p[8..12].try_into().unwrap());
    if peer != VERSION {
        return Err(WireError::VersionMismatch { peer });
    }
    Ok(())
}

fn header_with_crc(kind: FrameKind, payload_len: usize, crc: impl FnOnce(u32) -> u32) -> [u8; FRAME_HEADER_LEN] {
    let mut h = [0u8; FRAME_HEADER_LEN];
    h[0..2].copy_from_slice(&(kind as u16).to_le_bytes());
    h[4..8].copy_from_slice(&(payload_len as u32).to_le_bytes());
    let crc = crc(crc32c::crc32c(&h[..8]));
    h[8..12].copy_from_slice(&crc.to_le_bytes());
    h
}

/// The header bytes of a frame (CRC over header[..8] then payload).
pub fn frame_header(kind: FrameKind, payload: &[u8]) -> [u8; FRAME_HEADER_LEN] {
    header_with_crc(kind, payload.len(), |crc| crc32c::crc32c_append(crc, payload))
}

/// The header of a PAGES_ZEROCOPY frame whose payload is `payload_len`
/// bytes; `headers` are its PAGES header and record headers, back to back
/// (all its CRC covers).
pub fn zero_copy_frame_header(payload_len: usize, headers: &[u8]) -> [u8; FRAME_HEADER_LEN] {
    header_with_crc(FrameKind::PagesZeroCopy, payload_len, |crc| crc32c::crc32c_append(crc, headers))
}

/// The CRC of a PAGES_ZEROCOPY frame: header[..8], the PAGES header and
/// each record's header, skipping the record data. None when the records
/// run past the payload.
fn zero_copy_crc(h: &[u8; FRAME_HEADER_LEN], payload: &[u8]) -> Option<u32> {
    let mut crc = crc32c::crc32c(&h[..8]);
    zero_copy_covered(payload, |part| crc = crc32c::crc32c_append(crc, part))?;
    Some(crc)
}

/// Payloads up to this size go out in one write with their header.
const ONE_WRITE_PAYLOAD: usize = 512;

/// Writes one frame; a small one in a single write, so that an unbuffered
/// socket sends it in one segment (RESUMED went out as a 12-byte header
/// and its payload apart: the source woke for the header and slept again
/// until the rest came, 0.03 ms of the stop).
pub fn write_frame(w: &mut (impl Write + ?Sized), kind: FrameKind, payload: &[u8]) -> std::io::Result<()> {
    debug_assert!(payload.len() <= MAX_PAYLOAD);
    let header = frame_header(kind, payload);
    if payload.len() <= ONE_WRITE_PAYLOAD {
        let mut frame = [0u8; FRAME_HEADER_LEN + ONE_WRITE_PAYLOAD];
        frame[..FRAME_HEADER_LEN].copy_from_slice(&header);
        frame[FRAME_HEADER_LEN..FRAME_HEADER_LEN + payload.len()].copy_from_slice(payload);
        return w.write_all(&frame[..FRAME_HEADER_LEN + payload.len()]);
    }
    w.write_all(&header)?;
    w.write_all(payload)
}

/// Parses a frame header; returns kind and payload length.
pub fn parse_header(h: &[u8; FRAME_HEADER_LEN]) -> Result<(FrameKind, usize), WireError> {
    let raw_kind = u16::from_le_bytes([h[0], h[1]]);
    let kind = FrameKind::from_u16(raw_kind).ok_or(WireError::UnknownKind(raw_kind))?;
    let reserved = u16::from_le_bytes([h[2], h[3]]);
    if reserved != 0 {
        return Err(WireError::bad("header.reserved", format!("{reserved} (must be 0)")));
    }
    let len = u32::from_le_bytes(h[4..8].try_into().unwrap());
    if len as usize > MAX_PAYLOAD {
        return Err(WireError::TooLong(len));
    }
    Ok((kind, len as usize))
}

/// Reads one frame into `buf` (reused across calls); checks length cap
/// before allocating and the CRC before returning.
pub fn read_frame(r: &mut (impl Read + ?Sized), buf: &mut Vec<u8>) -> Result<FrameKind, WireError> {
    read_frame_reserving(r, buf, |_| Ok(()))
}

/// [`read_frame`], asking `reserve` for the payload's length after the
/// header is checked and before the buffer grows (the destination's cap on
/// the bytes a peer makes it hold).
pub fn read_frame_reserving<E: From<WireError>>(
    r: &mut (impl Read + ?Sized),
    buf: &mut Vec<u8>,
    reserve: impl FnOnce(usize) -> Result<(), E>,
) -> Result<FrameKind, E> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    r.read_exact(&mut h).map_err(WireError::from)?;
    let (kind, len) = parse_header(&h)?;
    reserve(len)?;
    buf.resize(len, 0);
    r.read_exact(buf).map_err(WireError::from)?;
    let want = u32::from_le_bytes(h[8..12].try_into().unwrap());
    let got = match kind {
        FrameKind::PagesZeroCopy => zero_copy_crc(&h, buf),
        _ => Some(crc32c::crc32c_append(crc32c::crc32c(&h[..8]), buf)),
    };
    let got = got.unwrap_or(!want);
    // Fuzz builds skip the check so mutations reach the parsers behind it.
    if want != got && !cfg!(fuzzing) {
        return Err(WireError::BadCrc { kind }.into());
    }
    Ok(kind)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::kind::SECURE_MAGIC;
    use crate::protocol::pages::{PAGES_HEADER, RECORD_HEADER};

    #[test]
    fn zero_copy_crc_covers_headers_not_data() {
        let mut b = crate::protocol::pages::PagesBuilder::new(2);
        b.reset(1, 0);
        b.push_header(7, crate::protocol::pages::Encoding::Raw, 4096);
        b.push_header(8, crate::protocol::pages::Encoding::Zero, 0);
        let headers = b.payload().to_vec();
        // The payload as it arrives: the page spliced in after its header.
        let mut payload = headers[..PAGES_HEADER + RECORD_HEADER].to_vec();
        payload.extend_from_slice(&[0xAB; 4096]);
        payload.extend_from_slice(&headers[PAGES_HEADER + RECORD_HEADER..]);
        let h = zero_copy_frame_header(payload.len(), &headers);
        let frame = |payload: &[u8]| [&h[..], payload].concat();
        let mut buf = Vec::new();
        assert_eq!(read_frame(&mut frame(&payload).as_slice(), &mut buf).unwrap(), FrameKind::PagesZeroCopy);
        // Page bytes are the digest's business; headers are the CRC's.
        let mut changed_page = payload.clone();
        changed_page[100] ^= 1;
        assert!(read_frame(&mut frame(&changed_page).as_slice(), &mut buf).is_ok());
        let mut changed_index = payload.clone();
        changed_index[PAGES_HEADER] ^= 1;
        assert!(matches!(read_frame(&mut frame(&changed_index).as_slice(), &mut buf), Err(WireError::BadCrc { .. })));
        let mut bad_count = payload;
        bad_count[8] = 200; // records past the payload
        assert!(matches!(read_frame(&mut frame(&bad_count).as_slice(), &mut buf), Err(WireError::BadCrc { .. })));
    }

    #[test]
    fn frame_round_trip_and_crc() {
        let mut wire = Vec::new();
        write_frame(&mut wire, FrameKind::Pages, b"hello").unwrap();
        let mut buf = Vec::new();
        assert_eq!(read_frame(&mut wire.as_slice(), &mut buf).unwrap(), FrameKind::Pages);
        assert_eq!(buf, b"hello");
        for i in 0..wire.len() {
            let mut bad = wire.clone();
            bad[i] ^= 0x40;
            assert!(read_frame(&mut bad.as_slice(), &mut buf).is_err(), "flip at byte {i} not caught");
        }
        assert!(matches!(read_frame(&mut &wire[..wire.len() - 1], &mut buf), Err(WireError::Io(_))));
    }

    #[test]
    fn oversized_and_unknown_frames_rejected_before_reading_payload() {
        let mut h = frame_header(FrameKind::Pages, b"");
        h[4..8].copy_from_slice(&(MAX_PAYLOAD as u32 + 1).to_le_bytes());
        assert!(matches!(parse_header(&h), Err(WireError::TooLong(_))));
        h[0] = 99;
        assert!(matches!(parse_header(&h), Err(WireError::UnknownKind(99))));
        let zero = [0u8; FRAME_HEADER_LEN];
        assert!(matches!(parse_header(&zero), Err(WireError::UnknownKind(0))));
    }

    #[test]
    fn preamble_checks_magic_and_version() {
        let mut ok = Vec::new();
        write_preamble(&mut ok, VERSION).unwrap();
        read_preamble(&mut ok.as_slice()).unwrap();
        let mut other = Vec::new();
        write_preamble(&mut other, VERSION + 1).unwrap();
        assert!(
            matches!(read_preamble(&mut other.as_slice()), Err(WireError::VersionMismatch { peer }) if peer == VERSION + 1)
        );
        assert!(matches!(read_preamble(&mut &[0u8; 16][..]), Err(WireError::BadMagic)));
        let mut secure = [0u8; 16];
        secure[..8].copy_from_slice(&SECURE_MAGIC);
        assert!(matches!(read_preamble(&mut &secure[..]), Err(WireError::PeerIsSecure(_))));
        let client_hello = [0x16, 3, 1, 0, 200, 1, 0, 0, 196, 3, 3, 0, 0, 0, 0, 0];
        assert!(matches!(read_preamble(&mut &client_hello[..]), Err(WireError::PeerIsSecure("a TLS handshake"))));
    }
}
