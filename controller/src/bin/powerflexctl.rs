//! `powerflexctl`: powerflex's admin CLI.
//!
//! Exit codes ([`Exit`]): 0 success; 1 the input was read but rejected (malformed file,
//! refused by the controller), or an I/O error; 2 the command line itself is wrong: every
//! value given on it is parsed by clap (`value_parser`), so a bad value is a usage error.

use powerflex_daemon::clock::unix_ms;
use powerflex_daemon::program::{Exit, Program};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use powerflex_controller::offline;
use powerflex_controller::render;
use powerflex_controller::{read_text, CtlError};
use powerflex_controller_machine::schedule::{
    parse_duration_ms, parse_event_duration_ms, parse_reduce, parse_start, Start,
};
use powerflex_core::allocate::Policy;
use powerflex_core::config::SiteConfig;
use powerflex_core::curves_csv::parse_curves;
use powerflex_core::evaluate::{evaluate, EvaluateParams};
use powerflex_core::Watts;
use powerflex_proto::admin::{AdminAnswer, AdminOp, AdminReply};
use powerflex_proto::event::Cut;
use powerflex_proto::status::CtldStatus;

/// Largest input file accepted, bytes.
const MAX_INPUT_BYTES: u64 = 256 * 1024 * 1024;

#[derive(Debug, Parser)]
#[command(
    name = "powerflexctl",
    version,
    about = "powerflex admin CLI: the controller's status, budget and grid events; per-job PFI, budget allocation and offline policy evaluation",
    long_about = None,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Write powerflexctl's man pages (one per subcommand, section 1) into DIR and exit.
    #[arg(long, hide = true, exclusive = true, value_name = "DIR")]
    write_man_pages: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    /// Aligned human-readable table.
    Table,
    /// One JSON document, for scripts.
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RecordFormat {
    /// Aligned human-readable table with totals.
    Table,
    /// One JSON array of records (the accounting log's format).
    Json,
    /// One row per job, SI units.
    Csv,
}

/// `now`, `-DURATION` (that long ago) or an RFC 3339 time, as Unix ms.
fn parse_when(text: &str) -> Result<u64, String> {
    let t = text.trim();
    if let Some(ago) = t.strip_prefix('-') {
        let ms = parse_duration_ms(ago).map_err(|e| e.to_string())?;
        return Ok(unix_ms().saturating_sub(ms));
    }
    parse_start(t)
        .map(|s| s.resolve(unix_ms()))
        .map_err(|e| format!("{e}; accepted: now, -DURATION (-7d) or an RFC 3339 time"))
}

/// A user name or uid as a uid (names through the system's user database, `id -u`).
fn uid_of(user: &str) -> Result<u32, CtlError> {
    if let Ok(uid) = user.parse::<u32>() {
        return Ok(uid);
    }
    let bad = || CtlError::Usage(format!("no user {user:?}; give a user name or a uid"));
    if user.is_empty() || user.starts_with('-') {
        return Err(bad());
    }
    let out = std::process::Command::new("id")
        .arg("-u")
        .arg(user)
        .output()
        .map_err(|_| bad())?;
    if !out.status.success() {
        return Err(bad());
    }
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|_| bad())
}

fn records(
    args: &CtldArgs,
    op: AdminOp,
) -> Result<Vec<powerflex_proto::usage::JobEnergyRecord>, CtlError> {
    match admin(args, op)? {
        AdminAnswer::Records(records) => Ok(records),
        _ => Err(missing("records")),
    }
}

/// What `reference` prints.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum ReferenceTopic {
    /// Every key of the site config (powerflex.toml), from the config types.
    Config,
    /// Every metric both daemons export, from their catalog (Markdown only).
    Metrics,
}

