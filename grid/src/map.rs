//! Pure mapping from OpenADR 3 events to powerflex grid events, and the reconciliation
//! that keeps the controller's events equal to what the VTN asks for. No I/O, no clock:
//! `now_ms` is passed in, so every rule here is a table-driven test.
//!
//! One VTN event becomes at most one powerflex event:
//! - its intervals are resolved to absolute times (an interval's own `intervalPeriod`, or
//!   the event's, intervals following one another);
//! - each interval carries one payload powerflex acts on: `SIMPLE` (a level, mapped to a
//!   cut of the base budget through `simple_levels_pct`) or `IMPORT_CAPACITY_LIMIT` (kW,
//!   minus the site's other load, becomes a `--target` budget);
//! - leading and trailing intervals with no cut are dropped; the rest must be contiguous;
//! - the deepest interval sets the cut; shallower intervals before the first deepest one
//!   and after the last are the ramp, and powerflex ramps linearly over the shorter of the
//!   two (its ramps are symmetric);
//! - anything malformed or out of range is refused with a reason and never applied.

use std::collections::{BTreeMap, BTreeSet};

use openleadr_wire::event::{EventType, EventValuesMap};
use openleadr_wire::values_map::Value;
use openleadr_wire::{Event, Unit};
use powerflex_core::config::OpenAdrConfig;
use powerflex_proto::admin::AdminOp;
use powerflex_proto::event::{Cut, Event as PfEvent};
use powerflex_proto::status::CtldStatus;
use serde::{Deserialize, Serialize};

/// What the mapping needs from the site config.
#[derive(Debug, Clone, PartialEq)]
pub struct Mapping {
    /// Cut fraction per `SIMPLE` level, index = level.
    pub simple_level_cuts: Vec<f64>,
    /// Subtracted from an import capacity limit, kW.
    pub other_load_kw: f64,
    pub max_event_duration_ms: u64,
    /// Program → the power domain its events cut (a program not listed: the site).
    pub program_domains: BTreeMap<String, String>,
}

impl Mapping {
    pub fn from_config(config: &OpenAdrConfig) -> Mapping {
        Mapping {
            simple_level_cuts: config.simple_level_cuts.clone(),
            other_load_kw: config.other_load_kw,
            max_event_duration_ms: config.max_event_duration_s.saturating_mul(1000),
            program_domains: config.program_domains.clone(),
        }
    }

    /// What `event` of `program` asks of the site at `now_ms`: [`interpret`], cutting the
    /// program's power domain where the site maps it to one.
    pub fn interpret_for(&self, program: &str, event: &Event, now_ms: u64) -> Meaning {
        match interpret(event, self, now_ms) {
            Meaning::Apply(request) => Meaning::Apply(Request {
                domain: self.program_domains.get(program).cloned(),
                ..request
            }),
            other => other,
        }
    }
}

/// The powerflex event a VTN event asks for: the fields of `event-add`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    pub cut: Cut,
    pub start_ms: u64,
    pub duration_ms: u64,
    pub ramp_ms: u64,
    /// The power domain the event cuts (its program's, `grid.openadr.program_domains`);
    /// none: the site.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
}

impl Request {
    /// The controller's `event-add` for this request, the one way the VEN asks for it
    /// (a grid event's and a program's safe mode alike).
    pub fn event_add(&self) -> AdminOp {
        AdminOp::EventAdd {
            cut: self.cut,
            start_ms: self.start_ms,
            duration_ms: self.duration_ms,
            ramp_ms: self.ramp_ms,
            domain: self.domain.clone(),
        }
    }

    pub fn end_ms(&self) -> u64 {
        self.start_ms.saturating_add(self.duration_ms)
    }

    /// Whether a controller event is this request (the controller stores exactly what
    /// it was sent).
    pub fn matches(&self, event: &PfEvent) -> bool {
        event.cut == self.cut
            && event.start_ms == self.start_ms
            && event.duration_ms == self.duration_ms
            && event.ramp_ms == self.ramp_ms
            && event.domain == self.domain
    }

    /// In force (ramping or held) at `now_ms`.
    pub fn in_force(&self, now_ms: u64) -> bool {
        self.start_ms <= now_ms && now_ms < self.end_ms()
    }
}

