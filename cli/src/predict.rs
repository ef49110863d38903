//! `recsys predict`: offline batch scoring of JSON lines, streamed in batches so memory does not
//! grow with the file, with output lines in input order.

use crate::output::tell;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::time::Instant;

use serde_json::{Map, Value};

use crate::cli::PredictArgs;
use crate::error::{CliError, Result};
use crate::progress;
use recsys_engine::{
    Engine, ExternalId, ExternalIds, Request, RequestTimes, ServeOptions, UnknownItemPolicy,
};

use recsys_cli::jsonl::{parse_line, Ids, Line, MAX_LINE_BYTES};

#[derive(Default, Clone, Copy)]
struct Counts {
    lines: u64,
    failed: u64,
    unknown_ids: u64,
}

impl Counts {
    fn add(&mut self, other: Counts) {
        self.lines += other.lines;
        self.failed += other.failed;
        self.unknown_ids += other.unknown_ids;
    }
}

/// `I/N`: this job handles the lines whose 0-based record number is I modulo N.
fn parse_shard(text: &str) -> Result<(u64, u64)> {
    let bad = || {
        CliError::Usage(format!(
            "--shard must be I/N with 0 <= I < N, found {text:?}"
        ))
    };
    let (i, n) = text.split_once('/').ok_or_else(bad)?;
    let (i, n): (u64, u64) = (
        i.trim().parse().map_err(|_| bad())?,
        n.trim().parse().map_err(|_| bad())?,
    );
    if n == 0 || i >= n {
        return Err(bad());
    }
    Ok((i, n))
}

/// For `--resume`: keeps the complete lines of an existing output (cutting a partial last line)
/// and returns how many there are, so that many records are skipped.
fn resume_point(path: &std::path::Path) -> Result<u64> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(CliError::io(format!("cannot read {}", path.display()))(e)),
    };
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1);
    if complete < bytes.len() {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(CliError::io(format!("cannot open {}", path.display())))?;
        file.set_len(complete as u64).map_err(CliError::io(format!(
            "cannot cut the partial last line of {}",
            path.display()
        )))?;
    }
    Ok(bytes[..complete].iter().filter(|&&b| b == b'\n').count() as u64)
}

/// `args` with every object-store path (s3://, gs://) replaced by a local copy in a scratch folder
/// (under TMPDIR): the engine folder and the input downloaded, the output written locally and
/// uploaded whole when the run completes (returned as the URI to upload to).
fn localize(
    args: &PredictArgs,
) -> Result<(PredictArgs, Option<String>, Option<tempfile::TempDir>)> {
    use recsys_registry::transfer;
    let text = |p: &std::path::Path| p.to_str().unwrap_or_default().to_string();
    let (engine, input, output) = (text(&args.engine), text(&args.input), text(&args.output));
    if ![&engine, &input, &output]
        .iter()
        .any(|t| transfer::is_remote(t))
    {
        return Ok((args.clone(), None, None));
    }
    if args.resume && transfer::is_remote(&output) {
        return Err(CliError::Usage(
            "--resume needs a local --output: an object-store output appears only once the run \
             completes, so there is nothing to resume from"
                .into(),
        ));
    }
    let scratch = tempfile::Builder::new()
        .prefix("recsys-predict-")
        .tempdir()
        .map_err(CliError::io("cannot create a scratch folder (set TMPDIR)"))?;
    let mut local = args.clone();
    if transfer::is_remote(&engine) {
        let dir = scratch.path().join("engine");
        let bytes = transfer::download_folder(&engine, &dir)?;
        tell!(
            "predict: downloaded the engine {engine} ({:.1} MB)",
            bytes as f64 / 1e6
        );
        local.engine = dir;
    }
    if transfer::is_remote(&input) {
        let file = scratch.path().join("input.jsonl");
        transfer::download_file(&input, &file)?;
        local.input = file;
    }
    let upload = transfer::is_remote(&output).then(|| {
        local.output = scratch.path().join("output.jsonl");
        output.clone()
    });
    Ok((local, upload, Some(scratch)))
}

pub fn run(args: &PredictArgs) -> Result<i32> {
    let (local, upload, _scratch) = localize(args)?;
    let code = run_local(&local)?;
    if let Some(uri) = upload {
        let bytes = recsys_registry::transfer::upload_file(&local.output, &uri, &mut |_| {})?;
        tell!("predict: wrote {uri} ({:.1} MB)", bytes as f64 / 1e6);
    }
    Ok(code)
}

