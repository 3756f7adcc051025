//! Which source a receiver follows: the preferred one (an actor's regional relay), the ones
//! after it in order (other relays, then the hub), when to try again, which to leave alone
//! for a while, and when to go back to the preferred one.
//!
//! Pure like the rest of [`crate::follow`]: it is told what happened and the time, and says
//! what to do next; the shell runs the connections and the probes.
//!
//! - **Order.** Sources are tried in order, starting after the one just left (a relay that
//!   dropped its actors is not tried again first), around again after the last.
//! - **Retry.** A source not reached is followed by the next one after a pause that starts at
//!   [`PolicyConfig::retry_min`] and doubles up to [`PolicyConfig::retry_max`]; a connection
//!   that ends is replaced at once. [`PolicyConfig::max_failures`] in a row (reaching none, or
//!   losing each, with no version activated in between) give up.
//! - **Quarantine.** A source that broke a bound (a hostile or broken peer) is not used for
//!   [`PolicyConfig::quarantine`].
//! - **Return.** While it follows a fallback, the receiver probes the preferred source (its own
//!   task in the shell, never the receiving loop's wait) [`PolicyConfig::probe_every`] after the
//!   last probe ended. Once it answers holding at most [`PolicyConfig::return_within`] versions
//!   fewer than the receiver, the receiver goes back at once, even in the middle of a version
//!   (what it already has is not fetched again): every version it would otherwise take from
//!   the fallback crosses the region's WAN link once more.
//!   A preferred source that had nothing to offer (neither the next delta nor a newer anchor)
//!   is not returned to before the receiver is past the version it lacked.
//! - **Crowded.** A source that refused the subscription because this receiver's certificate
//!   already holds its bound of live subscriptions there (`TooManyConnections`: connections of
//!   an earlier incarnation of this receiver that the server has not yet seen end) is asked
//!   again, not left: after [`CROWDED_RETRY_MIN`], doubling up to [`CROWDED_RETRY_MAX`], for up
//!   to [`CROWDED_PATIENCE`] since its first refusal in a row. Only a source that still refuses
//!   then is left as lost (the next one is tried at once), and a preferred source left so is
//!   not returned to by a probe for [`PolicyConfig::quarantine`]: a probe is answered
//!   (`Welcome`) by a server that would refuse the subscription, so the receiver would go back
//!   and forth. The refusals within the patience count as no failure.

use std::time::{Duration, Instant};

use super::{CROWDED_PATIENCE, CROWDED_RETRY_MAX, CROWDED_RETRY_MIN};

/// A source, by its place in the list the policy was made with (0 is the preferred one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SourceId(pub usize);

/// How a receiver chooses and leaves sources.
#[derive(Debug, Clone)]
pub struct PolicyConfig {
    /// Failures in a row (a source not reached, or lost) before giving up; `None`: never.
    pub max_failures: Option<u32>,
    /// The first pause after a source was not reached.
    pub retry_min: Duration,
    /// The longest pause (the pause doubles after each failure in a row).
    pub retry_max: Duration,
    /// How long a source that broke a bound is left alone.
    pub quarantine: Duration,
    /// The pause between the end of one probe of the preferred source and the next.
    pub probe_every: Duration,
    /// How many versions the preferred source may hold fewer than the receiver and still be
    /// returned to (it catches up from its own upstream meanwhile, at the speed the receiver
    /// would get them from the fallback; far behind, it may need an anchor first).
    pub return_within: u64,
}

impl PolicyConfig {
    /// An actor's: 50 failures in a row, 200 ms between attempts, 60 s of quarantine, the
    /// preferred relay probed 100 ms after the last probe ended (a probe of a relay that is
    /// down gives up after `upstream::PROBE_TIMEOUT`, so a relay back is found within about
    /// 0.6 s; each probe is a handshake on the region's LAN).
    pub fn actor() -> Self {
        Self {
            max_failures: Some(50),
            retry_min: Duration::from_millis(200),
            retry_max: Duration::from_millis(200),
            quarantine: Duration::from_secs(60),
            probe_every: Duration::from_millis(100),
            return_within: 8,
        }
    }

    /// A relay's (one source, the hub): never gives up, backs off from 200 ms to 5 s.
    pub fn relay() -> Self {
        Self {
            max_failures: None,
            retry_min: Duration::from_millis(200),
            retry_max: Duration::from_secs(5),
            quarantine: Duration::from_secs(60),
            probe_every: Duration::from_secs(1),
            return_within: 0,
        }
    }
}

