//! `starling-relay`: see [`starling_relay::cli`].

fn main() -> std::process::ExitCode {
    starling_relay::cli::main_from(std::env::args_os())
}
