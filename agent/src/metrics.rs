//! Prometheus text exposition of the agent's snapshot, served on a loopback port. The
//! families (names, label sets) are the shared catalog's, so the agent's and the
//! controller's series join on the same labels.

use std::net::TcpListener;
use std::sync::Arc;

use powerflex_daemon::http::{HttpOptions, MetricsServer};
use powerflex_daemon::prom::{catalog, TextWriter};

use crate::server::{ServerStats, SnapshotCell, SocketStats};
use powerflex_proto::status::{
    AgentGpuStatus as GpuView, AgentJobStatus as JobView, AgentStatus as Snapshot,
};

/// Renders a snapshot and the sockets' counters in the Prometheus text format (version
/// 0.0.4). No series carries a uid: who runs which job is not the metrics' to tell.
pub fn render(s: &Snapshot, sockets: &ServerStats) -> String {
    let node = s.node.as_str();
    let indices: Vec<String> = s.gpus.iter().map(|g| g.index.to_string()).collect();
    let gpus = || s.gpus.iter().zip(&indices);
    let mut w = TextWriter::new();
    let gpu_rows = |value: fn(&GpuView) -> Option<f64>| {
        gpus()
            .filter_map(|(g, i)| Some(([node, i.as_str(), g.uuid.as_str()], value(g)?)))
            .collect::<Vec<_>>()
    };
    w.family(&catalog::GPU_POWER_WATTS, gpu_rows(|g| g.power_w))
        .family(&catalog::GPU_CAP_WATTS, gpu_rows(|g| g.cap_w))
        .family(
            &catalog::GPU_DEFAULT_CAP_WATTS,
            gpu_rows(|g| Some(g.default_w)),
        )
        .family(&catalog::GPU_ENERGY_JOULES_TOTAL, gpu_rows(|g| g.energy_j))
        .family(
            &catalog::GPU_DEGRADED,
            gpu_rows(|g| Some(if g.degraded.is_some() { 1.0 } else { 0.0 })),
        )
        .family(
            &catalog::GPU_OWNED_ELSEWHERE,
            gpu_rows(|g| Some(if g.owned_elsewhere { 1.0 } else { 0.0 })),
        );
    let job_rows = |value: fn(&JobView) -> Option<f64>| {
        s.jobs
            .iter()
            .filter_map(|j| Some(([node, j.job.as_str(), j.tier.as_str()], value(j)?)))
            .collect::<Vec<_>>()
    };
    w.family(&catalog::JOB_PFI, job_rows(|j| j.pfi.or(j.prior_pfi)))
        .family(&catalog::JOB_CAP_WATTS, job_rows(|j| j.cap_w))
        .family(&catalog::JOB_THROUGHPUT, job_rows(|j| j.throughput));
    w.family(
        &catalog::JOB_CALIBRATION_STATE,
        s.jobs.iter().map(|j| {
            (
                [node, j.job.as_str(), j.tier.as_str(), j.calibration.name()],
                1.0,
            )
        }),
    )
    .family(
        &catalog::AGENT_FAILSAFE,
        [([node], if s.failsafe { 1.0 } else { 0.0 })],
    )
    .family(
        &catalog::PROGRESS_REJECTED_TOTAL,
        [([node], s.progress_rejected as f64)],
    )
    .family(
        &catalog::GPU_FOREIGN_USE_TOTAL,
        [([node], s.gpu_foreign_use as f64)],
    );
    let load =
        |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed) as f64;
    let socks: [(&str, &SocketStats); 2] = [
        ("control", &sockets.control),
        ("progress", &sockets.progress),
    ];
    w.family(
        &catalog::AGENT_CONNECTIONS_REFUSED_TOTAL,
        socks.iter().flat_map(|&(name, st)| {
            [
                ([node, name, "full"], load(&st.refused_full)),
                ([node, name, "per_uid"], load(&st.refused_per_uid)),
            ]
        }),
    )
    .family(
        &catalog::AGENT_CONNECTIONS_TIMED_OUT_TOTAL,
        socks
            .iter()
            .map(|&(name, st)| ([node, name], load(&st.timed_out))),
    )
    .family(
        &catalog::PROGRESS_REPORTS_SKIPPED_TOTAL,
        [([node], load(&sockets.progress.reports_skipped))],
    );
    w.finish()
}

/// Serves `GET /metrics` from the published snapshot until the server is stopped.
pub fn spawn(
    listener: TcpListener,
    snapshot: SnapshotCell,
    sockets: Arc<ServerStats>,
) -> Result<MetricsServer, powerflex_daemon::DaemonError> {
    MetricsServer::spawn(listener, HttpOptions::default(), move || {
        let snap = snapshot.read().map(|s| Arc::clone(&s)).ok();
        snap.map(|s| render(&s, &sockets)).unwrap_or_default()
    })
}