/// Where a probe of the preferred source stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    /// Not on a fallback (or the preferred source is quarantined).
    Off,
    /// The next probe is due then.
    Due(Instant),
    /// A probe is running.
    Running,
}

/// What to do about a source that refused the subscription for connections (see
/// [`SourcePolicy::crowded`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crowded {
    /// Connect to the same source again then.
    Retry(Instant),
    /// It has refused for `waited` ([`CROWDED_PATIENCE`] or more): it is left as lost, and the
    /// next source is tried at once.
    Leave { waited: Duration },
}

/// Refusals for connections in a row from one source.
#[derive(Debug, Clone, Copy)]
struct Crowding {
    source: SourceId,
    /// The first of them.
    since: Instant,
    /// The pause after the next one.
    pause: Duration,
}

/// Why a receiver gave up on its sources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no source reachable or kept after {failures} attempts in a row")]
pub struct GaveUp {
    pub failures: u32,
}

/// The source policy: see the module docs.
#[derive(Debug, Clone)]
pub struct SourcePolicy {
    cfg: PolicyConfig,
    sources: usize,
    next: usize,
    quarantined: Vec<Option<Instant>>,
    failures: u32,
    pause: Duration,
    current: Option<SourceId>,
    probe: Probe,
    /// The preferred source had nothing to offer after this version (neither the next delta
    /// nor a newer anchor): it is not returned to by a probe until the receiver is past it,
    /// else the receiver would go back and forth between it and the fallback and never move.
    preferred_lacks: Option<u64>,
    /// The source followed refused the subscription for connections, since when.
    crowding: Option<Crowding>,
    /// The preferred source refused for connections through a whole [`CROWDED_PATIENCE`]:
    /// not probed again before then.
    crowded_out: Option<Instant>,
    #[cfg(test)]
    pub(crate) regression: super::Regression,
}

impl SourcePolicy {
    /// A policy over `sources` sources (at least one), the first preferred.
    pub fn new(cfg: PolicyConfig, sources: usize) -> Self {
        let sources = sources.max(1);
        Self {
            pause: cfg.retry_min,
            cfg,
            sources,
            next: 0,
            quarantined: vec![None; sources],
            failures: 0,
            current: None,
            probe: Probe::Off,
            preferred_lacks: None,
            crowding: None,
            crowded_out: None,
            #[cfg(test)]
            regression: super::Regression::None,
        }
    }

    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    /// The source followed now (connected or being connected to).
    pub fn current(&self) -> Option<SourceId> {
        self.current
    }

    /// Whether `source` is left alone at `now`.
    pub fn is_quarantined(&self, source: SourceId, now: Instant) -> bool {
        self.quarantined
            .get(source.0)
            .copied()
            .flatten()
            .is_some_and(|until| until > now)
    }

    /// The source to connect to at `now`, or the time one will be usable (every source is
    /// quarantined).
    pub fn choose(&mut self, now: Instant) -> Result<SourceId, Instant> {
        for k in 0..self.sources {
            let i = (self.next + k) % self.sources;
            if !self.is_quarantined(SourceId(i), now) {
                self.current = Some(SourceId(i));
                self.probe = Probe::Off;
                return Ok(SourceId(i));
            }
        }
        let until = self.quarantined.iter().flatten().min().copied();
        Err(until.unwrap_or(now))
    }

    /// `source` answered and is followed now: on a fallback, the preferred one is probed.
    pub fn connected(&mut self, source: SourceId, now: Instant) {
        if source.0 == 0 {
            // Back on the preferred source (by the round, not a probe): a later fallback
            // probes it again as usual, not after the old hold.
            self.crowded_out = None;
        }
        self.current = Some(source);
        self.next = source.0 + 1;
        self.pause = self.cfg.retry_min;
        self.probe = if source.0 > 0 && !self.is_quarantined(SourceId(0), now) {
            Probe::Due(self.not_before_crowded_out(now + self.first_probe()))
        } else {
            Probe::Off
        };
    }

    fn first_probe(&self) -> Duration {
        #[cfg(test)]
        if self.regression == super::Regression::ProbeEvery2sBetweenVersionsOnly {
            return Duration::from_secs(2);
        }
        self.cfg.probe_every
    }

    /// `source` was not reached: when to try the next one, or give up.
    pub fn not_reached(&mut self, source: SourceId, now: Instant) -> Result<Instant, GaveUp> {
        self.left(source);
        self.fail()?;
        let at = now + self.pause;
        self.pause = (self.pause * 2).min(self.cfg.retry_max);
        Ok(at)
    }

