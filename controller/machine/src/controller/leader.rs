//! Leadership under `[controller.ha]`: whether this controller steers the
//! site, and with which epoch, decided from the leadership database's answers and the
//! time. Pure: the edge (`powerflex_controller::ctld::ha`) runs the claims in
//! PostgreSQL and hands back what they said, with when they were sent.
//!
//! - **One claim at a time.** The edge asks [`Leader::claim_due`] each turn; a claim is
//!   due every third of the leadership TTL (a renewal while active, a poll while not).
//!   In the database it is one transaction, on the database's clock: renew the row if
//!   this controller holds it with its epoch, take it (the epoch raised by one, the
//!   state the last active controller committed read in the same transaction) if it
//!   has lapsed or names this controller, else report who holds it.
//! - **Step down before the row can lapse.** The row, once renewed by a claim sent at
//!   `t`, lasts until at least `t + TTL` on the database's clock. An active controller
//!   whose last successful renewal was sent at `t` stops steering at `t + 2/3 TTL`, a
//!   third of a TTL before any standby may take over, whatever the database does
//!   meanwhile (a claim that hangs is no answer). It sends no lease from then on; the
//!   agents keep their last lease's caps until it runs out, then the fail-safe.
//! - **Takeover.** A standby polls every third of a TTL, so it takes over at most 4/3
//!   TTL after the active controller's last renewal (the config keeps that within half a
//!   node lease). It steers from the state the database holds, with the new epoch on
//!   every lease: agents refuse the old one's leases from their first lease of the new.

use powerflex_core::UnixMs;
use powerflex_proto::status::{LeadershipRole, LeadershipView};
use tracing::{error, info, warn};

use super::state::CtldState;
use crate::error::MachineError;

/// What leadership is configured with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderSettings {
    /// This controller's name (`controller.ha.name`): what the database's row holds.
    pub name: String,
    /// How long leadership lasts unless renewed, ms (`controller.ha.leader_ttl_s`).
    pub ttl_ms: u64,
}

impl LeaderSettings {
    /// A claim (renewal or poll) is due this often.
    pub fn claim_every_ms(&self) -> u64 {
        (self.ttl_ms / 3).max(1)
    }

    /// An active controller whose last renewal was sent this long ago steps down.
    pub fn step_down_after_ms(&self) -> u64 {
        self.ttl_ms * 2 / 3
    }
}

/// Least time between a claim and one an agent's refusal asks for early, ms.
const EARLY_CLAIM_GAP_MS: u64 = 1_000;

/// A claim for the edge to run in the database, in one transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// The epoch this controller steers with, to renew; `None`: not active, take
    /// leadership if it is free.
    pub renew_epoch: Option<u64>,
}

/// What the database answered a claim (or a fenced state save).
#[derive(Debug, Clone, PartialEq)]
pub enum ClaimAnswer {
    /// This controller still holds leadership with this epoch, renewed.
    Renewed { epoch: u64 },
    /// This controller took leadership: the epoch raised to `epoch`, and the state the
    /// last active controller committed (none before any did), read in the same
    /// transaction. `previous_holder` held it before (`None`: nobody ever did).
    TookOver {
        epoch: u64,
        state: Option<Box<CtldState>>,
        previous_holder: Option<String>,
    },
    /// Another controller holds leadership, until `expires_in_ms` from the database's
    /// now unless it renews.
    HeldBy {
        holder: String,
        epoch: u64,
        expires_in_ms: u64,
    },
}

/// What the edge hands the machine.
#[derive(Debug, Clone, PartialEq)]
pub enum LeaderInput {
    /// The answer to a claim sent at `sent`, or why it failed.
    Answer {
        sent: UnixMs,
        answer: Result<ClaimAnswer, MachineError>,
    },
    /// An agent refused this controller's lease of `lease_epoch` because it follows a
    /// controller of `accepted_epoch`. The database, not the agent, says who leads: a
    /// refusal of this leadership's epoch by a later one sends a claim at once, whose
    /// answer keeps this controller active (the refusal was false or stale) or stands it
    /// by (another took over). One node's word never steps it down.
    Fenced {
        lease_epoch: u64,
        accepted_epoch: u64,
    },
    /// Time passed (the edge's turn): the step-down deadline is checked.
    Tick,
}

