//! `recsys publish | approve | reject | rollback | versions`: the registry (recsys-registry) driven
//! from the command line, with a line per gate and per replica as each finishes.

use std::time::Duration;

use recsys_registry::config::{policy_versions, CONFIG_FILE};
use recsys_registry::publish::PublishRequest;
use recsys_registry::release::{self, Fleet, Release, Step};
use recsys_registry::replicas::{self, Outcome, ReplicaReport};
use recsys_registry::{versions as records, Repository, Status};

use crate::cli::{PublishArgs, RollbackArgs, RolloutArg, StatusArgs, VersionsArgs};
use crate::error::{CliError, Result};

const RELOAD_TIMEOUT: Duration = Duration::from_secs(120);

/// A gate refused the version: nothing changed (the reason is recorded on the version).
pub const REFUSED_EXIT: i32 = 3;
/// The repository changed but not every replica serves the version (`--rollout continue`, or a
/// failed rollout with no previous version to go back to).
pub const PARTIAL_ROLLOUT_EXIT: i32 = 4;
/// A replica failed after the switch and the command rolled itself back.
pub const ROLLED_BACK_EXIT: i32 = 5;

fn print_replica(r: &ReplicaReport, model: &str, version: u64) {
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
}

/// Progress lines as the gates and replicas finish, unless `quiet`.
fn reporter(model: &str, quiet: bool) -> impl FnMut(Step<'_>) + '_ {
    move |step| {
        if quiet {
            return;
        }
        match step {
            Step::Verifying { version } => println!(
                "verifying {model} version {version}: every stored file against its SHA-256"
            ),
            Step::Verified { version, verified } => println!(
                "{model} version {version} verified: {} files, {} bytes",
                verified.files, verified.bytes
            ),
            Step::Canary(report) => match &report.result {
                Ok(()) => println!(
                    "canary {} loaded the version and passed its self-check ({:.1} s){}",
                    report.server,
                    report.seconds,
                    match &report.restored {
                        Ok(()) => String::new(),
                        Err(e) => format!("; it was not put back: {e}"),
                    }
                ),
                Err(e) => println!("canary {} FAILED: {e}", report.server),
            },
            Step::Replica { version, report } | Step::RolledBack { version, report } => {
                print_replica(report, model, version)
            }
            Step::RollingBack { to, reason } => {
                println!("rolling back to {model} version {to}: {reason}")
            }
        }
    }
}

fn fleet<'a>(replicas: &'a [String], rollout: RolloutArg) -> Fleet<'a> {
    Fleet {
        replicas,
        continue_after_failure: rollout == RolloutArg::Continue,
        reload_timeout: RELOAD_TIMEOUT,
    }
}

