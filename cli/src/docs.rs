//! `recsys completions | man`: shell completion scripts and manual pages, generated from the
//! command-line definitions themselves (so they never drift from `--help`).

use clap::CommandFactory;

use crate::cli::{Cli, CompletionsArgs, ManArgs};
use crate::error::{CliError, Result};
use crate::output::tell;

pub fn completions(args: &CompletionsArgs) -> Result<i32> {
    let mut command = Cli::command();
    clap_complete::generate(args.shell, &mut command, "recsys", &mut std::io::stdout());
    Ok(0)
}

pub fn man(args: &ManArgs) -> Result<i32> {
    std::fs::create_dir_all(&args.output).map_err(CliError::io(format!(
        "cannot create {}",
        args.output.display()
    )))?;
    clap_mangen::generate_to(Cli::command(), &args.output).map_err(CliError::io(format!(
        "cannot write the manual pages to {}",
        args.output.display()
    )))?;
    let pages = std::fs::read_dir(&args.output)
        .map(|d| d.filter_map(|e| e.ok()).count())
        .unwrap_or(0);
    tell!("wrote {pages} manual page(s) to {}", args.output.display());
    Ok(0)
}