/// How `reference` prints it.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum ReferenceFormat {
    /// Markdown (docs/reference/config.md).
    Markdown,
    /// A man page in roff (powerflex.toml(5)).
    Man,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print a reference generated from the code itself: `config` is every key of the
    /// site config with its type, unit, whether it is required and what it does, as
    /// Markdown or as the man page powerflex.toml(5); `metrics` is every metric the
    /// daemons export, as Markdown.
    Reference {
        #[arg(value_enum)]
        topic: ReferenceTopic,
        #[arg(long, value_enum, default_value = "markdown")]
        format: ReferenceFormat,
    },
    /// PFI (arXiv 2609.11542 Eq. 1) of every job in a curves file.
    Pfi {
        /// Curves CSV: job,cap_w,power_w,throughput, then optionally gpus,tier,dram_copy_product;
        /// cap_w per GPU in W, power_w the job's summed GPU power in W.
        #[arg(long, value_name = "FILE")]
        curves: String,
        /// Output: a table for people, JSON for scripts.
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
    /// Split a GPU power budget across the jobs of a curves file the way the controller
    /// would (the same estimator, cautious rule and budget accounting, on the file's
    /// points as measured curves): cap, power, throughput, slowdown and tier per job, and
    /// totals. Jobs whose tier is `none` stay uncapped and their power comes off the
    /// budget first.
    Allocate {
        /// Curves CSV (see `pfi --help`); the optional `tier` column takes any
        /// --power-flex value (flex2, max-slowdown=15%, none).
        #[arg(long, value_name = "FILE")]
        curves: String,
        /// Budget for the summed GPU power of these jobs: watts, or with a unit
        /// (850kW, 1.2MW).
        #[arg(long, value_name = "W", value_parser = watts_flag)]
        budget_w: Watts,
        /// Allocation policy [default: the site's, else optimal].
        #[arg(long, value_parser = ["optimal", "equal", "pfi-proportional"])]
        policy: Option<String>,
        /// Site config (powerflex.toml): its tiers, default tier, cap limits and
        /// policy. Without it: the default tiers (flex0 0 %, flex1 10 %, flex2 25 %,
        /// flex3 50 %), untiered jobs unmanaged, each job's measured caps in 1 W steps.
        #[arg(long, value_name = "FILE")]
        site: Option<String>,
        /// Which [gpu_models.NAME] of the site config limits the caps, when it has several.
        #[arg(long, value_name = "NAME", requires = "site")]
        gpu_model: Option<String>,
        /// One standard error of each point's power and throughput, as a fraction of the
        /// value (0.01 = 1 %, the controller's assumption for one measurement window), for
        /// points the file gives no power_sigma_w/throughput_sigma columns for. The plan is
        /// the controller's: it leans to the equal split as far as this uncertainty says.
        #[arg(long, default_value_t = 0.01, value_name = "F", value_parser = noise_fraction)]
        noise: f64,
        /// Output: a table for people, JSON for scripts.
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
    /// The paper's §6 experiment on your curves: equal, pfi_proportional,
    /// optimal_calibrated and oracle, scored on the true curves at the caps they chose.
    Evaluate(EvaluateArgs),
    /// Writes node NAME's own link key, derived from the site key (`controller.key_file`),
    /// to FILE (root-owned, mode 0600). Run it on the controller's host, as root, once per
    /// node; copy FILE to the node as its `agent.key_file`. The node can use it for
    /// itself only.
    LinkKey {
        /// Site config naming the site key.
        #[arg(long, default_value = "/etc/slurm/powerflex.toml", value_name = "FILE")]
        site: String,
        /// The node's Slurm name.
        #[arg(long, value_name = "NAME", value_parser = node_name)]
        node: String,
        /// Where to write the node's key.
        #[arg(long, value_name = "FILE")]
        out: String,
    },
    /// The controller's state: budget, draw, headroom, active event, nodes, jobs.
    Status {
        #[command(flatten)]
        ctld: CtldArgs,
        /// Output: a table for people, JSON for scripts.
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
    /// Jobs across the site: tier, nodes, GPUs, PFI, cap, throughput now vs uncapped, bound.
    Jobs {
        #[command(flatten)]
        ctld: CtldArgs,
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
    /// Power domains as a tree (`[[domains]]`): each one's limit, budget in force, draw,
    /// headroom, what the last allocation planned through it, its event and whether it
    /// binds.
    Domains {
        #[command(flatten)]
        ctld: CtldArgs,
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
    /// Nodes: GPUs, live or silent, draw, jobs (and leaf domain, where the site has them).
    Nodes {
        #[command(flatten)]
        ctld: CtldArgs,
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
    /// One job's measured curve (per node) and PFI.
    Report {
        /// Slurm job id.
        #[arg(long)]
        job: String,
        #[command(flatten)]
        ctld: CtldArgs,
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
    /// What a policy would decide now, on the controller's own curves and views:
    /// per-job cap, expected power, throughput and slowdown, and the totals. Read-only;
    /// nothing is applied. `whatif --budget 9kW` is what the site's own policy would do
    /// at 9 kW; `whatif --policy equal` is the tier-aware equal split; `whatif --policy
    /// equal --ignore-tiers` is the paper's equal-weight baseline.
    Whatif {
        /// optimal, equal or pfi-proportional [default: the site's own,
        /// `controller.policy`].
        #[arg(long, value_parser = policy_names())]
        policy: Option<powerflex_core::allocate::Policy>,
        /// Budget to split, e.g. 11kW [default: the budget in force, events included].
        #[arg(long, value_parser = power)]
        budget: Option<Watts>,
        /// Leave the tiers' slowdown bounds out, as the paper's baselines do: every job
        /// is cut by the policy's rule alone, whatever its tier (the floors shown then
        /// say nothing of the tiers).
        #[arg(long)]
        ignore_tiers: bool,
        #[command(flatten)]
        ctld: CtldArgs,
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
    /// Ended jobs' energy records, like `sreport`: energy, average power, time capped,
    /// slowdown and bound per job, and totals per tier; or, with --plot, an SVG of the
    /// energy per tier and the energy saved (ESTIMATE). A user sees their own jobs only.
    Accounting(AccountingArgs),
    /// Change the facility budget (root): `budget set 850kW`.
    Budget {
        #[command(subcommand)]
        action: BudgetAction,
    },
    /// Forget a node the controller knows (decommissioned or renamed): it stops counting
    /// in the budget as a silent node. Refused while the node reports. Root only.
    ForgetNode {
        /// The node's Slurm name, as `powerflexctl status` lists it.
        node: String,
        #[command(flatten)]
        ctld: CtldArgs,
    },
    /// Scheduled and running grid events (same as `event list`).
    Events {
        #[command(flatten)]
        ctld: CtldArgs,
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
    /// Draw budget vs draw over time and each job's cap as an SVG (from the controller's
    /// in-memory history: one sample per allocation period, the last 8,640, thinned evenly to at most 2,000 per request).
    Plot {
        /// Where to write the picture; must end in .svg.
        #[arg(long, value_name = "FILE.svg", value_parser = svg_path)]
        out: String,
        /// Title printed at the top.
        #[arg(
            long,
            default_value = "powerflex: facility budget, GPU draw and per-job caps"
        )]
        title: String,
        #[command(flatten)]
        ctld: CtldArgs,
    },
    /// Grid events (adding and cancelling needs root).
    Event {
        #[command(subcommand)]
        action: EventAction,
    },
    /// Write SIMULATED curves for the jobs of the paper's PFI table (for trying the other
    /// commands without measurements). Output is a curves CSV on stdout.
    SynthCurves {
        /// The paper's table, e.g. shared/data/paper_pfi_h200.csv.
        #[arg(long, value_name = "FILE")]
        paper: String,
        /// Multiplicative measurement noise on each point (0.005 = 0.5 %); 0 reproduces
        /// the paper's PFIs exactly.
        #[arg(long, default_value_t = 0.0, value_name = "F", value_parser = noise_fraction)]
        noise: f64,
        /// Seed of the noise.
        #[arg(long, default_value_t = 1, value_name = "N")]
        seed: u64,
    },
}

// `evaluate`'s arguments. A plain comment: a doc comment here would be clap's text for
// the subcommand, which is the one on `Command::Evaluate`.
#[derive(Debug, clap::Args)]
struct EvaluateArgs {
    /// Curves CSV (see `pfi --help`); each job's points are its true curve.
    #[arg(long, value_name = "FILE")]
    curves: String,
    /// Share of Σ P_max to shed: 30% or 0.3 (the same cut).
    #[arg(long, value_name = "SHARE", value_parser = open_fraction)]
    cut: f64,
    /// Jobs per workload, drawn with replacement from the file.
    #[arg(long, default_value_t = 100, value_name = "N", value_parser = at_least_one)]
    jobs_per_workload: usize,
    /// Number of random workloads.
    #[arg(long, default_value_t = 500, value_name = "N", value_parser = at_least_one)]
    workloads: usize,
    /// Seed of the random draws (same seed, same numbers, on any machine).
    #[arg(long, default_value_t = 1, value_name = "N")]
    seed: u64,
    /// Fixed calibration caps as fractions of each job's maximum cap, one window each
    /// (each maps to the nearest measured cap); without it the designed calibration
    /// runs (see --calibration-budget, --expected-cut).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "F,F,...",
        value_parser = grid_fraction
    )]
    calibration_grid: Option<Vec<f64>>,
    /// One standard deviation of multiplicative noise on one measurement window's
    /// reading of power and of throughput (0.01 = 1 %).
    #[arg(long, default_value_t = 0.01, value_name = "F", value_parser = noise_fraction)]
    noise: f64,
    /// Score raw throughput (tokens/s) instead of per-job normalised T/T_max.
    #[arg(long)]
    raw: bool,
    /// Cap granularity, W per GPU (default: the spacing of each job's measured caps,
    /// so only measured caps are chosen).
    #[arg(long, value_name = "W", value_parser = positive_w)]
    cap_step_w: Option<f64>,
    /// Most tokens the designed calibration may cost a job, fraction of its
    /// first-hour tokens.
    #[arg(long, default_value_t = 0.02, value_name = "F", value_parser = budget_fraction)]
    calibration_budget: f64,
    /// The deepest cut the site expects, 30% or 0.3; sets how deep the designed
    /// calibration walks [default: the site config's facility.expected_cut_pct, else 30%].
    #[arg(long, value_name = "SHARE", value_parser = open_fraction)]
    expected_cut: Option<f64>,
    /// Site config (powerflex.toml) to take the expected cut from.
    #[arg(long, value_name = "FILE")]
    site: Option<String>,
    /// Length of one calibration measurement window, s (--noise is per window).
    #[arg(long, default_value_t = 30.0, value_name = "S", value_parser = positive_s)]
    window_s: f64,
    /// Standard deviations by which the optimal caps' expected gain must beat its
    /// uncertainty before the allocator leaves the equal split.
    #[arg(long, default_value_t = 1.0, value_name = "Z", value_parser = z_score)]
    gain_z: f64,
    /// Standard deviations of the summed-power error kept below the budget.
    #[arg(long, default_value_t = 1.0, value_name = "Z", value_parser = z_score)]
    power_z: f64,
    /// Multi-event mode: run this many grid events after calibration, learning from
    /// each event's steady stretches and small cap probes; reports gap recovered per
    /// event.
    #[arg(long, default_value_t = 0, value_name = "N")]
    events: usize,
    /// How long each event holds its caps, s.
    #[arg(long, default_value_t = 3600.0, value_name = "S", value_parser = positive_s)]
    event_hold_s: f64,
    /// Suppress the progress line on stderr.
    #[arg(long, short)]
    quiet: bool,
    /// Output: a table for people, JSON for scripts.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
}

// `accounting`'s arguments (a plain comment, as on `EvaluateArgs`).
#[derive(Debug, clap::Args)]
struct AccountingArgs {
    /// Jobs that ended after this: an RFC 3339 time (2026-12-01T00:00:00Z), `now`, or
    /// -DURATION ago (-7d) [default: every record the controller keeps]. `--since -7d`
    /// and `--since=-7d` both work.
    #[arg(long, value_parser = parse_when, allow_hyphen_values = true)]
    since: Option<u64>,
    /// Jobs that ended at or before this (same forms) [default: now].
    #[arg(long, value_parser = parse_when, allow_hyphen_values = true)]
    until: Option<u64>,
    /// Only this user's jobs (a name or a uid; root only, a user sees their own).
    #[arg(long)]
    user: Option<String>,
    /// Only jobs of this tier, in `--power-flex` form (flex2, none, …).
    #[arg(long)]
    tier: Option<String>,
    /// Only jobs charged to this Slurm account (as Slurm recorded the job).
    #[arg(long)]
    account: Option<String>,
    /// Instead of the listing, draw these records as an SVG: GPU energy used per tier,
    /// and the energy saved against running uncapped (an ESTIMATE from each job's
    /// measured curve) split by whether the jobs ran in grid events. Must end in .svg.
    #[arg(long, value_name = "FILE.svg", value_parser = svg_path, conflicts_with = "format")]
    plot: Option<String>,
    /// The plot's title.
    #[arg(long, requires = "plot")]
    title: Option<String>,
    #[command(flatten)]
    ctld: CtldArgs,
    #[arg(long, value_enum, default_value = "table")]
    format: RecordFormat,
}

/// How to reach powerflex-ctld.
#[derive(Debug, Clone, clap::Args)]
struct CtldArgs {
    /// Site config, for the controller's admin socket.
    #[arg(long, default_value = "/etc/slurm/powerflex.toml", value_name = "FILE")]
    site: String,
    /// The admin socket itself (overrides --site).
    #[arg(long, value_name = "PATH")]
    socket: Option<String>,
}

#[derive(Debug, Subcommand)]
enum BudgetAction {
    /// Set the budget: watts, or with a unit (850kW, 1.2MW).
    Set {
        #[arg(value_parser = power)]
        budget: Watts,
        /// Set this power domain's budget (in place of its limit in the site config)
        /// instead of the site's; `powerflexctl domains` lists them.
        #[arg(long, value_name = "NAME")]
        domain: Option<String>,
        #[command(flatten)]
        ctld: CtldArgs,
    },
}

/// What an event's `--reduce` is a share of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ShareOf {
    /// The metered draw when the event is added: what an operator asked to shed 30 % means.
    Draw,
    /// The base budget (`facility.gpu_budget_w` or the last `budget set`; a domain's limit).
    Base,
}

#[derive(Debug, Subcommand)]
enum EventAction {
    /// Schedule a grid event: --reduce 30% or --target 600kW, from --start for --duration.
    Add {
        /// Cut this share (30% or 0.3) of what `--of` names: by default the draw now.
        #[arg(
            long,
            value_name = "SHARE",
            conflicts_with = "target",
            required_unless_present = "target",
            value_parser = parse_reduce
        )]
        reduce: Option<f64>,
        /// What `--reduce` is a share of: `draw`, the metered draw when the event is added
        /// (the site's, or the domain's), sent as the target it makes; or `base`, the base
        /// budget (the domain's limit), as a utility's simple level is.
        #[arg(long, value_enum, default_value = "draw", conflicts_with = "target")]
        of: ShareOf,
        /// Bring the budget to this power, e.g. 600kW.
        #[arg(long, value_parser = power)]
        target: Option<Watts>,
        /// now, +DURATION (+10m) or an RFC 3339 time with an offset (2026-12-01T17:00:00Z).
        #[arg(long, default_value = "now", value_parser = parse_start)]
        start: Start,
        /// How long the event lasts: 90s, 5m, 3h, 1h30m, 1d (more than 0).
        #[arg(long, value_name = "DURATION", value_parser = parse_event_duration_ms)]
        duration: u64,
        /// Time over which caps step down after the start and back up before the end.
        #[arg(long, default_value = "0s", value_name = "DURATION", value_parser = parse_duration_ms)]
        ramp: u64,
        /// Cut this power domain's budget (a feed, a rack: `powerflexctl domains` lists
        /// them) instead of the site's; only the nodes behind it are touched.
        #[arg(long, value_name = "NAME")]
        domain: Option<String>,
        #[command(flatten)]
        ctld: CtldArgs,
    },
    /// List scheduled and running events.
    List {
        #[command(flatten)]
        ctld: CtldArgs,
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
    /// Cancel an event by id.
    Cancel {
        id: u64,
        #[command(flatten)]
        ctld: CtldArgs,
    },
}

/// A node name as the link accepts it.
fn node_name(text: &str) -> Result<String, String> {
    if powerflex_proto::link::valid_node_name(text) {
        Ok(text.to_string())
    } else {
        Err(format!(
            "\"{}\" is not a node name; accepted: 1-{} ASCII letters, digits, '.', '_' or '-', not \"{}\"",
            text.escape_default(),
            powerflex_proto::link::MAX_NODE_NAME_BYTES,
            powerflex_proto::link::CONTROLLER
        ))
    }
}

/// A power on the command line: `850kW`, `1.2MW`, `700W` or bare watts.
/// `--policy` as the admin protocol's type, with the accepted names in `--help`.
fn policy_names() -> impl clap::builder::TypedValueParser<Value = powerflex_core::allocate::Policy>
{
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(powerflex_core::allocate::Policy::NAMES).try_map(
        |name: String| {
            powerflex_core::allocate::Policy::from_name(&name)
                .ok_or_else(|| format!("unknown policy {name:?}"))
        },
    )
}

fn power(text: &str) -> Result<Watts, String> {
    Watts::parse(text).map_err(|e| e.to_string())
}

/// A flag whose name says watts (`--budget-w`): a bare number is watts there, and a
/// unit is taken too.
fn watts_flag(text: &str) -> Result<Watts, String> {
    let trimmed = text.trim();
    match trimmed.parse::<f64>() {
        Ok(w) if w.is_finite() && w >= 0.0 => Ok(Watts(w)),
        _ => power(trimmed),
    }
}

/// A number, or a message naming the flag's accepted range.
fn number(text: &str, accepted: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err(format!(
            "\"{}\" is not a number; accepted: {accepted}",
            text.escape_default()
        )),
    }
}

fn in_range(text: &str, accepted: &str, ok: impl Fn(f64) -> bool) -> Result<f64, String> {
    let v = number(text, accepted)?;
    if ok(v) {
        Ok(v)
    } else {
        Err(format!("{v} is out of range; accepted: {accepted}"))
    }
}

/// `--cut`: a share of the power strictly between 0 and 1, as a percentage (`30%`) or a
/// fraction (`0.3`), as every command reads a share.
fn open_fraction(text: &str) -> Result<f64, String> {
    let accepted =
        "a share strictly between 0 and 100 %, as a percentage (e.g. 30%) or a fraction (e.g. 0.3)";
    match powerflex_core::units::parse_share(text) {
        Ok(v) if v > 0.0 && v < 1.0 => Ok(v),
        Ok(v) => Err(format!("{v} is out of range; accepted: {accepted}")),
        Err(e) => Err(e.to_string()),
    }
}

/// One `--calibration-grid` entry: a fraction of the maximum cap.
fn grid_fraction(text: &str) -> Result<f64, String> {
    in_range(text, "fractions in (0, 1], e.g. 1.0,0.8,0.6,0.4", |v| {
        v > 0.0 && v <= 1.0
    })
}

/// `--noise`: one standard deviation of multiplicative noise.
fn noise_fraction(text: &str) -> Result<f64, String> {
    in_range(text, "a fraction in [0, 0.5), e.g. 0.01", |v| {
        (0.0..0.5).contains(&v)
    })
}

/// `--cap-step-w`: watts per GPU above 0.
fn positive_w(text: &str) -> Result<f64, String> {
    in_range(text, "a positive number of watts, e.g. 1 or 5", |v| v > 0.0)
}

/// `--calibration-budget`: a fraction of first-hour tokens.
fn budget_fraction(text: &str) -> Result<f64, String> {
    let accepted =
        "a share above 0 and at most 50 %, as a percentage (e.g. 2%) or a fraction (e.g. 0.02)";
    match powerflex_core::units::parse_share(text) {
        Ok(v) if v > 0.0 && v <= 0.5 => Ok(v),
        Ok(v) => Err(format!("{v} is out of range; accepted: {accepted}")),
        Err(e) => Err(e.to_string()),
    }
}

/// `--window-s`, `--event-hold-s`: seconds above 0.
fn positive_s(text: &str) -> Result<f64, String> {
    in_range(text, "a positive number of seconds, e.g. 30", |v| v > 0.0)
}

/// `--power-z`, `--gain-z`: standard deviations, 0 or more.
fn z_score(text: &str) -> Result<f64, String> {
    in_range(
        text,
        "a non-negative number of standard deviations, e.g. 1",
        |v| v >= 0.0,
    )
}

/// A count of at least one.
fn at_least_one(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "\"{}\" is not a whole number of at least 1",
            text.escape_default()
        )),
    }
}

