//! Progress reports: who may report for a job, and what a report does to its log.

use powerflex_proto::ProgressReport;

use super::{Agent, Job, ReportSender};
use crate::calibration::Recorded;
use crate::MachineError;

impl Agent {
    /// A progress report as it came off the progress socket: accepted when `sender` may
    /// report for the job it names (its owner or root, from a step of the same Slurm
    /// cluster as the job's step daemons), then recorded (see [`Self::progress`]). A
    /// refusal is counted, and its reason goes back to the sender.
    pub(super) fn report_progress(
        &mut self,
        now: f64,
        sender: &ReportSender,
        report: &ProgressReport,
    ) -> Result<(), MachineError> {
        let outcome = match self.jobs.get(&report.job_id) {
            None => Err(MachineError::NoSuchJob(report.job_id.clone())),
            Some(job) if job.uid != sender.uid && sender.uid != 0 => {
                Err(MachineError::NotJobOwner {
                    uid: sender.uid,
                    job_id: report.job_id.clone(),
                    owner: job.uid,
                })
            }
            // Same id, another cluster on this host (the test clusters): not this job.
            Some(Job {
                cluster: Some(cluster),
                ..
            }) if *cluster != sender.cluster => Err(MachineError::OtherCluster {
                pid: sender.pid,
                step_job: sender.step_job.clone(),
                cluster: sender.cluster.clone(),
                job_id: report.job_id.clone(),
            }),
            Some(_) => self.progress(now, &report.job_id, sender.pid, report.tokens, report.steps),
        };
        if outcome.is_err() {
            self.progress_rejected += 1;
        }
        outcome
    }

    /// A progress line the socket refused before it reached the machine (unreadable,
    /// or from a process in no Slurm step): counted with the refused reports.
    pub(super) fn progress_refused(&mut self) {
        self.progress_rejected += 1;
    }

    /// A progress report from a verified process of `job_id`; `source` is the sending
    /// process (each reporter's counter is followed on its own, see [`ProgressLog`]).
    pub(super) fn progress(
        &mut self,
        now: f64,
        job_id: &str,
        source: u32,
        tokens: u64,
        steps: u64,
    ) -> Result<(), MachineError> {
        let job = self
            .jobs
            .get_mut(job_id)
            .ok_or_else(|| MachineError::NoSuchJob(job_id.to_string()))?;
        let count = if tokens > 0 {
            tokens as f64
        } else {
            steps as f64
        };
        match job.log.record_from(now, source, count) {
            Recorded::First | Recorded::Forward => {}
            Recorded::NewReporter { reporters } => tracing::info!(
                job_id,
                pid = source,
                reporters,
                "another process reports this job's progress; each reporter's progress counts from its first report"
            ),
            // Rate-limited: a reporter that keeps resetting its counter must not flood
            // the log.
            Recorded::Restarted { from, to }
                if job.log.restarts <= 3 || job.log.restarts.is_power_of_two() =>
            {
                tracing::warn!(
                    job_id,
                    pid = source,
                    from,
                    to,
                    restarts = job.log.restarts,
                    "a reporter's progress count went backwards (its counter restarted); its progress counts again from here"
                )
            }
            Recorded::Restarted { .. } => {}
        }
        job.counts_tokens = Some(tokens > 0);
        Ok(())
    }
}
