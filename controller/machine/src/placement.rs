//! Trust from Slurm's record, not from a node's word. Pure.
//!
//! A node's link key proves which node speaks, nothing more: root on one GPU node holds
//! that node's key, and could report another user's job on another node (as `flex3`,
//! `preempt=requeue`) or announce hundreds of GPUs to force a deep cut. So the controller
//! believes a node only about the jobs Slurm places on that node, takes each job's owner
//! from Slurm, and counts a node's GPUs up to what Slurm configures for it
//! ([`Placement::believe`]). What it refuses it counts per node, so `status` and the
//! metrics say which node sent it.
//!
//! The placement comes from `squeue --json` / `sinfo --json` (see
//! [`powerflex_core::slurm_record`]), read by the controller's I/O edge with a deadline;
//! when Slurm is slow or away the last one read stays in force.

use std::collections::BTreeMap;

use powerflex_core::slurm_record::SlurmJobs;
use powerflex_proto::report::{GpuInfo, JobReport};

/// What Slurm said at one moment: its jobs, and the GPUs it configures per node.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Placement {
    pub jobs: SlurmJobs,
    /// Node → GPUs of its `gpu` gres. A node Slurm does not list has none.
    pub node_gpus: BTreeMap<String, u32>,
    /// When it was read, ms since the epoch.
    pub read_at_ms: u64,
}

/// Why a node's word about a job was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RefusedBecause {
    /// Slurm does not list the job at all (yet, or any more).
    UnknownJob,
    /// Slurm places the job on other nodes, or it is not running.
    NotOnThisNode,
    /// No placement has been read from Slurm yet.
    NoPlacementYet,
}

impl RefusedBecause {
    pub fn label(self) -> &'static str {
        match self {
            RefusedBecause::UnknownJob => "unknown_job",
            RefusedBecause::NotOnThisNode => "not_on_this_node",
            RefusedBecause::NoPlacementYet => "no_placement_yet",
        }
    }
}

/// What one node said that was believed, and what was not.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Believed {
    /// The reports of jobs Slurm places on the node, each with Slurm's owner.
    pub jobs: Vec<JobReport>,
    /// The jobs refused, and why.
    pub refused: Vec<(String, RefusedBecause)>,
    /// The node's GPUs, at most as many as Slurm configures for it.
    pub gpus: Vec<GpuInfo>,
    /// GPUs announced beyond Slurm's count.
    pub gpus_refused: usize,
}

impl Placement {
    /// What to believe of `node`'s reports and announced GPUs. `placement` `None`: Slurm
    /// has not answered yet, and no job is believed (its GPUs count at their default in
    /// the budget, as unmanaged ones do, so nothing is over-drawn meanwhile).
    pub fn believe(
        placement: Option<&Placement>,
        node: &str,
        reports: &[JobReport],
        gpus: &[GpuInfo],
    ) -> Believed {
        let Some(placement) = placement else {
            return Believed {
                jobs: Vec::new(),
                refused: reports
                    .iter()
                    .map(|r| (r.job_id.clone(), RefusedBecause::NoPlacementYet))
                    .collect(),
                gpus: gpus.to_vec(),
                gpus_refused: 0,
            };
        };
        let mut believed = Believed::default();
        for report in reports {
            match placement.jobs.get(&report.job_id) {
                None => believed
                    .refused
                    .push((report.job_id.clone(), RefusedBecause::UnknownJob)),
                Some(job) if !(job.state.holds_nodes() && job.nodes.contains(node)) => believed
                    .refused
                    .push((report.job_id.clone(), RefusedBecause::NotOnThisNode)),
                Some(job) => {
                    let mut report = report.clone();
                    // Slurm's owner, whatever the agent learnt: need-to-know filters by it.
                    report.owner_uid = Some(job.uid);
                    believed.jobs.push(report);
                }
            }
        }
        let configured = placement.node_gpus.get(node).copied().unwrap_or(0) as usize;
        believed.gpus = gpus.iter().take(configured).cloned().collect();
        believed.gpus_refused = gpus.len().saturating_sub(configured);
        believed
    }
}

