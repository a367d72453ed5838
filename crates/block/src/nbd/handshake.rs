//! Fixed-newstyle negotiation, from the server's greeting to the export's
//! size and transmission flags.
//!
//! ```text
//! S: NBDMAGIC IHAVEOPT u16 handshake-flags
//! C: u32 client-flags
//! C: IHAVEOPT NBD_OPT_GO len (u32 name-len, name, u16 0)
//! S: REPLY_MAGIC GO NBD_REP_INFO len (u16 NBD_INFO_EXPORT, u64 size, u16 flags)   (other INFOs ignored)
//! S: REPLY_MAGIC GO NBD_REP_ACK 0                       -> transmission
//!    or an error reply; NBD_REP_ERR_UNSUP -> fall back to:
//! C: IHAVEOPT NBD_OPT_EXPORT_NAME len name
//! S: u64 size, u16 flags, [124 zeroes unless NO_ZEROES] -> transmission
//!    (or the server closes: no such export)
//! ```

use std::io::{Read, Write};

use super::error::{io_error, NbdError};
use super::flags;
use super::uri::NbdUri;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// What an old-style server sends instead of IHAVEOPT.
const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_GO: u32 = 7;

const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR: u32 = 1 << 31;
const REP_ERR_UNSUP: u32 = REP_ERR + 1;
const REP_ERR_UNKNOWN: u32 = REP_ERR + 6;

const INFO_EXPORT: u16 = 0;

/// The largest option reply payload accepted; the protocol's strings are
/// at most 4 KiB, so anything larger is a broken or hostile server.
pub const MAX_OPTION_REPLY: u32 = 64 << 10;

/// Replies accepted to one option before giving up on a server that never
/// ends the list.
const MAX_REPLIES: usize = 64;

/// The largest export size accepted (the protocol's offsets are signed in
/// places; nothing real comes near).
const MAX_EXPORT_SIZE: u64 = 1 << 62;

/// What negotiation learnt about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    /// Size in bytes: non-zero, at most 2^62, a multiple of 4 KiB.
    pub size: u64,
    /// Transmission flags ([`super::flags`]); 0 when the server sent none.
    pub flags: u16,
}

