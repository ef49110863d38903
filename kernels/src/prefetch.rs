//! How far ahead the micro-kernels request the panels they will read next, if at all.
//!
//! A scan reads 8 panels side by side per call, so the hardware sees 8 short interleaved streams
//! (512 bytes to a few KB each at d = 64), too short for its prefetchers to ramp up when the table
//! comes from memory: the int8 and fp16 kernels, with more instructions per byte than the fp32 one,
//! then ran at about half the read bandwidth. Requesting the panels of the calls ahead fixes that.
//! A table that fits in the last-level cache is served from there between batches instead, and
//! the extra requests only take load slots (a 2,000 x 600 fp32 output layer scanned 5x slower
//! with them), so such tables get none.

use std::sync::OnceLock;

/// How far ahead (bytes) the panels are requested: far enough to cover memory latency at the
/// read bandwidth, close enough that the requested lines are still in L2 when read.
const DISTANCE_BYTES: usize = 64 * 1024;

/// Used when the cache size cannot be read (not Linux, or no sysfs): the last-level cache of
/// the machines the kernels are measured on.
const DEFAULT_LAST_LEVEL_CACHE_BYTES: usize = 8 << 20;

/// The largest cache of CPU 0 (Linux sysfs), read once.
pub fn last_level_cache_bytes() -> usize {
    static BYTES: OnceLock<usize> = OnceLock::new();
    *BYTES.get_or_init(|| read_last_level_cache().unwrap_or(DEFAULT_LAST_LEVEL_CACHE_BYTES))
}

fn read_last_level_cache() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|entry| {
        let size = std::fs::read_to_string(entry.ok()?.path().join("size")).ok()?;
        parse_cache_size(&size)
    })
    .max()
}

/// "8192K" / "32M" / "512" (bytes) as sysfs writes them.
fn parse_cache_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, unit) = match text.as_bytes().last()? {
        b'K' => (&text[..text.len() - 1], 1 << 10),
        b'M' => (&text[..text.len() - 1], 1 << 20),
        b'G' => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits.parse::<usize>().ok()?.checked_mul(unit)
}

/// The distance, in bytes past the start of a call's panels, at which that call requests the
/// panels of the calls ahead; 0 for none. `table_bytes`: the whole table the scan reads;
/// `call_bytes`: the panels one call reads. Whole calls ahead, so a call requests exactly the
/// panels of a later call.
pub fn distance(table_bytes: usize, call_bytes: usize) -> usize {
    distance_for_cache(table_bytes, call_bytes, last_level_cache_bytes())
}

fn distance_for_cache(table_bytes: usize, call_bytes: usize, cache_bytes: usize) -> usize {
    // Three quarters: the cache also holds the activations, the other layers and other threads'
    // data, so a table near its size does not stay in it.
    if call_bytes == 0 || table_bytes <= cache_bytes / 4 * 3 {
        return 0;
    }
    DISTANCE_BYTES.div_ceil(call_bytes) * call_bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_sizes_parse() {
        assert_eq!(parse_cache_size("8192K\n"), Some(8 << 20));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("big"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn tables_in_cache_get_no_prefetch_and_larger_ones_whole_calls_ahead() {
        let cache = 8 << 20;
        assert_eq!(distance_for_cache(4_800_000, 153_600, cache), 0);
        // int8, d = 64, 8 panels a call: 4 KiB; 16 calls make the 64 KiB distance.
        assert_eq!(distance_for_cache(64_000_000, 4096, cache), 64 * 1024);
        // fp32, d = 600, 8 panels a call: one call ahead is already farther than the distance.
        assert_eq!(distance_for_cache(240_000_000, 153_600, cache), 153_600);
        assert_eq!(
            distance_for_cache(64_000_000, 3000, cache) % 3000,
            0,
            "whole calls"
        );
        assert_eq!(distance_for_cache(64_000_000, 0, cache), 0);
    }
}
