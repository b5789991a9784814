//! Prometheus text exposition (format 0.0.4) and the catalog of every metric family
//! powerflex exports.
//!
//! A family's label names are part of its type ([`Family<N>`] takes exactly `N` label
//! values per sample), and every family is declared once in [`catalog`], so one metric
//! name cannot carry two label sets in two daemons, and a label value cannot break the
//! format: [`TextWriter`] escapes `\`, `"` and newlines.

use std::fmt::Write as _;

/// Prometheus metric type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        }
    }
}

/// One metric family: name, type, help text and its `N` label names, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family<const N: usize> {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    pub labels: [&'static str; N],
}

/// Every metric the daemons export. Per-node series (the agent's) carry `node`; per-job
/// series carry `job` (and `tier` where the exporter knows it); per-GPU series `gpu`
/// (NVML index) and `uuid`. The agent reports what it applied on its node, the
/// controller what it granted site-wide, under different names, because in fail-safe
/// or between leases the two differ.
pub mod catalog {
    use super::{Family, Kind};

    // --- powerflexd (node agent) ---
    pub const GPU_POWER_WATTS: Family<3> = Family {
        name: "powerflex_gpu_power_watts",
        kind: Kind::Gauge,
        help: "GPU power draw, W.",
        labels: ["node", "gpu", "uuid"],
    };
    pub const GPU_CAP_WATTS: Family<3> = Family {
        name: "powerflex_gpu_cap_watts",
        kind: Kind::Gauge,
        help: "GPU power limit set by powerflex, W.",
        labels: ["node", "gpu", "uuid"],
    };
    pub const GPU_DEFAULT_CAP_WATTS: Family<3> = Family {
        name: "powerflex_gpu_default_cap_watts",
        kind: Kind::Gauge,
        help: "GPU power limit restored when no job runs, W.",
        labels: ["node", "gpu", "uuid"],
    };
    pub const GPU_ENERGY_JOULES_TOTAL: Family<3> = Family {
        name: "powerflex_gpu_energy_joules_total",
        kind: Kind::Counter,
        help: "GPU energy since driver load, J.",
        labels: ["node", "gpu", "uuid"],
    };
    pub const GPU_DEGRADED: Family<3> = Family {
        name: "powerflex_gpu_degraded",
        kind: Kind::Gauge,
        help: "1 when the GPU is out of service.",
        labels: ["node", "gpu", "uuid"],
    };
    pub const GPU_OWNED_ELSEWHERE: Family<3> = Family {
        name: "powerflex_gpu_owned_elsewhere",
        kind: Kind::Gauge,
        help: "1 when another power manager keeps the GPU's limit below powerflex's: powerflex does not write it, and the controller counts it at that limit.",
        labels: ["node", "gpu", "uuid"],
    };
    pub const JOB_PFI: Family<3> = Family {
        name: "powerflex_job_pfi",
        kind: Kind::Gauge,
        help: "Power Flexibility Index of the job (measured, or the telemetry prior).",
        labels: ["node", "job", "tier"],
    };
    pub const JOB_CAP_WATTS: Family<3> = Family {
        name: "powerflex_job_cap_watts",
        kind: Kind::Gauge,
        help: "Per-GPU cap applied to the job's GPUs on this node, W.",
        labels: ["node", "job", "tier"],
    };
    pub const JOB_THROUGHPUT: Family<3> = Family {
        name: "powerflex_job_throughput",
        kind: Kind::Gauge,
        help: "Recent job throughput, in the job's unit per second.",
        labels: ["node", "job", "tier"],
    };
    pub const JOB_CALIBRATION_STATE: Family<4> = Family {
        name: "powerflex_job_calibration_state",
        kind: Kind::Gauge,
        help: "1 for the job's calibration state (warmup, walking, done, skipped).",
        labels: ["node", "job", "tier", "state"],
    };
    pub const AGENT_FAILSAFE: Family<1> = Family {
        name: "powerflex_agent_failsafe",
        kind: Kind::Gauge,
        help: "1 when the controller's lease ran out and the fail-safe cap applies.",
        labels: ["node"],
    };
    pub const PROGRESS_REJECTED_TOTAL: Family<1> = Family {
        name: "powerflex_progress_rejected_total",
        kind: Kind::Counter,
        help: "Progress reports refused (wrong user, wrong job, malformed).",
        labels: ["node"],
    };
    pub const AGENT_CONNECTIONS_REFUSED_TOTAL: Family<3> = Family {
        name: "powerflex_agent_connections_refused_total",
        kind: Kind::Counter,
        help: "Connections to the agent's sockets refused (socket control|progress; reason full|per_uid).",
        labels: ["node", "socket", "reason"],
    };
    pub const GPU_FOREIGN_USE_TOTAL: Family<1> = Family {
        name: "powerflex_gpu_foreign_use_total",
        kind: Kind::Counter,
        help:
            "Times processes of another job began to use a GPU a job holds (NVML's process lists); the GPU stays the holder's, capped as the job is.",
        labels: ["node"],
    };
    pub const PROGRESS_REPORTS_SKIPPED_TOTAL: Family<1> = Family {
        name: "powerflex_progress_reports_skipped_total",
        kind: Kind::Counter,
        help: "Progress reports never handed to the control loop: held back while it held 16 of their connection's reports, then superseded by a newer one (progress is cumulative).",
        labels: ["node"],
    };
    pub const AGENT_CONNECTIONS_TIMED_OUT_TOTAL: Family<2> = Family {
        name: "powerflex_agent_connections_timed_out_total",
        kind: Kind::Counter,
        help:
            "Connections to the agent's sockets closed for sending nothing within the idle limit.",
        labels: ["node", "socket"],
    };

