//! Structured logs for every Starling binary, through `tracing` and `tracing-subscriber`.
//!
//! Logs go to **stderr**, human-readable by default or one JSON object per line
//! (`--log-format json`) for log shippers; which events are written is chosen with
//! `RUST_LOG`-style directives (`--log`, else `STARLING_LOG`, else `RUST_LOG`, else `info`).
//! Stdout is left to each binary's readiness lines (`listening on ADDR`), which are a contract
//! with the harnesses that start it, not a log.
//!
//! A JSON line has `timestamp`, `level`, `target`, `fields` (with `message`), and the span the
//! event is in (`span`) with its parents (`spans`), so a `version`, `peer` or `actor` recorded
//! on a span is on every line logged inside it.
//!
//! [`fatal`] lives here, not beside the exit codes, because how the last error is written
//! depends on the format [`init`] chose: a JSON log must not end with a line that is not JSON.

use std::io::IsTerminal;
use std::sync::OnceLock;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::util::SubscriberInitExt;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One readable line per event (colours only on a terminal).
    #[default]
    Human,
    /// One JSON object per line.
    Json,
}

/// The logging flags every binary takes (flatten into its `clap` arguments).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LogArgs {
    /// How to write logs on stderr: `human` lines or one `json` object per line.
    #[arg(
        long,
        value_enum,
        default_value_t = LogFormat::Human,
        env = "STARLING_LOG_FORMAT",
        global = true
    )]
    pub log_format: LogFormat,
    /// Which events to log, as `RUST_LOG` directives (e.g. `info`,
    /// `starling_transport=debug,info`). Default: `RUST_LOG` if set, else `info`.
    #[arg(long = "log", env = "STARLING_LOG", global = true)]
    pub log: Option<String>,
}

/// Why logging could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LogInitError {
    /// The filter directives do not parse.
    #[error("--log {directives:?} is not a valid filter")]
    Filter {
        /// What was given.
        directives: String,
        /// The parser's complaint.
        source: tracing_subscriber::filter::ParseError,
    },
    /// A global subscriber was already installed (a second call in one process).
    #[error("logging was already set up in this process")]
    AlreadySet,
}

/// The format [`init`] installed, for [`fatal`].
static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Reports the error that ends the process: `error: …` on stderr for a person (human logs, or
/// before logging was set up), an ERROR event for a log shipper (JSON logs), so that every
/// line of a JSON log stays JSON.
pub fn fatal(message: &dyn std::fmt::Display) {
    match FORMAT.get() {
        Some(LogFormat::Json) => tracing::error!("{message}"),
        _ => eprintln!("error: {message}"),
    }
}

/// Installs the process's global subscriber as `args` say. Call once, first thing in `main`.
pub fn init(args: &LogArgs) -> Result<(), LogInitError> {
    let directives = args
        .log
        .clone()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .filter(|d| !d.trim().is_empty())
        .unwrap_or_else(|| "info".to_owned());
    let filter =
        EnvFilter::builder()
            .parse(&directives)
            .map_err(|source| LogInitError::Filter {
                directives: directives.clone(),
                source,
            })?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = match args.log_format {
        LogFormat::Human => builder
            .with_ansi(std::io::stderr().is_terminal())
            .finish()
            .try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .finish()
            .try_init(),
    };
    installed.map_err(|_| LogInitError::AlreadySet)?;
    let _ = FORMAT.set(args.log_format);
    Ok(())
}
