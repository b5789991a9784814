//! The leadership row (`powerflex_leader`) as a claim's transaction reads it, and what
//! the claim does with it. Pure: the edge
//! (`powerflex_controller::ctld::ha`) reads the row, asks [`decide`], and writes what it
//! answers.
//!
//! - **Who holds it.** A row names its holder twice: `controller.ha.name`, and the
//!   holding process's instance token (random at its start). A live row is renewed or
//!   taken again only by the process whose name *and* token it holds. A live row with
//!   this controller's name and another token is another process: a restart of this
//!   one (the row lapses within a leadership TTL, then it is free), or a second
//!   controller configured with the same name, which would otherwise take the row back
//!   and forth forever. Either way this process waits, and says why.
//! - **The epoch.** The row's epoch is a `bigint`: a negative one, or one at `i64::MAX`
//!   (no later leadership could be numbered), is refused with the recovery steps; it is
//!   never read as 0 nor saturated.
//! - **Its own row.** [`RowAction::Take::own`]: this process held the row last, so if
//!   the state committed with it cannot be read, the state in this process's memory is
//!   the state it committed (or newer), and it may steer from it.

use super::leader::Claim;
use crate::error::MachineError;

/// The row, as read under `FOR UPDATE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// `controller.ha.name` of the holder ('' before anyone held it).
    pub holder: String,
    /// The holder's instance token ('' before anyone held it, or from a controller older
    /// than the token).
    pub token: String,
    pub epoch: i64,
    /// Not lapsed, on the database's clock.
    pub live: bool,
}

/// This controller process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Me<'a> {
    pub name: &'a str,
    pub token: &'a str,
}

/// What a claim does with the row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowAction {
    /// This process holds it with this epoch: extend it.
    Renew { epoch: u64 },
    /// Take it, with `new_epoch` and this process's name and token. `own`: this process
    /// held it last (name and token).
    Take { new_epoch: u64, own: bool },
    /// Another controller holds it.
    Held { holder: String, epoch: u64 },
    /// A live row held under this controller's name by another process: wait.
    SameName { epoch: u64 },
    /// The row's epoch is out of range: nobody may take it (why, and how to recover).
    Refuse(String),
}

/// Where the recovery steps are written.
const SEE: &str = "docs/admins.md, \"Recovering the leadership database\"";

/// What `claim` does with `row` (see the module docs).
pub fn decide(row: &Row, me: Me<'_>, claim: Claim) -> RowAction {
    let Ok(epoch) = u64::try_from(row.epoch) else {
        return RowAction::Refuse(format!(
            "the leadership row's epoch is {}, below 0 (edited by hand, or a bad restore); \
             accepted: 0 to {}. No controller takes leadership until it is fixed: find the \
             highest controller_epoch in the agents' state files (agent-state.json in each \
             agent.state_dir; absent means 0) and run UPDATE powerflex_leader SET epoch = \
             <that + 1>, holder = '', token = '', expires_at = to_timestamp(0) WHERE id = 1 \
             ({SEE})",
            row.epoch,
            i64::MAX - 1
        ));
    };
    let mine = row.holder == me.name && row.token == me.token;
    if mine && claim.renew_epoch == Some(epoch) {
        return RowAction::Renew { epoch };
    }
    if !row.live || mine {
        // Never saturated: at i64::MAX a new epoch would repeat the old one, and two
        // leaderships with one epoch are not fenced from each other.
        return match row.epoch.checked_add(1).and_then(|e| u64::try_from(e).ok()) {
            Some(new_epoch) => RowAction::Take {
                new_epoch,
                own: mine,
            },
            None => RowAction::Refuse(format!(
                "the leadership row's epoch is {}, the highest the database holds: no later \
                 leadership can be numbered. To recover, stop every powerflex-ctld and every \
                 agent, remove controller_epoch from every agent's state file \
                 (agent-state.json in each agent.state_dir), run UPDATE powerflex_leader SET \
                 epoch = 0, holder = '', token = '', expires_at = to_timestamp(0) WHERE id = 1, \
                 then start them again ({SEE})",
                row.epoch
            )),
        };
    }
    if row.holder == me.name {
        return RowAction::SameName { epoch };
    }
    RowAction::Held {
        holder: row.holder.clone(),
        epoch,
    }
}

/// What status and the log say while [`RowAction::SameName`] holds.
pub fn same_name_message(name: &str) -> String {
    format!(
        "another controller also calls itself {name}: give each controller.ha.name its own \
         value (if this controller has just restarted, it takes over once its old row \
         lapses, within controller.ha.leader_ttl_s)"
    )
}

/// Whether the committed state in the database is still behind the newest state this
/// controller steers from: a save that failed leaves it stale,
/// and the newest state is sent again with each claim until a save succeeds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DbCopy {
    /// Why the last save failed, while the copy is stale.
    stale: Option<String>,
}

/// A change of [`DbCopy`] worth a log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DbCopyChange {
    None,
    /// The database's copy fell behind (the save's error).
    BecameStale(String),
    /// A save succeeded after some failed.
    Fresh,
}

impl DbCopy {
    /// Why the database's copy is behind, if it is.
    pub fn stale(&self) -> Option<&str> {
        self.stale.as_deref()
    }