/// The exit status of a release, with the explanation on stderr unless `quiet`.
fn finish(release: &Release, quiet: bool, retry: &str) -> i32 {
    if let Some(reason) = &release.refused {
        if !quiet {
            eprintln!(
                "refused: {reason}
nothing changed: the repository and every replica are as they \
                 were (`recsys versions` shows the reason on the version)"
            );
        }
        return REFUSED_EXIT;
    }
    if let Some(reason) = &release.rollback_reason {
        if !quiet {
            let back = release.rolled_back.as_ref();
            let ok = back.is_some_and(|b| b.complete());
            eprintln!(
                "rolled back: {reason}
the repository names version {} again{}; version {} is \
                 marked rolled-back (approve it again once the replicas are healthy)",
                release.serving.unwrap_or_default(),
                if ok {
                    " and every replica the rollout reached serves it"
                } else {
                    ", but not every replica the rollout reached could be put back (see above)"
                },
                release.version
            );
        }
        return ROLLED_BACK_EXIT;
    }
    let Some(report) = &release.rollout else {
        return 0;
    };
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
    let replicas = if args.approve {
        replicas::expand(&args.fleet.servers)?
    } else {
        Vec::new()
    };
    let bar = crate::progress::bytes(0);
    bar.set_message(format!("uploading {}", args.engine.display()));
    let request = PublishRequest {
        model: &args.model,
        engine_dir: &args.engine,
        approve: args.approve,
        metrics,
    };
    let mut upload_progress = |sent, total| {
        bar.set_length(total);
        bar.set_position(sent);
    };
    let published = if args.approve {
        let mut first_step = true;
        let mut report = reporter(&args.model, args.json);
        release::publish_and_approve(
            &repo,
            &request,
            args.max_batch_size,
            &fleet(&replicas, args.fleet.rollout),
            &mut upload_progress,
            &mut |step| {
                if std::mem::take(&mut first_step) {
                    bar.finish_and_clear();
                }
                report(step)
            },
        )
        .map(|(info, release)| (info, Some(release)))
    } else {
        recsys_registry::publish::publish(&repo, &request, &mut upload_progress)
            .map(|info| (info, None))
    };
    bar.finish_and_clear();
    let (info, release) = published?;
    let approve_command = command_line(
        "approve",
        &args.repository,
        &args.model,
        info.version,
        &args.fleet.servers,
    );
    let code = match &release {
        Some(release) => finish(release, args.json, &approve_command),
        None => 0,
    };
    if !args.json {
        if release.as_ref().is_some_and(|r| r.created_config) {
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
        if info.status == Status::Pending && release.is_none() {
            println!(
                "version {} is pending; to serve it:\n  {approve_command}",
                info.version
            );
        }
    } else {
        let serving = match &release {
            Some(r) => r.serving.or(r.serving_before),
            None => records::serving(&records::list(&repo, &args.model)?),
        };
        let summary = serde_json::json!({
            "model": args.model,
            "version": info.version,
            "status": info.status.to_string(),
            "kind": info.model_kind,
            "precision": info.precision,
            "engine": args.engine,
            "repository": args.repository,
            "created_config": release.as_ref().is_some_and(|r| r.created_config),
            "serving_version": serving,
            "release": release.as_ref().map(Release::to_json),
            "rollout": release.as_ref().and_then(|r| r.rollout.as_ref()).map(|r| r.to_json()),
            "approve_command": (info.status != Status::Approved).then_some(&approve_command),
            "exit_code": code,
        });
        println!("{summary}");
    }
    Ok(code)
}

/// Prints a release's outcome as JSON, or its summary line.
fn conclude(release: &Release, json: bool, what: &str, retry: &str) -> i32 {
    let code = finish(release, json, retry);
    if json {
        let mut summary = release.to_json();
        summary["status"] = serde_json::json!(what);
        summary["exit_code"] = serde_json::json!(code);
        println!("{summary}");
    } else if release.refused.is_none() {
        if let Some(serving) = release.serving {
            println!(
                "{} version {} is {what}; the repository names version {serving}",
                release.model, release.version
            );
        }
    }
    code
}

pub fn set(args: &StatusArgs, status: Status) -> Result<i32> {
    let repo = Repository::open(&args.repository)?;
    let replicas = replicas::expand(&args.fleet.servers)?;
    let fleet = fleet(&replicas, args.fleet.rollout);
    let mut report = reporter(&args.model, args.json);
    let (release, verb) = if status == Status::Approved {
        (
            release::approve(
                &repo,
                &args.model,
                args.version,
                &fleet,
                args.max_batch_size,
                &mut report,
            )?,
            "approve",
        )
    } else {
        (
            release::reject(&repo, &args.model, args.version, &fleet, &mut report)?,
            "reject",
        )
    };
    let retry = command_line(
        verb,
        &args.repository,
        &args.model,
        args.version,
        &args.fleet.servers,
    );
    let what = if release.rollback_reason.is_some() {
        "rolled-back".to_string()
    } else {
        status.to_string()
    };
    Ok(conclude(&release, args.json, &what, &retry))
}

pub fn rollback(args: &RollbackArgs) -> Result<i32> {
    let repo = Repository::open(&args.repository)?;
    let replicas = replicas::expand(&args.fleet.servers)?;
    let mut report = reporter(&args.model, args.json);
    let release = release::rollback(
        &repo,
        &args.model,
        args.to,
        &fleet(&replicas, args.fleet.rollout),
        &mut report,
    )?;
    let mut retry = format!(
        "recsys rollback --repository {} --model {}",
        shell_word(&args.repository),
        shell_word(&args.model)
    );
    if let Some(to) = release.serving {
        retry.push_str(&format!(" --to {to}"));
    }
    for server in &args.fleet.servers {
        retry.push_str(&format!(" --server {}", shell_word(server)));
    }
    if !args.json && release.refused.is_none() {
        println!(
            "{} rolled back from version {} to version {}",
            args.model,
            release.version,
            release.serving.unwrap_or_default()
        );
    }
    let code = finish(&release, args.json, &retry);
    if args.json {
        let mut summary = release.to_json();
        summary["exit_code"] = serde_json::json!(code);
        println!("{summary}");
    }
    Ok(code)
}

pub fn list(args: &VersionsArgs) -> Result<i32> {
    let repo = Repository::open(&args.repository)?;
    if let Some(keep) = args.keep {
        return prune(args, &repo, keep as usize);
    }
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
        "{:<8} {:<12} {:<8} {:<9} {:<22} {:<21} note",
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
            "{:<8} {:<12} {:<8} {:<9} {:<22} {:<21} {}",
            v.version,
            v.status.to_string(),
            if serving { "yes" } else { "" },
            v.precision,
            format!("{} / {}", metric("ndcg@10"), metric("recall@10")),
            v.created_at,
            v.last_failure.as_deref().unwrap_or("")
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

fn prune(args: &VersionsArgs, repo: &Repository, keep: usize) -> Result<i32> {
    let pruned = recsys_registry::prune::prune(repo, &args.model, keep, args.dry_run, &mut |v| {
        if !args.json {
            println!("removed {} version {v}", args.model);
        }
    })?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "model": args.model,
                "dry_run": args.dry_run,
                "removed": pruned.removed,
                "kept": pruned.kept.iter().map(|(v, why)| serde_json::json!({"version": v, "why": why})).collect::<Vec<_>>(),
            })
        );
        return Ok(0);
    }
    if args.dry_run {
        for v in &pruned.removed {
            println!("would remove {} version {v}", args.model);
        }
    }
    for (v, why) in &pruned.kept {
        println!("kept {} version {v}: {why}", args.model);
    }
    if pruned.removed.is_empty() {
        println!("nothing to prune: {} keeps its {keep} newest versions and every version that serves or may serve next", args.model);
    }
    Ok(0)
}