    /// The connection to `source` ended: the next source is tried at once (or give up).
    pub fn lost(&mut self, source: SourceId) -> Result<(), GaveUp> {
        self.left(source);
        self.fail()
    }

    /// `source` refused the subscription at `now` because this receiver's certificate holds
    /// the server's bound of live subscriptions there: the same source again after a pause,
    /// or, once it has refused for [`CROWDED_PATIENCE`] in a row, the next one at once (as
    /// [`lost`](Self::lost): a failure, or give up). The pauses start at
    /// [`CROWDED_RETRY_MIN`] and double up to [`CROWDED_RETRY_MAX`]; the last attempt is
    /// made when the patience ends. A refusal in a row is one with nothing else between:
    /// leaving the source in any other way starts the count afresh.
    pub fn crowded(&mut self, source: SourceId, now: Instant) -> Result<Crowded, GaveUp> {
        let c = match self.crowding {
            Some(c) if c.source == source => c,
            _ => Crowding {
                source,
                since: now,
                pause: CROWDED_RETRY_MIN,
            },
        };
        let until = c.since + CROWDED_PATIENCE;
        if now >= until {
            if source.0 == 0 {
                self.crowded_out = Some(now + self.cfg.quarantine);
            }
            self.lost(source)?;
            return Ok(Crowded::Leave {
                waited: now - c.since,
            });
        }
        self.crowding = Some(Crowding {
            pause: (c.pause * 2).min(CROWDED_RETRY_MAX),
            ..c
        });
        self.current = None;
        self.probe = Probe::Off;
        self.next = source.0;
        Ok(Crowded::Retry((now + c.pause).min(until)))
    }

    /// `at`, or the end of the preferred source's hold after it stayed crowded, if later.
    fn not_before_crowded_out(&self, at: Instant) -> Instant {
        self.crowded_out.map_or(at, |until| at.max(until))
    }

    /// `source` broke a bound at `now`: left alone for a while; the next one is tried.
    pub fn misbehaved(&mut self, source: SourceId, now: Instant) -> Result<(), GaveUp> {
        if let Some(q) = self.quarantined.get_mut(source.0) {
            *q = Some(now + self.cfg.quarantine);
        }
        self.left(source);
        self.fail()
    }

    /// The receiver leaves `source` on its own account (the source had nothing for it, or it
    /// restored an anchor and subscribes again): `again` says whether to come back to it.
    pub fn leave(&mut self, source: SourceId, again: bool) {
        self.left(source);
        if again {
            self.next = source.0;
        }
    }

    /// `source` has neither the next delta after `after` nor a newer anchor (the receiver
    /// leaves it next).
    pub fn nothing_to_offer(&mut self, source: SourceId, after: u64) {
        if source.0 == 0 {
            self.preferred_lacks = Some(after);
        }
    }

    /// The receiver leaves its source to start over from the preferred one (a probe said the
    /// preferred one answers again, or an anchor changed what the receiver needs).
    pub fn go_back(&mut self) {
        self.current = None;
        self.probe = Probe::Off;
        self.next = 0;
        self.crowding = None;
    }

    fn left(&mut self, source: SourceId) {
        self.next = source.0 + 1;
        self.current = None;
        self.probe = Probe::Off;
        self.crowding = None;
    }

    fn fail(&mut self) -> Result<(), GaveUp> {
        self.failures += 1;
        match self.cfg.max_failures {
            Some(max) if self.failures > max => Err(GaveUp {
                failures: self.failures,
            }),
            _ => Ok(()),
        }
    }

    /// A version was activated: the sources work.
    pub fn activated(&mut self) {
        self.failures = 0;
    }

    /// When the next probe is due, if one is.
    pub fn probe_due(&self) -> Option<Instant> {
        match self.probe {
            Probe::Due(at) => Some(at),
            _ => None,
        }
    }

    /// Starts the due probe: the preferred source to probe.
    pub fn start_probe(&mut self, now: Instant) -> Option<SourceId> {
        match self.probe {
            Probe::Due(at) if at <= now => {
                self.probe = Probe::Running;
                Some(SourceId(0))
            }
            _ => None,
        }
    }