/// What a VTN event means for the site.
#[derive(Debug, Clone, PartialEq)]
pub enum Meaning {
    /// Apply this powerflex event.
    Apply(Request),
    /// Nothing to do: the event is over, or it cuts nothing.
    Nothing { why: &'static str },
    /// Malformed or out of range: logged with the reason, never applied.
    Refused(String),
}

/// The payload kinds powerflex acts on.
const ACCEPTED_TYPES: &str = "SIMPLE (level), IMPORT_CAPACITY_LIMIT (kW)";

fn ms_of(t: chrono::DateTime<chrono::Utc>) -> Option<u64> {
    u64::try_from(t.timestamp_millis()).ok()
}

/// One interval, resolved.
#[derive(Debug, Clone, Copy)]
struct Span {
    start_ms: u64,
    end_ms: u64,
    cut: Cut,
}

/// How deep a cut is, for ordering cuts of one kind: larger is deeper.
fn depth(cut: Cut) -> f64 {
    match cut {
        Cut::Reduce { fraction } => fraction,
        Cut::Target { budget_w } => -budget_w,
    }
}

fn cuts_nothing(cut: Cut) -> bool {
    matches!(cut, Cut::Reduce { fraction } if fraction <= 0.0)
}

/// What one interval's payloads ask for.
fn payload_cut(
    index: usize,
    payloads: &[EventValuesMap],
    kw_units: bool,
    mapping: &Mapping,
) -> Result<Cut, String> {
    let acted: Vec<&EventValuesMap> = payloads
        .iter()
        .filter(|p| {
            matches!(
                p.value_type,
                EventType::Simple | EventType::ImportCapacityLimit
            )
        })
        .collect();
    let payload = match acted.as_slice() {
        [one] => *one,
        [] => {
            return Err(format!(
                "interval {index} carries no payload powerflex acts on; accepted: {ACCEPTED_TYPES}"
            ))
        }
        _ => {
            return Err(format!(
                "interval {index} carries {} payloads powerflex acts on; accepted: exactly one of {ACCEPTED_TYPES}",
                acted.len()
            ))
        }
    };
    let [value] = payload.values.as_slice() else {
        return Err(format!(
            "interval {index}: {} values in one payload; accepted: exactly one",
            payload.values.len()
        ));
    };
    match payload.value_type {
        EventType::Simple => {
            let levels = mapping.simple_level_cuts.len();
            let level = match value {
                Value::Integer(i) => *i,
                other => {
                    return Err(format!(
                    "interval {index}: SIMPLE level {other:?} is not an integer; accepted: 0 to {}",
                    levels.saturating_sub(1)
                ))
                }
            };
            let fraction = usize::try_from(level)
                .ok()
                .and_then(|l| mapping.simple_level_cuts.get(l))
                .ok_or_else(|| {
                    format!(
                        "interval {index}: SIMPLE level {level} is out of range; accepted: 0 to {} (grid.openadr.simple_levels_pct)",
                        levels.saturating_sub(1)
                    )
                })?;
            Ok(Cut::Reduce {
                fraction: *fraction,
            })
        }
        _ => {
            if !kw_units {
                return Err(format!(
                    "interval {index}: IMPORT_CAPACITY_LIMIT in units other than KW; accepted: KW"
                ));
            }
            let kw = match value {
                Value::Number(n) => *n,
                Value::Integer(i) => *i as f64,
                other => {
                    return Err(format!(
                        "interval {index}: import capacity limit {other:?} is not a number; accepted: kW above the site's other load ({} kW)",
                        mapping.other_load_kw
                    ))
                }
            };
            let gpu_kw = kw - mapping.other_load_kw;
            if !kw.is_finite() || gpu_kw <= 0.0 || kw > 1e7 {
                return Err(format!(
                    "interval {index}: import capacity limit {kw} kW is out of range; accepted: above the site's other load ({} kW) and at most 10000000 kW",
                    mapping.other_load_kw
                ));
            }
            Ok(Cut::Target {
                budget_w: gpu_kw * 1000.0,
            })
        }
    }
}

/// What `event` asks of the site at `now_ms`.
pub fn interpret(event: &Event, mapping: &Mapping, now_ms: u64) -> Meaning {
    match spans(event, mapping) {
        Err(reason) => Meaning::Refused(reason),
        Ok(spans) => shape(&spans, mapping, now_ms),
    }
}

fn spans(event: &Event, mapping: &Mapping) -> Result<Vec<Span>, String> {
    let content = &event.content;
    let intervals = match content.intervals.as_deref() {
        Some(list) if !list.is_empty() => list,
        _ => return Err("the event has no intervals; accepted: at least one".into()),
    };
    if intervals.len() > MAX_INTERVALS {
        return Err(format!(
            "the event has {} intervals; accepted: at most {MAX_INTERVALS}",
            intervals.len()
        ));
    }
    // IMPORT_CAPACITY_LIMIT values are kW unless the event says otherwise.
    let kw_units = content
        .payload_descriptors
        .iter()
        .flatten()
        .filter(|d| d.payload_type == EventType::ImportCapacityLimit)
        .all(|d| d.units.as_ref().is_none_or(|u| *u == Unit::KW));
    // "Now" in OpenADR is the zero date; read it as the time the VTN last changed the
    // event, which every poll sees the same, so a re-read is not a new event.
    let anchor = event.modification_date_time;
    let resolve = |t: chrono::DateTime<chrono::Utc>| {
        if chrono::Datelike::year(&t) == 1 {
            anchor
        } else {
            t
        }
    };
    let default = content.interval_period.as_ref();
    let mut cursor: Option<chrono::DateTime<chrono::Utc>> = default.map(|p| resolve(p.start));
    let mut out = Vec::with_capacity(intervals.len());
    for (index, interval) in intervals.iter().enumerate() {
        let own = interval.interval_period.as_ref();
        let start = match (own, cursor) {
            (Some(p), _) => resolve(p.start),
            (None, Some(c)) => c,
            (None, None) => {
                return Err(format!(
                    "interval {index} has no start (no intervalPeriod on it or on the event); accepted: an intervalPeriod with a start"
                ))
            }
        };
        let duration = own
            .and_then(|p| p.duration.as_ref())
            .or_else(|| default.and_then(|p| p.duration.as_ref()))
            .or(content.duration.as_ref())
            .ok_or_else(|| {
                format!(
                    "interval {index} has no duration; accepted: an ISO 8601 duration such as PT1H"
                )
            })?;
        let length = interval_length(index, duration, start, mapping)?;
        let length_ms = u64::try_from(length.num_milliseconds()).unwrap_or(0);
        if length_ms == 0 {
            return Err(format!(
                "interval {index} lasts {duration}; accepted: a positive duration"
            ));
        }
        if length_ms > mapping.max_event_duration_ms {
            return Err(too_long(index, duration, mapping));
        }
        let start_ms = ms_of(start).ok_or_else(|| {
            format!("interval {index} starts before 1970 ({start}); accepted: a real date")
        })?;
        let cut = payload_cut(index, &interval.payloads, kw_units, mapping)?;
        let end_ms = start_ms.saturating_add(length_ms);
        cursor = Some(start + length);
        out.push(Span {
            start_ms,
            end_ms,
            cut,
        });
    }
    Ok(out)
}

fn too_long(index: usize, duration: &openleadr_wire::Duration, mapping: &Mapping) -> String {
    format!(
        "interval {index} lasts {duration}, longer than grid.openadr.max_event_duration_s ({} s)",
        mapping.max_event_duration_ms / 1000
    )
}

/// How long `duration` lasts from `start`. The library's own conversion panics when the
/// sum leaves chrono's range (a VTN may serve `PT99999999999999999999S`), so it runs only
/// on durations whose upper bound from their fields (366-day years, 31-day months) is
/// under two years. Anything longer is over `max_event_duration_s` (at most 7 days)
/// whatever its start: the true length is at least the bound over 31/28.
fn interval_length(
    index: usize,
    duration: &openleadr_wire::Duration,
    start: chrono::DateTime<chrono::Utc>,
    mapping: &Mapping,
) -> Result<chrono::Duration, String> {
    const DAY_S: f64 = 86_400.0;
    const CONVERTIBLE_S: f64 = 2.0 * 366.0 * DAY_S;
    // The wire type keeps its fields private; its text is the ISO 8601 form of them.
    let fields: iso8601_duration::Duration = duration.to_string().parse().map_err(|_| {
        format!("interval {index}: duration {duration} cannot be read; accepted: an ISO 8601 duration such as PT1H")
    })?;
    let parts = [
        (fields.year, 366.0 * DAY_S),
        (fields.month, 31.0 * DAY_S),
        (fields.day, DAY_S),
        (fields.hour, 3600.0),
        (fields.minute, 60.0),
        (fields.second, 1.0),
    ];
    if parts.iter().any(|(n, _)| !n.is_finite() || *n < 0.0) {
        return Err(format!(
            "interval {index}: duration {duration} has a part that is not a finite, non-negative number; accepted: an ISO 8601 duration such as PT1H"
        ));
    }
    let upper_s: f64 = parts.iter().map(|(n, s)| f64::from(*n) * s).sum();
    if upper_s > CONVERTIBLE_S {
        return Err(too_long(index, duration, mapping));
    }
    Ok(duration.to_chrono_at_datetime(start))
}

/// The most intervals one VTN event may carry (a week of 5-minute prices is 2,016).
pub const MAX_INTERVALS: usize = 10_000;

/// The most VTN events the VEN applies at once, over all its programs. A program has a
/// handful; a VTN serving thousands (by mistake or not) would otherwise fill the
/// controller's event list (`MAX_PENDING_EVENTS`, 256, shared with the admins' events)
/// and make every allocation scan them.
pub const MAX_APPLIED_EVENTS: usize = 64;

/// Keeps at most `most` events to apply: the ones starting first (then by VTN id); the
/// rest are refused with the reason, logged, and applied in a later round once earlier
/// ones end. An event in force starts before any ahead of it, so it is never displaced
/// by a new one further out.
pub fn bound_applied(view: &mut VtnView, most: usize) {
    let mut applied: Vec<(u64, String)> = view
        .events
        .iter()
        .filter_map(|(id, (_, meaning))| match meaning {
            Meaning::Apply(request) => Some((request.start_ms, id.clone())),
            _ => None,
        })
        .collect();
    if applied.len() <= most {
        return;
    }
    applied.sort();
    let total = applied.len();
    for (_, id) in applied.into_iter().skip(most) {
        if let Some((_, meaning)) = view.events.get_mut(&id) {
            *meaning = Meaning::Refused(format!(
                "the VTN asks for {total} events in force or ahead at once; accepted: at most {most}, the earliest first (this one waits for a later round)"
            ));
        }
    }
}

fn shape(spans: &[Span], mapping: &Mapping, now_ms: u64) -> Meaning {
    let mut spans: Vec<Span> = spans.to_vec();
    spans.sort_by_key(|s| s.start_ms);
    let kinds: BTreeSet<bool> = spans
        .iter()
        .map(|s| matches!(s.cut, Cut::Reduce { .. }))
        .collect();
    if kinds.len() > 1 {
        return Meaning::Refused(
            "the event mixes SIMPLE levels and IMPORT_CAPACITY_LIMIT; accepted: one kind per event"
                .into(),
        );
    }
    for pair in spans.windows(2) {
        if pair[1].start_ms != pair[0].end_ms {
            return Meaning::Refused(format!(
                "intervals are not contiguous (one ends at {} ms, the next starts at {} ms); accepted: each interval starting where the one before ends",
                pair[0].end_ms, pair[1].start_ms
            ));
        }
    }
    // Announcement or wind-down intervals that cut nothing are not part of the event.
    let first = spans.iter().position(|s| !cuts_nothing(s.cut));
    let last = spans.iter().rposition(|s| !cuts_nothing(s.cut));
    let (Some(first), Some(last)) = (first, last) else {
        return Meaning::Nothing {
            why: "every interval cuts nothing",
        };
    };
    let spans = &spans[first..=last];
    let deepest = spans
        .iter()
        .map(|s| s.cut)
        .max_by(|a, b| depth(*a).total_cmp(&depth(*b)))
        .unwrap_or(spans[0].cut);
    let first_deep = spans
        .iter()
        .position(|s| s.cut == deepest)
        .unwrap_or_default();
    let last_deep = spans
        .iter()
        .rposition(|s| s.cut == deepest)
        .unwrap_or_default();
    let start_ms = spans[0].start_ms;
    let end_ms = spans[spans.len() - 1].end_ms;
    let lead_ms = spans[first_deep].start_ms - start_ms;
    let trail_ms = end_ms - spans[last_deep].end_ms;
    let duration_ms = end_ms - start_ms;
    if duration_ms > mapping.max_event_duration_ms {
        return Meaning::Refused(format!(
            "the event lasts {} s, longer than grid.openadr.max_event_duration_s ({} s)",
            duration_ms / 1000,
            mapping.max_event_duration_ms / 1000
        ));
    }
    if end_ms <= now_ms {
        return Meaning::Nothing {
            why: "the event is over",
        };
    }
    Meaning::Apply(Request {
        cut: deepest,
        start_ms,
        duration_ms,
        ramp_ms: lead_ms.min(trail_ms),
        domain: None,
    })
}

// ---------------------------------------------------------------------------------------
// The ledger: which VTN event is which powerflex event, persisted by the binary.
// ---------------------------------------------------------------------------------------

/// One VTN event the VEN has acted on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// The VTN program the event belongs to (by name, as configured).
    pub program: String,
    /// What was sent to the controller for it.
    pub request: Request,
    /// The controller's event id; `None` between sending `event-add` and hearing the id
    /// (after a crash there, the event is found by its fields, never added twice).
    pub pf_id: Option<u64>,
    /// Controller events of earlier versions of this VTN event, still to cancel (the new
    /// version is added first, so the cut never lapses: the deepest event wins).
    #[serde(default)]
    pub superseded: Vec<u64>,
    /// When the last report for this event was sent, Unix ms.
    #[serde(default)]
    pub reported_ms: Option<u64>,
}