/// `accounting --plot`: the records as an SVG at `out`, and a line saying what it shows.
fn plot_energy(
    records: &[powerflex_proto::usage::JobEnergyRecord],
    out: &str,
    title: Option<&str>,
) -> Result<String, CtlError> {
    use powerflex_controller::energy_plot;
    use powerflex_proto::usage::human_energy;
    let svg = energy_plot::render_energy_svg(
        records,
        title.unwrap_or("powerflex: GPU energy per tier and energy saved (ESTIMATE)"),
    )?;
    std::fs::write(out, svg).map_err(|source| CtlError::Write {
        path: out.to_string(),
        source,
    })?;
    let tiers = energy_plot::by_tier(records);
    Ok(format!(
        "wrote {out}: {} jobs in {} tiers, {} used, about {} saved (ESTIMATE){}\n",
        records.len(),
        tiers.len(),
        human_energy(tiers.iter().map(|t| t.energy_j).sum()),
        human_energy(tiers.iter().map(|t| t.saved_j()).sum()),
        if records.iter().any(|r| r.simulated) {
            " [SIMULATED GPUs]"
        } else {
            ""
        }
    ))
}

/// `plot --out`, `accounting --plot`: only SVG is written.
fn svg_path(text: &str) -> Result<String, String> {
    let extension = std::path::Path::new(text)
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    if extension.as_deref() == Some("svg") {
        Ok(text.to_string())
    } else {
        Err(format!(
            "\"{}\" does not end in .svg; only SVG is written (open it in a browser or convert it with rsvg-convert)",
            text.escape_default()
        ))
    }
}

