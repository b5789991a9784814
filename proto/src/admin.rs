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
pub use crate::event::{Cut, Event};

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
    /// What `policy` would decide now, on the same curves and views as the controller's
    /// own allocation, at `budget_w` (default: the budget in force). Read-only.
    WhatIf {
        policy: powerflex_core::allocate::Policy,
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
    /// A refusal this client does not know (a newer controller): handled as a plain
    /// error, so an added variant never makes the whole reply unreadable.
    #[serde(other)]
    Other,
}

/// The controller's answer. Exactly one of the payload fields is set on success, the one
/// the operation asks for; `budget-set` and `event-cancel` carry none. Unknown fields
/// are ignored (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdminReply {
    pub v: u32,
    pub ok: bool,
    /// What went wrong, when `ok` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Which refusal it was, when a client may act on it (absent from every other reply,
    /// so a success reply reads as before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<Refusal>,
    /// For `status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<CtldStatus>,
    /// For `history`: oldest first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<Vec<HistorySample>>,
    /// For `event-add`: the new event's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<u64>,
    /// For `what-if`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub what_if: Option<DecisionView>,
    /// For `accounting`: oldest first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub records: Option<Vec<crate::usage::JobEnergyRecord>>,
}

impl AdminReply {
    pub fn ok() -> AdminReply {
        AdminReply {
            v: ADMIN_VERSION,
            ok: true,
            error: None,
            refusal: None,
            status: None,
            history: None,
            event_id: None,
            what_if: None,
            records: None,
        }
    }

    pub fn error(message: impl Into<String>) -> AdminReply {
        AdminReply {
            ok: false,
            error: Some(message.into()),
            ..AdminReply::ok()
        }
    }

    /// A refusal a client can tell apart by `refusal`, with `message` for people.
    pub fn refused(refusal: Refusal, message: impl Into<String>) -> AdminReply {
        AdminReply {
            refusal: Some(refusal),
            ..AdminReply::error(message)
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
            policy: powerflex_core::allocate::Policy::Equal,
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
                policy: powerflex_core::allocate::Policy::PfiProportional,
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
