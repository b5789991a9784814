//! The `--power-flex` option: its grammar, the site's tier table, and the order in which
//! tiers give way when the budget is short.
//!
//! The SPANK plugin validates the option at submission with [`parse_power_flex`], so every
//! message here is what an ML engineer sees from `sbatch`. The agent and controller parse
//! the same text again and get the same [`FlexRequest`].
//!
//! # Grammar
//!
//! ```text
//! value   = service *( "," key "=" val )            ; canonical order; any order parses
//! service = TIER | "none" | "max-slowdown=" PERCENT
//! PERCENT = DIGITS [ "." 1*2DIGIT ] [ "%" ]          ; 0 to 100 inclusive
//! ```
//!
//! - `TIER` is a tier the site offers (by default `flex0`, `flex1`, `flex2`, `flex3`,
//!   allowing 0, 10, 25 and 50 % slowdown, the tiers of the Emerald AI field demo,
//!   arXiv 2507.00909). Tier names are case-sensitive.
//! - `none` means the job is not managed by powerflex; no key may follow it.
//! - `max-slowdown=N%` stands in place of a tier when the site allows explicit bounds
//!   ([`TierTable::allows_max_slowdown`]): `max-slowdown=15%`, `max-slowdown=15` (the `%`
//!   is implied) or `max-slowdown=12.5%`; at most two decimals.
//!
//! Keys (each at most once, in any order; the service usually comes first):
//!
//! - `calibrate=auto|off` (default `auto`): `off` skips the calibration walk, so
//!   powerflex relies on the predictor prior and telemetry at the granted caps.
//! - `max-slowdown=N%`: the explicit bound above, in place of a tier.
//! - `preempt=never|suspend|requeue` (default: the site's setting for the tier, else
//!   `never`): when caps at every job's floor cannot meet the budget (a grid event deeper
//!   than caps reach), the controller may suspend (`scontrol suspend`) or requeue the job
//!   until the event ends. Not accepted for a tier that allows no slowdown (`flex0`):
//!   such jobs are never suspended.
//!
//! The whole value is at most [`MAX_VALUE_BYTES`] bytes of ASCII letters, digits and
//! `- _ . % = ,`; anything else (spaces, control or non-ASCII characters) is rejected
//! and shown escaped.
//! [`FlexRequest`]'s `Display` writes the canonical form (service first, default keys
//! left out), which parses back to the same request.
//!
//! # Giving way
//!
//! When the facility budget cannot hold every job at its tier's floor, jobs with the
//! largest `max_slowdown` give way first: `flex3`, then `flex2`, then `flex1`, and `flex0`
//! last. [`give_way_order`] is that order as a comparator for the allocator's sort.

use std::cmp::Ordering;
use std::fmt;

use crate::units::SlowdownFraction;

/// Longest accepted `--power-flex` value, in bytes.
pub const MAX_VALUE_BYTES: usize = 256;

/// Longest tier name, in characters.
pub const MAX_TIER_NAME_CHARS: usize = 32;

/// The service word for a job powerflex leaves alone.
pub const UNMANAGED: &str = "none";

/// The key that bounds slowdown explicitly; also the `tier` of such a [`Service::Bounded`].
pub const MAX_SLOWDOWN_KEY: &str = "max-slowdown";

/// The key that turns calibration on or off.
pub const CALIBRATE_KEY: &str = "calibrate";

/// The key that lets the controller suspend or requeue the job in a deep cut.
pub const PREEMPT_KEY: &str = "preempt";

/// Words a site may not use as tier names: they already mean something in the grammar.
pub const RESERVED_NAMES: [&str; 4] = [UNMANAGED, MAX_SLOWDOWN_KEY, CALIBRATE_KEY, PREEMPT_KEY];

/// Shown in every percentage error.
const PERCENT_ACCEPTED: &str = "a percentage from 0 to 100 with at most two decimals, e.g. 15%";

/// Shown in every character error.
const CHARS_ACCEPTED: &str = "letters, digits and - _ . % = ,";

/// A slowdown tier the site offers: jobs in it run at least `1 - max_slowdown` of their
/// uncapped throughput.
#[derive(Debug, Clone, PartialEq)]
pub struct Tier {
    /// What users write after `--power-flex=`: 1 to 32 of `a-z`, `0-9`, `-`, `_`.
    pub name: String,
    /// Largest tolerated slowdown, as a fraction of uncapped throughput (0 to 1).
    pub max_slowdown: SlowdownFraction,
    /// What the controller may do to the tier's jobs in a deep cut when they do not say
    /// (`preempt=`): the site's default, `never` unless the site config says otherwise.
    pub preempt: Preempt,
}

impl Tier {
    /// A tier allowing `max_slowdown_pct` percent slowdown (not yet validated).
    pub fn new(name: impl Into<String>, max_slowdown_pct: f64) -> Tier {
        Tier {
            name: name.into(),
            max_slowdown: SlowdownFraction(max_slowdown_pct / 100.0),
            preempt: Preempt::Never,
        }
    }
}

/// The tiers a site offers, validated, plus whether users may write `max-slowdown=N%`.
#[derive(Debug, Clone, PartialEq)]
pub struct TierTable {
    tiers: Vec<Tier>,
    allow_max_slowdown: bool,
}

impl TierTable {
    /// Validates a site's tiers: names of 1 to 32 characters from `a-z`, `0-9`, `-`, `_`,
    /// unique, none of [`RESERVED_NAMES`]; slowdowns finite, from 0 to 100 %. The list may
    /// be empty only if `allow_max_slowdown` is set. Tiers are listed in the given order.
    pub fn new(tiers: Vec<Tier>, allow_max_slowdown: bool) -> Result<TierTable, FlexError> {
        if tiers.is_empty() && !allow_max_slowdown {
            return Err(FlexError::NoTiers);
        }
        for (index, tier) in tiers.iter().enumerate() {
            if RESERVED_NAMES.contains(&tier.name.as_str()) {
                return Err(FlexError::ReservedTierName {
                    name: tier.name.clone(),
                });
            }
            if !is_valid_tier_name(&tier.name) {
                return Err(FlexError::InvalidTierName {
                    name: tier.name.clone(),
                });
            }
            if tiers[..index].iter().any(|t| t.name == tier.name) {
                return Err(FlexError::DuplicateTier {
                    name: tier.name.clone(),
                });
            }
            let fraction = tier.max_slowdown.0;
            if !fraction.is_finite() || !(0.0..=1.0).contains(&fraction) {
                return Err(FlexError::TierSlowdownOutOfRange {
                    name: tier.name.clone(),
                    max_slowdown_pct: fraction * 100.0,
                });
            }
        }
        Ok(TierTable {
            tiers,
            allow_max_slowdown,
        })
    }

