//! Jobs run side by side within one budget of sequences, shared by every generation call the
//! engine runs at once.
//!
//! vLLM batches whatever requests are in flight. The `vllm` engine used to send its jobs one
//! completion at a time, so it decoded one group's `n` samples while up to `--max-batch`
//! sequences could run together. Here each job is a thread of its own, started in its call's
//! job order as soon as its sequences fit the [`SequenceBudget`] (`--max-batch`: how many
//! sequences the engine decodes together); a job larger than the whole budget runs alone.
//! The budget belongs to the engine, not to a call: the worker overlaps two calls on such an
//! engine, so when a call's last, longest jobs leave most of the budget idle, the next call's
//! jobs take it up at once (continuous batching at the granularity of jobs, where one call
//! at a time was static batching). Keeping to the budget also keeps requests out of vLLM's
//! waiting queue: a request that waits there streams nothing, and the engine gives up on a
//! stream that stays silent too long.
//!
//! After a job of a call fails no further job of that call starts, and its jobs in flight are
//! told to stop (the flag `run` is given: the `vllm` engine then stops reading their streams,
//! and vLLM aborts a request whose client has gone), so the call fails as a whole at once
//! rather than after its longest generation, holding the engine's version meanwhile. A job
//! that panics fails its call like an error.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, PoisonError, mpsc};

use anyhow::{Result, anyhow};

/// The sequences an engine decodes at once, shared by all its generation calls.
#[derive(Debug)]
pub(crate) struct SequenceBudget {
    /// Lowered, never raised, once the engine learns what its server runs at once
    /// ([`SequenceBudget::lower_to`]).
    max: AtomicU64,
    in_flight: Mutex<u64>,
    freed: Condvar,
}

/// Sequences taken from a [`SequenceBudget`], given back when dropped.
#[derive(Debug)]
pub(crate) struct Permit<'a> {
    budget: &'a SequenceBudget,
    sequences: u64,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        let mut in_flight = self.budget.lock();
        *in_flight = in_flight.saturating_sub(self.sequences);
        drop(in_flight);
        self.budget.freed.notify_all();
    }
}

impl SequenceBudget {
    /// At most `max` sequences at once (at least 1).
    pub(crate) fn new(max: u32) -> Self {
        Self {
            max: AtomicU64::new(u64::from(max.max(1))),
            in_flight: Mutex::new(0),
            freed: Condvar::new(),
        }
    }