    /// A probe ended: the preferred source answered holding `latest` (or did not answer).
    /// `true`: go back to it now (the receiver holds `active`; `half_received` says a version
    /// is partly here).
    pub fn probed(
        &mut self,
        latest: Option<u64>,
        active: u64,
        half_received: bool,
        now: Instant,
    ) -> bool {
        if self.probe != Probe::Running {
            return false;
        }
        let back = latest.is_some_and(|l| l.saturating_add(self.cfg.return_within) >= active)
            && self.preferred_lacks.is_none_or(|after| active > after)
            && self.crowded_out.is_none_or(|until| now >= until);
        #[cfg(test)]
        if self.regression == super::Regression::ProbeEvery2sBetweenVersionsOnly {
            // The actor before 7230b72: every 2 s, back only if the probe itself found the
            // preferred relay holding the actor's version with nothing half-received.
            if latest.is_some_and(|l| l >= active) && !half_received {
                self.probe = Probe::Off;
                return true;
            }
            self.probe = Probe::Due(now + Duration::from_secs(2));
            return false;
        }
        let _ = half_received;
        if back {
            self.probe = Probe::Off;
            true
        } else {
            self.probe = Probe::Due(self.not_before_crowded_out(now + self.cfg.probe_every));
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_tried_in_order_after_the_one_left() {
        let now = Instant::now();
        let mut p = SourcePolicy::new(PolicyConfig::actor(), 3);
        assert_eq!(p.choose(now), Ok(SourceId(0)));
        let at = p.not_reached(SourceId(0), now).expect("not given up");
        assert_eq!(at, now + Duration::from_millis(200));
        assert_eq!(p.choose(now), Ok(SourceId(1)));
        p.connected(SourceId(1), now);
        assert_eq!(p.probe_due(), Some(now + Duration::from_millis(100)));
        p.lost(SourceId(1)).expect("not given up");
        assert_eq!(p.choose(now), Ok(SourceId(2)));
        p.lost(SourceId(2)).expect("not given up");
        assert_eq!(p.choose(now), Ok(SourceId(0)), "around again");
    }

    #[test]
    fn a_quarantined_source_is_skipped_until_its_time_is_up() {
        let now = Instant::now();
        let mut p = SourcePolicy::new(PolicyConfig::actor(), 2);
        p.misbehaved(SourceId(1), now).expect("not given up");
        p.lost(SourceId(0)).expect("not given up");
        assert_eq!(p.choose(now), Ok(SourceId(0)));
        p.misbehaved(SourceId(0), now).expect("not given up");
        let until = now + Duration::from_secs(60);
        assert_eq!(p.choose(now), Err(until));
        assert_eq!(p.choose(until), Ok(SourceId(1)));
    }

    #[test]
    fn failures_in_a_row_give_up_and_an_activation_resets_them() {
        let now = Instant::now();
        let mut cfg = PolicyConfig::actor();
        cfg.max_failures = Some(2);
        let mut p = SourcePolicy::new(cfg, 1);
        p.lost(SourceId(0)).expect("1");
        p.activated();
        p.lost(SourceId(0)).expect("1 again");
        p.lost(SourceId(0)).expect("2");
        assert_eq!(p.lost(SourceId(0)), Err(GaveUp { failures: 3 }));
        let mut relay = SourcePolicy::new(PolicyConfig::relay(), 1);
        for _ in 0..1000 {
            relay.not_reached(SourceId(0), now).expect("never gives up");
        }
    }

    #[test]
    fn the_relay_backs_off_to_five_seconds_and_starts_over_once_connected() {
        let now = Instant::now();
        let mut p = SourcePolicy::new(PolicyConfig::relay(), 1);
        let pauses: Vec<u128> = (0..7)
            .map(|_| (p.not_reached(SourceId(0), now).expect("retry") - now).as_millis())
            .collect();
        assert_eq!(pauses, [200, 400, 800, 1600, 3200, 5000, 5000]);
        p.connected(SourceId(0), now);
        let again = p.not_reached(SourceId(0), now).expect("retry");
        assert_eq!(again - now, Duration::from_millis(200));
    }

    /// Refusals for connections in a row: the same source after 1, 2, 2, … s (the last
    /// attempt when the patience ends), no failure counted; then left as lost. Leaving the
    /// source in any other way, or leaving it once crowded, starts the count afresh; a relay
    /// (its one source) is asked again at once and waits it out again.
    #[test]
    fn a_crowded_source_is_retried_within_the_patience_then_left() {
        let start = Instant::now();
        let mut cfg = PolicyConfig::actor();
        cfg.max_failures = Some(2);
        let mut p = SourcePolicy::new(cfg, 2);
        let mut now = start;
        let mut pauses = Vec::new();
        let left = loop {
            assert_eq!(p.choose(now), Ok(SourceId(0)));
            p.connected(SourceId(0), now);
            match p.crowded(SourceId(0), now).expect("no failure counted") {
                Crowded::Retry(at) => {
                    pauses.push((at - now).as_millis());
                    now = at;
                }
                Crowded::Leave { waited } => break waited,
            }
        };
        assert_eq!(pauses, [1000, 2000, 2000, 2000, 2000, 1000]);
        assert_eq!(left, CROWDED_PATIENCE);
        assert_eq!(p.choose(now), Ok(SourceId(1)), "the next source");
        // Lost from the next source: back to the first, whose refusals count afresh.
        p.connected(SourceId(1), now);
        p.lost(SourceId(1)).expect("a failure, and not given up");
        assert_eq!(p.choose(now), Ok(SourceId(0)));
        assert_eq!(
            p.crowded(SourceId(0), now),
            Ok(Crowded::Retry(now + CROWDED_RETRY_MIN))
        );
        // Not reached in between: afresh as well.
        let later = now + CROWDED_RETRY_MIN;
        assert_eq!(p.choose(later), Ok(SourceId(0)));
        p.not_reached(SourceId(0), later)
            .expect_err("the third failure: leaving the crowded source was the first");

        let mut relay = SourcePolicy::new(PolicyConfig::relay(), 1);
        let mut now = start;
        loop {
            relay.choose(now).expect("the hub");
            match relay.crowded(SourceId(0), now).expect("never gives up") {
                Crowded::Retry(at) => now = at,
                Crowded::Leave { .. } => break,
            }
        }
        assert_eq!(relay.choose(now), Ok(SourceId(0)), "the hub again, at once");
        assert_eq!(
            relay.crowded(SourceId(0), now),
            Ok(Crowded::Retry(now + CROWDED_RETRY_MIN)),
            "waited out afresh"
        );
    }

    /// A preferred source left after it refused for connections through the patience is not
    /// returned to by a probe before the quarantine is over: it would answer the probe and
    /// refuse the subscription again.
    #[test]
    fn a_preferred_source_left_crowded_is_not_probed_for_a_while() {
        let start = Instant::now();
        let mut p = SourcePolicy::new(PolicyConfig::actor(), 2);
        let mut now = start;
        while let Crowded::Retry(at) = p.crowded(SourceId(0), now).expect("not given up") {
            now = at;
        }
        let hold = now + PolicyConfig::actor().quarantine;
        assert_eq!(p.choose(now), Ok(SourceId(1)));
        p.connected(SourceId(1), now);
        assert_eq!(p.probe_due(), Some(hold));
        assert_eq!(p.start_probe(hold), Some(SourceId(0)));
        assert!(
            p.probed(Some(1), 1, false, hold),
            "back once the hold is over"
        );
    }

    /// Served by the preferred source again before the hold ended (reached by the round, not
    /// a probe), a later fallback probes it as usual, not after the old hold.
    #[test]
    fn a_preferred_source_connected_again_ends_its_crowded_hold() {
        let start = Instant::now();
        let mut p = SourcePolicy::new(PolicyConfig::actor(), 2);
        let mut now = start;
        while let Crowded::Retry(at) = p.crowded(SourceId(0), now).expect("not given up") {
            now = at;
        }
        p.connected(SourceId(0), now);
        p.lost(SourceId(0)).expect("not given up");
        p.connected(SourceId(1), now);
        assert_eq!(p.probe_due(), Some(now + PolicyConfig::actor().probe_every));
    }

    #[test]
    fn the_preferred_source_is_returned_to_once_it_answers_close_enough() {
        let now = Instant::now();
        let mut p = SourcePolicy::new(PolicyConfig::actor(), 2);
        p.connected(SourceId(1), now);
        assert_eq!(p.start_probe(now), None, "not due yet");
        let due = p.probe_due().expect("probing");
        assert_eq!(p.start_probe(due), Some(SourceId(0)));
        assert!(!p.probed(None, 20, false, due), "no answer");
        let due = p.probe_due().expect("probing again");
        assert_eq!(p.start_probe(due), Some(SourceId(0)));
        assert!(!p.probed(Some(11), 20, true, due), "9 behind");
        let due = p.probe_due().expect("probing again");
        p.start_probe(due);
        assert!(p.probed(Some(12), 20, true, due), "8 behind, mid-version");
        assert_eq!(p.probe_due(), None);
        p.go_back();
        assert_eq!(p.choose(due), Ok(SourceId(0)));
    }
}