fn admin_socket(args: &CtldArgs) -> Result<std::path::PathBuf, CtlError> {
    if let Some(s) = &args.socket {
        return Ok(std::path::PathBuf::from(s));
    }
    let text = read_text(&args.site, MAX_INPUT_BYTES)?;
    let site = SiteConfig::from_toml_str(&text).map_err(|e| CtlError::Input {
        path: args.site.clone(),
        source: e.into(),
    })?;
    Ok(site.controller.admin_socket)
}

/// What the controller answered `op` with; its refusal's message as the error.
fn admin(args: &CtldArgs, op: AdminOp) -> Result<AdminAnswer, CtlError> {
    match powerflex_admin_client::request(&admin_socket(args)?, &op)
        .map_err(|e| CtlError::Usage(e.to_string()))?
    {
        AdminReply::Done(answer) => Ok(answer),
        AdminReply::Refused { message, .. } => Err(CtlError::Usage(message)),
    }
}

/// The controller's status; an `ok` reply without one is a controller that does not
/// speak this CLI's protocol.
fn status(args: &CtldArgs) -> Result<CtldStatus, CtlError> {
    match admin(args, AdminOp::Status)? {
        AdminAnswer::Status(status) => Ok(*status),
        _ => Err(missing("status")),
    }
}

fn missing(what: &str) -> CtlError {
    CtlError::Usage(format!(
        "the controller's answer carries no {what}; is powerflex-ctld the same version as powerflexctl?"
    ))
}