fn run_local(args: &PredictArgs) -> Result<i32> {
    // Flags first: a bad combination is reported before any file is read.
    let (shard, shards) = match &args.shard {
        Some(text) => parse_shard(text)?,
        None => (0, 1),
    };
    let to_stdout = args.output.as_os_str() == "-";
    if args.resume && to_stdout {
        return Err(CliError::Usage(
            "--resume needs an output file, not standard output".into(),
        ));
    }
    let mut engine = Engine::load(&args.engine)?;
    if let Some(source) = &args.catalogue {
        let delta = if source.ends_with(".parquet") {
            crate::catalogue_table::read_delta(std::path::Path::new(source))?
        } else {
            recsys_registry::catalogue::read(&engine, source)?
        };
        engine = engine.with_catalogue(&delta)?;
        let summary = engine.catalogue().expect("just applied");
        tell!(
            "predict: catalogue {source}: {} item(s) added, {} replaced, {} retired ({} items in all)",
            summary.added,
            summary.replaced,
            summary.retired,
            engine.n_items()
        );
    }
    if args.timeline {
        if engine.why_no_prefix_cache().is_none() {
            // Each event's state carried to the next: a timeline of n events computes n steps.
            // Room for every in-flight history's state many times over.
            engine.set_prefix_cache(Some(recsys_engine::prefix_cache::PrefixCache::new(
                TIMELINE_CACHE_BYTES,
                None,
            )))?;
        } else {
            tell!(
                "predict: --timeline: {} recomputes each prefix of a history (no incremental \
                 state), so n events cost n(n+1)/2 event steps",
                engine.kind()
            );
        }
    }
    // Each worker scores its batches on one thread (the engine's), which the plan is made for.
    if let Some(plan) = engine.plan_screen(args.screen_policy.parse().map_err(CliError::Usage)?) {
        tell!("predict: screen plan: {}", plan.describe());
    }
    if let Some(plan) = engine.plan_bf16_path(args.bf16_path.parse().map_err(CliError::Usage)?) {
        tell!("predict: kernel plan: {}", plan.describe());
    }
    if let Some(plan) = engine.plan_row_block(args.row_block.parse().map_err(CliError::Usage)?) {
        tell!("predict: row-block plan: {}", plan.describe());
    }
    match engine.plan_amx(args.amx.parse().map_err(CliError::Usage)?) {
        Ok(Some(plan)) => tell!("predict: AMX plan: {}", plan.describe()),
        Ok(None) => {}
        Err(why) => tell!("predict: AMX tiles not used (the SIMD tables run): {why}"),
    }
    let engine = engine;
    if let Some(source) = &args.availability {
        let applied = recsys_registry::availability::apply(&engine, source)?;
        tell!(
            "predict: availability version {} from {source}: {} items, {} ids not in the \
             catalogue left out",
            applied.version,
            applied.known_items,
            applied.unknown_items
        );
    }
    let options = ServeOptions {
        default_k: args.k as usize,
        exclude_seen: !args.include_seen,
        unknown_items: if args.strict_ids {
            UnknownItemPolicy::Error
        } else {
            UnknownItemPolicy::Drop
        },
        empty_history: args.empty_history_policy.parse().map_err(CliError::Usage)?,
    };
    let skip = if args.resume {
        resume_point(&args.output)?
    } else {
        0
    };
    let stdin = args.input.as_os_str() == "-";
    let (input, total): (Box<dyn Read + Send>, Option<u64>) = if stdin {
        (Box::new(std::io::stdin()), None)
    } else {
        let file = std::fs::File::open(&args.input).map_err(CliError::io(format!(
            "cannot open input {}",
            args.input.display()
        )))?;
        let len = file.metadata().ok().map(|m| m.len());
        (Box::new(file), len)
    };
    let mut reader = BufReader::with_capacity(1 << 20, input);
    let output: Box<dyn Write + Send> = if to_stdout {
        Box::new(std::io::stdout())
    } else if args.resume {
        Box::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&args.output)
                .map_err(CliError::io(format!(
                    "cannot open output {}",
                    args.output.display()
                )))?,
        )
    } else {
        Box::new(
            std::fs::File::create(&args.output).map_err(CliError::io(format!(
                "cannot create output {}",
                args.output.display()
            )))?,
        )
    };
    let mut writer = BufWriter::with_capacity(1 << 20, output);
    let bar = match total {
        Some(total) => progress::bytes(total),
        None => progress::spinner("scoring"),
    };
    if skip > 0 {
        tell!(
            "predict: resuming after {skip} lines already in {}",
            args.output.display()
        );
    }

    // Pipeline: this thread reads and parses batches, `threads` workers score them, one writer
    // puts them back in input order. Channels are bounded, so memory holds at most a few batches
    // per worker whatever the input size.
    let workers = crate::cli::default_threads(args.threads);
    let started = Instant::now();
    let (job_tx, job_rx) = std::sync::mpsc::sync_channel::<(u64, Vec<Line>)>(2 * workers);
    let job_rx = std::sync::Mutex::new(job_rx);
    let (done_tx, done_rx) = std::sync::mpsc::sync_channel::<(u64, Vec<u8>, Counts)>(2 * workers);
    let outcome: Result<Counts> = std::thread::scope(|scope| {
        for _ in 0..workers {
            let (job_rx, done_tx, engine, options) = (&job_rx, done_tx.clone(), &engine, &options);
            let embeddings = args.return_embedding;
            let timeline = args.timeline;
            scope.spawn(move || loop {
                let job = job_rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                let Ok((seq, batch)) = job else { break };
                let mut out = Vec::with_capacity(batch.len() * 256);
                let mut counts = Counts::default();
                score_batch(
                    engine,
                    options,
                    embeddings,
                    timeline,
                    &batch,
                    &mut out,
                    &mut counts,
                );
                if done_tx.send((seq, out, counts)).is_err() {
                    break;
                }
            });
        }
        drop(done_tx);
        let writer_thread = scope.spawn(move || -> Result<Counts> {
            let mut pending = std::collections::BTreeMap::new();
            let mut next = 0u64;
            let mut counts = Counts::default();
            for (seq, bytes, c) in done_rx {
                pending.insert(seq, (bytes, c));
                while let Some((bytes, c)) = pending.remove(&next) {
                    writer
                        .write_all(&bytes)
                        .map_err(CliError::io("cannot write output"))?;
                    counts.add(c);
                    next += 1;
                }
            }
            writer
                .flush()
                .map_err(CliError::io("cannot write output"))?;
            Ok(counts)
        });

        let mut record = 0u64; // non-blank input lines seen
        let mut line_no = 0u64;
        let mut seq = 0u64;
        let mut buf = Vec::new();
        let mut read_error = None;
        'read: loop {
            let mut batch: Vec<Line> = Vec::with_capacity(args.batch_size as usize);
            while batch.len() < args.batch_size as usize {
                buf.clear();
                let n = match (&mut reader)
                    .take(MAX_LINE_BYTES as u64 + 1)
                    .read_until(b'\n', &mut buf)
                {
                    Ok(n) => n,
                    Err(e) => {
                        read_error = Some(CliError::io(format!(
                            "cannot read {}",
                            args.input.display()
                        ))(e));
                        break 'read;
                    }
                };
                if n == 0 {
                    if !batch.is_empty() {
                        let _ = job_tx.send((seq, batch));
                    }
                    break 'read;
                }
                bar.inc(n as u64);
                line_no += 1;
                let oversized = buf.len() > MAX_LINE_BYTES && !buf.ends_with(b"\n");
                if oversized {
                    bar.inc(skip_rest_of_line(&mut reader));
                }
                let blank = !oversized && buf.iter().all(|b| b.is_ascii_whitespace());
                if blank {
                    continue; // blank lines carry no request and produce no output
                }
                let mine = record % shards == shard;
                record += 1;
                if !mine {
                    continue;
                }
                let position = (record - 1) / shards; // index among this shard's records
                if position < skip {
                    continue;
                }
                let parsed = if oversized {
                    Err((
                        format!("line longer than {MAX_LINE_BYTES} bytes"),
                        Map::new(),
                    ))
                } else {
                    match std::str::from_utf8(&buf) {
                        Ok(text) => parse_line(text.trim()),
                        Err(_) => Err(("the line is not UTF-8".into(), Map::new())),
                    }
                };
                batch.push((line_no, parsed));
            }
            if job_tx.send((seq, batch)).is_err() {
                break;
            }
            seq += 1;
        }
        drop(job_tx);
        let written = writer_thread.join().expect("writer thread panicked");
        match read_error {
            Some(e) => Err(e),
            None => written,
        }
    });
    let counts = outcome?;
    bar.finish_and_clear();

    let secs = started.elapsed().as_secs_f64();
    tell!(
        "predict: {} lines, {} ok, {} failed, {} unknown history ids dropped, {:.2} s ({:.0} lines/s){}",
        counts.lines,
        counts.lines - counts.failed,
        counts.failed,
        counts.unknown_ids,
        secs,
        counts.lines as f64 / secs.max(1e-9),
        if shards > 1 { format!(", shard {shard}/{shards}") } else { String::new() }
    );
    Ok(if counts.failed > 0 { 3 } else { 0 })
}

