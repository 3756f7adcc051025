//! `starling-hub`: see [`starling_hub::cli`].

fn main() -> std::process::ExitCode {
    starling_hub::cli::main_from(std::env::args_os())
}
