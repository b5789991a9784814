//! `scontrol` annotations: each managed job's tier, PFI and cap in its `AdminComment`, so
//! admins see them in `scontrol show job` (and, for a job held out of a deep cut, why it
//! is suspended or requeued). The core decides what changed
//! ([`powerflex_controller_machine::controller::annotate::changes`]); one thread runs `scontrol`
//! for each change ([`spawn_annotator`]), another runs the suspensions, resumptions,
//! requeues and releases the core asks for ([`spawn_preemptor`]).

use crossbeam_channel::{unbounded, Sender};
use tracing::info;

use powerflex_controller_machine::preempt::Action;

pub use powerflex_controller_machine::controller::annotate::changes;

/// Runs `scontrol suspend|resume|requeuehold|release JOB` for each queued action, logging
/// each outcome. A failure leaves the job as it was; the core counts a held job at what
/// it draws (at most its lowest cap, which its lease holds it to), so a suspension that
/// did not happen costs the budget nothing, only the other jobs' watts.
pub fn spawn_preemptor() -> Sender<Action> {
    let (tx, rx) = unbounded::<Action>();
    std::thread::spawn(move || {
        for action in &rx {
            let args = action.scontrol_args();
            match scontrol(&args) {
                Ok(()) => {
                    info!(job_id = %action.job(), action = args[0], "scontrol done");
                    // Slurm holds a requeued batch job back for a while after the requeue
                    // (its EligibleTime); the cut that requeued it is over, so it may
                    // start as soon as the scheduler finds it room.
                    if let Action::Release { job } = &action {
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

/// Runs `scontrol update JobId=N AdminComment=...` for each queued job, so admins see
/// the job's tier, PFI and cap in `scontrol show job`. Where scontrol is missing or fails,
/// it says so once and carries on without: the annotation is a courtesy, not control.
pub fn spawn_annotator() -> Sender<(String, String)> {
    let (tx, rx) = unbounded::<(String, String)>();
    std::thread::spawn(move || {
        let mut warned = false;
        for (job, text) in &rx {
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
