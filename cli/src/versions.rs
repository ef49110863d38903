//! `recsys publish | approve | reject | rollback | versions`: the registry (recsys-registry) driven
//! from the command line, with a line per gate and per replica as each finishes.

use crate::output::{say, tell};
use std::time::Duration;

use recsys_registry::config::{policy_versions, CONFIG_FILE};
use recsys_registry::lease::LeaseOptions;
use recsys_registry::publish::PublishRequest;
use recsys_registry::pushgateway;
use recsys_registry::release::{self, Fleet, Release, Step};
use recsys_registry::replicas::{Outcome, ReplicaReport, Rollout};
use recsys_registry::{versions as records, Repository, Status};

use crate::cli::{
    FleetArgs, LeaseArgs, PublishArgs, QualityArgs, RollbackArgs, RolloutArg, StatusArgs,
    VersionsArgs,
};
use crate::error::{CliError, Result};
use crate::exit::{
    CANARY_STRANDED_EXIT, FAILED_AFTER_SWITCH_EXIT, LEASE_LOST_EXIT, PARTIAL_ROLLOUT_EXIT,
    REFUSED_EXIT, ROLLED_BACK_EXIT, SUPERSEDED_EXIT,
};

fn print_replica(r: &ReplicaReport, model: &str, version: u64) {
    match &r.outcome {
        Outcome::Serving if !r.reloaded => {
            say!("{} already serves {model} version {version}", r.server)
        }
        Outcome::Serving => say!(
            "{} now serves {model} version {version} ({:.1} s)",
            r.server,
            r.seconds
        ),
        Outcome::Failed(e) => say!("{} FAILED: {e}", r.server),
        Outcome::Unreachable(e) => say!(
            "{} unreachable (starting, stopping or gone; it loads what the repository names when \
             it starts): {e}",
            r.server
        ),
        Outcome::NotAttempted => say!(
            "{} not attempted: the rollout stops at the first failure (--rollout continue goes on)",
            r.server
        ),
        Outcome::Stopped(e) => say!("{} left alone: {e}", r.server),
    }
}