/// Version of the ledger file.
pub const LEDGER_VERSION: u32 = 1;

/// Every VTN event the VEN has acted on, by VTN event id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ledger {
    pub v: u32,
    pub events: BTreeMap<String, Entry>,
    /// Programs in safe mode (the VTN unreachable past their `after_s`): what was sent
    /// for each, and the controller event that holds its domain once its id is known.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub safe_mode: BTreeMap<String, SafeEntry>,
    /// When the VTN last answered a read, Unix ms: kept across restarts, so a VEN that
    /// restarts while the VTN is away still engages safe mode on time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_vtn_answer_ms: Option<u64>,
}

/// One program's safe mode as the ledger keeps it: recorded before `event-add` is sent
/// (`pf_id` none), so an event sent just before a crash is found again by its fields and
/// lifted, never left in force or added twice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SafeEntry {
    pub request: Request,
    pub pf_id: Option<u64>,
}

impl Default for Ledger {
    fn default() -> Ledger {
        Ledger::new()
    }
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger {
            v: LEDGER_VERSION,
            events: BTreeMap::new(),
            safe_mode: BTreeMap::new(),
            last_vtn_answer_ms: None,
        }
    }

    /// Controller event ids the ledger accounts for (safe modes' included: they are the
    /// VEN's own, never a VTN event's to adopt).
    fn claimed(&self) -> BTreeSet<u64> {
        self.events
            .values()
            .flat_map(|e| e.pf_id.into_iter().chain(e.superseded.iter().copied()))
            .chain(self.safe_mode.values().filter_map(|e| e.pf_id))
            .collect()
    }
}

/// The site's safe-mode rules: per program, its mode; where its events go; how long a
/// safe-mode event is asked for (it is engaged again if it ends while the VTN is still
/// away).
#[derive(Debug, Clone, Copy)]
pub struct SafeModeRules<'a> {
    pub modes: &'a BTreeMap<String, powerflex_core::config::SafeMode>,
    pub mapping: &'a Mapping,
    pub duration_ms: u64,
}

/// A program's safe mode to engage, adopt or lift (see [`safe_mode_actions`]).
#[derive(Debug, Clone, PartialEq)]
pub enum SafeAction {
    /// Record `request` as the program's safe mode (pending), then send `event-add` for
    /// it and record its id.
    Engage { program: String, request: Request },
    /// A pending safe mode's event is at the controller already (sent before a crash):
    /// take its id.
    Adopt { program: String, pf_id: u64 },
    /// Cancel the program's safe-mode event, if it has one at the controller (a
    /// controller that no longer has it is fine), and forget it.
    Lift { program: String, pf_id: Option<u64> },
}

/// The controller event a pending safe mode was sent as, found by its fields among the
/// events no ledger entry claims.
fn sent_before(entry: &SafeEntry, ledger: &Ledger, ctld: &[PfEvent]) -> Option<u64> {
    let claimed = ledger.claimed();
    ctld.iter()
        .find(|e| !claimed.contains(&e.id) && entry.request.matches(e))
        .map(|e| e.id)
}

/// What the VEN does about its programs' safe modes at `now_ms`. While the VTN answers
/// (`vtn_answers`), every safe mode is lifted (a pending one's event, sent before a
/// crash, found by its fields). When it has not answered since `last_answer_ms` for a
/// program's `after_s` or longer, that program's safe mode is engaged: an event holding
/// its domain (or the site) to the mode's limit from now for `duration_ms` (the longest
/// event the site applies). A pending one whose event is at the controller is adopted;
/// one whose event the controller no longer holds (it ended, or an admin cancelled it)
/// is engaged again.
pub fn safe_mode_actions(
    rules: &SafeModeRules<'_>,
    now_ms: u64,
    vtn_answers: bool,
    last_answer_ms: u64,
    ledger: &Ledger,
    ctld: &[PfEvent],
) -> Vec<SafeAction> {
    let SafeModeRules {
        modes,
        mapping,
        duration_ms,
    } = *rules;
    let mut out = Vec::new();
    if vtn_answers {
        for (program, entry) in &ledger.safe_mode {
            out.push(SafeAction::Lift {
                program: program.clone(),
                pf_id: entry.pf_id.or_else(|| sent_before(entry, ledger, ctld)),
            });
        }
        return out;
    }
    let silent_ms = now_ms.saturating_sub(last_answer_ms);
    for (program, mode) in modes {
        match ledger.safe_mode.get(program) {
            Some(SafeEntry {
                pf_id: Some(id), ..
            }) if ctld.iter().any(|e| e.id == *id) => continue,
            Some(entry @ SafeEntry { pf_id: None, .. }) => {
                if let Some(pf_id) = sent_before(entry, ledger, ctld) {
                    out.push(SafeAction::Adopt {
                        program: program.clone(),
                        pf_id,
                    });
                    continue;
                }
            }
            _ => {}
        }
        if silent_ms < mode.after_s.saturating_mul(1000) {
            continue;
        }
        out.push(SafeAction::Engage {
            program: program.clone(),
            request: Request {
                cut: Cut::Target {
                    budget_w: mode.gpu_limit.0,
                },
                start_ms: now_ms,
                duration_ms,
                ramp_ms: 0,
                domain: mapping.program_domains.get(program).cloned(),
            },
        });
    }
    out
}

/// One step toward the VTN's wishes. The binary executes them in order and records each
/// in the ledger (persisted) before the next.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send `event-add`; first record `request` as pending on `vtn_id` (moving its current
    /// controller event, if any, to `superseded`).
    Add {
        vtn_id: String,
        program: String,
        request: Request,
    },
    /// A pending entry's event is at the controller already (sent before a crash): take
    /// its id.
    Adopt { vtn_id: String, pf_id: u64 },
    /// Send `event-cancel` for `pf_id` (an earlier version, or a deleted VTN event), then
    /// drop it from the ledger; a controller that no longer has it is fine.
    Cancel { vtn_id: String, pf_id: u64 },
    /// Drop the entry: its VTN event is gone or over and nothing is left to cancel.
    Forget { vtn_id: String },
}

impl Action {
    /// The VTN event the action is for.
    pub fn vtn_id(&self) -> &str {
        match self {
            Action::Add { vtn_id, .. }
            | Action::Adopt { vtn_id, .. }
            | Action::Cancel { vtn_id, .. }
            | Action::Forget { vtn_id } => vtn_id,
        }
    }
}

