//! What survives a controller restart: the machine's view of its state file. The edge
//! (`powerflex_controller::ctld::state`) reads and writes the file.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use powerflex_core::Watts;
use powerflex_proto::report::GpuInfo;

use crate::preempt::Preempted;
use crate::schedule::Event;

/// What survives a restart.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
    /// The leadership epoch this state was last steered with (issue 22): every lease
    /// carries it, and an agent refuses leases of a lower epoch than it has accepted. 0
    /// for a single controller (and absent from its file); under `[controller.ha]` each
    /// takeover raises it in the database.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: u64,
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