/// Skips the rest of an oversized line without holding it; returns the bytes skipped.
fn skip_rest_of_line(reader: &mut impl BufRead) -> u64 {
    let mut skipped = 0u64;
    while let Ok(chunk) = reader.fill_buf() {
        if chunk.is_empty() {
            break;
        }
        let (used, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(p) => (p + 1, true),
            None => (chunk.len(), false),
        };
        reader.consume(used);
        skipped += used as u64;
        if done {
            break;
        }
    }
    skipped
}

/// The prefix cache of a `--timeline` run: far more than the states of the histories in flight.
const TIMELINE_CACHE_BYTES: usize = 256 << 20;

fn score_batch(
    engine: &Engine,
    options: &ServeOptions,
    all_embeddings: bool,
    timeline: bool,
    batch: &[Line],
    writer: &mut Vec<u8>,
    counts: &mut Counts,
) {
    // Borrowed string views must outlive the requests that point at them.
    fn str_view(ids: Option<&Ids>) -> Vec<&str> {
        match ids {
            Some(Ids::Str(v)) => v.iter().map(String::as_str).collect(),
            _ => Vec::new(),
        }
    }
    fn external<'a>(ids: &'a Ids, strs: &'a [&'a str]) -> ExternalIds<'a> {
        match ids {
            Ids::Int(v) => ExternalIds::Int(v),
            Ids::Str(_) => ExternalIds::Str(strs),
        }
    }
    let str_views: Vec<[Vec<&str>; 3]> = batch
        .iter()
        .map(|(_, line)| match line {
            Ok(p) => [
                str_view(Some(&p.history)),
                str_view(p.exclude.as_ref()),
                str_view(p.candidates.as_ref()),
            ],
            Err(_) => [Vec::new(), Vec::new(), Vec::new()],
        })
        .collect();
    let mut requests = Vec::new();
    let mut request_of_line = Vec::with_capacity(batch.len());
    for ((_, line), [hist_strs, excl_strs, cand_strs]) in batch.iter().zip(&str_views) {
        match line {
            Ok(p) => {
                request_of_line.push(Some(requests.len()));
                requests.push(Request {
                    history: external(&p.history, hist_strs),
                    k: p.k,
                    exclude: p.exclude.as_ref().map(|e| external(e, excl_strs)),
                    candidates: p.candidates.as_ref().map(|c| external(c, cand_strs)),
                    // Embeddings come from the same encoder pass as the recommendations.
                    embedding: all_embeddings || p.return_embedding,
                    filter: p.filter.as_ref(),
                    times: p.times(),
                });
            }
            Err(_) => request_of_line.push(None),
        }
    }
    // The timeline first: its last event is the whole history, which the cache then holds.
    let mut timelines: Vec<Vec<Value>> = if timeline {
        events_of(engine, options, &requests)
    } else {
        Vec::new()
    };
    let mut answers: Vec<Option<recsys_engine::Result<recsys_engine::Recommendation>>> = engine
        .recommend(&requests, options)
        .into_iter()
        .map(Some)
        .collect();

    let id_json = |id: ExternalId| match id {
        ExternalId::Int(i) => Value::from(i),
        ExternalId::Str(s) => Value::from(s),
    };
    for ((line_no, line), slot) in batch.iter().zip(request_of_line) {
        counts.lines += 1;
        let record = match (
            line,
            slot.map(|s| answers[s].take().expect("each answer used once")),
        ) {
            (Ok(parsed), Some(Ok(rec))) => {
                // Every index is checked against the catalogue before it becomes an id.
                let ids: Option<Vec<Value>> = rec
                    .items
                    .iter()
                    .map(|s| engine.external_id(s.index).map(id_json))
                    .collect();
                match ids {
                    None => error_record(
                        "internal error: the engine returned an item index outside the catalogue",
                        *line_no,
                        &parsed.passthrough,
                    ),
                    Some(ids) => {
                        counts.unknown_ids += rec.unknown_ids as u64;
                        let mut out = Map::new();
                        out.insert("item_ids".into(), Value::Array(ids));
                        out.insert(
                            "scores".into(),
                            Value::Array(rec.items.iter().map(|s| Value::from(s.score)).collect()),
                        );
                        if rec.popular {
                            // Scores are shares of the interactions, not the model's.
                            out.insert("answered_by".into(), Value::from("popular"));
                        }
                        if let Some(events) = slot.and_then(|s| timelines.get_mut(s)) {
                            out.insert("timeline".into(), Value::Array(std::mem::take(events)));
                        }
                        if all_embeddings || parsed.return_embedding {
                            out.insert(
                                "embedding".into(),
                                Value::Array(
                                    rec.embedding.iter().map(|&v| Value::from(v)).collect(),
                                ),
                            );
                        }
                        for (k, v) in &parsed.passthrough {
                            out.entry(k.clone()).or_insert_with(|| v.clone());
                        }
                        out
                    }
                }
            }
            (Ok(parsed), Some(Err(e))) => {
                error_record(&e.to_string(), *line_no, &parsed.passthrough)
            }
            (Err((msg, passthrough)), _) => error_record(msg, *line_no, passthrough),
            (Ok(_), None) => unreachable!("parsed lines always have a request"),
        };
        if record.contains_key("error") {
            counts.failed += 1;
        }
        // Serialising a JSON value into memory cannot fail.
        serde_json::to_writer(&mut *writer, &Value::Object(record)).expect("JSON into memory");
        writer.push(b'\n');
    }
}

