//! How each job's curve improved: a snapshot after its calibration and after every grid
//! event since, so `powerflexctl report` can show learning in operation at work (points
//! added, windows behind them, uncertainty shrinking). Pure.

use std::collections::BTreeMap;

use powerflex_proto::status::{CurvePoint, CurveSnapshot, SnapshotAfter};

use super::session::Session;

/// Snapshots kept per job: the first (calibrated) and the latest ones.
pub const MAX_SNAPSHOTS: usize = 32;

/// Updates `history` after an allocation at `now_ms`: a job whose curve is reported for
/// the first time (its walk done) gets a `calibrated` snapshot; when `ended_event` ended
/// since the last allocation, every job with a curve gets an `event <id>` snapshot.
/// Jobs no node reports any more are forgotten. A job's curve is the one reported by
/// its first node by name (each node estimates the job from its own windows).
pub fn record(
    history: &mut BTreeMap<String, Vec<CurveSnapshot>>,
    sessions: &BTreeMap<String, Session>,
    ended_event: Option<u64>,
    now_ms: u64,
) {
    let mut reported: BTreeMap<&str, Option<(&str, &[CurvePoint])>> = BTreeMap::new();
    for (node, s) in sessions {
        for j in &s.view.jobs {
            let entry = reported.entry(j.job_id.as_str()).or_insert(None);
            // A job being walked again (or probed) still reports the curve it plans
            // on; a first walk reports none until it is done.
            if entry.is_none() && !j.curve.is_empty() {
                *entry = Some((node.as_str(), j.curve.as_slice()));
            }
        }
    }
    history.retain(|job, _| reported.contains_key(job.as_str()));
    for (job, curve) in reported {
        let Some((node, points)) = curve else {
            continue;
        };
        let snapshots = history.entry(job.to_string()).or_default();
        let after = if snapshots.is_empty() {
            SnapshotAfter::Calibrated
        } else if let Some(id) = ended_event {
            SnapshotAfter::Event(id)
        } else {
            continue;
        };
        snapshots.push(CurveSnapshot {
            t_ms: now_ms,
            after,
            node: node.to_string(),
            points: points.to_vec(),
        });
        if snapshots.len() > MAX_SNAPSHOTS {
            // Keep the calibrated one: the baseline every later one is read against.
            snapshots.remove(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_decide::NodeView;
    use powerflex_proto::report::JobReport;

    fn point(cap_w: f64, sigma: f64, windows: u32) -> CurvePoint {
        CurvePoint {
            cap_w,
            power_w: cap_w * 4.0,
            throughput: cap_w,
            power_sigma_w: sigma,
            throughput_sigma: sigma,
            windows,
        }
    }

    fn sessions(curve: Vec<CurvePoint>, calibrating: bool) -> BTreeMap<String, Session> {
        let job = JobReport {
            job_id: "7".into(),
            tier: "flex2".into(),
            gpus: 4,
            cap_w: Some(700.0),
            power_w: Some(2800.0),
            throughput: Some(700.0),
            calibrating,
            curve,
            ..JobReport::default()
        };
        let view = NodeView {
            node: "n1".into(),
            gpus: Vec::new(),
            jobs: vec![job],
            power_w: 0.0,
            live: true,
        };
        [(
            "n1".to_string(),
            Session {
                reported_since_hello: true,
                ..Session::new(view, Vec::new())
            },
        )]
        .into()
    }

    #[test]
    fn a_snapshot_after_calibration_and_after_each_event_and_none_for_a_gone_job() {
        let mut history = BTreeMap::new();
        record(&mut history, &sessions(Vec::new(), true), None, 1);
        assert!(
            history.get("7").is_none_or(Vec::is_empty),
            "walking: no curve yet"
        );
        let first = vec![point(700.0, 5.0, 8), point(500.0, 6.0, 4)];
        record(&mut history, &sessions(first, false), None, 2);
        record(
            &mut history,
            &sessions(vec![point(700.0, 1.0, 9)], false),
            None,
            3,
        );
        assert_eq!(history["7"].len(), 1, "no event ended: nothing new");
        let later = vec![
            point(700.0, 5.0, 8),
            point(500.0, 2.0, 30),
            point(450.0, 4.0, 3),
        ];
        record(&mut history, &sessions(later, false), Some(4), 4);
        let h = &history["7"];
        assert_eq!(
            h.iter().map(|s| s.after).collect::<Vec<_>>(),
            [SnapshotAfter::Calibrated, SnapshotAfter::Event(4)]
        );
        assert!(h[1].windows() > h[0].windows());
        assert!(h[1].mean_relative_sigma() < h[0].mean_relative_sigma());
        record(&mut history, &BTreeMap::new(), Some(5), 5);
        assert!(history.is_empty(), "a job no node reports is forgotten");
    }
}
