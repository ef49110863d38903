//! `recsys catalogue publish | show | compact | fold-in`: a model's live catalogue object in its
//! repository, its folding into the next engine version, and rows for new items estimated from
//! their first interactions.

use std::path::Path;

use recsys_engine::catalogue::ItemOp;
use recsys_engine::catalogue_file::CatalogueFile;
use recsys_registry::catalogue::{self, CatalogueSource};
use recsys_registry::store::Fetched;
use recsys_registry::Repository;

use crate::cli::{
    CatalogueCompactArgs, CatalogueFoldInArgs, CataloguePublishArgs, CatalogueShowArgs,
};
use crate::error::{CliError, Result};
use crate::output::{say, tell};

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub fn publish(args: &CataloguePublishArgs) -> Result<i32> {
    let delta = crate::catalogue_table::read_delta(&args.table)?;
    let repository = Repository::open(&args.repository)?;
    let engine_version = match args.engine_version {
        Some(v) => v,
        None => catalogue::served_version(&repository, &args.model)?,
    };
    let scratch = tempfile::tempdir().map_err(CliError::io("cannot create a scratch folder"))?;
    tell!(
        "catalogue: checking {} row(s) against {} version {engine_version}",
        delta.rows.len(),
        args.model
    );
    let engine = catalogue::load_engine(&repository, &args.model, engine_version, scratch.path())?;
    let published = catalogue::publish(
        &repository,
        &args.model,
        &engine,
        engine_version,
        delta,
        args.version,
    )?;
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
        "published {} catalogue version {} ({previous}) for engine version {}: {} added, {} \
         replaced, {} retired ({} items in all), {} bytes",
        published.model,
        published.version,
        published.engine_version,
        published.added,
        published.replaced,
        published.retired,
        published.items,
        published.bytes
    );
    say!("source: {}", published.source);
    if !published.configured {
        tell!(
            "warning: {}'s config.pbtxt names no catalogue_source, so no server reads this \
             object; add\n  parameters {{ key: \"catalogue_source\" value {{ string_value: \
             \"{}\" }} }}\nand reload the model",
            published.model,
            published.source
        );
    }
    Ok(0)
}

pub fn show(args: &CatalogueShowArgs) -> Result<i32> {
    let text = match (&args.repository, &args.model, &args.source) {
        (Some(repository), Some(model), _) => {
            catalogue::source_uri(&Repository::open(repository)?, model)
        }
        (_, _, Some(source)) => source.clone(),
        _ => {
            return Err(CliError::Usage(
                "give --repository and --model, or --source".into(),
            ))
        }
    };
    let source = CatalogueSource::open(&text, Path::new("."))?;
    // No engine to derive a bound from here: the object's head is still checked as it arrives,
    // so anything that is not a catalogue object is refused at once.
    let object = match source.fetch(None, u64::MAX)? {
        Fetched::Changed(object) => object,
        Fetched::Missing | Fetched::Unchanged => {
            return Err(CliError::Input(format!(
                "{text}: no catalogue object there (publish one with `recsys catalogue publish`)"
            )))
        }
        Fetched::Refused { why, .. } => {
            return Err(CliError::Input(format!("{text}: refused: {why}")))
        }
    };
    // Ids are listed as text: without the engine, their type is not known here.
    let file = CatalogueFile::from_bytes(&object.bytes, recsys_engine::idmap::IdType::String)
        .map_err(|e| CliError::Input(format!("{text}: refused: {e}")))?;
    let rows = &file.delta.rows;
    let retired = rows.iter().filter(|r| r.op == ItemOp::Retire).count();
    let with_rows = rows.iter().filter(|r| r.vector.is_some()).count();
    let age = now_unix().saturating_sub(file.published_unix);
    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "source": text,
                "version": file.delta.version,
                "published_unix": file.published_unix,
                "age_seconds": age,
                "engine_sha256": file.engine_sha256,
                "rows": rows.len(),
                "rows_with_vectors": with_rows,
                "retired": retired,
                "vector_width": file.vector_width,
                "input_width": file.input_width,
                "bytes": object.bytes.len(),
                "sha256": file.sha256,
            }))
            .expect("serialisable")
        );
        return Ok(0);
    }
    say!(
        "{text}: version {}, published {age} s ago, for the engine with weights sha256 {}: {} \
         row(s) ({with_rows} with vectors, {retired} retired), {} bytes, sha256 {}",
        file.delta.version,
        file.engine_sha256,
        rows.len(),
        object.bytes.len(),
        file.sha256
    );
    Ok(0)
}

