//! `nbd://HOST[:PORT]/EXPORT` or `nbd+unix:///EXPORT?socket=PATH`: where
//! an NBD export lives.

use std::fmt;
use std::str::FromStr;

use crate::BlockError;

/// The port NBD servers listen on unless told otherwise (IANA's).
pub const DEFAULT_PORT: u16 = 10809;

/// The protocol's cap on strings (export names, messages).
pub const MAX_NAME_LEN: usize = 4096;

/// A parsed NBD URI. The export name is everything after the first `/`
/// after the authority, as given (no percent-decoding); empty when the URI
/// has none (`nbd://host` names the server's default export).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    /// Host name or IP address (an IPv6 address without its brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// Export name, possibly empty.
    pub export: String,
    /// A Unix socket to connect to instead of `host:port`
    /// (`nbd+unix:///EXPORT?socket=PATH`; then host is empty).
    pub socket: Option<std::path::PathBuf>,
}

impl NbdUri {
    /// Parses `nbd://HOST[:PORT][/EXPORT]`; IPv6 addresses go in brackets
    /// (`nbd://[::1]:10809/vm1`).
    pub fn parse(text: &str) -> Result<NbdUri, BlockError> {
        let bad = |reason| BlockError::BadSpec { spec: text.to_string(), reason };
        if let Some(rest) = text.strip_prefix("nbd+unix://") {
            // The URI form of the NBD document: no host, the socket as a query.
            let path = rest.strip_prefix('/').ok_or_else(|| bad("use nbd+unix:///EXPORT?socket=PATH"))?;
            let (export, query) = path.split_once('?').ok_or_else(|| bad("no ?socket=PATH"))?;
            let socket = query.strip_prefix("socket=").filter(|s| !s.is_empty() && !s.contains('&'));
            let socket = socket.ok_or_else(|| bad("the query must be socket=PATH, nothing else"))?;
            if export.len() > MAX_NAME_LEN || export.contains('\0') {
                return Err(bad("bad export name"));
            }
            return Ok(NbdUri {
                host: String::new(),
                port: 0,
                export: export.to_string(),
                socket: Some(socket.into()),
            });
        }
        let rest = text.strip_prefix("nbd://").ok_or_else(|| bad("not an nbd:// URI"))?;
        let (authority, export) = match rest.find('/') {
            Some(slash) => (&rest[..slash], &rest[slash + 1..]),
            None => (rest, ""),
        };
        if export.contains('?') || authority.contains('?') {
            return Err(bad("query parameters are not supported; use nbd://HOST[:PORT]/EXPORT"));
        }
        if export.len() > MAX_NAME_LEN {
            return Err(bad("export name longer than 4096 bytes"));
        }
        if export.contains('\0') {
            return Err(bad("export name contains NUL"));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let end = v6.find(']').ok_or_else(|| bad("IPv6 address without its closing ']'"))?;
            let host = &v6[..end];
            if host.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(bad("not an IPv6 address inside '[...]'"));
            }
            match &v6[end + 1..] {
                "" => (host, None),
                after => (host, Some(after.strip_prefix(':').ok_or_else(|| bad("junk after ']'"))?)),
            }
        } else {
            match authority.split_once(':') {
                Some((_, port)) if port.contains(':') => {
                    return Err(bad("IPv6 addresses go in brackets: nbd://[ADDR]:PORT/EXPORT"))
                }
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(bad("no host; use nbd://HOST[:PORT]/EXPORT"));
        }
        if host.contains(['@', ' ', '[', ']']) {
            return Err(bad("bad character in host"));
        }
        let port = match port {
            None => DEFAULT_PORT,
            Some(port) => match port.parse::<u16>() {
                Ok(0) | Err(_) => return Err(bad("port must be a number from 1 to 65535")),
                Ok(port) => port,
            },
        };
        Ok(NbdUri { host: host.to_string(), port, export: export.to_string(), socket: None })
    }

    /// `host:port` (IPv6 in brackets) or the socket's path, for messages.
    pub fn authority(&self) -> String {
        if let Some(socket) = &self.socket {
            socket.display().to_string()
        } else if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl FromStr for NbdUri {
    type Err = BlockError;

    fn from_str(text: &str) -> Result<NbdUri, BlockError> {
        NbdUri::parse(text)
    }
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.socket {
            Some(socket) => write!(f, "nbd+unix:///{}?socket={}", self.export, socket.display()),
            None => write!(f, "nbd://{}/{}", self.authority(), self.export),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uri(host: &str, port: u16, export: &str) -> NbdUri {
        NbdUri { host: host.into(), port, export: export.into(), socket: None }
    }

    #[test]
    fn parses_hosts_ports_and_exports() {
        assert_eq!(NbdUri::parse("nbd://10.0.0.1:10900/vm1").unwrap(), uri("10.0.0.1", 10900, "vm1"));
        assert_eq!(NbdUri::parse("nbd://host").unwrap(), uri("host", DEFAULT_PORT, ""));
        assert_eq!(NbdUri::parse("nbd://host/").unwrap(), uri("host", DEFAULT_PORT, ""));
        assert_eq!(NbdUri::parse("nbd://host/a/b").unwrap(), uri("host", DEFAULT_PORT, "a/b"));
        assert_eq!(NbdUri::parse("nbd://[::1]:99/x").unwrap(), uri("::1", 99, "x"));
        assert_eq!(NbdUri::parse("nbd://[fe80::2]").unwrap(), uri("fe80::2", DEFAULT_PORT, ""));
        let round = NbdUri::parse("nbd://[::1]:99/x").unwrap();
        assert_eq!(round.to_string(), "nbd://[::1]:99/x");
        assert_eq!(NbdUri::parse(&round.to_string()).unwrap(), round);
    }

    #[test]
    fn bad_uris_say_why() {
        for (text, why) in [
            ("http://host/x", "nbd://"),
            ("nbd://", "no host"),
            ("nbd:///x", "no host"),
            ("nbd://host:0/x", "port"),
            ("nbd://host:70000/x", "port"),
            ("nbd://host:abc/x", "port"),
            ("nbd://host:/x", "port"),
            ("nbd://::1/x", "brackets"),
            ("nbd://[::1/x", "']'"),
            ("nbd://[nothost]/x", "IPv6"),
            ("nbd://[::1]99/x", "junk"),
            ("nbd://host/x?socket=/tmp/s", "query"),
            ("nbd://user@host/x", "character"),
        ] {
            let err = NbdUri::parse(text).unwrap_err().to_string();
            assert!(err.contains(why), "{text}: {err}");
        }
        let long = format!("nbd://host/{}", "x".repeat(MAX_NAME_LEN + 1));
        assert!(NbdUri::parse(&long).is_err());
    }

    #[test]
    fn unix_sockets() {
        let u = NbdUri::parse("nbd+unix:///vm1?socket=/run/nbd.sock").unwrap();
        assert_eq!((u.export.as_str(), u.socket.as_deref()), ("vm1", Some(std::path::Path::new("/run/nbd.sock"))));
        assert_eq!(u.to_string(), "nbd+unix:///vm1?socket=/run/nbd.sock");
        assert_eq!(NbdUri::parse("nbd+unix:///?socket=/s").unwrap().export, "");
        for bad in ["nbd+unix://host/x?socket=/s", "nbd+unix:///x", "nbd+unix:///x?sock=/s", "nbd+unix:///x?socket="] {
            assert!(NbdUri::parse(bad).is_err(), "{bad}");
        }
    }
}
