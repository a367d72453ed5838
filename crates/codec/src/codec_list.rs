//! Which codecs a stream uses and their cache sizes: `--codec`'s list,
//! parsed and printed.

use crate::batch::BatchCodec;
use crate::error::CodecError;
use crate::PAGE_SIZE;

/// Default XBZRLE cache: 512 MiB, as GMigrate and QEMU users commonly set.
pub const DEFAULT_XBZRLE_CACHE: usize = 512 << 20;
/// Default dedup chunk cache.
pub const DEFAULT_DEDUP_CACHE: usize = 64 << 20;

/// Which codecs a stream uses, and their cache sizes. Parsed from and
/// printed as `none` or a comma list, e.g. `zero,xbzrle=512M,dedup,lz4`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CodecList {
    /// Detect all-zero pages.
    pub zero: bool,
    /// GM-RLE for pages no cached codec took.
    pub rle: bool,
    /// XBZRLE with a page cache of this many bytes.
    pub xbzrle: Option<usize>,
    /// Dedup with a chunk cache of this many bytes.
    pub dedup: Option<usize>,
    /// lz4 or zstd over each batch.
    pub batch: Option<BatchCodec>,
}

impl CodecList {
    /// True when only raw pages (and maybe zero records) are sent.
    pub fn is_plain(&self) -> bool {
        !self.rle && self.xbzrle.is_none() && self.dedup.is_none() && self.batch.is_none()
    }
}

fn parse_bytes(text: &str) -> Option<usize> {
    let t = text.to_ascii_lowercase();
    let t = t.strip_suffix("ib").or_else(|| t.strip_suffix('b')).unwrap_or(&t);
    let (digits, shift) = match t.chars().last()? {
        'k' => (&t[..t.len() - 1], 10),
        'm' => (&t[..t.len() - 1], 20),
        'g' => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    digits.parse::<usize>().ok()?.checked_mul(1 << shift)
}

const KNOWN: &str = "none, zero, rle, xbzrle[=SIZE], dedup[=SIZE], lz4, zstd[=LEVEL]";

impl std::str::FromStr for CodecList {
    type Err = CodecError;

    /// `none`, or a comma list of `zero`, `rle`, `xbzrle[=SIZE]`,
    /// `dedup[=SIZE]`, `lz4`, `zstd[=LEVEL]` (SIZE in bytes with an
    /// optional K/M/G suffix, 8K to 64G; LEVEL 1 to 19).
    fn from_str(s: &str) -> Result<CodecList, CodecError> {
        let bad = |m: String| CodecError::BadList(m);
        let s = s.trim();
        if s.is_empty() {
            return Err(bad(format!("empty (known: {KNOWN})")));
        }
        let mut list = CodecList::default();
        if s == "none" {
            return Ok(list);
        }
        for item in s.split(',').map(str::trim) {
            let (name, value) = match item.split_once('=') {
                Some((n, v)) => (n.trim(), Some(v.trim())),
                None => (item, None),
            };
            let size = |default: usize| -> Result<usize, CodecError> {
                match value {
                    None => Ok(default),
                    Some(v) => parse_bytes(v)
                        .filter(|&b| (2 * PAGE_SIZE..=(64usize << 30)).contains(&b))
                        .ok_or_else(|| bad(format!("'{item}': cache size must be 8K to 64G"))),
                }
            };
            let batch = |list: &CodecList, codec: BatchCodec| match list.batch {
                Some(other) => Err(bad(format!("'{item}': {} already compresses the batches", other.name()))),
                None => Ok(Some(codec)),
            };
            match name {
                "zero" if value.is_none() => list.zero = true,
                "rle" if value.is_none() => list.rle = true,
                "xbzrle" => list.xbzrle = Some(size(DEFAULT_XBZRLE_CACHE)?),
                "dedup" => list.dedup = Some(size(DEFAULT_DEDUP_CACHE)?),
                "lz4" if value.is_none() => list.batch = batch(&list, BatchCodec::Lz4)?,
                "zstd" => {
                    let level = match value {
                        None => 1,
                        Some(v) => v
                            .parse::<i32>()
                            .ok()
                            .filter(|l| (1..=19).contains(l))
                            .ok_or_else(|| bad(format!("'{item}': zstd level must be 1 to 19")))?,
                    };
                    list.batch = batch(&list, BatchCodec::Zstd(level))?;
                }
                "zero" | "rle" | "lz4" => return Err(bad(format!("'{item}': {name} takes no value"))),
                "none" => return Err(bad("'none' cannot be combined with codecs".into())),
                "" => return Err(bad(format!("empty item in '{s}'"))),
                _ => return Err(bad(format!("unknown codec '{item}' (known: {KNOWN})"))),
            }
        }
        Ok(list)
    }
}

impl std::fmt::Display for CodecList {
    /// The canonical form, as sent in a stream's setup; it parses back to
    /// the same list.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if self.zero {
            parts.push("zero".to_string());
        }
        if let Some(b) = self.xbzrle {
            parts.push(format!("xbzrle={b}"));
        }
        if let Some(b) = self.dedup {
            parts.push(format!("dedup={b}"));
        }
        if self.rle {
            parts.push("rle".into());
        }
        match self.batch {
            Some(BatchCodec::Lz4) => parts.push("lz4".into()),
            Some(BatchCodec::Zstd(l)) => parts.push(format!("zstd={l}")),
            None => {}
        }
        if parts.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&parts.join(","))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_print() {
        let l: CodecList = "zero,xbzrle,dedup=1M,zstd=3".parse().unwrap();
        assert_eq!(l.xbzrle, Some(DEFAULT_XBZRLE_CACHE));
        assert_eq!(l.dedup, Some(1 << 20));
        assert_eq!(l.batch, Some(BatchCodec::Zstd(3)));
        assert_eq!(l.to_string().parse::<CodecList>().unwrap(), l);
        let l: CodecList = " zero , rle , lz4 ".parse().unwrap();
        assert_eq!(l.to_string(), "zero,rle,lz4");
        assert_eq!("xbzrle=64MiB".parse::<CodecList>().unwrap().xbzrle, Some(64 << 20));
        assert!("none".parse::<CodecList>().unwrap().is_plain());
        for bad in ["", "gzip", "zero=1", "xbzrle=1", "zstd=99", "dedup=lots", "lz4,zstd", "none,zero", "zero,,rle"] {
            assert!(bad.parse::<CodecList>().is_err(), "{bad}");
        }
        let e = "zero,gzip".parse::<CodecList>().unwrap_err().to_string();
        assert!(e.starts_with("codec list: unknown codec 'gzip' (known: none, zero"), "{e}");
    }
}
