//! The site config, `powerflex.toml`: parsed once by every powerflex component on a
//! node and validated into typed values before anything acts on it.
//!
//! Two steps, two kinds of error. [`RawSiteConfig`] mirrors the file with serde and
//! `deny_unknown_fields`, so a typo in a key is a [`ConfigError::Parse`] carrying toml's
//! message with line and column. [`RawSiteConfig::validate`] then checks ranges and
//! cross-field rules and returns a [`SiteConfig`] of typed values ([`Watts`], durations
//! in `_s` seconds, [`Policy`], [`TierTable`], socket addresses), or one validation
//! variant of [`ConfigError`] naming the key path and what is accepted.
//! [`SiteConfig::from_toml_str`] does both.
//!
//! Every key carries its unit in its name (`_w` watts, `_s` seconds, `_pct` percent).
//! This module only sees text: callers read the file (conventionally next to
//! `slurm.conf`, e.g. `/etc/slurm/powerflex.toml`) and hand the contents in.
//!
//! Sections: `[facility]` (budget and policy), `[tiers]` (what `--power-flex` accepts),
//! `[gpu_models.<NAME>]` (per-GPU cap ranges, calibration grid, fail-safe cap),
//! `[controller]`, `[agent]`, `[predictor]` and `[grid.openadr]` (the utility's OpenADR
//! server, for `powerflex-grid`). `slurm-conf/powerflex.toml` is a complete, commented
//! example.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::allocate::Policy;
use crate::flex::{FlexError, Preempt, Service, Tier, TierTable, UNMANAGED};
use crate::units::{SlowdownFraction, Watts};

/// Accepted range of `controller.lease_ttl_s`, in seconds.
pub const LEASE_TTL_RANGE_S: std::ops::RangeInclusive<u64> = 5..=3600;
/// Accepted range of `controller.allocation_period_s`, in seconds.
pub const ALLOCATION_PERIOD_RANGE_S: std::ops::RangeInclusive<u64> = 1..=600;
/// Accepted range of `agent.calibration_allowance_pct`, in percent.
pub const CALIBRATION_ALLOWANCE_RANGE_PCT: std::ops::RangeInclusive<f64> = 0.0..=50.0;
/// Longest accepted `[gpu_models.<NAME>]` name, in bytes.
pub const MAX_GPU_MODEL_NAME_BYTES: usize = 64;

const DEFAULT_LEASE_TTL_S: u64 = 60;
const DEFAULT_ALLOCATION_PERIOD_S: u64 = 10;
const DEFAULT_KEY_FILE: &str = "/etc/slurm/powerflex.key";
const DEFAULT_AGENT_SOCKET: &str = "/run/powerflex/%n.sock";
/// Default path of a node's own link key (see `powerflexctl link-key`).
pub const DEFAULT_AGENT_KEY_FILE: &str = "/etc/powerflex/node.key";
const DEFAULT_CALIBRATION_ALLOWANCE_PCT: f64 = 5.0;

// ---------------------------------------------------------------------------------------
// Raw: the file as written.
// ---------------------------------------------------------------------------------------

/// `powerflex.toml` as written, before validation. Unknown keys at any level are parse
/// errors.
///
/// `Serialize` writes the same file back (a `None` key is left out, so the loader's
/// default applies): tests and the demo build their site configs from these types, so a
/// renamed key breaks their build instead of their run. `Default` is an empty, invalid
/// config (budget 0, no models, no controller address) to fill in with struct update
/// syntax.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawSiteConfig {
    /// `[facility]`, required.
    pub facility: RawFacility,
    /// `[tiers]`, optional: without it the site offers the default tiers.
    #[serde(default)]
    pub tiers: RawTiers,
    /// `[gpu_models.<NAME>]`, at least one.
    #[serde(default)]
    pub gpu_models: BTreeMap<String, RawGpuModel>,
    /// `[controller]`, required.
    pub controller: RawController,
    /// `[agent]`, optional.
    #[serde(default)]
    pub agent: RawAgent,
    /// `[predictor]`, optional.
    #[serde(default)]
    pub predictor: RawPredictor,
    /// `[grid]`, optional: where grid events come from besides `powerflexctl event add`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grid: Option<RawGrid>,
    /// `[[domains]]`, optional: the facility's power domains below its budget (feeds,
    /// rows, PDUs, racks), each with its limit; every node in one leaf. Without them the
    /// site has one budget.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domains: Vec<crate::domains::RawDomain>,
}

/// `[facility]`: the site-wide budget and how it is shared.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawFacility {
    /// Facility GPU power budget, watts: the sum of all powerflex-managed GPUs' caps
    /// stays at or below it. Required, finite, above 0.
    pub gpu_budget_w: f64,
    /// Allocation policy: `optimal` (default), `equal` or `pfi-proportional`.
    pub policy: Option<String>,
    /// The deepest grid-event cut the site expects, percent of the uncapped draw
    /// (default 30, accepted above 0 and below 95): calibration walks each job as deep as
    /// such a cut can push it.
    pub expected_cut_pct: Option<f64>,
    /// What the budget bounds: `metered` (default; the GPUs' measured draw) or `hard`
    /// (the sum of caps × GPUs, trusting no curve: for breaker limits).
    pub budget_mode: Option<String>,
    /// `metered` mode: the share of the budget held back for measurement noise and the
    /// draw's rise between two allocations, percent (default 1, 0 to 20).
    pub metered_margin_pct: Option<f64>,
    /// What the allocation maximises: `relative-speed` (default; each job counts as its
    /// throughput over its own uncapped throughput, so what a job reports about its scale
    /// buys it nothing) or `tokens` (the site's total tokens/s, as the jobs report them).
    pub objective: Option<String>,
    /// The fastest the budget the controller allocates may rise, watts per second, when an
    /// event ends, a ramp-up steps or the budget is raised: it bounds the rebound when
    /// every capped job speeds up at once. Optional (default: no limit); above 0.
    pub max_ramp_w_per_s: Option<f64>,
}

/// `[tiers]`: what `--power-flex` accepts at this site.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawTiers {
    /// Service for jobs submitted without `--power-flex`: a tier name or `none`
    /// (default `none`: such jobs are not managed).
    pub default: Option<String>,
    /// Whether users may write `max-slowdown=N%` in place of a tier (default `true`).
    pub allow_max_slowdown: Option<bool>,
    /// `[tiers.preempt]`: per tier, what the controller may do to its jobs that do not
    /// say (`preempt=`) when caps at every floor cannot meet the budget: `never`
    /// (default), `suspend` or `requeue`. Not `suspend`/`requeue` for a tier allowing no
    /// slowdown (flex0).
    pub preempt: Option<BTreeMap<String, String>>,
    /// `[[tiers.tier]]` entries. Absent: the default tiers flex0/1/2/3 (0/10/25/50 %).
    /// Present but empty (`tier = []`): no named tiers, which needs
    /// `allow_max_slowdown = true`.
    pub tier: Option<Vec<RawTier>>,
    /// Who may run a job unmanaged with `--power-flex=none`: `anyone` (default) or
    /// `listed` (root and the users of `opt_out_users` only; `default` must then be a
    /// tier, or every job without the option would opt out).
    pub opt_out: Option<String>,
    /// With `opt_out = "listed"`: the user names that may opt out.
    pub opt_out_users: Option<Vec<String>>,
}

/// One `[[tiers.tier]]` entry.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawTier {
    /// Name users write: 1 to 32 of `a-z`, `0-9`, `-`, `_`; not `none`.
    pub name: String,
    /// Largest tolerated slowdown, percent of uncapped throughput, 0 to 100.
    pub max_slowdown_pct: f64,
}

/// `[gpu_models.<NAME>]`: the cap range and grids for one GPU model. All values are per
/// GPU, in watts.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawGpuModel {
    /// Lowest per-GPU cap powerflex may set, watts; at or above NVML's minimum
    /// power-management limit for the model.
    pub min_cap_w: f64,
    /// Highest per-GPU cap, watts: the uncapped reference point (normally the TDP, e.g.
    /// 700 for H200).
    pub max_cap_w: f64,
    /// Cap granularity, watts, above 0: allocated caps are multiples of this step above
    /// `min_cap_w`.
    pub cap_step_w: f64,
    /// Per-GPU caps the calibration design may visit, watts, strictly descending,
    /// starting at `max_cap_w` (the uncapped point) with at least one cap below it, all
    /// within `min_cap_w..=max_cap_w`. Optional: absent or empty, the design chooses
    /// among every `cap_step_w` from `max_cap_w` down to `min_cap_w`. When given, these
    /// caps win as the candidates; the design still decides which of them to visit, how
    /// many windows to read at each and when to stop. Where the step to the next
    /// candidate is more than the chord from `min_cap_w` can show within the job's bound
    /// plus the calibration allowance, the walk reads the lowest whole watt it can show
    /// instead (for example 315 W between 400 and 300 W).
    #[serde(default)]
    pub calibration_caps_w: Vec<f64>,
    /// Per-GPU cap the agent applies when its controller lease expires, watts, within
    /// `min_cap_w..=max_cap_w`. Choose it so that every GPU at this cap fits the facility
    /// budget.
    pub failsafe_cap_w: f64,
}

/// `[controller]`: the site controller.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawController {
    /// Socket address the controller listens on and agents connect to, e.g.
    /// `10.0.0.5:7300` or `[fd00::5]:7300`: an IP literal (no host names), not `0.0.0.0`
    /// or `[::]`.
    pub listen: String,
    /// Lifetime of a cap lease, seconds, 5 to 3600 (default 60), at least twice
    /// `allocation_period_s`.
    pub lease_ttl_s: Option<u64>,
    /// Seconds between allocations (and lease renewals), 1 to 600 (default 10).
    pub allocation_period_s: Option<u64>,
    /// Absolute path of the root-only site key, on the controller's host only: the
    /// controller derives each node's link key from it (default
    /// `/etc/slurm/powerflex.key`). Nodes hold their own key, `agent.key_file`.
    pub key_file: Option<String>,
    /// Absolute path of the controller's admin socket, where `powerflexctl` talks to it
    /// (default `/run/powerflex/ctld.sock`).
    pub admin_socket: Option<String>,
    /// Absolute directory for the controller's persisted state: budget, events
    /// (default `/var/lib/powerflex/ctld`).
    pub state_dir: Option<String>,
    /// Optional socket address for the controller's unauthenticated Prometheus metrics;
    /// must be loopback, e.g. `127.0.0.1:9465`. Absent: no metrics listener.
    pub metrics_listen: Option<String>,
    /// How a new allocation reaches the nodes: `two-step` (default; decreases first,
    /// increases once the nodes confirm the decreases, read back) or `at-once` (every
    /// node at once, as before: a node may raise before another has lowered).
    pub lease_rollout: Option<String>,
    /// Where the controller learns which jobs run on which node, and whose they are:
    /// `slurm` (default; `squeue --json` and `sinfo --json` every
    /// `slurm_poll_s`: a node is believed only about jobs Slurm places on it, each job's
    /// owner is Slurm's, and a node's GPUs are bounded by its gres) or `reports` (every
    /// node is believed about what it reports: only for a controller without Slurm, such
    /// as an evaluation on synthetic agents).
    pub job_placement: Option<String>,
    /// Seconds between reads of Slurm's placement, 1 to 300 (default 5). A report that
    /// names a job Slurm has not placed yet asks for an earlier read.
    pub slurm_poll_s: Option<u64>,
    /// Longest wait for `squeue`/`sinfo`, seconds, 1 to 60 (default 5): past it, the
    /// controller keeps the last placement it read and says so in `status`.
    pub slurm_timeout_s: Option<u64>,
    /// `[controller.database]`: a PostgreSQL database the controller also writes each
    /// ended job's energy record to (its own tables, migrated by the controller). Absent:
    /// the records live in the JSON-lines log under `state_dir` only.
    pub database: Option<RawDatabase>,
    /// Link addresses of the site's other controllers (`[controller.ha]`), e.g.
    /// `["10.0.0.6:7300"]`: an agent tries `listen` first, then these in turn, and
    /// follows whichever steers (a standby sends it on). At most 8, IP literals. Absent:
    /// one controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby_addresses: Option<Vec<String>>,
    /// `[controller.ha]`: two or more controllers, one active, with their leadership and
    /// state in PostgreSQL. Absent: one controller, its state in `state_dir`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ha: Option<RawHa>,
}

/// `[controller.ha]`: a standby controller. Each controller of the site runs with the
/// same database and its own `name`; the one holding leadership steers, the others
/// wait and take over when its leadership lapses.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawHa {
    /// This controller's name, unique among the site's controllers: 1 to 64 ASCII
    /// letters, digits, `.`, `_` or `-`, e.g. the host's name.
    pub name: String,
    /// The PostgreSQL URL of the database that holds leadership and state, without a
    /// password, e.g. `postgres://powerflex@db.example.org:5432/powerflex` (it may be
    /// the accounting database's).
    pub url: String,
    /// Absolute path of a root-only file holding the database user's password (its first
    /// line). Absent: none is sent.
    pub password_file: Option<String>,
    /// Longest wait to connect, and for one statement, seconds, at least 1 and at most
    /// a third of `leader_ttl_s` (default: 5, or a third of `leader_ttl_s` when less).
    pub timeout_s: Option<u64>,
    /// How long leadership lasts unless renewed, seconds (renewed every third of it; a
    /// standby polls as often). A standby takes over at most four thirds of it after
    /// the active controller stops, so it must be at most 3/8 of
    /// `controller.lease_ttl_s` (takeover within half a lease); at least 3. Default:
    /// 3/10 of `controller.lease_ttl_s` (18 for the default 60).
    pub leader_ttl_s: Option<u64>,
}

/// `[controller.database]`: where the controller's PostgreSQL database is.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawDatabase {
    /// A PostgreSQL URL without a password, e.g.
    /// `postgres://powerflex@db.example.org:5432/powerflex`.
    pub url: String,
    /// Absolute path of a root-only file holding the database user's password (its first
    /// line). Absent: none is sent (trust, peer or certificate authentication).
    pub password_file: Option<String>,
    /// Longest wait to connect, and for one statement, seconds, 1 to 60 (default 5).
    pub timeout_s: Option<u64>,
}

/// `[agent]`: the node agent `powerflexd`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawAgent {
    /// Absolute path of the agent's Unix socket; `%n` is the Slurm node name, `%%` a
    /// literal `%` (default `/run/powerflex/%n.sock`).
    pub socket: Option<String>,
    /// Optional socket address for unauthenticated metrics; must be loopback, e.g.
    /// `127.0.0.1:9464`. Absent: no metrics listener.
    pub metrics_listen: Option<String>,
    /// Optional NVML library to load (path or soname). Absent: the system
    /// `libnvidia-ml.so.1`.
    pub nvml_library: Option<String>,
    /// Extra slowdown tolerated during calibration beyond the tier bound, percent of
    /// uncapped throughput, 0 to 50 (default 5).
    pub calibration_allowance_pct: Option<f64>,
    /// Node GPU power budget for standalone mode (no controller), watts, above 0.
    /// Absent: the node's budget comes from the controller.
    pub node_budget_w: Option<f64>,
    /// Directory for the agent's persisted state (saved default caps, live jobs and
    /// their curves); `%n` is the node name (default `/var/lib/powerflex/%n`).
    pub state_dir: Option<String>,
    /// Absolute path of this node's own link key (root-owned, mode 0600), made with
    /// `powerflexctl link-key --node <name>` on the controller's host; `%n` is the node
    /// name (default `/etc/powerflex/node.key`). Keep it on local disk: each node must
    /// hold only its own key.
    pub key_file: Option<String>,
    /// Calibration: least time a job reports progress before its walk starts, seconds
    /// (0.5 to 3600, default 60).
    pub calibration_warmup_s: Option<f64>,
    /// Calibration: time a job gets to feel each new cap before it is measured, seconds
    /// (0.5 to 600, default 10).
    pub calibration_settle_s: Option<f64>,
    /// Calibration: measurement time at each cap, seconds (1 to 3600, default 30).
    pub calibration_hold_s: Option<f64>,
    /// Calibration: most token cost of a job's walk (and of its probes over its life),
    /// percent of the job's first-hour tokens, above 0 and at most 50 (default 2).
    pub calibration_budget_pct: Option<f64>,
    /// A job whose step daemons (root-owned `slurmstepd`) have all been gone from the
    /// node this long is ended without its epilog, seconds (5 to 3600, default 30).
    pub job_end_grace_s: Option<f64>,
    /// Least time from the end of a job's walk to walking it again when its measurements
    /// leave its curve (a new phase), seconds (10 to 86400, default 120): each walk costs
    /// the job tokens (at most its tier's bound plus the calibration allowance while it
    /// lasts). The job's old curve is set aside at once and, until it is walked again, it
    /// is planned on the chord from its GPUs' static draw, which holds its bound whatever
    /// its new curve but costs the other jobs watts: the walk starts when this time has
    /// passed, however often the job changes.
    pub calibration_rewalk_after_s: Option<f64>,
    /// Write power limits (default true). False is observe mode, for a site's first
    /// week: every job is measured, accounted and reported, the controller computes the
    /// leases it would send, and no limit is ever written. One reload switches it.
    pub enforce: Option<bool>,
    /// Append each job's final share on this node to `<state_dir>/usage.jsonl` (default
    /// true).
    pub usage_log: Option<bool>,
    /// A GPU that NVML shows processes on while no registered job holds it (a job whose
    /// registration failed, a process started outside Slurm; a `none` job is registered
    /// as unmanaged and keeps its GPUs at their default): `"failsafe"` caps it at its
    /// model's fail-safe until those processes are gone, `"default"` leaves it at its
    /// default limit (default here, for configs written before the plugin registered
    /// `none` jobs; the shipped config sets `"failsafe"`).
    pub unregistered_gpu_use: Option<String>,
}