    /// `flex0` 0 %, `flex1` 10 %, `flex2` 25 %, `flex3` 50 % (the Emerald AI field demo
    /// tiers), with `max-slowdown=N%` allowed, as a config without `[[tiers.tier]]` gets.
    pub fn default_table() -> TierTable {
        TierTable {
            tiers: vec![
                Tier::new("flex0", 0.0),
                Tier::new("flex1", 10.0),
                Tier::new("flex2", 25.0),
                Tier::new("flex3", 50.0),
            ],
            allow_max_slowdown: true,
        }
    }

    /// The same tiers with `max-slowdown=N%` allowed or not.
    pub fn with_max_slowdown(self, allow: bool) -> Result<TierTable, FlexError> {
        TierTable::new(self.tiers, allow)
    }

    /// The tier called `name`, if the site offers it. `none` is not a tier.
    pub fn lookup(&self, name: &str) -> Option<&Tier> {
        self.tiers.iter().find(|t| t.name == name)
    }

    /// Tier names in the site's order (without `none`).
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.tiers.iter().map(|t| t.name.as_str())
    }

    /// The tiers in the site's order.
    pub fn tiers(&self) -> &[Tier] {
        &self.tiers
    }

    /// Sets the site's default `preempt` for tier `name`; false when there is no such
    /// tier. (The config validates the value against the tier's bound.)
    pub fn set_preempt(&mut self, name: &str, preempt: Preempt) -> bool {
        match self.tiers.iter_mut().find(|t| t.name == name) {
            Some(tier) => {
                tier.preempt = preempt;
                true
            }
            None => false,
        }
    }

    /// What the controller may do to `request`'s job in a deep cut: its own `preempt=`,
    /// else its tier's default; `never` for flex0-like bounds of 0 and unmanaged jobs.
    pub fn preempt_for(&self, request: &FlexRequest) -> Preempt {
        let site_default = match &request.service {
            Service::Bounded { tier, .. } => {
                self.lookup(tier).map_or(Preempt::Never, |t| t.preempt)
            }
            Service::Unmanaged => Preempt::Never,
        };
        request.preempt_or(site_default)
    }

    /// Whether users may write `max-slowdown=N%` in place of a tier.
    pub fn allows_max_slowdown(&self) -> bool {
        self.allow_max_slowdown
    }

    /// What a user may write as the service, for messages:
    /// `flex0, flex1, flex2, flex3, none, or max-slowdown=N%` (the last part only when
    /// the site allows explicit bounds).
    pub fn accepted(&self) -> String {
        let mut text = String::new();
        for name in self.names() {
            text.push_str(name);
            text.push_str(", ");
        }
        text.push_str(UNMANAGED);
        if self.allow_max_slowdown {
            text.push_str(", or max-slowdown=N%");
        }
        text
    }

    /// The keys a user may write, for messages: `calibrate, max-slowdown` or `calibrate`.
    pub fn accepted_keys(&self) -> &'static str {
        if self.allow_max_slowdown {
            "calibrate, preempt, max-slowdown"
        } else {
            "calibrate, preempt"
        }
    }
}

fn is_valid_tier_name(name: &str) -> bool {
    (1..=MAX_TIER_NAME_CHARS).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// Whether and how tightly powerflex manages a job.
#[derive(Debug, Clone, PartialEq)]
pub enum Service {
    /// `none`: powerflex leaves the job's GPUs alone.
    Unmanaged,
    /// Capped, never slower than `max_slowdown` of uncapped throughput.
    Bounded {
        /// The tier's name, or [`MAX_SLOWDOWN_KEY`] for an explicit `max-slowdown=N%`.
        tier: String,
        /// The bound, as a fraction of uncapped throughput (0 to 1).
        max_slowdown: SlowdownFraction,
    },
}

impl Service {
    /// The slowdown bound, or `None` for an unmanaged job.
    pub fn max_slowdown(&self) -> Option<SlowdownFraction> {
        match self {
            Service::Unmanaged => None,
            Service::Bounded { max_slowdown, .. } => Some(*max_slowdown),
        }
    }

    /// Whether powerflex caps this job at all.
    pub fn is_managed(&self) -> bool {
        matches!(self, Service::Bounded { .. })
    }
}

/// Whether the agent measures the job's power–throughput curve with a short cap walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Calibrate {
    /// Walk down the model's calibration caps, within the tier bound (the default).
    #[default]
    Auto,
    /// No walk: rely on the predictor prior and what telemetry shows at the granted caps.
    Off,
}

impl Calibrate {
    /// Accepted values, as users write them.
    pub const NAMES: [&'static str; 2] = ["auto", "off"];

    /// The value as users write it.
    pub fn name(self) -> &'static str {
        match self {
            Calibrate::Auto => "auto",
            Calibrate::Off => "off",
        }
    }
}

impl fmt::Display for Calibrate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the controller may do to a job when caps at every floor cannot meet the budget.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Preempt {
    /// Capped only, never stopped (the default).
    #[default]
    Never,
    /// Suspended (`scontrol suspend`) and resumed when the budget allows: the job keeps
    /// its GPUs and memory, which fall to idle draw.
    Suspend,
    /// Requeued (`scontrol requeue`): it loses its progress since its last checkpoint
    /// and frees its GPUs; Slurm starts it again when it can.
    Requeue,
}

impl Preempt {
    /// Accepted values, as users write them.
    pub const NAMES: [&'static str; 3] = ["never", "suspend", "requeue"];

    /// The value as users write it.
    pub fn name(self) -> &'static str {
        match self {
            Preempt::Never => "never",
            Preempt::Suspend => "suspend",
            Preempt::Requeue => "requeue",
        }
    }

    /// Parses a value users write, if it is one of [`Preempt::NAMES`].
    pub fn from_name(name: &str) -> Option<Preempt> {
        match name {
            "never" => Some(Preempt::Never),
            "suspend" => Some(Preempt::Suspend),
            "requeue" => Some(Preempt::Requeue),
            _ => None,
        }
    }
}

impl fmt::Display for Preempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A parsed `--power-flex` value.
///
/// [`parse_power_flex`] never returns `Unmanaged` with `Calibrate::Off` (`none` takes no
/// keys); `Display` writes the canonical option text, e.g. `flex2`, `flex1,calibrate=off`,
/// `max-slowdown=12.5%` or `none`. An explicit bound is written to 0.01 %.
#[derive(Debug, Clone, PartialEq)]
pub struct FlexRequest {
    pub service: Service,
    pub calibrate: Calibrate,
    /// `preempt=`, if the user gave it; `None`: the site's setting for the tier.
    pub preempt: Option<Preempt>,
}