/// The VTN's view this round, for the programs that could be read.
#[derive(Debug, Clone, Default)]
pub struct VtnView {
    /// Programs whose event lists were read completely this round. Entries of other
    /// programs are left alone: a VTN that failed to answer has not cancelled anything.
    pub programs_read: BTreeSet<String>,
    /// Per VTN event id: its program and what it means now.
    pub events: BTreeMap<String, (String, Meaning)>,
}

/// The actions that make the controller's events match the VTN's view.
///
/// Idempotent: run again on the state the actions produce, it returns nothing. Ordering
/// is by VTN event id, adds before cancels of the same id.
pub fn reconcile(now_ms: u64, view: &VtnView, ledger: &Ledger, ctld: &[PfEvent]) -> Vec<Action> {
    let at_ctld = |id: u64| ctld.iter().any(|e| e.id == id);
    let claimed = ledger.claimed();
    let mut adopted: BTreeSet<u64> = BTreeSet::new();
    let mut actions = Vec::new();
    for (vtn_id, (program, meaning)) in &view.events {
        let entry = ledger.events.get(vtn_id);
        match meaning {
            Meaning::Apply(request) => {
                let add = Action::Add {
                    vtn_id: vtn_id.clone(),
                    program: program.clone(),
                    request: request.clone(),
                };
                match entry {
                    None => actions.push(add),
                    Some(e) if e.pf_id.is_none() => {
                        // Sent before a crash? Look for it by its fields.
                        let found = ctld.iter().find(|c| {
                            e.request.matches(c)
                                && !claimed.contains(&c.id)
                                && !adopted.contains(&c.id)
                        });
                        match found {
                            Some(c) => {
                                adopted.insert(c.id);
                                actions.push(Action::Adopt {
                                    vtn_id: vtn_id.clone(),
                                    pf_id: c.id,
                                });
                            }
                            None if e.request.end_ms() <= now_ms => {}
                            None => actions.push(add),
                        }
                    }
                    Some(e) => {
                        let same = e.request == *request;
                        let lost =
                            e.pf_id.is_some_and(|id| !at_ctld(id)) && request.end_ms() > now_ms;
                        if !same || lost {
                            actions.push(add);
                        }
                        // The earlier version goes once the new one is in (the deepest
                        // event wins at the controller, so the overlap cuts no less).
                        if let Some(old) = e.pf_id.filter(|&id| !same && at_ctld(id)) {
                            actions.push(Action::Cancel {
                                vtn_id: vtn_id.clone(),
                                pf_id: old,
                            });
                        }
                    }
                }
            }
            Meaning::Nothing { .. } => {
                if let Some(e) = entry {
                    // Over, or changed to cut nothing: what was applied goes.
                    withdraw(vtn_id, e, ctld, &claimed, &mut adopted, &mut actions);
                }
            }
            // A malformed update leaves the last valid instruction in force.
            Meaning::Refused(_) => {}
        }
        if let Some(e) = entry {
            for id in &e.superseded {
                let cancel = Action::Cancel {
                    vtn_id: vtn_id.clone(),
                    pf_id: *id,
                };
                if !actions.contains(&cancel) {
                    actions.push(cancel);
                }
            }
        }
    }
    // Deleted at the VTN (the OpenADR way to cancel an event).
    for (vtn_id, e) in &ledger.events {
        if view.events.contains_key(vtn_id) || !view.programs_read.contains(&e.program) {
            continue;
        }
        withdraw(vtn_id, e, ctld, &claimed, &mut adopted, &mut actions);
    }
    actions
}

/// Cancels what `e` put at the controller and forgets it. A pending entry (sent, id not
/// heard) cancels the unclaimed controller event that matches it, if there is one.
fn withdraw(
    vtn_id: &str,
    e: &Entry,
    ctld: &[PfEvent],
    claimed: &BTreeSet<u64>,
    adopted: &mut BTreeSet<u64>,
    actions: &mut Vec<Action>,
) {
    let pending = e.pf_id.is_none().then(|| {
        ctld.iter()
            .find(|c| e.request.matches(c) && !claimed.contains(&c.id) && !adopted.contains(&c.id))
            .map(|c| c.id)
    });
    let ids = e
        .pf_id
        .iter()
        .chain(e.superseded.iter())
        .copied()
        .chain(pending.flatten());
    for id in ids {
        if ctld.iter().any(|c| c.id == id) {
            adopted.insert(id);
            actions.push(Action::Cancel {
                vtn_id: vtn_id.to_string(),
                pf_id: id,
            });
        }
    }
    actions.push(Action::Forget {
        vtn_id: vtn_id.to_string(),
    });
}

/// Records that `action` was carried out (`pf_id`: the id the controller gave an
/// `Add`). The binary persists the ledger after each call.
pub fn record(ledger: &mut Ledger, action: &Action, pf_id: Option<u64>) {
    match action {
        Action::Add {
            vtn_id,
            program,
            request,
        } => {
            let entry = ledger.events.entry(vtn_id.clone()).or_insert(Entry {
                program: program.clone(),
                request: request.clone(),
                pf_id: None,
                superseded: Vec::new(),
                reported_ms: None,
            });
            if let Some(old) = entry.pf_id.take() {
                if Some(old) != pf_id && !entry.superseded.contains(&old) {
                    entry.superseded.push(old);
                }
            }
            entry.request = request.clone();
            entry.program = program.clone();
            entry.pf_id = pf_id;
        }
        Action::Adopt { vtn_id, pf_id } => {
            if let Some(e) = ledger.events.get_mut(vtn_id) {
                e.pf_id = Some(*pf_id);
            }
        }
        Action::Cancel { vtn_id, pf_id } => {
            if let Some(e) = ledger.events.get_mut(vtn_id) {
                e.superseded.retain(|id| id != pf_id);
                if e.pf_id == Some(*pf_id) {
                    e.pf_id = None;
                }
            }
        }
        Action::Forget { vtn_id } => {
            ledger.events.remove(vtn_id);
        }
    }
}

/// VTN events due a report at `now_ms`: in force, and never reported or last reported at
/// least `interval_ms` ago.
pub fn reports_due(ledger: &Ledger, now_ms: u64, interval_ms: u64) -> Vec<String> {
    ledger
        .events
        .iter()
        .filter(|(_, e)| e.pf_id.is_some() && e.request.in_force(now_ms))
        .filter(|(_, e)| {
            e.reported_ms
                .is_none_or(|last| now_ms.saturating_sub(last) >= interval_ms)
        })
        .map(|(id, _)| id.clone())
        .collect()
}

/// What a report for an event of `domain` (none: the site's) tells the utility: the
/// metered draw and the budget in force there, W. None while the controller does not
/// hear every node behind it (its summed draw would be too low) or does not know the
/// domain.
pub fn reported_w(domain: Option<&str>, status: &CtldStatus) -> Option<(f64, f64)> {
    match domain {
        None => draw_known(status.nodes.iter().map(|n| n.live))
            .then_some((status.draw_w, status.budget_w)),
        Some(name) => status
            .domains
            .iter()
            .find(|d| d.name == name)
            .filter(|d| d.nodes > 0 && d.live_nodes == d.nodes)
            .map(|d| (d.draw_w, d.budget_w)),
    }
}

