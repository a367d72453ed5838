//! Little-endian field reading with named errors, shared by every
//! message's decoder.

use super::kind::{FrameKind, WireError};

/// Little-endian field reader over a payload, with named errors.
pub struct Fields<'a> {
    kind: FrameKind,
    bytes: &'a [u8],
}

impl<'a> Fields<'a> {
    /// Reads fields of a `kind` payload.
    pub fn new(kind: FrameKind, bytes: &'a [u8]) -> Self {
        Fields { kind, bytes }
    }

    /// Takes `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.bytes.len() < n {
            return Err(WireError::Truncated(self.kind));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    /// A u8.
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    /// A little-endian u16.
    pub fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }

    /// A little-endian u32.
    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }

    /// A little-endian u64.
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }

    /// A u16-length-prefixed UTF-8 string of at most `max` bytes.
    pub fn string(&mut self, field: &'static str, max: usize) -> Result<String, WireError> {
        let len = self.u16()? as usize;
        if len > max {
            return Err(WireError::bad(field, format!("{len} bytes (at most {max})")));
        }
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| WireError::bad(field, "not UTF-8"))
    }

    /// Bytes left.
    pub fn rest(&self) -> &'a [u8] {
        self.bytes
    }

    /// The one u64 of a `kind` payload that holds nothing else.
    pub fn only_u64(kind: FrameKind, bytes: &'a [u8]) -> Result<u64, WireError> {
        let mut f = Fields::new(kind, bytes);
        let value = f.u64()?;
        f.finish()?;
        Ok(value)
    }

    /// Fails unless every byte was consumed.
    pub fn finish(self) -> Result<(), WireError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(WireError::bad("payload", format!("{} trailing bytes", self.bytes.len())))
        }
    }
}

/// Appends a u16-length-prefixed string (cut at `max` bytes on a char boundary).
pub fn put_string(out: &mut Vec<u8>, s: &str, max: usize) {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}
