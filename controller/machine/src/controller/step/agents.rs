//! Agents coming and going: a hello opens or renews a node's session; a refusal of this
//! controller's epoch fences it for that node, and for the site when most refuse.

use tracing::{debug, error, info};

use powerflex_decide::NodeView;
use powerflex_proto::report::GpuInfo;
use powerflex_proto::status::{LeadershipRole, LeadershipView};

use crate::controller::session::Session;

use super::Controller;

impl Controller {
    pub(super) fn hello(&mut self, node: String, gpus: Vec<GpuInfo>, now_ms: u64) {
        info!(node = %node, gpus = gpus.len(), "agent connected");
        let session = self.sessions.entry(node.clone()).or_insert_with(|| {
            Session::new(
                NodeView {
                    node: node.clone(),
                    gpus: Vec::new(),
                    jobs: Vec::new(),
                    power_w: 0.0,
                    live: true,
                },
                Vec::new(),
            )
        });
        session.announced = gpus;
        session.reported_since_hello = false;
        session.last_seen_ms = now_ms;
        self.believe(&node);
        self.allocate_now = true;
    }

    /// An agent refused a lease for its epoch. Only a refusal of this controller's own
    /// epoch by a later one counts (a refusal of an older lease still in flight from
    /// before a takeover says nothing about this one), and it fences this controller for
    /// that node: it leases the node no more and counts it as silent. One node's word
    /// stops nothing else (its root can refuse its own leases anyway).
    ///
    /// A single controller (no `[controller.ha]`) has no database to ask: once more
    /// than half of the nodes it knows (connected, in Slurm's placement, or placed by
    /// the domains) refuse it, a controller of a later epoch steers
    /// the site and this one is a stale one (a rogue), and it stops steering entirely
    /// (FENCED), so it steers no node without an epoch memory either. Under
    /// `[controller.ha]` the leader row decides: the edge asks the database at once.
    /// Returns whether the node is newly fenced.
    pub(super) fn fenced(
        &mut self,
        node: &str,
        lease_epoch: u64,
        accepted_epoch: u64,
        now_ms: u64,
    ) -> bool {
        let epoch = self.state.epoch;
        if lease_epoch != epoch || accepted_epoch <= epoch {
            debug!(
                node,
                lease_epoch,
                accepted_epoch,
                epoch,
                "an agent's epoch refusal of another epoch ignored"
            );
            return false;
        }
        if self
            .fenced_by
            .insert(node.to_string(), accepted_epoch)
            .is_some()
        {
            return false;
        }
        error!(
            node,
            epoch,
            accepted_epoch,
            "fenced: an agent follows a controller of a later epoch; this controller stops steering that node"
        );
        // Every node the controller knows of, not only those connected: Slurm's GPU
        // nodes and the nodes the domains place count too, so a lone node's refusal
        // (its root can forge one) while few have connected fences no site.
        let known = self
            .sessions
            .len()
            .max(self.fenced_by.len())
            .max(self.placement.as_ref().map_or(0, |p| {
                p.node_gpus.values().filter(|&&gpus| gpus > 0).count()
            }))
            .max(
                self.options
                    .site
                    .domains
                    .as_ref()
                    .map_or(0, |d| d.tree.node_count()),
            );
        if self.leadership.is_none() && 2 * self.fenced_by.len() > known {
            let highest = self
                .fenced_by
                .values()
                .copied()
                .max()
                .unwrap_or(accepted_epoch);
            error!(
                epoch,
                refused_by = self.fenced_by.len(),
                known,
                highest_epoch = highest,
                "fenced: most nodes follow a controller of a later epoch; this controller stops steering"
            );
            self.leadership = Some(LeadershipView {
                role: LeadershipRole::Fenced,
                name: None,
                epoch,
                holder: None,
                reason: Some(format!(
                    "{} of the {known} nodes it knows follow a controller of a later epoch (up to {highest}) than this one's {epoch}",
                    self.fenced_by.len()
                )),
                since_unix_ms: now_ms,
            });
        }
        true
    }
}
