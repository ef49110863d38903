//! Request filters resolved to the masks the kernels read, once per distinct filter, over the
//! engine's own item sets and, when the model has one, a live availability object.
//!
//! A shop's requests repeat a few filters (a category page, "in stock in the EU") many times a
//! second; resolving one means unions and intersections of compressed sets and writing a bit per
//! item of the catalogue. The masks of recent filters are kept, so a repeated filter costs a
//! lookup.
//!
//! Live availability changes while requests run. Everything a batch filters by is one immutable
//! [`FilterView`]: the engine's sets, the availability object in force, and the masks resolved
//! from both. A new object becomes a new view, swapped in whole ([`Filters::replace_availability`]);
//! a batch takes the view once ([`Filters::view`]) and keeps it to its end, so no answer mixes two
//! objects and no request waits for an update (the swap holds the lock for a pointer store).
//!
//! Items a live catalogue retired ([`crate::catalogue`]) are out of every mask a view resolves,
//! and a request without a filter gets the mask of every item still offered
//! ([`FilterView::unfiltered`]): no path returns a retired item.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use roaring::RoaringBitmap;

use crate::availability::Availability;
use crate::item_sets::{resolve_with, ItemFilter, ItemSets};
use crate::kernels::item_mask::ItemMask;

/// Memory the cached masks of one view may hold together (each is one bit per output row).
const CACHE_BYTES: usize = 64 << 20;

/// What a batch filters by: the engine's sets overlaid with one availability object, and the
/// masks resolved from them.
pub struct FilterView {
    base: Arc<ItemSets>,
    /// The availability object in force; its columns take the place of the engine's columns of
    /// the same name.
    live: Option<Arc<Availability>>,
    /// Why the model's availability source is not in force yet, when it is configured and has
    /// never been read (said when a request names a set it would hold).
    waiting: Option<String>,
    /// Rows of the output layer, the length of every mask.
    mask_len: usize,
    /// Every item still offered, when a catalogue delta retired some (`None`: none retired).
    offered: Option<Arc<ItemMask>>,
    cache: Mutex<HashMap<ItemFilter, Arc<ItemMask>>>,
}

