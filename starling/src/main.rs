//! `starling`: every Starling role in one binary, and `starling demo`, the RL run on one
//! machine.
//!
//! `starling hub …`, `starling relay …` and `starling actor …` take exactly the arguments of
//! `starling-hub`, `starling-relay` and `starling-actor` (the same code). One binary means that
//! `cargo run --release -p starling -- demo` builds everything the demo starts: the demo runs
//! the hub, relays and actors as child processes of this same executable.

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cluster;
mod compare;
mod demo;
mod demo_args;
mod links;
mod model;
mod plot;
mod procs;
mod real;
mod real_summary;
mod summary;
mod toy_run;
mod vllm_server;
mod watch;

#[derive(Parser, Debug)]
#[command(
    name = "starling",
    version,
    about = "Starling: RL post-training across regions; ships only the weights that changed."
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The RL run on one machine: a hub, two regions behind emulated WAN links (a relay and
    /// actors at speeds 1:2:3), and the built-in GRPO trainer; live progress, then a summary
    /// JSON and a PNG plot in the output directory.
    Demo(demo_args::DemoArgs),
    /// Models: `starling model import --gguf FILE -o DIR` writes a Hugging Face directory
    /// (BF16 safetensors, config, tokenizer, chat template) from a GGUF file (docs/models.md).
    #[command(subcommand)]
    Model(model::ModelCmd),
    /// The trainer hub (`starling-hub`'s arguments).
    #[command(disable_help_flag = true)]
    Hub {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// A regional relay (`starling-relay`'s arguments).
    #[command(disable_help_flag = true)]
    Relay {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// A rollout actor (`starling-actor`'s arguments).
    #[command(disable_help_flag = true)]
    Actor {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
}

fn with_name(name: &str, args: Vec<OsString>) -> Vec<OsString> {
    std::iter::once(OsString::from(name)).chain(args).collect()
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Cmd::Hub { args } => starling_hub::cli::main_from(with_name("starling hub", args)),
        Cmd::Relay { args } => starling_relay::cli::main_from(with_name("starling relay", args)),
        Cmd::Actor { args } => starling_actor::cli::main_from(with_name("starling actor", args)),
        Cmd::Model(cmd) => match model::run(cmd) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        },
        Cmd::Demo(args) => match procs::stop_children_on_signal().and_then(|()| demo::run(&args)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                procs::wait_if_stopping();
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}
