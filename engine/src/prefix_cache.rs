//! The prefix cache: a causal model's state after a history, kept so that the next call with the
//! same history one event longer computes only the new event.
//!
//! Real-time recommenders are called on every click with the user's whole history, each time one
//! event longer. For a causal model (GRU4Rec: the GRU's states after the last item) everything
//! but the new events is what the previous call computed. The cache is content-addressed: an
//! entry is found by a hash of the exact item sequence it covers and accepted only if its items
//! are that sequence, so a hash collision can cost time but never change an answer, and a lost
//! entry (evicted, expired, another replica) only costs the recomputation. A request still
//! carries its whole history.
//!
//! Bounded: a byte budget (entries' items and states), least recently used entries evicted first
//! and entries idle for longer than the expiry dropped, so it never grows past the budget under
//! any load. Shared: one cache per engine, so a model's instances in one process share it.
//!
//! A state is kept as runs of floats read in order ([`State`]): a model whose state grows by
//! appending (SASRec's keys and values, a row per event) stores a longer history's state as the
//! shorter one's runs plus one new run, so a session that grows by one event costs that event's
//! bytes, not a copy of everything before it.
//!
//! A key is a sequence of `u32` tokens laid out by the model ([`KeyLayout`]): the items for the
//! models whose states depend on the items alone, the items with their timestamps for HSTU (a
//! row's keys and values read the time of the event after it).

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes an entry costs beyond its items and state (map and order bookkeeping, allocation).
const ENTRY_OVERHEAD: usize = 96;
/// Bytes a run of a state costs beyond its floats (its pointer, length and shared counts).
const RUN_OVERHEAD: usize = 32;
/// Runs a state may have before appending merges them into one: bounds the work of reading a
/// state and of copying its list, at the cost of copying the whole state once every so many
/// appends.
const MAX_RUNS: usize = 32;

/// A cached state: runs of floats read in order as one sequence, shared between states (cloning
/// one copies its list of runs, not its floats).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct State {
    runs: Vec<Arc<[f32]>>,
    len: usize,
}

impl State {
    /// A state of one run holding `values`.
    pub fn from_slice(values: &[f32]) -> State {
        State {
            runs: vec![values.into()],
            len: values.len(),
        }
    }

    /// This state followed by `more`: the runs shared, `more` a new run (all merged into one run
    /// when there would be more than [`MAX_RUNS`]).
    pub fn appended(&self, more: &[f32]) -> State {
        if self.runs.len() + 1 > MAX_RUNS {
            let mut all = Vec::with_capacity(self.len + more.len());
            for run in &self.runs {
                all.extend_from_slice(run);
            }
            all.extend_from_slice(more);
            return State::from_slice(&all);
        }
        let mut runs = self.runs.clone();
        if !more.is_empty() {
            runs.push(more.into());
        }
        State {
            runs,
            len: self.len + more.len(),
        }
    }

    /// The runs, in order.
    pub fn runs(&self) -> &[Arc<[f32]>] {
        &self.runs
    }

    /// Floats in all runs.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The floats, in one piece: borrowed when the state is one run.
    pub fn contiguous(&self) -> std::borrow::Cow<'_, [f32]> {
        match self.runs.as_slice() {
            [] => std::borrow::Cow::Borrowed(&[]),
            [one] => std::borrow::Cow::Borrowed(one),
            runs => std::borrow::Cow::Owned(runs.iter().flat_map(|r| r.iter().copied()).collect()),
        }
    }

    fn bytes(&self) -> usize {
        4 * self.len + RUN_OVERHEAD * self.runs.len()
    }
}

/// How a model's histories key the cache, and how many of a history's rows a key covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyLayout {
    /// The items, one token each: a key of `m` tokens covers `m` rows (GRU4Rec, SASRec).
    Items,
    /// Per event its timestamp's low and high halves, then its item. The state of the first `m`
    /// rows depends on their items and on the times of events `0..=m` (row `i`'s bias reads
    /// `t_{i+1}`), so it is keyed by the first `3m + 2` tokens (HSTU).
    TimedItems,
}

