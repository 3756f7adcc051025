//! The acceptance rule of SparrowRL §5.4 as a pure function: a result is accepted only if the
//! job is leased to the submitter, the lease is still valid (`now <= expiry`), the result's
//! version equals the job's version and its digest equals that version's digest, and no result
//! for the job was accepted before. Both backends read the job rows (locked, inside the submit
//! transaction) and ask [`judge`]; exactly-once then rests on the transaction plus the
//! `UNIQUE (job_id)` constraint on `results`.

use crate::ids::{ActorId, Digest, Timestamp, Version};
use crate::model::{JobState, Rejection, ResultSubmission};

/// What the submit transaction reads about a job.
#[derive(Debug, Clone)]
pub(crate) struct JobRow {
    pub(crate) state: JobState,
    pub(crate) attempts: i64,
    pub(crate) version: Version,
    pub(crate) holder: Option<String>,
    pub(crate) leased_at: Option<i64>,
    pub(crate) expires: Option<i64>,
    pub(crate) digest: Digest,
}

/// Decides one submission. `accepted_in_call` is true when an earlier submission of the same
/// call was accepted for this job (a duplicate within one request).
pub(crate) fn judge(
    row: Option<&JobRow>,
    sub: &ResultSubmission,
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
    if row.state == JobState::Failed {
        return Err(Rejection::JobFailed);
    }
    if sub.version != row.version {
        return Err(Rejection::StaleVersion {
            job: row.version,
            result: sub.version,
        });
    }
    if sub.digest != row.digest {
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
            holder: holder.map(str::to_owned),
            leased_at: expires.map(|e| e - 100),
            expires,
            digest: Digest([7; 16]),
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
        let leased = row(JobState::Leased, Some("a"), Some(1_000));
        assert_eq!(judge(Some(&leased), &sub(4, 7), &a, t, false), Ok(()));
        assert_eq!(
            judge(None, &sub(4, 7), &a, t, false),
            Err(Rejection::UnknownJob)
        );
        assert_eq!(
            judge(Some(&leased), &sub(4, 7), &a, t, true),
            Err(Rejection::AlreadyAccepted)
        );
        assert_eq!(
            judge(Some(&leased), &sub(3, 7), &a, t, false),
            Err(Rejection::StaleVersion {
                job: v(4),
                result: v(3)
            })
        );
        assert_eq!(
            judge(Some(&leased), &sub(4, 8), &a, t, false),
            Err(Rejection::DigestMismatch)
        );
        assert_eq!(
            judge(
                Some(&leased),
                &sub(4, 7),
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
            judge(Some(&other), &sub(4, 7), &a, t, false),
            Err(Rejection::NotLeaseHolder)
        );
        let done = row(JobState::Done, None, None);
        assert_eq!(
            judge(Some(&done), &sub(4, 7), &a, t, false),
            Err(Rejection::AlreadyAccepted)
        );
        let failed = row(JobState::Failed, None, None);
        assert_eq!(
            judge(Some(&failed), &sub(4, 7), &a, t, false),
            Err(Rejection::JobFailed)
        );
        let swept = row(JobState::Pending, None, None);
        assert_eq!(
            judge(Some(&swept), &sub(4, 7), &a, t, false),
            Err(Rejection::LeaseExpired { expired_at: None })
        );
        let mut never = row(JobState::Pending, None, None);
        never.attempts = 0;
        assert_eq!(
            judge(Some(&never), &sub(4, 7), &a, t, false),
            Err(Rejection::NotLeaseHolder)
        );
    }
}
