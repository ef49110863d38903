//! `recsys publish | approve | reject | versions`.

use std::time::Duration;

use crate::cli::{PublishArgs, StatusArgs, VersionsArgs};
use crate::error::{CliError, Result};
use crate::registry::{self, Status};

const RELOAD_TIMEOUT: Duration = Duration::from_secs(120);

fn reload(server: &Option<String>, model: &str, version: u64) -> Result<()> {
    if let Some(server) = server {
        registry::reload_and_wait(server, model, version, RELOAD_TIMEOUT)?;
        println!("{server} now serves {model} version {version}");
    }
    Ok(())
}

pub fn publish(args: &PublishArgs) -> Result<i32> {
    let metrics = match &args.metrics {
        None => None,
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(CliError::io(format!("cannot read {}", path.display())))?;
            Some(
                serde_json::from_str(&text)
                    .map_err(|e| CliError::Usage(format!("{} is not JSON: {e}", path.display())))?,
            )
        }
    };
    let model_dir = args.repository.join(&args.model);
    let info = registry::publish(&model_dir, &args.engine, args.approve, metrics)?;
    println!(
        "published {} version {} ({}, {} {}) from {}",
        args.model,
        info.version,
        info.status,
        info.model_kind,
        info.precision,
        args.engine.display()
    );
    if info.status == Status::Approved {
        reload(&args.server, &args.model, info.version)?;
    } else {
        println!(
            "version {} is pending: `recsys approve --version {}` makes it serve",
            info.version, info.version
        );
    }
    Ok(0)
}

pub fn set(args: &StatusArgs, status: Status) -> Result<i32> {
    let model_dir = args.repository.join(&args.model);
    let serving = registry::set_status(&model_dir, args.version, status)?;
    println!(
        "{} version {} is {status}; the newest approved version is {serving}",
        args.model, args.version
    );
    reload(&args.server, &args.model, serving)?;
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