pub fn compact(args: &CatalogueCompactArgs) -> Result<i32> {
    let repository = Repository::open(&args.repository)?;
    let scratch = tempfile::tempdir().map_err(CliError::io("cannot create a scratch folder"))?;
    tell!(
        "catalogue: folding {}'s catalogue into a new engine version (verified against the served \
         engine with the delta before anything is written)",
        args.model
    );
    let bar = crate::progress::bytes(0);
    bar.set_message("uploading the compacted engine");
    let compacted = recsys_registry::compact::compact(
        &repository,
        &args.model,
        args.engine_version,
        scratch.path(),
        &mut |sent, total| {
            bar.set_length(total);
            bar.set_position(sent);
        },
    );
    bar.finish_and_clear();
    let compacted = compacted?;
    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&compacted).expect("serialisable")
        );
        return Ok(0);
    }
    say!(
        "published {} version {} (pending): version {} with catalogue version {} folded in: {} \
         added, {} replaced, {} kept retired ({} items in all); {} probe histories answered \
         alike, bit for bit",
        compacted.model,
        compacted.version,
        compacted.from_version,
        compacted.catalogue_version,
        compacted.added,
        compacted.replaced,
        compacted.retired,
        compacted.items,
        compacted.verified_histories
    );
    say!(
        "next: recsys approve --repository {} --model {} --version {} (canary and gates as for \
         any version); until it serves, the servers of version {} apply the stored delta, and \
         once it serves they take it as folded in",
        args.repository,
        compacted.model,
        compacted.version,
        compacted.from_version
    );
    if !compacted.weights_changed {
        tell!(
            "note: the delta only retires items, so the new version's weights are version {}'s: \
             the stored delta applies to it unchanged",
            compacted.from_version
        );
    }
    Ok(0)
}

pub fn fold_in(args: &CatalogueFoldInArgs) -> Result<i32> {
    use recsys_engine::fold_in::{FoldInOptions, InputRowSource};

    let engine = recsys_engine::Engine::load(&args.engine)?;
    let logs =
        recsys_engine::interactions::read_user_logs(&args.interactions).map_err(CliError::Input)?;
    let options = FoldInOptions {
        l2: args.l2,
        max_examples: args.max_examples as usize,
        negative_samples: args.negative_samples as usize,
    };
    let bar = crate::progress::counter(0, "items");
    let folded = recsys_engine::fold_in::fold_in(&engine, &logs, &options, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    let folded = folded?;
    if folded.items.is_empty() {
        return Err(CliError::Input(format!(
            "{}: no item to fold in ({} interaction(s) with items the engine lacks, {} skipped: \
             {})",
            args.interactions.display(),
            folded.new_interactions,
            folded.skipped.len(),
            folded
                .skipped
                .iter()
                .take(3)
                .map(|(id, why)| format!("{id}: {why}"))
                .collect::<Vec<_>>()
                .join("; ")
        )));
    }
    let rows: Vec<_> = folded.items.iter().map(|f| f.row.clone()).collect();
    crate::catalogue_table::write_delta(&args.output, &rows)?;
    let input_source = match folded.items[0].input_source {
        InputRowSource::Tied => "tied to the output rows (the same fit)",
        InputRowSource::CoOccurrence => {
            "from co-occurrence (the mean input row of the items their users also interacted with)"
        }
    };
    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "output": args.output,
                "items": folded.items.len(),
                "skipped": folded.skipped.iter().map(|(id, why)| serde_json::json!({"item_id": id, "why": why})).collect::<Vec<_>>(),
                "users": folded.users,
                "known_interactions": folded.known_interactions,
                "new_interactions": folded.new_interactions,
                "input_rows": folded.items[0].input_source,
                "l2": options.l2,
                "negative_contexts": folded.negative_contexts,
                "negative_samples": folded.negative_samples,
                "folded": folded.items.iter().map(|f| serde_json::json!({
                    "item_id": crate::catalogue_table::id_text(&f.row.id),
                    "interactions": f.interactions,
                    "examples": f.examples,
                    "log_likelihood": f.log_likelihood,
                    "iterations": f.iterations,
                })).collect::<Vec<_>>(),
            }))
            .expect("serialisable")
        );
        return Ok(0);
    }
    let examples: usize = folded.items.iter().map(|f| f.examples).sum();
    say!(
        "folded in {} new item(s) from {} interaction(s) ({examples} examples, {} users; {} \
         interactions with known items as context) into {}",
        folded.items.len(),
        folded.new_interactions,
        folded.users,
        folded.known_interactions,
        args.output.display()
    );
    say!("input rows: {input_source}");
    if !folded.skipped.is_empty() {
        tell!("skipped {} item(s):", folded.skipped.len());
        for (id, why) in folded.skipped.iter().take(10) {
            tell!("  {id}: {why}");
        }
    }
    Ok(0)
}