    // --- powerflex-ctld (controller) ---
    pub const BUDGET_WATTS: Family<0> = Family {
        name: "powerflex_budget_watts",
        kind: Kind::Gauge,
        help: "Facility GPU budget in force, W.",
        labels: [],
    };
    pub const ALLOCATED_BUDGET_WATTS: Family<0> = Family {
        name: "powerflex_allocated_budget_watts",
        kind: Kind::Gauge,
        help: "Budget the last allocation was made for: the lowest step until its caps may be replaced, and a rise held to max_ramp_w_per_s, W.",
        labels: [],
    };
    pub const JOB_PREEMPTED: Family<2> = Family {
        name: "powerflex_job_preempted",
        kind: Kind::Gauge,
        help: "1 while the controller holds the job suspended or requeued because caps at every floor could not meet the budget.",
        labels: ["job", "how"],
    };
    pub const BASE_BUDGET_WATTS: Family<0> = Family {
        name: "powerflex_base_budget_watts",
        kind: Kind::Gauge,
        help: "Facility GPU budget without grid events, W.",
        labels: [],
    };
    pub const DRAW_WATTS: Family<0> = Family {
        name: "powerflex_draw_watts",
        kind: Kind::Gauge,
        help: "Summed GPU draw reported by live agents, W.",
        labels: [],
    };
    pub const EVENT_ACTIVE: Family<0> = Family {
        name: "powerflex_event_active",
        kind: Kind::Gauge,
        help: "1 while a grid event cuts the budget.",
        labels: [],
    };
    pub const DOMAIN_BUDGET_WATTS: Family<1> = Family {
        name: "powerflex_domain_budget_watts",
        kind: Kind::Gauge,
        help: "A power domain's budget in force: its limit (or an admin's budget for it) less its events' cut, W. One series per domain of the site config's [[domains]] (at most 10,000).",
        labels: ["domain"],
    };
    pub const DOMAIN_DRAW_WATTS: Family<1> = Family {
        name: "powerflex_domain_draw_watts",
        kind: Kind::Gauge,
        help: "Summed GPU draw the live nodes behind a power domain reported, W.",
        labels: ["domain"],
    };
    pub const DOMAIN_HEADROOM_WATTS: Family<1> = Family {
        name: "powerflex_domain_headroom_watts",
        kind: Kind::Gauge,
        help: "A power domain's budget in force less its draw, W (negative: over).",
        labels: ["domain"],
    };
    pub const DOMAIN_BINDS: Family<1> = Family {
        name: "powerflex_domain_binds",
        kind: Kind::Gauge,
        help: "1 when the last allocation found a power domain's jobs' floors above its limit (its jobs give way, and only they may be held out).",
        labels: ["domain"],
    };
    pub const NODE_LIVE: Family<1> = Family {
        name: "powerflex_node_live",
        kind: Kind::Gauge,
        help: "1 when the node's agent reported within its lease.",
        labels: ["node"],
    };
    pub const UNMANAGED_NODES: Family<0> = Family {
        name: "powerflex_unmanaged_nodes",
        kind: Kind::Gauge,
        help: "GPU nodes Slurm lists or a power domain places whose agents this controller has never heard from (UNMANAGED): each is reserved at its worst case.",
        labels: [],
    };
    pub const UNMANAGED_RESERVE_WATTS: Family<0> = Family {
        name: "powerflex_unmanaged_reserve_watts",
        kind: Kind::Gauge,
        help: "What the last allocation reserved for the UNMANAGED nodes (their GPUs times the site's largest GPU model's max_cap_w), W: the budget left to the managed jobs is short by this much.",
        labels: [],
    };
    pub const NODE_REPORTS_REFUSED: Family<1> = Family {
        name: "powerflex_node_reports_refused_total",
        kind: Kind::Counter,
        help: "Job reports from this node refused because Slurm does not place the job on it, since the controller started.",
        labels: ["node"],
    };
    /// The controller's grant; the agent's applied cap is [`JOB_CAP_WATTS`]. (Before
    /// this catalog the controller exported the grant as `powerflex_job_cap_watts{job}`,
    /// the same name the agent used with `{node,job,tier}`.)
    pub const JOB_GRANTED_CAP_WATTS: Family<1> = Family {
        name: "powerflex_job_granted_cap_watts",
        kind: Kind::Gauge,
        help: "Per-GPU cap the controller grants the job on all its nodes, W.",
        labels: ["job"],
    };
    pub const JOB_DRIFTED: Family<1> = Family {
        name: "powerflex_job_drifted",
        kind: Kind::Gauge,
        help: "1 while the job's measured draw or throughput is outside its curve's band.",
        labels: ["job"],
    };
    pub const REPORTS_REJECTED: Family<0> = Family {
        name: "powerflex_reports_rejected",
        kind: Kind::Gauge,
        help: "Agent reports (jobs or whole nodes) left out of the last allocation because their values cannot be true.",
        labels: [],
    };
    pub const FLOORS_BROKEN: Family<0> = Family {
        name: "powerflex_floors_broken",
        kind: Kind::Gauge,
        help: "Jobs whose tier bound the budget cannot hold.",
        labels: [],
    };
    pub const OVER_BUDGET_WATTS: Family<0> = Family {
        name: "powerflex_over_budget_watts",
        kind: Kind::Gauge,
        help: "Shortfall with every job at its lowest cap, W.",
        labels: [],
    };
    /// What the site can shed now, as the lowest budget that holds every tier's bound:
    /// `by="caps"` with caps alone, `by="preemption"` with the jobs whose tier allows it
    /// held out too.
    pub const SHED_REACH_WATTS: Family<1> = Family {
        name: "powerflex_shed_reach_watts",
        kind: Kind::Gauge,
        help: "Lowest site budget that holds every job within its tier's bound, W: by caps alone, or with preemptable jobs held out too.",
        labels: ["by"],
    };