/// What changed, for the edge to carry out.
#[derive(Debug, Clone, PartialEq)]
pub enum LeaderChange {
    /// Nothing to do but show the view.
    None,
    /// This controller took leadership with `epoch`: it steers from `state` (the
    /// database's; `None`: nothing committed yet) with that epoch.
    BecameActive {
        epoch: u64,
        state: Option<Box<CtldState>>,
        previous_holder: Option<String>,
    },
    /// This controller stopped steering (it stepped down, or another took over).
    StoppedSteering,
}

/// The leadership state machine (see the module docs).
#[derive(Debug, Clone)]
pub struct Leader {
    settings: LeaderSettings,
    role: LeadershipRole,
    /// The epoch this controller steers (or last steered) with.
    epoch: u64,
    /// When the last successful claim (renewal or takeover) was sent, while active.
    renewed_sent: Option<UnixMs>,
    /// When the claim in flight was sent, if one is.
    in_flight: Option<UnixMs>,
    /// When the last claim was sent.
    last_sent: Option<UnixMs>,
    holder: Option<String>,
    reason: Option<String>,
    since: UnixMs,
    /// An agent's refusal asks for a claim now, not at the next third of a TTL.
    claim_now: bool,
}

impl Leader {
    /// A controller starting at `now`: a standby until its first claim wins.
    pub fn new(settings: LeaderSettings, now: UnixMs) -> Leader {
        Leader {
            settings,
            role: LeadershipRole::Standby,
            epoch: 0,
            renewed_sent: None,
            in_flight: None,
            last_sent: None,
            holder: None,
            reason: Some("starting: leadership not claimed yet".into()),
            since: now,
            claim_now: false,
        }
    }

