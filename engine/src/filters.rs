//! Request filters resolved to the masks the kernels read, once per distinct filter.
//!
//! A shop's requests repeat a few filters (a category page, "in stock in the EU") many times a
//! second; resolving one means unions and intersections of compressed sets and writing a bit per
//! item of the catalogue. The masks of recent filters are kept, so a repeated filter costs a
//! lookup; a new set of item sets (a live availability update) starts an empty cache.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::item_sets::{ItemFilter, ItemSets};
use crate::kernels::item_mask::ItemMask;

/// Memory the cached masks may hold together (each is one bit per output row).
const CACHE_BYTES: usize = 64 << 20;

/// The item sets of a model and the masks of the filters recently asked of them.
pub struct Filters {
    sets: ItemSets,
    /// Rows of the output layer, the length of every mask.
    mask_len: usize,
    cache: Mutex<HashMap<ItemFilter, Arc<ItemMask>>>,
}

impl Filters {
    pub fn new(sets: ItemSets, mask_len: usize) -> Self {
        Filters {
            sets,
            mask_len,
            cache: Mutex::new(HashMap::new()),
        }
    }

    pub fn sets(&self) -> &ItemSets {
        &self.sets
    }

    /// Masks kept at most: the cache's memory over one mask's bytes, and at least 8.
    fn capacity(&self) -> usize {
        (CACHE_BYTES / self.mask_len.div_ceil(8).max(1)).max(8)
    }

    /// The items `filter` keeps (see [`ItemSets::resolve`]); an unknown set name is refused,
    /// naming it. Equal filters (names in any order, repeated) share one mask.
    pub fn resolve(&self, filter: &ItemFilter) -> Result<Arc<ItemMask>, String> {
        let key = filter.normalized();
        let lock = || {
            self.cache
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        if let Some(mask) = lock().get(&key) {
            return Ok(Arc::clone(mask));
        }
        // Resolved outside the lock: another thread resolving the same filter meanwhile costs a
        // second resolution, never a wait behind this one.
        let mask = Arc::new(self.sets.resolve(&key, self.mask_len)?);
        let mut cache = lock();
        if cache.len() >= self.capacity() {
            // Filters in use come back within the next requests; dropping all at once keeps the
            // bookkeeping to a map.
            cache.clear();
        }
        cache.insert(key, Arc::clone(&mask));
        Ok(mask)
    }

    /// Masks cached now.
    pub fn cached(&self) -> usize {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }
}
