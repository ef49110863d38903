//! `recsys predict`: offline batch scoring of JSON lines, streamed in batches so memory does not
//! grow with the file, with output lines in input order.

use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::time::Instant;

use serde_json::{Map, Value};

use crate::cli::PredictArgs;
use crate::error::{CliError, Result};
use crate::progress;
use recsys_engine::{Engine, ExternalId, ExternalIds, Request, ServeOptions, UnknownItemPolicy};

/// A line longer than this is refused without being parsed (a history of a million ids fits).
const MAX_LINE_BYTES: usize = 16 << 20;

enum Ids {
    Int(Vec<i64>),
    Str(Vec<String>),
}

impl Ids {
    /// Numbers stay numbers; any string in the list makes the whole list strings (an int64
    /// catalogue still resolves digit strings).
    fn parse(value: &Value, field: &str) -> std::result::Result<Ids, String> {
        let items = value
            .as_array()
            .ok_or_else(|| format!("\"{field}\" must be an array of item ids"))?;
        if items.iter().all(|v| v.is_i64()) {
            return Ok(Ids::Int(
                items.iter().map(|v| v.as_i64().expect("checked")).collect(),
            ));
        }
        items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                Value::Number(n) if n.is_i64() => Ok(n.to_string()),
                other => Err(format!(
                    "\"{field}\" holds {other}, which is not an item id (integer or string)"
                )),
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(Ids::Str)
    }
}

/// A line that could not be turned into a request: the message, and the fields to pass through.
type LineError = (String, Map<String, Value>);

/// One input line: its 1-based number and what it parsed into.
type Line = (u64, std::result::Result<ParsedLine, LineError>);

struct ParsedLine {
    history: Ids,
    exclude: Option<Ids>,
    k: Option<i64>,
    passthrough: Map<String, Value>,
}

fn parse_line(text: &str) -> std::result::Result<ParsedLine, LineError> {
    let mut object = match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => map,
        Ok(_) => return Err(("the line is not a JSON object".into(), Map::new())),
        Err(e) => return Err((format!("invalid JSON: {e}"), Map::new())),
    };
    let fail = |msg: String, object: Map<String, Value>| Err((msg, object));
    let Some(history) = object.remove("item_ids") else {
        return fail("missing \"item_ids\"".into(), object);
    };
    let history = match Ids::parse(&history, "item_ids") {
        Ok(ids) => ids,
        Err(msg) => return fail(msg, object),
    };
    let exclude = match object.remove("exclude_item_ids") {
        None | Some(Value::Null) => None,
        Some(v) => match Ids::parse(&v, "exclude_item_ids") {
            Ok(ids) => Some(ids),
            Err(msg) => return fail(msg, object),
        },
    };
    let k = match object.remove("k") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(k) if k >= 1 => Some(k),
            _ => {
                return fail(
                    format!("\"k\" must be a positive integer, found {v}"),
                    object,
                )
            }
        },
    };
    Ok(ParsedLine {
        history,
        exclude,
        k,
        passthrough: object,
    })
}

#[derive(Default)]
struct Counts {
    lines: u64,
    failed: u64,
    unknown_ids: u64,
}