/// Whether the controller's summed draw covers the site: at least one node, every node
/// live (reported within its lease).
pub fn draw_known(live: impl IntoIterator<Item = bool>) -> bool {
    let mut any = false;
    for l in live {
        if !l {
            return false;
        }
        any = true;
    }
    any
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const T0: u64 = 1_800_000_000_000; // 2027-01-15T08:00:00Z

    fn mapping() -> Mapping {
        Mapping {
            simple_level_cuts: vec![0.0, 0.1, 0.2, 0.3],
            other_load_kw: 40.0,
            max_event_duration_ms: 86_400_000,
            program_domains: BTreeMap::new(),
        }
    }

    fn iso(ms: u64) -> String {
        chrono::DateTime::from_timestamp_millis(ms as i64)
            .unwrap()
            .to_rfc3339()
    }

    /// A VTN event as the VTN serves it, from JSON: `intervals` is the JSON array.
    fn event(id: &str, period: &str, intervals: &str) -> Event {
        let text = format!(
            r#"{{"id":"{id}","createdDateTime":"{c}","modificationDateTime":"{c}",
                "objectType":"EVENT","programID":"p1","priority":null,
                {period}
                "intervals":{intervals}}}"#,
            c = iso(T0 - 60_000)
        );
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    fn simple(level: i64) -> String {
        format!(r#"[{{"type":"SIMPLE","values":[{level}]}}]"#)
    }

    fn period(start_ms: u64, duration: &str) -> String {
        format!(
            r#""intervalPeriod":{{"start":"{}","duration":"{duration}"}},"#,
            iso(start_ms)
        )
    }

    #[test]
    fn one_simple_interval_is_a_stepped_cut() {
        let e = event(
            "e1",
            &period(T0, "PT1H"),
            &format!(r#"[{{"id":0,"payloads":{}}}]"#, simple(3)),
        );
        assert_eq!(
            interpret(&e, &mapping(), T0),
            Meaning::Apply(Request {
                cut: Cut::Reduce { fraction: 0.3 },
                start_ms: T0,
                duration_ms: 3_600_000,
                ramp_ms: 0,
                domain: None,
            })
        );
    }

    #[test]
    fn shallower_intervals_either_side_are_the_ramp() {
        // Announcement at level 0, ramp-in 10 min at level 1, 1 h at level 3, ramp-out
        // 5 min at level 2: sequential intervals under the event's period.
        let intervals = format!(
            r#"[{{"id":0,"payloads":{l0}}},
                {{"id":1,"intervalPeriod":{{"start":"{a}","duration":"PT10M"}},"payloads":{l1}}},
                {{"id":2,"intervalPeriod":{{"start":"{b}","duration":"PT1H"}},"payloads":{l3}}},
                {{"id":3,"intervalPeriod":{{"start":"{c}","duration":"PT5M"}},"payloads":{l2}}}]"#,
            l0 = simple(0),
            l1 = simple(1),
            l3 = simple(3),
            l2 = simple(2),
            a = iso(T0 + 900_000),
            b = iso(T0 + 1_500_000),
            c = iso(T0 + 5_100_000),
        );
        let e = event("e2", &period(T0, "PT15M"), &intervals);
        assert_eq!(
            interpret(&e, &mapping(), T0),
            Meaning::Apply(Request {
                cut: Cut::Reduce { fraction: 0.3 },
                start_ms: T0 + 900_000,
                duration_ms: 75 * 60_000,
                ramp_ms: 5 * 60_000,
                domain: None,
            })
        );
    }

    #[test]
    fn intervals_without_their_own_period_follow_one_another() {
        let intervals = format!(
            r#"[{{"id":0,"payloads":{}}},{{"id":1,"payloads":{}}},{{"id":2,"payloads":{}}}]"#,
            simple(1),
            simple(2),
            simple(1)
        );
        let e = event("e3", &period(T0, "PT10M"), &intervals);
        assert_eq!(
            interpret(&e, &mapping(), T0),
            Meaning::Apply(Request {
                cut: Cut::Reduce { fraction: 0.2 },
                start_ms: T0,
                duration_ms: 1_800_000,
                ramp_ms: 600_000,
                domain: None,
            })
        );
    }

    #[test]
    fn an_import_capacity_limit_becomes_a_target_net_of_other_load() {
        let e = event(
            "e4",
            &period(T0, "PT2H"),
            r#"[{"id":0,"payloads":[{"type":"IMPORT_CAPACITY_LIMIT","values":[52.5]}]}]"#,
        );
        assert_eq!(
            interpret(&e, &mapping(), T0),
            Meaning::Apply(Request {
                cut: Cut::Target { budget_w: 12_500.0 },
                start_ms: T0,
                duration_ms: 7_200_000,
                ramp_ms: 0,
                domain: None,
            })
        );
    }

    #[test]
    fn the_zero_date_means_when_the_vtn_last_changed_the_event() {
        let e = event(
            "e5",
            r#""intervalPeriod":{"start":"0001-01-01T00:00:00Z","duration":"PT30M"},"#,
            &format!(r#"[{{"id":0,"payloads":{}}}]"#, simple(2)),
        );
        let Meaning::Apply(r) = interpret(&e, &mapping(), T0) else {
            panic!("applied")
        };
        assert_eq!(r.start_ms, T0 - 60_000);
        // Read again later: the same request, so nothing new is sent.
        assert_eq!(interpret(&e, &mapping(), T0 + 5000), Meaning::Apply(r));
    }

    #[test]
    fn over_or_empty_events_do_nothing() {
        let e = event(
            "e6",
            &period(T0 - 7_200_000, "PT1H"),
            &format!(r#"[{{"id":0,"payloads":{}}}]"#, simple(3)),
        );
        assert!(matches!(
            interpret(&e, &mapping(), T0),
            Meaning::Nothing { .. }
        ));
        let e = event(
            "e7",
            &period(T0, "PT1H"),
            &format!(r#"[{{"id":0,"payloads":{}}}]"#, simple(0)),
        );
        assert!(matches!(
            interpret(&e, &mapping(), T0),
            Meaning::Nothing { .. }
        ));
    }

    #[test]
    fn malformed_and_out_of_range_events_are_refused_with_a_reason() {
        let one = |payloads: &str| format!(r#"[{{"id":0,"payloads":{payloads}}}]"#);
        let cases: Vec<(String, String, &str)> = vec![
            (
                period(T0, "PT1H"),
                one(&simple(7)),
                "level 7 is out of range",
            ),
            (period(T0, "PT1H"), one(&simple(-1)), "out of range"),
            (
                period(T0, "PT1H"),
                one(r#"[{"type":"SIMPLE","values":[1,2]}]"#),
                "2 values",
            ),
            (
                period(T0, "PT1H"),
                one(r#"[{"type":"PRICE","values":[0.5]}]"#),
                "no payload powerflex acts on",
            ),
            (
                period(T0, "PT1H"),
                one(r#"[{"type":"IMPORT_CAPACITY_LIMIT","values":[-5.0]}]"#),
                "-5 kW is out of range",
            ),
            (
                period(T0, "PT1H"),
                one(r#"[{"type":"IMPORT_CAPACITY_LIMIT","values":[30.0]}]"#),
                "above the site's other load",
            ),
            (
                period(T0, "PT1H"),
                one(
                    r#"[{"type":"SIMPLE","values":[1]},{"type":"IMPORT_CAPACITY_LIMIT","values":[90.0]}]"#,
                ),
                "2 payloads",
            ),
            (period(T0, "P9999Y"), one(&simple(1)), "longer than"),
            (period(T0, "PT0S"), one(&simple(1)), "positive duration"),
            (String::new(), one(&simple(1)), "no start"),
            (period(T0, "PT1H"), "[]".into(), "no intervals"),
            (
                period(T0, "PT1H"),
                format!(
                    r#"[{{"id":0,"payloads":{}}},{{"id":1,"intervalPeriod":{{"start":"{}","duration":"PT1H"}},"payloads":{}}}]"#,
                    simple(1),
                    iso(T0 + 7_200_000),
                    simple(2)
                ),
                "not contiguous",
            ),
            (
                period(T0, "PT1H"),
                format!(
                    r#"[{{"id":0,"payloads":{}}},{{"id":1,"payloads":[{{"type":"IMPORT_CAPACITY_LIMIT","values":[90.0]}}]}}]"#,
                    simple(1)
                ),
                "mixes",
            ),
        ];
        for (p, intervals, needle) in cases {
            let e = event("bad", &p, &intervals);
            match interpret(&e, &mapping(), T0) {
                Meaning::Refused(reason) => {
                    assert!(reason.contains(needle), "{intervals}: {reason}");
                    assert!(
                        reason.contains("accepted") || reason.contains("max_event_duration_s"),
                        "{reason}"
                    );
                }
                other => panic!("{intervals}: expected a refusal, got {other:?}"),
            }
        }
        // Units other than kW for a capacity limit.
        let mut e = event(
            "w",
            &period(T0, "PT1H"),
            &one(r#"[{"type":"IMPORT_CAPACITY_LIMIT","values":[90.0]}]"#),
        );
        e.content.payload_descriptors = Some(vec![openleadr_wire::event::EventPayloadDescriptor {
            payload_type: EventType::ImportCapacityLimit,
            units: Some(Unit::KVA),
            currency: None,
        }]);
        assert!(matches!(interpret(&e, &mapping(), T0), Meaning::Refused(r) if r.contains("KW")));
    }

    fn request(fraction: f64, start_ms: u64) -> Request {
        Request {
            cut: Cut::Reduce { fraction },
            start_ms,
            duration_ms: 3_600_000,
            ramp_ms: 60_000,
            domain: None,
        }
    }

    /// A program mapped to a domain cuts that domain; another program the site.
    #[test]
    fn a_program_mapped_to_a_domain_cuts_that_domain() {
        let mut m = mapping();
        m.program_domains
            .insert("feed-b-dr".into(), "feed-b".into());
        let e = event(
            "e1",
            &period(T0 + 60_000, "PT1H"),
            &format!(r#"[{{"id":0,"payloads":{}}}]"#, simple(2)),
        );
        let Meaning::Apply(mapped) = m.interpret_for("feed-b-dr", &e, T0) else {
            panic!("applied");
        };
        assert_eq!(mapped.domain.as_deref(), Some("feed-b"));
        let Meaning::Apply(site) = m.interpret_for("other", &e, T0) else {
            panic!("applied");
        };
        assert_eq!(site.domain, None);
        // A controller event is the request only in the same domain.
        let at_ctld = PfEvent {
            id: 1,
            cut: mapped.cut,
            start_ms: mapped.start_ms,
            duration_ms: mapped.duration_ms,
            ramp_ms: mapped.ramp_ms,
            domain: None,
        };
        assert!(!mapped.matches(&at_ctld));
        assert!(site.matches(&at_ctld));
    }

    /// A domain's event is reported with that domain's draw and budget, the site's
    /// with the site's; either only while every node behind it is heard.
    #[test]
    fn a_report_is_of_the_draw_and_budget_where_the_event_cuts() {
        use powerflex_proto::status::{DomainStatus, NodeStatus};
        let node = |name: &str, live: bool| NodeStatus {
            node: name.into(),
            gpus: 8,
            live,
            power_w: 4000.0,
            jobs: 1,
            seen_ms_ago: 0,
            refused_reports: 0,
            refused_gpus: 0,
            domain: None,
            unmanaged_reserve_w: None,
        };
        let feed = |live_nodes: u32| DomainStatus {
            name: "feed-b".into(),
            parent: None,
            depth: 0,
            limit_w: 50_000.0,
            budget_w: 30_000.0,
            draw_w: 29_000.0,
            headroom_w: 1000.0,
            nodes: 2,
            live_nodes,
            planned_w: None,
            floors_over_w: None,
            event: Some(4),
            unmanaged_reserve_w: None,
        };
        let status: CtldStatus = serde_json::from_value(serde_json::json!({
            "base_budget_w": 100000.0, "budget_w": 100000.0, "draw_w": 61000.0,
            "headroom_w": 39000.0, "events": [], "nodes": [], "jobs": [],
        }))
        .expect("status");
        let status = CtldStatus {
            nodes: vec![node("n1", true), node("n2", true)],
            domains: vec![feed(2)],
            ..status
        };
        assert_eq!(reported_w(None, &status), Some((61_000.0, 100_000.0)));
        assert_eq!(
            reported_w(Some("feed-b"), &status),
            Some((29_000.0, 30_000.0))
        );
        assert_eq!(reported_w(Some("feed-z"), &status), None);
        let silent = CtldStatus {
            domains: vec![feed(1)],
            ..status.clone()
        };
        assert_eq!(reported_w(Some("feed-b"), &silent), None);
    }

    /// Safe mode: engaged for a program once the VTN has been away for its `after_s`,
    /// on its domain, at its limit; engaged again if its event is gone while the VTN is
    /// still away; lifted as soon as the VTN answers.
    #[test]
    fn safe_mode_holds_a_program_s_domain_while_the_vtn_is_away() {
        use powerflex_core::config::SafeMode;
        use powerflex_core::Watts;
        let mut m = mapping();
        m.program_domains
            .insert("feed-b-dr".into(), "feed-b".into());
        let modes: BTreeMap<String, SafeMode> = [
            (
                "feed-b-dr".to_string(),
                SafeMode {
                    gpu_limit: Watts(300_000.0),
                    after_s: 900,
                },
            ),
            (
                "site-dr".to_string(),
                SafeMode {
                    gpu_limit: Watts(800_000.0),
                    after_s: 3600,
                },
            ),
        ]
        .into();
        let rules = SafeModeRules {
            modes: &modes,
            mapping: &m,
            duration_ms: 86_400_000,
        };
        let mut ledger = Ledger::new();
        let last = T0;
        // Away, but not yet for 900 s: nothing.
        assert!(safe_mode_actions(&rules, T0 + 899_000, false, last, &ledger, &[]).is_empty());
        // 900 s: feed-b's safe mode, not the site's (3600 s).
        let actions = safe_mode_actions(&rules, T0 + 900_000, false, last, &ledger, &[]);
        assert_eq!(
            actions,
            [SafeAction::Engage {
                program: "feed-b-dr".into(),
                request: Request {
                    cut: Cut::Target {
                        budget_w: 300_000.0
                    },
                    start_ms: T0 + 900_000,
                    duration_ms: 86_400_000,
                    ramp_ms: 0,
                    domain: Some("feed-b".into()),
                },
            }]
        );
        // Recorded before it is sent; after a crash there its event is found by its
        // fields and adopted, not sent twice.
        let Some(SafeAction::Engage { request, .. }) = actions.first().cloned() else {
            panic!("engaged");
        };
        ledger.safe_mode.insert(
            "feed-b-dr".into(),
            SafeEntry {
                request: request.clone(),
                pf_id: None,
            },
        );
        let sent = PfEvent {
            id: 7,
            cut: request.cut,
            start_ms: request.start_ms,
            duration_ms: request.duration_ms,
            ramp_ms: request.ramp_ms,
            domain: request.domain.clone(),
        };
        assert_eq!(
            safe_mode_actions(
                &rules,
                T0 + 950_000,
                false,
                last,
                &ledger,
                std::slice::from_ref(&sent)
            ),
            [SafeAction::Adopt {
                program: "feed-b-dr".into(),
                pf_id: 7
            }]
        );
        // The VTN answers before the id was recorded: the event found by its fields is
        // cancelled.
        assert_eq!(
            safe_mode_actions(
                &rules,
                T0 + 960_000,
                true,
                T0 + 960_000,
                &ledger,
                std::slice::from_ref(&sent)
            ),
            [SafeAction::Lift {
                program: "feed-b-dr".into(),
                pf_id: Some(7)
            }]
        );
        ledger.safe_mode.insert(
            "feed-b-dr".into(),
            SafeEntry {
                request,
                pf_id: Some(7),
            },
        );
        assert!(
            ledger.claimed().contains(&7),
            "never adopted for a VTN event"
        );
        let held = PfEvent {
            id: 7,
            cut: Cut::Target {
                budget_w: 300_000.0,
            },
            start_ms: T0 + 900_000,
            duration_ms: 86_400_000,
            ramp_ms: 0,
            domain: Some("feed-b".into()),
        };
        // Held at the controller: nothing new; its event gone: engaged again.
        assert!(safe_mode_actions(
            &rules,
            T0 + 1_000_000,
            false,
            last,
            &ledger,
            std::slice::from_ref(&held)
        )
        .is_empty());
        let again = safe_mode_actions(&rules, T0 + 1_000_000, false, last, &ledger, &[]);
        assert!(
            matches!(&again[..], [SafeAction::Engage { program, .. }] if program == "feed-b-dr")
        );
        // The VTN answers: lifted.
        assert_eq!(
            safe_mode_actions(
                &rules,
                T0 + 1_100_000,
                true,
                T0 + 1_100_000,
                &ledger,
                &[held]
            ),
            [SafeAction::Lift {
                program: "feed-b-dr".into(),
                pf_id: Some(7)
            }]
        );
    }

    fn view(events: &[(&str, Meaning)]) -> VtnView {
        VtnView {
            programs_read: ["p".to_string()].into(),
            events: events
                .iter()
                .map(|(id, m)| (id.to_string(), ("p".to_string(), m.clone())))
                .collect(),
        }
    }

    /// Plays the actions against a fake controller; returns its events.
    fn execute(
        ledger: &mut Ledger,
        ctld: &mut Vec<PfEvent>,
        next_id: &mut u64,
        actions: &[Action],
    ) {
        for a in actions {
            match a {
                Action::Add { request, .. } => {
                    *next_id += 1;
                    ctld.push(PfEvent {
                        id: *next_id,
                        cut: request.cut,
                        start_ms: request.start_ms,
                        duration_ms: request.duration_ms,
                        ramp_ms: request.ramp_ms,
                        domain: None,
                    });
                    record(ledger, a, Some(*next_id));
                }
                Action::Cancel { pf_id, .. } => {
                    ctld.retain(|e| e.id != *pf_id);
                    record(ledger, a, None);
                }
                _ => record(ledger, a, None),
            }
        }
    }

    #[test]
    fn updates_and_cancellations_are_idempotent() {
        let (mut ledger, mut ctld, mut next) = (Ledger::new(), Vec::new(), 0);
        let v1 = view(&[("a", Meaning::Apply(request(0.3, T0)))]);
        let actions = reconcile(T0, &v1, &ledger, &ctld);
        assert!(matches!(actions.as_slice(), [Action::Add { .. }]));
        execute(&mut ledger, &mut ctld, &mut next, &actions);
        // Polled again: nothing to do, however often.
        for _ in 0..3 {
            assert_eq!(reconcile(T0 + 1000, &v1, &ledger, &ctld), vec![]);
        }
        // Modified at the VTN: the new version is added before the old is cancelled.
        let v2 = view(&[("a", Meaning::Apply(request(0.2, T0)))]);
        let actions = reconcile(T0 + 2000, &v2, &ledger, &ctld);
        assert!(
            matches!(
                actions.as_slice(),
                [Action::Add { .. }, Action::Cancel { pf_id: 1, .. }]
            ),
            "{actions:?}"
        );
        execute(&mut ledger, &mut ctld, &mut next, &actions);
        assert_eq!(ctld.len(), 1);
        assert!(request(0.2, T0).matches(&ctld[0]));
        assert_eq!(reconcile(T0 + 3000, &v2, &ledger, &ctld), vec![]);
        // A malformed update leaves the last valid version in force.
        let bad = view(&[("a", Meaning::Refused("nonsense".into()))]);
        assert_eq!(reconcile(T0 + 4000, &bad, &ledger, &ctld), vec![]);
        // Deleted at the VTN: cancelled, then forgotten; then nothing more.
        let gone = view(&[]);
        let actions = reconcile(T0 + 5000, &gone, &ledger, &ctld);
        assert_eq!(
            actions,
            vec![
                Action::Cancel {
                    vtn_id: "a".into(),
                    pf_id: 2
                },
                Action::Forget { vtn_id: "a".into() }
            ]
        );
        execute(&mut ledger, &mut ctld, &mut next, &actions);
        assert!(ctld.is_empty() && ledger.events.is_empty());
        assert_eq!(reconcile(T0 + 6000, &gone, &ledger, &ctld), vec![]);
    }

    #[test]
    fn a_crash_between_add_and_its_id_adopts_the_event_rather_than_adding_it_again() {
        let (mut ledger, mut ctld, mut next) = (Ledger::new(), Vec::new(), 0);
        let v = view(&[("a", Meaning::Apply(request(0.3, T0)))]);
        let actions = reconcile(T0, &v, &ledger, &ctld);
        // The ledger recorded the add as pending, the controller got it, then the VEN died.
        record(&mut ledger, &actions[0], None);
        next += 1;
        ctld.push(PfEvent {
            id: next,
            cut: Cut::Reduce { fraction: 0.3 },
            start_ms: T0,
            duration_ms: 3_600_000,
            ramp_ms: 60_000,
            domain: None,
        });
        let actions = reconcile(T0 + 1000, &v, &ledger, &ctld);
        assert_eq!(
            actions,
            vec![Action::Adopt {
                vtn_id: "a".into(),
                pf_id: 1
            }]
        );
        execute(&mut ledger, &mut ctld, &mut next, &actions);
        assert_eq!(reconcile(T0 + 2000, &v, &ledger, &ctld), vec![]);
        assert_eq!(ctld.len(), 1);
        // The crash came before the controller heard it: it is sent again, once.
        let mut ledger = Ledger::new();
        record(&mut ledger, &actions_add("b", request(0.1, T0)), None);
        let v = view(&[("b", Meaning::Apply(request(0.1, T0)))]);
        let actions = reconcile(T0, &v, &ledger, &[]);
        assert!(matches!(actions.as_slice(), [Action::Add { .. }]));
    }

    #[test]
    fn an_event_deleted_while_its_add_was_pending_is_cancelled_too() {
        let mut ledger = Ledger::new();
        record(&mut ledger, &actions_add("a", request(0.3, T0)), None);
        // The controller got it (id 5) before the VEN died; then the VTN deleted it.
        let ctld = vec![PfEvent {
            id: 5,
            cut: Cut::Reduce { fraction: 0.3 },
            start_ms: T0,
            duration_ms: 3_600_000,
            ramp_ms: 60_000,
            domain: None,
        }];
        assert_eq!(
            reconcile(T0, &view(&[]), &ledger, &ctld),
            vec![
                Action::Cancel {
                    vtn_id: "a".into(),
                    pf_id: 5
                },
                Action::Forget { vtn_id: "a".into() }
            ]
        );
    }

    fn actions_add(id: &str, request: Request) -> Action {
        Action::Add {
            vtn_id: id.into(),
            program: "p".into(),
            request,
        }
    }

    #[test]
    fn an_event_the_controller_lost_is_added_again_and_unread_programs_are_left_alone() {
        let (mut ledger, mut ctld, mut next) = (Ledger::new(), Vec::new(), 0);
        let v = view(&[("a", Meaning::Apply(request(0.3, T0)))]);
        let actions = reconcile(T0, &v, &ledger, &ctld);
        execute(&mut ledger, &mut ctld, &mut next, &actions);
        ctld.clear(); // a controller restarted without its state
        let actions = reconcile(T0 + 1000, &v, &ledger, &ctld);
        assert!(matches!(actions.as_slice(), [Action::Add { .. }]));
        execute(&mut ledger, &mut ctld, &mut next, &actions);
        assert_eq!(ledger.events["a"].pf_id, Some(2));
        // The VTN did not answer for program "p": its events are not cancelled.
        let silent = VtnView::default();
        assert_eq!(reconcile(T0 + 2000, &silent, &ledger, &ctld), vec![]);
    }

    #[test]
    fn reports_are_due_in_force_at_the_interval() {
        let mut ledger = Ledger::new();
        record(&mut ledger, &actions_add("a", request(0.3, T0)), Some(1));
        assert!(reports_due(&ledger, T0 - 1, 10_000).is_empty());
        assert_eq!(reports_due(&ledger, T0, 10_000), vec!["a".to_string()]);
        ledger.events.get_mut("a").unwrap().reported_ms = Some(T0);
        assert!(reports_due(&ledger, T0 + 9_999, 10_000).is_empty());
        assert_eq!(reports_due(&ledger, T0 + 10_000, 10_000).len(), 1);
        assert!(reports_due(&ledger, T0 + 3_600_000, 10_000).is_empty());
    }

    #[test]
    fn the_draw_is_known_only_with_every_node_live() {
        assert!(draw_known([true, true]));
        assert!(!draw_known([true, false]));
        assert!(
            !draw_known([]),
            "a controller that knows no node knows no draw"
        );
    }

    #[test]
    fn the_ledger_round_trips_as_json() {
        let mut ledger = Ledger::new();
        record(&mut ledger, &actions_add("a", request(0.3, T0)), Some(4));
        let text = serde_json::to_string(&ledger).unwrap();
        assert_eq!(serde_json::from_str::<Ledger>(&text).unwrap(), ledger);
    }

    /// Whatever a VTN serves is refused with a reason or applied within the
    /// site's limits. A duration past chrono's range made the library's conversion panic
    /// (`PT99999999999999999999S` from any start), which would have ended the VEN.
    #[test]
    fn durations_past_any_calendar_are_refused_not_a_panic() {
        let one = format!(r#"[{{"id":0,"payloads":{}}}]"#, simple(1));
        for duration in [
            "PT99999999999999999999S",
            "PT9999999999999M",
            "P99999999999Y",
            "P3000000000M",
            "P99999999999999999999DT1H",
            "P1Y1M1DT1H1M99999999999.5S",
            "P1000W",
        ] {
            let e = event("huge", &period(T0, duration), &one);
            match interpret(&e, &mapping(), T0) {
                Meaning::Refused(reason) => assert!(
                    reason.contains("max_event_duration_s") || reason.contains("accepted"),
                    "{duration}: {reason}"
                ),
                other => panic!("{duration}: expected a refusal, got {other:?}"),
            }
        }
        // The last day of the calendar, and a duration just inside the bound.
        let e = event(
            "late",
            r#""intervalPeriod":{"start":"9999-12-31T23:00:00Z","duration":"PT23H"},"#,
            &one,
        );
        assert!(matches!(interpret(&e, &mapping(), T0), Meaning::Apply(_)));
        let e = event("y", &period(T0, "P1Y"), &one);
        assert!(
            matches!(interpret(&e, &mapping(), T0), Meaning::Refused(r) if r.contains("longer than"))
        );
        // Too many intervals.
        let many = format!(
            "[{}]",
            (0..=MAX_INTERVALS)
                .map(|i| format!(r#"{{"id":{i},"payloads":{}}}"#, simple(1)))
                .collect::<Vec<_>>()
                .join(",")
        );
        let e = event("many", &period(T0, "PT1S"), &many);
        assert!(
            matches!(interpret(&e, &mapping(), T0), Meaning::Refused(r) if r.contains("at most 10000")),
        );
    }

    #[test]
    fn at_most_so_many_events_apply_the_earliest_first() {
        let mut events = Vec::new();
        for k in 0..5u64 {
            let request = request(0.1, T0 + (4 - k) * 60_000);
            events.push((format!("e{k}"), Meaning::Apply(request)));
        }
        events.push(("bad".to_string(), Meaning::Refused("level 9".into())));
        let refs: Vec<(&str, Meaning)> = events
            .iter()
            .map(|(i, m)| (i.as_str(), m.clone()))
            .collect();
        let mut v = view(&refs);
        bound_applied(&mut v, 3);
        let applied: Vec<&str> = v
            .events
            .iter()
            .filter(|(_, (_, m))| matches!(m, Meaning::Apply(_)))
            .map(|(id, _)| id.as_str())
            .collect();
        assert_eq!(applied, ["e2", "e3", "e4"], "the three starting first");
        for id in ["e0", "e1"] {
            assert!(matches!(&v.events[id].1, Meaning::Refused(r) if r.contains("at most 3")));
        }
        assert!(matches!(&v.events["bad"].1, Meaning::Refused(r) if r == "level 9"));
        // Under the bound nothing changes.
        let mut w = view(&refs);
        bound_applied(&mut w, 5);
        assert_eq!(w.events, view(&refs).events);
    }

    mod any_vtn_event {
        use super::*;
        use proptest::prelude::*;

        /// An ISO 8601 duration of random parts: small, huge, fractional or absent.
        fn duration() -> impl Strategy<Value = String> {
            let part = prop_oneof![
                Just(String::new()),
                (0u64..100).prop_map(|n| n.to_string()),
                (0u64..10_000_000).prop_map(|n| n.to_string()),
                "[0-9]{10,30}",
                (0u32..100, 0u32..1000).prop_map(|(a, b)| format!("{a}.{b}")),
            ];
            (
                part.clone(),
                part.clone(),
                part.clone(),
                part.clone(),
                part.clone(),
                part,
            )
                .prop_map(|(y, mo, d, h, mi, s)| {
                    let date: String = [(y, "Y"), (mo, "M"), (d, "D")]
                        .iter()
                        .filter(|(n, _)| !n.is_empty())
                        .map(|(n, u)| format!("{n}{u}"))
                        .collect();
                    let time: String = [(h, "H"), (mi, "M"), (s, "S")]
                        .iter()
                        .filter(|(n, _)| !n.is_empty())
                        .map(|(n, u)| format!("{n}{u}"))
                        .collect();
                    match (date.is_empty(), time.is_empty()) {
                        (true, true) => "PT0S".to_string(),
                        (_, true) => format!("P{date}"),
                        _ => format!("P{date}T{time}"),
                    }
                })
        }

        /// A start anywhere in the calendar RFC 3339 can write, the zero date included.
        fn start() -> impl Strategy<Value = String> {
            prop_oneof![
                Just("0001-01-01T00:00:00Z".to_string()),
                (1i32..=9999, 1u32..=12, 1u32..=28, 0u32..24)
                    .prop_map(|(y, m, d, h)| format!("{y:04}-{m:02}-{d:02}T{h:02}:00:00Z")),
                (-3_600_000i64..3_600_000).prop_map(|dt| iso((T0 as i64 + dt) as u64)),
            ]
        }

        fn payload() -> impl Strategy<Value = String> {
            let value = prop_oneof![
                any::<i64>().prop_map(|v| v.to_string()),
                (-5i64..10).prop_map(|v| v.to_string()),
                any::<f64>()
                    .prop_filter("JSON has no NaN or infinity", |v| v.is_finite())
                    .prop_map(|v| format!("{v:?}")),
                (-100.0f64..1e8).prop_map(|v| format!("{v:?}")),
                Just("true".to_string()),
                Just("\"x\"".to_string()),
            ];
            let kind = prop_oneof![
                Just("SIMPLE"),
                Just("IMPORT_CAPACITY_LIMIT"),
                Just("PRICE"),
                Just("EXPORT_CAPACITY_LIMIT"),
            ];
            (kind, proptest::collection::vec(value, 0..3)).prop_map(|(kind, values)| {
                format!(r#"{{"type":"{kind}","values":[{}]}}"#, values.join(","))
            })
        }

        fn interval() -> impl Strategy<Value = String> {
            (
                proptest::option::of((start(), duration())),
                proptest::collection::vec(payload(), 0..3),
            )
                .prop_map(|(own, payloads)| {
                    let own = own.map_or(String::new(), |(start, duration)| {
                        format!(
                            r#""intervalPeriod":{{"start":"{start}","duration":"{duration}"}},"#
                        )
                    });
                    format!(r#"{{"id":0,{own}"payloads":[{}]}}"#, payloads.join(","))
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            #[test]
            fn is_refused_with_a_reason_or_applied_within_limits(
                period in proptest::option::of((start(), duration())),
                intervals in proptest::collection::vec(interval(), 0..6),
                now_offset_ms in -100_000_000i64..100_000_000,
            ) {
                let period = period.map_or(String::new(), |(start, duration)| {
                    format!(r#""intervalPeriod":{{"start":"{start}","duration":"{duration}"}},"#)
                });
                let text = format!(
                    r#"{{"id":"p","createdDateTime":"{c}","modificationDateTime":"{c}",
                        "objectType":"EVENT","programID":"p1","priority":null,
                        {period}"intervals":[{}]}}"#,
                    intervals.join(","),
                    c = iso(T0 - 60_000)
                );
                // What the wire types cannot read never reaches the mapping (the VTN
                // client refuses the list); what they can must map without a panic.
                let Ok(event) = serde_json::from_str::<Event>(&text) else {
                    return Ok(());
                };
                let now_ms = (T0 as i64 + now_offset_ms) as u64;
                let m = mapping();
                match interpret(&event, &m, now_ms) {
                    Meaning::Apply(r) => {
                        prop_assert!(r.duration_ms <= m.max_event_duration_ms, "{r:?}");
                        prop_assert!(r.end_ms() > now_ms, "{r:?}");
                        prop_assert_eq!(
                            powerflex_proto::event::check_new_event(&r.cut, r.start_ms, r.duration_ms, r.ramp_ms),
                            Ok(())
                        );
                        match r.cut {
                            Cut::Reduce { fraction } => prop_assert!(m.simple_level_cuts.contains(&fraction)),
                            Cut::Target { budget_w } => prop_assert!(budget_w > 0.0 && budget_w <= 1e10),
                        }
                    }
                    Meaning::Refused(reason) => prop_assert!(
                        reason.contains("accepted") || reason.contains("max_event_duration_s"),
                        "{reason}"
                    ),
                    Meaning::Nothing { .. } => {}
                }
            }
        }
    }
}
