//! The acceptance rule of SparrowRL §5.4, extended with a staleness bound, as a pure
//! function: a result is accepted only if the job is leased to the submitter, the lease is
//! still valid (`now <= expiry`), the result was generated with a version `w` no older than
//! the job's (`w >= job.version`) and within the batch's staleness bound of the newest
//! committed version (`w >= latest - max_staleness`), its digest equals `w`'s digest, and no
//! result for the job was accepted before. Both backends read the job rows (locked, inside the
//! submit transaction) and the digests of the versions the results name, and ask [`judge`];
//! exactly-once then rests on the transaction plus the `UNIQUE (job_id)` constraint on
//! `results`.

use std::collections::HashMap;

use crate::ids::{ActorId, Digest, Timestamp, Version};
use crate::model::{JobState, Rejection, ResultSubmission};

/// What the submit transaction reads about a job.
#[derive(Debug, Clone)]
pub(crate) struct JobRow {
    pub(crate) state: JobState,
    pub(crate) attempts: i64,
    pub(crate) version: Version,
    pub(crate) batch: i64,
    pub(crate) max_staleness: u64,
    pub(crate) cancelled: bool,
    pub(crate) holder: Option<String>,
    pub(crate) leased_at: Option<i64>,
    pub(crate) expires: Option<i64>,
}

/// The committed versions a submit call may name: their digests, and the newest one.
#[derive(Debug, Clone, Default)]
pub(crate) struct Committed {
    pub(crate) digests: HashMap<Version, Digest>,
    pub(crate) latest: Option<Version>,
}

