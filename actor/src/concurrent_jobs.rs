//! A generation call's jobs run side by side, within a budget of sequences.
//!
//! vLLM batches whatever requests are in flight. The `vllm` engine used to send its jobs one
//! completion at a time, so it decoded one group's `n` samples while up to `--max-batch`
//! sequences could run together. Here each job is a thread of its own, started in job order
//! while the sequences in flight fit the budget (`--max-batch`, which says how many sequences
//! the engine decodes together), and a job larger than the budget runs alone. Keeping to the
//! budget also keeps requests out of vLLM's waiting queue: a request that waits there streams
//! nothing, and the engine gives up on a stream that stays silent too long.
//!
//! After the first failure no further job is started (the call fails as a whole, as it did);
//! the jobs already in flight run to their end, since a blocking request cannot be withdrawn.

use std::sync::mpsc;

use anyhow::{Result, anyhow};

/// Runs `run(i)` for every job `i` (whose sequences are `sizes[i]`) on threads of their own,
/// at most `budget` sequences in flight unless one job alone is larger, and returns the
/// results in job order, or the first error.
pub(crate) fn run_within<T: Send>(
    sizes: &[u32],
    budget: u32,
    run: impl Fn(usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let run = &run;
    std::thread::scope(|scope| {
        let (done_tx, done_rx) = mpsc::channel::<(usize, Result<T>)>();
        let mut results: Vec<Option<T>> = sizes.iter().map(|_| None).collect();
        let mut first_error = None;
        let (mut next, mut running, mut in_flight) = (0, 0usize, 0u64);
        loop {
            while first_error.is_none()
                && next < sizes.len()
                && (running == 0 || in_flight + u64::from(sizes[next]) <= u64::from(budget))
            {
                let (i, tx) = (next, done_tx.clone());
                scope.spawn(move || {
                    // The receiver outlives every sender: the loop below reads until none runs.
                    let _ = tx.send((i, run(i)));
                });
                running += 1;
                in_flight += u64::from(sizes[i]);
                next += 1;
            }
            if running == 0 {
                break;
            }
            let (i, result) = done_rx
                .recv()
                .map_err(|_| anyhow!("a generation thread ended without a result"))?;
            running -= 1;
            in_flight -= u64::from(sizes[i]);
            match result {
                Ok(r) => results[i] = Some(r),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
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
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    /// Runs jobs that hold their sequences for `hold`, recording the most in flight at once.
    fn peak(sizes: &[u32], budget: u32, hold: Duration) -> (Vec<usize>, u64) {
        let (now, most) = (AtomicU64::new(0), AtomicU64::new(0));
        let got = run_within(sizes, budget, |i| {
            let n = u64::from(sizes[i]);
            let was = now.fetch_add(n, Ordering::SeqCst);
            most.fetch_max(was + n, Ordering::SeqCst);
            std::thread::sleep(hold);
            now.fetch_sub(n, Ordering::SeqCst);
            Ok(i)
        })
        .expect("all run");
        (got, most.load(Ordering::SeqCst))
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
        let got = run_within(&[1, 1], 2, |i| {
            let (tx, rx) = {
                let mut e = ends.lock().expect("ends");
                if i == 0 { e.0.take() } else { e.1.take() }.expect("once")
            };
            tx.send(()).expect("the other job's end");
            rx.recv_timeout(Duration::from_secs(10))
                .map_err(|_| anyhow!("job {i} ran alone"))?;
            Ok(i)
        })
        .expect("both ran at once");
        assert_eq!(got, [0, 1]);
    }

    #[test]
    fn after_a_failure_nothing_more_starts() {
        let started = AtomicU64::new(0);
        let e = run_within(&[1, 1, 1, 1], 1, |i| {
            started.fetch_add(1, Ordering::SeqCst);
            if i == 1 {
                return Err(anyhow!("job 1 failed"));
            }
            Ok(i)
        })
        .expect_err("fails");
        assert_eq!(e.to_string(), "job 1 failed");
        assert_eq!(started.load(Ordering::SeqCst), 2);
        assert!(run_within(&[], 4, Ok).expect("none").is_empty());
    }
}
