//! What survives a controller restart: the machine's view of its state file. The edge
//! (`powerflex_controller::ctld::state`) reads and writes the file.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use powerflex_core::domains::{
    MAX_DOMAINS, MAX_DOMAIN_LIMIT_W, MAX_DOMAIN_NAME_BYTES, MAX_NODES_IN_ALL,
};
use powerflex_core::{UnixMs, Watts};
use powerflex_proto::event::{check_new_event, MAX_PENDING_EVENTS};
use powerflex_proto::link::valid_node_name;
use powerflex_proto::report::{validate_gpus, GpuInfo};

use crate::error::MachineError;
use crate::preempt::Preempted;
use powerflex_proto::event::Event;

/// The longest committed state accepted, bytes (the state file, or the leadership
/// database's row): a site of 10,000 nodes of 8 GPUs writes a few MB.
pub const MAX_STATE_BYTES: usize = 64 << 20;
/// The highest budget a committed state (or `budget set`) may hold, W: the highest limit
/// a power domain may have, far above any facility's GPUs (1 GW).
pub const MAX_BUDGET_W: f64 = MAX_DOMAIN_LIMIT_W;
/// The most held (suspended or requeued) jobs a committed state may name: one per job
/// of the largest site.
pub const MAX_PREEMPTED_JOBS: usize = MAX_NODES_IN_ALL;

/// What survives a restart.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CtldState {
    /// Budget set with `powerflexctl budget set`, overriding the site config's.
    pub budget_w: Option<Watts>,
    pub events: Vec<Event>,
    pub next_event_id: u64,
    /// Every node that has connected, with its GPUs. After a restart the controller
    /// waits for these (up to half a lease) before allocating: allocating with only the
    /// first agents to reconnect would hand them the others' watts while the others'
    /// old leases still hold their caps, and the site would go over budget.
    #[serde(default)]
    pub nodes: BTreeMap<String, Vec<GpuInfo>>,
    /// Jobs suspended or requeued for a cut deeper than caps reach: a restarted
    /// controller still resumes or releases them when the cut is over.
    #[serde(default)]
    pub preempted: BTreeMap<String, Preempted>,
    /// Budgets set per power domain with `powerflexctl budget set --domain`, in place of
    /// the limits the site config gives them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub domain_budgets_w: BTreeMap<String, Watts>,
    /// The leadership epoch this state was last steered with: every lease
    /// carries it, and an agent refuses leases of a lower epoch than it has accepted. 0
    /// for a single controller (and absent from its file); under `[controller.ha]` each
    /// takeover raises it in the database.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: u64,
}

impl CtldState {
    /// A committed state read from `text` (the state file, or the leadership database's
    /// row), once checked: at most [`MAX_STATE_BYTES`], then parsed, then
    /// [`CtldState::checked`]. The error names the field and what is accepted.
    ///
    /// Fields this build does not know (written by a newer controller) are ignored: a
    /// newer controller adds fields with defaults, so an older standby can still take
    /// over in a rolling upgrade. An event's fields stay strict: an event this build
    /// cannot read whole is refused rather than applied differently.
    pub fn from_json(text: &[u8], now: UnixMs) -> Result<CtldState, MachineError> {
        if text.len() > MAX_STATE_BYTES {
            return Err(MachineError::StateTooLarge {
                bytes: text.len(),
                max_bytes: MAX_STATE_BYTES,
            });
        }
        let state: CtldState =
            serde_json::from_slice(text).map_err(|e| MachineError::NotAState(e.to_string()))?;
        state.checked(now)
    }

