//! One bit per guest page: the dirty set the migration engine reads from
//! KVM's dirty log (OR the pages the VMM itself wrote), and every other
//! page set the engine keeps (pages to send, to hash, to discard).
//! Pages written concurrently by several threads are marked in vm-memory's
//! `AtomicBitmap` instead (guest memory carries one), and read from there
//! into a [`DirtyBitmap`].

/// A set of guest pages, one bit per page, LSB first in 64-bit words (the
/// layout of KVM's dirty log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtyBitmap {
    words: Vec<u64>,
    pages: u64,
}

impl DirtyBitmap {
    /// No page set.
    pub fn new(pages: u64) -> DirtyBitmap {
        DirtyBitmap { words: vec![0; pages.div_ceil(64) as usize], pages }
    }

    /// Every page set.
    pub fn full(pages: u64) -> DirtyBitmap {
        let mut b = DirtyBitmap::new(pages);
        b.set_all();
        b
    }

    /// A bitmap of `pages` pages from its words (extra bits past the last
    /// page are dropped).
    pub fn from_words(mut words: Vec<u64>, pages: u64) -> DirtyBitmap {
        words.resize(pages.div_ceil(64) as usize, 0);
        let mut b = DirtyBitmap { words, pages };
        b.trim();
        b
    }

    fn trim(&mut self) {
        if !self.pages.is_multiple_of(64) {
            if let Some(last) = self.words.last_mut() {
                *last &= (1u64 << (self.pages % 64)) - 1;
            }
        }
    }

    /// Pages the bitmap covers.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// The words, LSB first.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// The words, to be filled (by KVM's dirty log, say).
    pub fn words_mut(&mut self) -> &mut [u64] {
        &mut self.words
    }

    /// Pages set.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| w.count_ones() as u64).sum()
    }

    /// True when no page is set.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// Whether `page` is set (false past the end).
    pub fn get(&self, page: u64) -> bool {
        page < self.pages && self.words[(page / 64) as usize] & (1 << (page % 64)) != 0
    }

    /// Sets `page` (ignored past the end).
    pub fn set(&mut self, page: u64) {
        if page < self.pages {
            self.words[(page / 64) as usize] |= 1 << (page % 64);
        }
    }

    /// Clears `page`.
    pub fn unset(&mut self, page: u64) {
        if page < self.pages {
            self.words[(page / 64) as usize] &= !(1 << (page % 64));
        }
    }

    /// Sets every page.
    pub fn set_all(&mut self) {
        self.words.fill(u64::MAX);
        self.trim();
    }

    /// Clears every page.
    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// Adds the pages of `other` (of the same size).
    pub fn union_with(&mut self, other: &DirtyBitmap) {
        debug_assert_eq!(self.pages, other.pages);
        self.words.iter_mut().zip(&other.words).for_each(|(a, b)| *a |= b);
    }

    /// Removes the pages of `other` (of the same size).
    pub fn subtract(&mut self, other: &DirtyBitmap) {
        debug_assert_eq!(self.pages, other.pages);
        self.words.iter_mut().zip(&other.words).for_each(|(a, b)| *a &= !b);
    }

    /// Adds pages given as words, LSB first, from page 0.
    pub fn union_words(&mut self, words: &[u64]) {
        self.words.iter_mut().zip(words).for_each(|(a, b)| *a |= b);
        self.trim();
    }

    /// The bitmap in runs of `words` words (the last may be shorter), each
    /// with the first page it covers: the unit a migration clears in KVM
    /// and reads.
    pub fn chunks(&self, words: usize) -> impl Iterator<Item = (u64, &[u64])> + '_ {
        self.words.chunks(words).enumerate().map(move |(i, chunk)| ((i * words * 64) as u64, chunk))
    }

    /// The set pages, in order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &word)| {
            let mut bits = word;
            std::iter::from_fn(move || {
                (bits != 0).then(|| {
                    let bit = bits.trailing_zeros() as u64;
                    bits &= bits - 1;
                    i as u64 * 64 + bit
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_count_iterate() {
        let mut b = DirtyBitmap::new(130);
        assert!(b.is_empty());
        for p in [0, 63, 64, 129, 200] {
            b.set(p);
        }
        assert_eq!(b.count(), 4);
        assert_eq!(b.iter().collect::<Vec<_>>(), vec![0, 63, 64, 129]);
        assert!(b.get(129) && !b.get(128) && !b.get(200));
        b.unset(63);
        assert_eq!(b.count(), 3);
        let full = DirtyBitmap::full(130);
        assert_eq!(full.count(), 130);
        b.union_with(&full);
        assert_eq!(b, full);
        assert_eq!(DirtyBitmap::from_words(vec![u64::MAX; 3], 130).count(), 130);
        let mut some = DirtyBitmap::new(130);
        some.set(5);
        some.set(129);
        b.subtract(&some);
        assert_eq!(b.count(), 128);
        assert!(!b.get(5) && !b.get(129) && b.get(128));
    }
}