fn list_events(args: &CtldArgs, format: Format) -> Result<String, CtlError> {
    let status = status(args)?;
    match format {
        Format::Json => json(&status.events),
        Format::Table => Ok(render::render_events(&status.events)),
    }
}

impl Program for Cli {
    const NAME: &'static str = "powerflexctl";
    const MAN_SECTION: &'static str = "1";

    fn write_man_pages(&self) -> Option<&std::path::Path> {
        self.write_man_pages.as_deref()
    }
}

fn main() -> ExitCode {
    let cli = match Cli::start() {
        Ok(cli) => cli,
        Err(done) => return done.into(),
    };
    Cli::finish(run(cli).map(|output| print!("{output}")), |_| Exit::Failure)
}

fn json<T: serde::Serialize>(value: &T) -> Result<String, CtlError> {
    serde_json::to_string_pretty(value)
        .map(|s| s + "\n")
        .map_err(|e| CtlError::Usage(format!("cannot encode JSON: {e}")))
}

fn load_curves(path: &str) -> Result<Vec<powerflex_core::curves_csv::JobCurveRecord>, CtlError> {
    let text = read_text(path, MAX_INPUT_BYTES)?;
    parse_curves(&text).map_err(|e| CtlError::Input {
        path: path.to_string(),
        source: e.into(),
    })
}

