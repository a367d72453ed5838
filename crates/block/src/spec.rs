//! What `--disk` names: an image file, or an NBD export
//! (`nbd://HOST[:PORT]/EXPORT`). It travels in a migrating VM's state so
//! the destination opens the same (shared) storage.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{BlockError, NbdUri};

/// Storage as the user named it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DiskSpec {
    /// A raw image file.
    File(PathBuf),
    /// An NBD export, as its URI (`nbd://HOST[:PORT]/EXPORT`); the NBD
    /// client parses the rest.
    Nbd(String),
}

impl FromStr for DiskSpec {
    type Err = BlockError;

    fn from_str(text: &str) -> Result<DiskSpec, BlockError> {
        let bad = |reason| BlockError::BadSpec { spec: text.to_string(), reason };
        if text.is_empty() {
            return Err(bad("empty; give an image file or nbd://HOST[:PORT]/EXPORT"));
        }
        if text.starts_with("nbd://") || text.starts_with("nbd+unix://") {
            // Checked now so a bad URI fails at the command line, not at open.
            NbdUri::parse(text)?;
            return Ok(DiskSpec::Nbd(text.to_string()));
        }
        if text.contains("://") {
            return Err(bad("unknown scheme; give an image file or nbd://HOST[:PORT]/EXPORT"));
        }
        Ok(DiskSpec::File(PathBuf::from(text)))
    }
}

impl fmt::Display for DiskSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiskSpec::File(path) => write!(f, "{}", path.display()),
            DiskSpec::Nbd(uri) => f.write_str(uri),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_files_and_nbd() {
        assert_eq!("/tmp/a.img".parse::<DiskSpec>().unwrap(), DiskSpec::File("/tmp/a.img".into()));
        assert_eq!("disk.img".parse::<DiskSpec>().unwrap().to_string(), "disk.img");
        let nbd: DiskSpec = "nbd://10.0.0.1:10809/vm1".parse().unwrap();
        assert_eq!(nbd, DiskSpec::Nbd("nbd://10.0.0.1:10809/vm1".into()));
        assert_eq!(nbd.to_string(), "nbd://10.0.0.1:10809/vm1");
        for bad in ["", "nbd://", "nbd:///x", "http://host/x", "nbd://h:0/x", "nbd://::1/x"] {
            assert!(bad.parse::<DiskSpec>().is_err(), "{bad}");
        }
    }
}
