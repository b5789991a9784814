//! The controller's admin protocol (`powerflexctl` → `powerflex-ctld`, one JSON line each
//! way over the admin Unix socket), and the grid events it schedules.
//!
//! ```json
//! {"v":1,"op":"status"}
//! {"v":1,"op":"budget-set","budget_w":6000.0}
//! {"v":1,"op":"event-add","cut":{"reduce":{"fraction":0.3}},"start_ms":1800000000000,"duration_ms":3600000,"ramp_ms":60000}
//! ```
//! Replies: `{"v":1,"ok":true,...}` or `{"v":1,"ok":false,"error":"...","refusal":"..."}`
//! (`refusal` only where a client may act on the reason, see [`Refusal`]). A request with
//! another `v` is refused with a message naming the version this controller speaks.
//! Requests deny unknown fields (a typo must not be ignored); replies accept them, so a
//! field a newer controller adds does not break an older client.

use serde::{Deserialize, Serialize};

use crate::status::{CtldStatus, DecisionView, HistorySample};

/// Version of the admin protocol this crate speaks.
pub const ADMIN_VERSION: u32 = 1;

/// Longest admin request line, bytes (newline included).
pub const MAX_ADMIN_REQUEST_BYTES: usize = 65_536;

// Grid events are shared with the status (the event in force) and the VEN: their own
// module, so the admin protocol and the status do not import each other.
use crate::event::Cut;

/// The most history samples one reply carries: one request's work is bounded whoever
/// asks (a day at a 10 s period is 8,640 samples, each with every job's cap).
pub const MAX_HISTORY_SAMPLES: u32 = 2_000;

/// An admin operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum AdminOp {
    Status,
    /// The recent budget, draw and caps, one sample per allocation period, after
    /// `since_ms` (default: all the controller keeps). With `max_samples`: the oldest
    /// that many (at most [`MAX_HISTORY_SAMPLES`]), a page; a client pages by asking
    /// again after the last `t_ms` it got. Without: an overview evenly thinned to at most
    /// [`MAX_HISTORY_SAMPLES`], the newest kept.
    History {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since_ms: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_samples: Option<u32>,
    },
    /// The site's standing budget, or with `domain` that power domain's (in place of its
    /// configured limit; events cut from it).
    BudgetSet {
        budget_w: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        domain: Option<String>,
    },
    EventAdd {
        cut: Cut,
        start_ms: u64,
        duration_ms: u64,
        ramp_ms: u64,
        /// The power domain the event cuts (from its budget); none: the whole site.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        domain: Option<String>,
    },
    EventCancel {
        id: u64,
    },
    /// What `policy` (default: the site's own) would decide now, on the same curves and
    /// views as the controller's own allocation, at `budget_w` (default: the budget in
    /// force). Read-only.
    WhatIf {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        policy: Option<powerflex_core::allocate::Policy>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        budget_w: Option<f64>,
        /// Leave the tiers' slowdown bounds out, as the paper's baselines do (every job
        /// cut alike); the reply's floors then say nothing of the tiers.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        ignore_tiers: bool,
    },
    /// Forget a node the controller knows from an earlier hello (decommissioned,
    /// renamed, or a name it should never have heard): it no longer counts in the
    /// budget as a silent node. Refused while the node reports. Root only.
    ForgetNode {
        node: String,
    },
    /// Jobs' energy records (see [`crate::usage::JobEnergyRecord`]) of jobs that ended
    /// in `(since_ms, until_ms]`, in [`RecordCursor`] order (by end, then job id, run,
    /// write time), at most [`MAX_RECORDS_PER_REPLY`]. A client pages by asking again
    /// with `after` the cursor of the last record it got ([`RecordCursor::of`]): exact,
    /// even when many records end in the same millisecond. A user sees only their own
    /// jobs' records; root all, or one user's with `uid`.
    Accounting {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since_ms: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        until_ms: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uid: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tier: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        job: Option<String>,
        /// Slurm's account the jobs were charged to.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        account: Option<String>,
        /// Records after this one only (the last of the previous page). A controller
        /// older than this field refuses it: only a second page asks with it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<RecordCursor>,
    },
}

/// Where a record stands in the order `accounting` answers in: a total order over the
/// records a controller keeps (one per job run), stable across its restarts.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordCursor {
    pub to_unix_ms: u64,
    pub job_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_start_unix_ms: Option<u64>,
    pub written_unix_ms: u64,
}

impl RecordCursor {
    /// The cursor of `record`.
    pub fn of(record: &crate::usage::JobEnergyRecord) -> RecordCursor {
        RecordCursor {
            to_unix_ms: record.to_unix_ms,
            job_id: record.job_id.clone(),
            run_start_unix_ms: record.run_start_unix_ms,
            written_unix_ms: record.written_unix_ms,
        }
    }
}