/// Runs the command line's subcommand: each has its function below.
fn run(cli: Cli) -> Result<String, CtlError> {
    let Some(command) = cli.command else {
        use clap::CommandFactory;
        // As clap answers a missing required subcommand: the usage, exit 2.
        Cli::command()
            .error(
                clap::error::ErrorKind::MissingSubcommand,
                "a subcommand is required (see --help)",
            )
            .exit();
    };
    match command {
        Command::Reference { topic, format } => reference(topic, format),
        Command::Pfi { curves, format } => pfi(&curves, format),
        Command::Allocate {
            curves,
            budget_w,
            policy,
            site,
            gpu_model,
            noise,
            format,
        } => allocate(
            &curves,
            budget_w,
            policy.as_deref(),
            site,
            gpu_model.as_deref(),
            noise,
            format,
        ),
        Command::Evaluate(args) => evaluate_curves(args),
        Command::Status { ctld: args, format } => show_status(&args, format),
        Command::Jobs { ctld: args, format } => jobs(&args, format),
        Command::Domains { ctld: args, format } => domains(&args, format),
        Command::Nodes { ctld: args, format } => nodes(&args, format),
        Command::Report {
            job,
            ctld: args,
            format,
        } => report(&job, &args, format),
        Command::Accounting(args) => accounting(args),
        Command::Whatif {
            policy,
            budget,
            ignore_tiers,
            ctld: args,
            format,
        } => whatif(policy, budget, ignore_tiers, &args, format),
        Command::Budget {
            action:
                BudgetAction::Set {
                    budget,
                    domain,
                    ctld: args,
                },
        } => budget_set(budget, domain, &args),
        Command::Event { action } => match action {
            EventAction::Add {
                reduce,
                of,
                target,
                start,
                duration,
                ramp,
                domain,
                ctld: args,
            } => event_add(
                reduce.map(|share| (share, of)),
                target,
                start,
                duration,
                ramp,
                domain,
                &args,
            ),
            EventAction::List { ctld: args, format } => list_events(&args, format),
            EventAction::Cancel { id, ctld: args } => event_cancel(id, &args),
        },
        Command::Events { ctld: args, format } => list_events(&args, format),
        Command::ForgetNode { node, ctld: args } => forget_node(&node, &args),
        Command::Plot {
            out,
            title,
            ctld: args,
        } => plot(&out, &title, &args),
        Command::LinkKey { site, node, out } => link_key(&site, &node, &out),
        Command::SynthCurves { paper, noise, seed } => synth_curves(paper, noise, seed),
    }
}

/// `reference`: a reference generated from the code itself.
fn reference(topic: ReferenceTopic, format: ReferenceFormat) -> Result<String, CtlError> {
    use powerflex_controller::reference;
    match (topic, format) {
        (ReferenceTopic::Config, ReferenceFormat::Markdown) => {
            Ok(reference::render_markdown(&reference::site_config_tables()))
        }
        (ReferenceTopic::Config, ReferenceFormat::Man) => Ok(reference::render_man(
            &reference::site_config_tables(),
            env!("CARGO_PKG_VERSION"),
        )),
        (ReferenceTopic::Metrics, ReferenceFormat::Markdown) => {
            Ok(reference::render_metrics_markdown())
        }
        (ReferenceTopic::Metrics, ReferenceFormat::Man) => Err(CtlError::Usage(
            "the metrics reference is Markdown only; accepted: reference metrics --format markdown"
                .into(),
        )),
    }
}

/// `pfi`: the PFI of every job in a curves file.
fn pfi(curves: &str, format: Format) -> Result<String, CtlError> {
    let rows = offline::pfi_rows(&load_curves(curves)?);
    match format {
        Format::Table => Ok(offline::render_pfi(&rows)),
        Format::Json => json(&rows),
    }
}

/// `allocate`: a budget split across a curves file's jobs, as the controller would.
fn allocate(
    curves: &str,
    budget_w: Watts,
    policy: Option<&str>,
    site: Option<String>,
    gpu_model: Option<&str>,
    noise: f64,
    format: Format,
) -> Result<String, CtlError> {
    let budget = budget_w;
    let policy = policy.and_then(Policy::from_name);
    let setup = match site {
        Some(path) => {
            let text = read_text(&path, MAX_INPUT_BYTES)?;
            let site = SiteConfig::from_toml_str(&text).map_err(|e| CtlError::Input {
                path: path.clone(),
                source: e.into(),
            })?;
            offline::AllocateSetup::from_site(&site, gpu_model, policy)?
        }
        None => offline::AllocateSetup::defaults(policy.unwrap_or(Policy::Optimal)),
    };
    let setup = offline::AllocateSetup { noise, ..setup };
    let report = offline::allocate_curves(&load_curves(curves)?, budget, &setup)?;
    if !report.floors_broken.is_empty() || report.over_budget_w > 0.0 {
        eprintln!(
            "powerflexctl: warning: the budget cannot hold every tier bound ({} job(s) over their bound, {:.0} W short at the lowest caps)",
            report.floors_broken.len(),
            report.over_budget_w
        );
    }
    match format {
        Format::Table => Ok(offline::render_allocate(&report)),
        Format::Json => json(&report),
    }
}

/// `evaluate`: the paper's §6 experiment on a curves file.
fn evaluate_curves(args: EvaluateArgs) -> Result<String, CtlError> {
    let EvaluateArgs {
        curves,
        cut,
        jobs_per_workload,
        workloads,
        seed,
        calibration_grid,
        noise,
        raw,
        cap_step_w,
        calibration_budget,
        expected_cut,
        window_s,
        gain_z,
        power_z,
        events,
        event_hold_s,
        site,
        quiet,
        format,
    } = args;
    let records = load_curves(&curves)?;
    let expected_cut = match (expected_cut, site) {
        (Some(cut), _) => cut,
        (None, Some(path)) => {
            let text = read_text(&path, MAX_INPUT_BYTES)?;
            SiteConfig::from_toml_str(&text)
                .map_err(|e| CtlError::Input {
                    path: path.clone(),
                    source: e.into(),
                })?
                .facility
                .expected_cut
        }
        (None, None) => powerflex_core::config::DEFAULT_EXPECTED_CUT_PCT / 100.0,
    };
    let params = EvaluateParams {
        cut,
        jobs_per_workload,
        workloads,
        seed,
        calibration_grid,
        design: powerflex_core::calibration_design::DesignParams {
            budget_fraction: calibration_budget,
            expected_cut,
            window_s,
            ..Default::default()
        },
        noise,
        raw,
        cap_step_w,
        caution: powerflex_core::allocate::Caution { power_z, gain_z },
        events,
        event_hold_s,
    };
    let started = std::time::Instant::now();
    let mut last_shown = std::time::Instant::now();
    let mut progress = |done: usize, total: usize| {
        if quiet {
            return;
        }
        if done == total || last_shown.elapsed().as_millis() >= 500 {
            last_shown = std::time::Instant::now();
            eprint!(
                "\revaluate: workload {done}/{total} ({:.1} s)",
                started.elapsed().as_secs_f64()
            );
            if done == total {
                eprintln!();
            }
        }
    };
    let report = evaluate(&records, &params, &mut progress).map_err(powerflex_core::Error::from)?;
    match format {
        Format::Table => Ok(offline::render_evaluate(&report)),
        Format::Json => json(&report),
    }
}

