//! Per-event latency of growing sessions: groups of `batch` users whose histories come back one
//! event longer on every call (the whole history each time, as a real-time recommender is called),
//! with the engine's prefix cache on or off, for `scripts/bench_sessions.py`.
//!
//! session_probe ENGINE HISTORIES_JSON batch k threads cache(on|off) groups LENGTHS [encode]
//!
//! HISTORIES_JSON: a list of histories (lists of external int ids), replayed `batch` at a time
//! (`groups` groups). LENGTHS: comma-separated event counts to report (e.g. 10,50,100,200).
//! Prints JSON: per length, the median seconds of the call that brought every history of a group
//! to that length (encode + fused score + top-k of the batch; with `encode`, the encoder alone:
//! the part of a call the cache can shorten), and the cache's counters and bytes per cached user.
//! A model that reads time (HSTU) gets event `p` of every history at `T0 + 3600 p` seconds and
//! each call's query time at the next event's (the cost does not depend on the values).
#![forbid(unsafe_code)]

use std::time::Instant;

use recsys_engine::models::EventTimes;
use recsys_engine::prefix_cache::PrefixCache;
use recsys_engine::{Engine, ExternalIds, InternalRequest};

/// The first event's time of every replayed history (2020-09-13, any would do).
const T0: i64 = 1_600_000_000;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 9 && !(args.len() == 10 && args[9] == "encode") {
        eprintln!(
            "usage: session_probe ENGINE HISTORIES_JSON batch k threads cache(on|off) groups \
             LENGTHS [encode]"
        );
        std::process::exit(2);
    }
    let encoder_only = args.len() == 10;
    let mut engine = Engine::load(std::path::Path::new(&args[1])).unwrap_or_else(|e| panic!("{e}"));
    let histories: Vec<Vec<i64>> =
        serde_json::from_str(&std::fs::read_to_string(&args[2]).expect("read histories"))
            .expect("histories JSON");
    let batch: usize = args[3].parse().expect("batch");
    let k: usize = args[4].parse().expect("k");
    engine.set_threads(args[5].parse().expect("threads"));
    let cached = match args[6].as_str() {
        "on" => true,
        "off" => false,
        other => panic!("cache must be on or off, not {other}"),
    };
    if cached {
        engine
            .set_prefix_cache(Some(PrefixCache::new(1 << 30, None)))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let groups: usize = args[7].parse().expect("groups");
    let lengths: Vec<usize> = args[8]
        .split(',')
        .map(|x| x.parse().expect("length"))
        .collect();
    let longest = *lengths.iter().max().expect("a length");
    let mapped: Vec<Vec<u32>> = histories
        .iter()
        .map(|h| engine.ids.map(ExternalIds::Int(h)).indices)
        .filter(|h| h.len() >= longest)
        .collect();
    assert!(
        mapped.len() >= batch * groups,
        "{} histories of at least {longest} known items; {} needed",
        mapped.len(),
        batch * groups
    );
    let timed = engine.kind().reads_timestamps();
    let clock: Vec<i64> = (0..=longest as i64).map(|p| T0 + 3600 * p).collect();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); lengths.len()];
    for g in 0..groups {
        let users = &mapped[g * batch..(g + 1) * batch];
        for t in 1..=longest {
            let requests: Vec<InternalRequest> = users
                .iter()
                .map(|h| InternalRequest {
                    history: h[..t].to_vec(),
                    k,
                    exclude_seen: true,
                    timestamps: if timed {
                        clock[..t].to_vec()
                    } else {
                        Vec::new()
                    },
                    query_timestamp: if timed { clock[t] } else { 0 },
                    ..Default::default()
                })
                .collect();
            let start = Instant::now();
            if encoder_only {
                let histories: Vec<&[u32]> = requests.iter().map(|r| &r.history[..]).collect();
                let event_times: Vec<EventTimes<'_>> = if timed {
                    (0..histories.len())
                        .map(|_| EventTimes {
                            events: &clock[..t],
                            query: clock[t],
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                let (hidden, _) = engine.encode_timed(&histories, &event_times);
                assert!(!hidden.is_empty());
            } else {
                let answers = engine.recommend_internal(&requests);
                assert_eq!(answers.len(), batch);
            }
            let elapsed = start.elapsed().as_secs_f64();
            if let Some(i) = lengths.iter().position(|&l| l == t) {
                times[i].push(elapsed);
            }
        }
    }
    let stats = engine.prefix_cache().map(PrefixCache::stats);
    let out = serde_json::json!({
        "batch": batch,
        "cache": cached,
        "encoder_only": encoder_only,
        "isa": engine.scorer.kernels.isa.name(),
        "threads": engine.scorer.threads,
        "per_event": lengths.iter().zip(&times).map(|(l, t)| serde_json::json!({
            "length": l,
            "median_s": median(t.clone()),
        })).collect::<Vec<_>>(),
        "cache_stats": stats.map(|s| serde_json::json!({
            "hits": s.hits,
            "misses": s.misses,
            "events_computed": s.events_computed,
            "events_reused": s.events_reused,
            "bytes": s.bytes,
            "entries": s.entries,
            "bytes_per_entry": s.bytes.checked_div(s.entries).unwrap_or(0),
        })),
    });
    println!("{out}");
}