/// Most records one `accounting` reply carries.
pub const MAX_RECORDS_PER_REPLY: usize = 500;

impl AdminOp {
    /// Whether the operation changes the controller's state (root only, and the
    /// allocation runs again at once).
    pub fn changes_state(&self) -> bool {
        !matches!(
            self,
            AdminOp::Status
                | AdminOp::History { .. }
                | AdminOp::WhatIf { .. }
                | AdminOp::Accounting { .. }
        )
    }
}

/// An admin request: protocol version plus the operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdminRequest {
    pub v: u32,
    #[serde(flatten)]
    pub op: AdminOp,
}

/// Why an admin request line was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    #[error("admin request of {0} bytes exceeds the {MAX_ADMIN_REQUEST_BYTES}-byte limit")]
    TooLong(usize),
    #[error("malformed admin request: {0}")]
    Malformed(String),
    #[error("admin request without a protocol version; accepted: \"v\":{ADMIN_VERSION}")]
    NoVersion,
    #[error(
        "unsupported admin protocol version {0}; this controller speaks version {ADMIN_VERSION}"
    )]
    Version(u64),
}

impl AdminRequest {
    pub fn new(op: AdminOp) -> AdminRequest {
        AdminRequest {
            v: ADMIN_VERSION,
            op,
        }
    }

    /// The request as one line, newline included.
    pub fn to_line(&self) -> String {
        // Strings, numbers and enums only: serialising cannot fail.
        let mut line = serde_json::to_string(self).unwrap_or_default();
        line.push('\n');
        line
    }

    /// Parses one request line. The version is read first, so a client speaking another
    /// version hears which one is accepted rather than a complaint about its fields.
    pub fn from_line(line: &str) -> Result<AdminRequest, AdminError> {
        if line.len() > MAX_ADMIN_REQUEST_BYTES {
            return Err(AdminError::TooLong(line.len()));
        }
        let text = line.trim_end_matches(['\n', '\r']);
        #[derive(Deserialize)]
        struct VersionOnly {
            v: Option<serde_json::Number>,
        }
        let version: VersionOnly =
            serde_json::from_str(text).map_err(|e| AdminError::Malformed(e.to_string()))?;
        match version.v.map(|n| n.as_u64()) {
            None => return Err(AdminError::NoVersion),
            Some(Some(v)) if v == u64::from(ADMIN_VERSION) => {}
            Some(Some(v)) => return Err(AdminError::Version(v)),
            Some(None) => return Err(AdminError::Version(u64::MAX)),
        }
        serde_json::from_str(text).map_err(|e| AdminError::Malformed(e.to_string()))
    }
}

/// Why the controller refused a request, for a client that acts on the reason; `error`
/// says it for people. Only refusals a client tells apart have a variant: a client
/// must never match the `error` text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Refusal {
    /// `event-cancel` named an event the controller does not hold (it ended, was
    /// cancelled already, or was never added).
    NoSuchEvent,
    /// `forget-node` named a node the controller does not know.
    NoSuchNode,
    /// `forget-node` named a node that is reporting now (stop its agent first).
    NodeLive,
    /// `event-add` asked for an event the controller cannot apply (a cut out of range, a
    /// duration of zero or too long, a ramp longer than half the event): that event
    /// never will be, whatever else happens.
    EventOutOfRange,
    /// `event-add` found [`crate::event::MAX_PENDING_EVENTS`] events held already: this
    /// one may be accepted once others end or are cancelled.
    TooManyEvents,
    /// `event-add` or `budget-set` named a power domain the site config does not declare.
    NoSuchDomain,
    /// A change sent to a controller that does not steer the site now (a standby, one
    /// that stepped down, or one fenced): send it to the active controller.
    NotActive,
    /// A change the controller could not make durable (the state file written and
    /// synced, or the leadership database's commit), or one sent while it cannot: the
    /// last durable state stays in force; try again once `status` shows it saved.
    NotDurable,
    /// A refusal this client does not know (a newer controller): handled as a plain
    /// error, so an added variant never makes the whole reply unreadable.
    #[serde(other)]
    Other,
}

/// The controller's answer: refused with the reason, or done with what the operation
/// asks back. On the wire it is one object, `{"v":1,"ok":true,...}` with the answer's
/// field or `{"v":1,"ok":false,"error":"...","refusal":"..."}`, the form every client
/// and controller release reads and writes. Unknown fields are ignored (see the module
/// docs).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "AdminReplyWire")]
pub enum AdminReply {
    /// The request was refused: `message` says why for people; `refusal` which refusal
    /// it was, when a client may act on it.
    Refused {
        message: String,
        refusal: Option<Refusal>,
    },
    /// The request was carried out.
    Done(AdminAnswer),
}