pub fn run(args: &PredictArgs) -> Result<i32> {
    let mut engine = Engine::load(&args.engine)?;
    engine.set_threads(args.threads as usize);
    let options = ServeOptions {
        default_k: args.k as usize,
        exclude_seen: !args.include_seen,
        unknown_items: if args.strict_ids {
            UnknownItemPolicy::Error
        } else {
            UnknownItemPolicy::Drop
        },
    };
    let stdin = args.input.as_os_str() == "-";
    let (input, total): (Box<dyn Read>, Option<u64>) = if stdin {
        (Box::new(std::io::stdin().lock()), None)
    } else {
        let file = std::fs::File::open(&args.input).map_err(CliError::io(format!(
            "cannot open input {}",
            args.input.display()
        )))?;
        let len = file.metadata().ok().map(|m| m.len());
        (Box::new(file), len)
    };
    let mut reader = BufReader::with_capacity(1 << 20, input);
    let output: Box<dyn Write> = if args.output.as_os_str() == "-" {
        Box::new(std::io::stdout().lock())
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

    let started = Instant::now();
    let mut counts = Counts::default();
    let mut line_no = 0u64;
    let mut buf = Vec::new();
    let mut batch: Vec<Line> = Vec::new();
    loop {
        batch.clear();
        let mut eof = false;
        while batch.len() < args.batch_size as usize {
            buf.clear();
            let n = (&mut reader)
                .take(MAX_LINE_BYTES as u64 + 1)
                .read_until(b'\n', &mut buf)
                .map_err(CliError::io(format!(
                    "cannot read {}",
                    args.input.display()
                )))?;
            if n == 0 {
                eof = true;
                break;
            }
            bar.inc(n as u64);
            line_no += 1;
            if buf.len() > MAX_LINE_BYTES && !buf.ends_with(b"\n") {
                // Skip the rest of the oversized line without holding it.
                let mut skipped = 0u64;
                loop {
                    let chunk = reader
                        .fill_buf()
                        .map_err(CliError::io("cannot read input"))?;
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
                bar.inc(skipped);
                batch.push((
                    line_no,
                    Err((
                        format!("line longer than {MAX_LINE_BYTES} bytes"),
                        Map::new(),
                    )),
                ));
                continue;
            }
            let text = match std::str::from_utf8(&buf) {
                Ok(t) => t.trim(),
                Err(_) => {
                    batch.push((line_no, Err(("the line is not UTF-8".into(), Map::new()))));
                    continue;
                }
            };
            if text.is_empty() {
                continue; // blank lines carry no request
            }
            batch.push((line_no, parse_line(text)));
        }
        score_batch(&engine, &options, &batch, &mut writer, &mut counts)?;
        if eof {
            break;
        }
    }
    writer.flush().map_err(CliError::io(format!(
        "cannot write {}",
        args.output.display()
    )))?;
    bar.finish_and_clear();

    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "predict: {} lines, {} ok, {} failed, {} unknown history ids dropped, {:.2} s ({:.0} lines/s)",
        counts.lines,
        counts.lines - counts.failed,
        counts.failed,
        counts.unknown_ids,
        secs,
        counts.lines as f64 / secs.max(1e-9)
    );
    Ok(if counts.failed > 0 { 3 } else { 0 })
}

fn score_batch(
    engine: &Engine,
    options: &ServeOptions,
    batch: &[Line],
    writer: &mut impl Write,
    counts: &mut Counts,
) -> Result<()> {
    // Borrowed string views must outlive the requests that point at them.
    let str_views: Vec<(Vec<&str>, Vec<&str>)> = batch
        .iter()
        .map(|(_, line)| match line {
            Ok(p) => (
                match &p.history {
                    Ids::Str(v) => v.iter().map(String::as_str).collect(),
                    Ids::Int(_) => Vec::new(),
                },
                match &p.exclude {
                    Some(Ids::Str(v)) => v.iter().map(String::as_str).collect(),
                    _ => Vec::new(),
                },
            ),
            Err(_) => (Vec::new(), Vec::new()),
        })
        .collect();
    let mut requests = Vec::new();
    let mut request_of_line = Vec::with_capacity(batch.len());
    for ((_, line), (hist_strs, excl_strs)) in batch.iter().zip(&str_views) {
        match line {
            Ok(p) => {
                let history = match &p.history {
                    Ids::Int(v) => ExternalIds::Int(v),
                    Ids::Str(_) => ExternalIds::Str(hist_strs),
                };
                let exclude = p.exclude.as_ref().map(|e| match e {
                    Ids::Int(v) => ExternalIds::Int(v),
                    Ids::Str(_) => ExternalIds::Str(excl_strs),
                });
                request_of_line.push(Some(requests.len()));
                requests.push(Request {
                    history,
                    k: p.k,
                    exclude,
                });
            }
            Err(_) => request_of_line.push(None),
        }
    }
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
                counts.unknown_ids += rec.unknown_ids as u64;
                let mut out = Map::new();
                out.insert(
                    "item_ids".into(),
                    Value::Array(
                        rec.items
                            .iter()
                            .map(|s| id_json(engine.external_id(s.index)))
                            .collect(),
                    ),
                );
                out.insert(
                    "scores".into(),
                    Value::Array(rec.items.iter().map(|s| Value::from(s.score)).collect()),
                );
                for (k, v) in &parsed.passthrough {
                    out.entry(k.clone()).or_insert_with(|| v.clone());
                }
                out
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
        serde_json::to_writer(&mut *writer, &Value::Object(record)).map_err(|e| CliError::Io {
            context: "cannot write output".into(),
            source: e.into(),
        })?;
        writer
            .write_all(b"\n")
            .map_err(CliError::io("cannot write output"))?;
    }
    Ok(())
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
