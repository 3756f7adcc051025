//! Telemetry for every Starling binary: logs, Prometheus metrics and the HTTP server that
//! exposes them.
//!
//! - [`logging`]: [`logging::init`], structured logs on stderr (human or JSON, `RUST_LOG`
//!   filtering), and the `--log-format`/`--log` flags every binary takes.
//! - [`metrics`]: [`Metrics`], the fixed set of `starling_<component>_*` families that the hub,
//!   relays and actors record into (bytes and segments per peer, refetches, versions, transfer,
//!   apply and control round-trip times, jobs and results), encoded as OpenMetrics or the
//!   Prometheus text format.
//! - [`http_client`]: a blocking HTTP/1.1 client for the local JSON APIs processes call.
//! - [`http`]: [`http::serve`], which answers `GET /metrics` and `GET /healthz` and whatever
//!   routes the binary adds (`/v1/status`; the hub adds its API, events and dashboard), with
//!   JSON errors for unknown routes and methods.
//!
//! Invariants: recording never blocks on I/O and never fails; the number of label values is
//! bounded ([`metrics::MAX_PEERS`]), so a scrape stays small however many peers come and go.

pub mod http;
pub mod http_client;
pub mod logging;
pub mod metrics;

pub use metrics::{Component, Metrics};

/// An error and every cause under it, each message once, joined with `": "`: the text of
/// anyhow's `{:#}`, for the places that keep an error as a string (refusal details, JSON error
/// bodies, status pages, log lines).
///
/// Starling's errors never repeat their source in their own message (the source is reachable
/// through [`std::error::Error::source`]), so `to_string()` alone drops the cause; this puts it
/// back. A cause whose message the message above it already is or ends with after a `": "` (a
/// third-party error that prints its source itself) is not repeated.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut last = text.clone();
    let mut cause = error.source();
    while let Some(e) = cause {
        let message = e.to_string();
        let repeated = last == message
            || last
                .strip_suffix(message.as_str())
                .is_some_and(|head| head.ends_with(": "));
        if !message.is_empty() && !repeated {
            text.push_str(": ");
            text.push_str(&message);
        }
        last = message;
        cause = e.source();
    }
    text
}

/// Milliseconds since the Unix epoch, as status documents report times (0 before 1970).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::error_chain;
    use starling_checkpoint::deltafile::DeltaFileError;
    use starling_checkpoint::safetensors::Checkpoint;
    use starling_proto::apply::StageError;
    use starling_proto::manifest::SignatureError;

    /// The manifest refusal: what failed, then why, each once.
    #[test]
    fn a_refused_manifest_says_why_once() {
        let e = StageError::from(SignatureError::UntrustedKey("ab12".into()));
        let want = "refused manifest: the manifest is signed by ab12, which is not a trusted key";
        assert_eq!(error_chain(&e), want);
        let chain = format!("{:#}", anyhow::Error::new(e).context("apply version 7"));
        assert_eq!(chain, format!("apply version 7: {want}"));
        assert_eq!(chain.matches("ab12").count(), 1, "{chain}");
    }

    /// A file that cannot be read: the path, then the operating system's reason, each once,
    /// also through a transparent wrapper and an anyhow context.
    #[test]
    fn a_missing_file_says_which_and_why_once() {
        let path = std::env::temp_dir().join(format!(
            "starling-error-chain-{}/missing.safetensors",
            std::process::id()
        ));
        let Err(e) = Checkpoint::open(&path) else {
            panic!("{} opened", path.display());
        };
        let e = DeltaFileError::from(e);
        let chain = error_chain(&e);
        assert!(
            chain.starts_with(&format!("read {}: ", path.display())),
            "{chain}"
        );
        assert_eq!(chain.matches("(os error 2)").count(), 1, "{chain}");
        assert_eq!(
            chain.matches(path.to_str().expect("utf-8")).count(),
            1,
            "{chain}"
        );
        let any = format!("{:#}", anyhow::Error::new(e).context("publish"));
        assert_eq!(any, format!("publish: {chain}"));
    }

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Repeats(#[source] std::io::Error);

    /// A third-party error that prints its source itself is not repeated.
    #[test]
    fn a_source_already_printed_is_not_repeated() {
        let e = Repeats(std::io::Error::other("inner"));
        assert_eq!(error_chain(&e), "outer: inner");
        let plain = std::io::Error::other("alone");
        assert_eq!(error_chain(&plain), "alone");
        // A message that merely ends with the same words is a different cause.
        #[derive(Debug, thiserror::Error)]
        #[error("refused manifest")]
        struct Outer(#[source] std::io::Error);
        let e = Outer(std::io::Error::other("manifest"));
        assert_eq!(error_chain(&e), "refused manifest: manifest");
    }
}
