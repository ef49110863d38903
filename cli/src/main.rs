//! `recsys`: turn trained recommender checkpoints into serving engines, score users offline and
//! evaluate ranking quality.
#![forbid(unsafe_code)]

mod attributes;
mod availability;
mod catalogue;
mod catalogue_table;
mod cli;
mod convert;
mod docs;
mod error;
mod eval;
mod exit;
mod export_items;
mod export_onnx;
mod output;
mod predict;
mod progress;
mod sweep;
mod sweep_chart;
mod versions;

use clap::Parser;

use crate::output::{say, tell};

/// Whether the command line asks for JSON output: then a failure is one JSON object on stdout
/// too, so a script reading stdout always gets something parseable.
fn wants_json() -> bool {
    std::env::args().skip(1).any(|a| a == "--json")
}

fn fail_json(error: &str, exit_code: i32) {
    if wants_json() {
        say!(
            "{}",
            serde_json::json!({ "error": error, "exit_code": exit_code })
        );
    }
}

fn main() {
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = e.exit_code();
            if e.use_stderr() {
                fail_json(e.render().to_string().trim(), code);
            }
            e.exit();
        }
    };
    let code = match cli.command {
        cli::Command::Convert(args) => convert::run(&args),
        cli::Command::Predict(args) => predict::run(&args),
        cli::Command::Eval(args) => eval::run(&args),
        cli::Command::Publish(args) => versions::publish(&args),
        cli::Command::Approve(args) => versions::set(&args, recsys_registry::Status::Approved),
        cli::Command::Reject(args) => versions::set(&args, recsys_registry::Status::Rejected),
        cli::Command::Rollback(args) => versions::rollback(&args),
        cli::Command::Versions(args) => versions::list(&args),
        cli::Command::Sweep(args) => sweep::run(&args),
        cli::Command::ExportOnnx(args) => export_onnx::run(&args),
        cli::Command::ExportItems(args) => export_items::run(&args),
        cli::Command::Availability(cli::AvailabilityCommand::Publish(args)) => {
            availability::publish(&args)
        }
        cli::Command::Availability(cli::AvailabilityCommand::Show(args)) => {
            availability::show(&args)
        }
        cli::Command::Catalogue(cli::CatalogueCommand::Publish(args)) => catalogue::publish(&args),
        cli::Command::Catalogue(cli::CatalogueCommand::Show(args)) => catalogue::show(&args),
        cli::Command::Catalogue(cli::CatalogueCommand::Compact(args)) => catalogue::compact(&args),
        cli::Command::Catalogue(cli::CatalogueCommand::FoldIn(args)) => catalogue::fold_in(&args),
        cli::Command::Completions(args) => docs::completions(&args),
        cli::Command::Man(args) => docs::man(&args),
    };
    match code {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            fail_json(&e.to_string(), e.exit_code());
            tell!("error: {e}");
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                tell!("  caused by: {cause}");
                source = cause.source();
            }
            std::process::exit(e.exit_code());
        }
    }
}