/// `[predictor]`: the telemetry prior PFI ≈ intercept + slope · DRAM copy product
/// (arXiv 2609.11542; LOO R² 0.52, RMSE 0.24, weak within a job type).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawPredictor {
    /// PFI at a DRAM copy product of 0, dimensionless (default 1.2).
    pub pfi_intercept: Option<f64>,
    /// PFI gained per unit of DRAM copy product (DRAM activity × memory copy
    /// utilisation, both fractions 0 to 1), dimensionless (default 1.5).
    pub pfi_per_dram_copy_product: Option<f64>,
}

// ---------------------------------------------------------------------------------------
// Validated: typed values.
// ---------------------------------------------------------------------------------------

/// The site config file's JSON Schema, with every key's doc comment as its description
/// (feature `reference`): what `powerflexctl reference config` renders as the config
/// reference and `powerflex.toml(5)`.
#[cfg(feature = "reference")]
pub fn file_schema() -> serde_json::Value {
    schemars::schema_for!(RawSiteConfig).to_value()
}

/// A validated site config.
#[derive(Debug, Clone, PartialEq)]
pub struct SiteConfig {
    pub facility: FacilityConfig,
    pub tiers: TiersConfig,
    /// Sorted by name; at least one.
    pub gpu_models: Vec<GpuModelConfig>,
    pub controller: ControllerConfig,
    pub agent: AgentConfig,
    pub predictor: PredictorConfig,
    pub grid: GridConfig,
    /// The power domains (empty without `[[domains]]`).
    pub domains: crate::domains::DomainTree,
}

/// Validated `[facility]`.
#[derive(Debug, Clone, PartialEq)]
pub struct FacilityConfig {
    /// Facility GPU power budget, above 0.
    pub gpu_budget_w: Watts,
    pub policy: Policy,
    /// The deepest cut the site expects, a fraction (0.3 = 30 %).
    pub expected_cut: f64,
    pub budget_mode: BudgetMode,
    pub objective: Objective,
    /// The fastest the allocated budget may rise, W/s (`None`: no limit).
    pub max_ramp_w_per_s: Option<f64>,
}

/// What the allocation maximises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Objective {
    /// The sum of each job's throughput over its own uncapped throughput: a job's
    /// self-reported scale buys it nothing.
    #[default]
    RelativeSpeed,
    /// The site's total tokens/s, as the jobs report them (trusts the jobs' counts; falls
    /// back to relative speed while any managed job reports only steps).
    Tokens,
}

impl Objective {
    /// The names `facility.objective` accepts.
    pub const NAMES: [&'static str; 2] = ["relative-speed", "tokens"];

    pub fn name(&self) -> &'static str {
        match self {
            Objective::RelativeSpeed => "relative-speed",
            Objective::Tokens => "tokens",
        }
    }
}

/// What the facility budget bounds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "kebab-case")]
pub enum BudgetMode {
    /// The sum of every GPU's cap (idle and unmanaged GPUs at their default limit) stays
    /// within the budget, by construction: no curve or measurement is trusted.
    Hard,
    /// The GPUs' measured draw stays within the budget less `margin` (a fraction): each
    /// job's curve is corrected by the power it draws at the cap in force, so the
    /// headroom of jobs drawing below their caps goes to jobs that can use it.
    Metered { margin: f64 },
}

impl BudgetMode {
    /// The names `facility.budget_mode` accepts.
    pub const NAMES: [&'static str; 2] = ["metered", "hard"];
    /// Default `metered_margin_pct`.
    pub const DEFAULT_MARGIN_PCT: f64 = 1.0;

    pub fn name(&self) -> &'static str {
        match self {
            BudgetMode::Hard => "hard",
            BudgetMode::Metered { .. } => "metered",
        }
    }
}

impl Default for BudgetMode {
    fn default() -> BudgetMode {
        BudgetMode::Metered {
            margin: BudgetMode::DEFAULT_MARGIN_PCT / 100.0,
        }
    }
}

/// Validated `[tiers]`.
#[derive(Debug, Clone, PartialEq)]
pub struct TiersConfig {
    /// Tiers offered, and whether `max-slowdown=N%` is allowed.
    pub table: TierTable,
    /// Service for jobs submitted without `--power-flex`.
    pub default: Service,
    /// Who may ask for `--power-flex=none`.
    pub opt_out: OptOut,
}

/// Who may run a job unmanaged (`--power-flex=none`): `tiers.opt_out`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum OptOut {
    /// Anyone (the default).
    #[default]
    Anyone,
    /// Root and these users only.
    Listed(std::collections::BTreeSet<String>),
}

impl OptOut {
    /// Whether the job of `uid` (named `user`, when the name is known) may opt out.
    pub fn allows(&self, uid: u32, user: Option<&str>) -> bool {
        uid == 0
            || match self {
                OptOut::Anyone => true,
                OptOut::Listed(users) => user.is_some_and(|u| users.contains(u)),
            }
    }
}

/// Validated `[gpu_models.<NAME>]`. All caps are per GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuModelConfig {
    /// Matched by the agent as a case-insensitive substring of the NVML device name:
    /// `H200` matches `NVIDIA H200`. See [`SiteConfig::gpu_model_for`].
    pub name: String,
    pub min_cap_w: Watts,
    pub max_cap_w: Watts,
    pub cap_step_w: Watts,
    /// Strictly descending, starting at `max_cap_w`, at least two entries; or empty:
    /// the design chooses among every cap step (see [`GpuModelConfig::calibration_grid`]).
    pub calibration_caps_w: Vec<Watts>,
    pub failsafe_cap_w: Watts,
}

impl GpuModelConfig {
    /// The caps the calibration design chooses among, highest (uncapped) first:
    /// `calibration_caps_w` when the site lists them, else `max_cap_w` and every
    /// `cap_step_w` below it down to `min_cap_w`.
    pub fn calibration_grid(&self) -> Vec<Watts> {
        if !self.calibration_caps_w.is_empty() {
            return self.calibration_caps_w.clone();
        }
        let mut caps = vec![self.max_cap_w];
        let mut cap = self.max_cap_w.0 - self.cap_step_w.0;
        while cap >= self.min_cap_w.0 - 1e-9 && self.cap_step_w.0 > 0.0 {
            caps.push(Watts(cap));
            cap -= self.cap_step_w.0;
        }
        caps
    }
}

/// Validated `[controller]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ControllerConfig {
    pub listen: SocketAddr,
    /// 5 to 3600, at least twice `allocation_period_s`.
    pub lease_ttl_s: u64,
    /// 1 to 600.
    pub allocation_period_s: u64,
    /// Absolute.
    pub key_file: PathBuf,
    /// Absolute.
    pub admin_socket: PathBuf,
    /// Absolute.
    pub state_dir: PathBuf,
    /// Loopback only.
    pub metrics_listen: Option<SocketAddr>,
    pub lease_rollout: LeaseRollout,
    pub job_placement: JobPlacement,
    /// 1 to 300.
    pub slurm_poll_s: u64,
    /// 1 to 60.
    pub slurm_timeout_s: u64,
    /// The accounting database, if the site has one.
    pub database: Option<DatabaseConfig>,
    /// The other controllers' link addresses, for agents: at most 8, none is `listen`.
    pub standby_addresses: Vec<SocketAddr>,
    /// `[controller.ha]`, when the site runs more than one controller.
    pub ha: Option<HaConfig>,
}

/// `[controller.ha]`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HaConfig {
    /// 1 to 64 of `[A-Za-z0-9._-]`.
    pub name: String,
    /// The leadership and state database (its URL checked as
    /// `controller.database.url`'s; `timeout_s` at most a third of `leader_ttl_s`).
    pub database: DatabaseConfig,
    /// 3 or more, at most 3/8 of `controller.lease_ttl_s`.
    pub leader_ttl_s: u64,
}

impl HaConfig {
    /// How long leadership lasts unless renewed.
    pub fn leader_ttl(&self) -> Duration {
        Duration::from_secs(self.leader_ttl_s)
    }
}

/// Most `controller.standby_addresses`.
pub const MAX_STANDBY_ADDRESSES: usize = 8;
/// Shortest `controller.ha.leader_ttl_s`: renewed every second at most.
pub const MIN_LEADER_TTL_S: u64 = 3;

fn validate_ha(raw: RawHa, lease_ttl_s: u64) -> Result<HaConfig, ConfigError> {
    let name = raw.name.trim().to_string();
    let name_ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !name_ok {
        return Err(ConfigError::OutOfRange {
            key: "controller.ha.name".into(),
            value: format!("\"{}\"", name.escape_default()),
            accepted: "1 to 64 ASCII letters, digits, '.', '_' or '-', unique per controller"
                .into(),
        });
    }
    // Takeover takes at most a leadership TTL (the row lapses) and a standby's poll
    // (a third of it) after the active controller stops: within half a lease, the
    // known agents are still awaited and no lease has run out.
    let most_s = lease_ttl_s * 3 / 8;
    let leader_ttl_s = raw
        .leader_ttl_s
        .unwrap_or((lease_ttl_s * 3 / 10).max(MIN_LEADER_TTL_S));
    if leader_ttl_s < MIN_LEADER_TTL_S || leader_ttl_s > most_s {
        return Err(ConfigError::OutOfRange {
            key: "controller.ha.leader_ttl_s".into(),
            value: leader_ttl_s.to_string(),
            accepted: if most_s < MIN_LEADER_TTL_S {
                format!(
                    "none with controller.lease_ttl_s = {lease_ttl_s}: a takeover within half \
                     a lease needs controller.lease_ttl_s of at least 8"
                )
            } else {
                format!(
                    "{MIN_LEADER_TTL_S} to {most_s} seconds (3/8 of controller.lease_ttl_s = \
                     {lease_ttl_s}: a standby takes over within 4/3 of it, half a lease)"
                )
            },
        });
    }
    let most_timeout_s = leader_ttl_s / 3;
    let timeout_s = raw.timeout_s.unwrap_or(5.min(most_timeout_s));
    if !(1..=most_timeout_s).contains(&timeout_s) {
        return Err(ConfigError::OutOfRange {
            key: "controller.ha.timeout_s".into(),
            value: timeout_s.to_string(),
            accepted: format!(
                "1 to {most_timeout_s} seconds (a third of controller.ha.leader_ttl_s: a \
                 renewal must end before the next is due)"
            ),
        });
    }
    let database = validate_database_at(
        RawDatabase {
            url: raw.url,
            password_file: raw.password_file,
            timeout_s: Some(1),
        },
        "controller.ha",
    )?;
    Ok(HaConfig {
        name,
        database: DatabaseConfig {
            timeout_s,
            ..database
        },
        leader_ttl_s,
    })
}

fn validate_standby_addresses(
    raw: Option<Vec<String>>,
    listen: SocketAddr,
) -> Result<Vec<SocketAddr>, ConfigError> {
    let raw = raw.unwrap_or_default();
    if raw.len() > MAX_STANDBY_ADDRESSES {
        return Err(ConfigError::OutOfRange {
            key: "controller.standby_addresses".into(),
            value: format!("{} addresses", raw.len()),
            accepted: format!("at most {MAX_STANDBY_ADDRESSES}"),
        });
    }
    let mut addresses: Vec<SocketAddr> = Vec::with_capacity(raw.len());
    for text in raw {
        let addr = socket_addr("controller.standby_addresses", &text)?;
        if addr.ip().is_unspecified() || addr == listen || addresses.contains(&addr) {
            return Err(ConfigError::OutOfRange {
                key: "controller.standby_addresses".into(),
                value: addr.to_string(),
                accepted: "the other controllers' own addresses, each once, none of them \
                           controller.listen nor 0.0.0.0/[::]"
                    .into(),
            });
        }
        addresses.push(addr);
    }
    Ok(addresses)
}

/// `[controller.database]`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseConfig {
    /// `postgres://` or `postgresql://`, without a password.
    pub url: String,
    /// Absolute.
    pub password_file: Option<PathBuf>,
    /// 1 to 60.
    pub timeout_s: u64,
}

/// Longest accepted `controller.database.url`, bytes.
pub const MAX_DATABASE_URL_BYTES: usize = 1024;

fn validate_database(raw: RawDatabase) -> Result<DatabaseConfig, ConfigError> {
    validate_database_at(raw, "controller.database")
}

/// A database section's keys (`section.url`, ...), checked and named under `section`.
/// An error never repeats the URL: a mistyped one may still hold a password.
fn validate_database_at(raw: RawDatabase, section: &str) -> Result<DatabaseConfig, ConfigError> {
    let url = raw.url.trim().to_string();
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"));
    let Some(rest) = rest.filter(|_| url.len() <= MAX_DATABASE_URL_BYTES) else {
        return Err(ConfigError::OutOfRange {
            key: format!("{section}.url"),
            value: if url.len() > MAX_DATABASE_URL_BYTES {
                format!(
                    "a URL of {} bytes (not shown: it may hold a password)",
                    url.len()
                )
            } else {
                "a URL that does not start postgres:// or postgresql:// (not shown: it may \
                 hold a password)"
                    .into()
            },
            accepted: format!(
                "a PostgreSQL URL of at most {MAX_DATABASE_URL_BYTES} bytes, \
                 postgres://USER@HOST:PORT/DATABASE"
            ),
        });
    };
    // A password in the URL would sit in a world-readable config: it goes in a file.
    if url_has_password(rest) {
        return Err(ConfigError::OutOfRange {
            key: format!("{section}.url"),
            value: "a URL with a password (not shown)".into(),
            accepted: format!(
                "a URL without one (postgres://USER@HOST:PORT/DATABASE, no password \
                 parameter); put the password in a root-only file named by \
                 {section}.password_file"
            ),
        });
    }
    if url.chars().any(|c| c.is_control() || c == ' ') {
        return Err(ConfigError::OutOfRange {
            key: format!("{section}.url"),
            value: "a URL with a space or control character (not shown: it may hold a \
                    password)"
                .into(),
            accepted: "a URL without spaces or control characters".into(),
        });
    }
    let password_file = match raw.password_file {
        None => None,
        Some(p) => Some(path(&format!("{section}.password_file"), &p, true)?),
    };
    let timeout_s = raw.timeout_s.unwrap_or(5);
    if !(1..=60).contains(&timeout_s) {
        return Err(ConfigError::OutOfRange {
            key: format!("{section}.timeout_s"),
            value: timeout_s.to_string(),
            accepted: "1 to 60 seconds".into(),
        });
    }
    Ok(DatabaseConfig {
        url,
        password_file,
        timeout_s,
    })
}

/// A name as one segment of a dotted key in an error: as it is when it is a bare TOML
/// key, else quoted with its control characters escaped (a key is never printed raw).
fn key_segment(name: &str) -> String {
    if !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
    {
        name.to_string()
    } else {
        format!("\"{}\"", name.escape_default())
    }
}

/// Whether a PostgreSQL URL (`rest`: what follows `postgres://`) carries a password as
/// the client library reads it (tokio-postgres 0.7): credentials are what comes before
/// the first `@`, a password what follows their first `:`; parameters follow the first
/// `?` after them, each key percent-decoded, so `pass%77ord=` is `password=`. (Core does
/// not depend on the client library; the controller checks the parsed URL again where it
/// connects.) Errs toward refusing: any decoded parameter text holding `password=` counts.
pub fn url_has_password(rest: &str) -> bool {
    let after_credentials = match rest.find('@') {
        Some(at) if rest[..at].contains(':') => return true,
        Some(at) => &rest[at + 1..],
        None => rest,
    };
    let Some(query) = after_credentials
        .find('?')
        .map(|q| &after_credentials[q + 1..])
    else {
        return false;
    };
    // The parser takes each key up to its `=` and decodes it: a decoded key of
    // `password` leaves `password=` in the decoded text (which also refuses a value that
    // merely mentions one, a price worth paying).
    percent_encoding::percent_decode_str(query)
        .decode_utf8_lossy()
        .contains("password=")
}

/// Where the controller learns which jobs run where (see `controller.job_placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JobPlacement {
    /// Slurm's own record: a node is believed only about the jobs Slurm places on it.
    #[default]
    Slurm,
    /// Every node's reports, as they come: a controller without Slurm only.
    Reports,
}

impl JobPlacement {
    pub const NAMES: [&'static str; 2] = ["slurm", "reports"];
}

/// How the controller sends a new allocation to the nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LeaseRollout {
    /// Decreases first; increases only after every node whose caps fell confirms it
    /// (caps read back through NVML), or after a timeout that counts the node at the
    /// most it may draw. No reallocation overshoots.
    #[default]
    TwoStep,
    /// Every node at once: during a reallocation one node may raise before another has
    /// lowered. Kept to measure what the two steps buy.
    AtOnce,
}

impl LeaseRollout {
    pub const NAMES: [&'static str; 2] = ["two-step", "at-once"];

    pub fn name(&self) -> &'static str {
        match self {
            LeaseRollout::TwoStep => "two-step",
            LeaseRollout::AtOnce => "at-once",
        }
    }
}

