//! `starling-actor`: see [`starling_actor::cli`].

fn main() -> std::process::ExitCode {
    starling_actor::cli::main_from(std::env::args_os())
}