/// Each request's answers after each of its history's events, as timeline entries (`event`: how
/// many of its history's ids were seen; `item_ids` and `scores`, or that step's `error`). Every
/// request's prefixes of one length run as one batch, shortest first, so with the prefix cache
/// each step resumes from the one before and computes one event per history.
fn events_of(engine: &Engine, options: &ServeOptions, requests: &[Request<'_>]) -> Vec<Vec<Value>> {
    let id_json = |id: ExternalId| match id {
        ExternalId::Int(i) => Value::from(i),
        ExternalId::Str(s) => Value::from(s),
    };
    fn prefix<'a>(ids: ExternalIds<'a>, t: usize) -> ExternalIds<'a> {
        match ids {
            ExternalIds::Int(v) => ExternalIds::Int(&v[..t]),
            ExternalIds::Str(v) => ExternalIds::Str(&v[..t]),
        }
    }
    let longest = requests.iter().map(|r| r.history.len()).max().unwrap_or(0);
    let mut out: Vec<Vec<Value>> = requests
        .iter()
        .map(|r| Vec::with_capacity(r.history.len()))
        .collect();
    for t in 1..=longest {
        let (which, step): (Vec<usize>, Vec<Request<'_>>) = requests
            .iter()
            .enumerate()
            .filter(|(_, r)| r.history.len() >= t)
            .map(|(i, r)| {
                (
                    i,
                    Request {
                        history: prefix(r.history, t),
                        embedding: false,
                        // After event t, the next event is the one to predict: its time is the
                        // query's (the request's own after the last).
                        times: r.times.map(|times| RequestTimes {
                            events: &times.events[..t.min(times.events.len())],
                            query: times.events.get(t).copied().or(times.query),
                        }),
                        ..*r
                    },
                )
            })
            .unzip();
        for (i, answer) in which.into_iter().zip(engine.recommend(&step, options)) {
            let mut entry = Map::new();
            entry.insert("event".into(), Value::from(t));
            match answer {
                Ok(rec) => {
                    let ids: Vec<Value> = rec
                        .items
                        .iter()
                        .filter_map(|s| engine.external_id(s.index).map(id_json))
                        .collect();
                    entry.insert("item_ids".into(), Value::Array(ids));
                    entry.insert(
                        "scores".into(),
                        Value::Array(rec.items.iter().map(|s| Value::from(s.score)).collect()),
                    );
                }
                Err(e) => {
                    entry.insert("error".into(), Value::from(e.to_string()));
                }
            }
            out[i].push(Value::Object(entry));
        }
    }
    out
}

/// The record that takes a failed line's place: the error, the line number, and the caller's own
/// fields so the failure can be traced back to its user.
fn error_record(
    message: &str,
    line_no: u64,
    passthrough: &Map<String, Value>,
) -> Map<String, Value> {
    let mut out = Map::new();
    out.insert("error".into(), Value::from(message));
    out.insert("line".into(), Value::from(line_no));
    for (k, v) in passthrough {
        out.entry(k.clone()).or_insert_with(|| v.clone());
    }
    out
}
