//! Power domains: the facility's electrical tree below its budget, from the feeds to the
//! racks. Each domain has a limit (its breaker's, or what the site may put through it);
//! every node belongs to exactly one leaf. Validated from `[[domains]]` in the site
//! config ([`crate::config`]); the controller splits its budget within every limit at
//! once ([`crate::allocate::allocate_within`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::slurm_record::{expand_hostlist, valid_node_name, MAX_NODE_NAME_BYTES};
use crate::units::Watts;

/// The most domains a site config may declare: a 10,000-node site has a few hundred
/// racks; a file past this is a mistake, not a facility.
pub const MAX_DOMAINS: usize = 10_000;
/// The most nodes one leaf's `nodes` hostlist may name.
pub const MAX_NODES_PER_DOMAIN: usize = 65_536;
/// The most nodes all leaves together may name: ten times the largest site planned for.
pub const MAX_NODES_IN_ALL: usize = 1_000_000;
/// The most levels from a top domain to a leaf (feed, switchboard, row, PDU, rack and a
/// few more).
pub const MAX_DEPTH: usize = 16;
/// The highest limit a domain may have, W: far above any facility's GPUs (1 GW).
pub const MAX_DOMAIN_LIMIT_W: f64 = 1e9;
/// The longest domain name, bytes.
pub const MAX_DOMAIN_NAME_BYTES: usize = 64;

/// `[[domains]]`: one power domain as the site config writes it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "reference", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawDomain {
    /// The domain's name (1 to 64 of `A-Z a-z 0-9 . _ -`), unique in the file: what
    /// `powerflexctl event add --domain` and `budget set --domain` name.
    pub name: String,
    /// The domain it sits in; none for a top domain (fed straight from the facility,
    /// under `facility.gpu_budget_w`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// The most the powerflex-managed GPUs behind this domain may draw, watts (its
    /// breaker's rating less what else it feeds). Above 0, at most 1e9.
    pub gpu_limit_w: f64,
    /// A leaf's nodes, as a Slurm hostlist (`gpu[001-040]`); only leaves (domains no
    /// other names as parent) have nodes, and every node is in one leaf only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<String>,
}

/// One validated domain.
#[derive(Debug, Clone, PartialEq)]
pub struct Domain {
    pub name: String,
    /// Index of its parent in [`DomainTree::domains`]; none for a top domain.
    pub parent: Option<usize>,
    pub gpu_limit: Watts,
    /// Indices of its children.
    pub children: Vec<usize>,
    /// A leaf's nodes (empty for an inner domain).
    pub nodes: Vec<String>,
}

impl Domain {
    pub fn is_leaf(&self) -> bool {
        self.children.is_empty()
    }
}

/// The site's domains, checked: names unique, parents known, no cycle, nodes only in
/// leaves and each node in one leaf.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DomainTree {
    domains: Vec<Domain>,
    /// Each domain's index by name: the controller looks domains up by name for every
    /// domain in every allocation.
    by_name: BTreeMap<String, usize>,
    leaf_of: BTreeMap<String, usize>,
}