/// `status`: the controller's status.
fn show_status(args: &CtldArgs, format: Format) -> Result<String, CtlError> {
    let status = status(args)?;
    match format {
        Format::Table => Ok(render::render_status(&status)),
        Format::Json => json(&status),
    }
}

/// `jobs`: the jobs the caller may read.
fn jobs(args: &CtldArgs, format: Format) -> Result<String, CtlError> {
    let status = status(args)?;
    match format {
        Format::Table => Ok(match status.jobs_of_uid {
            Some(uid) => format!(
                "{}\n{}",
                render::only_yours(uid),
                render::render_jobs(&status.jobs)
            ),
            None => render::render_jobs(&status.jobs),
        }),
        Format::Json => json(&status.jobs),
    }
}

/// `domains`: the power domains.
fn domains(args: &CtldArgs, format: Format) -> Result<String, CtlError> {
    let status = status(args)?;
    match format {
        Format::Table => Ok(render::render_domains(&status.domains)),
        Format::Json => json(&status.domains),
    }
}

/// `nodes`: the nodes.
fn nodes(args: &CtldArgs, format: Format) -> Result<String, CtlError> {
    let status = status(args)?;
    match format {
        Format::Table => Ok(render::render_nodes(&status.nodes)),
        Format::Json => json(&status.nodes),
    }
}

/// `report`: one job, running (from the status) or ended (its energy record).
fn report(job: &str, args: &CtldArgs, format: Format) -> Result<String, CtlError> {
    let status = status(args)?;
    let filtered = status.jobs_of_uid;
    let running = status.jobs.into_iter().find(|j| j.job == job);
    if running.is_none() {
        // An ended job: its energy record.
        let ended = records(
            args,
            AdminOp::Accounting {
                since_ms: None,
                until_ms: None,
                uid: None,
                tier: None,
                job: Some(job.to_string()),
                account: None,
                after: None,
            },
        )?;
        if let Some(record) = ended.last() {
            return match format {
                Format::Json => json(record),
                Format::Table => Ok(render::render_job_record(record)),
            };
        }
    }
    let found = running
        .ok_or_else(|| {
            CtlError::Usage(match filtered {
                Some(uid) => format!(
                    "no job {job} of uid {uid} is known to the controller (a non-root user reads only their own jobs; root reads every job)"
                ),
                None => format!("no job {job} is known to the controller"),
            })
        })?;
    match format {
        Format::Json => json(&found),
        Format::Table => Ok(render::render_job_report(&found)),
    }
}

/// `accounting`: ended jobs' energy records, every page of them.
fn accounting(args: AccountingArgs) -> Result<String, CtlError> {
    let AccountingArgs {
        since,
        until,
        user,
        tier,
        account,
        plot,
        title,
        ctld: args,
        format,
    } = args;
    let uid = user.as_deref().map(uid_of).transpose()?;
    let mut all = Vec::new();
    let mut after: Option<powerflex_proto::admin::RecordCursor> = None;
    // Paged: each reply holds at most MAX_RECORDS_PER_REPLY in cursor order; the
    // next page starts after the last record got (exact: records ending in the
    // same millisecond are neither skipped nor repeated).
    loop {
        let page = records(
            &args,
            AdminOp::Accounting {
                since_ms: since,
                until_ms: until,
                uid,
                tier: tier.clone(),
                account: account.clone(),
                job: None,
                after: after.clone(),
            },
        )?;
        let full = page.len() >= powerflex_proto::admin::MAX_RECORDS_PER_REPLY;
        let next = page.last().map(powerflex_proto::admin::RecordCursor::of);
        all.extend(page);
        match next {
            // A cursor that does not advance would loop: stop.
            Some(c) if full && after.as_ref() != Some(&c) => after = Some(c),
            _ => break,
        }
    }
    if let Some(out) = plot {
        return plot_energy(&all, &out, title.as_deref());
    }
    match format {
        RecordFormat::Table => Ok(render::render_accounting(&all)),
        RecordFormat::Json => json(&all),
        RecordFormat::Csv => Ok(render::accounting_csv(&all)),
    }
}

/// `whatif`: what a policy would decide now, read-only.
fn whatif(
    policy: Option<Policy>,
    budget: Option<Watts>,
    ignore_tiers: bool,
    args: &CtldArgs,
    format: Format,
) -> Result<String, CtlError> {
    let budget_w = budget.map(|w| w.0);
    let op = AdminOp::WhatIf {
        policy,
        budget_w,
        ignore_tiers,
    };
    let AdminAnswer::WhatIf(decision) = admin(args, op)? else {
        return Err(missing("decision"));
    };
    match format {
        Format::Json => json(&decision),
        Format::Table => Ok(render::render_whatif(&decision)),
    }
}

/// `budget set`: the site's or a domain's budget.
fn budget_set(budget: Watts, domain: Option<String>, args: &CtldArgs) -> Result<String, CtlError> {
    let w = budget;
    admin(
        args,
        AdminOp::BudgetSet {
            budget_w: w.0,
            domain: domain.clone(),
        },
    )?;
    Ok(match domain {
        None => format!("budget set to {w}\n"),
        Some(d) => format!("budget of domain {d} set to {w}\n"),
    })
}

