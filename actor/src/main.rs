//! `starling-actor`: see [`starling_actor::cli`].
//!
//! The allocator is mimalloc: staging a version allocates its changes afresh (8 bytes each,
//! hundreds of MB at 8B), and glibc's returned-then-refaulted pages cost the fast codec set
//! 22% of its staging time at 2-5% density (`docs/benchmarks.md`); mimalloc reuses them.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    starling_actor::cli::main_from(std::env::args_os())
}