/// `gpus` with each one's limits held to `max_gpu_w`, the highest `max_cap_w` of the
/// site's GPU models: a node announcing 5 kW GPUs where the site runs 700 W ones is not
/// paid for at 5 kW. Whether anything was clamped is returned too.
pub fn bound_gpu_power(gpus: &[GpuInfo], max_gpu_w: f64) -> (Vec<GpuInfo>, bool) {
    let mut clamped = false;
    let out = gpus
        .iter()
        .map(|g| {
            let mut g = g.clone();
            for w in [&mut g.max_w, &mut g.default_w, &mut g.min_w] {
                if !w.is_finite() || *w > max_gpu_w {
                    *w = max_gpu_w;
                    clamped = true;
                }
            }
            g
        })
        .collect();
    (out, clamped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_core::slurm_record::{SlurmJob, SlurmJobState};

    fn report(id: &str, owner: Option<u32>) -> JobReport {
        JobReport {
            job_id: id.into(),
            tier: "flex3,preempt=requeue".into(),
            gpus: 1,
            cap_w: None,
            power_w: None,
            throughput: None,
            throughput_unit: None,
            pfi: None,
            pfi_source: None,
            points: Vec::new(),
            gpu_uuids: Vec::new(),
            power_cap_w: None,
            power_cap_steady_s: None,
            calibrating: false,
            curve_in_question: false,
            curve: Vec::new(),
            calibration_cost_pct: None,
            owner_uid: owner,
            usage: None,
        }
    }

    fn gpu(i: u32) -> GpuInfo {
        GpuInfo {
            uuid: format!("GPU-{i}"),
            name: "H200".into(),
            min_w: 200.0,
            max_w: 700.0,
            default_w: 700.0,
        }
    }

    fn placement() -> Placement {
        let job = |nodes: &[&str], uid, state| SlurmJob {
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            uid,
            state,
            admin_comment: String::new(),
            account: String::new(),
            start_unix_s: None,
        };
        Placement {
            jobs: BTreeMap::from([
                (
                    "1".into(),
                    job(&["n1", "n2"], 1001, SlurmJobState::OnItsNodes),
                ),
                ("2".into(), job(&["n2"], 1002, SlurmJobState::Suspended)),
                ("3".into(), job(&[], 1003, SlurmJobState::Pending)),
            ]),
            node_gpus: BTreeMap::from([("n1".into(), 2), ("n2".into(), 4)]),
            read_at_ms: 1,
        }
    }

    #[test]
    fn a_node_is_believed_only_about_jobs_slurm_places_on_it_with_slurm_s_owner() {
        let p = placement();
        let reports = [
            report("1", Some(0)),
            report("2", None),
            report("3", None),
            report("9", None),
        ];
        let on_n1 = Placement::believe(Some(&p), "n1", &reports, &[]);
        assert_eq!(on_n1.jobs.len(), 1);
        assert_eq!(on_n1.jobs[0].job_id, "1");
        assert_eq!(
            on_n1.jobs[0].owner_uid,
            Some(1001),
            "Slurm's owner, not the node's"
        );
        assert_eq!(
            on_n1.refused,
            vec![
                ("2".into(), RefusedBecause::NotOnThisNode),
                ("3".into(), RefusedBecause::NotOnThisNode),
                ("9".into(), RefusedBecause::UnknownJob),
            ]
        );
        // A suspended job still holds its node.
        let on_n2 = Placement::believe(Some(&p), "n2", &reports, &[]);
        let ids: Vec<&str> = on_n2.jobs.iter().map(|j| j.job_id.as_str()).collect();
        assert_eq!(ids, ["1", "2"]);
        // Before Slurm answered, nothing is believed.
        let none = Placement::believe(None, "n1", &reports, &[gpu(0)]);
        assert!(none.jobs.is_empty());
        assert_eq!(none.refused.len(), 4);
        assert_eq!(none.gpus.len(), 1);
    }

    #[test]
    fn a_node_s_gpus_are_bounded_by_slurm_s_gres() {
        let p = placement();
        let announced: Vec<GpuInfo> = (0..300).map(gpu).collect();
        let n1 = Placement::believe(Some(&p), "n1", &[], &announced);
        assert_eq!((n1.gpus.len(), n1.gpus_refused), (2, 298));
        let stranger = Placement::believe(Some(&p), "n7", &[], &announced);
        assert_eq!((stranger.gpus.len(), stranger.gpus_refused), (0, 300));
    }

    #[test]
    fn a_gpu_s_power_is_bounded_by_the_site_s_largest_model() {
        let mut big = gpu(0);
        big.max_w = 5000.0;
        big.default_w = 5000.0;
        let (bounded, clamped) = bound_gpu_power(&[big, gpu(1)], 700.0);
        assert!(clamped);
        assert_eq!(
            (bounded[0].max_w, bounded[0].default_w, bounded[0].min_w),
            (700.0, 700.0, 200.0)
        );
        assert_eq!(bounded[1], gpu(1));
        assert!(!bound_gpu_power(&[gpu(1)], 700.0).1);
    }
}
