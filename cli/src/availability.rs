//! `recsys availability publish | show`: a model's live availability object in its repository.

use crate::output::{say, tell};
use recsys_engine::AvailabilityFile;
use recsys_registry::availability::{self, AvailabilitySource};
use recsys_registry::store::Fetched;
use recsys_registry::Repository;

use crate::cli::{AvailabilityPublishArgs, AvailabilityShowArgs};
use crate::error::{CliError, Result};

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub fn publish(args: &AvailabilityPublishArgs) -> Result<i32> {
    let table = crate::attributes::read(&args.table)?;
    let repository = Repository::open(&args.repository)?;
    let published = availability::publish(&repository, &args.model, &table, args.version)?;
    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&published).expect("serialisable")
        );
        return Ok(0);
    }
    let previous = published.previous.map_or("none before".to_string(), |p| {
        format!("replacing version {p}")
    });
    say!(
        "published {} availability version {} ({previous}): {} items, {} sets, {} bytes",
        published.model,
        published.version,
        published.items,
        published.sets.len(),
        published.bytes
    );
    say!("source: {}", published.source);
    if !published.configured {
        tell!(
            "warning: {}'s config.pbtxt names no availability_source, so no server reads this \
             object; add\n  parameters {{ key: \"availability_source\" value {{ string_value: \
             \"{}\" }} }}\nand reload the model",
            published.model,
            published.source
        );
    }
    Ok(0)
}

pub fn show(args: &AvailabilityShowArgs) -> Result<i32> {
    let (source, text) = match (&args.repository, &args.model, &args.source) {
        (Some(repository), Some(model), _) => {
            let repository = Repository::open(repository)?;
            let uri = availability::source_uri(&repository, model);
            (
                AvailabilitySource::open(&uri, std::path::Path::new("."))?,
                uri,
            )
        }
        (_, _, Some(source)) => (
            AvailabilitySource::open(source, std::path::Path::new("."))?,
            source.clone(),
        ),
        _ => {
            return Err(CliError::Usage(
                "give --repository and --model, or --source".into(),
            ))
        }
    };
    // No catalogue to derive a bound from here: the object's head is still checked as it
    // arrives, so anything that is not an availability object is refused at once.
    let object = match source.fetch(None, u64::MAX)? {
        Fetched::Changed(object) => object,
        Fetched::Missing | Fetched::Unchanged => {
            return Err(CliError::Input(format!(
                "{text}: no availability object there (publish one with `recsys availability \
                 publish`)"
            )))
        }
        Fetched::Refused { why, .. } => {
            return Err(CliError::Input(format!("{text}: refused: {why}")))
        }
    };
    let file = AvailabilityFile::from_bytes(&object.bytes)
        .map_err(|e| CliError::Input(format!("{text}: refused: {e}")))?;
    let age = now_unix().saturating_sub(file.published_unix);
    let sets = file.summary();
    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "source": text,
                "version": file.version,
                "published_unix": file.published_unix,
                "age_seconds": age,
                "items": file.n_ids(),
                "bytes": object.bytes.len(),
                "sha256": file.sha256(),
                "sets": sets.iter().map(|(n, c)| serde_json::json!({"name": n, "items": c})).collect::<Vec<_>>(),
            }))
            .expect("serialisable")
        );
        return Ok(0);
    }
    say!(
        "{text}: version {}, published {age} s ago, {} items, {} sets, {} bytes, sha256 {}",
        file.version,
        file.n_ids(),
        sets.len(),
        object.bytes.len(),
        file.sha256()
    );
    if args.sets {
        for (name, count) in &sets {
            say!("  {name}\t{count}");
        }
    }
    Ok(0)
}
