//! The loop every receiving shell runs: the core's actions ([`crate::follow`]) carried out
//! against a [`Feed`] (QUIC) and a [`Shell`] (what the relay or the actor does with a version:
//! forward and cache it, or stage, commit and journal it), and what comes back handed to the
//! core. The relay and the actor implement [`Shell`] and call [`run`]; neither has a loop of
//! its own.
//!
//! Prints the lines tests and operators read that both shells share: `resume VERSION have N`
//! when a new connection continues a half-received version, `refetch VERSION` when (part of)
//! one is asked for again (counted in the feed's metrics by source). Both shells measure the
//! control round trip to their source the same way: [`Feed::ping`] in their tick, the round
//! trip back in [`Shell::pong`].

use std::time::{Duration, Instant};

use futures_util::FutureExt;
use starling_proto::delta::anchor::AnchorSeal;
use starling_proto::protocol::msg::Message;
use tokio_util::sync::CancellationToken;

use crate::follow::{Action, Event, Follower, GaveUp, Notice};
use crate::framed::{DataStreamReader, StreamFrame};
use crate::upstream::{Feed, Input, SourceAddr, UpstreamError};

/// What a receiving shell does with versions; [`run`] calls it as the core says.
#[allow(async_fn_in_trait)]
pub trait Shell {
    /// Why the shell stops (a fatal refusal, a disk that fails).
    type Error: From<GaveUp>;
    /// What the background work of [`activate`](Self::activate) ends with.
    type Done;

    /// The `Hello` to say to a source.
    fn hello(&self) -> Message;
    /// Makes ready to stage `version`; `false`: it could not (the core starts it over).
    fn begin(&mut self, version: u64, base: u64, delta_id: [u8; 32]) -> bool;
    /// Stages a frame of `version`; `false`: it failed, and what was staged of the version is
    /// gone.
    fn stage(&mut self, version: u64, frame: StreamFrame) -> bool;
    /// Stages frames of `version` that came in together, in order, as [`stage`](Self::stage)
    /// would one by one; a shell that can work on several at once (an actor decoding their
    /// parts on all its cores) does. `false`: one failed, and what was staged of the
    /// version is gone.
    fn stage_batch(&mut self, version: u64, frames: Vec<StreamFrame>) -> bool {
        frames.into_iter().all(|frame| self.stage(version, frame))
    }
    /// Forgets what was staged of `version`.
    fn discard(&mut self, version: u64);
    /// Verifies `version` whole and makes it active: `Some(active)` when done at once, `None`
    /// when it goes on in the background ([`background`](Self::background)).
    async fn activate(
        &mut self,
        feed: &mut Feed,
        version: u64,
        started: Instant,
    ) -> Result<Option<bool>, Self::Error>;
    /// The end of the background activation under way (never, if none is). Cancellation-safe.
    async fn background(&mut self) -> Self::Done;
    /// Completes a background activation: the version and whether it is active.
    async fn finish(&mut self, feed: &mut Feed, done: Self::Done) -> (u64, bool);
    /// Receives and installs the anchor `seal` describes from `stream`; `false` (logged) if
    /// it did not check out.
    async fn restore(&mut self, seal: AnchorSeal, stream: DataStreamReader) -> bool;
    /// How often [`tick`](Self::tick) runs (none: never).
    fn tick_every(&self) -> Option<Duration> {
        None
    }
    /// Periodic work (a ping, an actor's engine health check).
    async fn tick(&mut self, _feed: &mut Feed) {}
    /// The upstream answered a [`Feed::ping`] after `rtt`.
    fn pong(&mut self, _rtt: Duration) {}
    /// Subscribed to `source` after `after`.
    fn subscribed(&mut self, source: &SourceAddr, after: u64);
    /// The connection to `source` ended (lost, or left).
    fn left(&mut self, source: &SourceAddr);
    /// A source was not reached: `Err` if that is fatal (another cluster's credentials, a
    /// refusal), else it is logged.
    fn not_reached(&mut self, error: UpstreamError) -> Result<(), Self::Error>;
    /// Something worth telling an operator (`source`: the source it concerns).
    fn notice(&mut self, notice: Notice, source: Option<&SourceAddr>) -> Result<(), Self::Error>;
}

