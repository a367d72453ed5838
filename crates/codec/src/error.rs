//! What a decoder found wrong with its input, or a bad codec list.

/// What a decoder found wrong with its input, or a bad codec list.
///
/// After a decoder returns an error its caches no longer match the
/// encoder's: the stream must be abandoned.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum CodecError {
    /// A record ends before what it announces.
    #[error("{codec} record for page {page} is truncated")]
    Truncated {
        /// Codec name.
        codec: &'static str,
        /// Page index.
        page: u64,
    },
    /// The decoded data would not fit in a page.
    #[error("{codec} record for page {page} overruns the page at offset {offset}")]
    Overrun {
        /// Codec name.
        codec: &'static str,
        /// Page index.
        page: u64,
        /// Where it went past the end.
        offset: usize,
    },
    /// A record breaks a rule of its format.
    #[error("{codec} record for page {page} is malformed: {what}")]
    Malformed {
        /// Codec name.
        codec: &'static str,
        /// Page index.
        page: u64,
        /// The rule.
        what: &'static str,
    },
    /// A record refers to a cache entry the decoder does not hold.
    #[error("{codec} record for page {page} refers to a cache entry this side does not hold")]
    CacheMiss {
        /// Codec name.
        codec: &'static str,
        /// Page index.
        page: u64,
    },
    /// Bytes left over after the record.
    #[error("{codec} record for page {page} has {extra} trailing bytes")]
    Trailing {
        /// Codec name.
        codec: &'static str,
        /// Page index.
        page: u64,
        /// Bytes left.
        extra: usize,
    },
    /// A compressed batch did not decompress.
    #[error("{codec} batch does not decompress: {detail}")]
    Batch {
        /// Codec name.
        codec: &'static str,
        /// Why.
        detail: String,
    },
    /// A codec list could not be parsed.
    #[error("codec list: {0}")]
    BadList(String),
    /// A codec tag the decoder does not know or was not told about.
    #[error("page {page} uses codec tag {tag}, which this stream did not enable")]
    UnknownTag {
        /// The tag.
        tag: u8,
        /// Page index.
        page: u64,
    },
}