impl ControllerConfig {
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_s)
    }

    pub fn allocation_period(&self) -> Duration {
        Duration::from_secs(self.allocation_period_s)
    }
}

/// Validated `[agent]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    /// Socket path pattern: absolute, placeholders `%n` and `%%` only. Expand it with
    /// [`AgentConfig::socket_path`].
    pub socket: String,
    /// Loopback only.
    pub metrics_listen: Option<SocketAddr>,
    pub nvml_library: Option<PathBuf>,
    /// Extra slowdown tolerated during calibration beyond the tier bound, 0 to 0.5.
    pub calibration_allowance: SlowdownFraction,
    pub node_budget_w: Option<Watts>,
    /// State directory pattern: absolute, `%n` = node name.
    pub state_dir: String,
    /// This node's link key file pattern: absolute, `%n` = node name. Expand it with
    /// [`AgentConfig::key_file`].
    pub key_file: String,
    pub calibration_warmup_s: f64,
    pub calibration_settle_s: f64,
    pub calibration_hold_s: f64,
    /// Most token cost of a walk, fraction of the job's first-hour tokens.
    pub calibration_budget: f64,
    pub job_end_grace_s: f64,
    pub calibration_rewalk_after_s: f64,
    /// [`RawAgent::enforce`].
    pub enforce: bool,
    /// [`RawAgent::usage_log`].
    pub usage_log: bool,
    /// [`RawAgent::unregistered_gpu_use`].
    pub unregistered_gpu_use: UnregisteredGpuUse,
}

/// What the agent does with a GPU that processes use while no registered job holds it
/// (`agent.unregistered_gpu_use`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UnregisteredGpuUse {
    /// Capped at the model's fail-safe until those processes are gone: a job that could
    /// not register, or a process outside Slurm, draws no more than a job whose node lost
    /// its controller. A `--power-flex=none` job is not: the plugin registers it as
    /// unmanaged, so its GPUs are a job's, at their default.
    Failsafe,
    /// Left at its default limit (hard mode pays for it at its default).
    #[default]
    Default,
}

impl UnregisteredGpuUse {
    pub const NAMES: [&'static str; 2] = ["failsafe", "default"];
}

/// Default state directory of the agent.
pub const DEFAULT_AGENT_STATE_DIR: &str = "/var/lib/powerflex/%n";

/// Expands `%n` (node name) and `%%` in a path pattern.
pub fn expand_node(pattern: &str, node_name: &str) -> PathBuf {
    let mut path = String::with_capacity(pattern.len() + node_name.len());
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            path.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => path.push_str(node_name),
            Some(other) => path.push(other),
            None => path.push('%'),
        }
    }
    PathBuf::from(path)
}

impl AgentConfig {
    /// The state directory on node `node_name`.
    pub fn state_dir(&self, node_name: &str) -> PathBuf {
        expand_node(&self.state_dir, node_name)
    }

    /// The socket path on node `node_name`: `%n` replaced by the name, `%%` by `%`.
    pub fn socket_path(&self, node_name: &str) -> PathBuf {
        expand_node(&self.socket, node_name)
    }

    /// The link key file of node `node_name`.
    pub fn key_file(&self, node_name: &str) -> PathBuf {
        expand_node(&self.key_file, node_name)
    }
}

/// What `powerflexd --release-gpus` needs of the site config, read leniently: a node
/// being taken out of service must still put its GPUs back when the rest of the file no
/// longer validates (an edit gone wrong, a file from another version). Only
/// `agent.nvml_library` and `agent.socket` are read; every other key is ignored,
/// whatever it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseSettings {
    /// The NVML library to load (`None`: the system's).
    pub nvml_library: Option<String>,
    /// The agent's socket pattern (`%n` = node name).
    pub socket: String,
}

impl ReleaseSettings {
    /// From the file's text; an error only when it is not TOML at all, or when one of the
    /// two keys is there with the wrong type.
    pub fn from_toml_str(text: &str) -> Result<ReleaseSettings, ConfigError> {
        let table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                message: e.to_string(),
            })?;
        let agent = table.get("agent").and_then(toml::Value::as_table);
        let get = |key: &str| agent.and_then(|a| a.get(key));
        let string = |key: &str| -> Result<Option<String>, ConfigError> {
            match get(key) {
                None => Ok(None),
                Some(toml::Value::String(v)) => Ok(Some(v.clone())),
                Some(other) => Err(ConfigError::Parse {
                    message: format!("agent.{key} is a {}; accepted: a string", other.type_str()),
                }),
            }
        };
        Ok(ReleaseSettings {
            nvml_library: string("nvml_library")?,
            socket: string("socket")?.unwrap_or_else(|| DEFAULT_AGENT_SOCKET.to_string()),
        })
    }

    /// The agent's socket on node `node_name`.
    pub fn socket_path(&self, node_name: &str) -> PathBuf {
        expand_node(&self.socket, node_name)
    }
}

/// Validated `[predictor]`: a prior only, replaced by the job's measured curve once the
/// agent has calibrated it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PredictorConfig {
    pub pfi_intercept: f64,
    pub pfi_per_dram_copy_product: f64,
}

impl Default for PredictorConfig {
    /// Intercept 1.2, slope 1.5: spans roughly the PFI range the paper measured on H200
    /// (1.10 to 2.67) as the DRAM copy product goes from 0 to 1. A prior, not a fit to
    /// any site's jobs.
    fn default() -> PredictorConfig {
        PredictorConfig {
            pfi_intercept: 1.2,
            pfi_per_dram_copy_product: 1.5,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Errors.
// ---------------------------------------------------------------------------------------

/// Why `powerflex.toml` was rejected. `Parse` is toml's own message (with line and
/// column); every other variant is one validation rule, naming the key path and what
/// is accepted.
///
/// `model` fields hold the model name as it appears in a key path: `H200`, or quoted
/// (`"H100 NVL"`) when TOML needs quotes. Watt values are plain `f64` watts.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot parse the site config: {message}")]
    Parse { message: String },
    #[error("{key} must be a finite number, not {value}")]
    NotFinite { key: String, value: f64 },
    #[error("{key} = {value} is out of range; accepted: {accepted}")]
    OutOfRange {
        key: String,
        value: String,
        accepted: String,
    },
    #[error(
        "unknown facility.policy \"{}\"; accepted: {}",
        .value.escape_default(), Policy::NAMES.join(", ")
    )]
    UnknownPolicy { value: String },
    #[error("tiers.tier: {0}")]
    Tiers(FlexError),
    #[error("domains: {0}")]
    Domains(crate::domains::DomainError),
    #[error("tiers.default \"{}\" is not offered; accepted: {accepted}", .name.escape_default())]
    UnknownDefaultTier { name: String, accepted: String },
    #[error("tiers.opt_out = \"listed\" with tiers.default = \"none\" lets every job submitted without --power-flex opt out; set tiers.default to one of: {accepted}")]
    OptOutWithUnmanagedDefault { accepted: String },
    #[error(
        "no gpu models configured; add at least one [gpu_models.<NAME>] section, \
         e.g. [gpu_models.H200]"
    )]
    NoGpuModels,
    #[error(
        "invalid gpu model name \"{}\"; accepted: 1 to {MAX_GPU_MODEL_NAME_BYTES} printable \
         ascii characters without leading or trailing spaces, e.g. H200",
        .name.escape_default()
    )]
    InvalidGpuModelName { name: String },
    #[error(
        "gpu models \"{}\" and \"{}\" differ only in case; the agent matches names \
         case-insensitively, keep one",
        .first.escape_default(), .second.escape_default()
    )]
    DuplicateGpuModel { first: String, second: String },
    #[error("gpu_models.{model}: min_cap_w ({min_cap_w}) must be below max_cap_w ({max_cap_w})")]
    CapRangeInverted {
        model: String,
        min_cap_w: f64,
        max_cap_w: f64,
    },
    #[error(
        "gpu_models.{model}.calibration_caps_w has {count} caps; accepted: max_cap_w first, \
         then at least one lower cap, e.g. [700, 600, 500, 400]"
    )]
    CalibrationCapsTooFew { model: String, count: usize },
    #[error(
        "gpu_models.{model}.calibration_caps_w starts at {first} W; it must start at \
         max_cap_w ({max_cap_w} W), the uncapped reference point"
    )]
    CalibrationCapsMustStartAtMax {
        model: String,
        first: f64,
        max_cap_w: f64,
    },
    #[error(
        "gpu_models.{model}.calibration_caps_w: {cap} W is outside min_cap_w..max_cap_w \
         ({min_cap_w} to {max_cap_w} W)"
    )]
    CalibrationCapOutOfRange {
        model: String,
        cap: f64,
        min_cap_w: f64,
        max_cap_w: f64,
    },
    #[error(
        "gpu_models.{model}.calibration_caps_w: {cap} W follows {previous} W; caps must be \
         strictly descending"
    )]
    CalibrationCapsNotDescending {
        model: String,
        previous: f64,
        cap: f64,
    },
    #[error(
        "gpu_models.{model}: failsafe_cap_w ({failsafe_cap_w}) must be within min_cap_w..max_cap_w \
         ({min_cap_w} to {max_cap_w})"
    )]
    FailsafeCapOutOfRange {
        model: String,
        failsafe_cap_w: f64,
        min_cap_w: f64,
        max_cap_w: f64,
    },
    #[error(
        "{key} \"{}\" is not a socket address; accepted: ip:port, e.g. 10.0.0.5:7300 or \
         [fd00::5]:7300 (host names are not resolved)",
        .value.escape_default()
    )]
    BadSocketAddr { key: String, value: String },
    #[error(
        "controller.listen ({addr}) must name one address agents can connect to; use the \
         controller host's ip, e.g. 10.0.0.5:{}",
        .addr.port()
    )]
    UnspecifiedListen { addr: SocketAddr },
    #[error(
        "agent.metrics_listen ({addr}) must be a loopback address, e.g. 127.0.0.1:{} or \
         [::1]:{}: metrics are served without authentication",
        .addr.port(), .addr.port()
    )]
    MetricsNotLoopback { addr: SocketAddr },
    #[error(
        "controller.lease_ttl_s ({lease_ttl_s}) must be at least twice \
         controller.allocation_period_s ({allocation_period_s}) so one missed renewal does \
         not expire the leases"
    )]
    LeaseTooShort {
        lease_ttl_s: u64,
        allocation_period_s: u64,
    },
    #[error("{key} is empty; accepted: a path")]
    EmptyPath { key: String },
    #[error(
        "{key} \"{}\" contains control characters; accepted: a plain path",
        .value.escape_default()
    )]
    ControlCharacterInPath { key: String, value: String },
    #[error(
        "{key} \"{}\" is not an absolute path; accepted: a path starting with /",
        .value.escape_default()
    )]
    NotAbsolutePath { key: String, value: String },
    #[error(
        "agent.socket \"{}\" uses an unknown placeholder %{}; accepted: %n (slurm node name), \
         %% (a literal %)",
        .value.escape_default(), .placeholder.escape_default()
    )]
    BadSocketPlaceholder { value: String, placeholder: String },
}

// ---------------------------------------------------------------------------------------
// Parsing and validation.
// ---------------------------------------------------------------------------------------

impl SiteConfig {
    /// This config, once every program's domain in `grid.openadr.program_domains` is one
    /// of its `[[domains]]`.
    fn with_checked_program_domains(self) -> Result<SiteConfig, ConfigError> {
        if let Some(openadr) = &self.grid.openadr {
            for (program, domain) in &openadr.program_domains {
                if self.domains.find(domain).is_none() {
                    let declared: Vec<&str> = self
                        .domains
                        .domains()
                        .iter()
                        .map(|d| d.name.as_str())
                        .collect();
                    return Err(out_of_range(
                        &format!("grid.openadr.program_domains.{}", key_segment(program)),
                        format!("\"{}\"", domain.escape_default()),
                        &if declared.is_empty() {
                            "a domain of [[domains]] (the site declares none)".to_string()
                        } else {
                            format!("a domain of [[domains]] ({})", declared.join(", "))
                        },
                    ));
                }
            }
            // A safe-mode limit at or above what already binds cuts nothing: "safe mode
            // engaged" would be logged while nothing is held.
            for (program, safe) in &openadr.safe_mode {
                let (most, what) = match openadr.program_domains.get(program) {
                    Some(domain) => match self.domains.find(domain) {
                        Some(i) => (
                            self.domains.domains()[i].gpu_limit,
                            format!("domain {domain}'s gpu_limit_w"),
                        ),
                        None => continue,
                    },
                    None => (
                        self.facility.gpu_budget_w,
                        "facility.gpu_budget_w (the program is site-wide)".to_string(),
                    ),
                };
                if safe.gpu_limit.0 > most.0 {
                    return Err(out_of_range(
                        &format!(
                            "grid.openadr.safe_mode.{}.gpu_limit_kw",
                            key_segment(program)
                        ),
                        safe.gpu_limit.0 / 1000.0,
                        &format!(
                            "above 0, at most {} kW ({what}; a limit above it cuts nothing)",
                            most.0 / 1000.0
                        ),
                    ));
                }
            }
        }
        Ok(self)
    }

    /// Parses and validates the text of `powerflex.toml`.
    pub fn from_toml_str(text: &str) -> Result<SiteConfig, ConfigError> {
        RawSiteConfig::from_toml_str(text)?.validate()
    }

    /// The model config for an NVML device name: the configured names that occur in it,
    /// case-insensitively, longest first (so `H100 NVL` beats `H100` for
    /// `NVIDIA H100 NVL`). `None`: powerflex does not manage this GPU model.
    pub fn gpu_model_for(&self, nvml_device_name: &str) -> Option<&GpuModelConfig> {
        let device = nvml_device_name.to_ascii_lowercase();
        self.gpu_models
            .iter()
            .filter(|m| device.contains(&m.name.to_ascii_lowercase()))
            .max_by_key(|m| m.name.len())
    }
}

impl RawSiteConfig {
    /// Parses the text of `powerflex.toml` without validating values.
    pub fn from_toml_str(text: &str) -> Result<RawSiteConfig, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            message: e.to_string().trim_end().to_string(),
        })
    }

    /// Checks every value and cross-field rule; the first violation is returned.
    /// (`grid.openadr.program_domains` is checked against `[[domains]]` after both are
    /// read, in `SiteConfig::with_checked_program_domains`.)
    pub fn validate(self) -> Result<SiteConfig, ConfigError> {
        SiteConfig {
            facility: validate_facility(self.facility)?,
            tiers: validate_tiers(self.tiers)?,
            gpu_models: validate_gpu_models(self.gpu_models)?,
            controller: validate_controller(self.controller)?,
            agent: validate_agent(self.agent)?,
            predictor: validate_predictor(self.predictor)?,
            grid: validate_grid(self.grid)?,
            domains: crate::domains::DomainTree::build(&self.domains)
                .map_err(ConfigError::Domains)?,
        }
        .with_checked_program_domains()
    }
}