impl Export {
    /// True when the server advertised `flag`.
    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

fn read_array<const N: usize>(stream: &mut impl Read, during: &'static str) -> Result<[u8; N], NbdError> {
    let mut bytes = [0u8; N];
    stream.read_exact(&mut bytes).map_err(io_error(during))?;
    Ok(bytes)
}

fn read_u64(stream: &mut impl Read, during: &'static str) -> Result<u64, NbdError> {
    read_array(stream, during).map(u64::from_be_bytes)
}

/// Negotiates `uri.export` on a fresh connection.
pub(super) fn negotiate<S: Read + Write>(stream: &mut S, uri: &NbdUri) -> Result<Export, NbdError> {
    const GREETING: &str = "reading the server's greeting";
    let magic = read_u64(stream, GREETING)?;
    if magic != NBDMAGIC {
        return Err(NbdError::Protocol(format!("greeting magic {magic:#x} is not NBDMAGIC (not an NBD server?)")));
    }
    match read_u64(stream, GREETING)? {
        IHAVEOPT => {}
        OLDSTYLE_MAGIC => return Err(NbdError::Protocol("old-style negotiation is not supported".into())),
        other => return Err(NbdError::Protocol(format!("greeting magic {other:#x} is not IHAVEOPT"))),
    }
    let server_flags = u16::from_be_bytes(read_array(stream, GREETING)?);
    let client_flags = server_flags & (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    stream.write_all(&u32::from(client_flags).to_be_bytes()).map_err(io_error("sending client flags"))?;
    let no_zeroes = client_flags & FLAG_NO_ZEROES != 0;

    // Without fixed newstyle a server may drop the connection on an option
    // it does not know, so only EXPORT_NAME is safe.
    let export = if client_flags & FLAG_FIXED_NEWSTYLE != 0 {
        match go(stream, uri)? {
            Some(export) => export,
            None => export_name(stream, uri, no_zeroes)?,
        }
    } else {
        export_name(stream, uri, no_zeroes)?
    };
    if export.size == 0 || export.size > MAX_EXPORT_SIZE {
        return Err(NbdError::Protocol(format!("export size {} is not sane", export.size)));
    }
    if !export.size.is_multiple_of(crate::BLOCK_SIZE as u64) {
        return Err(NbdError::BadSize { size: export.size });
    }
    Ok(export)
}

fn send_option(stream: &mut impl Write, option: u32, data: &[u8]) -> Result<(), NbdError> {
    let mut message = Vec::with_capacity(16 + data.len());
    message.extend_from_slice(&IHAVEOPT.to_be_bytes());
    message.extend_from_slice(&option.to_be_bytes());
    message.extend_from_slice(&(data.len() as u32).to_be_bytes());
    message.extend_from_slice(data);
    stream.write_all(&message).and_then(|()| stream.flush()).map_err(io_error("sending an option"))
}

/// `NBD_OPT_GO`: the export, or `None` when the server does not know GO.
fn go<S: Read + Write>(stream: &mut S, uri: &NbdUri) -> Result<Option<Export>, NbdError> {
    const DURING: &str = "reading the reply to NBD_OPT_GO";
    let name = uri.export.as_bytes();
    let mut data = Vec::with_capacity(6 + name.len());
    data.extend_from_slice(&(name.len() as u32).to_be_bytes());
    data.extend_from_slice(name);
    data.extend_from_slice(&0u16.to_be_bytes());
    send_option(stream, OPT_GO, &data)?;

    let mut export = None;
    for _ in 0..MAX_REPLIES {
        let header: [u8; 20] = read_array(stream, DURING)?;
        let magic = u64::from_be_bytes(header[0..8].try_into().expect("8 bytes"));
        let option = u32::from_be_bytes(header[8..12].try_into().expect("4 bytes"));
        let kind = u32::from_be_bytes(header[12..16].try_into().expect("4 bytes"));
        let len = u32::from_be_bytes(header[16..20].try_into().expect("4 bytes"));
        if magic != REPLY_MAGIC {
            return Err(NbdError::Protocol(format!("option reply magic {magic:#x}")));
        }
        if option != OPT_GO {
            return Err(NbdError::Protocol(format!("reply to option {option} when GO was asked")));
        }
        if len > MAX_OPTION_REPLY {
            return Err(NbdError::Protocol(format!("option reply of {len} bytes (at most {MAX_OPTION_REPLY})")));
        }
        let mut payload = vec![0u8; len as usize];
        stream.read_exact(&mut payload).map_err(io_error(DURING))?;
        match kind {
            REP_ACK => {
                return export
                    .map(Some)
                    .ok_or_else(|| NbdError::Protocol("GO acknowledged without the export's size".into()))
            }
            REP_INFO => {
                if payload.len() < 2 {
                    return Err(NbdError::Protocol("NBD_REP_INFO shorter than its type".into()));
                }
                // Other information types are optional; skip them.
                if u16::from_be_bytes([payload[0], payload[1]]) == INFO_EXPORT {
                    if payload.len() != 12 {
                        return Err(NbdError::Protocol(format!("NBD_INFO_EXPORT of {} bytes, not 12", payload.len())));
                    }
                    let size = u64::from_be_bytes(payload[2..10].try_into().expect("8 bytes"));
                    let flags = u16::from_be_bytes([payload[10], payload[11]]);
                    export = Some(Export { size, flags: transmission_flags(flags) });
                }
            }
            REP_ERR_UNSUP => return Ok(None),
            REP_ERR_UNKNOWN => {
                return Err(NbdError::ExportNotFound { export: uri.export.clone(), host: uri.authority() })
            }
            kind if kind & REP_ERR != 0 => {
                return Err(NbdError::OptionRefused {
                    option: "NBD_OPT_GO",
                    reply: reply_error_name(kind),
                    message: String::from_utf8_lossy(&payload).into_owned(),
                })
            }
            other => return Err(NbdError::Protocol(format!("reply type {other} to NBD_OPT_GO"))),
        }
    }
    Err(NbdError::Protocol(format!("more than {MAX_REPLIES} replies to NBD_OPT_GO")))
}

/// `NBD_OPT_EXPORT_NAME`: the old way, with no error reply (a server
/// without the export just closes the connection).
fn export_name<S: Read + Write>(stream: &mut S, uri: &NbdUri, no_zeroes: bool) -> Result<Export, NbdError> {
    const DURING: &str = "reading the reply to NBD_OPT_EXPORT_NAME";
    send_option(stream, OPT_EXPORT_NAME, uri.export.as_bytes())?;
    let not_found = |e: NbdError| match e {
        NbdError::Io { ref source, .. } if source.kind() == std::io::ErrorKind::UnexpectedEof => {
            NbdError::ExportNotFound { export: uri.export.clone(), host: uri.authority() }
        }
        e => e,
    };
    let size = read_u64(stream, DURING).map_err(not_found)?;
    let flags = u16::from_be_bytes(read_array(stream, DURING)?);
    if !no_zeroes {
        let _: [u8; 124] = read_array(stream, DURING)?;
    }
    Ok(Export { size, flags: transmission_flags(flags) })
}

/// Flags without HAS_FLAGS mean nothing.
fn transmission_flags(raw: u16) -> u16 {
    if raw & flags::HAS_FLAGS != 0 {
        raw
    } else {
        0
    }
}

fn reply_error_name(kind: u32) -> String {
    match kind - REP_ERR {
        1 => "NBD_REP_ERR_UNSUP".into(),
        2 => "NBD_REP_ERR_POLICY (the server's policy forbids it)".into(),
        3 => "NBD_REP_ERR_INVALID".into(),
        4 => "NBD_REP_ERR_PLATFORM".into(),
        5 => "NBD_REP_ERR_TLS_REQD (the server requires TLS)".into(),
        6 => "NBD_REP_ERR_UNKNOWN".into(),
        7 => "NBD_REP_ERR_SHUTDOWN (the server is shutting down)".into(),
        8 => "NBD_REP_ERR_BLOCK_SIZE_REQD".into(),
        9 => "NBD_REP_ERR_TOO_BIG".into(),
        n => format!("error reply {n}"),
    }
}

/// Server-side pieces for tests: a greeting, option parsing and replies.
#[cfg(test)]
pub(super) mod fake {
    use super::*;

    pub fn greet(s: &mut impl Write, flags: u16) {
        s.write_all(&NBDMAGIC.to_be_bytes()).unwrap();
        s.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
        s.write_all(&flags.to_be_bytes()).unwrap();
    }

    /// Reads the client flags and one option: (option, data).
    pub fn read_option(s: &mut impl Read, first: bool) -> (u32, Vec<u8>) {
        if first {
            let mut client_flags = [0; 4];
            s.read_exact(&mut client_flags).unwrap();
        }
        let mut head = [0; 16];
        s.read_exact(&mut head).unwrap();
        assert_eq!(u64::from_be_bytes(head[..8].try_into().unwrap()), IHAVEOPT);
        let option = u32::from_be_bytes(head[8..12].try_into().unwrap());
        let mut data = vec![0; u32::from_be_bytes(head[12..16].try_into().unwrap()) as usize];
        s.read_exact(&mut data).unwrap();
        (option, data)
    }

    pub fn reply(s: &mut impl Write, option: u32, kind: u32, data: &[u8]) {
        s.write_all(&REPLY_MAGIC.to_be_bytes()).unwrap();
        s.write_all(&option.to_be_bytes()).unwrap();
        s.write_all(&kind.to_be_bytes()).unwrap();
        s.write_all(&(data.len() as u32).to_be_bytes()).unwrap();
        s.write_all(data).unwrap();
    }

    /// A full GO exchange serving an export of `size` bytes with `flags`;
    /// returns the export name asked for.
    pub fn serve_go(s: &mut (impl Read + Write), size: u64, flags: u16) -> String {
        greet(s, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        let (option, data) = read_option(s, true);
        assert_eq!(option, OPT_GO);
        let name_len = u32::from_be_bytes(data[..4].try_into().unwrap()) as usize;
        let mut info = INFO_EXPORT.to_be_bytes().to_vec();
        info.extend_from_slice(&size.to_be_bytes());
        info.extend_from_slice(&flags.to_be_bytes());
        reply(s, OPT_GO, REP_INFO, &info);
        reply(s, OPT_GO, REP_ACK, &[]);
        String::from_utf8(data[4..4 + name_len].to_vec()).unwrap()
    }

    pub const GO: u32 = OPT_GO;
    pub const EXPORT_NAME: u32 = OPT_EXPORT_NAME;
    pub const ERR_UNSUP: u32 = REP_ERR_UNSUP;
    pub const ERR_UNKNOWN: u32 = REP_ERR_UNKNOWN;
    pub const ERR_POLICY: u32 = REP_ERR + 2;
    pub const FIXED: u16 = FLAG_FIXED_NEWSTYLE;
    pub const NO_ZEROES: u16 = FLAG_NO_ZEROES;
}

#[cfg(test)]
mod tests {
    use super::fake::*;
    use super::*;
    use std::io::Cursor;

    /// A stream whose reads come from `input` and whose writes are kept.
    struct Scripted {
        input: Cursor<Vec<u8>>,
        output: Vec<u8>,
    }

    impl Read for Scripted {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.input.read(buf)
        }
    }

    impl Write for Scripted {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.output.write(buf)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn negotiate_with(server: impl FnOnce(&mut Vec<u8>)) -> Result<Export, NbdError> {
        let mut input = Vec::new();
        server(&mut input);
        let mut stream = Scripted { input: Cursor::new(input), output: Vec::new() };
        negotiate(&mut stream, &NbdUri::parse("nbd://h/e").unwrap())
    }

    fn info(size: u64, flags: u16) -> Vec<u8> {
        let mut info = INFO_EXPORT.to_be_bytes().to_vec();
        info.extend_from_slice(&size.to_be_bytes());
        info.extend_from_slice(&flags.to_be_bytes());
        info
    }

    #[test]
    fn go_skips_unknown_infos() {
        let export = negotiate_with(|s| {
            greet(s, FIXED | NO_ZEROES);
            reply(s, GO, REP_INFO, &[0, 3, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0]); // NBD_INFO_BLOCK_SIZE-ish
            reply(s, GO, REP_INFO, &info(1 << 20, flags::HAS_FLAGS | flags::SEND_FLUSH));
            reply(s, GO, REP_ACK, &[]);
        })
        .unwrap();
        assert_eq!(export, Export { size: 1 << 20, flags: flags::HAS_FLAGS | flags::SEND_FLUSH });
    }

    #[test]
    fn insane_or_unaligned_sizes_are_refused() {
        for (size, want) in [(0u64, "not sane"), ((1 << 62) + 4096, "not sane"), (4097, "4 KiB")] {
            let err = negotiate_with(|s| {
                greet(s, FIXED | NO_ZEROES);
                reply(s, GO, REP_INFO, &info(size, 1));
                reply(s, GO, REP_ACK, &[]);
            })
            .unwrap_err();
            assert!(err.to_string().contains(want), "{size}: {err}");
        }
    }

    #[test]
    fn bad_option_replies_are_refused() {
        type Server = Box<dyn Fn(&mut Vec<u8>)>;
        let cases: Vec<(&str, Server)> = vec![
            ("at most", Box::new(|s| reply(s, GO, REP_INFO, &vec![0; MAX_OPTION_REPLY as usize + 1]))),
            ("without the export", Box::new(|s| reply(s, GO, REP_ACK, &[]))),
            ("reply to option", Box::new(|s| reply(s, 3, REP_ACK, &[]))),
            ("not 12", Box::new(|s| reply(s, GO, REP_INFO, &[0, 0, 1]))),
            ("shorter", Box::new(|s| reply(s, GO, REP_INFO, &[0]))),
            ("reply type", Box::new(|s| reply(s, GO, 77, &[]))),
            ("POLICY", Box::new(|s| reply(s, GO, ERR_POLICY, b"not you"))),
            ("more than", Box::new(|s| (0..=MAX_REPLIES).for_each(|_| reply(s, GO, REP_INFO, &[0, 9])))),
            ("connection lost", Box::new(|s| s.extend_from_slice(&REPLY_MAGIC.to_be_bytes()))),
            (
                "magic",
                Box::new(|s| {
                    s.extend_from_slice(&1u64.to_be_bytes());
                    s.extend_from_slice(&[0; 12]);
                }),
            ),
        ];
        for (want, server) in cases {
            let err = negotiate_with(|s| {
                greet(s, FIXED | NO_ZEROES);
                server(s);
            })
            .unwrap_err();
            assert!(err.to_string().contains(want), "want '{want}': {err}");
        }
    }

    #[test]
    fn old_servers_get_export_name_with_zeroes() {
        // Not fixed newstyle: straight to EXPORT_NAME, 124 zeroes follow.
        let export = negotiate_with(|s| {
            greet(s, 0);
            s.extend_from_slice(&(8192u64).to_be_bytes());
            s.extend_from_slice(&3u16.to_be_bytes());
            s.extend_from_slice(&[0; 124]);
        })
        .unwrap();
        assert_eq!(export, Export { size: 8192, flags: 3 });
        let err = negotiate_with(|s| greet(s, 0)).unwrap_err();
        assert!(matches!(err, NbdError::ExportNotFound { .. }), "{err}");
        let err = negotiate_with(|s| {
            s.extend_from_slice(&NBDMAGIC.to_be_bytes());
            s.extend_from_slice(&OLDSTYLE_MAGIC.to_be_bytes());
        })
        .unwrap_err();
        assert!(err.to_string().contains("old-style"), "{err}");
    }
}