impl FlexRequest {
    /// What the controller may do to this job in a deep cut: the user's `preempt=`, else
    /// `site_default` (the tier's setting); never anything for an unmanaged job or a bound
    /// of 0 (flex0), whatever either says.
    pub fn preempt_or(&self, site_default: Preempt) -> Preempt {
        match self.service.max_slowdown() {
            Some(bound) if bound.0 > 0.0 => self.preempt.unwrap_or(site_default),
            _ => Preempt::Never,
        }
    }
}

impl fmt::Display for FlexRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.service {
            Service::Unmanaged => f.write_str(UNMANAGED)?,
            Service::Bounded { tier, max_slowdown } if tier == MAX_SLOWDOWN_KEY => {
                write!(f, "{MAX_SLOWDOWN_KEY}=")?;
                write_percent(f, *max_slowdown)?;
            }
            Service::Bounded { tier, .. } => f.write_str(tier)?,
        }
        if self.calibrate != Calibrate::default() {
            write!(f, ",{CALIBRATE_KEY}={}", self.calibrate)?;
        }
        if let Some(preempt) = self.preempt {
            write!(f, ",{PREEMPT_KEY}={preempt}")?;
        }
        Ok(())
    }
}

/// Comparator for the order in which bounded jobs give way when the budget cannot hold
/// every tier floor: `Less` means `a`'s job gives way before `b`'s. The largest
/// `max_slowdown` goes first (`flex3`, then `flex2`, `flex1`, and `flex0` last); equal
/// bounds compare `Equal`, so the allocator breaks ties itself (e.g. by job id) to stay
/// deterministic. Total on all floats, NaN included, so sorting never panics.
///
/// ```
/// use powerflex_core::flex::give_way_order;
/// use powerflex_core::units::SlowdownFraction;
/// let mut bounds = vec![SlowdownFraction(0.1), SlowdownFraction(0.5), SlowdownFraction(0.0)];
/// bounds.sort_by(|a, b| give_way_order(*a, *b));
/// assert_eq!(bounds, [SlowdownFraction(0.5), SlowdownFraction(0.1), SlowdownFraction(0.0)]);
/// ```
pub fn give_way_order(a: SlowdownFraction, b: SlowdownFraction) -> Ordering {
    b.0.total_cmp(&a.0)
}

/// Why a `--power-flex` value or a site's tier table was rejected. Every message names the
/// offending part (escaped, never raw control characters) and what is accepted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FlexError {
    #[error("--power-flex value is empty; this site offers: {accepted}")]
    Empty { accepted: String },
    #[error(
        "--power-flex value is {len} bytes, over the {MAX_VALUE_BYTES}-byte limit \
         (it starts \"{prefix}\")"
    )]
    TooLong {
        len: usize,
        /// The first few characters, already escaped.
        prefix: String,
    },
    #[error(
        "--power-flex contains '{}' at byte {offset}; accepted characters: {CHARS_ACCEPTED}",
        .character.escape_default()
    )]
    InvalidCharacter { character: char, offset: usize },
    #[error(
        "--power-flex has an empty item at position {position} (a doubled, leading or \
         trailing comma); expected TIER or TIER,key=value,..., e.g. flex1,calibrate=off"
    )]
    EmptyItem {
        /// 1-based item number.
        position: usize,
    },
    #[error(
        "--power-flex item \"{}\" has no key before '='; accepted keys: {accepted_keys}",
        .item.escape_default()
    )]
    EmptyKey {
        item: String,
        accepted_keys: &'static str,
    },
    #[error(
        "key \"{}\" in --power-flex has an empty value; accepted: {}",
        .key.escape_default(), key_values(.key)
    )]
    EmptyValue { key: String },
    #[error(
        "key \"{}\" in --power-flex needs '=' and a value; accepted: {}",
        .key.escape_default(), key_values(.key)
    )]
    MissingEquals { key: String },
    #[error(
        "unknown key \"{}\" in --power-flex; accepted keys: {accepted_keys}",
        .key.escape_default()
    )]
    UnknownKey {
        key: String,
        accepted_keys: &'static str,
    },
    #[error(
        "key \"{}\" appears twice in --power-flex; give each key at most once",
        .key.escape_default()
    )]
    DuplicateKey { key: String },
    #[error(
        "bad calibrate value \"{}\" in --power-flex; accepted: auto, off",
        .value.escape_default()
    )]
    BadCalibrate { value: String },
    #[error(
        "bad preempt value \"{}\" in --power-flex; accepted: never, suspend, requeue",
        .value.escape_default()
    )]
    BadPreempt { value: String },
    #[error(
        "preempt={} does not apply to \"{}\", which allows no slowdown: such jobs are never \
         suspended or requeued; drop preempt= or choose a tier that allows slowdown",
        .preempt, .tier.escape_default()
    )]
    PreemptWithoutSlowdown { tier: String, preempt: Preempt },
    #[error(
        "bad max-slowdown \"{}\" in --power-flex; accepted: {PERCENT_ACCEPTED}",
        .text.escape_default()
    )]
    BadPercent { text: String },
    #[error("unknown tier \"{}\"; this site offers: {accepted}", .name.escape_default())]
    UnknownTier { name: String, accepted: String },
    #[error(
        "--power-flex names two tiers, \"{}\" and \"{}\"; give exactly one",
        .first.escape_default(), .second.escape_default()
    )]
    SecondTier { first: String, second: String },
    #[error(
        "--power-flex gives both \"{}\" and max-slowdown; give one of them, not both",
        .tier.escape_default()
    )]
    TierWithMaxSlowdown { tier: String },
    #[error(
        "this site does not allow max-slowdown=N% in --power-flex; this site offers: {accepted}"
    )]
    MaxSlowdownNotAllowed { accepted: String },
    #[error("--power-flex names no tier; this site offers: {accepted}")]
    MissingTier { accepted: String },
    #[error(
        "key \"{}\" does not apply to none (a job powerflex does not manage); \
         write none alone",
        .key.escape_default()
    )]
    KeyWithNone { key: String },
    #[error(
        "--power-flex item \"{}\" is not key=value; after the tier, accepted keys: {accepted_keys}",
        .item.escape_default()
    )]
    ExpectedKeyValue {
        item: String,
        accepted_keys: &'static str,
    },
    #[error("the site offers no tiers and does not allow max-slowdown; add at least one tier")]
    NoTiers,
    #[error(
        "invalid tier name \"{}\"; accepted: 1 to {MAX_TIER_NAME_CHARS} characters \
         from a-z, 0-9, - and _",
        .name.escape_default()
    )]
    InvalidTierName { name: String },
    #[error(
        "tier name \"{}\" is reserved; choose a name other than none, max-slowdown, calibrate, preempt",
        .name.escape_default()
    )]
    ReservedTierName { name: String },
    #[error("tier \"{}\" is defined twice; tier names must be unique", .name.escape_default())]
    DuplicateTier { name: String },
    #[error(
        "tier \"{}\" allows {}% slowdown; accepted: 0 to 100%",
        .name.escape_default(), display_pct(.max_slowdown_pct)
    )]
    TierSlowdownOutOfRange { name: String, max_slowdown_pct: f64 },
}

