//! The controller's history — one sample per allocation: the budget, the draw and every
//! job's cap, for `powerflexctl plot` — served to the admin socket outside the allocation
//! loop.
//!
//! Any local user may ask for the history, and one answer can copy 2,000 samples of a
//! cap per job each: answered inside the step ([`super::step`]), a flood of such requests
//! would stall the allocations. So the step only makes each sample and says when the jobs'
//! owners changed ([`super::step::Output`]); the I/O edge publishes both on the
//! [`HistoryBoard`]; the admin threads answer `history` from the board and never reach the
//! step. A request
//! holds the board's lock only to pick its page, at most [`MAX_HISTORY_SAMPLES`] `Arc`
//! pointers, and copies and filters the samples after releasing it: however many
//! requests are in flight, a publish waits at most for one such pick.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use powerflex_proto::admin::{AdminAnswer, AdminReply, MAX_HISTORY_SAMPLES};
use powerflex_proto::status::HistorySample;

use super::owners::{self, OwnerMap};

/// Samples kept: an hour at a 1 s period, a day at the default 10 s... within memory.
pub const HISTORY: usize = 8640;

/// The last [`HISTORY`] samples and the owners of the jobs they name, shared by the loop
/// (which publishes) and the admin threads (which read). Cheap to clone: one board.
#[derive(Debug, Clone, Default)]
pub struct HistoryBoard {
    shared: Arc<Mutex<Board>>,
}

#[derive(Debug, Default)]
struct Board {
    /// Oldest first, one per allocation. Shared with the answers being copied out.
    samples: VecDeque<Arc<HistorySample>>,
    /// As the step last reported them: a caller reads only the caps of their own jobs,
    /// including jobs that have ended since (the step remembers owners for the window).
    owners: Arc<OwnerMap>,
}

impl HistoryBoard {
    pub fn new() -> HistoryBoard {
        HistoryBoard::default()
    }

    /// Adds what one step made: its allocation's sample, and the owners when they
    /// changed (either may be absent). The oldest sample past [`HISTORY`] is dropped.
    ///
    /// The samples' times strictly increase, because a page ends at a `t_ms` and the
    /// next one starts after it: two samples in one millisecond (two allocations in a
    /// row, a report's and the tick's) would lose the second to the reader paging across
    /// them. A sample at or before the newest one's millisecond (the same instant, or the
    /// wall clock stepped back) is stamped a millisecond after it: none is dropped, and
    /// the history stays in order until the clock catches up.
    pub fn publish(&self, sample: Option<Arc<HistorySample>>, owners: Option<Arc<OwnerMap>>) {
        if sample.is_none() && owners.is_none() {
            return;
        }
        let mut dropped = Vec::new();
        let replaced = {
            let mut board = self.lock();
            if let Some(sample) = sample {
                match board.samples.back().map(|newest| newest.t_ms) {
                    Some(newest) if sample.t_ms <= newest => {
                        let mut later = (*sample).clone();
                        later.t_ms = newest + 1;
                        board.samples.push_back(Arc::new(later));
                    }
                    _ => board.samples.push_back(sample),
                }
            }
            while board.samples.len() > HISTORY {
                dropped.extend(board.samples.pop_front());
            }
            owners.map(|owners| std::mem::replace(&mut board.owners, owners))
        };
        // Freed here, after the lock: a sample holds a cap per job, and no reader should
        // wait while it is.
        drop((dropped, replaced));
    }

    /// The answer to `history` for a caller with `uid` (from the socket's peer credentials): the
    /// page `since_ms` and `max_samples` select (as
    /// [`AdminOp::History`](powerflex_proto::admin::AdminOp::History) says), each sample with only
    /// the caps the caller may read ([`owners::history_for`], the rule every admin reply follows).
    pub fn answer(&self, since_ms: Option<u64>, max_samples: Option<u32>, uid: u32) -> AdminReply {
        let (picked, owners) = {
            let board = self.lock();
            (
                page(&board.samples, since_ms, max_samples),
                board.owners.clone(),
            )
        };
        AdminReply::Done(AdminAnswer::History(owners::history_for(
            &picked, uid, &owners,
        )))
    }