    /// Connections and messages the controller refused, by reason: on the agent link
    /// `version`, `mac`, `replay`, `stale`, `wrong_peer`, `malformed`, `oversize`,
    /// `unexpected`, `pending_cap` (a handshake slot taken back for a newer connection),
    /// `handshake_timeout`, `session_cap`; on the admin socket `admin_cap`,
    /// `admin_uid_cap`, `admin_timeout`; on the metrics server `metrics_bad_request`.
    pub const REFUSALS_TOTAL: Family<1> = Family {
        name: "powerflex_refusals_total",
        kind: Kind::Counter,
        help: "Connections and messages the controller refused, by reason.",
        labels: ["reason"],
    };
    pub const JOB_RECORDS: Family<1> = Family {
        name: "powerflex_job_records_total",
        kind: Kind::Counter,
        help: "Jobs' energy records written since the controller started, per tier.",
        labels: ["tier"],
    };
    pub const TIER_ENERGY_JOULES: Family<1> = Family {
        name: "powerflex_job_energy_joules_total",
        kind: Kind::Counter,
        help: "GPU energy of the jobs whose records were written since the controller started, per tier, J (from the GPUs' energy counters).",
        labels: ["tier"],
    };
    pub const TIER_ENERGY_SAVED_ESTIMATE_JOULES: Family<1> = Family {
        name: "powerflex_job_energy_saved_estimate_joules_total",
        kind: Kind::Counter,
        help: "ESTIMATED energy saved against running uncapped for the same work (from each job's measured curve), of the records written since the controller started, per tier, J.",
        labels: ["tier"],
    };
    pub const ACCOUNT_ENERGY_JOULES: Family<1> = Family {
        name: "powerflex_account_energy_joules_total",
        kind: Kind::Counter,
        help: "GPU energy of the jobs whose records were written since the controller started, per Slurm account (at most 64 values, the rest as \"other\"), J.",
        labels: ["account"],
    };
    pub const ACCOUNTING_DB_UP: Family<0> = Family {
        name: "powerflex_accounting_db_up",
        kind: Kind::Gauge,
        help: "1 while the controller reaches its accounting database ([controller.database]).",
        labels: [],
    };
    pub const ACCOUNTING_DB_PENDING: Family<0> = Family {
        name: "powerflex_accounting_db_pending_records",
        kind: Kind::Gauge,
        help: "Job energy records waiting to be written to the accounting database (they are in the log meanwhile).",
        labels: [],
    };