fn validate_facility(raw: RawFacility) -> Result<FacilityConfig, ConfigError> {
    let gpu_budget_w = positive_watts("facility.gpu_budget_w", raw.gpu_budget_w)?;
    let policy = match raw.policy {
        None => Policy::Optimal,
        Some(name) => Policy::from_name(&name).ok_or(ConfigError::UnknownPolicy { value: name })?,
    };
    let key = "facility.expected_cut_pct";
    let expected_pct = finite(
        key,
        raw.expected_cut_pct.unwrap_or(DEFAULT_EXPECTED_CUT_PCT),
    )?;
    if !(expected_pct > 0.0 && expected_pct < 95.0) {
        return Err(ConfigError::OutOfRange {
            key: key.into(),
            value: expected_pct.to_string(),
            accepted: "above 0 and below 95 percent".into(),
        });
    }
    let margin_pct = finite(
        "facility.metered_margin_pct",
        raw.metered_margin_pct
            .unwrap_or(BudgetMode::DEFAULT_MARGIN_PCT),
    )?;
    if !(0.0..=20.0).contains(&margin_pct) {
        return Err(ConfigError::OutOfRange {
            key: "facility.metered_margin_pct".into(),
            value: margin_pct.to_string(),
            accepted: "a percentage from 0 to 20".into(),
        });
    }
    let budget_mode = match raw.budget_mode.as_deref() {
        None | Some("metered") => BudgetMode::Metered {
            margin: margin_pct / 100.0,
        },
        Some("hard") if raw.metered_margin_pct.is_none() => BudgetMode::Hard,
        Some("hard") => {
            return Err(ConfigError::OutOfRange {
                key: "facility.metered_margin_pct".into(),
                value: margin_pct.to_string(),
                accepted:
                    "nothing with budget_mode = \"hard\" (the margin applies to metered mode)"
                        .into(),
            })
        }
        Some(other) => {
            return Err(ConfigError::OutOfRange {
                key: "facility.budget_mode".into(),
                value: format!("\"{}\"", other.escape_default()),
                accepted: BudgetMode::NAMES
                    .iter()
                    .map(|n| format!("\"{n}\""))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        }
    };
    let objective = match raw.objective.as_deref() {
        None | Some("relative-speed") => Objective::RelativeSpeed,
        Some("tokens") => Objective::Tokens,
        Some(other) => {
            return Err(ConfigError::OutOfRange {
                key: "facility.objective".into(),
                value: format!("\"{}\"", other.escape_default()),
                accepted: Objective::NAMES
                    .iter()
                    .map(|n| format!("\"{n}\""))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        }
    };
    let max_ramp_w_per_s = match raw.max_ramp_w_per_s {
        None => None,
        Some(rate) => {
            let rate = finite("facility.max_ramp_w_per_s", rate)?;
            if rate <= 0.0 {
                return Err(ConfigError::OutOfRange {
                    key: "facility.max_ramp_w_per_s".into(),
                    value: rate.to_string(),
                    accepted: "watts per second above 0 (leave it out for no limit)".into(),
                });
            }
            Some(rate)
        }
    };
    Ok(FacilityConfig {
        gpu_budget_w,
        policy,
        budget_mode,
        objective,
        max_ramp_w_per_s,
        expected_cut: expected_pct / 100.0,
    })
}

/// Default `facility.expected_cut_pct`: the deepest cut in the paper's and the field
/// demo's grid events (arXiv 2507.00909 shed 25 % for three hours).
pub const DEFAULT_EXPECTED_CUT_PCT: f64 = 30.0;

fn validate_tiers(raw: RawTiers) -> Result<TiersConfig, ConfigError> {
    let allow = raw.allow_max_slowdown.unwrap_or(true);
    let table = match raw.tier {
        None => TierTable::default_table().with_max_slowdown(allow),
        Some(tiers) => TierTable::new(
            tiers
                .into_iter()
                .map(|t| Tier::new(t.name, t.max_slowdown_pct))
                .collect(),
            allow,
        ),
    }
    .map_err(ConfigError::Tiers)?;
    let mut table = table;
    for (name, value) in raw.preempt.unwrap_or_default() {
        let key = format!("tiers.preempt.{}", name.escape_default());
        let Some(preempt) = Preempt::from_name(&value) else {
            return Err(ConfigError::OutOfRange {
                key,
                value: format!("\"{}\"", value.escape_default()),
                accepted: "\"never\", \"suspend\", \"requeue\"".into(),
            });
        };
        let Some(bound) = table.lookup(&name).map(|t| t.max_slowdown) else {
            return Err(ConfigError::OutOfRange {
                key,
                value: format!("\"{}\"", value.escape_default()),
                accepted: format!(
                    "only the site's tiers: {}",
                    table.names().collect::<Vec<_>>().join(", ")
                ),
            });
        };
        if bound.0 <= 0.0 && preempt != Preempt::Never {
            return Err(ConfigError::OutOfRange {
                key,
                value: format!("\"{value}\""),
                accepted: "\"never\" for a tier that allows no slowdown (its jobs are never suspended or requeued)".into(),
            });
        }
        table.set_preempt(&name, preempt);
    }
    let default = match raw.default.as_deref() {
        None | Some(UNMANAGED) => Service::Unmanaged,
        Some(name) => match table.lookup(name) {
            Some(tier) => Service::Bounded {
                tier: tier.name.clone(),
                max_slowdown: tier.max_slowdown,
            },
            None => {
                let mut accepted: Vec<&str> = table.names().collect();
                accepted.push(UNMANAGED);
                return Err(ConfigError::UnknownDefaultTier {
                    name: name.to_string(),
                    accepted: accepted.join(", "),
                });
            }
        },
    };
    let users = raw.opt_out_users.unwrap_or_default();
    for user in &users {
        let valid = !user.is_empty()
            && user.len() <= 64
            && user
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'$'));
        if !valid {
            return Err(ConfigError::OutOfRange {
                key: "tiers.opt_out_users".into(),
                value: format!("\"{}\"", user.escape_default()),
                accepted: "user names of 1 to 64 of A-Z a-z 0-9 . _ - $".into(),
            });
        }
    }
    let opt_out = match raw.opt_out.as_deref() {
        None | Some("anyone") => {
            if !users.is_empty() {
                return Err(ConfigError::OutOfRange {
                    key: "tiers.opt_out".into(),
                    value: "\"anyone\"".into(),
                    accepted: "\"listed\" when tiers.opt_out_users names users (or leave opt_out_users out)".into(),
                });
            }
            OptOut::Anyone
        }
        Some("listed") => {
            if default == Service::Unmanaged {
                return Err(ConfigError::OptOutWithUnmanagedDefault {
                    accepted: table.names().collect::<Vec<_>>().join(", "),
                });
            }
            OptOut::Listed(users.into_iter().collect())
        }
        Some(other) => {
            return Err(ConfigError::OutOfRange {
                key: "tiers.opt_out".into(),
                value: format!("\"{}\"", other.escape_default()),
                accepted: "\"anyone\", \"listed\"".into(),
            })
        }
    };
    Ok(TiersConfig {
        table,
        default,
        opt_out,
    })
}

fn validate_gpu_models(
    raw: BTreeMap<String, RawGpuModel>,
) -> Result<Vec<GpuModelConfig>, ConfigError> {
    if raw.is_empty() {
        return Err(ConfigError::NoGpuModels);
    }
    let mut models: Vec<GpuModelConfig> = Vec::with_capacity(raw.len());
    for (name, model) in raw {
        let valid_name = !name.is_empty()
            && name.len() <= MAX_GPU_MODEL_NAME_BYTES
            && name.bytes().all(|b| (0x20..=0x7e).contains(&b))
            && name.trim() == name;
        if !valid_name {
            return Err(ConfigError::InvalidGpuModelName { name });
        }
        if let Some(other) = models.iter().find(|m| m.name.eq_ignore_ascii_case(&name)) {
            return Err(ConfigError::DuplicateGpuModel {
                first: other.name.clone(),
                second: name,
            });
        }
        models.push(validate_gpu_model(name, model)?);
    }
    Ok(models)
}

fn validate_gpu_model(name: String, raw: RawGpuModel) -> Result<GpuModelConfig, ConfigError> {
    let model = model_key(&name);
    let key = |field: &str| format!("gpu_models.{model}.{field}");
    let min = positive_watts(&key("min_cap_w"), raw.min_cap_w)?;
    let max = positive_watts(&key("max_cap_w"), raw.max_cap_w)?;
    let step = positive_watts(&key("cap_step_w"), raw.cap_step_w)?;
    if min.0 >= max.0 {
        return Err(ConfigError::CapRangeInverted {
            model,
            min_cap_w: min.0,
            max_cap_w: max.0,
        });
    }
    if step.0 > max.0 - min.0 {
        return Err(ConfigError::OutOfRange {
            key: key("cap_step_w"),
            value: step.0.to_string(),
            accepted: format!(
                "above 0 and at most max_cap_w - min_cap_w ({} W)",
                max.0 - min.0
            ),
        });
    }

    let caps = &raw.calibration_caps_w;
    for (index, cap) in caps.iter().enumerate() {
        finite(&format!("{}[{index}]", key("calibration_caps_w")), *cap)?;
    }
    if caps.len() == 1 {
        return Err(ConfigError::CalibrationCapsTooFew {
            model,
            count: caps.len(),
        });
    }
    if !caps.is_empty() && caps.first() != Some(&max.0) {
        return Err(ConfigError::CalibrationCapsMustStartAtMax {
            model,
            first: caps.first().copied().unwrap_or(f64::NAN),
            max_cap_w: max.0,
        });
    }
    let mut previous: Option<f64> = None;
    for &cap in caps {
        if !(min.0..=max.0).contains(&cap) {
            return Err(ConfigError::CalibrationCapOutOfRange {
                model,
                cap,
                min_cap_w: min.0,
                max_cap_w: max.0,
            });
        }
        if let Some(previous) = previous.filter(|p| cap >= *p) {
            return Err(ConfigError::CalibrationCapsNotDescending {
                model,
                previous,
                cap,
            });
        }
        previous = Some(cap);
    }

    let failsafe = finite(&key("failsafe_cap_w"), raw.failsafe_cap_w)?;
    if !(min.0..=max.0).contains(&failsafe) {
        return Err(ConfigError::FailsafeCapOutOfRange {
            model,
            failsafe_cap_w: failsafe,
            min_cap_w: min.0,
            max_cap_w: max.0,
        });
    }

    Ok(GpuModelConfig {
        name,
        min_cap_w: min,
        max_cap_w: max,
        cap_step_w: step,
        calibration_caps_w: raw.calibration_caps_w.into_iter().map(Watts).collect(),
        failsafe_cap_w: Watts(failsafe),
    })
}

/// A model name as it appears in a TOML key path: bare if TOML allows it, else quoted.
fn model_key(name: &str) -> String {
    let bare = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if bare {
        name.to_string()
    } else {
        format!("\"{}\"", name.escape_default())
    }
}

fn validate_controller(raw: RawController) -> Result<ControllerConfig, ConfigError> {
    let listen = socket_addr("controller.listen", &raw.listen)?;
    if listen.ip().is_unspecified() {
        return Err(ConfigError::UnspecifiedListen { addr: listen });
    }
    let lease_ttl_s = raw.lease_ttl_s.unwrap_or(DEFAULT_LEASE_TTL_S);
    if !LEASE_TTL_RANGE_S.contains(&lease_ttl_s) {
        return Err(ConfigError::OutOfRange {
            key: "controller.lease_ttl_s".into(),
            value: lease_ttl_s.to_string(),
            accepted: "5 to 3600 seconds".into(),
        });
    }
    let allocation_period_s = raw
        .allocation_period_s
        .unwrap_or(DEFAULT_ALLOCATION_PERIOD_S);
    if !ALLOCATION_PERIOD_RANGE_S.contains(&allocation_period_s) {
        return Err(ConfigError::OutOfRange {
            key: "controller.allocation_period_s".into(),
            value: allocation_period_s.to_string(),
            accepted: "1 to 600 seconds".into(),
        });
    }
    if lease_ttl_s < allocation_period_s.saturating_mul(2) {
        return Err(ConfigError::LeaseTooShort {
            lease_ttl_s,
            allocation_period_s,
        });
    }
    let key_file = path(
        "controller.key_file",
        raw.key_file.as_deref().unwrap_or(DEFAULT_KEY_FILE),
        true,
    )?;
    let admin_socket = path(
        "controller.admin_socket",
        raw.admin_socket
            .as_deref()
            .unwrap_or("/run/powerflex/ctld.sock"),
        true,
    )?;
    let state_dir = path(
        "controller.state_dir",
        raw.state_dir
            .as_deref()
            .unwrap_or("/var/lib/powerflex/ctld"),
        true,
    )?;
    let metrics_listen = match raw.metrics_listen {
        None => None,
        Some(text) => {
            let addr = socket_addr("controller.metrics_listen", &text)?;
            if !addr.ip().is_loopback() {
                return Err(ConfigError::MetricsNotLoopback { addr });
            }
            Some(addr)
        }
    };
    let lease_rollout = match raw.lease_rollout.as_deref() {
        None | Some("two-step") => LeaseRollout::TwoStep,
        Some("at-once") => LeaseRollout::AtOnce,
        Some(other) => {
            return Err(ConfigError::OutOfRange {
                key: "controller.lease_rollout".into(),
                value: format!("\"{}\"", other.escape_default()),
                accepted: LeaseRollout::NAMES
                    .iter()
                    .map(|n| format!("\"{n}\""))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        }
    };
    let job_placement = match raw.job_placement.as_deref() {
        None | Some("slurm") => JobPlacement::Slurm,
        Some("reports") => JobPlacement::Reports,
        Some(other) => {
            return Err(ConfigError::OutOfRange {
                key: "controller.job_placement".into(),
                value: format!("\"{}\"", other.escape_default()),
                accepted: JobPlacement::NAMES
                    .iter()
                    .map(|n| format!("\"{n}\""))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        }
    };
    let slurm_poll_s = raw.slurm_poll_s.unwrap_or(5);
    if !(1..=300).contains(&slurm_poll_s) {
        return Err(ConfigError::OutOfRange {
            key: "controller.slurm_poll_s".into(),
            value: slurm_poll_s.to_string(),
            accepted: "1 to 300 seconds".into(),
        });
    }
    let slurm_timeout_s = raw.slurm_timeout_s.unwrap_or(5);
    if !(1..=60).contains(&slurm_timeout_s) {
        return Err(ConfigError::OutOfRange {
            key: "controller.slurm_timeout_s".into(),
            value: slurm_timeout_s.to_string(),
            accepted: "1 to 60 seconds".into(),
        });
    }
    Ok(ControllerConfig {
        listen,
        lease_ttl_s,
        allocation_period_s,
        key_file,
        admin_socket,
        state_dir,
        metrics_listen,
        lease_rollout,
        job_placement,
        slurm_poll_s,
        slurm_timeout_s,
        database: raw.database.map(validate_database).transpose()?,
        standby_addresses: validate_standby_addresses(raw.standby_addresses, listen)?,
        ha: raw.ha.map(|ha| validate_ha(ha, lease_ttl_s)).transpose()?,
    })
}

fn validate_agent(raw: RawAgent) -> Result<AgentConfig, ConfigError> {
    let socket = raw
        .socket
        .unwrap_or_else(|| DEFAULT_AGENT_SOCKET.to_string());
    path("agent.socket", &socket, true)?;
    let mut chars = socket.chars();
    while let Some(c) = chars.next() {
        if c == '%' {
            match chars.next() {
                Some('n' | '%') => {}
                other => {
                    return Err(ConfigError::BadSocketPlaceholder {
                        placeholder: other.map(String::from).unwrap_or_default(),
                        value: socket,
                    })
                }
            }
        }
    }

    let metrics_listen = match raw.metrics_listen {
        None => None,
        Some(text) => {
            let addr = socket_addr("agent.metrics_listen", &text)?;
            if !addr.ip().is_loopback() {
                return Err(ConfigError::MetricsNotLoopback { addr });
            }
            Some(addr)
        }
    };
    let nvml_library = match raw.nvml_library {
        None => None,
        Some(text) => Some(path("agent.nvml_library", &text, false)?),
    };

    let key = "agent.calibration_allowance_pct";
    let allowance_pct = finite(
        key,
        raw.calibration_allowance_pct
            .unwrap_or(DEFAULT_CALIBRATION_ALLOWANCE_PCT),
    )?;
    if !CALIBRATION_ALLOWANCE_RANGE_PCT.contains(&allowance_pct) {
        return Err(ConfigError::OutOfRange {
            key: key.into(),
            value: allowance_pct.to_string(),
            accepted: "0 to 50 percent".into(),
        });
    }
    let key = "agent.calibration_budget_pct";
    let budget_pct = finite(key, raw.calibration_budget_pct.unwrap_or(2.0))?;
    if !(budget_pct > 0.0 && budget_pct <= 50.0) {
        return Err(ConfigError::OutOfRange {
            key: key.into(),
            value: budget_pct.to_string(),
            accepted: "above 0 and at most 50 percent of a job's first-hour tokens".into(),
        });
    }
    let node_budget_w = match raw.node_budget_w {
        None => None,
        Some(w) => Some(positive_watts("agent.node_budget_w", w)?),
    };
    let state_dir = raw
        .state_dir
        .unwrap_or_else(|| DEFAULT_AGENT_STATE_DIR.to_string());
    path("agent.state_dir", &state_dir, true)?;
    let key_file = raw
        .key_file
        .unwrap_or_else(|| DEFAULT_AGENT_KEY_FILE.to_string());
    path("agent.key_file", &key_file, true)?;
    let seconds = |key: &str,
                   value: Option<f64>,
                   default: f64,
                   lo: f64,
                   hi: f64|
     -> Result<f64, ConfigError> {
        let v = finite(key, value.unwrap_or(default))?;
        if (lo..=hi).contains(&v) {
            Ok(v)
        } else {
            Err(ConfigError::OutOfRange {
                key: key.to_string(),
                value: v.to_string(),
                accepted: format!("{lo} to {hi} seconds"),
            })
        }
    };
    Ok(AgentConfig {
        socket,
        metrics_listen,
        nvml_library,
        calibration_allowance: SlowdownFraction(allowance_pct / 100.0),
        node_budget_w,
        state_dir,
        key_file,
        calibration_warmup_s: seconds(
            "agent.calibration_warmup_s",
            raw.calibration_warmup_s,
            60.0,
            0.5,
            3600.0,
        )?,
        calibration_settle_s: seconds(
            "agent.calibration_settle_s",
            raw.calibration_settle_s,
            10.0,
            0.5,
            600.0,
        )?,
        calibration_hold_s: seconds(
            "agent.calibration_hold_s",
            raw.calibration_hold_s,
            30.0,
            1.0,
            3600.0,
        )?,
        calibration_budget: budget_pct / 100.0,
        job_end_grace_s: seconds(
            "agent.job_end_grace_s",
            raw.job_end_grace_s,
            30.0,
            5.0,
            3600.0,
        )?,
        calibration_rewalk_after_s: seconds(
            "agent.calibration_rewalk_after_s",
            raw.calibration_rewalk_after_s,
            120.0,
            10.0,
            86_400.0,
        )?,
        enforce: raw.enforce.unwrap_or(true),
        usage_log: raw.usage_log.unwrap_or(true),
        unregistered_gpu_use: match raw.unregistered_gpu_use.as_deref() {
            Some("failsafe") => UnregisteredGpuUse::Failsafe,
            None | Some("default") => UnregisteredGpuUse::Default,
            Some(other) => {
                return Err(ConfigError::OutOfRange {
                    key: "agent.unregistered_gpu_use".into(),
                    value: format!("\"{}\"", other.escape_default()),
                    accepted: UnregisteredGpuUse::NAMES
                        .iter()
                        .map(|n| format!("\"{n}\""))
                        .collect::<Vec<_>>()
                        .join(", "),
                })
            }
        },
    })
}

fn validate_predictor(raw: RawPredictor) -> Result<PredictorConfig, ConfigError> {
    let default = PredictorConfig::default();
    Ok(PredictorConfig {
        pfi_intercept: finite(
            "predictor.pfi_intercept",
            raw.pfi_intercept.unwrap_or(default.pfi_intercept),
        )?,
        pfi_per_dram_copy_product: finite(
            "predictor.pfi_per_dram_copy_product",
            raw.pfi_per_dram_copy_product
                .unwrap_or(default.pfi_per_dram_copy_product),
        )?,
    })
}

// ---------------------------------------------------------------------------------------
// [grid.openadr]: the utility's OpenADR 3 server, followed by `powerflex-grid`.
// ---------------------------------------------------------------------------------------

/// `[grid]`: sources of grid events besides `powerflexctl event add`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawGrid {
    /// `[grid.openadr]`: the utility's OpenADR 3 VTN, followed by `powerflex-grid`.
    pub openadr: Option<RawOpenAdr>,
}

/// `[grid.openadr]` as written.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawOpenAdr {
    /// Base URL of the VTN's OpenADR 3 API, e.g. `https://vtn.utility.example/openadr3/`.
    /// `https`, or plain `http` to a loopback address only (a test VTN or a local proxy).
    pub vtn_url: String,
    /// Absolute path of the VEN's credentials (a TOML file with `bearer_token`, or
    /// `client_id` and `client_secret` for an OAuth token URL): a regular file owned by
    /// root, mode 0600. Required.
    pub credentials_file: String,
    /// `https` (or loopback `http`) URL of the OAuth 2 token endpoint, used only with
    /// `client_id`/`client_secret` credentials (default: `<vtn_url>/auth/token`).
    pub oauth_token_url: Option<String>,
    /// Name this site registers under at the VTN, 1 to 128 printable ascii characters
    /// (default `powerflex`).
    pub ven_name: Option<String>,
    /// Names of the VTN programs whose events this site follows, at least one.
    pub programs: Vec<String>,
    /// Seconds between two polls of the VTN's events, 1 to 300 (default 10).
    pub poll_interval_s: Option<u64>,
    /// Seconds between two reports of the metered GPU draw during an event, 1 to 3600
    /// (default 60).
    pub report_interval_s: Option<u64>,
    /// Absolute directory for the VEN's state: which VTN event is which powerflex event
    /// (default `/var/lib/powerflex/grid`).
    pub state_dir: Option<String>,
    /// Cut for each level of a `SIMPLE` event, percent of the base budget, index = level
    /// (default `[0, 10, 20, 30]`: levels 0 to 3). Each 0 to 95, never decreasing.
    pub simple_levels_pct: Option<Vec<f64>>,
    /// Site load besides the managed GPUs, kW, subtracted from an `IMPORT_CAPACITY_LIMIT`
    /// to give the GPU budget target (default 0, accepted 0 to 1,000,000).
    pub other_load_kw: Option<f64>,
    /// Longest event applied, seconds (default 86400; accepted 60 to 604800). A longer
    /// one is refused, not truncated.
    pub max_event_duration_s: Option<u64>,
    /// `[grid.openadr.program_domains]`: a program's name → the power domain (of
    /// `[[domains]]`) its events cut, e.g. `"feed-b-dr" = "feed-b"`. A program not
    /// listed cuts the site's budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program_domains: Option<BTreeMap<String, String>>,
    /// `[grid.openadr.safe_mode.<PROGRAM>]`: what the site holds a program's domain (or
    /// the site) to while the VTN has not answered for longer than the program allows,
    /// as grid operators' OpenADR profiles ask of every program; lifted when the VTN
    /// answers again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safe_mode: Option<BTreeMap<String, RawSafeMode>>,
}

/// `[grid.openadr.safe_mode.<PROGRAM>]`: one program's safe mode.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawSafeMode {
    /// The GPU budget held while the VTN is unreachable, kW (above 0, at most 1,000,000).
    pub gpu_limit_kw: f64,
    /// How long the VTN may be unreachable before it applies, seconds (60 to 86400).
    pub after_s: u64,
}

/// Validated `[grid.openadr.safe_mode.<PROGRAM>]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SafeMode {
    pub gpu_limit: Watts,
    pub after_s: u64,
}

/// Accepted range of `grid.openadr.safe_mode.<PROGRAM>.after_s`, seconds.
pub const SAFE_MODE_AFTER_RANGE_S: std::ops::RangeInclusive<u64> = 60..=86_400;

/// Validated `[grid]`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GridConfig {
    pub openadr: Option<OpenAdrConfig>,
}

/// Validated `[grid.openadr]`.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenAdrConfig {
    /// `https://…`, or `http://` to a loopback host; ends with `/`.
    pub vtn_url: String,
    pub credentials_file: PathBuf,
    pub oauth_token_url: Option<String>,
    pub ven_name: String,
    /// At least one, no duplicates.
    pub programs: Vec<String>,
    pub poll_interval_s: u64,
    pub report_interval_s: u64,
    pub state_dir: PathBuf,
    /// Cut fraction (0 to 0.95) per `SIMPLE` level, index = level.
    pub simple_level_cuts: Vec<f64>,
    pub other_load_kw: f64,
    pub max_event_duration_s: u64,
    /// Program → the power domain its events cut (checked against `[[domains]]`).
    pub program_domains: BTreeMap<String, String>,
    /// Program → its safe mode.
    pub safe_mode: BTreeMap<String, SafeMode>,
}

