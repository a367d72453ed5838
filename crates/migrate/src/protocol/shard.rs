//! How pages are split into codec shards and shards onto channels: both
//! ends compute the same layout from HELLO, so each shard's codec caches
//! see the same pages in the same order on both ends.

use tsubame_codec::{CodecList, PAGE_SIZE};

/// How page indices map to shards and channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLayout {
    /// Pages per batch; shards own whole batches.
    pub batch_pages: u64,
    /// Codec shards.
    pub shards: u16,
    /// Connections.
    pub channels: u16,
}

impl ShardLayout {
    /// The shard of a batch starting at `first_page`.
    pub fn shard(&self, first_page: u64) -> u16 {
        ((first_page / self.batch_pages) % self.shards as u64) as u16
    }

    /// The channel that carries a shard's frames.
    pub fn channel(&self, shard: u16) -> u16 {
        shard % self.channels
    }

    /// The shards a channel carries.
    pub fn shards_of(&self, channel: u16) -> impl Iterator<Item = u16> + '_ {
        (0..self.shards).filter(move |&s| self.channel(s) == channel)
    }

    /// Index of `page` among its shard's pages (for per-shard tables).
    pub fn local_index(&self, page: u64) -> u64 {
        let chunk = page / self.batch_pages;
        (chunk / self.shards as u64) * self.batch_pages + page % self.batch_pages
    }

    /// Pages a shard's tables must hold for `pages_total` guest pages.
    pub fn pages_per_shard(&self, pages_total: u64) -> u64 {
        pages_total.div_ceil(self.batch_pages).div_ceil(self.shards as u64) * self.batch_pages
    }
}

/// The codec list of one shard: the caches split evenly, and none larger
/// than guest memory (more could never be used, and the destination
/// allocates what the source's HELLO names). Both ends compute it alike.
pub fn shard_codecs(codecs: &CodecList, shards: u16, memory_bytes: u64) -> CodecList {
    let memory = usize::try_from(memory_bytes).unwrap_or(usize::MAX);
    let split = |bytes: usize| (bytes.min(memory) / shards as usize).max(2 * PAGE_SIZE);
    CodecList { xbzrle: codecs.xbzrle.map(split), dedup: codecs.dedup.map(split), ..codecs.clone() }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_maps_every_page_once() {
        let layout = ShardLayout { batch_pages: 64, shards: 3, channels: 2 };
        let pages = 1000;
        let per_shard = layout.pages_per_shard(pages);
        let mut seen = vec![std::collections::HashSet::new(); 3];
        for page in 0..pages {
            let shard = layout.shard(page - page % 64);
            let local = layout.local_index(page);
            assert!(local < per_shard, "page {page} local {local} >= {per_shard}");
            assert!(seen[shard as usize].insert(local), "page {page} collides in shard {shard}");
        }
        assert_eq!(layout.shards_of(0).collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(layout.shards_of(1).collect::<Vec<_>>(), vec![1]);
    }

    #[test]
    fn caches_split_across_shards() {
        let codecs: CodecList = "zero,xbzrle=64M,dedup=8M".parse().unwrap();
        let split = shard_codecs(&codecs, 4, 1 << 30);
        assert_eq!(split.xbzrle, Some(16 << 20));
        assert_eq!(split.dedup, Some(2 << 20));
        assert!(split.zero);
        // A cache larger than memory is cut to memory: a hostile HELLO
        // cannot make the destination allocate more.
        let huge: CodecList = "zero,xbzrle=38G".parse().unwrap();
        assert_eq!(shard_codecs(&huge, 2, 32 << 20).xbzrle, Some(16 << 20));
    }
}
