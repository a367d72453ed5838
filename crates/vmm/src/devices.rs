//! Port-I/O devices: the debug console on 0xE9 and a log of unknown ports.

use std::collections::HashSet;
use std::time::Instant;

/// Port of the debug console (QEMU's isa-debugcon default).
pub const DEBUG_CONSOLE_PORT: u16 = 0xE9;

/// One line the guest printed, stamped when its newline arrived.
#[derive(Debug, Clone)]
pub struct ConsoleLine {
    /// Host time the line was completed.
    pub at: Instant,
    /// The text, without the newline.
    pub text: String,
}

/// Longest line kept; the rest of a longer line is dropped.
const MAX_LINE: usize = 4096;

/// Collects console bytes into lines.
#[derive(Default)]
pub struct DebugConsole {
    partial: Vec<u8>,
}

impl DebugConsole {
    /// Feeds bytes written to the port; calls `emit` once per finished line.
    pub fn write(&mut self, data: &[u8], mut emit: impl FnMut(ConsoleLine)) {
        for &b in data {
            if b == b'\n' {
                let text = String::from_utf8_lossy(&self.partial).into_owned();
                self.partial.clear();
                emit(ConsoleLine { at: Instant::now(), text });
            } else if self.partial.len() < MAX_LINE {
                self.partial.push(b);
            }
        }
    }
}

/// Remembers which unknown ports were already reported, to log each once.
#[derive(Default)]
pub struct UnknownPorts {
    seen: HashSet<(u16, bool)>,
}

impl UnknownPorts {
    /// True the first time a port is seen for a direction (true = write).
    pub fn first_access(&mut self, port: u16, write: bool) -> bool {
        self.seen.insert((port, write))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_splits_lines_across_writes() {
        let mut console = DebugConsole::default();
        let mut lines = Vec::new();
        console.write(b"tsb ops=1", |l| lines.push(l.text));
        assert!(lines.is_empty());
        console.write(b" pass=0\nnext\n", |l| lines.push(l.text));
        assert_eq!(lines, vec!["tsb ops=1 pass=0", "next"]);
    }

    #[test]
    fn unknown_port_reported_once() {
        let mut ports = UnknownPorts::default();
        assert!(ports.first_access(0x80, true));
        assert!(!ports.first_access(0x80, true));
        assert!(ports.first_access(0x80, false));
    }
}