impl KeyLayout {
    /// The key of a whole history (`times`: one per item, read by [`KeyLayout::TimedItems`]).
    /// The items' own key is the items themselves, borrowed (the GRU4Rec and SASRec hot path
    /// copies nothing).
    pub fn key<'a>(self, items: &'a [u32], times: &[i64]) -> std::borrow::Cow<'a, [u32]> {
        match self {
            KeyLayout::Items => std::borrow::Cow::Borrowed(items),
            KeyLayout::TimedItems => {
                assert_eq!(items.len(), times.len(), "one timestamp per item");
                items
                    .iter()
                    .zip(times)
                    .flat_map(|(&item, &t)| {
                        let bits = t as u64;
                        [bits as u32, (bits >> 32) as u32, item]
                    })
                    .collect::<Vec<u32>>()
                    .into()
            }
        }
    }

    /// The rows a key prefix of `len` tokens covers, `None` when no state is keyed by that many.
    pub fn rows_of(self, len: usize) -> Option<usize> {
        match self {
            KeyLayout::Items => Some(len),
            KeyLayout::TimedItems => (len % 3 == 2).then_some(len / 3),
        }
    }

    /// The tokens of the key of a state covering `rows` rows (0 for none).
    pub fn len_of(self, rows: usize) -> usize {
        match (self, rows) {
            (_, 0) => 0,
            (KeyLayout::Items, rows) => rows,
            (KeyLayout::TimedItems, rows) => 3 * rows + 2,
        }
    }

    /// The items a key names.
    pub fn items(self, key: &[u32]) -> impl Iterator<Item = u32> + '_ {
        let (skip, step) = match self {
            KeyLayout::Items => (0, 1),
            KeyLayout::TimedItems => (2, 3),
        };
        key.iter().skip(skip).step_by(step).copied()
    }
}

/// The hash of every prefix of `items`: `out[i]` covers `items[..i]`, so `out.len() == items.len() + 1`.
pub fn prefix_hashes(items: &[u32]) -> Vec<u64> {
    let mut out = Vec::with_capacity(items.len() + 1);
    // A 64-bit mix per item (splitmix64's finaliser over the running value and the item): cheap,
    // and equal only by chance for different sequences; entries are verified item by item anyway.
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    out.push(h);
    for &item in items {
        let mut z = h ^ (u64::from(item).wrapping_add(0x632b_e59b_d9b4_e019));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h = z ^ (z >> 31);
        out.push(h);
    }
    out
}

/// The map's keys are already hashes: used as they are.
#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

struct Entry {
    items: Box<[u32]>,
    state: State,
    /// Position in the recency order (larger: used more recently).
    tick: u64,
    used: Instant,
}

impl Entry {
    fn bytes(&self) -> usize {
        4 * self.items.len() + self.state.bytes() + ENTRY_OVERHEAD
    }
}

#[derive(Default)]
struct Inner {
    entries: HashMap<u64, Entry, BuildHasherDefault<IdentityHasher>>,
    /// Tick -> key, oldest first: the eviction order.
    recency: BTreeMap<u64, u64>,
    next_tick: u64,
    bytes: usize,
}

impl Inner {
    fn touch(&mut self, key: u64) {
        let tick = self.next_tick;
        self.next_tick += 1;
        if let Some(entry) = self.entries.get_mut(&key) {
            self.recency.remove(&entry.tick);
            entry.tick = tick;
            entry.used = Instant::now();
            self.recency.insert(tick, key);
        }
    }

    /// Keeps `entry` under `key` as the most recently used. Its tick is its own from the start:
    /// an entry never takes over another's place in the recency order.
    fn add(&mut self, key: u64, mut entry: Entry) {
        entry.tick = self.next_tick;
        self.next_tick += 1;
        self.bytes += entry.bytes();
        self.recency.insert(entry.tick, key);
        self.entries.insert(key, entry);
    }

    fn remove(&mut self, key: u64) -> bool {
        match self.entries.remove(&key) {
            Some(entry) => {
                self.recency.remove(&entry.tick);
                self.bytes -= entry.bytes();
                true
            }
            None => false,
        }
    }

    /// The least recently used entry's key and when it was used.
    fn oldest(&self) -> Option<(u64, Instant)> {
        let (_, &key) = self.recency.iter().next()?;
        Some((key, self.entries[&key].used))
    }
}

/// Counters of what the cache did, since the engine loaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Histories that found a cached prefix, and those that found none.
    pub hits: u64,
    pub misses: u64,
    /// Events (items) computed, and events whose work a cached prefix saved.
    pub events_computed: u64,
    pub events_reused: u64,
    /// Entries dropped for the budget, and for having been idle past the expiry.
    pub evictions: u64,
    pub expirations: u64,
    /// Bytes and entries held now.
    pub bytes: u64,
    pub entries: u64,
}

