//! `scontrol` annotations: each managed job's tier, PFI and cap in its `AdminComment`, so
//! admins see them in `scontrol show job` (and, for a job held out of a deep cut, why it
//! is suspended or requeued). The core decides what changed ([`changes`]); one thread
//! runs `scontrol` for each change ([`spawn_annotator`]), another runs the suspensions,
//! resumptions, requeues and releases the core asks for ([`spawn_preemptor`]).

use std::collections::BTreeMap;

use crossbeam_channel::{unbounded, Sender};
use tracing::info;

use powerflex_proto::link::JobReport;

use crate::preempt::{Action, Preempted};
use crate::site::Decision;

/// The annotations `decision` calls for that differ from those already made (`done`,
/// job → text, updated in place; jobs no longer allocated are forgotten). Pure.
pub fn changes<'a>(
    decision: &Decision,
    held: &'a BTreeMap<String, Preempted>,
    reports: impl Iterator<Item = &'a JobReport> + Clone,
    done: &mut BTreeMap<String, String>,
) -> Vec<(String, String)> {
    let Some(allocation) = &decision.allocation else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut live: Vec<&str> = Vec::new();
    for (id, p) in held {
        let tier = reports
            .clone()
            .find(|j| &j.job_id == id)
            .map_or("-", |r| r.tier.as_str());
        // What the user reads in `scontrol show job`: held, why, and until when.
        let how = match p.how {
            powerflex_core::flex::Preempt::Requeue => "requeued",
            _ => "suspended",
        };
        let text = format!(
            "powerflex;tier={tier};{how}:grid-cut-deeper-than-every-cap-floor;back-when-the-cut-ends"
        );
        live.push(id);
        if done.get(id) != Some(&text) {
            done.insert(id.clone(), text.clone());
            out.push((id.clone(), text));
        }
    }
    for job in &allocation.jobs {
        let report = reports.clone().find(|j| j.job_id == job.id);
        let tier = report.map_or("-", |r| r.tier.as_str());
        let pfi = report
            .and_then(|r| r.pfi)
            .map_or("-".to_string(), |p| format!("{p:.2}"));
        // Energy so far over the job's nodes, floored to two significant digits: the text
        // (and so an `scontrol update`) changes a few dozen times in a job's life, not at
        // every report. Slurm refuses updates once a job has finished, so this is the
        // last figure `sacct` shows; the exact one is the controller's record.
        let energy_mj: u64 = reports
            .clone()
            .filter(|j| j.job_id == job.id)
            .filter_map(|j| j.usage.as_ref().map(|u| u.energy_mj))
            .fold(0u64, u64::saturating_add);
        let energy = if energy_mj > 0 {
            format!(
                ";energy_kwh_so_far={}",
                floor_two_digits(energy_mj as f64 / 1000.0 / powerflex_proto::usage::J_PER_KWH)
            )
        } else {
            String::new()
        };
        // No spaces: `scontrol show job` prints key=value pairs separated by spaces.
        let text = format!(
            "powerflex;tier={tier};pfi={pfi};cap={:.0}W{energy}",
            job.cap_w.0
        );
        live.push(&job.id);
        if done.get(&job.id) != Some(&text) {
            done.insert(job.id.clone(), text.clone());
            out.push((job.id.clone(), text));
        }
    }
    done.retain(|id, _| live.contains(&id.as_str()));
    out
}

/// `x` floored to two significant digits, without trailing noise (`0.0012`, `1.2`, `34`).
fn floor_two_digits(x: f64) -> String {
    if !(x.is_finite() && x > 0.0) {
        return "0".to_string();
    }
    let exponent = x.log10().floor() as i32 - 1;
    let scale = 10f64.powi(exponent);
    let floored = (x / scale).floor() * scale;
    let decimals = (-exponent).max(0) as usize;
    format!("{floored:.decimals$}")
}

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
