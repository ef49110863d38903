//! `recsys publish | approve | reject | versions`: the registry (recsys-registry) driven from the
//! command line, with a per-replica report of every rollout.

use std::time::Duration;

use recsys_registry::config::{policy_versions, CONFIG_FILE};
use recsys_registry::publish::PublishRequest;
use recsys_registry::replicas::{self, Outcome, Rollout};
use recsys_registry::{versions as records, Repository, Status};

use crate::cli::{PublishArgs, RolloutArg, StatusArgs, VersionsArgs};
use crate::error::{CliError, Result};

const RELOAD_TIMEOUT: Duration = Duration::from_secs(120);

/// The exit status when the repository changed but not every replica serves the version.
pub const PARTIAL_ROLLOUT_EXIT: i32 = 4;

/// Reloads every replica behind `servers` onto `version`, printing each outcome unless `quiet`.
fn roll_out(
    servers: &[String],
    rollout: RolloutArg,
    model: &str,
    version: u64,
    quiet: bool,
) -> Result<Option<Rollout>> {
    if servers.is_empty() {
        return Ok(None);
    }
    let replicas = replicas::expand(servers)?;
    let report = replicas::roll_out(
        &replicas,
        model,
        version,
        rollout == RolloutArg::Continue,
        RELOAD_TIMEOUT,
        &mut |r| {
            if quiet {
                return;
            }
            match &r.outcome {
                Outcome::Serving => println!(
                    "{} now serves {model} version {version} ({:.1} s)",
                    r.server, r.seconds
                ),
                Outcome::Failed(e) => println!("{} FAILED: {e}", r.server),
                Outcome::NotAttempted => println!(
                    "{} not attempted: the rollout stops at the first failure (--rollout continue goes on)",
                    r.server
                ),
            }
        },
    );
    Ok(Some(report))
}

/// The exit status of a command whose repository change succeeded, given its rollout.
fn finish(report: &Option<Rollout>, quiet: bool, retry: &str) -> i32 {
    let Some(report) = report else { return 0 };
    if report.complete() {
        return 0;
    }
    if !quiet {
        let serving = report
            .replicas
            .iter()
            .filter(|r| r.outcome == Outcome::Serving)
            .count();
        eprintln!(
            "partial rollout: {serving} of {} replicas serve {} version {}; the repository names \
             it, so a replica that restarts loads it too. Once the failed replicas are back, run \
             the command again to finish:\n  {retry}",
            report.replicas.len(),
            report.model,
            report.version
        );
    }
    PARTIAL_ROLLOUT_EXIT
}

/// `text` quoted for a POSIX shell when it needs to be, so a printed command can be pasted.
fn shell_word(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@+%".contains(c));
    if plain {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
    }
}

fn command_line(
    verb: &str,
    repository: &str,
    model: &str,
    version: u64,
    servers: &[String],
) -> String {
    let mut line = format!(
        "recsys {verb} --repository {} --model {} --version {version}",
        shell_word(repository),
        shell_word(model)
    );
    for server in servers {
        line.push_str(&format!(" --server {}", shell_word(server)));
    }
    line
}