    pub fn active(&self) -> bool {
        self.role == LeadershipRole::Active
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn settings(&self) -> &LeaderSettings {
        &self.settings
    }

    /// The claim to send now, if one is due and none is in flight; it counts as sent.
    pub fn claim_due(&mut self, now: UnixMs) -> Option<Claim> {
        if self.in_flight.is_some() {
            return None;
        }
        let gap_ms = self.claim_gap_ms();
        let due = self.last_sent.is_none_or(|t| now.ms() >= t.ms() + gap_ms);
        if !due {
            return None;
        }
        self.claim_now = false;
        self.in_flight = Some(now);
        self.last_sent = Some(now);
        Some(Claim {
            renew_epoch: self.active().then_some(self.epoch),
        })
    }

    /// Least time from the last claim to the next: a third of the TTL, or a second when
    /// an agent's refusal asks for one early.
    fn claim_gap_ms(&self) -> u64 {
        let every = self.settings.claim_every_ms();
        if self.claim_now {
            every.min(EARLY_CLAIM_GAP_MS)
        } else {
            every
        }
    }

    /// Until when this controller may act as the leader, on the leadership clock: the
    /// step-down deadline of its last renewal while active, `None` otherwise. A command
    /// decided under this leadership and still queued past it is dropped, never run: by
    /// then a standby may lead (a paused process thawed late finds it passed).
    pub fn steering_until(&self) -> Option<UnixMs> {
        self.renewed_sent
            .filter(|_| self.active())
            .map(|t| UnixMs(t.ms() + self.settings.step_down_after_ms()))
    }

    /// When the machine next needs a turn (a claim due, or the step-down deadline).
    pub fn next_due(&self) -> UnixMs {
        let claim = self.last_sent.map_or(0, |t| t.ms() + self.claim_gap_ms());
        let deadline = self
            .renewed_sent
            .filter(|_| self.active())
            .map_or(u64::MAX, |t| t.ms() + self.settings.step_down_after_ms());
        UnixMs(claim.min(deadline))
    }

    /// Takes one input at `now`.
    pub fn step(&mut self, now: UnixMs, input: LeaderInput) -> LeaderChange {
        let change = match input {
            LeaderInput::Answer { sent, answer } => {
                if self.in_flight == Some(sent) {
                    self.in_flight = None;
                }
                self.answer(now, sent, answer)
            }
            LeaderInput::Fenced {
                lease_epoch,
                accepted_epoch,
            } => {
                // The claim goes a second after the last at the earliest (see
                // `claim_due`): a node that repeats its refusal (falsely, or a flood)
                // must not keep the database busy, and one just after a claim is not
                // dropped but deferred.
                if self.active()
                    && lease_epoch == self.epoch
                    && accepted_epoch > self.epoch
                    && !self.claim_now
                {
                    warn!(
                        epoch = self.epoch,
                        accepted_epoch,
                        "an agent follows a later leadership; asking the database whether this controller still leads"
                    );
                    self.claim_now = true;
                }
                LeaderChange::None
            }
            LeaderInput::Tick => LeaderChange::None,
        };
        if change != LeaderChange::None {
            return change;
        }
        self.check_deadline(now)
    }

    /// Steps down when the last renewal is too old for the row to be surely held.
    fn check_deadline(&mut self, now: UnixMs) -> LeaderChange {
        let Some(renewed) = self.renewed_sent.filter(|_| self.active()) else {
            return LeaderChange::None;
        };
        let late_ms = now.ms().saturating_sub(renewed.ms());
        if late_ms < self.settings.step_down_after_ms() {
            return LeaderChange::None;
        }
        let why = self.reason.clone().unwrap_or_else(|| "no answer".into());
        error!(
            epoch = self.epoch,
            renewed_ms_ago = late_ms,
            ttl_ms = self.settings.ttl_ms,
            error = %why,
            "stepping down: leadership not renewed in time; no lease is sent until it is taken again (the agents keep their caps, then fall to the fail-safe)"
        );
        self.become_(
            now,
            LeadershipRole::SteppedDown,
            Some(format!(
                "leadership not renewed for {late_ms} ms (last error: {why})"
            )),
        );
        LeaderChange::StoppedSteering
    }

    fn answer(
        &mut self,
        now: UnixMs,
        sent: UnixMs,
        answer: Result<ClaimAnswer, MachineError>,
    ) -> LeaderChange {
        match answer {
            Ok(ClaimAnswer::Renewed { epoch }) if self.active() && epoch == self.epoch => {
                self.renewed_sent = Some(self.renewed_sent.map_or(sent, |t| t.max(sent)));
                self.reason = None;
                LeaderChange::None
            }
            // A renewal that comes back after this controller stopped: its next claim
            // takes leadership again, with a new epoch and the committed state.
            Ok(ClaimAnswer::Renewed { .. }) => LeaderChange::None,
            Ok(ClaimAnswer::TookOver {
                epoch,
                state,
                previous_holder,
            }) => {
                let was_active = self.active();
                info!(
                    name = %self.settings.name,
                    epoch,
                    previous_holder = previous_holder.as_deref().unwrap_or("none"),
                    "leadership taken: this controller steers the site"
                );
                self.epoch = epoch;
                self.renewed_sent = Some(sent);
                self.holder = None;
                self.become_(now, LeadershipRole::Active, None);
                if was_active {
                    warn!(epoch, "leadership taken again while steering: the state is reloaded with the new epoch");
                }
                LeaderChange::BecameActive {
                    epoch,
                    state,
                    previous_holder,
                }
            }
            Ok(ClaimAnswer::HeldBy {
                holder,
                epoch,
                expires_in_ms,
            }) => {
                let was_active = self.active();
                if was_active {
                    error!(
                        holder = %holder,
                        holder_epoch = epoch,
                        epoch = self.epoch,
                        "leadership lost to another controller; standing by"
                    );
                } else if self.holder.as_deref() != Some(holder.as_str()) {
                    info!(holder = %holder, holder_epoch = epoch, expires_in_ms, "standing by: another controller steers");
                }
                self.holder = Some(holder);
                if self.role != LeadershipRole::Standby || was_active {
                    self.become_(now, LeadershipRole::Standby, None);
                } else {
                    self.reason = None;
                }
                if was_active {
                    LeaderChange::StoppedSteering
                } else {
                    LeaderChange::None
                }
            }
            Err(e) => {
                let e = e.to_string();
                if self.reason.as_deref() != Some(e.as_str()) {
                    warn!(error = %e, role = self.role.name(), "leadership claim failed");
                }
                self.reason = Some(e);
                LeaderChange::None
            }
        }
    }

    fn become_(&mut self, now: UnixMs, role: LeadershipRole, reason: Option<String>) {
        if self.role != role {
            self.since = now;
        }
        self.role = role;
        self.reason = reason;
        if role != LeadershipRole::Active {
            self.renewed_sent = None;
        }
    }

    /// What `status` shows.
    pub fn view(&self) -> LeadershipView {
        LeadershipView {
            role: self.role,
            name: Some(self.settings.name.clone()),
            epoch: self.epoch,
            holder: self.holder.clone(),
            reason: self.reason.clone(),
            since_unix_ms: self.since.ms(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_800_000_000_000;
    /// Leadership of 6 s: claims every 2 s, step-down 4 s after the last renewal sent.
    fn leader() -> Leader {
        Leader::new(
            LeaderSettings {
                name: "ctld-a".into(),
                ttl_ms: 6_000,
            },
            UnixMs(T0),
        )
    }

    fn answer(sent: u64, answer: Result<ClaimAnswer, MachineError>) -> LeaderInput {
        LeaderInput::Answer {
            sent: UnixMs(sent),
            answer,
        }
    }

    fn took_over(epoch: u64) -> Result<ClaimAnswer, MachineError> {
        Ok(ClaimAnswer::TookOver {
            epoch,
            state: None,
            previous_holder: Some("ctld-b".into()),
        })
    }

    #[test]
    fn a_standby_claims_every_third_of_a_ttl_and_steers_once_it_takes_over() {
        let mut l = leader();
        assert!(!l.active());
        assert_eq!(l.claim_due(UnixMs(T0)), Some(Claim { renew_epoch: None }));
        assert_eq!(l.claim_due(UnixMs(T0 + 5_000)), None, "one claim in flight");
        let held = Ok(ClaimAnswer::HeldBy {
            holder: "ctld-b".into(),
            epoch: 3,
            expires_in_ms: 5_000,
        });
        assert_eq!(
            l.step(UnixMs(T0 + 10), answer(T0, held)),
            LeaderChange::None
        );
        assert_eq!(l.view().holder.as_deref(), Some("ctld-b"));
        assert_eq!(l.claim_due(UnixMs(T0 + 1_999)), None);
        assert_eq!(
            l.claim_due(UnixMs(T0 + 2_000)),
            Some(Claim { renew_epoch: None })
        );
        let change = l.step(UnixMs(T0 + 2_010), answer(T0 + 2_000, took_over(4)));
        assert!(matches!(
            change,
            LeaderChange::BecameActive { epoch: 4, .. }
        ));
        assert!(l.active());
        assert_eq!(l.view().role, LeadershipRole::Active);
        // Active: each claim renews its own epoch.
        assert_eq!(
            l.claim_due(UnixMs(T0 + 4_000)),
            Some(Claim {
                renew_epoch: Some(4)
            })
        );
    }

    #[test]
    fn an_active_controller_that_cannot_renew_steps_down_before_its_row_can_lapse() {
        let mut l = leader();
        l.claim_due(UnixMs(T0));
        l.step(UnixMs(T0 + 5), answer(T0, took_over(1)));
        // Renewed once at T0 + 2 s, then the database is gone.
        l.claim_due(UnixMs(T0 + 2_000));
        l.step(
            UnixMs(T0 + 2_005),
            answer(T0 + 2_000, Ok(ClaimAnswer::Renewed { epoch: 1 })),
        );
        l.claim_due(UnixMs(T0 + 4_000));
        l.step(
            UnixMs(T0 + 4_100),
            answer(
                T0 + 4_000,
                Err(MachineError::Database("connection refused".into())),
            ),
        );
        assert!(l.active(), "one failed renewal is within the margin");
        // A hung claim is no answer: the deadline still falls, 2/3 TTL after the last
        // renewal was sent (4 s before the row could lapse at T0 + 8 s, at the earliest).
        l.claim_due(UnixMs(T0 + 6_000));
        assert_eq!(
            l.step(UnixMs(T0 + 5_999), LeaderInput::Tick),
            LeaderChange::None
        );
        assert_eq!(l.next_due(), UnixMs(T0 + 6_000));
        assert_eq!(
            l.step(UnixMs(T0 + 6_000), LeaderInput::Tick),
            LeaderChange::StoppedSteering
        );
        let view = l.view();
        assert_eq!(view.role, LeadershipRole::SteppedDown);
        assert!(view
            .reason
            .is_some_and(|r| r.contains("connection refused")));
        // The hung claim answers late, renewed: it does not make this controller steer
        // again; the next claim takes leadership anew (new epoch, committed state).
        l.step(
            UnixMs(T0 + 6_500),
            answer(T0 + 6_000, Ok(ClaimAnswer::Renewed { epoch: 1 })),
        );
        assert!(!l.active());
        assert_eq!(
            l.claim_due(UnixMs(T0 + 8_000)),
            Some(Claim { renew_epoch: None })
        );
        let change = l.step(UnixMs(T0 + 8_010), answer(T0 + 8_000, took_over(2)));
        assert!(matches!(
            change,
            LeaderChange::BecameActive { epoch: 2, .. }
        ));
    }

    #[test]
    fn leadership_lost_stops_steering_at_once_and_an_agent_s_refusal_asks_the_database() {
        let mut l = leader();
        l.claim_due(UnixMs(T0));
        l.step(UnixMs(T0 + 5), answer(T0, took_over(5)));
        l.claim_due(UnixMs(T0 + 2_000));
        let held = Ok(ClaimAnswer::HeldBy {
            holder: "ctld-b".into(),
            epoch: 6,
            expires_in_ms: 6_000,
        });
        assert_eq!(
            l.step(UnixMs(T0 + 2_005), answer(T0 + 2_000, held)),
            LeaderChange::StoppedSteering
        );
        assert_eq!(l.view().role, LeadershipRole::Standby);
        // An agent's refusal never steps it down by itself: a refusal of this epoch by a
        // later one asks the database at once; a stale one (another epoch refused, or
        // one no later) asks nothing.
        let mut l = leader();
        l.claim_due(UnixMs(T0));
        l.step(UnixMs(T0 + 5), answer(T0, took_over(5)));
        let fenced = |lease_epoch, accepted_epoch| LeaderInput::Fenced {
            lease_epoch,
            accepted_epoch,
        };
        assert_eq!(l.step(UnixMs(T0 + 1_100), fenced(5, 0)), LeaderChange::None);
        assert_eq!(l.step(UnixMs(T0 + 1_101), fenced(4, 6)), LeaderChange::None);
        assert_eq!(l.claim_due(UnixMs(T0 + 1_102)), None, "nothing to ask yet");
        assert_eq!(l.step(UnixMs(T0 + 1_103), fenced(5, 6)), LeaderChange::None);
        assert!(l.active(), "one node's word does not step it down");
        assert_eq!(
            l.next_due(),
            UnixMs(T0 + 1_000),
            "a second after the last claim"
        );
        assert_eq!(
            l.claim_due(UnixMs(T0 + 1_104)),
            Some(Claim {
                renew_epoch: Some(5)
            }),
            "the database asked at once"
        );
        // The row still names it: the refusal was false or stale, it keeps steering.
        assert_eq!(
            l.step(
                UnixMs(T0 + 1_110),
                answer(T0 + 1_104, Ok(ClaimAnswer::Renewed { epoch: 5 }))
            ),
            LeaderChange::None
        );
        assert!(l.active());
        // The same refusal again within a second asks at most one a second: deferred
        // to a second after the last claim, not dropped.
        l.step(UnixMs(T0 + 1_200), fenced(5, 6));
        assert_eq!(
            l.claim_due(UnixMs(T0 + 1_201)),
            None,
            "at most one a second"
        );
        assert_eq!(l.next_due(), UnixMs(T0 + 2_104));
        assert!(
            l.claim_due(UnixMs(T0 + 2_104)).is_some(),
            "deferred, not dropped"
        );
        // Another took over: the answer says so and it stands by.
        let held = Ok(ClaimAnswer::HeldBy {
            holder: "ctld-b".into(),
            epoch: 6,
            expires_in_ms: 6_000,
        });
        assert_eq!(
            l.step(UnixMs(T0 + 2_110), answer(T0 + 2_104, held)),
            LeaderChange::StoppedSteering
        );
        assert!(!l.active());
    }
}