    /// Waits until `sequences` more fit (or nothing else runs, for a job larger than the
    /// whole budget), and takes them; none once `stop` is set (seen when sequences are next
    /// given back: a failing job sets it before it gives its own back).
    pub(crate) fn acquire(&self, sequences: u32, stop: &AtomicBool) -> Option<Permit<'_>> {
        let sequences = u64::from(sequences);
        let mut in_flight = self.lock();
        loop {
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            if *in_flight == 0 || *in_flight + sequences <= self.max.load(Ordering::Relaxed) {
                break;
            }
            in_flight = self
                .freed
                .wait(in_flight)
                .unwrap_or_else(PoisonError::into_inner);
        }
        *in_flight += sequences;
        Some(Permit {
            budget: self,
            sequences,
        })
    }

    /// The sequences at most in flight now.
    pub(crate) fn max(&self) -> u32 {
        u32::try_from(self.max.load(Ordering::Relaxed)).unwrap_or(u32::MAX)
    }

    /// Keeps at most `max` (at least 1) sequences in flight from now on, where that is fewer
    /// than today's bound; answers whether it lowered the bound. Jobs already in flight keep
    /// their sequences.
    pub(crate) fn lower_to(&self, max: u32) -> bool {
        let max = u64::from(max.max(1));
        self.max.fetch_min(max, Ordering::Relaxed) > max
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, u64> {
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Runs `run(i, stop)` for every job `i` (whose sequences are `sizes[i]`) on a thread of its
/// own, each started in job order once its sequences fit `budget`, and returns the results
/// in job order, or the first error. `stop` is set by the failing job itself, or from
/// outside (the caller no longer wants the results): the jobs in flight should end as soon
/// as they can, and no further one starts.
pub(crate) fn run_within<T: Send>(
    sizes: &[u32],
    budget: &SequenceBudget,
    stop: &AtomicBool,
    run: impl Fn(usize, &AtomicBool) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let run = &run;
    std::thread::scope(|scope| {
        let (done_tx, done_rx) = mpsc::channel::<(usize, Result<T>)>();
        let mut results: Vec<Option<T>> = sizes.iter().map(|_| None).collect();
        let mut first_error = None;
        let mut running = 0usize;
        let mut take = |(i, result): (usize, Result<T>), first_error: &mut Option<_>| match result {
            Ok(r) => results[i] = Some(r),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        };
        for (i, &size) in sizes.iter().enumerate() {
            let Some(permit) = budget.acquire(size, stop) else {
                break;
            };
            // What ended meanwhile (a job sends its result before it gives its sequences
            // back), so that a failure stops the call before its next start.
            while let Ok(done) = done_rx.try_recv() {
                running -= 1;
                take(done, &mut first_error);
            }
            if first_error.is_some() {
                break;
            }
            let tx = done_tx.clone();
            scope.spawn(move || {
                let result = catch_unwind(AssertUnwindSafe(|| run(i, stop)))
                    .unwrap_or_else(|_| Err(anyhow!("job {i}'s generation thread panicked")));
                if result.is_err() {
                    // At once, not when the dispatcher next looks: it may be waiting for
                    // sequences, and the call's other jobs should stop now.
                    stop.store(true, Ordering::Relaxed);
                }
                // The receiver outlives every sender: the loop below reads until none runs.
                let _ = tx.send((i, result));
                // Wakes a dispatcher waiting for sequences, which then sees the flag.
                drop(permit);
            });
            running += 1;
        }
        while running > 0 {
            let done = done_rx
                .recv()
                .map_err(|_| anyhow!("a generation thread ended without a result"))?;
            running -= 1;
            take(done, &mut first_error);
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        if stop.load(Ordering::Relaxed) {
            return Err(anyhow!("the call was stopped"));
        }
        results
            .into_iter()
            .map(|r| r.ok_or_else(|| anyhow!("a job was not run")))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    /// Counts the sequences in flight and the most at once.
    #[derive(Default)]
    struct Peak {
        now: AtomicU64,
        most: AtomicU64,
    }

    impl Peak {
        fn hold(&self, n: u32, hold: Duration) {
            let n = u64::from(n);
            let was = self.now.fetch_add(n, Ordering::SeqCst);
            self.most.fetch_max(was + n, Ordering::SeqCst);
            std::thread::sleep(hold);
            self.now.fetch_sub(n, Ordering::SeqCst);
        }

        fn most(&self) -> u64 {
            self.most.load(Ordering::SeqCst)
        }
    }

    /// Runs jobs that hold their sequences for `hold`: their order and the most in flight.
    fn peak(sizes: &[u32], budget: u32, hold: Duration) -> (Vec<usize>, u64) {
        let p = Peak::default();
        let got = run_within(
            sizes,
            &SequenceBudget::new(budget),
            &AtomicBool::new(false),
            |i, _| {
                p.hold(sizes[i], hold);
                Ok(i)
            },
        )
        .expect("all run");
        (got, p.most())
    }

    #[test]
    fn jobs_run_together_up_to_the_budget_and_answer_in_order() {
        let hold = Duration::from_millis(50);
        let (got, most) = peak(&[4, 4, 4, 4], 8, hold);
        assert_eq!(got, [0, 1, 2, 3]);
        assert_eq!(most, 8, "two jobs of 4 at once, never three");
        let (_, most) = peak(&[1; 6], 32, hold);
        assert_eq!(most, 6, "every job at once");
    }

    #[test]
    fn a_lowered_budget_holds_for_every_later_job_and_is_never_raised() {
        let budget = SequenceBudget::new(32);
        assert!(budget.lower_to(8));
        assert!(!budget.lower_to(16), "a higher bound does not raise it");
        assert!(!budget.lower_to(8));
        assert_eq!(budget.max(), 8);
        let p = Peak::default();
        let sizes = [4u32; 6];
        run_within(&sizes, &budget, &AtomicBool::new(false), |i, _| {
            p.hold(sizes[i], Duration::from_millis(30));
            Ok(i)
        })
        .expect("all run");
        assert_eq!(p.most(), 8, "two jobs of 4 at once under the lowered bound");
        assert!(budget.lower_to(0));
        assert_eq!(budget.max(), 1, "at least one sequence");
    }

    #[test]
    fn a_job_larger_than_the_budget_runs_alone() {
        let (got, most) = peak(&[2, 40, 2], 8, Duration::from_millis(30));
        assert_eq!(got, [0, 1, 2]);
        assert_eq!(most, 40);
        let (_, most) = peak(&[40, 2], 8, Duration::from_millis(30));
        assert_eq!(most, 40, "nothing joins a job over the budget");
    }

    #[test]
    fn jobs_overlap_in_time() {
        // Each of two jobs waits for the other to have started: run one at a time, the first
        // would wait in vain.
        let (a_tx, a_rx) = mpsc::channel::<()>();
        let (b_tx, b_rx) = mpsc::channel::<()>();
        let ends = Mutex::new((Some((a_tx, b_rx)), Some((b_tx, a_rx))));
        let got = run_within(
            &[1, 1],
            &SequenceBudget::new(2),
            &AtomicBool::new(false),
            |i, _| {
                let (tx, rx) = {
                    let mut e = ends.lock().expect("ends");
                    if i == 0 { e.0.take() } else { e.1.take() }.expect("once")
                };
                tx.send(()).expect("the other job's end");
                rx.recv_timeout(Duration::from_secs(10))
                    .map_err(|_| anyhow!("job {i} ran alone"))?;
                Ok(i)
            },
        )
        .expect("both ran at once");
        assert_eq!(got, [0, 1]);
    }

    #[test]
    fn two_calls_share_one_budget_and_fill_each_others_gaps() {
        // Call A: one long job and one short; call B: two short ones. With a budget of 3,
        // B's jobs start as A's short job ends, while A's long job still runs: the budget
        // stays full, and B ends long before A.
        let budget = SequenceBudget::new(3);
        let p = Peak::default();
        let ms = Duration::from_millis;
        let started = std::time::Instant::now();
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| {
                run_within(&[2, 1], &budget, &AtomicBool::new(false), |i, _| {
                    p.hold(
                        if i == 0 { 2 } else { 1 },
                        if i == 0 { ms(400) } else { ms(50) },
                    );
                    Ok(started.elapsed())
                })
            });
            std::thread::sleep(ms(10));
            let b = s.spawn(|| {
                run_within(&[1, 1], &budget, &AtomicBool::new(false), |_, _| {
                    p.hold(1, ms(50));
                    Ok(started.elapsed())
                })
            });
            (
                a.join().expect("call A").expect("A runs"),
                b.join().expect("call B").expect("B runs"),
            )
        });
        assert_eq!(p.most(), 3, "never over the shared budget");
        assert!(
            b[1] < a[0],
            "B ended at {:?}, before A's long job at {:?}",
            b[1],
            a[0]
        );
    }

    #[test]
    fn a_failure_stops_the_jobs_in_flight_and_a_panic_is_a_failure() {
        // Job 1 fails while job 0 runs "for ever": job 0 sees the flag and ends, and the call
        // answers with job 1's error at once.
        let started = std::time::Instant::now();
        let e = run_within(
            &[1, 1],
            &SequenceBudget::new(2),
            &AtomicBool::new(false),
            |i, stop| {
                if i == 1 {
                    std::thread::sleep(Duration::from_millis(20));
                    return Err(anyhow!("job 1 failed"));
                }
                while !stop.load(Ordering::Relaxed) {
                    if started.elapsed() > Duration::from_secs(10) {
                        return Ok(0);
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(anyhow!("job 0 stopped"))
            },
        )
        .expect_err("fails");
        assert_eq!(e.to_string(), "job 1 failed");
        assert!(started.elapsed() < Duration::from_secs(5));

        let e = run_within(
            &[1, 1],
            &SequenceBudget::new(2),
            &AtomicBool::new(false),
            |i, _| {
                if i == 0 {
                    panic!("a bug");
                }
                Ok(i)
            },
        )
        .expect_err("a panic fails the call");
        assert_eq!(e.to_string(), "job 0's generation thread panicked");
    }

    #[test]
    fn a_failure_ends_a_call_waiting_for_sequences_another_call_holds() {
        // Call B holds 2 of 4 sequences for 2 s. Call A's first job (1) fails at once; its
        // second (3) cannot fit until B ends. A answers at once, not when B gives its
        // sequences back.
        let budget = SequenceBudget::new(4);
        let ms = Duration::from_millis;
        let (b_started_tx, b_started) = mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(|| {
                run_within(&[2], &budget, &AtomicBool::new(false), |_, _| {
                    b_started_tx.send(()).expect("started");
                    std::thread::sleep(ms(2000));
                    Ok(())
                })
            });
            b_started.recv().expect("B runs");
            let started = std::time::Instant::now();
            let e = run_within(&[1, 3], &budget, &AtomicBool::new(false), |i, _| {
                std::thread::sleep(ms(20));
                Err::<(), _>(anyhow!("job {i} failed"))
            })
            .expect_err("A fails");
            assert_eq!(e.to_string(), "job 0 failed");
            assert!(
                started.elapsed() < ms(1000),
                "A took {:?}",
                started.elapsed()
            );
        });
    }

    #[test]
    fn a_call_stopped_from_outside_starts_nothing_more_and_fails() {
        let stop = AtomicBool::new(false);
        let ran = AtomicU64::new(0);
        let e = run_within(&[1, 1, 1], &SequenceBudget::new(1), &stop, |_, _| {
            ran.fetch_add(1, Ordering::SeqCst);
            stop.store(true, Ordering::Relaxed);
            Ok(())
        })
        .expect_err("stopped");
        assert_eq!(e.to_string(), "the call was stopped");
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn after_a_failure_nothing_more_starts() {
        let started = AtomicU64::new(0);
        let e = run_within(
            &[1, 1, 1, 1],
            &SequenceBudget::new(1),
            &AtomicBool::new(false),
            |i, _| {
                started.fetch_add(1, Ordering::SeqCst);
                if i == 1 {
                    return Err(anyhow!("job 1 failed"));
                }
                Ok(i)
            },
        )
        .expect_err("fails");
        assert_eq!(e.to_string(), "job 1 failed");
        assert_eq!(started.load(Ordering::SeqCst), 2);
        assert!(
            run_within(
                &[],
                &SequenceBudget::new(4),
                &AtomicBool::new(false),
                |i, _| Ok(i)
            )
            .expect("none")
            .is_empty()
        );
    }
}