/// What a carried-out admin request answers with: the one payload the operation asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum AdminAnswer {
    /// `budget-set`, `event-cancel`, `forget-node`: nothing to carry back.
    Empty,
    Status(Box<CtldStatus>),
    /// Oldest first.
    History(Vec<HistorySample>),
    /// `event-add`: the new event's id.
    EventAdded(u64),
    WhatIf(Box<DecisionView>),
    /// `accounting`: oldest first.
    Records(Vec<crate::usage::JobEnergyRecord>),
}

/// An [`AdminReply`] as it is read.
#[derive(Deserialize)]
struct AdminReplyWire {
    // Read (and required) as every release has; not checked, as before.
    #[allow(dead_code)]
    v: u32,
    ok: bool,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    refusal: Option<Refusal>,
    #[serde(default)]
    status: Option<Box<CtldStatus>>,
    #[serde(default)]
    history: Option<Vec<HistorySample>>,
    #[serde(default)]
    event_id: Option<u64>,
    #[serde(default)]
    what_if: Option<Box<DecisionView>>,
    #[serde(default)]
    records: Option<Vec<crate::usage::JobEnergyRecord>>,
}

/// An [`AdminReply`] as it is written: the same fields in the same order, each absent
/// when it has nothing to say (so a success reply never carries `refusal`).
#[derive(Serialize)]
struct AdminReplyWireRef<'a> {
    v: u32,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    refusal: Option<Refusal>,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<&'a CtldStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    history: Option<&'a [HistorySample]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    event_id: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    what_if: Option<&'a DecisionView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    records: Option<&'a [crate::usage::JobEnergyRecord]>,
}

impl TryFrom<AdminReplyWire> for AdminReply {
    type Error = crate::ProtoError;

    fn try_from(wire: AdminReplyWire) -> Result<AdminReply, crate::ProtoError> {
        if !wire.ok {
            // A refusal without a reason (no controller sends one) reads as the word
            // the clients have always shown for it.
            return Ok(AdminReply::Refused {
                message: wire.error.unwrap_or_else(|| "refused".into()),
                refusal: wire.refusal,
            });
        }
        let mut answers = Vec::new();
        if let Some(status) = wire.status {
            answers.push(AdminAnswer::Status(status));
        }
        if let Some(history) = wire.history {
            answers.push(AdminAnswer::History(history));
        }
        if let Some(id) = wire.event_id {
            answers.push(AdminAnswer::EventAdded(id));
        }
        if let Some(what_if) = wire.what_if {
            answers.push(AdminAnswer::WhatIf(what_if));
        }
        if let Some(records) = wire.records {
            answers.push(AdminAnswer::Records(records));
        }
        if answers.len() > 1 {
            return Err(crate::ProtoError::Invalid {
                field: "reply".into(),
                reason: "it carries the answers of more than one operation".into(),
            });
        }
        Ok(AdminReply::Done(
            answers.pop().unwrap_or(AdminAnswer::Empty),
        ))
    }
}

impl Serialize for AdminReply {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut wire = AdminReplyWireRef {
            v: ADMIN_VERSION,
            ok: true,
            error: None,
            refusal: None,
            status: None,
            history: None,
            event_id: None,
            what_if: None,
            records: None,
        };
        match self {
            AdminReply::Refused { message, refusal } => {
                wire.ok = false;
                wire.error = Some(message);
                wire.refusal = *refusal;
            }
            AdminReply::Done(AdminAnswer::Empty) => {}
            AdminReply::Done(AdminAnswer::Status(status)) => wire.status = Some(status),
            AdminReply::Done(AdminAnswer::History(history)) => wire.history = Some(history),
            AdminReply::Done(AdminAnswer::EventAdded(id)) => wire.event_id = Some(*id),
            AdminReply::Done(AdminAnswer::WhatIf(view)) => wire.what_if = Some(view),
            AdminReply::Done(AdminAnswer::Records(records)) => wire.records = Some(records),
        }
        wire.serialize(serializer)
    }
}

impl AdminReply {
    /// Done, with nothing to carry back.
    pub fn ok() -> AdminReply {
        AdminReply::Done(AdminAnswer::Empty)
    }

    /// Refused, for the reason `message` gives, of no kind a client acts on.
    pub fn error(message: impl Into<String>) -> AdminReply {
        AdminReply::Refused {
            message: message.into(),
            refusal: None,
        }
    }

