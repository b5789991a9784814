//! Loopback ports for tests and benches that start daemons (feature `test-ports`; never
//! in a shipped binary).
//!
//! A port from the kernel's ephemeral range, once released, can be taken by any
//! outgoing connection or any `bind(:0)` before the test's daemon binds it (a controller
//! was refused `Address already in use` in a loaded clean-clone run), and a connect to
//! a closed one can even succeed (a loopback connect whose source port happens to equal
//! its destination port connects to itself). A port below that range is taken only by a
//! bind that names it.

use std::hash::{BuildHasher, Hasher};

/// The lowest port drawn: above the well-known and the usual registered service ports.
const LOWEST: u16 = 10_000;

/// A loopback TCP port free at the time of asking, drawn at random below the kernel's
/// ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`); a port from that range
/// only when the range leaves too little room below it. Panics when no port is free.
pub fn free_loopback_port() -> u16 {
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    if ephemeral_from > LOWEST + 1_000 {
        let span = u64::from(ephemeral_from - LOWEST);
        for _ in 0..500 {
            // A fresh random key per draw (std's hasher seeds), so concurrent tests
            // draw apart.
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            let port = LOWEST + u16::try_from(h.finish() % span).unwrap_or(0);
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("cannot find a free loopback port: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_bindable_ports_below_the_ephemeral_range() {
        let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|t| t.split_whitespace().next()?.parse::<u16>().ok())
            .unwrap_or(32_768);
        let drawn: Vec<u16> = (0..20).map(|_| free_loopback_port()).collect();
        for port in &drawn {
            if ephemeral_from > LOWEST + 1_000 {
                assert!((LOWEST..ephemeral_from).contains(port), "{port}");
            }
            std::net::TcpListener::bind(("127.0.0.1", *port)).expect("still free");
        }
        let distinct: std::collections::BTreeSet<_> = drawn.iter().collect();
        assert!(distinct.len() > 1, "draws differ: {drawn:?}");
    }
}