/// Progress lines as the gates and replicas finish, unless `quiet`.
fn reporter(model: &str, quiet: bool) -> impl FnMut(Step<'_>) + '_ {
    move |step| {
        if quiet {
            return;
        }
        match step {
            Step::WaitingForLease(held) => say!(
                "waiting for the lease on {model}: held by {}",
                held.describe()
            ),
            Step::Verifying { version } => {
                say!("verifying {model} version {version}: every stored file against its SHA-256")
            }
            Step::Verified { version, verified } => say!(
                "{model} version {version} verified: {} files, {} bytes",
                verified.files,
                verified.bytes
            ),
            Step::Canary(report) => {
                if let Some(q) = &report.quality {
                    print_quality(q);
                }
                match &report.result {
                    Ok(()) => say!(
                        "canary {} loaded the version and passed its self-check ({:.1} s){}",
                        report.server,
                        report.seconds,
                        match &report.restored {
                            Ok(()) => String::new(),
                            Err(e) => format!("; it was not put back: {e}"),
                        }
                    ),
                    Err(e) => say!("canary {} FAILED: {e}", report.server),
                }
            }
            Step::Replica { version, report }
            | Step::RolledBack { version, report }
            | Step::Reconciled { version, report } => print_replica(report, model, version),
            Step::RollingBack { to, reason } => {
                say!("rolling back to {model} version {to}: {reason}")
            }
            Step::Reconciling { version } => {
                say!("reconciling: every replica against {CONFIG_FILE} (version {version})")
            }
        }
    }
}

/// Pushes a release command's outcome when a Pushgateway is named (`--pushgateway`, else
/// `RECSYS_PUSHGATEWAY`). `outcome` is the command's own result: a release, or the error it ended
/// with (then the version the config names is read from the repository, when it can be).
fn push_outcome(
    gateway: Option<&str>,
    repo: &Repository,
    model: &str,
    command: &str,
    outcome: std::result::Result<(&Release, i32), &CliError>,
) {
    let from_env = std::env::var("RECSYS_PUSHGATEWAY").ok();
    let Some(gateway) = gateway.or(from_env.as_deref()).filter(|g| !g.is_empty()) else {
        return;
    };
    let pushed = match outcome {
        Ok((release, code)) => pushgateway::Outcome::of(release, command, code),
        Err(e) => pushgateway::Outcome {
            model,
            command,
            exit_code: e.exit_code(),
            repository_version: configured_version(repo, model),
            replicas: None,
        },
    };
    pushgateway::push(gateway, &pushed);
}

/// The one version config.pbtxt names, if it can be read.
fn configured_version(repo: &Repository, model: &str) -> Option<u64> {
    let config = repo.read(&format!("{model}/{CONFIG_FILE}")).ok()??;
    match policy_versions(&String::from_utf8_lossy(&config.bytes))?.as_slice() {
        [one] => Some(*one),
        _ => None,
    }
}

/// The quality gate's numbers, one line.
fn print_quality(q: &recsys_registry::quality::QualityReport) {
    let ndcg = |n: Option<f64>| n.map_or("-".to_string(), |n| format!("{n:.4}"));
    let against = match &q.serving {
        Some(s) => format!(" against version {}'s {}", s.version, ndcg(s.ndcg_at_10)),
        None => match &q.serving_unscored {
            Some(why) => format!(" (not compared: {why})"),
            None => " (nothing serves yet to compare with)".into(),
        },
    };
    say!(
        "quality gate: version {} NDCG@10 {}{against}, {:.0}% flat answers ({}){}",
        q.candidate.version,
        ndcg(q.candidate.ndcg_at_10),
        q.candidate.degenerate_share * 100.0,
        q.source,
        if q.refused.is_some() {
            ": REFUSED"
        } else {
            ": passed"
        }
    );
}

fn quality_options(args: &QualityArgs) -> recsys_registry::quality::QualityOptions {
    recsys_registry::quality::QualityOptions {
        skip: args.skip_quality_gate,
        max_drop: args.max_ndcg_drop,
        histories: args.quality_histories as usize,
    }
}

fn lease_options(args: &LeaseArgs, command: String) -> LeaseOptions {
    LeaseOptions {
        command,
        ttl: recsys_registry::lease::LEASE_TTL,
        wait: Duration::from_secs(args.lease_wait),
        force: args.force,
    }
}

fn fleet<'a>(args: &'a FleetArgs, quality: Option<&QualityArgs>, command: String) -> Fleet<'a> {
    Fleet {
        servers: &args.servers,
        servers_file: args.servers_file.as_deref(),
        canary: args.canary.as_deref(),
        canary_on_traffic: args.canary_on_traffic,
        continue_after_failure: args.rollout == RolloutArg::Continue,
        reload_timeout: Duration::from_secs(args.reload_timeout),
        lease: lease_options(&args.lease, command),
        quality: quality.map(quality_options).unwrap_or_default(),
    }
}

/// Replicas of a report that do not serve its version, as "server (outcome)".
fn behind(report: &Rollout) -> Vec<String> {
    report
        .replicas
        .iter()
        .filter(|r| r.outcome != Outcome::Serving)
        .map(|r| format!("{} ({})", r.server, r.outcome.name()))
        .collect()
}

