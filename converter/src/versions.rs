//! `recsys publish | approve | reject | versions`.

use std::time::Duration;

use crate::cli::{PublishArgs, StatusArgs, VersionsArgs};
use crate::error::{CliError, Result};
use crate::registry::{self, Status};

const RELOAD_TIMEOUT: Duration = Duration::from_secs(120);

/// Reloads the model on `server` (if given) and waits until `version` serves; returns the server.
fn reload(
    server: &Option<String>,
    model: &str,
    version: u64,
    quiet: bool,
) -> Result<Option<String>> {
    if let Some(server) = server {
        registry::reload_and_wait(server, model, version, RELOAD_TIMEOUT)?;
        if !quiet {
            println!("{server} now serves {model} version {version}");
        }
    }
    Ok(server.clone())
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
    let model_dir = args.repository.join(&args.model);
    let published = registry::publish(
        &model_dir,
        &args.engine,
        args.approve,
        metrics,
        args.max_batch_size,
    )?;
    let info = &published.info;
    let approve_command = format!(
        "recsys approve --repository {} --model {} --version {}",
        shell_word(&args.repository.display().to_string()),
        shell_word(&args.model),
        info.version
    );
    if !args.json {
        if let Some(config) = &published.created_config {
            println!(
                "{} had no config.pbtxt: wrote a minimal one (backend \"recsys\", max_batch_size {})",
                config.display(),
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
    let reloaded = if info.status == Status::Approved {
        reload(&args.server, &args.model, info.version, args.json)?
    } else {
        None
    };
    if args.json {
        let summary = serde_json::json!({
            "model": args.model,
            "version": info.version,
            "status": info.status.to_string(),
            "kind": info.model_kind,
            "precision": info.precision,
            "engine": args.engine,
            "created_config": published.created_config,
            "served_by": reloaded,
            "approve_command": (info.status != Status::Approved).then_some(&approve_command),
        });
        println!("{summary}");
    }
    Ok(0)
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

pub fn set(args: &StatusArgs, status: Status) -> Result<i32> {
    let model_dir = args.repository.join(&args.model);
    let serving = registry::set_status(&model_dir, args.version, status)?;
    let reloaded = reload(&args.server, &args.model, serving, args.json)?;
    if args.json {
        let summary = serde_json::json!({
            "model": args.model,
            "version": args.version,
            "status": status.to_string(),
            "serving_version": serving,
            "served_by": reloaded,
        });
        println!("{summary}");
    } else {
        println!(
            "{} version {} is {status}; the newest approved version is {serving}",
            args.model, args.version
        );
    }
    Ok(0)
}

pub fn list(args: &VersionsArgs) -> Result<i32> {
    let model_dir = args.repository.join(&args.model);
    let versions = registry::list(&model_dir)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&versions).expect("serialisable")
        );
        return Ok(0);
    }
    let serving = registry::serving(&versions);
    println!(
        "{:<8} {:<9} {:<8} {:<9} {:<22} {:<20}",
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
        println!(
            "{:<8} {:<9} {:<8} {:<9} {:<22} {:<20}",
            v.version,
            v.status.to_string(),
            if Some(v.version) == serving {
                "yes"
            } else {
                ""
            },
            v.precision,
            format!("{} / {}", metric("ndcg@10"), metric("recall@10")),
            v.created_at
        );
    }
    Ok(0)
}