    /// This state, if it can be steered from: events that have ended at `now` dropped
    /// (the first allocation would drop them), then every value within what the
    /// controller itself would accept (`budget set`, `event add`, an agent's hello):
    /// - `budget_w`: finite, above 0 W; one above [`MAX_BUDGET_W`] (an older release
    ///   took any) is held to it;
    /// - `domain_budgets_w`: at most [`MAX_DOMAINS`] domain names of 1 to
    ///   [`MAX_DOMAIN_NAME_BYTES`] bytes, each finite and above 0 W; one above
    ///   [`MAX_DOMAIN_LIMIT_W`] is held to it (the controller holds a domain to its
    ///   configured limit when it allocates);
    /// - `events`: at most [`MAX_PENDING_EVENTS`], each one `event add` accepts, ids
    ///   distinct and at most `next_event_id`;
    /// - `nodes`: at most [`MAX_NODES_IN_ALL`], each a valid node name; a node whose GPU
    ///   list no agent's hello may announce is dropped (logged), not the whole state:
    ///   states written by older releases may hold unchecked hello lists, and refusing
    ///   such a state at an upgrade would drop every event and budget with it (the node
    ///   is known again at its next hello);
    /// - `preempted`: at most [`MAX_PREEMPTED_JOBS`] job ids the link accepts;
    /// - `epoch`: at most `i64::MAX` (what the database holds).
    ///
    /// The error names the field and the accepted range.
    pub fn checked(mut self, now: UnixMs) -> Result<CtldState, MachineError> {
        if let Some(Watts(w)) = self.budget_w {
            if !(w.is_finite() && w > 0.0) {
                return Err(MachineError::BudgetOutOfRange {
                    w,
                    max_w: MAX_BUDGET_W,
                });
            }
            // States written by an older release may hold any positive budget: one above
            // the bound (no limit a GPU site reaches) loads at the bound rather than
            // losing the state.
            if w > MAX_BUDGET_W {
                tracing::warn!(
                    budget_w = w,
                    max_w = MAX_BUDGET_W,
                    "the committed budget is above the most a budget may be; held to it"
                );
                self.budget_w = Some(Watts(MAX_BUDGET_W));
            }
        }
        if self.domain_budgets_w.len() > MAX_DOMAINS {
            return Err(MachineError::TooManyDomainBudgets {
                count: self.domain_budgets_w.len(),
            });
        }
        for (name, Watts(w)) in &mut self.domain_budgets_w {
            if name.is_empty() || name.len() > MAX_DOMAIN_NAME_BYTES {
                return Err(MachineError::DomainBudgetName { bytes: name.len() });
            }
            if !(w.is_finite() && *w > 0.0) {
                return Err(MachineError::DomainBudgetOutOfRange {
                    name: name.clone(),
                    w: *w,
                });
            }
            // As the site's budget: held to the bound (the controller holds a domain to
            // its configured limit at every allocation anyway).
            *w = w.min(MAX_DOMAIN_LIMIT_W);
        }
        self.events.retain(|e| e.pending(now.ms()));
        if self.events.len() > MAX_PENDING_EVENTS {
            return Err(MachineError::TooManyEvents {
                count: self.events.len(),
            });
        }
        let mut ids = std::collections::BTreeSet::new();
        for e in &self.events {
            check_new_event(&e.cut, e.start_ms, e.duration_ms, e.ramp_ms).map_err(|why| {
                MachineError::BadEvent {
                    id: e.id,
                    why: why.to_string(),
                }
            })?;
            if e.id == 0 || e.id > self.next_event_id || !ids.insert(e.id) {
                return Err(MachineError::EventIdOutOfRange {
                    id: e.id,
                    next_event_id: self.next_event_id,
                });
            }
            if let Some(d) = &e.domain {
                if d.is_empty() || d.len() > MAX_DOMAIN_NAME_BYTES {
                    return Err(MachineError::EventDomainName {
                        id: e.id,
                        bytes: d.len(),
                    });
                }
            }
        }
        if self.nodes.len() > MAX_NODES_IN_ALL {
            return Err(MachineError::TooManyNodes {
                count: self.nodes.len(),
            });
        }
        for node in self.nodes.keys() {
            if !valid_node_name(node) {
                return Err(MachineError::BadNodeName { name: node.clone() });
            }
        }
        self.nodes.retain(|node, gpus| match validate_gpus(gpus) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(node = %node, error = %e, "the committed state's GPU list of this node is impossible; dropped until its agent says hello again");
                false
            }
        });
        if self.preempted.len() > MAX_PREEMPTED_JOBS {
            return Err(MachineError::TooManyPreempted {
                max_jobs: MAX_PREEMPTED_JOBS,
                count: self.preempted.len(),
            });
        }
        if let Some(job) = self
            .preempted
            .keys()
            .find(|j| !powerflex_proto::valid_job_id(j))
        {
            return Err(MachineError::BadJobId { job: job.clone() });
        }
        if i64::try_from(self.epoch).is_err() {
            return Err(MachineError::EpochOutOfRange { epoch: self.epoch });
        }
        Ok(self)
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The state as loaded at start.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Loaded {
    pub state: CtldState,
    /// The state was corrupt with no usable previous copy: the nodes and events it held
    /// are unknown.
    pub lost: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_proto::event::Cut;

    const NOW: UnixMs = UnixMs(1_800_000_000_000);

    fn event(id: u64) -> Event {
        Event {
            id,
            cut: Cut::Reduce { fraction: 0.3 },
            start_ms: NOW.ms(),
            duration_ms: 3_600_000,
            ramp_ms: 0,
            domain: None,
        }
    }

    fn refused(state: CtldState, says: &str) {
        let why = state.clone().checked(NOW).expect_err(says).to_string();
        assert!(why.contains(says), "{why} should say {says}");
        // (JSON has no NaN nor infinity: those are written as null, which is no budget.)
        let text = serde_json::to_string(&state).expect("encodes");
        if !text.contains("null") {
            assert!(
                CtldState::from_json(text.as_bytes(), NOW).is_err(),
                "{says}"
            );
        }
    }

    /// A committed state (database row or file) is steered from only once its values
    /// are within what the controller itself accepts.
    #[test]
    fn a_hostile_committed_state_is_refused_naming_the_field_and_range() {
        // Budgets above the bound (an older release took any positive one) load held to
        // the bound, with the rest of the state.
        let huge = br#"{"budget_w":1e308,"events":[],"next_event_id":0,"domain_budgets_w":{"rack-b":1e308}}"#;
        let held = CtldState::from_json(huge, NOW).expect("held to the bound");
        assert_eq!(held.budget_w, Some(Watts(MAX_BUDGET_W)));
        assert_eq!(held.domain_budgets_w["rack-b"], Watts(MAX_DOMAIN_LIMIT_W));
        for w in [2e9, 1e308] {
            let held = CtldState {
                budget_w: Some(Watts(w)),
                events: vec![event(1)],
                next_event_id: 1,
                ..CtldState::default()
            }
            .checked(NOW)
            .expect("held to the bound");
            assert_eq!(held.budget_w, Some(Watts(MAX_BUDGET_W)));
            assert_eq!(held.events, vec![event(1)]);
        }
        for w in [-5.0, 0.0, f64::NAN, f64::INFINITY] {
            refused(
                CtldState {
                    budget_w: Some(Watts(w)),
                    ..CtldState::default()
                },
                "budget_w",
            );
            refused(
                CtldState {
                    domain_budgets_w: [("rack-b".to_string(), Watts(w))].into_iter().collect(),
                    ..CtldState::default()
                },
                "domain_budgets_w.\"rack-b\"",
            );
        }
        refused(
            CtldState {
                events: (1..=MAX_PENDING_EVENTS as u64 + 1).map(event).collect(),
                next_event_id: MAX_PENDING_EVENTS as u64 + 1,
                ..CtldState::default()
            },
            "at most 256",
        );
        let mut bad = event(1);
        bad.cut = Cut::Reduce { fraction: 7.0 };
        refused(
            CtldState {
                events: vec![bad],
                next_event_id: 1,
                ..CtldState::default()
            },
            "a fraction from 0 to 1",
        );
        refused(
            CtldState {
                events: vec![event(1), event(1)],
                next_event_id: 1,
                ..CtldState::default()
            },
            "each once",
        );
        refused(
            CtldState {
                nodes: [("a],b".to_string(), Vec::new())].into_iter().collect(),
                ..CtldState::default()
            },
            "not a node name",
        );
        refused(
            CtldState {
                preempted: [(
                    "x".repeat(65),
                    Preempted {
                        how: powerflex_core::flex::Preempt::Suspend,
                        since_ms: 0,
                    },
                )]
                .into_iter()
                .collect(),
                ..CtldState::default()
            },
            "not a job id",
        );
        // An impossible GPU list (kept unchecked by an older release) costs that node's
        // entry, not the events and budgets beside it.
        let impossible = GpuInfo {
            uuid: "GPU-1".into(),
            name: "bad\u{0}name".into(),
            min_w: 100.0,
            max_w: 700.0,
            default_w: 700.0,
        };
        let kept = CtldState {
            events: vec![event(1)],
            next_event_id: 1,
            nodes: [
                ("n1".to_string(), vec![impossible]),
                ("n2".to_string(), Vec::new()),
            ]
            .into_iter()
            .collect(),
            ..CtldState::default()
        }
        .checked(NOW)
        .expect("loads without n1");
        assert_eq!(kept.events, vec![event(1)]);
        assert_eq!(kept.nodes.keys().collect::<Vec<_>>(), vec!["n2"]);
        let huge = vec![b' '; MAX_STATE_BYTES + 1];
        let why = CtldState::from_json(&huge, NOW)
            .expect_err("too big")
            .to_string();
        assert!(why.contains("at most"), "{why}");
        // What the controller writes itself loads; ended events are dropped.
        let mut ended = event(1);
        ended.start_ms = NOW.ms() - 7_200_000;
        let fine = CtldState {
            budget_w: Some(Watts(120_000.0)),
            events: vec![ended, event(2)],
            next_event_id: 2,
            domain_budgets_w: [("rack-b".to_string(), Watts(9_000.0))]
                .into_iter()
                .collect(),
            epoch: 3,
            ..CtldState::default()
        };
        let loaded = fine.clone().checked(NOW).expect("in range");
        assert_eq!(loaded.events, vec![event(2)]);
        assert_eq!(loaded.budget_w, fine.budget_w);
    }

    /// A state written by a newer controller (a field this build
    /// does not know) still loads, so an older standby can take over in a rolling
    /// upgrade; an event this build cannot read whole is still refused.
    #[test]
    fn a_newer_controller_s_extra_fields_are_ignored_but_not_an_event_s() {
        let newer = br#"{"budget_w":1000.0,"events":[],"next_event_id":0,"something_new":{"a":1}}"#;
        let state = CtldState::from_json(newer, NOW).expect("a newer controller's state");
        assert_eq!(state.budget_w, Some(Watts(1000.0)));
        let strange_event = format!(
            r#"{{"events":[{{"id":1,"cut":{{"reduce":{{"fraction":0.3}}}},"start_ms":{},"duration_ms":3600000,"ramp_ms":0,"how":"new"}}],"next_event_id":1}}"#,
            NOW.ms()
        );
        assert!(CtldState::from_json(strange_event.as_bytes(), NOW).is_err());
    }
}
