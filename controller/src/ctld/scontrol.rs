//! `scontrol` annotations: each managed job's tier, PFI and cap in its `AdminComment`, so
//! admins see them in `scontrol show job` (and, for a job held out of a deep cut, why it
//! is suspended or requeued). The core decides what changed
//! ([`powerflex_controller_machine::controller::annotate::changes`]); one thread runs `scontrol`
//! for each change ([`spawn_annotator`]), another runs the suspensions, resumptions,
//! requeues and releases the core asks for ([`spawn_preemptor`]).

use std::sync::{Arc, Mutex, PoisonError};

use crossbeam_channel::{unbounded, Sender};
use tracing::{info, warn};

use powerflex_controller_machine::preempt::Action;
use powerflex_core::UnixMs;
use powerflex_daemon::clock::{BootClock, Clock};

pub use powerflex_controller_machine::controller::annotate::changes;

/// Whether a Slurm command decided under a leadership epoch may still run: only while
/// that leadership steers, and, under `[controller.ha]`, before its step-down deadline
/// on the leadership clock (which counts a pause or a suspend: a thawed old leader finds
/// it passed before its loop has noticed). Checked by the runners just before each
/// `scontrol`; the loop moves it after every step.
#[derive(Debug, Clone)]
pub struct SlurmGate {
    open: Arc<Mutex<Option<Opening>>>,
    clock: BootClock,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Opening {
    epoch: u64,
    /// `None`: no deadline (a single controller).
    until: Option<UnixMs>,
}

impl SlurmGate {
    /// Closed until the loop opens it, with deadlines on `clock` (the leadership's).
    pub fn closed(clock: BootClock) -> SlurmGate {
        SlurmGate {
            open: Arc::new(Mutex::new(None)),
            clock,
        }
    }

    /// Commands of `epoch` run until `until` (`None`: for as long as it stays open).
    pub fn open(&self, epoch: u64, until: Option<UnixMs>) {
        *self.open.lock().unwrap_or_else(PoisonError::into_inner) = Some(Opening { epoch, until });
    }

    /// No command runs: this controller does not steer.
    pub fn close(&self) {
        *self.open.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// Whether a command decided under `epoch` may run now.
    pub fn allows(&self, epoch: u64) -> bool {
        let open = *self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.is_some_and(|o| {
            o.epoch == epoch && o.until.is_none_or(|until| self.clock.now() < until)
        })
    }
}

/// A command for Slurm with the leadership epoch that decided it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decided<T> {
    pub epoch: u64,
    pub what: T,
}

/// Runs `scontrol suspend|resume|requeuehold|release JOB` for each queued action the
/// `gate` still allows (one whose leadership ended is dropped and logged), logging
/// each outcome. A failure leaves the job as it was; the core counts a held job at what
/// it draws (at most its lowest cap, which its lease holds it to), so a suspension that
/// did not happen costs the budget nothing, only the other jobs' watts.
pub fn spawn_preemptor(gate: SlurmGate) -> Sender<Decided<Action>> {
    let (tx, rx) = unbounded::<Decided<Action>>();
    std::thread::spawn(move || {
        for Decided {
            epoch,
            what: action,
        } in &rx
        {
            let args = action.scontrol_args();
            if !gate.allows(epoch) {
                warn!(job_id = %action.job(), action = args[0], epoch, "not run: the leadership that decided it no longer steers");
                continue;
            }
            match scontrol(&args) {
                Ok(()) => {
                    info!(job_id = %action.job(), action = args[0], "scontrol done");
                    // Slurm holds a requeued batch job back for a while after the requeue
                    // (its EligibleTime); the cut that requeued it is over, so it may
                    // start as soon as the scheduler finds it room.
                    if let Action::Release { job } = &action {
                        if !gate.allows(epoch) {
                            continue;
                        }
                        let job_arg = format!("JobId={job}");
                        if let Err(e) = scontrol(&["update", &job_arg, "StartTime=now"]) {
                            info!(job_id = %job, error = %e, "could not bring the released job's start forward; Slurm starts it after its requeue delay");
                        }
                    }
                }
                Err(e) => {
                    tracing::error!(job_id = %action.job(), action = args[0], error = %e, "scontrol refused or did not answer");
                }
            }
        }
    });
    tx
}

/// The longest one `scontrol` call may take: a wedged `slurmctld` must not stall the
/// queue of preemptions and annotations for ever (the next allocation asks again).
const SCONTROL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs `scontrol ARGS` with [`SCONTROL_DEADLINE`].
fn scontrol(args: &[&str]) -> Result<(), powerflex_daemon::DaemonError> {
    powerflex_daemon::command::output_within("scontrol", args, &[], SCONTROL_DEADLINE, 64 * 1024)
        .map(|_| ())
}

/// Runs `scontrol update JobId=N AdminComment=...` for each queued job the `gate` still
/// allows (as [`spawn_preemptor`]), so admins see the job's tier, PFI and cap in
/// `scontrol show job`. Where scontrol is missing or fails,
/// it says so once and carries on without: the annotation is a courtesy, not control.
pub fn spawn_annotator(gate: SlurmGate) -> Sender<Decided<(String, String)>> {
    let (tx, rx) = unbounded::<Decided<(String, String)>>();
    std::thread::spawn(move || {
        let mut warned = false;
        for Decided {
            epoch,
            what: (job, text),
        } in &rx
        {
            if !gate.allows(epoch) {
                info!(job_id = %job, epoch, "AdminComment not written: the leadership that decided it no longer steers");
                continue;
            }
            let job_arg = format!("JobId={job}");
            let comment = format!("AdminComment={text}");
            match scontrol(&["update", &job_arg, &comment]) {
                Ok(()) => {}
                // No scontrol on this host: stop trying, the queue just drains.
                Err(powerflex_daemon::DaemonError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    if !warned {
                        info!(
                            "scontrol is not installed here; Slurm will not show powerflex's caps"
                        );
                    }
                    for _ in rx.iter() {}
                    return;
                }
                Err(e) if !warned => {
                    warned = true;
                    info!(job_id = %job, error = %e, "scontrol cannot annotate jobs here; Slurm will not show powerflex's caps");
                }
                Err(_) => {}
            }
        }
    });
    tx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_runs_only_under_the_leadership_that_decided_it_and_before_its_deadline() {
        let clock = BootClock::start();
        let gate = SlurmGate::closed(clock);
        assert!(!gate.allows(0), "closed until the loop opens it");
        gate.open(0, None);
        assert!(gate.allows(0), "a single controller: no deadline");
        let now = clock.now();
        gate.open(3, Some(UnixMs(now.ms() + 60_000)));
        assert!(gate.allows(3));
        assert!(
            !gate.allows(2),
            "a command of an earlier leadership is dropped"
        );
        // The deadline passed (as for a leader paused past it): dropped.
        gate.open(3, Some(UnixMs(now.ms().saturating_sub(1))));
        assert!(!gate.allows(3));
        gate.open(3, Some(UnixMs(now.ms() + 60_000)));
        gate.close();
        assert!(
            !gate.allows(3),
            "a controller that stopped steering runs nothing"
        );
    }
}