pub fn publish(args: &PublishArgs) -> Result<i32> {
    let metrics = match &args.metrics {
        None => None,
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(CliError::io(format!("cannot read {}", path.display())))?;
            Some(
                serde_json::from_str(&text)
                    .map_err(|e| CliError::Input(format!("{} is not JSON: {e}", path.display())))?,
            )
        }
    };
    let repo = Repository::open(&args.repository)?;
    let bar = crate::progress::bytes(0);
    bar.set_message(format!("uploading {}", args.engine.display()));
    let published = recsys_registry::publish::publish(
        &repo,
        &PublishRequest {
            model: &args.model,
            engine_dir: &args.engine,
            approve: args.approve,
            metrics,
            max_batch_size: args.max_batch_size,
        },
        &mut |sent, total| {
            bar.set_length(total);
            bar.set_position(sent);
        },
    );
    bar.finish_and_clear();
    let published = published?;
    let info = &published.info;
    let approve_command = command_line(
        "approve",
        &args.repository,
        &args.model,
        info.version,
        &args.servers,
    );
    if !args.json {
        if published.created_config {
            println!(
                "{}/{}/{CONFIG_FILE} did not exist: wrote a minimal one (backend \"recsys\", max_batch_size {})",
                args.repository.trim_end_matches('/'),
                args.model,
                args.max_batch_size
            );
        }
        println!(
            "published {} version {} ({}, {} {}) from {}",
            args.model,
            info.version,
            info.status,
            info.model_kind,
            info.precision,
            args.engine.display()
        );
        if info.status != Status::Approved {
            println!(
                "version {} is pending; to serve it:\n  {approve_command}",
                info.version
            );
        }
    }
    let rollout = if info.status == Status::Approved {
        roll_out(
            &args.servers,
            args.rollout,
            &args.model,
            published.serving,
            args.json,
        )?
    } else {
        None
    };
    let retry = command_line(
        "approve",
        &args.repository,
        &args.model,
        info.version,
        &args.servers,
    );
    let code = finish(&rollout, args.json, &retry);
    if args.json {
        let summary = serde_json::json!({
            "model": args.model,
            "version": info.version,
            "status": info.status.to_string(),
            "kind": info.model_kind,
            "precision": info.precision,
            "engine": args.engine,
            "repository": args.repository,
            "created_config": published.created_config,
            "serving_version": published.serving,
            "rollout": rollout.as_ref().map(Rollout::to_json),
            "approve_command": (info.status != Status::Approved).then_some(&approve_command),
        });
        println!("{summary}");
    }
    Ok(code)
}

pub fn set(args: &StatusArgs, status: Status) -> Result<i32> {
    let repo = Repository::open(&args.repository)?;
    let serving = recsys_registry::status::set_status(&repo, &args.model, args.version, status)?;
    if !args.json {
        println!(
            "{} version {} is {status}; the newest approved version is {serving}",
            args.model, args.version
        );
    }
    let rollout = roll_out(&args.servers, args.rollout, &args.model, serving, args.json)?;
    let verb = if status == Status::Approved {
        "approve"
    } else {
        "reject"
    };
    let retry = command_line(
        verb,
        &args.repository,
        &args.model,
        args.version,
        &args.servers,
    );
    let code = finish(&rollout, args.json, &retry);
    if args.json {
        let summary = serde_json::json!({
            "model": args.model,
            "version": args.version,
            "status": status.to_string(),
            "serving_version": serving,
            "rollout": rollout.as_ref().map(Rollout::to_json),
        });
        println!("{summary}");
    }
    Ok(code)
}

pub fn list(args: &VersionsArgs) -> Result<i32> {
    let repo = Repository::open(&args.repository)?;
    let versions = records::list(&repo, &args.model)?;
    let newest_approved = records::serving(&versions);
    // What the replicas load is what the config names; say so when it lags the records (a
    // command stopped between its two writes).
    let config = repo
        .read(&format!("{}/{CONFIG_FILE}", args.model))?
        .and_then(|o| String::from_utf8(o.bytes).ok());
    let configured = config.as_deref().and_then(policy_versions);
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "model": args.model,
                "repository": args.repository,
                "config_versions": configured,
                "newest_approved": newest_approved,
                "versions": versions,
            }))
            .expect("serialisable")
        );
        return Ok(0);
    }
    println!(
        "{:<8} {:<10} {:<8} {:<9} {:<22} {:<20}",
        "version", "status", "serving", "precision", "ndcg@10 / recall@10", "created"
    );
    for v in &versions {
        let metric = |k: &str| {
            v.metrics
                .as_ref()
                .and_then(|m| m.get("metrics").unwrap_or(m).get(k))
                .and_then(|x| x.as_f64())
                .map_or("-".to_string(), |x| format!("{x:.4}"))
        };
        let serving = configured.as_ref().is_some_and(|c| c.contains(&v.version));
        println!(
            "{:<8} {:<10} {:<8} {:<9} {:<22} {:<20}",
            v.version,
            v.status.to_string(),
            if serving { "yes" } else { "" },
            v.precision,
            format!("{} / {}", metric("ndcg@10"), metric("recall@10")),
            v.created_at
        );
    }
    match (&configured, newest_approved) {
        (Some(c), Some(n)) if c.as_slice() != [n] => eprintln!(
            "note: {CONFIG_FILE} names version(s) {c:?} but the newest approved version is {n} \
             (a command stopped between its two writes); `{}` finishes the switch",
            command_line("approve", &args.repository, &args.model, n, &[])
        ),
        _ => {}
    }
    Ok(0)
}