    /// Whether a claim should carry the newest state again.
    pub fn resend_with_claim(&self) -> bool {
        self.stale.is_some()
    }

    /// A save's outcome: `Ok` written, `Err` why not.
    pub fn saved(&mut self, outcome: Result<(), MachineError>) -> DbCopyChange {
        match outcome {
            Ok(()) => match self.stale.take() {
                Some(_) => DbCopyChange::Fresh,
                None => DbCopyChange::None,
            },
            Err(e) => match self.stale.replace(e.to_string()) {
                Some(_) => DbCopyChange::None,
                None => DbCopyChange::BecameStale(e.to_string()),
            },
        }
    }

    /// Leadership changed hands: what this controller owes the database starts afresh.
    pub fn reset(&mut self) {
        self.stale = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: Me<'static> = Me {
        name: "ctld-a",
        token: "t-mine",
    };

    fn row(holder: &str, token: &str, epoch: i64, live: bool) -> Row {
        Row {
            holder: holder.into(),
            token: token.into(),
            epoch,
            live,
        }
    }

    const POLL: Claim = Claim { renew_epoch: None };

    /// Two controllers with one name do not take a live row from each other; only the
    /// process that holds it (name and token) renews or retakes it.
    #[test]
    fn a_live_row_of_this_name_is_taken_only_with_this_process_s_token() {
        let twin = row("ctld-a", "t-twin", 7, true);
        assert_eq!(decide(&twin, ME, POLL), RowAction::SameName { epoch: 7 });
        assert_eq!(
            decide(
                &twin,
                ME,
                Claim {
                    renew_epoch: Some(7)
                }
            ),
            RowAction::SameName { epoch: 7 },
            "a renewal of the twin's epoch is not this process's"
        );
        let mine = row("ctld-a", "t-mine", 7, true);
        assert_eq!(
            decide(
                &mine,
                ME,
                Claim {
                    renew_epoch: Some(7)
                }
            ),
            RowAction::Renew { epoch: 7 }
        );
        assert_eq!(
            decide(&mine, ME, POLL),
            RowAction::Take {
                new_epoch: 8,
                own: true
            }
        );
        // Lapsed: anyone takes it (a restart of this controller, with a new token).
        assert_eq!(
            decide(&row("ctld-a", "t-twin", 7, false), ME, POLL),
            RowAction::Take {
                new_epoch: 8,
                own: false
            }
        );
        assert_eq!(
            decide(&row("ctld-b", "t-b", 7, true), ME, POLL),
            RowAction::Held {
                holder: "ctld-b".into(),
                epoch: 7
            }
        );
        assert!(same_name_message("ctld-a").contains(
            "another controller also calls itself ctld-a: give each controller.ha.name its own value"
        ));
    }

    /// A negative epoch is not read as 0, and i64::MAX is not saturated.
    #[test]
    fn an_epoch_out_of_range_is_refused_with_the_recovery() {
        for r in [row("", "", -1, false), row("ctld-b", "t-b", -5, true)] {
            let RowAction::Refuse(why) = decide(&r, ME, POLL) else {
                panic!("{r:?} taken");
            };
            assert!(
                why.contains("below 0") && why.contains("controller_epoch"),
                "{why}"
            );
            assert!(why.contains("UPDATE powerflex_leader SET epoch"), "{why}");
        }
        let RowAction::Refuse(why) = decide(&row("ctld-b", "t-b", i64::MAX, false), ME, POLL)
        else {
            panic!("taken at i64::MAX");
        };
        assert!(why.contains("no later leadership"), "{why}");
        assert_eq!(
            decide(&row("ctld-b", "t-b", i64::MAX - 1, false), ME, POLL),
            RowAction::Take {
                new_epoch: i64::MAX as u64,
                own: false
            }
        );
        // Held at i64::MAX by its holder: still renewed (nothing is raised).
        let held = row("ctld-a", "t-mine", i64::MAX, true);
        assert_eq!(
            decide(
                &held,
                ME,
                Claim {
                    renew_epoch: Some(i64::MAX as u64)
                }
            ),
            RowAction::Renew {
                epoch: i64::MAX as u64
            }
        );
    }

    /// A failed save is sent again with each claim until one succeeds; the
    /// copy going stale and fresh again are each said once.
    #[test]
    fn a_failed_save_is_resent_with_each_claim_until_one_succeeds() {
        let mut copy = DbCopy::default();
        assert!(!copy.resend_with_claim());
        assert_eq!(copy.saved(Ok(())), DbCopyChange::None);
        assert_eq!(
            copy.saved(Err(MachineError::Database("statement timeout".into()))),
            DbCopyChange::BecameStale("statement timeout".into())
        );
        assert!(copy.resend_with_claim());
        assert_eq!(copy.stale(), Some("statement timeout"));
        assert_eq!(
            copy.saved(Err(MachineError::Database("refused".into()))),
            DbCopyChange::None
        );
        assert!(copy.resend_with_claim(), "still stale: sent again");
        assert_eq!(copy.saved(Ok(())), DbCopyChange::Fresh);
        assert!(!copy.resend_with_claim());
        assert_eq!(copy.stale(), None);
        copy.saved(Err(MachineError::Database("x".into())));
        copy.reset();
        assert!(!copy.resend_with_claim());
    }
}
