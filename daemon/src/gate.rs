//! Admission of connections to a daemon's Unix socket by the peer's uid (`SO_PEERCRED`,
//! see [`crate::os::peer_of`]): a cap per non-root user, a cap on all users together, an
//! allowance for root, and a cap on everything, so no user holding idle connections can
//! starve other users, slurmstepd's registrations or the site's operator.
//!
//! Two shapes of the same limits, one per kind of socket:
//! - [`GateLimits::shared`] (the node agent's sockets): one pool of places, some of them
//!   reserved for root; root may also take any free place users may take.
//! - [`GateLimits::separate`] (the controller's admin socket): users and root each have
//!   their own allowance, and neither takes the other's.
//!
//! [`Admission`] is the pure bookkeeping (unit-tested here); [`Gate`] puts it behind a
//! mutex for the acceptor threads and hands out a [`Place`] that gives itself back when
//! dropped, so a connection thread that ends in any way frees its place. A refusal is a
//! typed [`Refusal`]: each daemon words its own reply and counts it under its own label.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

/// How many connections one socket serves at once, by who holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateLimits {
    /// Connections one non-root uid may hold.
    pub per_uid: usize,
    /// Connections all non-root uids together may hold.
    pub users: usize,
    /// Connections root may hold.
    pub root: usize,
    /// Connections held by anyone, root included.
    pub total: usize,
}

impl GateLimits {
    /// One pool of `total` places, `reserved_for_root` of them root's alone; root may take
    /// any free place.
    pub const fn shared(total: usize, per_uid: usize, reserved_for_root: usize) -> GateLimits {
        GateLimits {
            per_uid,
            users: total.saturating_sub(reserved_for_root),
            root: total,
            total,
        }
    }

    /// Separate allowances: `users` for all non-root uids (at most `per_uid` each) and
    /// `root` for root, neither taking the other's.
    pub const fn separate(per_uid: usize, users: usize, root: usize) -> GateLimits {
        GateLimits {
            per_uid,
            users,
            root,
            total: users.saturating_add(root),
        }
    }
}

/// Why a connection was not admitted, with the count that stopped it (for the reply).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `open` connections are held in all: the socket's cap.
    Full { open: usize },
    /// Root holds `open` connections: root's allowance.
    RootFull { open: usize },
    /// Non-root users hold `open` connections together: their allowance.
    UsersFull { open: usize },
    /// This uid holds `open` connections: the per-user cap.
    UidFull { uid: u32, open: usize },
}

/// The connections a socket holds, by uid. Pure: the acceptor asks it before serving a
/// connection and tells it when the connection ends.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Admission {
    by_uid: BTreeMap<u32, usize>,
    total: usize,
}

impl Admission {
    /// Admits a connection from `uid`, or says why not: the most specific limit first
    /// (a user over their own cap is told that, the reason they can act on), the
    /// socket's cap last.
    pub fn admit(&mut self, limits: &GateLimits, uid: u32) -> Result<(), Refusal> {
        let mine = self.held_by(uid);
        if uid == 0 {
            if mine >= limits.root {
                return Err(Refusal::RootFull { open: mine });
            }
        } else {
            if mine >= limits.per_uid {
                return Err(Refusal::UidFull { uid, open: mine });
            }
            let users = self.total - self.held_by(0);
            if users >= limits.users {
                return Err(Refusal::UsersFull { open: users });
            }
        }
        if self.total >= limits.total {
            return Err(Refusal::Full { open: self.total });
        }
        *self.by_uid.entry(uid).or_insert(0) += 1;
        self.total += 1;
        Ok(())
    }

    /// A connection from `uid` ended. Releasing what was never admitted changes nothing.
    pub fn release(&mut self, uid: u32) {
        if let Some(n) = self.by_uid.get_mut(&uid) {
            *n -= 1;
            self.total -= 1;
            if *n == 0 {
                self.by_uid.remove(&uid);
            }
        }
    }

    /// Connections `uid` holds now.
    pub fn held_by(&self, uid: u32) -> usize {
        self.by_uid.get(&uid).copied().unwrap_or(0)
    }
}

/// [`Admission`] shared by a socket's acceptor and its connection threads.
#[derive(Debug)]
pub struct Gate {
    limits: GateLimits,
    admission: Mutex<Admission>,
}

/// One admitted connection's place, given back when dropped.
#[derive(Debug)]
pub struct Place {
    gate: Arc<Gate>,
    uid: u32,
}

impl Gate {
    pub fn new(limits: GateLimits) -> Arc<Gate> {
        Arc::new(Gate {
            limits,
            admission: Mutex::new(Admission::default()),
        })
    }

    pub fn limits(&self) -> &GateLimits {
        &self.limits
    }