    /// Which daemon exports a family.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Exporter {
        Agent,
        Controller,
    }

    impl Exporter {
        /// The daemon's name.
        pub fn daemon(self) -> &'static str {
            match self {
                Exporter::Agent => "powerflexd",
                Exporter::Controller => "powerflex-ctld",
            }
        }
    }

    /// One family as the consistency tests and the metrics reference list it.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Listed {
        pub name: &'static str,
        pub kind: Kind,
        pub help: &'static str,
        pub labels: Vec<&'static str>,
        pub exporter: Exporter,
    }

    /// Every family, for the consistency tests and for `powerflexctl reference metrics`
    /// (docs/reference/metrics.md). A test counts the families declared in this file, so
    /// one left out of this list fails it.
    pub fn all() -> Vec<Listed> {
        use Exporter::{Agent, Controller};
        fn e<const N: usize>(f: Family<N>, exporter: Exporter) -> Listed {
            Listed {
                name: f.name,
                kind: f.kind,
                help: f.help,
                labels: f.labels.to_vec(),
                exporter,
            }
        }
        vec![
            e(GPU_POWER_WATTS, Agent),
            e(GPU_CAP_WATTS, Agent),
            e(GPU_DEFAULT_CAP_WATTS, Agent),
            e(GPU_ENERGY_JOULES_TOTAL, Agent),
            e(GPU_DEGRADED, Agent),
            e(GPU_OWNED_ELSEWHERE, Agent),
            e(JOB_PFI, Agent),
            e(JOB_CAP_WATTS, Agent),
            e(JOB_THROUGHPUT, Agent),
            e(JOB_CALIBRATION_STATE, Agent),
            e(AGENT_FAILSAFE, Agent),
            e(PROGRESS_REJECTED_TOTAL, Agent),
            e(AGENT_CONNECTIONS_REFUSED_TOTAL, Agent),
            e(AGENT_CONNECTIONS_TIMED_OUT_TOTAL, Agent),
            e(PROGRESS_REPORTS_SKIPPED_TOTAL, Agent),
            e(GPU_FOREIGN_USE_TOTAL, Agent),
            e(BUDGET_WATTS, Controller),
            e(ALLOCATED_BUDGET_WATTS, Controller),
            e(JOB_PREEMPTED, Controller),
            e(BASE_BUDGET_WATTS, Controller),
            e(DRAW_WATTS, Controller),
            e(EVENT_ACTIVE, Controller),
            e(DOMAIN_BUDGET_WATTS, Controller),
            e(DOMAIN_DRAW_WATTS, Controller),
            e(DOMAIN_HEADROOM_WATTS, Controller),
            e(DOMAIN_BINDS, Controller),
            e(NODE_LIVE, Controller),
            e(NODE_REPORTS_REFUSED, Controller),
            e(UNMANAGED_NODES, Controller),
            e(UNMANAGED_RESERVE_WATTS, Controller),
            e(JOB_GRANTED_CAP_WATTS, Controller),
            e(JOB_DRIFTED, Controller),
            e(REPORTS_REJECTED, Controller),
            e(FLOORS_BROKEN, Controller),
            e(OVER_BUDGET_WATTS, Controller),
            e(SHED_REACH_WATTS, Controller),
            e(REFUSALS_TOTAL, Controller),
            e(JOB_RECORDS, Controller),
            e(TIER_ENERGY_JOULES, Controller),
            e(TIER_ENERGY_SAVED_ESTIMATE_JOULES, Controller),
            e(ACCOUNT_ENERGY_JOULES, Controller),
            e(ACCOUNTING_DB_UP, Controller),
            e(ACCOUNTING_DB_PENDING, Controller),
        ]
    }
}

