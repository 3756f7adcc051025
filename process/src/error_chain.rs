//! [`error_chain`]: an error and every cause under it as one line of text.
//!
//! Starling's libraries keep an error's cause in [`std::error::Error::source`], never in its
//! message (a `thiserror` `#[source]`, not `{0}` in the text), so that anyhow's `{:#}` prints
//! each cause once. Where an error must become a string inside a process — a refusal sent to a
//! peer, a JSON error body, a status page, a log field — [`error_chain`] gives the same text
//! without anyhow.

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

#[cfg(test)]
mod tests {
    use super::error_chain;
    use starling_checkpoint::deltafile::DeltaFileError;
    use starling_checkpoint::safetensors::Checkpoint;
    use starling_proto::delta::apply::StageError;
    use starling_proto::delta::manifest::SignatureError;

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