    /// Admits one connection of `uid` (see [`Admission::admit`]).
    pub fn enter(self: &Arc<Gate>, uid: u32) -> Result<Place, Refusal> {
        self.admission
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .admit(&self.limits, uid)?;
        Ok(Place {
            gate: Arc::clone(self),
            uid,
        })
    }

    /// Connections `uid` holds now.
    pub fn held_by(&self, uid: u32) -> usize {
        self.admission
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .held_by(uid)
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.gate
            .admission
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .release(self.uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The agent's shape: 8 places, 4 of them root's.
    const SHARED: GateLimits = GateLimits::shared(8, 3, 4);

    /// One user holding many idle connections must not starve every job's progress, nor,
    /// refreshing them, slurmstepd's registrations.
    #[test]
    fn shared_one_user_cannot_take_the_places_of_others_or_of_root() {
        let mut a = Admission::default();
        for _ in 0..3 {
            assert_eq!(a.admit(&SHARED, 1000), Ok(()));
        }
        assert_eq!(
            a.admit(&SHARED, 1000),
            Err(Refusal::UidFull { uid: 1000, open: 3 })
        );
        assert_eq!(a.held_by(1000), 3);
        // Another user gets the last place open to users, then the reserve is root's.
        assert_eq!(a.admit(&SHARED, 1001), Ok(()));
        assert_eq!(a.admit(&SHARED, 1002), Err(Refusal::UsersFull { open: 4 }));
        for _ in 0..4 {
            assert_eq!(a.admit(&SHARED, 0), Ok(()));
        }
        assert_eq!(
            a.admit(&SHARED, 0),
            Err(Refusal::Full { open: 8 }),
            "the cap holds for root too"
        );
        a.release(1000);
        assert_eq!(
            a.admit(&SHARED, 1002),
            Ok(()),
            "a freed open place is anyone's"
        );
        assert_eq!(a.admit(&SHARED, 0), Err(Refusal::Full { open: 8 }));
        a.release(0);
        assert_eq!(
            a.admit(&SHARED, 1003),
            Err(Refusal::UsersFull { open: 4 }),
            "a freed reserved place stays root's"
        );
        assert_eq!(a.admit(&SHARED, 0), Ok(()));
        // A user at their own cap is told so first, whatever else is full: it is the
        // reason they can act on (the agent said `full` here before the gates were one).
        assert_eq!(a.held_by(1000), 2);
        a.release(1001);
        assert_eq!(a.admit(&SHARED, 1000), Ok(()));
        assert_eq!(a.admit(&SHARED, 1001), Err(Refusal::UsersFull { open: 4 }));
        assert_eq!(a.admit(&SHARED, 0), Err(Refusal::Full { open: 8 }));
        assert_eq!(
            a.admit(&SHARED, 1000),
            Err(Refusal::UidFull { uid: 1000, open: 3 })
        );
        let before = a.clone();
        a.release(4242);
        assert_eq!(a, before);
    }

    #[test]
    fn shared_root_may_take_the_places_users_may_take() {
        let mut a = Admission::default();
        for _ in 0..8 {
            assert_eq!(a.admit(&SHARED, 0), Ok(()));
        }
        assert_eq!(a.admit(&SHARED, 1000), Err(Refusal::Full { open: 8 }));
        for _ in 0..8 {
            a.release(0);
        }
        assert_eq!(a, Admission::default());
    }

    /// The controller's admin socket: users can never lock the operator out, and root
    /// never takes the users' allowance either.
    #[test]
    fn separate_allowances_for_users_and_root() {
        let limits = GateLimits::separate(2, 3, 1);
        let mut a = Admission::default();
        assert_eq!(a.admit(&limits, 1000), Ok(()));
        assert_eq!(a.admit(&limits, 1000), Ok(()));
        assert_eq!(
            a.admit(&limits, 1000),
            Err(Refusal::UidFull { uid: 1000, open: 2 })
        );
        assert_eq!(a.admit(&limits, 1001), Ok(()));
        assert_eq!(a.admit(&limits, 1002), Err(Refusal::UsersFull { open: 3 }));
        assert_eq!(
            a.admit(&limits, 0),
            Ok(()),
            "users filling theirs leave root's"
        );
        assert_eq!(a.admit(&limits, 0), Err(Refusal::RootFull { open: 1 }));
        a.release(1000);
        a.release(1000);
        a.release(1001);
        assert_eq!(a.admit(&limits, 0), Err(Refusal::RootFull { open: 1 }));
    }

    #[test]
    fn a_place_is_given_back_when_dropped() {
        let gate = Gate::new(GateLimits::separate(1, 1, 1));
        let place = gate.enter(1000).expect("first");
        assert_eq!(
            gate.enter(1000).map(|_| ()),
            Err(Refusal::UidFull { uid: 1000, open: 1 })
        );
        assert_eq!(gate.held_by(1000), 1);
        drop(place);
        assert_eq!(gate.held_by(1000), 0);
        assert!(gate.enter(1000).is_ok());
    }
}