/// A percentage for messages, without float noise (`100.29999999999998` → `100.3`).
fn display_pct(pct: &f64) -> f64 {
    (pct * 1e6).round() / 1e6
}

/// What a known key accepts, for messages.
fn key_values(key: &str) -> &'static str {
    match key {
        MAX_SLOWDOWN_KEY => PERCENT_ACCEPTED,
        PREEMPT_KEY => "never, suspend, requeue (e.g. preempt=suspend)",
        _ => "auto, off (e.g. calibrate=off)",
    }
}

/// Parses a `--power-flex` value against the site's tiers. Never panics; see the module
/// docs for the grammar.
///
/// ```
/// use powerflex_core::flex::{parse_power_flex, Calibrate, Service, TierTable};
/// let table = TierTable::default_table();
/// let request = parse_power_flex("flex2,calibrate=off", &table).unwrap();
/// assert_eq!(request.calibrate, Calibrate::Off);
/// assert!(matches!(request.service, Service::Bounded { ref tier, .. } if tier == "flex2"));
/// assert_eq!(request.to_string(), "flex2,calibrate=off");
/// ```
pub fn parse_power_flex(value: &str, table: &TierTable) -> Result<FlexRequest, FlexError> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(FlexError::TooLong {
            len: value.len(),
            prefix: escaped_prefix(value, 32),
        });
    }
    if let Some((offset, character)) = value.char_indices().find(|(_, c)| !is_accepted_char(*c)) {
        return Err(FlexError::InvalidCharacter { character, offset });
    }
    if value.is_empty() {
        return Err(FlexError::Empty {
            accepted: table.accepted(),
        });
    }

    let mut service: Option<Service> = None;
    let mut calibrate: Option<Calibrate> = None;
    let mut preempt: Option<Preempt> = None;
    let mut keys_seen: Vec<&str> = Vec::new();

    for (index, item) in value.split(',').enumerate() {
        if item.is_empty() {
            return Err(FlexError::EmptyItem {
                position: index + 1,
            });
        }
        let Some((key, val)) = item.split_once('=') else {
            // A bare word: the service, or a key written without its value.
            if item == CALIBRATE_KEY
                || item == PREEMPT_KEY
                || (item == MAX_SLOWDOWN_KEY && table.allow_max_slowdown)
            {
                return Err(FlexError::MissingEquals {
                    key: item.to_string(),
                });
            }
            if item == MAX_SLOWDOWN_KEY {
                return Err(FlexError::MaxSlowdownNotAllowed {
                    accepted: table.accepted(),
                });
            }
            match &service {
                None => service = Some(resolve_tier(item, table)?),
                Some(existing) => {
                    let first = service_word(existing);
                    if keys_seen.contains(&MAX_SLOWDOWN_KEY) {
                        return Err(FlexError::TierWithMaxSlowdown {
                            tier: item.to_string(),
                        });
                    }
                    if item == UNMANAGED || table.lookup(item).is_some() {
                        return Err(FlexError::SecondTier {
                            first,
                            second: item.to_string(),
                        });
                    }
                    return Err(FlexError::ExpectedKeyValue {
                        item: item.to_string(),
                        accepted_keys: table.accepted_keys(),
                    });
                }
            }
            continue;
        };

        if key.is_empty() {
            return Err(FlexError::EmptyKey {
                item: item.to_string(),
                accepted_keys: table.accepted_keys(),
            });
        }
        let key = match key {
            CALIBRATE_KEY => CALIBRATE_KEY,
            PREEMPT_KEY => PREEMPT_KEY,
            MAX_SLOWDOWN_KEY if table.allow_max_slowdown => MAX_SLOWDOWN_KEY,
            MAX_SLOWDOWN_KEY => {
                return Err(FlexError::MaxSlowdownNotAllowed {
                    accepted: table.accepted(),
                })
            }
            other => {
                return Err(FlexError::UnknownKey {
                    key: other.to_string(),
                    accepted_keys: table.accepted_keys(),
                })
            }
        };
        if keys_seen.contains(&key) {
            return Err(FlexError::DuplicateKey {
                key: key.to_string(),
            });
        }
        keys_seen.push(key);
        if val.is_empty() {
            return Err(FlexError::EmptyValue {
                key: key.to_string(),
            });
        }
        if key == PREEMPT_KEY {
            preempt = Some(
                Preempt::from_name(val).ok_or_else(|| FlexError::BadPreempt {
                    value: val.to_string(),
                })?,
            );
        } else if key == CALIBRATE_KEY {
            calibrate = Some(match val {
                "auto" => Calibrate::Auto,
                "off" => Calibrate::Off,
                other => {
                    return Err(FlexError::BadCalibrate {
                        value: other.to_string(),
                    })
                }
            });
        } else {
            if let Some(existing) = &service {
                return Err(FlexError::TierWithMaxSlowdown {
                    tier: service_word(existing),
                });
            }
            let basis_points =
                parse_percent_basis_points(val).ok_or_else(|| FlexError::BadPercent {
                    text: val.to_string(),
                })?;
            service = Some(Service::Bounded {
                tier: MAX_SLOWDOWN_KEY.to_string(),
                max_slowdown: SlowdownFraction(f64::from(basis_points) / 10_000.0),
            });
        }
    }

    let Some(service) = service else {
        return Err(FlexError::MissingTier {
            accepted: table.accepted(),
        });
    };
    if service == Service::Unmanaged {
        if let Some(key) = keys_seen.first() {
            return Err(FlexError::KeyWithNone {
                key: (*key).to_string(),
            });
        }
    }
    if let (Some(p @ (Preempt::Suspend | Preempt::Requeue)), Some(bound)) =
        (preempt, service.max_slowdown())
    {
        if bound.0 <= 0.0 {
            return Err(FlexError::PreemptWithoutSlowdown {
                tier: service_word(&service),
                preempt: p,
            });
        }
    }
    Ok(FlexRequest {
        service,
        calibrate: calibrate.unwrap_or_default(),
        preempt,
    })
}

