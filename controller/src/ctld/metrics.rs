//! The controller's Prometheus metrics: rendered by the core after each allocation,
//! served as plain text over loopback HTTP.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use powerflex_core::Watts;

use crate::site::Decision;

/// What the metrics show of one allocation.
#[derive(Debug)]
pub struct MetricsInput<'a> {
    pub decision: &'a Decision,
    pub base: Watts,
    pub budget: Watts,
    pub draw_w: f64,
    /// Node → live.
    pub nodes: Vec<(&'a str, bool)>,
    pub event_active: bool,
}

/// Renders the metrics text (Prometheus exposition format 0.0.4).
pub fn render(m: &MetricsInput<'_>) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, rows: Vec<(String, f64)>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (labels, v) in rows {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    gauge(
        "powerflex_budget_watts",
        "Facility GPU budget in force, W.",
        vec![(String::new(), m.budget.0)],
    );
    gauge(
        "powerflex_base_budget_watts",
        "Facility GPU budget without grid events, W.",
        vec![(String::new(), m.base.0)],
    );
    gauge(
        "powerflex_draw_watts",
        "Summed GPU draw reported by live agents, W.",
        vec![(String::new(), m.draw_w)],
    );
    gauge(
        "powerflex_event_active",
        "1 while a grid event cuts the budget.",
        vec![(String::new(), if m.event_active { 1.0 } else { 0.0 })],
    );
    gauge(
        "powerflex_node_live",
        "1 when the node's agent reported within its lease.",
        m.nodes
            .iter()
            .map(|(n, live)| (format!("{{node=\"{n}\"}}"), if *live { 1.0 } else { 0.0 }))
            .collect(),
    );
    if let Some(a) = &m.decision.allocation {
        gauge(
            "powerflex_job_cap_watts",
            "Per-GPU cap granted to the job, W.",
            a.jobs
                .iter()
                .map(|j| (format!("{{job=\"{}\"}}", j.id), j.cap_w.0))
                .collect(),
        );
        gauge(
            "powerflex_floors_broken",
            "Jobs whose tier bound the budget cannot hold.",
            vec![(String::new(), a.broken_floors().count() as f64)],
        );
        gauge(
            "powerflex_over_budget_watts",
            "Shortfall with every job at its lowest cap, W.",
            vec![(String::new(), a.over_budget_w.0)],
        );
    }
    out
}

/// Serves the latest `text` on `/metrics` (and `/`) until `shutdown`.
pub fn serve(listener: TcpListener, text: Arc<Mutex<String>>, shutdown: Arc<AtomicBool>) {
    let _ = listener.set_nonblocking(true);
    std::thread::spawn(move || {
        while !shutdown.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
                    let mut request = [0u8; 1024];
                    let read = stream.read(&mut request).unwrap_or(0);
                    let line = String::from_utf8_lossy(&request[..read]);
                    let path = line.split_whitespace().nth(1).unwrap_or("");
                    // Scrapers ask for /metrics; "/" too, for a person with curl.
                    let (status, body) = if path == "/metrics" || path == "/" {
                        (
                            "200 OK",
                            text.lock().unwrap_or_else(PoisonError::into_inner).clone(),
                        )
                    } else {
                        ("404 Not Found", "try /metrics\n".to_string())
                    };
                    let _ = write!(
                        stream,
                        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    });
}