/// What is wrong with a site's `[[domains]]`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DomainError {
    #[error(
        "domains[{index}].name \"{}\" is not a domain name; accepted: 1 to {MAX_DOMAIN_NAME_BYTES} of A-Z a-z 0-9 . _ -",
        .name.escape_default()
    )]
    BadName { index: usize, name: String },
    #[error("domain \"{name}\" is declared twice")]
    Duplicate { name: String },
    #[error("domain \"{name}\": parent \"{}\" is not a declared domain", .parent.escape_default())]
    UnknownParent { name: String, parent: String },
    #[error("domain \"{name}\" never reaches a top domain through its parents (a cycle)")]
    Cycle { name: String },
    #[error("domain \"{name}\" is more than {MAX_DEPTH} levels deep")]
    TooDeep { name: String },
    #[error("domain \"{name}\": gpu_limit_w = {value} is out of range; accepted: above 0, at most {MAX_DOMAIN_LIMIT_W}")]
    BadLimit { name: String, value: f64 },
    #[error("domain \"{name}\" has child domains and nodes; only a leaf (a domain no other names as parent) lists nodes")]
    NodesInInnerDomain { name: String },
    #[error("domain \"{name}\" is a leaf without nodes; give it `nodes = \"<hostlist>\"` or a child domain")]
    EmptyLeaf { name: String },
    #[error("domain \"{name}\": nodes {} is not a Slurm hostlist of at most {MAX_NODES_PER_DOMAIN} names", .nodes.escape_default())]
    BadHostlist { name: String, nodes: String },
    #[error("domain \"{name}\": \"{}\" is not a node name (1 to {MAX_NODE_NAME_BYTES} ASCII letters, digits, '.', '_' or '-', as Slurm names nodes)", .node.escape_default())]
    BadNodeName { name: String, node: String },
    #[error("node {node} is listed twice, in \"{first}\" and in \"{second}\"; every node belongs to exactly one leaf, once")]
    NodeTwice {
        node: String,
        first: String,
        second: String,
    },
    #[error("{count} domains; at most {MAX_DOMAINS} are accepted")]
    TooMany { count: usize },
    #[error("the leaves name more than {MAX_NODES_IN_ALL} nodes in all")]
    TooManyNodes,
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_DOMAIN_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl DomainTree {
    /// Validates `[[domains]]`. An empty list is a site without domains.
    pub fn build(raw: &[RawDomain]) -> Result<DomainTree, DomainError> {
        if raw.len() > MAX_DOMAINS {
            return Err(DomainError::TooMany { count: raw.len() });
        }
        let mut index: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, d) in raw.iter().enumerate() {
            if !valid_name(&d.name) {
                return Err(DomainError::BadName {
                    index: i,
                    name: d.name.clone(),
                });
            }
            if index.insert(d.name.as_str(), i).is_some() {
                return Err(DomainError::Duplicate {
                    name: d.name.clone(),
                });
            }
            if !(d.gpu_limit_w.is_finite()
                && d.gpu_limit_w > 0.0
                && d.gpu_limit_w <= MAX_DOMAIN_LIMIT_W)
            {
                return Err(DomainError::BadLimit {
                    name: d.name.clone(),
                    value: d.gpu_limit_w,
                });
            }
        }
        let mut domains: Vec<Domain> = raw
            .iter()
            .map(|d| Domain {
                name: d.name.clone(),
                parent: None,
                gpu_limit: Watts(d.gpu_limit_w),
                children: Vec::new(),
                nodes: Vec::new(),
            })
            .collect();
        for (i, d) in raw.iter().enumerate() {
            if let Some(parent) = &d.parent {
                let Some(&p) = index.get(parent.as_str()) else {
                    return Err(DomainError::UnknownParent {
                        name: d.name.clone(),
                        parent: parent.clone(),
                    });
                };
                domains[i].parent = Some(p);
                domains[p].children.push(i);
            }
        }
        // Every chain of parents ends at a top domain within MAX_DEPTH steps; a chain
        // longer than there are domains must go round a cycle.
        for d in &domains {
            let mut depth = 0;
            let mut at = d.parent;
            while let Some(p) = at {
                depth += 1;
                if depth > domains.len() {
                    return Err(DomainError::Cycle {
                        name: d.name.clone(),
                    });
                }
                at = domains[p].parent;
            }
            if depth > MAX_DEPTH {
                return Err(DomainError::TooDeep {
                    name: d.name.clone(),
                });
            }
        }
        let mut leaf_of: BTreeMap<String, usize> = BTreeMap::new();
        for (i, d) in raw.iter().enumerate() {
            let leaf = domains[i].is_leaf();
            match (&d.nodes, leaf) {
                (Some(_), false) => {
                    return Err(DomainError::NodesInInnerDomain {
                        name: d.name.clone(),
                    })
                }
                (None, true) => {
                    return Err(DomainError::EmptyLeaf {
                        name: d.name.clone(),
                    })
                }
                (None, false) => {}
                (Some(list), true) => {
                    let names = expand_hostlist(list, MAX_NODES_PER_DOMAIN).ok_or_else(|| {
                        DomainError::BadHostlist {
                            name: d.name.clone(),
                            nodes: list.clone(),
                        }
                    })?;
                    // Every name a node name no agent could fail to have: `gpu01, gpu02`
                    // would name " gpu02", `a],b` a node called that; such a node would
                    // be placed nowhere and its leaf would govern nothing.
                    if let Some(bad) = names.iter().find(|n| !valid_node_name(n)) {
                        return Err(DomainError::BadNodeName {
                            name: d.name.clone(),
                            node: bad.clone(),
                        });
                    }
                    if leaf_of.len() + names.len() > MAX_NODES_IN_ALL {
                        return Err(DomainError::TooManyNodes);
                    }
                    for node in &names {
                        if let Some(&first) = leaf_of.get(node) {
                            // The same leaf twice (`n[1-3],n2`) is a slip too: refused,
                            // as a node in two leaves is.
                            return Err(DomainError::NodeTwice {
                                node: node.clone(),
                                first: domains[first].name.clone(),
                                second: d.name.clone(),
                            });
                        }
                        leaf_of.insert(node.clone(), i);
                    }
                    domains[i].nodes = names;
                }
            }
        }
        let by_name = index.into_iter().map(|(n, i)| (n.to_string(), i)).collect();
        Ok(DomainTree {
            domains,
            by_name,
            leaf_of,
        })
    }

    /// Whether the site has no domains.
    pub fn is_empty(&self) -> bool {
        self.domains.is_empty()
    }

    /// Every domain, in the order the config declares them.
    pub fn domains(&self) -> &[Domain] {
        &self.domains
    }

    /// The index of the domain called `name`.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// How many nodes the leaves place (every node of a site that declares domains).
    pub fn node_count(&self) -> usize {
        self.leaf_of.len()
    }

    /// The leaf `node` belongs to; none for a node the config places nowhere.
    pub fn leaf_of(&self, node: &str) -> Option<usize> {
        self.leaf_of.get(node).copied()
    }

    /// `domain` and every domain above it, leaf first.
    pub fn path(&self, domain: usize) -> impl Iterator<Item = usize> + '_ {
        std::iter::successors(Some(domain), move |&d| self.domains[d].parent)
    }

    /// The domains `node` is in, its leaf first; empty for a node placed nowhere.
    pub fn path_of_node(&self, node: &str) -> Vec<usize> {
        self.leaf_of(node)
            .map(|leaf| self.path(leaf).collect())
            .unwrap_or_default()
    }

    /// Each domain's depth (0 for a top domain), for drawing the tree.
    pub fn depth(&self, domain: usize) -> usize {
        self.path(domain).count() - 1
    }

    /// Domains in the order a tree is drawn: each top domain, then its children in turn,
    /// depth first, in the config's order.
    pub fn preorder(&self) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.domains.len());
        let mut stack: Vec<usize> = self
            .domains
            .iter()
            .enumerate()
            .filter(|(_, d)| d.parent.is_none())
            .map(|(i, _)| i)
            .rev()
            .collect();
        while let Some(d) = stack.pop() {
            out.push(d);
            stack.extend(self.domains[d].children.iter().rev());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(name: &str, parent: Option<&str>, limit: f64, nodes: Option<&str>) -> RawDomain {
        RawDomain {
            name: name.into(),
            parent: parent.map(Into::into),
            gpu_limit_w: limit,
            nodes: nodes.map(Into::into),
        }
    }

    fn site() -> Vec<RawDomain> {
        vec![
            raw("feed-a", None, 100_000.0, None),
            raw("row-1", Some("feed-a"), 60_000.0, None),
            raw("rack-1", Some("row-1"), 30_000.0, Some("n[1-2]")),
            raw("rack-2", Some("row-1"), 30_000.0, Some("n[3-4]")),
            raw("feed-b", None, 50_000.0, Some("m1,m2")),
        ]
    }

    #[test]
    fn a_tree_from_feeds_to_racks_places_every_node_once() {
        let tree = DomainTree::build(&site()).expect("valid");
        let names = |path: Vec<usize>| -> Vec<String> {
            path.into_iter()
                .map(|d| tree.domains()[d].name.clone())
                .collect()
        };
        assert_eq!(
            names(tree.path_of_node("n3")),
            ["rack-2", "row-1", "feed-a"]
        );
        assert_eq!(names(tree.path_of_node("m2")), ["feed-b"]);
        assert!(tree.path_of_node("x9").is_empty());
        assert_eq!(
            names(tree.preorder()),
            ["feed-a", "row-1", "rack-1", "rack-2", "feed-b"]
        );
        assert_eq!(tree.depth(tree.find("rack-1").expect("rack")), 2);
    }

    #[test]
    fn each_mistake_is_refused_by_name() {
        let cases: Vec<(Vec<RawDomain>, &str)> = vec![
            (vec![raw("bad name", None, 1.0, Some("n1"))], "bad name"),
            (
                vec![
                    raw("a", None, 1.0, Some("n1")),
                    raw("a", None, 1.0, Some("n2")),
                ],
                "declared twice",
            ),
            (
                vec![raw("a", Some("zz"), 1.0, Some("n1"))],
                "\"zz\" is not a declared",
            ),
            (
                vec![
                    raw("a", Some("b"), 1.0, None),
                    raw("b", Some("a"), 1.0, None),
                ],
                "cycle",
            ),
            (vec![raw("a", None, 0.0, Some("n1"))], "gpu_limit_w = 0"),
            (
                vec![raw("a", None, f64::NAN, Some("n1"))],
                "gpu_limit_w = NaN",
            ),
            (vec![raw("a", None, 1e12, Some("n1"))], "out of range"),
            (
                vec![
                    raw("a", None, 1.0, Some("n1")),
                    raw("b", Some("a"), 1.0, Some("n2")),
                ],
                "only a leaf",
            ),
            (vec![raw("a", None, 1.0, None)], "a leaf without nodes"),
            (
                vec![raw("a", None, 1.0, Some("gpu01, gpu02"))],
                "\" gpu02\" is not a node name",
            ),
            (
                vec![raw("a", None, 1.0, Some("a],b"))],
                "\"a],b\" is not a node name",
            ),
            (
                vec![raw("a", None, 1.0, Some("n\u{f8}de[1-2]"))],
                "is not a node name",
            ),
            (
                vec![raw(
                    "a",
                    None,
                    1.0,
                    Some("controller-name-that-is-far-too-long-for-any-slurm-node-name-at-all"),
                )],
                "is not a node name (1 to 64 ASCII",
            ),
            (
                vec![raw("a", None, 1.0, Some("n[1-3],n2"))],
                "node n2 is listed twice, in \"a\" and in \"a\"",
            ),
            (
                vec![raw("a", None, 1.0, Some("n[1-"))],
                "not a Slurm hostlist",
            ),
            (
                vec![
                    raw("a", None, 1.0, Some("n[1-3]")),
                    raw("b", None, 1.0, Some("n3")),
                ],
                "node n3 is listed twice, in \"a\" and in \"b\"",
            ),
        ];
        for (domains, says) in cases {
            let e = DomainTree::build(&domains).expect_err("refused");
            assert!(e.to_string().contains(says), "{e} should say {says}");
        }
        let deep: Vec<RawDomain> = (0..=MAX_DEPTH + 1)
            .map(|i| {
                let parent = (i > 0).then(|| format!("d{}", i - 1));
                let last = i == MAX_DEPTH + 1;
                raw(
                    &format!("d{i}"),
                    parent.as_deref(),
                    1.0,
                    last.then_some("n1"),
                )
            })
            .collect();
        let e = DomainTree::build(&deep).expect_err("too deep");
        assert!(e.to_string().contains("levels deep"), "{e}");
    }
}