fn resolve_tier(word: &str, table: &TierTable) -> Result<Service, FlexError> {
    if word == UNMANAGED {
        return Ok(Service::Unmanaged);
    }
    match table.lookup(word) {
        Some(tier) => Ok(Service::Bounded {
            tier: tier.name.clone(),
            max_slowdown: tier.max_slowdown,
        }),
        None => Err(FlexError::UnknownTier {
            name: word.to_string(),
            accepted: table.accepted(),
        }),
    }
}

/// The word a user wrote for an already parsed service, for messages.
fn service_word(service: &Service) -> String {
    match service {
        Service::Unmanaged => UNMANAGED.to_string(),
        Service::Bounded { tier, .. } => tier.clone(),
    }
}

fn is_accepted_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '%' | '=' | ',')
}

/// The first `max_bytes` (or fewer, at a character boundary) of `text`, escaped.
fn escaped_prefix(text: &str, max_bytes: usize) -> String {
    let mut end = 0;
    for (offset, c) in text.char_indices() {
        if offset + c.len_utf8() > max_bytes {
            break;
        }
        end = offset + c.len_utf8();
    }
    text.get(..end).unwrap_or("").escape_default().to_string()
}

/// `15`, `15%`, `12.5%`, `0.25` as hundredths of a percent (`1500`, `1500`, `1250`,
/// `25`), if it is a plain decimal from 0 to 100 with at most two decimals. Fixed point,
/// so the canonical form written by [`write_percent`] parses back to the same fraction.
fn parse_percent_basis_points(text: &str) -> Option<u32> {
    let number = text.strip_suffix('%').unwrap_or(text);
    let (whole, decimals) = match number.split_once('.') {
        Some((whole, decimals)) => (whole, Some(decimals)),
        None => (number, None),
    };
    let mut basis_points = digits_value(whole)?.checked_mul(100)?;
    if let Some(decimals) = decimals {
        let scale = match decimals.len() {
            1 => 10,
            2 => 1,
            _ => return None,
        };
        basis_points = basis_points.checked_add(digits_value(decimals)? * scale)?;
    }
    (basis_points <= 10_000).then_some(basis_points)
}

/// The value of a non-empty run of ASCII digits, if it fits.
fn digits_value(digits: &str) -> Option<u32> {
    if digits.is_empty() {
        return None;
    }
    digits.bytes().try_fold(0u32, |acc, b| {
        if b.is_ascii_digit() {
            acc.checked_mul(10)?.checked_add(u32::from(b - b'0'))
        } else {
            None
        }
    })
}

