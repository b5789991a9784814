//! Prometheus text exposition of the agent's snapshot, served on a loopback port.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::warn;

use crate::control::Snapshot;
use crate::server::SnapshotCell;

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Renders a snapshot in the Prometheus text format (version 0.0.4).
pub fn render(s: &Snapshot) -> String {
    let mut out = String::new();
    let node = escape(&s.node);
    let mut family = |name: &str, kind: &str, help: &str, rows: Vec<(String, f64)>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, value) in rows {
            let _ = writeln!(out, "{name}{{node=\"{node}\"{labels}}} {value}");
        }
    };
    let gpu =
        |g: &crate::control::GpuView| format!(",gpu=\"{}\",uuid=\"{}\"", g.index, escape(&g.uuid));
    family(
        "powerflex_gpu_power_watts",
        "gauge",
        "GPU power draw, W.",
        s.gpus
            .iter()
            .filter_map(|g| Some((gpu(g), g.power_w?)))
            .collect(),
    );
    family(
        "powerflex_gpu_cap_watts",
        "gauge",
        "GPU power limit set by powerflex, W.",
        s.gpus
            .iter()
            .filter_map(|g| Some((gpu(g), g.cap_w?)))
            .collect(),
    );
    family(
        "powerflex_gpu_default_cap_watts",
        "gauge",
        "GPU power limit restored when no job runs, W.",
        s.gpus.iter().map(|g| (gpu(g), g.default_w)).collect(),
    );
    family(
        "powerflex_gpu_energy_joules_total",
        "counter",
        "GPU energy since driver load, J.",
        s.gpus
            .iter()
            .filter_map(|g| Some((gpu(g), g.energy_j?)))
            .collect(),
    );
    family(
        "powerflex_gpu_degraded",
        "gauge",
        "1 when the GPU is out of service.",
        s.gpus
            .iter()
            .map(|g| (gpu(g), if g.degraded.is_some() { 1.0 } else { 0.0 }))
            .collect(),
    );
    let job = |j: &crate::control::JobView| {
        format!(",job=\"{}\",tier=\"{}\"", escape(&j.job), escape(&j.tier))
    };
    family(
        "powerflex_job_pfi",
        "gauge",
        "Power Flexibility Index of the job (measured, or the telemetry prior).",
        s.jobs
            .iter()
            .filter_map(|j| Some((job(j), j.pfi.or(j.prior_pfi)?)))
            .collect(),
    );
    family(
        "powerflex_job_cap_watts",
        "gauge",
        "Per-GPU cap of the job, W.",
        s.jobs
            .iter()
            .filter_map(|j| Some((job(j), j.cap_w?)))
            .collect(),
    );
    family(
        "powerflex_job_throughput",
        "gauge",
        "Recent job throughput, in the job's unit per second.",
        s.jobs
            .iter()
            .filter_map(|j| Some((job(j), j.throughput?)))
            .collect(),
    );
    family(
        "powerflex_job_calibration_state",
        "gauge",
        "1 for the job's calibration state (warmup, walking, done, skipped).",
        s.jobs
            .iter()
            .map(|j| {
                (
                    format!("{},state=\"{}\"", job(j), j.calibration.name()),
                    1.0,
                )
            })
            .collect(),
    );
    family(
        "powerflex_agent_failsafe",
        "gauge",
        "1 when the controller's lease ran out and the fail-safe cap applies.",
        vec![(String::new(), if s.failsafe { 1.0 } else { 0.0 })],
    );
    family(
        "powerflex_progress_rejected_total",
        "counter",
        "Progress reports refused (wrong user, wrong job, malformed).",
        vec![(String::new(), s.progress_rejected as f64)],
    );
    out
}

/// Serves `GET /metrics` (any path) from the published snapshot until `shutdown`.
pub fn spawn(
    listener: TcpListener,
    snapshot: SnapshotCell,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    listener.set_nonblocking(true)?;
    std::thread::Builder::new().name("metrics".into()).spawn(move || {
        while !shutdown.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
                    let _ = stream.set_write_timeout(Some(Duration::from_millis(500)));
                    let mut request = [0u8; 1024];
                    let _ = stream.read(&mut request);
                    let snap = snapshot.read().map(|s| Arc::clone(&s)).ok();
                    let body = snap.map(|s| render(&s)).unwrap_or_default();
                    let _ = write!(
                        stream,
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => {
                    warn!(error = %e, "metrics accept failed");
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    })
}