    /// A refusal a client can tell apart by `refusal`, with `message` for people.
    pub fn refused(refusal: Refusal, message: impl Into<String>) -> AdminReply {
        AdminReply::Refused {
            message: message.into(),
            refusal: Some(refusal),
        }
    }

    /// Whether the request was carried out.
    pub fn is_ok(&self) -> bool {
        matches!(self, AdminReply::Done(_))
    }

    /// Why the request was refused; none when it was carried out.
    pub fn error_message(&self) -> Option<&str> {
        match self {
            AdminReply::Refused { message, .. } => Some(message),
            AdminReply::Done(_) => None,
        }
    }

    /// Which refusal it was, when a client may act on it.
    pub fn refusal(&self) -> Option<Refusal> {
        match self {
            AdminReply::Refused { refusal, .. } => *refusal,
            AdminReply::Done(_) => None,
        }
    }

    /// A `status` answer.
    pub fn status(&self) -> Option<&CtldStatus> {
        match self {
            AdminReply::Done(AdminAnswer::Status(status)) => Some(status),
            _ => None,
        }
    }

    /// A `history` answer.
    pub fn history(&self) -> Option<&[HistorySample]> {
        match self {
            AdminReply::Done(AdminAnswer::History(history)) => Some(history),
            _ => None,
        }
    }

    /// An `event-add` answer: the new event's id.
    pub fn event_id(&self) -> Option<u64> {
        match self {
            AdminReply::Done(AdminAnswer::EventAdded(id)) => Some(*id),
            _ => None,
        }
    }

    /// A `what-if` answer.
    pub fn what_if(&self) -> Option<&DecisionView> {
        match self {
            AdminReply::Done(AdminAnswer::WhatIf(view)) => Some(view),
            _ => None,
        }
    }

    /// An `accounting` answer.
    pub fn records(&self) -> Option<&[crate::usage::JobEnergyRecord]> {
        match self {
            AdminReply::Done(AdminAnswer::Records(records)) => Some(records),
            _ => None,
        }
    }

    /// The reply as one line, newline included.
    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(self)
            .unwrap_or_else(|_| format!("{{\"v\":{ADMIN_VERSION},\"ok\":false}}"));
        line.push('\n');
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_round_trips_as_one_line() {
        let request = AdminRequest::new(AdminOp::EventAdd {
            cut: Cut::Reduce { fraction: 0.3 },
            start_ms: 1_800_000_000_000,
            duration_ms: 3_600_000,
            ramp_ms: 60_000,
            domain: None,
        });
        let line = request.to_line();
        assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
        assert!(line.starts_with("{\"v\":1,\"op\":\"event-add\""), "{line}");
        assert_eq!(AdminRequest::from_line(&line), Ok(request));
    }