/// Accepted range of `grid.openadr.poll_interval_s`, seconds.
pub const OPENADR_POLL_RANGE_S: std::ops::RangeInclusive<u64> = 1..=300;
/// Accepted range of `grid.openadr.report_interval_s`, seconds.
pub const OPENADR_REPORT_RANGE_S: std::ops::RangeInclusive<u64> = 1..=3600;
/// Accepted range of `grid.openadr.max_event_duration_s`, seconds.
pub const OPENADR_MAX_EVENT_RANGE_S: std::ops::RangeInclusive<u64> = 60..=604_800;
/// Default `grid.openadr.state_dir`.
pub const DEFAULT_OPENADR_STATE_DIR: &str = "/var/lib/powerflex/grid";

fn out_of_range(key: &str, value: impl std::fmt::Display, accepted: &str) -> ConfigError {
    ConfigError::OutOfRange {
        key: key.to_string(),
        value: value.to_string(),
        accepted: accepted.to_string(),
    }
}

/// A name the VTN stores: 1 to 128 printable ascii characters.
fn vtn_name(key: &str, name: &str) -> Result<String, ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| (0x20..=0x7e).contains(&b))
        && name.trim() == name;
    if ok {
        Ok(name.to_string())
    } else {
        Err(out_of_range(
            key,
            format!("\"{}\"", name.escape_default()),
            "1 to 128 printable ascii characters without leading or trailing spaces",
        ))
    }
}

/// An `https` URL, or `http` to a loopback host (127.0.0.0/8, `[::1]`, `localhost`):
/// credentials and grid instructions never cross a network in clear text. Returned with
/// a trailing `/` so relative API paths join under it.
fn vtn_http_url(key: &str, text: &str) -> Result<String, ConfigError> {
    const ACCEPTED: &str = "an https:// url, or http:// to a loopback host (127.0.0.1, [::1], localhost), e.g. https://vtn.example.org/openadr3/";
    let bad = || out_of_range(key, format!("\"{}\"", text.escape_default()), ACCEPTED);
    if text.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(bad());
    }
    let (tls, rest) = if let Some(rest) = text.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = text.strip_prefix("http://") {
        (false, rest)
    } else {
        return Err(bad());
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.is_empty() || authority.contains('@') {
        return Err(bad());
    }
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next().unwrap_or_default()
    } else {
        authority.split(':').next().unwrap_or_default()
    };
    if host.is_empty() {
        return Err(bad());
    }
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !tls && !loopback {
        return Err(bad());
    }
    let mut url = text.to_string();
    if !url.ends_with('/') {
        url.push('/');
    }
    Ok(url)
}

fn validate_grid(raw: Option<RawGrid>) -> Result<GridConfig, ConfigError> {
    let Some(openadr) = raw.and_then(|g| g.openadr) else {
        return Ok(GridConfig::default());
    };
    Ok(GridConfig {
        openadr: Some(validate_openadr(openadr)?),
    })
}

fn validate_openadr(raw: RawOpenAdr) -> Result<OpenAdrConfig, ConfigError> {
    let vtn_url = vtn_http_url("grid.openadr.vtn_url", &raw.vtn_url)?;
    let credentials_file = path("grid.openadr.credentials_file", &raw.credentials_file, true)?;
    let oauth_token_url = raw
        .oauth_token_url
        .as_deref()
        .map(|u| vtn_http_url("grid.openadr.oauth_token_url", u))
        .transpose()?
        .map(|u| u.trim_end_matches('/').to_string());
    let ven_name = vtn_name(
        "grid.openadr.ven_name",
        raw.ven_name.as_deref().unwrap_or("powerflex"),
    )?;
    if raw.programs.is_empty() {
        return Err(out_of_range(
            "grid.openadr.programs",
            "[]",
            "at least one program name, e.g. [\"gpu-demand-response\"]",
        ));
    }
    let mut programs: Vec<String> = Vec::with_capacity(raw.programs.len());
    for name in &raw.programs {
        let name = vtn_name("grid.openadr.programs", name)?;
        if programs.contains(&name) {
            return Err(out_of_range(
                "grid.openadr.programs",
                format!("\"{}\" twice", name.escape_default()),
                "each program once",
            ));
        }
        programs.push(name);
    }
    let poll_interval_s = raw.poll_interval_s.unwrap_or(10);
    if !OPENADR_POLL_RANGE_S.contains(&poll_interval_s) {
        return Err(out_of_range(
            "grid.openadr.poll_interval_s",
            poll_interval_s,
            "1 to 300 seconds",
        ));
    }
    let report_interval_s = raw.report_interval_s.unwrap_or(60);
    if !OPENADR_REPORT_RANGE_S.contains(&report_interval_s) {
        return Err(out_of_range(
            "grid.openadr.report_interval_s",
            report_interval_s,
            "1 to 3600 seconds",
        ));
    }
    let state_dir = path(
        "grid.openadr.state_dir",
        raw.state_dir
            .as_deref()
            .unwrap_or(DEFAULT_OPENADR_STATE_DIR),
        true,
    )?;
    let levels = raw
        .simple_levels_pct
        .unwrap_or_else(|| vec![0.0, 10.0, 20.0, 30.0]);
    let key = "grid.openadr.simple_levels_pct";
    if levels.is_empty() || levels.len() > 16 {
        return Err(out_of_range(
            key,
            format!("{} levels", levels.len()),
            "1 to 16 levels, e.g. [0, 10, 20, 30]",
        ));
    }
    let mut simple_level_cuts = Vec::with_capacity(levels.len());
    for (level, &pct) in levels.iter().enumerate() {
        let pct = finite(key, pct)?;
        if !(0.0..=95.0).contains(&pct) {
            return Err(out_of_range(
                key,
                format!("{pct} at level {level}"),
                "0 to 95 percent per level",
            ));
        }
        if simple_level_cuts
            .last()
            .is_some_and(|&prev| pct / 100.0 < prev)
        {
            return Err(out_of_range(
                key,
                format!("{pct} at level {level}, below the level before"),
                "cuts that never decrease with the level",
            ));
        }
        simple_level_cuts.push(pct / 100.0);
    }
    let other_load_kw = finite(
        "grid.openadr.other_load_kw",
        raw.other_load_kw.unwrap_or(0.0),
    )?;
    if !(0.0..=1_000_000.0).contains(&other_load_kw) {
        return Err(out_of_range(
            "grid.openadr.other_load_kw",
            other_load_kw,
            "0 to 1000000 kW",
        ));
    }
    let max_event_duration_s = raw.max_event_duration_s.unwrap_or(86_400);
    if !OPENADR_MAX_EVENT_RANGE_S.contains(&max_event_duration_s) {
        return Err(out_of_range(
            "grid.openadr.max_event_duration_s",
            max_event_duration_s,
            "60 to 604800 seconds",
        ));
    }
    let known = |key: &str, program: &str| -> Result<(), ConfigError> {
        if programs.iter().any(|p| p == program) {
            Ok(())
        } else {
            Err(out_of_range(
                key,
                format!("\"{}\"", program.escape_default()),
                &format!("one of grid.openadr.programs ({})", programs.join(", ")),
            ))
        }
    };
    let program_domains = raw.program_domains.unwrap_or_default();
    for program in program_domains.keys() {
        known("grid.openadr.program_domains", program)?;
    }
    let mut safe_mode = BTreeMap::new();
    for (program, raw) in raw.safe_mode.unwrap_or_default() {
        let key = format!("grid.openadr.safe_mode.{}", key_segment(&program));
        known(&key, &program)?;
        let kw = finite(&format!("{key}.gpu_limit_kw"), raw.gpu_limit_kw)?;
        if !(kw > 0.0 && kw <= 1_000_000.0) {
            return Err(out_of_range(
                &format!("{key}.gpu_limit_kw"),
                kw,
                "above 0, at most 1000000 kW",
            ));
        }
        if !SAFE_MODE_AFTER_RANGE_S.contains(&raw.after_s) {
            return Err(out_of_range(
                &format!("{key}.after_s"),
                raw.after_s,
                "60 to 86400 seconds",
            ));
        }
        safe_mode.insert(
            program,
            SafeMode {
                gpu_limit: Watts(kw * 1000.0),
                after_s: raw.after_s,
            },
        );
    }
    Ok(OpenAdrConfig {
        vtn_url,
        credentials_file,
        oauth_token_url,
        ven_name,
        programs,
        poll_interval_s,
        report_interval_s,
        state_dir,
        simple_level_cuts,
        other_load_kw,
        max_event_duration_s,
        program_domains,
        safe_mode,
    })
}

fn finite(key: &str, value: f64) -> Result<f64, ConfigError> {
    if value.is_finite() {
        Ok(value)
    } else {
        Err(ConfigError::NotFinite {
            key: key.to_string(),
            value,
        })
    }
}

fn positive_watts(key: &str, value: f64) -> Result<Watts, ConfigError> {
    let value = finite(key, value)?;
    if value > 0.0 {
        Ok(Watts(value))
    } else {
        Err(ConfigError::OutOfRange {
            key: key.to_string(),
            value: value.to_string(),
            accepted: "a number of watts above 0".into(),
        })
    }
}

fn socket_addr(key: &str, text: &str) -> Result<SocketAddr, ConfigError> {
    text.parse().map_err(|_| ConfigError::BadSocketAddr {
        key: key.to_string(),
        value: text.to_string(),
    })
}

