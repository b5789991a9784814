//! Nodes the site names whose agents this controller has never heard from: UNMANAGED.
//!
//! A GPU node Slurm lists, or one a power domain places, may draw without its agent ever
//! having spoken to this controller: a new node whose agent is stopped, an agent that
//! died before the controller's restart, a state file lost. Nothing steers such a node
//! and nothing says what its GPUs' limits are, so the allocation pays for it at its worst
//! case ([`powerflex_decide::unheard_node_view`]), in the site's budget and in every
//! domain on its path, until its agent says hello (then it is a session: paid for at what
//! it announces, as a silent node until it reports, and by its reports after).
//!
//! Its GPUs, by the first rule that applies:
//! - Slurm lists the node (its placement is read): its `gpu` gres count. A node Slurm
//!   lists without GPUs is no GPU node and costs nothing (the controller believes none of
//!   its GPUs once it speaks either: [`crate::placement::Placement::believe`]).
//! - A domain places the node and Slurm does not list it (or the site runs without
//!   Slurm's placement): the most GPUs any node the controller knows has (Slurm's gres
//!   counts and the GPUs the agents announced), since the breaker carries whatever the
//!   node draws, and a node of the site is taken to be as large as its largest. While the
//!   controller knows no node's GPUs it knows no job either, and the node counts 0 GPUs
//!   (it is still listed UNMANAGED).
//!
//! Each GPU at the largest `max_cap_w` of the site's `[[gpu_models]]`: an agent that
//! never ran set no cap, and a GPU's default limit is at most its model's maximum.

use std::collections::{BTreeMap, BTreeSet};

use powerflex_decide::{silent_node_reserve_w, unheard_node_view, NodeView};

use crate::placement::Placement;

use super::session::Session;

/// One node never heard from, and what the allocation reserves for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Unheard {
    pub node: String,
    /// Its GPUs by the rules of this module.
    pub gpus: u32,
    /// Whether Slurm lists it (else only a domain places it).
    pub in_slurm: bool,
    /// `gpus` × the site's largest model's maximum, W.
    pub reserve_w: f64,
}

impl Unheard {
    /// The node as the allocation sees it: silent, at its worst case.
    pub fn view(&self, max_gpu_w: f64) -> NodeView {
        unheard_node_view(&self.node, self.gpus, max_gpu_w)
    }
}

/// The nodes `placement` (Slurm's, where the controller reads it) lists with GPUs and
/// `domain_nodes` place that have no session, each with its GPUs and reserve; in name
/// order.
pub fn unheard<'a>(
    placement: Option<&Placement>,
    domain_nodes: impl IntoIterator<Item = &'a str>,
    sessions: &BTreeMap<String, Session>,
    max_gpu_w: f64,
) -> Vec<Unheard> {
    let slurm = placement.map(|p| &p.node_gpus);
    let largest = slurm
        .into_iter()
        .flat_map(|n| n.values().copied())
        .chain(sessions.values().map(|s| {
            // Under Slurm's placement, only the GPUs Slurm bears out: what a node announces
            // beyond them is refused everywhere else, and a node's root announcing 256 GPUs
            // must not make every node a domain alone places cost 256 GPUs. Without
            // Slurm's word, what the node announced is all the site says of its size.
            if placement.is_some() {
                s.view.gpus.len() as u32
            } else {
                s.announced.len().max(s.view.gpus.len()) as u32
            }
        }))
        .max()
        .unwrap_or(0);
    let mut named: BTreeMap<&str, (u32, bool)> = BTreeMap::new();
    if let Some(slurm) = slurm {
        for (node, &gpus) in slurm {
            if gpus > 0 {
                named.insert(node.as_str(), (gpus, true));
            }
        }
    }
    let domain_nodes: BTreeSet<&str> = domain_nodes.into_iter().collect();
    for node in domain_nodes {
        if !slurm.is_some_and(|s| s.contains_key(node)) {
            named.entry(node).or_insert((largest, false));
        }
    }
    named
        .into_iter()
        .filter(|(node, _)| !sessions.contains_key(*node))
        .map(|(node, (gpus, in_slurm))| {
            let view = unheard_node_view(node, gpus, max_gpu_w);
            Unheard {
                node: node.to_string(),
                gpus: view.gpus.len() as u32,
                in_slurm,
                reserve_w: silent_node_reserve_w(&view.gpus),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_proto::report::GpuInfo;

    fn session(node: &str, gpus: usize) -> (String, Session) {
        let gpus: Vec<GpuInfo> = (0..gpus)
            .map(|i| GpuInfo {
                uuid: format!("GPU-{node}-{i}"),
                name: "NVIDIA H200".into(),
                min_w: 200.0,
                max_w: 700.0,
                default_w: 700.0,
            })
            .collect();
        (
            node.to_string(),
            Session {
                view: NodeView {
                    node: node.to_string(),
                    gpus: gpus.clone(),
                    jobs: Vec::new(),
                    power_w: 0.0,
                    live: true,
                },
                last_seen_ms: 1,
                reported: Vec::new(),
                announced: gpus,
                refused_reports: 0,
                refused_gpus: 0,
                observe_only: false,
                reported_since_hello: true,
            },
        )
    }

    fn placement(nodes: &[(&str, u32)]) -> Placement {
        Placement {
            jobs: BTreeMap::new(),
            node_gpus: nodes.iter().map(|(n, g)| (n.to_string(), *g)).collect(),
            read_at_ms: 1,
        }
    }

    #[test]
    fn slurm_s_gres_counts_and_the_largest_known_node_for_a_domain_only_node() {
        let sessions = BTreeMap::from([session("n1", 2)]);
        // n2: 4 GPUs in Slurm, never heard from; n3: Slurm's, no GPUs; n9: a domain's
        // only.
        let p = placement(&[("n1", 2), ("n2", 4), ("n3", 0)]);
        let found = unheard(Some(&p), ["n1", "n2", "n3", "n9"], &sessions, 1000.0);
        assert_eq!(
            found,
            vec![
                Unheard {
                    node: "n2".into(),
                    gpus: 4,
                    in_slurm: true,
                    reserve_w: 4000.0,
                },
                Unheard {
                    node: "n9".into(),
                    gpus: 4,
                    in_slurm: false,
                    reserve_w: 4000.0,
                },
            ]
        );
        // Without Slurm's placement, a domain's node is as large as the largest agent's.
        let found = unheard(None, ["n1", "n9"], &sessions, 1000.0);
        assert_eq!(found.len(), 1);
        assert_eq!((found[0].gpus, found[0].reserve_w), (2, 2000.0));
        // With nothing known, it is still named, at 0 W.
        let found = unheard(None, ["n9"], &BTreeMap::new(), 1000.0);
        assert_eq!((found[0].gpus, found[0].reserve_w), (0, 0.0));
        // Once every node has spoken, none is unheard.
        let all = BTreeMap::from([session("n1", 2), session("n2", 4), session("n9", 1)]);
        assert!(unheard(Some(&p), ["n9"], &all, 1000.0).is_empty());
    }
}