    #[test]
    fn a_typed_refusal_round_trips_and_other_replies_do_not_carry_one() {
        let refused = AdminReply::refused(Refusal::NoSuchEvent, "no event 7");
        let line = refused.to_line();
        assert!(line.contains("\"refusal\":\"no-such-event\""), "{line}");
        let back: AdminReply = serde_json::from_str(line.trim_end()).expect("parses");
        assert_eq!(back, refused);
        assert!(!AdminReply::ok().to_line().contains("refusal"));
        assert!(!AdminReply::error("x").to_line().contains("refusal"));
        // A field a newer controller adds does not break this client.
        let newer: AdminReply =
            serde_json::from_str(r#"{"v":1,"ok":true,"a_later_field":3}"#).expect("parses");
        assert_eq!(newer, AdminReply::ok());
    }

    /// Lines as controllers of the current release write them, each with the typed
    /// reply it reads as: the typed form reads each and writes it back byte for byte.
    #[test]
    fn the_release_s_reply_lines_read_and_write_back_unchanged() {
        let samples = [
            (r#"{"v":1,"ok":true}"#, AdminReply::ok()),
            (
                r#"{"v":1,"ok":false,"error":"only root may change the budget or grid events"}"#,
                AdminReply::error("only root may change the budget or grid events"),
            ),
            (
                r#"{"v":1,"ok":false,"error":"no event 7","refusal":"no-such-event"}"#,
                AdminReply::refused(Refusal::NoSuchEvent, "no event 7"),
            ),
            (
                r#"{"v":1,"ok":true,"event_id":3}"#,
                AdminReply::Done(AdminAnswer::EventAdded(3)),
            ),
            (
                r#"{"v":1,"ok":true,"history":[{"t_ms":5,"budget_w":6000.0,"draw_w":5000.0,"caps":{"42":300.0},"simulated":false}]}"#,
                AdminReply::Done(AdminAnswer::History(vec![HistorySample {
                    t_ms: 5,
                    budget_w: 6000.0,
                    draw_w: 5000.0,
                    caps: [("42".to_string(), 300.0)].into(),
                    simulated: false,
                    domains: Default::default(),
                }])),
            ),
            (
                r#"{"v":1,"ok":true,"history":[]}"#,
                AdminReply::Done(AdminAnswer::History(Vec::new())),
            ),
            (
                r#"{"v":1,"ok":true,"records":[]}"#,
                AdminReply::Done(AdminAnswer::Records(Vec::new())),
            ),
        ];
        for (line, typed) in samples {
            let back: AdminReply = serde_json::from_str(line).expect(line);
            assert_eq!(back, typed, "{line}");
            assert_eq!(typed.to_line(), format!("{line}\n"));
        }
        // No reason given: the word the clients have always shown.
        let bare: AdminReply = serde_json::from_str(r#"{"v":1,"ok":false}"#).expect("reads");
        assert_eq!(bare, AdminReply::error("refused"));
        // Two operations' answers in one reply make no sense to anyone.
        assert!(serde_json::from_str::<AdminReply>(
            r#"{"v":1,"ok":true,"event_id":3,"history":[]}"#
        )
        .is_err());
    }

    #[test]
    fn a_wrong_or_missing_version_is_refused_naming_the_accepted_one() {
        let wrong = AdminRequest::from_line("{\"v\":2,\"op\":\"status\"}\n");
        assert_eq!(wrong, Err(AdminError::Version(2)));
        let message = wrong.expect_err("refused").to_string();
        assert!(
            message.contains("version 2") && message.contains("version 1"),
            "{message}"
        );
        // A version 2 client's unknown op still hears about the version first.
        assert_eq!(
            AdminRequest::from_line("{\"v\":2,\"op\":\"teleport\"}"),
            Err(AdminError::Version(2))
        );
        let missing = AdminRequest::from_line("{\"op\":\"status\"}");
        assert_eq!(missing, Err(AdminError::NoVersion));
        assert!(missing
            .expect_err("refused")
            .to_string()
            .contains("\"v\":1"));
        assert!(matches!(
            AdminRequest::from_line("{\"v\":-1,\"op\":\"status\"}"),
            Err(AdminError::Version(_))
        ));
    }

    #[test]
    fn malformed_requests_name_what_was_wrong() {
        for (line, needle) in [
            ("not json", "malformed"),
            ("{\"v\":1,\"op\":\"teleport\"}", "teleport"),
            ("{\"v\":1,\"op\":\"budget-set\"}", "budget_w"),
            (
                "{\"v\":1,\"op\":\"event-cancel\",\"id\":1,\"extra\":2}",
                "extra",
            ),
        ] {
            let e = AdminRequest::from_line(line).expect_err(line).to_string();
            assert!(e.contains(needle), "{line}: {e}");
        }
        let long = format!(
            "{{\"v\":1,\"op\":\"status\",\"x\":\"{}\"}}",
            "a".repeat(70_000)
        );
        assert!(matches!(
            AdminRequest::from_line(&long),
            Err(AdminError::TooLong(_))
        ));
    }

    #[test]
    fn only_changes_need_root() {
        assert!(!AdminOp::Status.changes_state());
        assert!(!AdminOp::History {
            since_ms: None,
            max_samples: None
        }
        .changes_state());
        assert!(!AdminOp::WhatIf {
            policy: Some(powerflex_core::allocate::Policy::Equal),
            budget_w: None,
            ignore_tiers: true,
        }
        .changes_state());
        assert!(AdminOp::BudgetSet {
            budget_w: 1.0,
            domain: None
        }
        .changes_state());
        assert!(AdminOp::EventCancel { id: 1 }.changes_state());
    }

    #[test]
    fn a_what_if_names_a_policy_the_controller_knows_or_is_refused_naming_them() {
        let ok: AdminRequest =
            serde_json::from_str(r#"{"v":1,"op":"what-if","policy":"pfi-proportional"}"#)
                .expect("known policy");
        assert!(matches!(
            ok.op,
            AdminOp::WhatIf {
                policy: Some(powerflex_core::allocate::Policy::PfiProportional),
                ..
            }
        ));
        let e = serde_json::from_str::<AdminRequest>(r#"{"v":1,"op":"what-if","policy":"greedy"}"#)
            .expect_err("unknown policy")
            .to_string();
        assert!(
            e.contains("greedy") && e.contains("optimal") && e.contains("pfi-proportional"),
            "{e}"
        );
    }
}
