//! `starling-hub`: parses the command line and runs it; errors are reported with their
//! causes and a non-zero exit code.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = starling_hub::cli::Cli::parse();
    match starling_hub::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
