//! The crate's one error type, [`NetemError`].
//!
//! Every fallible public function returns it. Errors that come from the
//! operating system keep their [`std::io::Error`] source and say what the
//! emulator was doing when they happened.

use std::net::SocketAddr;

/// Everything that can go wrong when configuring or running the emulator.
#[derive(Debug, thiserror::Error)]
pub enum NetemError {
    /// A link profile is not usable (for example a loss outside `0..=1`).
    #[error("invalid link profile: {0}")]
    InvalidProfile(String),

    /// A human-friendly value (`100mbit`, `25ms`, `0.1%`, `1.5MB`) did not parse.
    #[error("invalid {what} {input:?}: {reason}")]
    InvalidValue {
        /// The kind of value expected (`rate`, `duration`, ...).
        what: &'static str,
        /// The text that was given.
        input: String,
        /// Why it was rejected and what would have been accepted.
        reason: String,
    },

    /// Binding a UDP socket failed.
    #[error("cannot bind UDP socket to {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// Another socket or thread operation failed.
    #[error("{context}")]
    Io {
        /// What the emulator was doing.
        context: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A worker thread panicked; the emulator's results are not trustworthy.
    #[error("netem thread {0:?} panicked")]
    ThreadPanicked(String),

    /// Some worker threads did not stop within the shutdown bound; they were
    /// detached (they only hold loopback sockets and exit on their next wake-up).
    #[error("{stuck} netem thread(s) did not stop within {timeout_ms} ms")]
    ShutdownTimeout {
        /// How many threads were still running.
        stuck: usize,
        /// The bound that was waited for.
        timeout_ms: u64,
    },
}

impl NetemError {
    pub(crate) fn io(context: &'static str, source: std::io::Error) -> Self {
        Self::Io { context, source }
    }
}