/// The exit status of a release, with the explanation on stderr unless `quiet`.
fn finish(release: &Release, quiet: bool, retry: &str) -> i32 {
    let say = |text: String| {
        if !quiet {
            tell!("{text}");
        }
    };
    if let Some(reason) = &release.lease_lost {
        say(format!(
            "stopped: {reason}\nnothing was written after the lease was lost; the command that \
             holds it now decides what the fleet serves (`recsys versions` shows the repository)"
        ));
        return LEASE_LOST_EXIT;
    }
    if let Some(reason) = &release.superseded {
        say(format!(
            "stopped: {reason}\nthe command that took over brings the fleet onto what the \
             repository names; `recsys versions` shows it"
        ));
        return SUPERSEDED_EXIT;
    }
    if let Some(error) = &release.failed_after_switch {
        let config = match release.serving {
            Some(v) => format!("{CONFIG_FILE} names version {v}"),
            None => format!(
                "the version records changed, and whether {CONFIG_FILE} was switched is not known \
                 (`recsys versions` shows both)"
            ),
        };
        say(format!(
            "failed after the repository began to change: {error}\n{config}; the report above \
             says which replicas were reached. Once the store or the fleet is reachable, run the \
             command again to finish:\n  {retry}"
        ));
        return FAILED_AFTER_SWITCH_EXIT;
    }
    if let Some(note) = &release.canary_stranded {
        say(format!(
            "{note}\nbring it back with `recsys approve` once it is healthy, or restart it (it \
             loads what the repository names)"
        ));
        return CANARY_STRANDED_EXIT;
    }
    if let Some(reason) = &release.refused {
        say(format!(
            "refused: {reason}\nnothing changed: the repository is as it was and every replica \
             serves what it names (`recsys versions` shows the reason on the version)"
        ));
        return REFUSED_EXIT;
    }
    if let Some(reason) = &release.rollback_reason {
        let converged =
            release.fleet_converged() && release.rolled_back.as_ref().is_some_and(|b| !b.failed());
        say(format!(
            "rolled back: {reason}\nthe repository names version {} again{}; version {} is \
             marked rolled-back (approve it again once the replicas are healthy)",
            release.serving.unwrap_or_default(),
            if converged {
                " and every replica serves it"
            } else {
                ", but not every replica could be put back (see above)"
            },
            release.version
        ));
        return ROLLED_BACK_EXIT;
    }
    let Some(reconciled) = &release.reconciled else {
        return 0;
    };
    if reconciled.complete() {
        return 0;
    }
    say(format!(
        "partial rollout: {} of {} replicas serve {} version {}; not: {}. The repository names \
         it, so a replica that starts loads it. Once the others are back, run the command \
         again to finish:\n  {retry}",
        reconciled.serving(),
        reconciled.replicas.len(),
        reconciled.model,
        reconciled.version,
        behind(reconciled).join(", ")
    ));
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
    fleet: &FleetArgs,
) -> String {
    let mut line = format!(
        "recsys {verb} --repository {} --model {} --version {version}",
        shell_word(repository),
        shell_word(model)
    );
    push_fleet(&mut line, fleet);
    line
}