/// Decides one submission. `accepted_in_call` is true when an earlier submission of the same
/// call was accepted for this job (a duplicate within one request).
pub(crate) fn judge(
    row: Option<&JobRow>,
    sub: &ResultSubmission,
    committed: &Committed,
    actor: &ActorId,
    now: Timestamp,
    accepted_in_call: bool,
) -> Result<(), Rejection> {
    let Some(row) = row else {
        return Err(Rejection::UnknownJob);
    };
    if accepted_in_call || row.state == JobState::Done {
        return Err(Rejection::AlreadyAccepted);
    }
    if row.cancelled {
        return Err(Rejection::Cancelled);
    }
    if row.state == JobState::Failed {
        return Err(Rejection::JobFailed);
    }
    if sub.version < row.version {
        return Err(Rejection::StaleVersion {
            job: row.version,
            result: sub.version,
        });
    }
    let Some(digest) = committed.digests.get(&sub.version) else {
        return Err(Rejection::UnknownVersion(sub.version));
    };
    if let Some(latest) = committed.latest {
        let floor = latest.number().saturating_sub(row.max_staleness);
        if sub.version.number() < floor {
            return Err(Rejection::TooStale {
                result: sub.version,
                latest,
            });
        }
    }
    if sub.digest != *digest {
        return Err(Rejection::DigestMismatch);
    }
    match row.state {
        JobState::Leased => {
            if row.holder.as_deref() != Some(actor.as_str()) {
                return Err(Rejection::NotLeaseHolder);
            }
            match row.expires {
                Some(exp) if now.millis() <= exp => Ok(()),
                exp => Err(Rejection::LeaseExpired {
                    expired_at: exp.map(Timestamp::from_millis),
                }),
            }
        }
        // Swept after expiry and back in the pool.
        JobState::Pending if row.attempts > 0 => Err(Rejection::LeaseExpired { expired_at: None }),
        // Never leased: whoever sends this never held a lease.
        _ => Err(Rejection::NotLeaseHolder),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn v(n: u64) -> Version {
        Version::new(n).expect("small version")
    }

    fn row(state: JobState, holder: Option<&str>, expires: Option<i64>) -> JobRow {
        JobRow {
            state,
            attempts: 1,
            version: v(4),
            batch: 1,
            max_staleness: 1,
            cancelled: false,
            holder: holder.map(str::to_owned),
            leased_at: expires.map(|e| e - 100),
            expires,
        }
    }

    fn committed(versions: &[(u64, u8)], latest: u64) -> Committed {
        Committed {
            digests: versions
                .iter()
                .map(|&(n, d)| (v(n), Digest([d; 16])))
                .collect(),
            latest: Some(v(latest)),
        }
    }

    fn sub(version: u64, digest: u8) -> ResultSubmission {
        ResultSubmission {
            job: crate::ids::JobId(1),
            version: v(version),
            digest: Digest([digest; 16]),
            tokens: 10,
            elapsed: Duration::from_millis(5),
            payload: vec![],
        }
    }

    #[test]
    fn every_rule_has_its_reason() {
        let a = ActorId::new("a").expect("id");
        let t = Timestamp::from_millis(1_000);
        let c = committed(&[(3, 3), (4, 7), (5, 5), (6, 6)], 5);
        let leased = row(JobState::Leased, Some("a"), Some(1_000));
        assert_eq!(judge(Some(&leased), &sub(4, 7), &c, &a, t, false), Ok(()));
        assert_eq!(
            judge(None, &sub(4, 7), &c, &a, t, false),
            Err(Rejection::UnknownJob)
        );
        assert_eq!(
            judge(Some(&leased), &sub(4, 7), &c, &a, t, true),
            Err(Rejection::AlreadyAccepted)
        );
        assert_eq!(
            judge(Some(&leased), &sub(3, 7), &c, &a, t, false),
            Err(Rejection::StaleVersion {
                job: v(4),
                result: v(3)
            })
        );
        assert_eq!(
            judge(Some(&leased), &sub(4, 8), &c, &a, t, false),
            Err(Rejection::DigestMismatch)
        );
        assert_eq!(
            judge(
                Some(&leased),
                &sub(4, 7),
                &c,
                &a,
                Timestamp::from_millis(1_001),
                false
            ),
            Err(Rejection::LeaseExpired {
                expired_at: Some(Timestamp::from_millis(1_000))
            })
        );
        let other = row(JobState::Leased, Some("b"), Some(5_000));
        assert_eq!(
            judge(Some(&other), &sub(4, 7), &c, &a, t, false),
            Err(Rejection::NotLeaseHolder)
        );
        let done = row(JobState::Done, None, None);
        assert_eq!(
            judge(Some(&done), &sub(4, 7), &c, &a, t, false),
            Err(Rejection::AlreadyAccepted)
        );
        let failed = row(JobState::Failed, None, None);
        assert_eq!(
            judge(Some(&failed), &sub(4, 7), &c, &a, t, false),
            Err(Rejection::JobFailed)
        );
        let swept = row(JobState::Pending, None, None);
        assert_eq!(
            judge(Some(&swept), &sub(4, 7), &c, &a, t, false),
            Err(Rejection::LeaseExpired { expired_at: None })
        );
        let mut never = row(JobState::Pending, None, None);
        never.attempts = 0;
        assert_eq!(
            judge(Some(&never), &sub(4, 7), &c, &a, t, false),
            Err(Rejection::NotLeaseHolder)
        );
    }

    #[test]
    fn newer_versions_are_accepted_within_the_staleness_bound() {
        let a = ActorId::new("a").expect("id");
        let t = Timestamp::from_millis(1_000);
        let leased = row(JobState::Leased, Some("a"), Some(1_000));
        // Job of version 4, latest committed 5, bound 1: results from 4 and 5 are fine.
        let c = committed(&[(4, 7), (5, 5)], 5);
        assert_eq!(judge(Some(&leased), &sub(5, 5), &c, &a, t, false), Ok(()));
        assert_eq!(judge(Some(&leased), &sub(4, 7), &c, &a, t, false), Ok(()));
        // Its digest must be that of the version it names, not the job's.
        assert_eq!(
            judge(Some(&leased), &sub(5, 7), &c, &a, t, false),
            Err(Rejection::DigestMismatch)
        );
        // Latest 6: version 4 is two steps behind.
        let c = committed(&[(4, 7), (5, 5), (6, 6)], 6);
        assert_eq!(
            judge(Some(&leased), &sub(4, 7), &c, &a, t, false),
            Err(Rejection::TooStale {
                result: v(4),
                latest: v(6)
            })
        );
        assert_eq!(judge(Some(&leased), &sub(5, 5), &c, &a, t, false), Ok(()));
        // A bound of 0: only the newest version counts.
        let mut strict = leased.clone();
        strict.max_staleness = 0;
        assert_eq!(
            judge(Some(&strict), &sub(5, 5), &c, &a, t, false),
            Err(Rejection::TooStale {
                result: v(5),
                latest: v(6)
            })
        );
        assert_eq!(judge(Some(&strict), &sub(6, 6), &c, &a, t, false), Ok(()));
        // A version nobody committed.
        assert_eq!(
            judge(Some(&leased), &sub(9, 9), &c, &a, t, false),
            Err(Rejection::UnknownVersion(v(9)))
        );
        // A cancelled batch accepts nothing more.
        let mut cancelled = leased.clone();
        cancelled.cancelled = true;
        assert_eq!(
            judge(Some(&cancelled), &sub(5, 5), &c, &a, t, false),
            Err(Rejection::Cancelled)
        );
    }
}