fn path(key: &str, text: &str, absolute: bool) -> Result<PathBuf, ConfigError> {
    if text.is_empty() {
        return Err(ConfigError::EmptyPath {
            key: key.to_string(),
        });
    }
    if text.chars().any(char::is_control) {
        return Err(ConfigError::ControlCharacterInPath {
            key: key.to_string(),
            value: text.to_string(),
        });
    }
    if absolute && !text.starts_with('/') {
        return Err(ConfigError::NotAbsolutePath {
            key: key.to_string(),
            value: text.to_string(),
        });
    }
    Ok(PathBuf::from(text))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    #[test]
    fn the_release_reads_its_two_keys_from_a_file_that_no_longer_validates() {
        // An unknown key and a budget of 0 fail the full loader; the release reads on.
        let text = "bogus = 1\n[facility]\ngpu_budget_w = 0\n[agent]\nnvml_library = \"/x/libnvml.so\"\nsocket = \"/s/%n.sock\"\nenforce = false\n";
        assert!(SiteConfig::from_toml_str(text).is_err());
        let release = ReleaseSettings::from_toml_str(text).expect("lenient");
        assert_eq!(release.nvml_library.as_deref(), Some("/x/libnvml.so"));
        assert_eq!(release.socket_path("n1"), PathBuf::from("/s/n1.sock"));
        let empty = ReleaseSettings::from_toml_str("").expect("an empty file");
        assert_eq!(empty.socket, DEFAULT_AGENT_SOCKET);
        assert!(empty.nvml_library.is_none());
        let wrong =
            ReleaseSettings::from_toml_str("[agent]\nsocket = 7\n").expect_err("a wrong type");
        assert!(wrong.to_string().contains("accepted: a string"), "{wrong}");
        assert!(ReleaseSettings::from_toml_str("not toml [").is_err());
    }

    use super::*;

    const EXAMPLE: &str = include_str!("../../slurm-conf/powerflex.toml");

    const MINIMAL: &str = r#"
[facility]
gpu_budget_w = 120000

[gpu_models.H200]
min_cap_w = 200
max_cap_w = 700
cap_step_w = 10
calibration_caps_w = [700, 600, 500, 400]
failsafe_cap_w = 500

[controller]
listen = "10.0.0.5:7300"
"#;

    /// `MINIMAL` with `old` replaced by `new` (which must change something).
    fn edited(old: &str, new: &str) -> String {
        assert!(MINIMAL.contains(old), "{old:?} not in MINIMAL");
        MINIMAL.replacen(old, new, 1)
    }

    /// `MINIMAL` with `extra` appended.
    fn plus(extra: &str) -> String {
        format!("{MINIMAL}\n{extra}\n")
    }

    fn parse_error(text: &str) -> String {
        match SiteConfig::from_toml_str(text) {
            Err(ConfigError::Parse { message }) => message,
            other => panic!("expected a parse error, got {other:?}"),
        }
    }

    const OPENADR: &str = r#"
[grid.openadr]
vtn_url = "https://vtn.example.org/openadr3"
credentials_file = "/etc/slurm/powerflex-openadr.toml"
programs = ["gpu-dr"]
"#;

    #[test]
    fn openadr_section_gets_defaults_and_a_trailing_slash() {
        let config = SiteConfig::from_toml_str(&plus(OPENADR)).unwrap();
        let o = config.grid.openadr.unwrap();
        assert_eq!(o.vtn_url, "https://vtn.example.org/openadr3/");
        assert_eq!(o.ven_name, "powerflex");
        assert_eq!(o.programs, vec!["gpu-dr".to_string()]);
        assert_eq!((o.poll_interval_s, o.report_interval_s), (10, 60));
        assert_eq!(o.simple_level_cuts, vec![0.0, 0.1, 0.2, 0.3]);
        assert_eq!(o.state_dir, PathBuf::from(DEFAULT_OPENADR_STATE_DIR));
        assert_eq!(o.max_event_duration_s, 86_400);
        assert!(o.oauth_token_url.is_none());
        // Without the section there is no VEN to run.
        assert!(SiteConfig::from_toml_str(MINIMAL)
            .unwrap()
            .grid
            .openadr
            .is_none());
    }

    #[test]
    fn openadr_values_out_of_range_name_the_key_and_what_is_accepted() {
        let cases: [(&str, &str, &str); 12] = [
            (
                "https://vtn.example.org/openadr3",
                "http://10.0.0.9:8080/",
                "grid.openadr.vtn_url",
            ),
            (
                "https://vtn.example.org/openadr3",
                "ftp://vtn.example.org/",
                "grid.openadr.vtn_url",
            ),
            (
                "https://vtn.example.org/openadr3",
                "https://",
                "grid.openadr.vtn_url",
            ),
            (
                "https://vtn.example.org/openadr3",
                "https://user@vtn/",
                "grid.openadr.vtn_url",
            ),
            (
                "/etc/slurm/powerflex-openadr.toml",
                "openadr.toml",
                "grid.openadr.credentials_file",
            ),
            ("[\"gpu-dr\"]", "[]", "grid.openadr.programs"),
            ("[\"gpu-dr\"]", "[\"a\", \"a\"]", "grid.openadr.programs"),
            ("[\"gpu-dr\"]", "[\" padded\"]", "grid.openadr.programs"),
            (
                "[\"gpu-dr\"]",
                "[\"gpu-dr\"]\npoll_interval_s = 0",
                "grid.openadr.poll_interval_s",
            ),
            (
                "[\"gpu-dr\"]",
                "[\"gpu-dr\"]\nsimple_levels_pct = [0, 30, 20]",
                "grid.openadr.simple_levels_pct",
            ),
            (
                "[\"gpu-dr\"]",
                "[\"gpu-dr\"]\nsimple_levels_pct = [0, 99]",
                "grid.openadr.simple_levels_pct",
            ),
            (
                "[\"gpu-dr\"]",
                "[\"gpu-dr\"]\nmax_event_duration_s = 10",
                "grid.openadr.max_event_duration_s",
            ),
        ];
        for (old, new, key) in cases {
            let text = plus(&OPENADR.replacen(old, new, 1));
            let err = SiteConfig::from_toml_str(&text).expect_err(new);
            let message = err.to_string();
            assert!(message.contains(key), "{new}: {message}");
            assert!(message.contains("accepted"), "{new}: {message}");
        }
        // Plain http is fine to a loopback VTN (tests, a local TLS-terminating proxy).
        for url in [
            "http://127.0.0.1:8080",
            "http://[::1]:8080/",
            "http://localhost/x/",
        ] {
            let text = plus(&OPENADR.replacen("https://vtn.example.org/openadr3", url, 1));
            assert!(SiteConfig::from_toml_str(&text).is_ok(), "{url}");
        }
        // A typo in a key is a parse error naming it.
        let typo = plus(&OPENADR.replacen("programs", "program", 1));
        assert!(parse_error(&typo).contains("program"), "{typo}");
    }

    #[test]
    fn example_config_parses_and_validates() {
        let config = SiteConfig::from_toml_str(EXAMPLE).unwrap();
        assert_eq!(config.gpu_models.len(), 1);
        let h200 = config.gpu_model_for("NVIDIA H200").unwrap();
        assert_eq!(h200.max_cap_w, Watts(700.0));
        assert!(config.facility.gpu_budget_w.0 > 0.0);
        // The fail-safe cap on every GPU of the example site fits its budget.
        let gpus = 24.0 * 8.0;
        assert!(h200.failsafe_cap_w.0 * gpus <= config.facility.gpu_budget_w.0);
        // Every key the example documents is set explicitly, not left to a default.
        let raw = RawSiteConfig::from_toml_str(EXAMPLE).unwrap();
        assert!(raw.facility.policy.is_some());
        assert!(raw.tiers.default.is_some() && raw.tiers.allow_max_slowdown.is_some());
        assert!(raw.tiers.tier.is_some());
        let c = &raw.controller;
        assert!(c.lease_ttl_s.is_some() && c.allocation_period_s.is_some());
        assert!(c.key_file.is_some());
        let a = &raw.agent;
        assert!(a.socket.is_some() && a.metrics_listen.is_some() && a.nvml_library.is_some());
        assert!(a.calibration_allowance_pct.is_some() && a.key_file.is_some());
        assert!(a.calibration_budget_pct.is_some());
        // Standalone mode is documented but left off: this site runs a controller.
        assert!(a.node_budget_w.is_none() && EXAMPLE.contains("# node_budget_w = "));
        let p = &raw.predictor;
        assert!(p.pfi_intercept.is_some() && p.pfi_per_dram_copy_product.is_some());
        let o = raw.grid.and_then(|g| g.openadr).unwrap();
        assert!(o.poll_interval_s.is_some() && o.report_interval_s.is_some());
        assert!(o.simple_levels_pct.is_some() && o.state_dir.is_some());
        assert!(config.grid.openadr.is_some());
    }

    /// What tests and the demo write is what the loader reads: serialising a raw config
    /// and parsing it back gives the same value, for the fully written example and for
    /// the minimal one (whose unset keys must stay unset, not become zeros or empty
    /// strings, so the loader's defaults still apply).
    #[test]
    fn raw_config_round_trips_through_toml() {
        for text in [EXAMPLE, MINIMAL] {
            let raw = RawSiteConfig::from_toml_str(text).unwrap();
            let written = toml::to_string(&raw).unwrap();
            assert_eq!(
                RawSiteConfig::from_toml_str(&written).unwrap(),
                raw,
                "{written}"
            );
        }
        let minimal = toml::to_string(&RawSiteConfig::from_toml_str(MINIMAL).unwrap()).unwrap();
        assert!(!minimal.contains("socket"), "{minimal}");
        assert!(!minimal.contains("lease_ttl_s"), "{minimal}");
        assert!(!minimal.contains("tier ="), "{minimal}");
    }

    #[test]
    fn the_rewalk_interval_is_a_site_setting_within_its_range() {
        let site = SiteConfig::from_toml_str(&plus("[agent]\ncalibration_rewalk_after_s = 30\n"))
            .expect("valid");
        assert_eq!(site.agent.calibration_rewalk_after_s, 30.0);
        let minimal = SiteConfig::from_toml_str(MINIMAL).expect("valid");
        assert_eq!(
            minimal.agent.calibration_rewalk_after_s, 120.0,
            "the default"
        );
        let err = SiteConfig::from_toml_str(&plus("[agent]\ncalibration_rewalk_after_s = 5\n"))
            .expect_err("below the range");
        let text = err.to_string();
        assert!(
            text.contains("agent.calibration_rewalk_after_s") && text.contains("10"),
            "{text}"
        );
    }

    /// The site says what a GPU used outside any registered job gets.
    #[test]
    fn unregistered_gpu_use_is_left_at_the_default_unless_the_site_says_failsafe() {
        let minimal = SiteConfig::from_toml_str(MINIMAL).expect("valid");
        assert_eq!(
            minimal.agent.unregistered_gpu_use,
            UnregisteredGpuUse::Default,
            "configs written before the plugin registered none jobs keep their behaviour"
        );
        let site =
            SiteConfig::from_toml_str(&plus("[agent]\nunregistered_gpu_use = \"failsafe\"\n"))
                .expect("valid");
        assert_eq!(
            site.agent.unregistered_gpu_use,
            UnregisteredGpuUse::Failsafe
        );
        let err =
            SiteConfig::from_toml_str(&plus("[agent]\nunregistered_gpu_use = \"uncapped\"\n"))
                .expect_err("not a choice");
        let text = err.to_string();
        assert!(
            text.contains("agent.unregistered_gpu_use")
                && text.contains("\"uncapped\"")
                && text.contains("\"failsafe\", \"default\""),
            "{text}"
        );
    }

    /// The site decides who may opt out with `--power-flex=none`.
    #[test]
    fn the_site_decides_who_may_opt_out() {
        let site = SiteConfig::from_toml_str(&plus(
            "[tiers]\ndefault = \"flex1\"\nopt_out = \"listed\"\nopt_out_users = [\"svc-infer\"]",
        ))
        .expect("valid");
        let opt_out = &site.tiers.opt_out;
        assert!(opt_out.allows(0, Some("root")), "root always");
        assert!(opt_out.allows(1001, Some("svc-infer")));
        assert!(!opt_out.allows(1002, Some("alice")));
        assert!(
            !opt_out.allows(1003, None),
            "an unknown name is not on the list"
        );
        let open = SiteConfig::from_toml_str(MINIMAL).expect("valid");
        assert_eq!(open.tiers.opt_out, OptOut::Anyone);
        assert!(open.tiers.opt_out.allows(1002, None));
        for (extra, want) in [
            (
                "[tiers]\nopt_out = \"listed\"",
                "tiers.opt_out = \"listed\" with tiers.default = \"none\"",
            ),
            (
                "[tiers]\ndefault = \"flex1\"\nopt_out = \"some\"",
                "accepted: \"anyone\", \"listed\"",
            ),
            (
                "[tiers]\nopt_out_users = [\"bob\"]",
                "\"listed\" when tiers.opt_out_users names users",
            ),
            (
                "[tiers]\ndefault = \"flex1\"\nopt_out = \"listed\"\nopt_out_users = [\"a b\"]",
                "user names of 1 to 64",
            ),
        ] {
            let e = SiteConfig::from_toml_str(&plus(extra)).expect_err(extra);
            assert!(e.to_string().contains(want), "{extra}: {e}");
        }
    }

    /// `[controller.ha]` is optional; its leadership TTL must let a standby
    /// take over within half a lease, its timeout fit a renewal, its name the link's
    /// rules; every refusal names its key and what is accepted.
    #[test]
    fn a_standby_controller_is_optional_and_its_leadership_fits_half_a_lease() {
        let site = SiteConfig::from_toml_str(MINIMAL).unwrap();
        assert_eq!(site.controller.ha, None, "one controller by default");
        assert!(site.controller.standby_addresses.is_empty());
        let ha = |extra: &str| {
            SiteConfig::from_toml_str(&plus(&format!(
                "[controller.ha]\nname = \"ctld-a\"\nurl = \"postgres://pf@db:5432/pf\"\n{extra}"
            )))
        };
        let c = ha("").unwrap().controller.ha.unwrap();
        // Default lease TTL 60 s: leadership 18 s, statements 5 s.
        assert_eq!((c.name.as_str(), c.leader_ttl_s), ("ctld-a", 18));
        assert_eq!(c.database.timeout_s, 5);
        assert_eq!(c.database.url, "postgres://pf@db:5432/pf");
        assert_eq!(
            ha("leader_ttl_s = 22")
                .unwrap()
                .controller
                .ha
                .unwrap()
                .leader_ttl_s,
            22
        );
        for (extra, key, accepted) in [
            (
                "leader_ttl_s = 23",
                "controller.ha.leader_ttl_s",
                "3 to 22 seconds",
            ),
            (
                "leader_ttl_s = 2",
                "controller.ha.leader_ttl_s",
                "3 to 22 seconds",
            ),
            (
                "leader_ttl_s = 9\ntimeout_s = 4",
                "controller.ha.timeout_s",
                "1 to 3 seconds",
            ),
            ("timeout_s = 0", "controller.ha.timeout_s", "1 to 6 seconds"),
            (
                "password_file = \"rel/pw\"",
                "controller.ha.password_file",
                "absolute",
            ),
        ] {
            let e = ha(extra).expect_err(extra).to_string();
            assert!(e.contains(key) && e.contains(accepted), "{extra}: {e}");
        }
        let e = SiteConfig::from_toml_str(&plus(
            "[controller.ha]\nname = \"a b\"\nurl = \"postgres://pf@db/pf\"",
        ))
        .expect_err("name")
        .to_string();
        assert!(e.contains("controller.ha.name"), "{e}");
        let e = SiteConfig::from_toml_str(&plus(
            "[controller.ha]\nname = \"a\"\nurl = \"postgres://pf:secret@db/pf\"",
        ))
        .expect_err("password")
        .to_string();
        assert!(
            e.contains("controller.ha.url") && e.contains("controller.ha.password_file"),
            "{e}"
        );
        // A lease too short for any takeover within half of it says so.
        let e = SiteConfig::from_toml_str(&edited(
            "listen = \"10.0.0.5:7300\"",
            "listen = \"10.0.0.5:7300\"\nlease_ttl_s = 6\nallocation_period_s = 1\n[controller.ha]\nname = \"a\"\nurl = \"postgres://pf@db/pf\"",
        ))
        .expect_err("short lease")
        .to_string();
        assert!(e.contains("lease_ttl_s of at least 8"), "{e}");
        // The agents' other addresses: IP literals, each once, not `listen`.
        let standby = |list: &str| {
            SiteConfig::from_toml_str(&edited(
                "listen = \"10.0.0.5:7300\"",
                &format!("listen = \"10.0.0.5:7300\"\nstandby_addresses = {list}"),
            ))
        };
        assert_eq!(
            standby("[\"10.0.0.6:7300\"]")
                .unwrap()
                .controller
                .standby_addresses,
            vec!["10.0.0.6:7300".parse::<SocketAddr>().unwrap()]
        );
        for bad in [
            "[\"10.0.0.5:7300\"]",
            "[\"10.0.0.6:7300\", \"10.0.0.6:7300\"]",
            "[\"0.0.0.0:7300\"]",
            "[\"ctld-b:7300\"]",
        ] {
            let e = standby(bad).expect_err(bad).to_string();
            assert!(e.contains("controller.standby_addresses"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_accounting_database_is_optional_checked_and_never_holds_a_password() {
        let site = SiteConfig::from_toml_str(MINIMAL).unwrap();
        assert_eq!(site.controller.database, None, "no database by default");
        let with = |table: &str| {
            SiteConfig::from_toml_str(&plus(&format!("[controller.database]\n{table}")))
        };
        let db = with("url = \"postgres://powerflex@db.example.org:5432/powerflex\"\npassword_file = \"/etc/slurm/powerflex-db.password\"")
            .unwrap()
            .controller
            .database
            .unwrap();
        assert_eq!(db.url, "postgres://powerflex@db.example.org:5432/powerflex");
        assert_eq!(db.timeout_s, 5);
        assert_eq!(
            db.password_file.as_deref(),
            Some(std::path::Path::new("/etc/slurm/powerflex-db.password"))
        );
        for (table, names) in [
            (
                "url = \"mysql://x@h/db\"",
                "postgres://USER@HOST:PORT/DATABASE",
            ),
            ("url = \"postgres://pf:secret@h/db\"", "password_file"),
            (
                "url = \"postgres://pf@h/db?password=secret\"",
                "password_file",
            ),
            (
                "url = \"postgres://pf@h/db\"\ntimeout_s = 0",
                "1 to 60 seconds",
            ),
            (
                "url = \"postgres://pf@h/db\"\npassword_file = \"relative\"",
                "absolute",
            ),
        ] {
            let e = with(table).unwrap_err().to_string();
            assert!(e.contains("controller.database"), "{table}: {e}");
            assert!(e.contains(names), "{table}: {e}");
            assert!(
                !e.contains("secret"),
                "an error never repeats a password: {e}"
            );
        }
        let long = format!(
            "url = \"postgres://pf@h/{}\"",
            "d".repeat(MAX_DATABASE_URL_BYTES)
        );
        assert!(with(&long)
            .unwrap_err()
            .to_string()
            .contains("at most 1024 bytes"));
        assert!(parse_error(&plus(
            "[controller.database]\nurl = \"postgres://pf@h/db\"\nuser = \"x\""
        ))
        .contains("user"));
    }

    /// Review 22, finding 10: the `leader_ttl_s` refusal reads as one sentence.
    #[test]
    fn the_leader_ttl_refusal_has_no_run_of_spaces() {
        for (toml, says) in [
            (
                "[controller.ha]\nname = \"a\"\nurl = \"postgres://pf@db/pf\"\nleader_ttl_s = 23",
                "3/8 of controller.lease_ttl_s = 60: a standby",
            ),
            (
                "[controller.ha]\nname = \"a\"\nurl = \"postgres://pf@db/pf\"",
                "a takeover within half a lease",
            ),
        ] {
            let text = if says.starts_with("a takeover") {
                plus(toml).replace(
                    "listen = \"10.0.0.5:7300\"",
                    "listen = \"10.0.0.5:7300\"\nlease_ttl_s = 6\nallocation_period_s = 2",
                )
            } else {
                plus(toml)
            };
            let e = SiteConfig::from_toml_str(&text)
                .expect_err(toml)
                .to_string();
            assert!(e.contains(says), "{e}");
            assert!(!e.contains("  "), "a run of spaces: {e}");
        }
    }

    /// Review 22, finding 9: a password is refused however the URL spells it, as the
    /// client library would read it, and no refusal repeats the URL.
    #[test]
    fn a_database_url_password_is_refused_however_written_and_never_echoed() {
        let with = |url: &str| {
            SiteConfig::from_toml_str(&plus(&format!(
                "[controller.ha]\nname = \"ctld-a\"\nurl = \"{url}\""
            )))
        };
        for url in [
            "postgres://pf@db/pf?pass%77ord=hunter2",
            "postgres://pf@db/pf?sslmode=disable&%70assword=hunter2",
            "postgresql://pf%40x:hunter2@db/pf",
            "postgres://pf@db/pf?password%3d=x&password=hunter2",
        ] {
            let e = with(url).expect_err(url).to_string();
            assert!(e.contains("password_file"), "{url}: {e}");
            assert!(!e.contains("hunter2"), "{url}: {e}");
        }
        assert!(with("postgres://pf@db:5432/pf?application_name=x").is_ok());
        // A typo in the scheme, an overlong URL, a control character: refused, unrepeated.
        for url in [
            "postgre://pf:hunter2@db/pf".to_string(),
            format!(
                "postgres://pf:hunter2@db/{}",
                "d".repeat(MAX_DATABASE_URL_BYTES)
            ),
            "postgres://pf@db/hunter2\\tx".to_string(),
        ] {
            let e = with(&url).expect_err(&url).to_string();
            assert!(e.contains("controller.ha.url"), "{e}");
            assert!(!e.contains("hunter2"), "the URL repeated: {e}");
        }
        assert!(url_has_password("pf@db/pf?pass%77ord=x"));
        assert!(!url_has_password("pf@db:5432/pf?application_name=pass"));
    }

    /// The minimal site with a domain `feed-b` of 40 kW (n1-n4) and an OpenADR VEN
    /// following `programs` (TOML array items), `extra` appended.
    fn feed_b_grid(programs: &str, extra: &str) -> String {
        format!(
            "{MINIMAL}
[[domains]]
name = \"feed-b\"
gpu_limit_w = 40000
nodes = \"n[1-4]\"

[grid.openadr]
vtn_url = \"http://127.0.0.1:8080/\"
credentials_file = \"/etc/slurm/powerflex-openadr.toml\"
programs = [{programs}]
{extra}
"
        )
    }

    /// Review 22, finding 10: a program name in a key is escaped like a value, and a
    /// safe-mode limit that could cut nothing is refused with the range that binds.
    #[test]
    fn safe_mode_keys_are_escaped_and_limits_must_cut() {
        let grid = feed_b_grid;
        let e = SiteConfig::from_toml_str(&grid(
            "\"feed-b-dr\"",
            "[grid.openadr.safe_mode.\"p\\u0007\"]\ngpu_limit_kw = 30\nafter_s = 900",
        ))
        .expect_err("unknown program")
        .to_string();
        assert!(
            !e.chars().any(|c| c.is_control()),
            "a raw control character: {e:?}"
        );
        assert!(e.contains("safe_mode.\"p\\u{7}\""), "{e}");
        let e = SiteConfig::from_toml_str(&grid(
            "\"feed-b-dr\"",
            "[grid.openadr.program_domains]\n\"feed-b-dr\" = \"feed-b\"\n\
             [grid.openadr.safe_mode.feed-b-dr]\ngpu_limit_kw = 41\nafter_s = 900",
        ))
        .expect_err("above the domain's limit")
        .to_string();
        assert!(
            e.contains("grid.openadr.safe_mode.feed-b-dr.gpu_limit_kw")
                && e.contains("at most 40 kW")
                && e.contains("feed-b"),
            "{e}"
        );
        let e = SiteConfig::from_toml_str(&grid(
            "\"site-dr\"",
            "[grid.openadr.safe_mode.site-dr]\ngpu_limit_kw = 150\nafter_s = 900",
        ))
        .expect_err("above the site budget")
        .to_string();
        assert!(
            e.contains("at most 120 kW") && e.contains("facility.gpu_budget_w"),
            "{e}"
        );
        assert!(SiteConfig::from_toml_str(&grid(
            "\"site-dr\"",
            "[grid.openadr.safe_mode.site-dr]\ngpu_limit_kw = 100\nafter_s = 900",
        ))
        .is_ok());
    }

    #[test]
    fn power_domains_are_read_and_checked() {
        let text = format!(
            "{MINIMAL}
[[domains]]
name = \"feed-a\"
gpu_limit_w = 40000

[[domains]]
name = \"rack-1\"
parent = \"feed-a\"
gpu_limit_w = 20000
nodes = \"gpu[01-04]\"
"
        );
        let site = SiteConfig::from_toml_str(&text).expect("valid");
        let tree = &site.domains;
        assert_eq!(tree.domains().len(), 2);
        let rack = tree.leaf_of("gpu03").expect("placed");
        assert_eq!(tree.domains()[rack].name, "rack-1");
        assert_eq!(tree.domains()[rack].gpu_limit, Watts(20000.0));
        assert!(SiteConfig::from_toml_str(MINIMAL)
            .expect("valid")
            .domains
            .is_empty());
        let bad = text.replace("parent = \"feed-a\"", "parent = \"feed-z\"");
        let e = SiteConfig::from_toml_str(&bad).expect_err("unknown parent");
        assert!(
            e.to_string()
                .contains("domains: domain \"rack-1\": parent \"feed-z\" is not a declared domain"),
            "{e}"
        );
        let unknown_key = text.replace("gpu_limit_w = 20000", "gpu_limit_w = 20000\nlimit = 1");
        assert!(SiteConfig::from_toml_str(&unknown_key).is_err());
    }

    #[test]
    fn a_program_s_domain_and_safe_mode_are_checked_against_the_site() {
        let grid = |extra: &str| feed_b_grid("\"feed-b-dr\"", extra);
        let ok = grid(
            "[grid.openadr.program_domains]\n\"feed-b-dr\" = \"feed-b\"\n\
             [grid.openadr.safe_mode.feed-b-dr]\ngpu_limit_kw = 30\nafter_s = 900",
        );
        let site = SiteConfig::from_toml_str(&ok).expect("valid");
        let openadr = site.grid.openadr.expect("openadr");
        assert_eq!(openadr.program_domains["feed-b-dr"], "feed-b");
        assert_eq!(openadr.safe_mode["feed-b-dr"].gpu_limit, Watts(30_000.0));
        assert_eq!(openadr.safe_mode["feed-b-dr"].after_s, 900);
        for (extra, says) in [
            (
                "[grid.openadr.program_domains]\n\"feed-b-dr\" = \"feed-z\"",
                "a domain of [[domains]] (feed-b)",
            ),
            (
                "[grid.openadr.program_domains]\n\"other\" = \"feed-b\"",
                "one of grid.openadr.programs (feed-b-dr)",
            ),
            (
                "[grid.openadr.safe_mode.feed-b-dr]\ngpu_limit_kw = 0\nafter_s = 900",
                "above 0",
            ),
            (
                "[grid.openadr.safe_mode.feed-b-dr]\ngpu_limit_kw = 30\nafter_s = 5",
                "60 to 86400 seconds",
            ),
        ] {
            let e = SiteConfig::from_toml_str(&grid(extra)).expect_err(extra);
            assert!(e.to_string().contains(says), "{e} should say {says}");
        }
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let config = SiteConfig::from_toml_str(MINIMAL).unwrap();
        assert_eq!(
            config,
            SiteConfig {
                facility: FacilityConfig {
                    gpu_budget_w: Watts(120_000.0),
                    policy: Policy::Optimal,
                    expected_cut: 0.3,
                    max_ramp_w_per_s: None,
                    budget_mode: BudgetMode::Metered { margin: 0.01 },
                    objective: Objective::RelativeSpeed,
                },
                tiers: TiersConfig {
                    opt_out: OptOut::Anyone,
                    table: TierTable::default_table(),
                    default: Service::Unmanaged,
                },
                gpu_models: vec![GpuModelConfig {
                    name: "H200".into(),
                    min_cap_w: Watts(200.0),
                    max_cap_w: Watts(700.0),
                    cap_step_w: Watts(10.0),
                    calibration_caps_w: vec![
                        Watts(700.0),
                        Watts(600.0),
                        Watts(500.0),
                        Watts(400.0)
                    ],
                    failsafe_cap_w: Watts(500.0),
                }],
                controller: ControllerConfig {
                    listen: "10.0.0.5:7300".parse().unwrap(),
                    lease_ttl_s: 60,
                    allocation_period_s: 10,
                    key_file: PathBuf::from("/etc/slurm/powerflex.key"),
                    admin_socket: PathBuf::from("/run/powerflex/ctld.sock"),
                    state_dir: PathBuf::from("/var/lib/powerflex/ctld"),
                    metrics_listen: None,
                    lease_rollout: LeaseRollout::TwoStep,
                    job_placement: JobPlacement::Slurm,
                    slurm_poll_s: 5,
                    slurm_timeout_s: 5,
                    database: None,
                    standby_addresses: Vec::new(),
                    ha: None,
                },
                agent: AgentConfig {
                    socket: "/run/powerflex/%n.sock".into(),
                    metrics_listen: None,
                    nvml_library: None,
                    calibration_allowance: SlowdownFraction(0.05),
                    node_budget_w: None,
                    state_dir: "/var/lib/powerflex/%n".into(),
                    key_file: "/etc/powerflex/node.key".into(),
                    calibration_warmup_s: 60.0,
                    calibration_settle_s: 10.0,
                    calibration_hold_s: 30.0,
                    calibration_budget: 0.02,
                    job_end_grace_s: 30.0,
                    calibration_rewalk_after_s: 120.0,
                    enforce: true,
                    usage_log: true,
                    unregistered_gpu_use: UnregisteredGpuUse::Default,
                },
                predictor: PredictorConfig {
                    pfi_intercept: 1.2,
                    pfi_per_dram_copy_product: 1.5,
                },
                grid: GridConfig { openadr: None },
                domains: crate::domains::DomainTree::default(),
            }
        );
        assert_eq!(config.controller.lease_ttl(), Duration::from_secs(60));
        assert_eq!(
            config.controller.allocation_period(),
            Duration::from_secs(10)
        );
    }

    #[test]
    fn accepted_values_are_typed() {
        let text = plus(
            r#"
[tiers]
default = "silver"
allow_max_slowdown = false
[[tiers.tier]]
name = "gold"
max_slowdown_pct = 0
[[tiers.tier]]
name = "silver"
max_slowdown_pct = 12.5

[gpu_models."H100 NVL"]
min_cap_w = 200.0
max_cap_w = 400.0
cap_step_w = 5
calibration_caps_w = [400, 300]
failsafe_cap_w = 200

[agent]
socket = "/run/pf/%n-100%%.sock"
metrics_listen = "[::1]:9464"
node_budget_w = 5600
"#,
        )
        .replace(
            "[controller]",
            "[controller]\nlease_ttl_s = 20\nallocation_period_s = 10",
        );
        let config = SiteConfig::from_toml_str(&text).unwrap();
        assert_eq!(
            config.tiers.default,
            Service::Bounded {
                tier: "silver".into(),
                max_slowdown: SlowdownFraction(0.125)
            }
        );
        assert!(!config.tiers.table.allows_max_slowdown());
        assert_eq!(config.controller.lease_ttl_s, 20);
        assert_eq!(
            config.agent.socket_path("gpu017"),
            PathBuf::from("/run/pf/gpu017-100%.sock")
        );
        assert_eq!(
            config.agent.metrics_listen,
            Some("[::1]:9464".parse().unwrap())
        );
        assert_eq!(config.agent.node_budget_w, Some(Watts(5600.0)));
        let names: Vec<_> = config.gpu_models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["H100 NVL", "H200"]);
        for policy in Policy::NAMES {
            let text = edited(
                "gpu_budget_w = 120000",
                &format!("gpu_budget_w = 120000\npolicy = \"{policy}\""),
            );
            let config = SiteConfig::from_toml_str(&text).unwrap();
            assert_eq!(config.facility.policy.name(), policy);
        }
    }

    #[test]
    fn gpu_models_match_nvml_names() {
        let text = plus(
            r#"
[gpu_models.h100]
min_cap_w = 200
max_cap_w = 700
cap_step_w = 10
calibration_caps_w = [700, 500]
failsafe_cap_w = 400
[gpu_models."H100 NVL"]
min_cap_w = 200
max_cap_w = 400
cap_step_w = 10
calibration_caps_w = [400, 300]
failsafe_cap_w = 300
"#,
        );
        let config = SiteConfig::from_toml_str(&text).unwrap();
        let name = |device: &str| config.gpu_model_for(device).map(|m| m.name.as_str());
        assert_eq!(name("NVIDIA H200"), Some("H200"));
        assert_eq!(name("nvidia h200 nvl"), Some("H200"));
        assert_eq!(name("NVIDIA H100 80GB HBM3"), Some("h100"));
        assert_eq!(name("NVIDIA H100 NVL"), Some("H100 NVL"));
        assert_eq!(name("NVIDIA A100-SXM4-80GB"), None);
    }

    #[test]
    fn rejects_each_validation_error() {
        let bad_tier = |extra: &str| plus(&format!("[tiers]\n{extra}"));
        let cases: Vec<(String, ConfigError)> = vec![
            (
                edited("gpu_budget_w = 120000", "gpu_budget_w = 0"),
                ConfigError::OutOfRange {
                    key: "facility.gpu_budget_w".into(),
                    value: "0".into(),
                    accepted: "a number of watts above 0".into(),
                },
            ),
            (
                edited("gpu_budget_w = 120000", "gpu_budget_w = -5.5"),
                ConfigError::OutOfRange {
                    key: "facility.gpu_budget_w".into(),
                    value: "-5.5".into(),
                    accepted: "a number of watts above 0".into(),
                },
            ),
            (
                edited("gpu_budget_w = 120000", "gpu_budget_w = inf"),
                ConfigError::NotFinite {
                    key: "facility.gpu_budget_w".into(),
                    value: f64::INFINITY,
                },
            ),
            (
                edited(
                    "gpu_budget_w = 120000",
                    "gpu_budget_w = 1\npolicy = \"greedy\"",
                ),
                ConfigError::UnknownPolicy {
                    value: "greedy".into(),
                },
            ),
            (
                edited(
                    "gpu_budget_w = 120000",
                    "gpu_budget_w = 1\nbudget_mode = \"soft\"",
                ),
                ConfigError::OutOfRange {
                    key: "facility.budget_mode".into(),
                    value: "\"soft\"".into(),
                    accepted: "\"metered\", \"hard\"".into(),
                },
            ),
            (
                format!("{MINIMAL}\n[tiers.preempt]\nflex3 = \"pause\"\n"),
                ConfigError::OutOfRange {
                    key: "tiers.preempt.flex3".into(),
                    value: "\"pause\"".into(),
                    accepted: "\"never\", \"suspend\", \"requeue\"".into(),
                },
            ),
            (
                format!("{MINIMAL}\n[tiers.preempt]\nflex9 = \"suspend\"\n"),
                ConfigError::OutOfRange {
                    key: "tiers.preempt.flex9".into(),
                    value: "\"suspend\"".into(),
                    accepted: "only the site's tiers: flex0, flex1, flex2, flex3".into(),
                },
            ),
            (
                format!("{MINIMAL}\n[tiers.preempt]\nflex0 = \"suspend\"\n"),
                ConfigError::OutOfRange {
                    key: "tiers.preempt.flex0".into(),
                    value: "\"suspend\"".into(),
                    accepted: "\"never\" for a tier that allows no slowdown (its jobs are never suspended or requeued)".into(),
                },
            ),
            (
                edited(
                    "gpu_budget_w = 120000",
                    "gpu_budget_w = 1\nmax_ramp_w_per_s = 0",
                ),
                ConfigError::OutOfRange {
                    key: "facility.max_ramp_w_per_s".into(),
                    value: "0".into(),
                    accepted: "watts per second above 0 (leave it out for no limit)".into(),
                },
            ),
            (
                edited(
                    "gpu_budget_w = 120000",
                    "gpu_budget_w = 1\nmax_ramp_w_per_s = -5.5",
                ),
                ConfigError::OutOfRange {
                    key: "facility.max_ramp_w_per_s".into(),
                    value: "-5.5".into(),
                    accepted: "watts per second above 0 (leave it out for no limit)".into(),
                },
            ),
            (
                edited(
                    "gpu_budget_w = 120000",
                    "gpu_budget_w = 1\nmax_ramp_w_per_s = nan",
                ),
                ConfigError::NotFinite {
                    key: "facility.max_ramp_w_per_s".into(),
                    value: f64::NAN,
                },
            ),
            (
                edited(
                    "gpu_budget_w = 120000",
                    "gpu_budget_w = 1\nmetered_margin_pct = 25",
                ),
                ConfigError::OutOfRange {
                    key: "facility.metered_margin_pct".into(),
                    value: "25".into(),
                    accepted: "a percentage from 0 to 20".into(),
                },
            ),
            (
                edited(
                    "gpu_budget_w = 120000",
                    "gpu_budget_w = 1\nbudget_mode = \"hard\"\nmetered_margin_pct = 3",
                ),
                ConfigError::OutOfRange {
                    key: "facility.metered_margin_pct".into(),
                    value: "3".into(),
                    accepted:
                        "nothing with budget_mode = \"hard\" (the margin applies to metered mode)"
                            .into(),
                },
            ),
            (
                bad_tier("default = \"flex9\""),
                ConfigError::UnknownDefaultTier {
                    name: "flex9".into(),
                    accepted: "flex0, flex1, flex2, flex3, none".into(),
                },
            ),
            (
                bad_tier("[[tiers.tier]]\nname = \"Gold\"\nmax_slowdown_pct = 5"),
                ConfigError::Tiers(FlexError::InvalidTierName {
                    name: "Gold".into(),
                }),
            ),
            (
                bad_tier("[[tiers.tier]]\nname = \"none\"\nmax_slowdown_pct = 5"),
                ConfigError::Tiers(FlexError::ReservedTierName {
                    name: "none".into(),
                }),
            ),
            (
                bad_tier(
                    "[[tiers.tier]]\nname = \"a\"\nmax_slowdown_pct = 5\n\
                     [[tiers.tier]]\nname = \"a\"\nmax_slowdown_pct = 6",
                ),
                ConfigError::Tiers(FlexError::DuplicateTier { name: "a".into() }),
            ),
            (
                bad_tier("[[tiers.tier]]\nname = \"a\"\nmax_slowdown_pct = 150"),
                ConfigError::Tiers(FlexError::TierSlowdownOutOfRange {
                    name: "a".into(),
                    max_slowdown_pct: 150.0,
                }),
            ),
            (
                bad_tier("allow_max_slowdown = false\ntier = []"),
                ConfigError::Tiers(FlexError::NoTiers),
            ),
            (
                "[facility]\ngpu_budget_w = 1\n[controller]\nlisten = \"10.0.0.5:7300\"\n"
                    .to_string(),
                ConfigError::NoGpuModels,
            ),
            (
                edited("[gpu_models.H200]", "[gpu_models.\" H200\"]"),
                ConfigError::InvalidGpuModelName {
                    name: " H200".into(),
                },
            ),
            (
                edited("[gpu_models.H200]", "[gpu_models.\"H200\\u0007\"]"),
                ConfigError::InvalidGpuModelName {
                    name: "H200\u{7}".into(),
                },
            ),
            (
                edited("[gpu_models.H200]", "[gpu_models.\"\"]"),
                ConfigError::InvalidGpuModelName { name: "".into() },
            ),
            (
                plus(
                    "[gpu_models.h200]\nmin_cap_w = 200\nmax_cap_w = 700\ncap_step_w = 10\n\
                     calibration_caps_w = [700, 600]\nfailsafe_cap_w = 500",
                ),
                ConfigError::DuplicateGpuModel {
                    first: "H200".into(),
                    second: "h200".into(),
                },
            ),
            (
                edited("min_cap_w = 200", "min_cap_w = 800"),
                ConfigError::CapRangeInverted {
                    model: "H200".into(),
                    min_cap_w: 800.0,
                    max_cap_w: 700.0,
                },
            ),
            (
                edited("min_cap_w = 200", "min_cap_w = 0"),
                ConfigError::OutOfRange {
                    key: "gpu_models.H200.min_cap_w".into(),
                    value: "0".into(),
                    accepted: "a number of watts above 0".into(),
                },
            ),
            (
                edited("max_cap_w = 700", "max_cap_w = nan"),
                ConfigError::NotFinite {
                    key: "gpu_models.H200.max_cap_w".into(),
                    value: f64::NAN,
                },
            ),
            (
                edited("cap_step_w = 10", "cap_step_w = 0"),
                ConfigError::OutOfRange {
                    key: "gpu_models.H200.cap_step_w".into(),
                    value: "0".into(),
                    accepted: "a number of watts above 0".into(),
                },
            ),
            (
                edited("cap_step_w = 10", "cap_step_w = 600"),
                ConfigError::OutOfRange {
                    key: "gpu_models.H200.cap_step_w".into(),
                    value: "600".into(),
                    accepted: "above 0 and at most max_cap_w - min_cap_w (500 W)".into(),
                },
            ),
            (
                edited("[700, 600, 500, 400]", "[700]"),
                ConfigError::CalibrationCapsTooFew {
                    model: "H200".into(),
                    count: 1,
                },
            ),
            (
                edited("[700, 600, 500, 400]", "[600, 500]"),
                ConfigError::CalibrationCapsMustStartAtMax {
                    model: "H200".into(),
                    first: 600.0,
                    max_cap_w: 700.0,
                },
            ),
            (
                edited("[700, 600, 500, 400]", "[700, 100]"),
                ConfigError::CalibrationCapOutOfRange {
                    model: "H200".into(),
                    cap: 100.0,
                    min_cap_w: 200.0,
                    max_cap_w: 700.0,
                },
            ),
            (
                edited("[700, 600, 500, 400]", "[700, 500, 600]"),
                ConfigError::CalibrationCapsNotDescending {
                    model: "H200".into(),
                    previous: 500.0,
                    cap: 600.0,
                },
            ),
            (
                edited("[700, 600, 500, 400]", "[700, 500, 500]"),
                ConfigError::CalibrationCapsNotDescending {
                    model: "H200".into(),
                    previous: 500.0,
                    cap: 500.0,
                },
            ),
            (
                edited("[700, 600, 500, 400]", "[700, -inf]"),
                ConfigError::NotFinite {
                    key: "gpu_models.H200.calibration_caps_w[1]".into(),
                    value: f64::NEG_INFINITY,
                },
            ),
            (
                edited("failsafe_cap_w = 500", "failsafe_cap_w = 150"),
                ConfigError::FailsafeCapOutOfRange {
                    model: "H200".into(),
                    failsafe_cap_w: 150.0,
                    min_cap_w: 200.0,
                    max_cap_w: 700.0,
                },
            ),
            (
                edited("\"10.0.0.5:7300\"", "\"ctl.example.org:7300\""),
                ConfigError::BadSocketAddr {
                    key: "controller.listen".into(),
                    value: "ctl.example.org:7300".into(),
                },
            ),
            (
                edited("\"10.0.0.5:7300\"", "\"10.0.0.5\""),
                ConfigError::BadSocketAddr {
                    key: "controller.listen".into(),
                    value: "10.0.0.5".into(),
                },
            ),
            (
                edited("\"10.0.0.5:7300\"", "\"0.0.0.0:7300\""),
                ConfigError::UnspecifiedListen {
                    addr: "0.0.0.0:7300".parse().unwrap(),
                },
            ),
            (
                plus("lease_ttl_s = 4"),
                ConfigError::OutOfRange {
                    key: "controller.lease_ttl_s".into(),
                    value: "4".into(),
                    accepted: "5 to 3600 seconds".into(),
                },
            ),
            (
                plus("lease_ttl_s = 3601"),
                ConfigError::OutOfRange {
                    key: "controller.lease_ttl_s".into(),
                    value: "3601".into(),
                    accepted: "5 to 3600 seconds".into(),
                },
            ),
            (
                plus("allocation_period_s = 0"),
                ConfigError::OutOfRange {
                    key: "controller.allocation_period_s".into(),
                    value: "0".into(),
                    accepted: "1 to 600 seconds".into(),
                },
            ),
            (
                plus("allocation_period_s = 40"),
                ConfigError::LeaseTooShort {
                    lease_ttl_s: 60,
                    allocation_period_s: 40,
                },
            ),
            (
                plus("key_file = \"\""),
                ConfigError::EmptyPath {
                    key: "controller.key_file".into(),
                },
            ),
            (
                plus("key_file = \"powerflex.key\""),
                ConfigError::NotAbsolutePath {
                    key: "controller.key_file".into(),
                    value: "powerflex.key".into(),
                },
            ),
            (
                plus("key_file = \"/etc/pf\\n.key\""),
                ConfigError::ControlCharacterInPath {
                    key: "controller.key_file".into(),
                    value: "/etc/pf\n.key".into(),
                },
            ),
            (
                plus("[agent]\nsocket = \"run/%n.sock\""),
                ConfigError::NotAbsolutePath {
                    key: "agent.socket".into(),
                    value: "run/%n.sock".into(),
                },
            ),
            (
                plus("[agent]\nsocket = \"/run/%h.sock\""),
                ConfigError::BadSocketPlaceholder {
                    value: "/run/%h.sock".into(),
                    placeholder: "h".into(),
                },
            ),
            (
                plus("[agent]\nsocket = \"/run/pf%\""),
                ConfigError::BadSocketPlaceholder {
                    value: "/run/pf%".into(),
                    placeholder: "".into(),
                },
            ),
            (
                plus("[agent]\nmetrics_listen = \"0.0.0.0:9464\""),
                ConfigError::MetricsNotLoopback {
                    addr: "0.0.0.0:9464".parse().unwrap(),
                },
            ),
            (
                plus("[agent]\nmetrics_listen = \"localhost:9464\""),
                ConfigError::BadSocketAddr {
                    key: "agent.metrics_listen".into(),
                    value: "localhost:9464".into(),
                },
            ),
            (
                plus("[agent]\nnvml_library = \"\""),
                ConfigError::EmptyPath {
                    key: "agent.nvml_library".into(),
                },
            ),
            (
                plus("[agent]\ncalibration_allowance_pct = 51"),
                ConfigError::OutOfRange {
                    key: "agent.calibration_allowance_pct".into(),
                    value: "51".into(),
                    accepted: "0 to 50 percent".into(),
                },
            ),
            (
                edited(
                    "gpu_budget_w = 120000",
                    "gpu_budget_w = 120000\nexpected_cut_pct = 95",
                ),
                ConfigError::OutOfRange {
                    key: "facility.expected_cut_pct".into(),
                    value: "95".into(),
                    accepted: "above 0 and below 95 percent".into(),
                },
            ),
            (
                plus("[agent]\ncalibration_allowance_pct = -1"),
                ConfigError::OutOfRange {
                    key: "agent.calibration_allowance_pct".into(),
                    value: "-1".into(),
                    accepted: "0 to 50 percent".into(),
                },
            ),
            (
                plus("[agent]\nnode_budget_w = 0"),
                ConfigError::OutOfRange {
                    key: "agent.node_budget_w".into(),
                    value: "0".into(),
                    accepted: "a number of watts above 0".into(),
                },
            ),
            (
                plus("[predictor]\npfi_intercept = nan"),
                ConfigError::NotFinite {
                    key: "predictor.pfi_intercept".into(),
                    value: f64::NAN,
                },
            ),
            (
                plus("[predictor]\npfi_per_dram_copy_product = inf"),
                ConfigError::NotFinite {
                    key: "predictor.pfi_per_dram_copy_product".into(),
                    value: f64::INFINITY,
                },
            ),
        ];
        for (text, expected) in cases {
            let got = SiteConfig::from_toml_str(&text);
            // NaN != NaN, so compare NaN-carrying variants by their message.
            match (&got, &expected) {
                (Err(e), ConfigError::NotFinite { value, .. }) if value.is_nan() => {
                    assert_eq!(e.to_string(), expected.to_string(), "config:\n{text}");
                    assert!(matches!(e, ConfigError::NotFinite { .. }));
                }
                _ => assert_eq!(got, Err(expected), "config:\n{text}"),
            }
        }
    }

    #[test]
    fn exact_validation_messages() {
        let message = |text: &str| SiteConfig::from_toml_str(text).unwrap_err().to_string();
        assert_eq!(
            message(&edited("min_cap_w = 200", "min_cap_w = 800")),
            "gpu_models.H200: min_cap_w (800) must be below max_cap_w (700)"
        );
        assert_eq!(
            message(&edited(
                "gpu_budget_w = 120000",
                "gpu_budget_w = 1\npolicy = \"greedy\""
            )),
            "unknown facility.policy \"greedy\"; accepted: optimal, equal, pfi-proportional"
        );
        assert_eq!(
            message(&plus("[agent]\nmetrics_listen = \"10.1.2.3:9464\"")),
            "agent.metrics_listen (10.1.2.3:9464) must be a loopback address, e.g. \
             127.0.0.1:9464 or [::1]:9464: metrics are served without authentication"
        );
        assert_eq!(
            message(
                &edited("[gpu_models.H200]", "[gpu_models.\"H200 NVL\"]")
                    .replace("failsafe_cap_w = 500", "failsafe_cap_w = 900")
            ),
            "gpu_models.\"H200 NVL\": failsafe_cap_w (900) must be within min_cap_w..max_cap_w \
             (200 to 700)"
        );
        assert_eq!(
            message(&plus("[tiers]\ndefault = \"gold\"")),
            "tiers.default \"gold\" is not offered; accepted: flex0, flex1, flex2, flex3, none"
        );
        for text in [
            edited("min_cap_w = 200", "min_cap_w = 800"),
            plus("lease_ttl_s = 4"),
            plus("[tiers]\ndefault = \"gold\""),
        ] {
            let m = message(&text);
            assert!(
                !m.ends_with('.') && !m.starts_with(char::is_uppercase),
                "{m}"
            );
        }
    }

    #[test]
    fn unknown_keys_are_parse_errors_at_every_level() {
        let cases = [
            plus("unknown_top = 1"),
            // Appending to MINIMAL lands in [controller].
            plus("budget_kw = 1"),
            edited(
                "gpu_budget_w = 120000",
                "gpu_budget_w = 120000\nbudget_kw = 1",
            ),
            plus("[tiers]\nallow_maxslowdown = true"),
            plus("[[tiers.tier]]\nname = \"a\"\nmax_slowdown_pct = 5\nmax_slowdown = 0.05"),
            edited("failsafe_cap_w = 500", "failsafe_cap_w = 500\ntdp_w = 700"),
            plus("[agent]\nsockets = \"/run/x\""),
            plus("[predictor]\npfi_slope = 1"),
            plus("[extra]\nx = 1"),
        ];
        for text in cases {
            let message = parse_error(&text);
            assert!(message.contains("unknown field"), "{message}");
            assert!(message.contains("line"), "{message}");
        }
    }

    #[test]
    fn wrong_types_and_missing_keys_are_parse_errors() {
        let cases = [
            edited("gpu_budget_w = 120000", "gpu_budget_w = \"120kW\""),
            plus("lease_ttl_s = 60.5"),
            plus("lease_ttl_s = -60"),
            plus("lease_ttl_s = \"60\""),
            edited("[700, 600, 500, 400]", "\"700,600\""),
            edited("[700, 600, 500, 400]", "[700, \"600\"]"),
            plus("[tiers]\nallow_max_slowdown = \"yes\""),
            plus("[agent]\nmetrics_listen = 9464"),
            plus("[agent]\nnode_budget_w = \"5kW\""),
            "not toml at all [".to_string(),
            String::new(),
        ];
        for text in cases {
            parse_error(&text);
        }
        let missing = [
            (edited("gpu_budget_w = 120000", ""), "gpu_budget_w"),
            (edited("min_cap_w = 200", ""), "min_cap_w"),
            (edited("max_cap_w = 700", ""), "max_cap_w"),
            (edited("cap_step_w = 10", ""), "cap_step_w"),
            (edited("failsafe_cap_w = 500", ""), "failsafe_cap_w"),
            (edited("listen = \"10.0.0.5:7300\"", ""), "listen"),
            (plus("[[tiers.tier]]\nname = \"a\""), "max_slowdown_pct"),
            (edited("[facility]\ngpu_budget_w = 120000", ""), "facility"),
            (
                edited("[controller]\nlisten = \"10.0.0.5:7300\"", ""),
                "controller",
            ),
        ];
        for (text, field) in missing {
            let message = parse_error(&text);
            assert!(
                message.contains("missing field") && message.contains(field),
                "{field}: {message}"
            );
        }
    }

    /// Without `calibration_caps_w` the design chooses among every cap step; with it,
    /// the site's caps are the candidates (existing configs keep their grid).
    #[test]
    fn the_calibration_grid_is_the_sites_list_or_every_cap_step() {
        let listed = SiteConfig::from_toml_str(MINIMAL).expect("minimal");
        assert_eq!(
            listed.gpu_models[0].calibration_grid(),
            [700.0, 600.0, 500.0, 400.0].map(Watts).to_vec()
        );
        let text = MINIMAL.replace("calibration_caps_w = [700, 600, 500, 400]", "");
        let stepped = SiteConfig::from_toml_str(&text).expect("no list");
        let grid = stepped.gpu_models[0].calibration_grid();
        assert_eq!(grid.len(), 51, "700 W down to 200 W in 10 W steps");
        assert_eq!((grid[0], grid[50]), (Watts(700.0), Watts(200.0)));
    }

    #[test]
    fn arbitrary_text_never_panics() {
        use proptest::prelude::*;
        proptest!(|(text in any::<String>())| {
            let _ = SiteConfig::from_toml_str(&text);
        });
        proptest!(|(value in any::<f64>(), key in prop_oneof![
            Just("gpu_budget_w = 120000"),
            Just("min_cap_w = 200"),
            Just("max_cap_w = 700"),
            Just("cap_step_w = 10"),
            Just("failsafe_cap_w = 500"),
        ])| {
            let name = key.split(' ').next().unwrap_or_default();
            let text = edited(key, &format!("{name} = {value:?}"));
            let _ = SiteConfig::from_toml_str(&text);
        });
    }
}
