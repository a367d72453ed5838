//! The link to the destination as every phase takes it.

use crate::options::MigrateOptions;

/// The link's rate, by one rule for every phase: `--max-bandwidth`, where
/// given, is what the link carries. The pacer holds the data channels to
/// it; pre-copy's watch and post-copy take it instead of a measure; the
/// pre-copy policy takes the lower of it and what it measured.
#[derive(Debug, Clone, Copy)]
pub struct LinkRate {
    /// `--max-bandwidth`, bytes per second.
    cap: Option<u64>,
}

impl LinkRate {
    /// The rate the options set: the one place `--max-bandwidth`
    /// ([`MigrateOptions::max_bandwidth`]) is read.
    pub fn of(options: &MigrateOptions) -> LinkRate {
        LinkRate { cap: options.max_bandwidth }
    }

    /// What the pacer holds the link to, bytes per second (None: unpaced).
    pub fn pacer_rate(self) -> Option<u64> {
        self.cap
    }

    /// The link's rate where it is known without a measure: the cap.
    pub fn known(self) -> Option<f64> {
        self.cap.map(|cap| cap as f64)
    }

    /// The link's rate: the cap where one is set, else `measured`.
    pub fn known_or(self, measured: f64) -> f64 {
        self.known().unwrap_or(measured)
    }

    /// `measured`, but never above the cap.
    pub fn at_most_cap(self, measured: f64) -> f64 {
        self.known().map_or(measured, |cap| measured.min(cap))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_replaces_a_measure_or_bounds_it() {
        let capped = LinkRate::of(&MigrateOptions { max_bandwidth: Some(125_000_000), ..MigrateOptions::default() });
        assert_eq!(capped.pacer_rate(), Some(125_000_000));
        assert_eq!(capped.known_or(3e8), 1.25e8);
        assert_eq!(capped.known_or(1e6), 1.25e8);
        assert_eq!(capped.at_most_cap(3e8), 1.25e8);
        assert_eq!(capped.at_most_cap(1e6), 1e6);
        let free = LinkRate::of(&MigrateOptions { max_bandwidth: None, ..MigrateOptions::default() });
        assert_eq!((free.pacer_rate(), free.known()), (None, None));
        assert_eq!((free.known_or(3e8), free.at_most_cap(3e8)), (3e8, 3e8));
    }
}
