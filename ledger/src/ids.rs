//! Newtype identifiers and the two value types every table shares: [`Version`] and
//! [`Digest`], plus the ledger's notion of time, [`Timestamp`].
//!
//! Invariants kept here, so that no other module has to re-check them:
//! - a [`Version`] always fits in a signed 64-bit column (`0..=i64::MAX`);
//! - an [`ActorId`] is 1..=[`ActorId::MAX_LEN`] bytes of printable text;
//! - a [`Digest`] is exactly 16 bytes (the codec's 128-bit state digest).

use std::fmt;
use std::time::Duration;

use thiserror::Error;

/// A model version. Stored as `BIGINT`, so values above `i64::MAX` are refused at construction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version(u64);

/// A `u64` that does not fit the ledger's signed 64-bit version columns.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
#[error("version {0} is above the largest storable version {max}", max = i64::MAX)]
pub struct VersionOutOfRange(pub u64);

impl Version {
    /// The largest storable version.
    pub const MAX: Version = Version(i64::MAX as u64);

    /// Parses a version number, refusing values that do not fit a `BIGINT`.
    pub fn new(v: u64) -> Result<Version, VersionOutOfRange> {
        if v > i64::MAX as u64 {
            Err(VersionOutOfRange(v))
        } else {
            Ok(Version(v))
        }
    }

    /// The version number.
    pub fn number(self) -> u64 {
        self.0
    }

    /// The previous version, if any.
    pub fn previous(self) -> Option<Version> {
        self.0.checked_sub(1).map(Version)
    }

    pub(crate) fn to_db(self) -> i64 {
        // In range by construction.
        self.0 as i64
    }

    pub(crate) fn from_db(v: i64) -> Result<Version, sqlx::Error> {
        u64::try_from(v)
            .map(Version)
            .map_err(|_| sqlx::Error::Decode(format!("negative version {v} in the ledger").into()))
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// An actor's name, as it authenticates (for example its certificate's common name).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ActorId(String);

/// An actor name that is empty, too long or contains control characters.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("invalid actor id {0:?}: must be 1..={max} bytes without control characters", max = ActorId::MAX_LEN)]
pub struct InvalidActorId(pub String);

impl ActorId {
    /// Longest accepted actor name, in bytes.
    pub const MAX_LEN: usize = 128;

    /// Parses an actor name.
    pub fn new(id: impl Into<String>) -> Result<ActorId, InvalidActorId> {
        let id = id.into();
        if id.is_empty() || id.len() > Self::MAX_LEN || id.chars().any(char::is_control) {
            Err(InvalidActorId(id))
        } else {
            Ok(ActorId(id))
        }
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub(crate) fn from_db(id: String) -> ActorId {
        ActorId(id)
    }
}

impl fmt::Display for ActorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A job (one prompt of one batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobId(pub(crate) i64);

impl JobId {
    /// A job id from its row id (as printed or sent over the wire).
    pub fn from_raw(id: i64) -> JobId {
        JobId(id)
    }

    /// The row id.
    pub fn raw(self) -> i64 {
        self.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "job#{}", self.0)
    }
}

/// A batch of prompts posted for one version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BatchId(pub(crate) i64);

impl BatchId {
    /// A batch id from its row id (as the API hands it out).
    pub fn from_raw(id: i64) -> BatchId {
        BatchId(id)
    }

    /// The row id.
    pub fn raw(self) -> i64 {
        self.0
    }
}

impl fmt::Display for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "batch#{}", self.0)
    }
}

/// One job connection of an actor: each registration of the actor takes the next number, and
/// the leases it claims are tagged with it, so closing one connection releases exactly what
/// that connection held (not what a newer connection of the same actor claimed since).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Session(pub(crate) i64);

impl Session {
    /// A session from its number (as logged).
    pub fn from_raw(n: i64) -> Session {
        Session(n)
    }

    /// The session number.
    pub fn raw(self) -> i64 {
        self.0
    }
}

impl fmt::Display for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "session#{}", self.0)
    }
}

/// The 128-bit homomorphic state digest of a version's weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Digest(pub [u8; 16]);

impl Digest {
    pub(crate) fn from_db(bytes: &[u8]) -> Result<Digest, sqlx::Error> {
        <[u8; 16]>::try_from(bytes).map(Digest).map_err(|_| {
            sqlx::Error::Decode(format!("digest of {} bytes in the ledger", bytes.len()).into())
        })
    }
}

/// A point in time: milliseconds since the Unix epoch. The ledger never reads a clock itself;
/// callers pass `now` (see [`crate::clock`]), which keeps lease tests deterministic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(i64);

impl Timestamp {
    /// A timestamp from milliseconds since the Unix epoch.
    pub const fn from_millis(ms: i64) -> Timestamp {
        Timestamp(ms)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn millis(self) -> i64 {
        self.0
    }

    /// This instant plus `d` (saturating).
    pub fn plus(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_add(duration_millis(d)))
    }

    /// This instant minus `d` (saturating).
    pub fn minus(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_sub(duration_millis(d)))
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }
}

pub(crate) fn duration_millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_range_is_enforced() {
        assert!(Version::new(i64::MAX as u64).is_ok());
        assert_eq!(Version::new(u64::MAX), Err(VersionOutOfRange(u64::MAX)));
        assert_eq!(Version::new(0).map(Version::previous), Ok(None));
        assert!(Version::from_db(-1).is_err());
    }

    #[test]
    fn actor_ids_are_bounded() {
        assert!(ActorId::new("eu-west/a1").is_ok());
        assert!(ActorId::new("").is_err());
        assert!(ActorId::new("a\nb").is_err());
        assert!(ActorId::new("x".repeat(ActorId::MAX_LEN + 1)).is_err());
    }

    #[test]
    fn digests_must_be_16_bytes() {
        assert!(Digest::from_db(&[0; 16]).is_ok());
        assert!(Digest::from_db(&[0; 15]).is_err());
    }
}