    /// Samples held.
    pub fn len(&self) -> usize {
        self.lock().samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Board> {
        // A reader that panicked mid-pick left nothing half-done: the board is whole.
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The samples after `since_ms` (all when none): with `max_samples`, the oldest that many
/// of them, a page (ask again after the last `t_ms` for the next); without, an overview
/// evenly thinned to at most [`MAX_HISTORY_SAMPLES`] with the newest kept. Picks
/// pointers only, so it costs the same however many caps a sample holds.
fn page(
    history: &VecDeque<Arc<HistorySample>>,
    since_ms: Option<u64>,
    max_samples: Option<u32>,
) -> Vec<Arc<HistorySample>> {
    let first = since_ms.map_or(0, |t| history.partition_point(|s| s.t_ms <= t));
    if let Some(page) = max_samples {
        let page = page.clamp(1, MAX_HISTORY_SAMPLES) as usize;
        return history.range(first..).take(page).cloned().collect();
    }
    let max = MAX_HISTORY_SAMPLES as usize;
    let n = history.len() - first;
    if n <= max {
        return history.range(first..).cloned().collect();
    }
    // `max` indices spread over the range, the last one the newest sample.
    (0..max)
        .map(|k| first + (n - 1) - (max - 1 - k) * (n - 1) / (max - 1))
        .map(|i| history[i].clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    const ALICE: u32 = 1001;
    const BOB: u32 = 1002;

    fn sample(t_ms: u64, caps: &[(&str, f64)]) -> Arc<HistorySample> {
        Arc::new(HistorySample {
            t_ms,
            budget_w: 1.0,
            draw_w: 1.0,
            caps: caps.iter().map(|(j, c)| (j.to_string(), *c)).collect(),
            simulated: true,
            domains: BTreeMap::new(),
        })
    }

    fn times(reply: &AdminReply) -> Vec<u64> {
        let history = reply.history().expect("history");
        history.iter().map(|s| s.t_ms).collect()
    }

    /// Seen in CI: two allocations in one millisecond gave two samples of one `t_ms`, and
    /// a reader paging by `since_ms` across them never saw the second.
    #[test]
    fn sample_times_strictly_increase_so_no_page_skips_one() {
        let board = HistoryBoard::new();
        board.publish(Some(sample(10, &[("1", 500.0)])), None);
        board.publish(Some(sample(20, &[("1", 400.0)])), None);
        board.publish(Some(sample(20, &[("1", 300.0)])), None);
        board.publish(Some(sample(15, &[("1", 250.0)])), None);
        board.publish(Some(sample(30, &[("1", 200.0)])), None);
        assert_eq!(times(&board.answer(None, None, 0)), [10, 20, 21, 22, 30]);
        let history = board
            .answer(None, None, 0)
            .history()
            .expect("history")
            .to_vec();
        let caps: Vec<f64> = history.iter().map(|s| s.caps["1"]).collect();
        assert_eq!(
            caps,
            [500.0, 400.0, 300.0, 250.0, 200.0],
            "every sample kept, in order"
        );
        // Paged one at a time, every sample is seen once.
        let mut seen = Vec::new();
        let mut since = None;
        loop {
            let page = times(&board.answer(since, Some(1), 0));
            let Some(&last) = page.last() else { break };
            seen.extend(page);
            since = Some(last);
        }
        assert_eq!(seen, [10, 20, 21, 22, 30]);
    }

    /// Any local user may ask for the history (8,640 samples x every job's cap in all):
    /// from the board an answer is bounded, thinned with the newest kept, paged, and the
    /// board itself bounded, so no request costs the allocation loop.
    #[test]
    fn a_history_request_is_bounded_thinned_and_paged() {
        let board = HistoryBoard::new();
        let most = MAX_HISTORY_SAMPLES as usize;
        assert_eq!(times(&board.answer(None, None, 0)), Vec::<u64>::new());
        // 100 more than the board keeps: the oldest 100 are gone.
        let dropped = 100;
        for t_ms in 0..(HISTORY + dropped) as u64 {
            board.publish(Some(sample(t_ms, &[])), None);
        }
        assert_eq!(board.len(), HISTORY, "the board is bounded");
        let oldest = dropped as u64;
        let newest = (HISTORY + dropped) as u64 - 1;

        let all = times(&board.answer(None, None, 0));
        assert_eq!(all.len(), most);
        assert_eq!(all.first(), Some(&oldest));
        assert_eq!(all.last(), Some(&newest), "the newest kept");
        assert!(all.windows(2).all(|w| w[0] < w[1]), "in order, no repeats");
        // Evenly thinned: no gap more than one step wider than another.
        let gaps: Vec<u64> = all.windows(2).map(|w| w[1] - w[0]).collect();
        let (narrowest, widest) = (gaps.iter().min(), gaps.iter().max());
        assert!(
            widest.zip(narrowest).is_some_and(|(w, n)| w - n <= 1),
            "{gaps:?}"
        );

        let page = times(&board.answer(None, Some(1_000_000), 0));
        assert_eq!(page.len(), most, "bounded whatever is asked");
        assert_eq!(page[0], oldest, "a page starts at the oldest");
        assert!(page.windows(2).all(|w| w[1] == w[0] + 1), "a page is whole");
        // Paging: after the last t_ms of a page comes the next, with no sample twice.
        let next = times(&board.answer(page.last().copied(), Some(1_000_000), 0));
        assert_eq!(next[0], page[most - 1] + 1);
        assert_eq!(next.len(), most);
        // `since_ms` is exclusive; a short overview comes whole.
        let tail = times(&board.answer(Some(8000), None, 0));
        assert_eq!(tail.len() as u64, newest - 8000, "a short overview whole");
        assert_eq!(tail[0], 8001);
        assert_eq!(times(&board.answer(None, Some(1), 0)), [oldest]);
        assert_eq!(
            times(&board.answer(None, Some(0), 0)),
            [oldest],
            "at least one"
        );
        assert!(times(&board.answer(Some(u64::MAX), None, 0)).is_empty());
        assert!(times(&board.answer(Some(newest), Some(10), 0)).is_empty());
    }

    /// Need-to-know from the board: a user reads the site's figures in every sample and
    /// the caps of their own jobs only — also of a job that has ended, whose owner the
    /// core still reports; root reads every cap. The owners in force are the last
    /// published, for every sample.
    #[test]
    fn a_user_reads_only_their_own_jobs_caps_from_the_board() {
        let board = HistoryBoard::new();
        // Jobs 1 and 4 are alice's, 2 bob's; 3's owner is unknown (an older agent).
        let owners: OwnerMap = [("1", ALICE), ("2", BOB), ("4", ALICE)]
            .map(|(j, u)| (j.to_string(), u))
            .into();
        board.publish(
            Some(sample(1, &[("1", 500.0), ("2", 400.0), ("3", 300.0)])),
            Some(Arc::new(owners.clone())),
        );
        board.publish(Some(sample(2, &[("2", 410.0), ("4", 200.0)])), None);
        let caps_of = |uid: u32| -> Vec<Vec<(String, f64)>> {
            let reply = board.answer(None, None, uid);
            assert!(reply.is_ok() && reply.error_message().is_none());
            let history = reply.history().expect("history").to_vec();
            assert_eq!(history.len(), 2, "every caller reads every sample");
            assert!(history
                .iter()
                .all(|s| s.budget_w == 1.0 && s.draw_w == 1.0 && s.simulated));
            history
                .into_iter()
                .map(|s| s.caps.into_iter().collect())
                .collect()
        };
        let caps = |list: &[(&str, f64)]| -> Vec<(String, f64)> {
            list.iter().map(|(j, c)| (j.to_string(), *c)).collect()
        };
        assert_eq!(
            caps_of(ALICE),
            [caps(&[("1", 500.0)]), caps(&[("4", 200.0)])]
        );
        assert_eq!(caps_of(BOB), [caps(&[("2", 400.0)]), caps(&[("2", 410.0)])]);
        assert_eq!(caps_of(1003), [caps(&[]), caps(&[])], "no job, no caps");
        assert_eq!(
            caps_of(0),
            [
                caps(&[("1", 500.0), ("2", 400.0), ("3", 300.0)]),
                caps(&[("2", 410.0), ("4", 200.0)])
            ],
            "root reads all, the job of unknown owner too"
        );
        // The step forgot job 1's owner (past the window): nobody but root reads it now.
        let mut later = owners;
        later.remove("1");
        board.publish(None, Some(Arc::new(later)));
        assert_eq!(caps_of(ALICE), [caps(&[]), caps(&[("4", 200.0)])]);
        // The same rule as every other admin reply's: the board's answer to each caller is
        // root's, filtered by `need_to_know` with the same owners.
        let owners = board.lock().owners.clone();
        for uid in [0, ALICE, BOB, 1003] {
            let filtered = owners::need_to_know(board.answer(None, None, 0), uid, |job| {
                owners.get(job).copied()
            });
            assert_eq!(filtered, board.answer(None, None, uid), "uid {uid}");
        }
    }

    /// The samples handed out are the board's own, shared: a page is pointers until it
    /// is filtered, and a sample dropped from the board lives on in an answer being made.
    #[test]
    fn a_page_shares_the_samples_it_picks() {
        let board = HistoryBoard::new();
        let first = sample(0, &[("1", 500.0)]);
        board.publish(Some(first.clone()), None);
        let picked = page(&board.lock().samples, None, None);
        assert!(Arc::ptr_eq(&picked[0], &first));
        drop(first);
        for t_ms in 1..=HISTORY as u64 {
            board.publish(Some(sample(t_ms, &[])), None);
        }
        assert_eq!(
            times(&board.answer(None, Some(1), 0)),
            [1],
            "dropped from the board"
        );
        assert_eq!(picked[0].caps, BTreeMap::from([("1".to_string(), 500.0)]));
    }
}
