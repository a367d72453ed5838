//! The two record formats of a secured connection and what can be wrong
//! with a record (see [`super::record`] for sealing and opening).

use ring::aead::Nonce;

/// Largest plaintext in one record of the tsubame format.
pub const MAX_RECORD: usize = 256 * 1024;
/// Largest plaintext in one TLS record (RFC 8446 §5.1).
pub const TLS_MAX_PLAINTEXT: usize = 16 * 1024;
/// Largest ciphertext of a TLS 1.3 record (RFC 8446 §5.2).
pub const TLS_MAX_CIPHERTEXT: usize = TLS_MAX_PLAINTEXT + 256;
/// Records one TLS key may protect here. RFC 8446 §5.5 allows about 2^24.5
/// for AES-GCM; past it a key update would be needed, which needs the
/// traffic secret rustls keeps, so a connection stops there instead
/// (2^24 records are 256 GiB, more than a migration sends on one channel).
pub const TLS_MAX_RECORDS: u64 = 1 << 24;
/// Bytes of the AES-GCM tag after each record's ciphertext.
pub(super) const TAG_LEN: usize = 16;

/// TLS content types (RFC 8446 §5.1).
pub(super) const CONTENT_ALERT: u8 = 0x15;
pub(super) const CONTENT_HANDSHAKE: u8 = 0x16;
pub(super) const CONTENT_APPLICATION_DATA: u8 = 0x17;

/// How records are framed and nonces made.
#[derive(Clone, Copy)]
pub enum RecordFormat {
    /// tsubame's own format (pre-shared-key mode).
    Tsubame,
    /// TLS 1.3 application-data records with this static IV.
    Tls13 {
        /// The IV the handshake derived for this direction.
        iv: [u8; 12],
    },
}

impl RecordFormat {
    pub(super) fn header_len(&self) -> usize {
        match self {
            RecordFormat::Tsubame => 4,
            RecordFormat::Tls13 { .. } => 5,
        }
    }

    pub(super) fn max_plaintext(&self) -> usize {
        match self {
            RecordFormat::Tsubame => MAX_RECORD,
            RecordFormat::Tls13 { .. } => TLS_MAX_PLAINTEXT,
        }
    }

    pub(super) fn nonce(&self, seq: u64) -> Nonce {
        let mut n = [0u8; 12];
        match self {
            RecordFormat::Tsubame => n[4..].copy_from_slice(&seq.to_le_bytes()),
            RecordFormat::Tls13 { iv } => {
                n[4..].copy_from_slice(&seq.to_be_bytes());
                for (n, iv) in n.iter_mut().zip(iv) {
                    *n ^= iv;
                }
            }
        }
        Nonce::assume_unique_for_key(n)
    }

    /// The header of a record whose sealed body is `body` bytes long.
    pub(super) fn header(&self, body: usize) -> [u8; 5] {
        match self {
            RecordFormat::Tsubame => {
                let l = (body as u32).to_le_bytes();
                [l[0], l[1], l[2], l[3], 0]
            }
            RecordFormat::Tls13 { .. } => {
                let l = (body as u16).to_be_bytes();
                [CONTENT_APPLICATION_DATA, 0x03, 0x03, l[0], l[1]]
            }
        }
    }

    /// The sealed body length a header announces, checked.
    pub(super) fn body_len(&self, header: &[u8; 5]) -> Result<usize, RecordError> {
        match self {
            RecordFormat::Tsubame => {
                let n = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
                if !(TAG_LEN..=MAX_RECORD + TAG_LEN).contains(&n) {
                    return Err(RecordError::Length(n));
                }
                Ok(n)
            }
            RecordFormat::Tls13 { .. } => {
                if header[..3] != [CONTENT_APPLICATION_DATA, 0x03, 0x03] {
                    return Err(RecordError::NotApplicationData(header[..3].try_into().expect("3 bytes")));
                }
                let n = u16::from_be_bytes([header[3], header[4]]) as usize;
                // At least the tag and the inner content type.
                if !(TAG_LEN + 1..=TLS_MAX_CIPHERTEXT).contains(&n) {
                    return Err(RecordError::Length(n));
                }
                Ok(n)
            }
        }
    }

    pub(super) fn record_limit(&self) -> u64 {
        match self {
            RecordFormat::Tsubame => u64::MAX,
            RecordFormat::Tls13 { .. } => TLS_MAX_RECORDS,
        }
    }
}

/// What is wrong with a record, or what it said (carried inside the
/// `std::io::Error` the reader or writer returns).
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The record length is out of range.
    #[error("encrypted record length {0} out of range")]
    Length(usize),
    /// The tag did not verify: forged, altered, reordered or dropped.
    #[error("encrypted record failed authentication")]
    Forged,
    /// A TLS record that is not an encrypted TLS 1.3 record.
    #[error("not a TLS 1.3 application-data record (header {0:02x?})")]
    NotApplicationData([u8; 3]),
    /// A TLS record with nothing but padding inside.
    #[error("TLS record has no content type")]
    NoContentType,
    /// The peer sent a TLS alert other than close_notify.
    #[error("the peer sent TLS alert {name} ({code})")]
    Alert {
        /// RFC 8446 name.
        name: &'static str,
        /// Its number.
        code: u8,
    },
    /// A malformed alert record.
    #[error("malformed TLS alert ({0} bytes)")]
    BadAlert(usize),
    /// A post-handshake message (KeyUpdate, NewSessionTicket, ...).
    #[error("the peer sent a post-handshake TLS message ({0}), which tsubame does not support")]
    PostHandshake(&'static str),
    /// A content type TLS 1.3 does not carry after the handshake.
    #[error("unexpected TLS content type {0}")]
    ContentType(u8),
    /// This key protected as many records as it may.
    #[error("TLS record limit of this connection reached ({TLS_MAX_RECORDS} records); use more --channels")]
    Exhausted,
    /// Sealing failed (never expected).
    #[error("sealing failed")]
    Seal,
}

impl RecordError {
    pub(super) fn io(self) -> std::io::Error {
        let kind = match self {
            RecordError::Alert { .. } | RecordError::PostHandshake(_) => std::io::ErrorKind::ConnectionAborted,
            RecordError::Exhausted | RecordError::Seal => std::io::ErrorKind::Other,
            _ => std::io::ErrorKind::InvalidData,
        };
        std::io::Error::new(kind, self)
    }
}

/// The RFC 8446 name of an alert.
pub fn alert_name(code: u8) -> &'static str {
    match code {
        0 => "close_notify",
        10 => "unexpected_message",
        20 => "bad_record_mac",
        22 => "record_overflow",
        40 => "handshake_failure",
        42 => "bad_certificate",
        43 => "unsupported_certificate",
        44 => "certificate_revoked",
        45 => "certificate_expired",
        46 => "certificate_unknown",
        47 => "illegal_parameter",
        48 => "unknown_ca",
        49 => "access_denied",
        50 => "decode_error",
        51 => "decrypt_error",
        70 => "protocol_version",
        71 => "insufficient_security",
        80 => "internal_error",
        86 => "inappropriate_fallback",
        90 => "user_canceled",
        109 => "missing_extension",
        110 => "unsupported_extension",
        112 => "unrecognized_name",
        113 => "bad_certificate_status_response",
        115 => "unknown_psk_identity",
        116 => "certificate_required",
        120 => "no_application_protocol",
        _ => "unknown alert",
    }
}