/// A model's states after histories, by history (see the module documentation).
pub struct PrefixCache {
    inner: Mutex<Inner>,
    budget: usize,
    idle: Option<Duration>,
    hits: AtomicU64,
    misses: AtomicU64,
    events_computed: AtomicU64,
    events_reused: AtomicU64,
    evictions: AtomicU64,
    expirations: AtomicU64,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PrefixCache({:?})", self.stats())
    }
}

impl PrefixCache {
    /// A cache holding at most `budget` bytes, dropping entries unused for `idle` (`None`: kept
    /// until the budget needs their room).
    pub fn new(budget: usize, idle: Option<Duration>) -> Self {
        PrefixCache {
            inner: Mutex::new(Inner::default()),
            budget,
            idle,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            events_computed: AtomicU64::new(0),
            events_reused: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            expirations: AtomicU64::new(0),
        }
    }

    /// A cache for the same model over a changed catalogue: the same budget, expiry and counters,
    /// holding every entry none of whose items (its key read by `layout`) `changed` (a history's
    /// state depends on its items' input rows, and HSTU's on their times too, which a catalogue
    /// does not change), in the same recency order: what a catalogue swap keeps of the cache.
    pub fn carried(&self, layout: KeyLayout, changed: impl Fn(u32) -> bool) -> PrefixCache {
        let cache = PrefixCache::new(self.budget, self.idle);
        for (to, from) in [
            (&cache.hits, &self.hits),
            (&cache.misses, &self.misses),
            (&cache.events_computed, &self.events_computed),
            (&cache.events_reused, &self.events_reused),
            (&cache.evictions, &self.evictions),
            (&cache.expirations, &self.expirations),
        ] {
            to.store(from.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        {
            let inner = self.lock();
            let mut kept = cache.lock();
            for key in inner.recency.values() {
                let entry = &inner.entries[key];
                if layout.items(&entry.items).any(&changed) {
                    continue;
                }
                kept.add(
                    *key,
                    Entry {
                        items: entry.items.clone(),
                        state: entry.state.clone(),
                        tick: 0,
                        used: entry.used,
                    },
                );
            }
        }
        cache
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The longest prefix of `items` the cache holds (`items` itself included): how many of its
    /// items the state covers, and the state; `None` when no prefix is cached.
    pub fn longest_prefix(&self, items: &[u32]) -> Option<(usize, State)> {
        self.longest_prefix_in(KeyLayout::Items, items)
    }

    /// The longest prefix of the key `key` (laid out by `layout`) that keys a state the cache
    /// holds: how many rows the state covers, and the state; `None` when none is cached.
    pub fn longest_prefix_in(&self, layout: KeyLayout, key: &[u32]) -> Option<(usize, State)> {
        let hashes = prefix_hashes(key);
        let mut inner = self.lock();
        let found = (1..=key.len()).rev().find_map(|len| {
            let rows = layout.rows_of(len)?;
            let entry = inner.entries.get(&hashes[len])?;
            // Verified token by token: a colliding hash is a miss, never another history's state.
            (*entry.items == key[..len]).then(|| (rows, hashes[len], entry.state.clone()))
        });
        match found {
            Some((rows, hash, state)) => {
                inner.touch(hash);
                drop(inner);
                self.hits.fetch_add(1, Ordering::Relaxed);
                self.events_reused.fetch_add(rows as u64, Ordering::Relaxed);
                Some((rows, state))
            }
            None => {
                drop(inner);
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Counts `events` computed for one history (the items after its cached prefix).
    pub fn computed(&self, events: usize) {
        self.events_computed
            .fetch_add(events as u64, Ordering::Relaxed);
    }

    /// Keeps `state` as the state after `items` in place of the entry of its first `replaced`
    /// items (the prefix it was computed from: a session grows, so the shorter state would only
    /// be asked for again by a history that went back on its last events).
    pub fn extend(&self, items: &[u32], state: State, replaced: usize) {
        if replaced > 0 && replaced < items.len() {
            let key = prefix_hashes(&items[..replaced])[replaced];
            let mut inner = self.lock();
            if inner
                .entries
                .get(&key)
                .is_some_and(|e| *e.items == items[..replaced])
            {
                inner.remove(key);
            }
        }
        self.insert(items, state);
    }

    /// Keeps `state` as the state after `items`, evicting the least recently used entries (and
    /// any idle past the expiry) to stay within the budget. An entry larger than the whole
    /// budget is not kept.
    pub fn insert(&self, items: &[u32], state: State) {
        let key = *prefix_hashes(items).last().expect("one hash per prefix");
        let entry = Entry {
            items: items.into(),
            state,
            tick: 0,
            used: Instant::now(),
        };
        let size = entry.bytes();
        if size > self.budget {
            return;
        }
        let mut inner = self.lock();
        inner.remove(key);
        if let Some(idle) = self.idle {
            let now = Instant::now();
            while let Some((oldest, used)) = inner.oldest() {
                if now.duration_since(used) <= idle {
                    break;
                }
                inner.remove(oldest);
                self.expirations.fetch_add(1, Ordering::Relaxed);
            }
        }
        while inner.bytes + size > self.budget {
            let Some((oldest, _)) = inner.oldest() else {
                break;
            };
            inner.remove(oldest);
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
        inner.add(key, entry);
    }

    /// What the cache did so far, and what it holds.
    pub fn stats(&self) -> PrefixCacheStats {
        let (bytes, entries) = {
            let inner = self.lock();
            (inner.bytes as u64, inner.entries.len() as u64)
        };
        PrefixCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            events_computed: self.events_computed.load(Ordering::Relaxed),
            events_reused: self.events_reused.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            expirations: self.expirations.load(Ordering::Relaxed),
            bytes,
            entries,
        }
    }

    /// The byte budget.
    pub fn budget(&self) -> usize {
        self.budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_cached_prefix_is_found_and_verified() {
        let cache = PrefixCache::new(1 << 20, None);
        assert!(cache.longest_prefix(&[1, 2, 3]).is_none());
        cache.insert(&[1, 2], State::from_slice(&[0.5, 0.25]));
        cache.insert(&[1, 2, 3, 4], State::from_slice(&[1.0, 2.0]));
        let (len, state) = cache.longest_prefix(&[1, 2, 3, 4, 5]).unwrap();
        assert_eq!((len, &*state.contiguous()), (4, &[1.0f32, 2.0][..]));
        let (len, _) = cache.longest_prefix(&[1, 2, 3, 9]).unwrap();
        assert_eq!(len, 2);
        let (len, _) = cache.longest_prefix(&[1, 2]).unwrap();
        assert_eq!(len, 2);
        assert!(cache.longest_prefix(&[2, 1]).is_none());
        let stats = cache.stats();
        assert_eq!((stats.hits, stats.misses, stats.events_reused), (3, 2, 8));
        assert_eq!(stats.entries, 2);
    }

    #[test]
    fn a_growing_session_keeps_one_entry() {
        let cache = PrefixCache::new(1 << 20, None);
        cache.insert(&[1], State::from_slice(&[1.0]));
        for t in 2..=50u32 {
            let items: Vec<u32> = (1..=t).collect();
            let (done, state) = cache.longest_prefix(&items).unwrap();
            assert_eq!(done, t as usize - 1);
            // Replaced (a GRU's state) for the first half, appended to (SASRec's) after.
            let state = if t <= 25 {
                State::from_slice(&[t as f32])
            } else {
                state.appended(&[t as f32])
            };
            cache.extend(&items, state, done);
        }
        let stats = cache.stats();
        assert_eq!(stats.entries, 1);
        let (_, state) = cache
            .longest_prefix(&(1..=50).collect::<Vec<u32>>())
            .unwrap();
        let want: Vec<f32> = (25..=50).map(|t| t as f32).collect();
        assert_eq!(&*state.contiguous(), &want[..]);
        assert_eq!(
            stats.bytes as usize,
            4 * 50 + state.bytes() + ENTRY_OVERHEAD,
            "one entry, its runs counted"
        );
    }

    #[test]
    fn a_colliding_hash_is_a_miss() {
        let cache = PrefixCache::new(1 << 20, None);
        cache.insert(&[7, 8], State::from_slice(&[1.0]));
        // Plant the entry under the key of another sequence: it must not be taken for it.
        {
            let mut inner = cache.lock();
            let key = prefix_hashes(&[7, 8])[2];
            let entry = inner.entries.remove(&key).unwrap();
            let other = prefix_hashes(&[9, 9])[2];
            inner.recency.insert(entry.tick, other);
            inner.entries.insert(other, entry);
        }
        assert!(cache.longest_prefix(&[9, 9]).is_none());
    }

    #[test]
    fn the_budget_evicts_the_least_recently_used_and_is_never_exceeded() {
        let one = 4 * 3 + 4 * 4 + RUN_OVERHEAD + ENTRY_OVERHEAD;
        let cache = PrefixCache::new(3 * one, None);
        for user in 0..3u32 {
            cache.insert(&[user, 1, 2], State::from_slice(&[user as f32; 4]));
        }
        // User 0 is used again: user 1 is now the oldest.
        assert!(cache.longest_prefix(&[0, 1, 2, 3]).is_some());
        cache.insert(&[3, 1, 2], State::from_slice(&[3.0; 4]));
        assert!(cache.longest_prefix(&[1, 1, 2]).is_none());
        assert!(cache.longest_prefix(&[0, 1, 2]).is_some());
        let stats = cache.stats();
        assert_eq!((stats.evictions, stats.entries), (1, 3));
        assert!(stats.bytes as usize <= cache.budget());
        for user in 0..1000u32 {
            cache.insert(&[user, user + 1, 5], State::from_slice(&[0.0; 4]));
            assert!(cache.stats().bytes as usize <= cache.budget());
        }
        // An entry larger than the budget is not kept.
        cache.insert(&[1; 100], State::from_slice(&[0.0; 4]));
        assert!(cache.longest_prefix(&[1; 100]).is_none());
    }

    #[test]
    fn the_first_entry_is_evicted_like_any_other_and_the_budget_holds() {
        let one = 4 * 3 + 4 * 4 + RUN_OVERHEAD + ENTRY_OVERHEAD;
        let cache = PrefixCache::new(2 * one, None);
        for user in 0..3u32 {
            cache.insert(&[user, 1, 2], State::from_slice(&[user as f32; 4]));
        }
        // Nothing was used again: the first entry is the least recently used and goes first.
        let stats = cache.stats();
        assert_eq!((stats.evictions, stats.entries), (1, 2));
        assert!(cache.longest_prefix(&[0, 1, 2]).is_none());
        assert!(cache.longest_prefix(&[1, 1, 2]).is_some());
        assert!(cache.longest_prefix(&[2, 1, 2]).is_some());

        // An entry that needs the room of both evicts both, the first one included.
        let cache = PrefixCache::new(2 * one, None);
        cache.insert(&[0, 1, 2], State::from_slice(&[0.0; 4]));
        cache.insert(&[1, 1, 2], State::from_slice(&[1.0; 4]));
        cache.insert(&[9, 9, 9], State::from_slice(&[9.0; 12]));
        let stats = cache.stats();
        assert_eq!((stats.evictions, stats.entries), (2, 1));
        assert!(stats.bytes as usize <= cache.budget(), "{stats:?}");
        assert!(cache.longest_prefix(&[9, 9, 9]).is_some());
    }

    #[test]
    fn appended_states_share_their_runs_and_merge_past_the_limit() {
        let mut state = State::from_slice(&[0.0, 1.0]);
        let first = Arc::clone(&state.runs()[0]);
        for i in 1..MAX_RUNS {
            state = state.appended(&[2.0 * i as f32, 2.0 * i as f32 + 1.0]);
        }
        assert_eq!(state.runs().len(), MAX_RUNS);
        assert!(
            Arc::ptr_eq(&first, &state.runs()[0]),
            "the first run is shared, not copied"
        );
        state = state.appended(&[64.0, 65.0]);
        assert_eq!(state.runs().len(), 1);
        let want: Vec<f32> = (0..66).map(|v| v as f32).collect();
        assert_eq!((state.len(), &*state.contiguous()), (66, &want[..]));
        assert_eq!(state.appended(&[]).runs().len(), 1);
    }

    #[test]
    fn idle_entries_expire() {
        let cache = PrefixCache::new(1 << 20, Some(Duration::from_millis(30)));
        cache.insert(&[1, 2], State::from_slice(&[1.0]));
        std::thread::sleep(Duration::from_millis(60));
        cache.insert(&[3, 4], State::from_slice(&[1.0]));
        assert!(cache.longest_prefix(&[1, 2]).is_none());
        assert!(cache.longest_prefix(&[3, 4]).is_some());
        assert_eq!(cache.stats().expirations, 1);
    }
}