/// Runs `core` with `feed` and `shell` until `stop` is cancelled (the core then leaves its
/// source) or the core or the shell gives up.
pub async fn run<S: Shell>(
    core: &mut Follower<StreamFrame>,
    feed: &mut Feed,
    shell: &mut S,
    stop: &CancellationToken,
) -> Result<(), S::Error> {
    // A tick that ran long (the actor's engine restarting) is followed by one tick, not by a
    // burst of the ticks it missed, which would keep the feed's events waiting.
    let mut tick = shell.tick_every().map(|every| {
        let mut t = tokio::time::interval(every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    // How often the core's deadline `deferring` was put off for inputs that were already
    // waiting (below); a new deadline starts the count over.
    let (mut deferring, mut deferred) = (None, 0);
    // An input the batch below took from the feed but did not hand the core: anything but a
    // frame is heard only once the actions of the frames before it have run.
    let mut carried = None;
    loop {
        actions(core, feed, shell, stop).await?;
        if core.is_stopped() {
            return Ok(());
        }
        let timer = core.poll_timeout().map(tokio::time::Instant::from_std);
        if timer != deferring {
            (deferring, deferred) = (timer, 0);
        }
        let step = match carried.take() {
            Some(input) => Step::Input(input),
            None => tokio::select! {
                _ = stop.cancelled() => Step::Stop,
                input = feed.next() => Step::Input(input),
                _ = sleep_until(timer) => match waiting(feed.next(), &mut deferred) {
                    Some(input) => Step::Input(input),
                    None => Step::Timer,
                },
                done = shell.background() => Step::Done(done),
                _ = next_tick(&mut tick) => Step::Tick,
            },
        };
        match step {
            Step::Stop => core.handle(Instant::now(), Event::Shutdown),
            Step::Input(input) => {
                let frame = is_frame(&input);
                hear(core, feed, shell, input)?;
                // Frames that queued up behind a long step go to the shell together (its
                // `stage_batch`): frames the feed already holds, nothing waited for, up to a
                // batch. Past the core's deadline each one counts as a deferral of it, so the
                // bound on putting a deadline off holds.
                let mut taken = 1;
                while frame && taken < MAX_STAGE_BATCH {
                    let past = timer.is_some_and(|t| t <= tokio::time::Instant::now());
                    if past && deferred >= MAX_TIMER_DEFERRALS {
                        break;
                    }
                    let Some(input) = tokio::task::coop::unconstrained(feed.next()).now_or_never()
                    else {
                        break;
                    };
                    if !is_frame(&input) {
                        carried = Some(input);
                        break;
                    }
                    hear(core, feed, shell, input)?;
                    taken += 1;
                    deferred += u32::from(past);
                }
            }
            Step::Timer => core.handle_timeout(Instant::now()),
            Step::Done(done) => {
                let (version, active) = shell.finish(feed, done).await;
                core.handle(Instant::now(), activation(version, active));
            }
            Step::Tick => shell.tick(feed).await,
        }
    }
}

/// Frames handed to [`Shell::stage_batch`] at most at once, and inputs taken from the feed
/// without running the core's actions in between: 16 segments are about 160 parts at 1.5B
/// and 7.8% density, enough for a many-core actor, and at about 30 ns per change a
/// 2-core actor stages them in under a second, so a SIGTERM is still heard soon.
const MAX_STAGE_BATCH: usize = 16;

/// Whether `input` is a frame of a version.
fn is_frame(input: &Input) -> bool {
    matches!(input, Input::Event(Event::Frame { .. }))
}

/// Hands the core (or the shell) one input from the feed.
fn hear<S: Shell>(
    core: &mut Follower<StreamFrame>,
    feed: &Feed,
    shell: &mut S,
    input: Input,
) -> Result<(), S::Error> {
    match input {
        Input::Event(ev) => {
            if let Event::Lost { .. } = ev
                && let Some(s) = core.source().and_then(|id| feed.source(id))
            {
                shell.left(s);
            }
            core.handle(Instant::now(), ev);
        }
        Input::ConnectFailed { conn, error } => {
            shell.not_reached(error)?;
            core.handle(Instant::now(), Event::ConnectFailed { conn });
        }
        Input::Pong(rtt) => shell.pong(rtt),
    }
    Ok(())
}

/// How many times one expired deadline of the core's may be put off for inputs that were
/// already waiting: the feed's channel holds 256 events, so a backlog left by one long step is
/// heard before the timer, while a feed that stays busy (a shell slower than its link) delays a
/// timer such as the preferred source's probe by at most this many inputs.
const MAX_TIMER_DEFERRALS: u32 = 256;

/// The input `next` (the feed's) already holds when the core's timer has expired, to hand the
/// core first.
///
/// After a step that ran long (a tick loading an engine), the core's timer may have expired
/// while the input it waited for (a source's answer) came in; `select!` picks among ready
/// branches at random, and the core would give up on a source that had answered. So an input
/// that is already there goes first, and the timer is looked at again once the core has heard
/// it. [`Feed::next`] is cancellation-safe, so a poll that finds nothing loses nothing; it is
/// polled outside tokio's cooperative budget, which the timer's own poll may have spent (the
/// budget would make a waiting input look absent).
fn waiting<T>(next: impl std::future::Future<Output = T>, deferred: &mut u32) -> Option<T> {
    if *deferred < MAX_TIMER_DEFERRALS
        && let Some(input) = tokio::task::coop::unconstrained(next).now_or_never()
    {
        *deferred += 1;
        return Some(input);
    }
    *deferred = 0;
    None
}

/// What woke the loop.
enum Step<D> {
    Stop,
    Input(Input),
    Timer,
    Done(D),
    Tick,
}

fn activation(version: u64, active: bool) -> Event<StreamFrame> {
    if active {
        Event::Activated { version }
    } else {
        Event::ActivationFailed { version }
    }
}

/// Runs the core's actions until it has none, feeding back what they led to. An anchor
/// being restored when `stop` is cancelled is given up (a 140 GB download does not hold up a
/// SIGTERM); the core then hears it failed, as it does of one that stalled.
pub async fn actions<S: Shell>(
    core: &mut Follower<StreamFrame>,
    feed: &mut Feed,
    shell: &mut S,
    stop: &CancellationToken,
) -> Result<(), S::Error> {
    while let Some(action) = core.poll_action() {
        let now = Instant::now;
        match action {
            Action::Connect { conn, source, .. } => feed.connect(conn, source, shell.hello()),
            Action::Send { conn, message } => {
                match &message {
                    Message::Resume { version, have } => {
                        println!("resume {version} have {}", have.len());
                    }
                    Message::Fetch { version, seqs } => {
                        println!("refetch {version}");
                        feed.refetching(*version, seqs.len());
                    }
                    Message::FetchAnchor { after_version } => {
                        tracing::info!(after_version, "asking for the newest anchor");
                    }
                    _ => {}
                }
                if feed.send(conn, &message).await
                    && let Message::Subscribe { after_version } = message
                    && let Some(s) = feed.current()
                {
                    tracing::info!(source = %s.name, role = s.role.as_str(), after_version, "subscribed");
                    shell.subscribed(s, after_version);
                }
            }
            Action::Disconnect { conn } => {
                if let Some(s) = feed.disconnect(conn).and_then(|s| feed.source(s)) {
                    shell.left(s);
                }
            }
            Action::Begin {
                version,
                base,
                delta_id,
            } => {
                if !shell.begin(version, base, delta_id) {
                    core.handle(now(), Event::StageFailed { version });
                }
            }
            Action::Stage { version, frame } => {
                // The frames of this version the core hands over next, staged together.
                let mut frames = vec![frame];
                while frames.len() < MAX_STAGE_BATCH
                    && let Some(frame) = core.poll_stage(version)
                {
                    frames.push(frame);
                }
                if !shell.stage_batch(version, frames) {
                    core.handle(now(), Event::StageFailed { version });
                }
            }
            Action::Discard { version } => shell.discard(version),
            Action::Activate { version, started } => {
                if let Some(active) = shell.activate(feed, version, started).await? {
                    core.handle(now(), activation(version, active));
                }
            }
            Action::RestoreAnchor { conn, version } => {
                let restored = match feed.take_anchor(conn) {
                    Some((seal, stream)) => tokio::select! {
                        r = shell.restore(seal, stream) => r,
                        () = stop.cancelled() => false,
                    },
                    None => false,
                };
                let ev = if restored {
                    Event::AnchorRestored { conn, version }
                } else {
                    Event::AnchorFailed { conn }
                };
                core.handle(now(), ev);
            }
            Action::Probe { source, .. } => feed.probe(source, shell.hello()),
            Action::Notice(n) => {
                let source = match &n {
                    Notice::SourceDropped { source, .. }
                    | Notice::Returning { from: source }
                    | Notice::NothingToOffer { source, .. }
                    | Notice::Unanswered { source, .. }
                    | Notice::Crowded { source, .. } => feed.source(*source),
                    Notice::Received { .. } => None,
                };
                shell.notice(n, source)?;
            }
            Action::GiveUp(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The next tick of `tick`, or never without one.
async fn next_tick(tick: &mut Option<tokio::time::Interval>) {
    match tick {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    #[tokio::test]
    async fn an_input_already_waiting_goes_before_the_timer_up_to_the_bound() {
        let (tx, mut rx) = mpsc::channel(512);
        for i in 0..MAX_TIMER_DEFERRALS + 2 {
            tx.try_send(i).expect("room in the channel");
        }
        let mut deferred = 0;
        for i in 0..MAX_TIMER_DEFERRALS {
            assert_eq!(waiting(rx.recv(), &mut deferred), Some(Some(i)));
        }
        // The bound: the timer goes now, although inputs wait, and the count starts over.
        assert_eq!(waiting(rx.recv(), &mut deferred), None);
        assert_eq!(deferred, 0);
        assert_eq!(
            waiting(rx.recv(), &mut deferred),
            Some(Some(MAX_TIMER_DEFERRALS))
        );
        // Nothing waiting: the timer goes.
        let (_tx, mut empty) = mpsc::channel::<u32>(1);
        let mut deferred = 5;
        assert_eq!(waiting(empty.recv(), &mut deferred), None);
        assert_eq!(deferred, 0);
    }

    #[tokio::test]
    async fn a_spent_cooperative_budget_does_not_hide_a_waiting_input() {
        let (tx, mut rx) = mpsc::channel(1024);
        for i in 0..1000u32 {
            tx.try_send(i).expect("room in the channel");
        }
        // Spend this task's budget without yielding, as a loop that handled many inputs in a
        // row (and the timer's poll) does: a budgeted receive then reports nothing.
        let mut taken = 0;
        while rx.recv().now_or_never().is_some() {
            taken += 1;
            assert!(taken < 1000, "tokio's budget never ran out");
        }
        let mut deferred = 0;
        assert_eq!(waiting(rx.recv(), &mut deferred), Some(Some(taken)));
    }
}