/// The fleet flags of a command, for a command line to paste.
fn push_fleet(line: &mut String, fleet: &FleetArgs) {
    for server in &fleet.servers {
        line.push_str(&format!(" --server {}", shell_word(server)));
    }
    if let Some(file) = &fleet.servers_file {
        line.push_str(&format!(
            " --servers-file {}",
            shell_word(&file.display().to_string())
        ));
    }
    if let Some(canary) = &fleet.canary {
        line.push_str(&format!(" --canary {}", shell_word(canary)));
    }
    if fleet.canary_on_traffic {
        line.push_str(" --canary-on-traffic");
    }
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
    let request = PublishRequest {
        model: &args.model,
        engine_dir: &args.engine,
        approve: args.approve,
        metrics,
        eval_set: args.eval_set.as_deref(),
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
            &fleet(
                &args.fleet,
                Some(&args.quality),
                format!("publish --approve --engine {}", args.engine.display()),
            ),
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
    // A plain publish changes no fleet: only publish --approve reports to the Pushgateway.
    let gateway = args.fleet.pushgateway.as_deref();
    let (info, release) = published.map_err(|e| {
        let e = CliError::from(e);
        if args.approve {
            push_outcome(gateway, &repo, &args.model, "publish", Err(&e));
        }
        e
    })?;
    let approve_command = command_line(
        "approve",
        &args.repository,
        &args.model,
        info.version,
        &args.fleet,
    );
    let code = match &release {
        Some(release) => finish(release, args.json, &approve_command),
        None => 0,
    };
    if let Some(release) = &release {
        push_outcome(gateway, &repo, &args.model, "publish", Ok((release, code)));
    }
    if !args.json {
        if release.as_ref().is_some_and(|r| r.created_config) {
            say!(
                "{}/{}/{CONFIG_FILE} did not exist: wrote a minimal one (backend \"recsys\", max_batch_size {})",
                args.repository.trim_end_matches('/'),
                args.model,
                args.max_batch_size
            );
        }
        say!(
            "published {} version {} ({}, {} {}) from {}",
            args.model,
            info.version,
            info.status,
            info.model_kind,
            info.precision,
            args.engine.display()
        );
        if info.status == Status::Pending && release.is_none() {
            say!(
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
        say!("{summary}");
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
        say!("{summary}");
    } else if release.refused.is_none() {
        if let Some(serving) = release.serving {
            say!(
                "{} version {} is {what}; the repository names version {serving}",
                release.model,
                release.version
            );
        }
    }
    code
}

pub fn set(args: &StatusArgs, status: Status) -> Result<i32> {
    let repo = Repository::open(&args.repository)?;
    let verb = if status == Status::Approved {
        "approve"
    } else {
        "reject"
    };
    let fleet = fleet(
        &args.fleet,
        Some(&args.quality),
        format!("{verb} --version {}", args.version),
    );
    let mut report = reporter(&args.model, args.json);
    let done = if status == Status::Approved {
        release::approve(
            &repo,
            &args.model,
            args.version,
            &fleet,
            args.max_batch_size,
            &mut report,
        )
    } else {
        release::reject(&repo, &args.model, args.version, &fleet, &mut report)
    };
    let gateway = args.fleet.pushgateway.as_deref();
    let release = done.map_err(|e| {
        let e = CliError::from(e);
        push_outcome(gateway, &repo, &args.model, verb, Err(&e));
        e
    })?;
    let retry = command_line(
        verb,
        &args.repository,
        &args.model,
        args.version,
        &args.fleet,
    );
    let what = if release.rollback_reason.is_some() {
        "rolled-back".to_string()
    } else {
        status.to_string()
    };
    let code = conclude(&release, args.json, &what, &retry);
    push_outcome(gateway, &repo, &args.model, verb, Ok((&release, code)));
    Ok(code)
}

pub fn rollback(args: &RollbackArgs) -> Result<i32> {
    let repo = Repository::open(&args.repository)?;
    let mut report = reporter(&args.model, args.json);
    let command = match args.to {
        Some(to) => format!("rollback --to {to}"),
        None => "rollback".to_string(),
    };
    let gateway = args.fleet.pushgateway.as_deref();
    let release = release::rollback(
        &repo,
        &args.model,
        args.to,
        &fleet(&args.fleet, None, command),
        &mut report,
    )
    .map_err(|e| {
        let e = CliError::from(e);
        push_outcome(gateway, &repo, &args.model, "rollback", Err(&e));
        e
    })?;
    let mut retry = format!(
        "recsys rollback --repository {} --model {}",
        shell_word(&args.repository),
        shell_word(&args.model)
    );
    if let Some(to) = release.serving {
        retry.push_str(&format!(" --to {to}"));
    }
    push_fleet(&mut retry, &args.fleet);
    if !args.json && release.refused.is_none() {
        say!(
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
        say!("{summary}");
    }
    push_outcome(
        gateway,
        &repo,
        &args.model,
        "rollback",
        Ok((&release, code)),
    );
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
    let lease = recsys_registry::lease::current(&repo, &args.model)?;
    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "model": args.model,
                "repository": args.repository,
                "config_versions": configured,
                "newest_approved": newest_approved,
                "lease": lease,
                "versions": versions,
            }))
            .expect("serialisable")
        );
        return Ok(0);
    }
    say!(
        "{:<8} {:<12} {:<8} {:<9} {:<22} {:<21} note",
        "version",
        "status",
        "serving",
        "precision",
        "ndcg@10 / recall@10",
        "created"
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
        say!(
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
        (Some(c), Some(n)) if c.as_slice() != [n] => tell!(
            "note: {CONFIG_FILE} names version(s) {c:?} but the newest approved version is {n} \
             (a command stopped between its two writes); `recsys approve --repository {} \
             --model {} --version {n}` finishes the switch",
            shell_word(&args.repository),
            shell_word(&args.model)
        ),
        _ => {}
    }
    if let Some(lease) = lease {
        tell!("note: the fleet's lease is held by {}", lease.describe());
    }
    Ok(0)
}

fn prune(args: &VersionsArgs, repo: &Repository, keep: usize) -> Result<i32> {
    let replicas = recsys_registry::replicas::expand(&args.servers)?;
    let request = recsys_registry::prune::PruneRequest {
        model: &args.model,
        keep,
        dry_run: args.dry_run,
        replicas: &replicas,
        lease: lease_options(&args.lease, format!("versions --prune --keep {keep}")),
    };
    let pruned = recsys_registry::prune::prune(
        repo,
        &request,
        &mut |server, e| {
            tell!("note: {server} is unreachable, so its loaded versions are not known: {e}")
        },
        &mut |v| {
            if !args.json {
                say!("removed {} version {v}", args.model);
            }
        },
    )?;
    if args.json {
        say!(
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
            say!("would remove {} version {v}", args.model);
        }
    }
    for (v, why) in &pruned.kept {
        say!("kept {} version {v}: {why}", args.model);
    }
    if pruned.removed.is_empty() {
        say!("nothing to prune: {} keeps its {keep} newest versions and every version that serves or may serve next", args.model);
    }
    Ok(0)
}