impl FilterView {
    fn new(
        base: Arc<ItemSets>,
        live: Option<Arc<Availability>>,
        waiting: Option<String>,
        mask_len: usize,
        offered: Option<Arc<ItemMask>>,
    ) -> Self {
        FilterView {
            base,
            live,
            waiting,
            mask_len,
            offered,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The mask of a request without a filter: every item still offered when a catalogue delta
    /// retired some, else `None` (every item: no mask to read).
    pub fn unfiltered(&self) -> Option<Arc<ItemMask>> {
        self.offered.clone()
    }

    /// The version of the availability object this view filters by (`None`: none is in force).
    pub fn availability_version(&self) -> Option<u64> {
        self.live.as_ref().map(|a| a.version)
    }

    /// The availability object in force.
    pub fn availability(&self) -> Option<&Arc<Availability>> {
        self.live.as_ref()
    }

    /// Masks kept at most: the cache's memory over one mask's bytes, and at least 8.
    fn capacity(&self) -> usize {
        (CACHE_BYTES / self.mask_len.div_ceil(8).max(1)).max(8)
    }

    /// The set `column=value`: the availability object's when it has the column, else the
    /// engine's; an unknown name is refused naming it and every column there is.
    fn get(&self, name: &str) -> Result<&RoaringBitmap, String> {
        let column = name.split_once('=').map(|(c, _)| c);
        if let (Some(live), Some(column)) = (&self.live, column) {
            if live.sets.has_column(column) {
                return live.sets.get(name);
            }
        }
        match (column, &self.live) {
            (Some(column), _) if self.base.has_column(column) => self.base.get(name),
            (Some(column), Some(live)) => {
                let mut known: Vec<&str> = self.base.columns().chain(live.sets.columns()).collect();
                known.sort_unstable();
                known.dedup();
                Err(format!(
                    "unknown item set {name:?}: no attribute column {column:?} (columns: {}; \
                     availability version {})",
                    known.join(", "),
                    live.version
                ))
            }
            _ => self.base.get(name).map_err(|e| match &self.waiting {
                Some(why) => format!("{e} ({why})"),
                None => e,
            }),
        }
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
        let mut mask = resolve_with(
            self.base.n_items(),
            |name| self.get(name),
            &key,
            self.mask_len,
        )?;
        if let Some(offered) = &self.offered {
            mask.intersect(offered);
        }
        let mask = Arc::new(mask);
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

    /// `(column=value, items)` for every set requests may name, sorted by name (an availability
    /// column hides the engine's column of the same name).
    pub fn summary(&self) -> Vec<(String, u64)> {
        let mut all: Vec<(String, u64)> = match &self.live {
            None => self.base.summary(),
            Some(live) => self
                .base
                .summary()
                .into_iter()
                .filter(|(name, _)| {
                    let column = name.split_once('=').map_or("", |(c, _)| c);
                    !live.sets.has_column(column)
                })
                .chain(live.sets.summary())
                .collect(),
        };
        all.sort_unstable();
        all
    }
}

/// What [`Filters::replace_availability`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replaced {
    /// The object is in force now; `previous` was (`None`: none was).
    Swapped { previous: Option<u64> },
    /// The object in force is this very one (same version and digest): nothing changed.
    Unchanged,
}

/// The item sets of a model and the view batches filter by.
pub struct Filters {
    base: Arc<ItemSets>,
    mask_len: usize,
    /// Every item still offered, when some are retired ([`FilterView::unfiltered`]).
    offered: Option<Arc<ItemMask>>,
    current: RwLock<Arc<FilterView>>,
    /// Serialises replacements, so two updates racing cannot both pass the version check.
    replacing: Mutex<()>,
}

impl Filters {
    pub fn new(sets: ItemSets, mask_len: usize) -> Self {
        Filters::retiring(sets, mask_len, &[])
    }

    /// [`Filters::new`] with `retired` items (internal indices) out of every mask: a catalogue
    /// delta's retirements.
    pub fn retiring(sets: ItemSets, mask_len: usize, retired: &[u32]) -> Self {
        let base = Arc::new(sets);
        let offered = (!retired.is_empty()).then(|| {
            let mut offered = ItemMask::all(mask_len);
            // PAD is never an item.
            offered.remove(0);
            for &i in retired {
                offered.remove(i);
            }
            Arc::new(offered)
        });
        Filters {
            current: RwLock::new(Arc::new(FilterView::new(
                Arc::clone(&base),
                None,
                None,
                mask_len,
                offered.clone(),
            ))),
            base,
            mask_len,
            offered,
            replacing: Mutex::new(()),
        }
    }

    /// The engine's own item sets (from `recsys convert --item-attributes`).
    pub fn sets(&self) -> &ItemSets {
        &self.base
    }

    /// What a batch filters by now; kept by the caller to its batch's end.
    pub fn view(&self) -> Arc<FilterView> {
        Arc::clone(&self.current.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// The items `filter` keeps under the current view ([`FilterView::resolve`]).
    pub fn resolve(&self, filter: &ItemFilter) -> Result<Arc<ItemMask>, String> {
        self.view().resolve(filter)
    }

    /// Masks the current view has cached.
    pub fn cached(&self) -> usize {
        self.view().cached()
    }

    /// The version of the availability object in force.
    pub fn availability_version(&self) -> Option<u64> {
        self.view().availability_version()
    }

    fn swap(&self, view: FilterView) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(view);
    }

    /// Puts `availability` in force for every batch that starts from now on. Refused (nothing
    /// changes) when its sets are not over this catalogue, or its version is not newer than the
    /// one in force, unless it is that very object.
    pub fn replace_availability(&self, availability: Availability) -> Result<Replaced, String> {
        let _one_at_a_time = self.replacing.lock().unwrap_or_else(|p| p.into_inner());
        if availability.sets.n_items() != self.base.n_items() {
            return Err(format!(
                "the availability sets index {} items, the catalogue has {}",
                availability.sets.n_items(),
                self.base.n_items()
            ));
        }
        let previous = self.view().live.clone();
        if let Some(current) = &previous {
            if current.version == availability.version && current.sha256 == availability.sha256 {
                return Ok(Replaced::Unchanged);
            }
            if availability.version <= current.version {
                return Err(format!(
                    "availability version {} is not newer than version {} in force (kept)",
                    availability.version, current.version
                ));
            }
        }
        self.swap(FilterView::new(
            Arc::clone(&self.base),
            Some(Arc::new(availability)),
            None,
            self.mask_len,
            self.offered.clone(),
        ));
        Ok(Replaced::Swapped {
            previous: previous.map(|a| a.version),
        })
    }

    /// Notes why the configured availability source is not in force yet (requests naming one of
    /// its sets are then told); ignored once an object is in force.
    pub fn note_availability_waiting(&self, why: String) {
        let _one_at_a_time = self.replacing.lock().unwrap_or_else(|p| p.into_inner());
        if self.view().live.is_some() {
            return;
        }
        self.swap(FilterView::new(
            Arc::clone(&self.base),
            None,
            Some(why),
            self.mask_len,
            self.offered.clone(),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::availability::AvailabilityFile;
    use crate::idmap::IdMap;
    use crate::item_sets::AttributeTable;

    fn catalogue() -> IdMap {
        IdMap::from_string_ids(["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect())
            .unwrap()
    }

    fn table(columns: &[&str], rows: &[(&str, &[&str])]) -> AttributeTable {
        AttributeTable {
            columns: columns.iter().map(|s| s.to_string()).collect(),
            rows: rows
                .iter()
                .map(|(id, values)| {
                    (
                        id.to_string(),
                        values.iter().map(|v| vec![v.to_string()]).collect(),
                    )
                })
                .collect(),
        }
    }

    fn live(version: u64, rows: &[(&str, &[&str])]) -> Availability {
        AvailabilityFile::from_table(&table(&["stock", "category"], rows), version, 0)
            .unwrap()
            .map(&catalogue())
    }

    fn kept(filters: &Filters, include: &[&str], exclude: &[&str]) -> Result<Vec<u32>, String> {
        let filter = ItemFilter {
            include: include.iter().map(|s| s.to_string()).collect(),
            exclude: exclude.iter().map(|s| s.to_string()).collect(),
        };
        Ok(filters.resolve(&filter)?.indices().collect())
    }

    fn engine_filters() -> Filters {
        let attributes = table(
            &["category", "brand"],
            &[
                ("a", &["shoes", "x"]),
                ("b", &["hats", "x"]),
                ("c", &["shoes", "y"]),
            ],
        );
        let (sets, _) = ItemSets::from_table(&attributes, &catalogue()).unwrap();
        Filters::new(sets, 8)
    }

    #[test]
    fn availability_overlays_the_engine_sets_and_replaces_only_forward() {
        let filters = engine_filters();
        filters.note_availability_waiting("the source has not been read yet".into());
        let err = kept(&filters, &[], &["stock=out"]).unwrap_err();
        assert!(err.contains("not been read yet"), "{err}");
        assert_eq!(
            kept(&filters, &["category=shoes"], &[]).unwrap(),
            vec![1, 3]
        );

        let v1 = live(
            1,
            &[
                ("a", &["in", "shoes"]),
                ("b", &["out", "shoes"]),
                ("c", &["in", "hats"]),
            ],
        );
        let before = filters.view();
        assert_eq!(
            filters.replace_availability(v1.clone()).unwrap(),
            Replaced::Swapped { previous: None }
        );
        // A batch keeps the view it took; new batches see the object.
        assert_eq!(before.availability_version(), None);
        assert_eq!(filters.availability_version(), Some(1));
        assert_eq!(kept(&filters, &["stock=in"], &[]).unwrap(), vec![1, 3]);
        // The object's column `category` hides the engine's; `brand` is still the engine's.
        assert_eq!(
            kept(&filters, &["category=shoes"], &[]).unwrap(),
            vec![1, 2]
        );
        assert_eq!(
            kept(&filters, &["brand=x"], &["stock=out"]).unwrap(),
            vec![1]
        );
        let err = kept(&filters, &["colour=red"], &[]).unwrap_err();
        assert!(err.contains("brand, category, stock"), "{err}");
        let names: Vec<String> = filters
            .view()
            .summary()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(
            names,
            [
                "brand=x",
                "brand=y",
                "category=hats",
                "category=shoes",
                "stock=in",
                "stock=out"
            ]
        );

        assert_eq!(
            filters.replace_availability(v1).unwrap(),
            Replaced::Unchanged
        );
        let older = live(1, &[("a", &["out", "shoes"])]);
        assert!(filters
            .replace_availability(older)
            .unwrap_err()
            .contains("not newer"));
        assert_eq!(kept(&filters, &["stock=in"], &[]).unwrap(), vec![1, 3]);
        let v3 = live(3, &[("d", &["in", "hats"])]);
        assert_eq!(
            filters.replace_availability(v3).unwrap(),
            Replaced::Swapped { previous: Some(1) }
        );
        assert_eq!(kept(&filters, &["stock=in"], &[]).unwrap(), vec![4]);
        // Waiting notes no longer apply once an object is in force.
        filters.note_availability_waiting("unreachable".into());
        assert_eq!(filters.availability_version(), Some(3));
    }

    #[test]
    fn a_value_the_live_object_lacks_is_an_empty_set_and_a_column_nobody_has_is_refused() {
        // Every item in stock: the feed has no `stock=out`, and requests that exclude it (the
        // usual request) or include it must still be answered.
        let filters = engine_filters();
        let all_in = live(
            1,
            &[
                ("a", &["in", "shoes"]),
                ("b", &["in", "hats"]),
                ("c", &["in", "shoes"]),
                ("d", &["in", "hats"]),
            ],
        );
        filters.replace_availability(all_in).unwrap();
        assert_eq!(
            kept(&filters, &[], &["stock=out"]).unwrap(),
            vec![1, 2, 3, 4]
        );
        assert_eq!(
            kept(&filters, &["category=shoes"], &["stock=out"]).unwrap(),
            vec![1, 3]
        );
        assert_eq!(
            kept(&filters, &["stock=out"], &[]).unwrap(),
            Vec::<u32>::new()
        );
        // The engine's own columns behave alike.
        assert_eq!(
            kept(&filters, &["brand=z"], &[]).unwrap(),
            Vec::<u32>::new()
        );
        assert_eq!(kept(&filters, &[], &["brand=z"]).unwrap(), vec![1, 2, 3, 4]);
        for nowhere in ["colour=red", "stock"] {
            let err = kept(&filters, &[], &[nowhere]).unwrap_err();
            assert!(err.contains(nowhere), "{err}");
        }
    }

    #[test]
    fn sets_of_another_catalogue_are_refused() {
        let filters = engine_filters();
        let other = IdMap::from_string_ids(vec!["a".into()]).unwrap();
        let wrong = AvailabilityFile::from_table(&table(&["stock"], &[("a", &["in"])]), 1, 0)
            .unwrap()
            .map(&other);
        assert!(filters.replace_availability(wrong).is_err());
        assert_eq!(filters.availability_version(), None);
    }
}