/// Escapes a label value: backslash, double quote and newline, as the text format
/// requires. Anything else (UTF-8 included) goes through unchanged.
pub fn escape_label_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Builds one exposition. Each family is written once, header then samples.
#[derive(Debug, Default)]
pub struct TextWriter {
    out: String,
}

impl TextWriter {
    pub fn new() -> TextWriter {
        TextWriter::default()
    }

    /// Writes `family`'s `# HELP`/`# TYPE` header and one sample per row; each row is
    /// the `N` label values (in the family's label order) and the value. A family with
    /// no rows still gets its header, so a scraper learns it exists.
    pub fn family<'v, const N: usize>(
        &mut self,
        family: &Family<N>,
        rows: impl IntoIterator<Item = ([&'v str; N], f64)>,
    ) -> &mut TextWriter {
        let name = family.name;
        let _ = writeln!(
            self.out,
            "# HELP {name} {}\n# TYPE {name} {}",
            family.help,
            family.kind.as_str()
        );
        for (values, value) in rows {
            self.out.push_str(name);
            if N > 0 {
                self.out.push('{');
                for (i, (label, v)) in family.labels.iter().zip(values).enumerate() {
                    if i > 0 {
                        self.out.push(',');
                    }
                    let _ = write!(self.out, "{label}=\"{}\"", escape_label_value(v));
                }
                self.out.push('}');
            }
            let _ = writeln!(self.out, " {}", format_value(value));
        }
        self
    }

    /// The exposition text.
    pub fn finish(self) -> String {
        self.out
    }
}

/// Values as the text format spells them (`+Inf`, `-Inf`, `NaN` included).
fn format_value(value: f64) -> String {
    if value.is_nan() {
        "NaN".into()
    } else if value == f64::INFINITY {
        "+Inf".into()
    } else if value == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        value.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label_value(r#"a\b"c"#), r#"a\\b\"c"#);
        assert_eq!(escape_label_value("line\nbreak"), "line\\nbreak");
        assert_eq!(escape_label_value("flex2 ünïcode"), "flex2 ünïcode");
        let mut w = TextWriter::new();
        w.family(
            &catalog::JOB_CAP_WATTS,
            [(["n1", "42", "x\"}\nevil 1"], 300.0)],
        );
        let text = w.finish();
        assert_eq!(
            text,
            "# HELP powerflex_job_cap_watts Per-GPU cap applied to the job's GPUs on this node, W.\n\
             # TYPE powerflex_job_cap_watts gauge\n\
             powerflex_job_cap_watts{node=\"n1\",job=\"42\",tier=\"x\\\"}\\nevil 1\"} 300\n"
        );
        // The hostile value stayed inside one sample line.
        assert_eq!(text.lines().count(), 3);
    }

    #[test]
    fn families_without_labels_and_special_values() {
        let mut w = TextWriter::new();
        w.family(&catalog::BUDGET_WATTS, [([], 3200.0)])
            .family(&catalog::DRAW_WATTS, [([], f64::NAN)])
            .family(&catalog::PROGRESS_REJECTED_TOTAL, []);
        let text = w.finish();
        assert!(text.contains("\npowerflex_budget_watts 3200\n"), "{text}");
        assert!(text.contains("\npowerflex_draw_watts NaN\n"), "{text}");
        assert!(text.contains("# TYPE powerflex_progress_rejected_total counter\n"));
        assert!(!text.contains("powerflex_progress_rejected_total{"));
    }

    #[test]
    fn each_name_has_one_label_set_and_names_follow_the_conventions() {
        let all = catalog::all();
        let mut names: Vec<_> = all.iter().map(|f| f.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len(), "a metric name is declared twice");
        // Every family this file declares is listed (the reference is made from the list).
        let declared = include_str!("prom.rs")
            .lines()
            .filter(|l| l.trim_start().starts_with("pub const ") && l.contains(": Family<"))
            .count();
        assert_eq!(
            declared,
            all.len(),
            "a family is declared but not in catalog::all()"
        );
        for catalog::Listed {
            name, kind, labels, ..
        } in &all
        {
            assert!(name.starts_with("powerflex_"), "{name}");
            // Counters, and only counters, end in `_total` (Prometheus naming).
            assert_eq!(name.ends_with("_total"), *kind == Kind::Counter, "{name}");
            let mut sorted = labels.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), labels.len(), "{name} repeats a label");
            // Per-node series lead with `node`, so the two daemons' series join on it.
            if labels.contains(&"node") {
                assert_eq!(labels[0], "node", "{name}");
            }
        }
    }
}