/// Writes a slowdown bound as the grammar's percentage, to 0.01 %: `15%`, `12.5%`, `0.25%`.
fn write_percent(f: &mut fmt::Formatter<'_>, fraction: SlowdownFraction) -> fmt::Result {
    // Saturating float-to-int cast: out-of-range or NaN bounds (only possible in a
    // hand-built request) still print something instead of panicking.
    let basis_points = (fraction.0 * 10_000.0).round() as u64;
    let (whole, hundredths) = (basis_points / 100, basis_points % 100);
    if hundredths == 0 {
        write!(f, "{whole}%")
    } else if hundredths % 10 == 0 {
        write!(f, "{whole}.{}%", hundredths / 10)
    } else {
        write!(f, "{whole}.{hundredths:02}%")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn strict_table() -> TierTable {
        TierTable::default_table().with_max_slowdown(false).unwrap()
    }

    fn bounded(tier: &str, fraction: f64) -> Service {
        Service::Bounded {
            tier: tier.to_string(),
            max_slowdown: SlowdownFraction(fraction),
        }
    }

    #[test]
    fn parses_valid_values() {
        let table = TierTable::default_table();
        let cases: Vec<(&str, Service, Calibrate)> = vec![
            ("flex0", bounded("flex0", 0.0), Calibrate::Auto),
            ("flex1", bounded("flex1", 0.1), Calibrate::Auto),
            ("flex2", bounded("flex2", 0.25), Calibrate::Auto),
            ("flex3", bounded("flex3", 0.5), Calibrate::Auto),
            ("none", Service::Unmanaged, Calibrate::Auto),
            ("flex1,calibrate=off", bounded("flex1", 0.1), Calibrate::Off),
            (
                "flex1,calibrate=auto",
                bounded("flex1", 0.1),
                Calibrate::Auto,
            ),
            (
                "calibrate=off,flex2",
                bounded("flex2", 0.25),
                Calibrate::Off,
            ),
            (
                "max-slowdown=15%",
                bounded("max-slowdown", 0.15),
                Calibrate::Auto,
            ),
            (
                "max-slowdown=15",
                bounded("max-slowdown", 0.15),
                Calibrate::Auto,
            ),
            (
                "max-slowdown=12.5%",
                bounded("max-slowdown", 0.125),
                Calibrate::Auto,
            ),
            (
                "max-slowdown=0.25",
                bounded("max-slowdown", 0.0025),
                Calibrate::Auto,
            ),
            (
                "max-slowdown=0%",
                bounded("max-slowdown", 0.0),
                Calibrate::Auto,
            ),
            (
                "max-slowdown=100%",
                bounded("max-slowdown", 1.0),
                Calibrate::Auto,
            ),
            (
                "max-slowdown=100.00",
                bounded("max-slowdown", 1.0),
                Calibrate::Auto,
            ),
            (
                "max-slowdown=007%",
                bounded("max-slowdown", 0.07),
                Calibrate::Auto,
            ),
            (
                "max-slowdown=20%,calibrate=off",
                bounded("max-slowdown", 0.2),
                Calibrate::Off,
            ),
        ];
        for (input, service, calibrate) in cases {
            assert_eq!(
                parse_power_flex(input, &table),
                Ok(FlexRequest {
                    service,
                    calibrate,
                    preempt: None
                }),
                "input {input:?}"
            );
        }
    }

    #[test]
    fn canonical_form() {
        let table = TierTable::default_table();
        for (input, canonical) in [
            ("flex2", "flex2"),
            ("flex2,calibrate=auto", "flex2"),
            ("calibrate=off,flex2", "flex2,calibrate=off"),
            ("none", "none"),
            ("max-slowdown=15", "max-slowdown=15%"),
            ("max-slowdown=12.50%", "max-slowdown=12.5%"),
            ("max-slowdown=0.05", "max-slowdown=0.05%"),
            ("max-slowdown=99.99", "max-slowdown=99.99%"),
        ] {
            assert_eq!(
                parse_power_flex(input, &table).unwrap().to_string(),
                canonical
            );
        }
    }

    #[test]
    fn rejects_each_error_path() {
        let open = TierTable::default_table();
        let strict = strict_table();
        let long = format!("flex1,calibrate=off,{}", "x".repeat(300));
        let cases: Vec<(&str, &TierTable, FlexError)> = vec![
            (
                "",
                &open,
                FlexError::Empty {
                    accepted: "flex0, flex1, flex2, flex3, none, or max-slowdown=N%".into(),
                },
            ),
            (
                &long,
                &open,
                FlexError::TooLong {
                    len: long.len(),
                    prefix: "flex1,calibrate=off,xxxxxxxxxxxx".into(),
                },
            ),
            (
                "flex1\u{7}",
                &open,
                FlexError::InvalidCharacter {
                    character: '\u{7}',
                    offset: 5,
                },
            ),
            (
                "flex1 ",
                &open,
                FlexError::InvalidCharacter {
                    character: ' ',
                    offset: 5,
                },
            ),
            (
                "fléx1",
                &open,
                FlexError::InvalidCharacter {
                    character: 'é',
                    offset: 2,
                },
            ),
            ("flex1,", &open, FlexError::EmptyItem { position: 2 }),
            (",flex1", &open, FlexError::EmptyItem { position: 1 }),
            (
                "flex1,,calibrate=off",
                &open,
                FlexError::EmptyItem { position: 2 },
            ),
            (
                "flex1,=off",
                &open,
                FlexError::EmptyKey {
                    item: "=off".into(),
                    accepted_keys: "calibrate, preempt, max-slowdown",
                },
            ),
            (
                "flex1,calibrate=",
                &open,
                FlexError::EmptyValue {
                    key: "calibrate".into(),
                },
            ),
            (
                "max-slowdown=",
                &open,
                FlexError::EmptyValue {
                    key: "max-slowdown".into(),
                },
            ),
            (
                "flex1,calibrate",
                &open,
                FlexError::MissingEquals {
                    key: "calibrate".into(),
                },
            ),
            (
                "max-slowdown",
                &open,
                FlexError::MissingEquals {
                    key: "max-slowdown".into(),
                },
            ),
            (
                "flex1,foo=1",
                &open,
                FlexError::UnknownKey {
                    key: "foo".into(),
                    accepted_keys: "calibrate, preempt, max-slowdown",
                },
            ),
            (
                "flex1,foo=1",
                &strict,
                FlexError::UnknownKey {
                    key: "foo".into(),
                    accepted_keys: "calibrate, preempt",
                },
            ),
            (
                "flex1,calibrate=off,calibrate=auto",
                &open,
                FlexError::DuplicateKey {
                    key: "calibrate".into(),
                },
            ),
            (
                "max-slowdown=10,max-slowdown=20",
                &open,
                FlexError::DuplicateKey {
                    key: "max-slowdown".into(),
                },
            ),
            (
                "flex1,calibrate=maybe",
                &open,
                FlexError::BadCalibrate {
                    value: "maybe".into(),
                },
            ),
            (
                "max-slowdown=abc",
                &open,
                FlexError::BadPercent { text: "abc".into() },
            ),
            (
                "max-slowdown=150%",
                &open,
                FlexError::BadPercent {
                    text: "150%".into(),
                },
            ),
            (
                "max-slowdown=100.01",
                &open,
                FlexError::BadPercent {
                    text: "100.01".into(),
                },
            ),
            (
                "max-slowdown=-5%",
                &open,
                FlexError::BadPercent { text: "-5%".into() },
            ),
            (
                "max-slowdown=NaN",
                &open,
                FlexError::BadPercent { text: "NaN".into() },
            ),
            (
                "max-slowdown=inf",
                &open,
                FlexError::BadPercent { text: "inf".into() },
            ),
            (
                "max-slowdown=15%x",
                &open,
                FlexError::BadPercent {
                    text: "15%x".into(),
                },
            ),
            (
                "max-slowdown=15%%",
                &open,
                FlexError::BadPercent {
                    text: "15%%".into(),
                },
            ),
            (
                "max-slowdown=1e1",
                &open,
                FlexError::BadPercent { text: "1e1".into() },
            ),
            (
                "max-slowdown=12.345",
                &open,
                FlexError::BadPercent {
                    text: "12.345".into(),
                },
            ),
            (
                "max-slowdown=.5",
                &open,
                FlexError::BadPercent { text: ".5".into() },
            ),
            (
                "max-slowdown=5.",
                &open,
                FlexError::BadPercent { text: "5.".into() },
            ),
            (
                "max-slowdown=99999999999999999999",
                &open,
                FlexError::BadPercent {
                    text: "99999999999999999999".into(),
                },
            ),
            (
                "flex9",
                &strict,
                FlexError::UnknownTier {
                    name: "flex9".into(),
                    accepted: "flex0, flex1, flex2, flex3, none".into(),
                },
            ),
            (
                "FLEX1",
                &open,
                FlexError::UnknownTier {
                    name: "FLEX1".into(),
                    accepted: "flex0, flex1, flex2, flex3, none, or max-slowdown=N%".into(),
                },
            ),
            (
                "flex1,flex2",
                &open,
                FlexError::SecondTier {
                    first: "flex1".into(),
                    second: "flex2".into(),
                },
            ),
            (
                "none,flex2",
                &open,
                FlexError::SecondTier {
                    first: "none".into(),
                    second: "flex2".into(),
                },
            ),
            (
                "flex1,max-slowdown=10%",
                &open,
                FlexError::TierWithMaxSlowdown {
                    tier: "flex1".into(),
                },
            ),
            (
                "max-slowdown=10%,flex1",
                &open,
                FlexError::TierWithMaxSlowdown {
                    tier: "flex1".into(),
                },
            ),
            (
                "none,max-slowdown=10%",
                &open,
                FlexError::TierWithMaxSlowdown {
                    tier: "none".into(),
                },
            ),
            (
                "max-slowdown=10%",
                &strict,
                FlexError::MaxSlowdownNotAllowed {
                    accepted: "flex0, flex1, flex2, flex3, none".into(),
                },
            ),
            (
                "max-slowdown",
                &strict,
                FlexError::MaxSlowdownNotAllowed {
                    accepted: "flex0, flex1, flex2, flex3, none".into(),
                },
            ),
            (
                "calibrate=off",
                &open,
                FlexError::MissingTier {
                    accepted: "flex0, flex1, flex2, flex3, none, or max-slowdown=N%".into(),
                },
            ),
            (
                "none,calibrate=off",
                &open,
                FlexError::KeyWithNone {
                    key: "calibrate".into(),
                },
            ),
            (
                "flex1,off",
                &open,
                FlexError::ExpectedKeyValue {
                    item: "off".into(),
                    accepted_keys: "calibrate, preempt, max-slowdown",
                },
            ),
        ];
        for (input, table, expected) in cases {
            assert_eq!(
                parse_power_flex(input, table),
                Err(expected),
                "input {input:?}"
            );
        }
    }

    #[test]
    fn exact_messages() {
        let open = TierTable::default_table();
        let strict = strict_table();
        let message = |input: &str, table: &TierTable| {
            parse_power_flex(input, table).unwrap_err().to_string()
        };
        assert_eq!(
            message("flex9", &strict),
            "unknown tier \"flex9\"; this site offers: flex0, flex1, flex2, flex3, none"
        );
        assert_eq!(
            message("flex9", &open),
            "unknown tier \"flex9\"; this site offers: flex0, flex1, flex2, flex3, none, \
             or max-slowdown=N%"
        );
        assert_eq!(
            message("", &strict),
            "--power-flex value is empty; this site offers: flex0, flex1, flex2, flex3, none"
        );
        assert_eq!(
            message("max-slowdown=150%", &open),
            "bad max-slowdown \"150%\" in --power-flex; accepted: a percentage from 0 to 100 \
             with at most two decimals, e.g. 15%"
        );
        assert_eq!(
            message("flex1,foo=1", &open),
            "unknown key \"foo\" in --power-flex; accepted keys: calibrate, preempt, max-slowdown"
        );
        assert_eq!(
            message("flex1,calibrate=maybe", &open),
            "bad calibrate value \"maybe\" in --power-flex; accepted: auto, off"
        );
        assert_eq!(
            message("flex1,calibrate", &open),
            "key \"calibrate\" in --power-flex needs '=' and a value; accepted: auto, off \
             (e.g. calibrate=off)"
        );
        assert_eq!(
            message("flex1\u{1b}[2J", &open),
            "--power-flex contains '\\u{1b}' at byte 5; accepted characters: letters, digits \
             and - _ . % = ,"
        );
        let long = format!("\u{7}{}", "a".repeat(400));
        let text = message(&long, &open);
        assert_eq!(
            text,
            format!(
                "--power-flex value is 401 bytes, over the 256-byte limit \
                 (it starts \"\\u{{7}}{}\")",
                "a".repeat(31)
            )
        );
        assert!(!text.contains('\u{7}'));
    }

    #[test]
    fn messages_are_lowercase_without_trailing_period() {
        let open = TierTable::default_table();
        for input in [
            "",
            "flex9",
            "flex1,",
            "flex1,=x",
            "calibrate=",
            "max-slowdown=abc",
            "flex1,flex2",
            "none,calibrate=off",
            "calibrate=off",
        ] {
            let text = parse_power_flex(input, &open).unwrap_err().to_string();
            assert!(!text.ends_with('.'), "{text}");
            assert!(!text.starts_with(char::is_uppercase), "{text}");
        }
    }

    #[test]
    fn validates_tier_tables() {
        let cases: Vec<(Vec<Tier>, bool, FlexError)> = vec![
            (vec![], false, FlexError::NoTiers),
            (
                vec![Tier::new("Flex1", 10.0)],
                true,
                FlexError::InvalidTierName {
                    name: "Flex1".into(),
                },
            ),
            (
                vec![Tier::new("", 10.0)],
                true,
                FlexError::InvalidTierName { name: "".into() },
            ),
            (
                vec![Tier::new("a".repeat(33), 10.0)],
                true,
                FlexError::InvalidTierName {
                    name: "a".repeat(33),
                },
            ),
            (
                vec![Tier::new("gold tier", 10.0)],
                true,
                FlexError::InvalidTierName {
                    name: "gold tier".into(),
                },
            ),
            (
                vec![Tier::new("none", 10.0)],
                true,
                FlexError::ReservedTierName {
                    name: "none".into(),
                },
            ),
            (
                vec![Tier::new("max-slowdown", 10.0)],
                true,
                FlexError::ReservedTierName {
                    name: "max-slowdown".into(),
                },
            ),
            (
                vec![Tier::new("a", 10.0), Tier::new("a", 20.0)],
                true,
                FlexError::DuplicateTier { name: "a".into() },
            ),
            (
                vec![Tier::new("a", 101.0)],
                true,
                FlexError::TierSlowdownOutOfRange {
                    name: "a".into(),
                    max_slowdown_pct: 101.0,
                },
            ),
            (
                vec![Tier::new("a", -1.0)],
                true,
                FlexError::TierSlowdownOutOfRange {
                    name: "a".into(),
                    max_slowdown_pct: -1.0,
                },
            ),
        ];
        for (tiers, allow, expected) in cases {
            assert_eq!(TierTable::new(tiers, allow), Err(expected));
        }
        let nan = TierTable::new(vec![Tier::new("a", f64::NAN)], true);
        assert!(matches!(nan, Err(FlexError::TierSlowdownOutOfRange { .. })));
        assert!(TierTable::new(vec![], true).is_ok());
        let table = TierTable::new(
            vec![Tier::new("gold_1", 5.0), Tier::new("x-2", 100.0)],
            false,
        )
        .unwrap();
        assert_eq!(table.names().collect::<Vec<_>>(), ["gold_1", "x-2"]);
        assert_eq!(table.accepted(), "gold_1, x-2, none");
        assert_eq!(
            TierTable::new(vec![Tier::new("bad\u{7}", 1.0)], true)
                .unwrap_err()
                .to_string(),
            "invalid tier name \"bad\\u{7}\"; accepted: 1 to 32 characters from a-z, 0-9, - and _"
        );
        assert_eq!(
            TierTable::new(vec![Tier::new("a", 100.3)], true)
                .unwrap_err()
                .to_string(),
            "tier \"a\" allows 100.3% slowdown; accepted: 0 to 100%"
        );
    }

    #[test]
    fn default_table_is_the_field_demo() {
        let table = TierTable::default_table();
        assert_eq!(
            table.names().collect::<Vec<_>>(),
            ["flex0", "flex1", "flex2", "flex3"]
        );
        assert_eq!(
            table.lookup("flex2").map(|t| t.max_slowdown),
            Some(SlowdownFraction(0.25))
        );
        assert_eq!(table.lookup("none"), None);
        assert!(table.allows_max_slowdown());
        // The default table passes its own validation.
        assert_eq!(
            TierTable::new(table.tiers().to_vec(), true),
            Ok(table.clone())
        );
    }

    #[test]
    fn higher_tiers_give_way_first() {
        let table = TierTable::default_table();
        let mut tiers = table.tiers().to_vec();
        tiers.sort_by(|a, b| give_way_order(a.max_slowdown, b.max_slowdown));
        let names: Vec<_> = tiers.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["flex3", "flex2", "flex1", "flex0"]);
        assert_eq!(
            give_way_order(SlowdownFraction(0.1), SlowdownFraction(0.1)),
            Ordering::Equal
        );
    }

    fn valid_request() -> impl Strategy<Value = FlexRequest> {
        let table = TierTable::default_table();
        let tiers = table.tiers().to_vec();
        let calibrate = prop_oneof![Just(Calibrate::Auto), Just(Calibrate::Off)];
        let preempt = prop_oneof![
            Just(None),
            Just(Some(Preempt::Never)),
            Just(Some(Preempt::Suspend)),
            Just(Some(Preempt::Requeue)),
        ];
        // A bound of 0 takes no suspend or requeue.
        let fit = |bound: SlowdownFraction, preempt: Option<Preempt>| {
            if bound.0 > 0.0 {
                preempt
            } else {
                preempt.filter(|p| *p == Preempt::Never)
            }
        };
        let named = (0..tiers.len(), calibrate.clone(), preempt.clone()).prop_map(
            move |(i, calibrate, preempt)| FlexRequest {
                service: Service::Bounded {
                    tier: tiers[i].name.clone(),
                    max_slowdown: tiers[i].max_slowdown,
                },
                calibrate,
                preempt: fit(tiers[i].max_slowdown, preempt),
            },
        );
        let explicit =
            (0u32..=10_000, calibrate, preempt).prop_map(move |(bp, calibrate, preempt)| {
                let bound = SlowdownFraction(f64::from(bp) / 10_000.0);
                FlexRequest {
                    service: Service::Bounded {
                        tier: MAX_SLOWDOWN_KEY.to_string(),
                        max_slowdown: bound,
                    },
                    calibrate,
                    preempt: fit(bound, preempt),
                }
            });
        let none = Just(FlexRequest {
            service: Service::Unmanaged,
            calibrate: Calibrate::Auto,
            preempt: None,
        });
        prop_oneof![named, explicit, none]
    }

    #[test]
    fn preempt_is_parsed_checked_and_defaulted() {
        let table = TierTable::default_table();
        let r = parse_power_flex("flex3,preempt=suspend", &table).expect("ok");
        assert_eq!(r.preempt, Some(Preempt::Suspend));
        assert_eq!(r.to_string(), "flex3,preempt=suspend");
        assert_eq!(r.preempt_or(Preempt::Never), Preempt::Suspend);
        let r = parse_power_flex("preempt=requeue,calibrate=off,flex2", &table).expect("ok");
        assert_eq!(r.to_string(), "flex2,calibrate=off,preempt=requeue");
        let r = parse_power_flex("flex2", &table).expect("ok");
        assert_eq!(
            r.preempt_or(Preempt::Suspend),
            Preempt::Suspend,
            "site default"
        );
        let r = parse_power_flex("flex2,preempt=never", &table).expect("ok");
        assert_eq!(
            r.preempt_or(Preempt::Suspend),
            Preempt::Never,
            "the user's word wins"
        );
        let mut site = table.clone();
        assert!(
            site.set_preempt("flex2", Preempt::Requeue)
                && !site.set_preempt("flex9", Preempt::Suspend)
        );
        let r = parse_power_flex("flex2", &site).expect("ok");
        assert_eq!(site.preempt_for(&r), Preempt::Requeue);
        let r = parse_power_flex("flex2,preempt=suspend", &site).expect("ok");
        assert_eq!(site.preempt_for(&r), Preempt::Suspend);
        let r = parse_power_flex("flex3", &site).expect("ok");
        assert_eq!(site.preempt_for(&r), Preempt::Never);
        let r = parse_power_flex("flex0", &table).expect("ok");
        assert_eq!(
            r.preempt_or(Preempt::Suspend),
            Preempt::Never,
            "flex0 is never suspended, whatever the site says"
        );
        assert_eq!(
            parse_power_flex("flex0,preempt=never", &table).map(|r| r.preempt),
            Ok(Some(Preempt::Never))
        );
        assert_eq!(
            parse_power_flex("flex0,preempt=suspend", &table),
            Err(FlexError::PreemptWithoutSlowdown {
                tier: "flex0".into(),
                preempt: Preempt::Suspend
            })
        );
        assert_eq!(
            parse_power_flex("max-slowdown=0%,preempt=requeue", &table),
            Err(FlexError::PreemptWithoutSlowdown {
                tier: "max-slowdown".into(),
                preempt: Preempt::Requeue
            })
        );
        assert_eq!(
            parse_power_flex("flex3,preempt=kill", &table),
            Err(FlexError::BadPreempt {
                value: "kill".into()
            })
        );
        assert_eq!(
            parse_power_flex("flex3,preempt", &table),
            Err(FlexError::MissingEquals {
                key: "preempt".into()
            })
        );
        assert_eq!(
            parse_power_flex("none,preempt=suspend", &table),
            Err(FlexError::KeyWithNone {
                key: "preempt".into()
            })
        );
        assert_eq!(
            parse_power_flex("flex3,preempt=suspend,preempt=never", &table),
            Err(FlexError::DuplicateKey {
                key: "preempt".into()
            })
        );
        let e = parse_power_flex("flex0,preempt=suspend", &table)
            .expect_err("flex0")
            .to_string();
        assert!(
            e.contains("preempt=suspend does not apply to \"flex0\"") && e.contains("never"),
            "{e}"
        );
        let e = parse_power_flex("flex3,preempt=kill", &table)
            .expect_err("kill")
            .to_string();
        assert!(e.ends_with("accepted: never, suspend, requeue"), "{e}");
    }

    proptest! {
        #[test]
        fn arbitrary_strings_never_panic(value in any::<String>()) {
            let _ = parse_power_flex(&value, &TierTable::default_table());
            let _ = parse_power_flex(&value, &strict_table());
        }

        #[test]
        fn grammar_shaped_strings_never_panic(
            value in "[a-z0-9=,.%-]{0,40}|\
                (flex[0-9]|none|max-slowdown=[0-9.%]{0,8}|calibrate=[a-z]{0,5}|,){0,6}"
        ) {
            let _ = parse_power_flex(&value, &TierTable::default_table());
        }

        #[test]
        fn valid_requests_round_trip(request in valid_request()) {
            let text = request.to_string();
            prop_assert_eq!(parse_power_flex(&text, &TierTable::default_table()), Ok(request));
        }

        #[test]
        fn any_percentage_round_trips(whole in 0u32..=100, hundredths in 0u32..100) {
            prop_assume!(whole < 100 || hundredths == 0);
            let text = format!("max-slowdown={whole}.{hundredths:02}%");
            let table = TierTable::default_table();
            let request = parse_power_flex(&text, &table).unwrap();
            let expected = f64::from(whole * 100 + hundredths) / 10_000.0;
            prop_assert_eq!(request.service.max_slowdown(), Some(SlowdownFraction(expected)));
            prop_assert_eq!(parse_power_flex(&request.to_string(), &table), Ok(request));
        }
    }
}