/// The metered draw `event add --reduce` takes its share of: the site's, or the named
/// domain's, as the controller's status has it now. Refused where that draw is not what
/// the share should be of: an event cuts it already (30 % of a cut draw is a deeper cut
/// than asked), or the event starts later (tonight's idle draw is no measure of
/// tomorrow's).
fn draw_now(domain: Option<&str>, start: Start, args: &CtldArgs) -> Result<Watts, CtlError> {
    if start != Start::Now {
        return Err(CtlError::Usage(
            "--reduce is a share of the draw now, and this event starts later: give --target, or --of base for a share of the base budget".into(),
        ));
    }
    let status = status(args)?;
    let (draw_w, cut_by) = match domain {
        None => (status.draw_w, status.active_event.map(|e| e.id)),
        Some(name) => {
            let d = status
                .domains
                .iter()
                .find(|d| d.name == name)
                .ok_or_else(|| {
                    CtlError::Usage(format!(
                        "the controller has no power domain \"{name}\" (`powerflexctl domains` lists them)"
                    ))
                })?;
            (d.draw_w, d.event.or(status.active_event.map(|e| e.id)))
        }
    };
    if let Some(id) = cut_by {
        return Err(CtlError::Usage(format!(
            "event {id} is in force, so the draw now is already cut: give --target, or --of base for a share of the base budget"
        )));
    }
    if !(draw_w.is_finite() && draw_w > 0.0) {
        return Err(CtlError::Usage(format!(
            "the controller reads no draw{} yet ({}): give --target, or --of base for a share of the base budget",
            domain.map_or(String::new(), |d| format!(" in domain {d}")),
            Watts(draw_w)
        )));
    }
    Ok(Watts(draw_w))
}

/// `event add`: schedules a grid event. A share of the draw becomes the target it makes
/// now (the controller's cuts of a share are of the base budget, which a utility's level
/// means), and the reply says so.
fn event_add(
    reduce: Option<(f64, ShareOf)>,
    target: Option<Watts>,
    start: Start,
    duration: u64,
    ramp: u64,
    domain: Option<String>,
    args: &CtldArgs,
) -> Result<String, CtlError> {
    let (cut, said) = match (reduce, target) {
        (Some((fraction, ShareOf::Base)), _) => (
            Cut::Reduce { fraction },
            format!("{} of the base budget", render::share_text(fraction)),
        ),
        (Some((fraction, ShareOf::Draw)), _) => {
            let draw = draw_now(domain.as_deref(), start, args)?;
            let budget_w = (draw.0 * (1.0 - fraction)).floor().max(0.0);
            (
                Cut::Target { budget_w },
                format!(
                    "{} below the draw now ({draw}): down to {}",
                    render::share_text(fraction),
                    Watts(budget_w)
                ),
            )
        }
        (None, Some(budget_w)) => (
            Cut::Target {
                budget_w: budget_w.0,
            },
            format!("down to {budget_w}"),
        ),
        (None, None) => return Err(CtlError::Usage("give --reduce or --target".into())),
    };
    let start_ms = start.resolve(unix_ms());
    let (duration_ms, ramp_ms) = (duration, ramp);
    let AdminAnswer::EventAdded(id) = admin(
        args,
        AdminOp::EventAdd {
            cut,
            start_ms,
            duration_ms,
            ramp_ms,
            domain: domain.clone(),
        },
    )?
    else {
        return Err(missing("event id"));
    };
    Ok(match domain {
        None => format!("event {id} scheduled: {said}\n"),
        Some(d) => format!("event {id} scheduled for domain {d}: {said}\n"),
    })
}

/// `event cancel`: cancels an event by id.
fn event_cancel(id: u64, args: &CtldArgs) -> Result<String, CtlError> {
    admin(args, AdminOp::EventCancel { id })?;
    Ok(format!("event {id} cancelled\n"))
}

/// `forget-node`: forgets a node the controller knows.
fn forget_node(node: &str, args: &CtldArgs) -> Result<String, CtlError> {
    admin(
        args,
        AdminOp::ForgetNode {
            node: node.to_string(),
        },
    )?;
    Ok(format!("node {node} forgotten\n"))
}

/// `plot`: the recent budget, draw and caps as an SVG.
fn plot(out: &str, title: &str, args: &CtldArgs) -> Result<String, CtlError> {
    let AdminAnswer::History(samples) = admin(
        args,
        AdminOp::History {
            since_ms: None,
            max_samples: None,
        },
    )?
    else {
        return Err(missing("history"));
    };
    let svg = powerflex_controller::plot::render_svg(&samples, title)
        .map_err(|e| CtlError::Usage(e.to_string()))?;
    std::fs::write(out, svg).map_err(|source| CtlError::Write {
        path: out.to_string(),
        source,
    })?;
    let jobs: std::collections::BTreeSet<&String> =
        samples.iter().flat_map(|s| s.caps.keys()).collect();
    Ok(format!(
        "wrote {out}: {} samples, {} jobs\n",
        samples.len(),
        jobs.len()
    ))
}

/// `link-key`: writes a node's link key.
fn link_key(site: &str, node: &str, out: &str) -> Result<String, CtlError> {
    let text = read_text(site, MAX_INPUT_BYTES)?;
    let config = SiteConfig::from_toml_str(&text).map_err(|e| CtlError::Input {
        path: site.to_string(),
        source: e.into(),
    })?;
    let site_key = powerflex_daemon::fsx::read_site_key(&config.controller.key_file)
        .map_err(|e| CtlError::Usage(e.to_string()))?;
    let mut key = powerflex_proto::link::node_key(&site_key, node)
        .map_err(|e| CtlError::Usage(e.to_string()))?;
    key.push(b'\n');
    powerflex_daemon::fsx::write_atomic(
        std::path::Path::new(out),
        &key,
        powerflex_daemon::fsx::AtomicWrite::durable().with_mode(0o600),
    )
    .map_err(|e| CtlError::Usage(e.to_string()))?;
    Ok(format!(
        "wrote node {node}'s link key to {out} (mode 0600); install it on {node} as agent.key_file, owned by root\n"
    ))
}

/// `synth-curves`: curves drawn from the paper's table.
fn synth_curves(paper: String, noise: f64, seed: u64) -> Result<String, CtlError> {
    let text = read_text(&paper, MAX_INPUT_BYTES)?;
    offline::synth_curves(&text, noise, seed).map_err(|source| CtlError::Input {
        path: paper,
        source,
    })
}
