//! The daemons' signals: SIGTERM and SIGINT set a shutdown flag, SIGHUP asks for a
//! reload. The watcher thread blocks until a signal arrives (`signal-hook`'s self-pipe),
//! so a signal is acted on at once and an idle daemon wakes for nothing.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::{Handle, Signals};
use tracing::info;

use crate::DaemonError;

/// A running signal watcher; [`SignalWatcher::stop`] (or drop) ends it.
#[derive(Debug)]
pub struct SignalWatcher {
    handle: Handle,
    thread: Option<JoinHandle<()>>,
}

impl SignalWatcher {
    /// Registers SIGTERM, SIGINT and SIGHUP and starts the watcher thread: it sets
    /// `shutdown` on SIGTERM/SIGINT and calls `on_reload` on SIGHUP (re-read the config,
    /// hand it to the main loop). A second SIGTERM while shutting down is logged and
    /// otherwise ignored, so restoring the GPUs' caps is not cut short.
    pub fn spawn(
        shutdown: Arc<AtomicBool>,
        mut on_reload: impl FnMut() + Send + 'static,
    ) -> Result<SignalWatcher, DaemonError> {
        let mut signals =
            Signals::new([SIGTERM, SIGINT, SIGHUP]).map_err(|source| DaemonError::Io {
                what: "cannot register handlers for",
                path: "SIGTERM, SIGINT and SIGHUP".into(),
                source,
            })?;
        let handle = signals.handle();
        let thread = std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for signal in signals.forever() {
                    if signal == SIGHUP {
                        info!(signal, "reload requested");
                        on_reload();
                    } else {
                        info!(signal, "shutdown requested");
                        shutdown.store(true, Ordering::SeqCst);
                    }
                }
            })
            .map_err(DaemonError::io("cannot start thread", "signals"))?;
        Ok(SignalWatcher {
            handle,
            thread: Some(thread),
        })
    }

    /// Ends the watcher and waits for its thread. The handlers stay registered with no
    /// action, so a late signal during the exit is ignored rather than killing it.
    pub fn stop(mut self) {
        self.close();
    }

    fn close(&mut self) {
        self.handle.close();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for SignalWatcher {
    fn drop(&mut self) {
        self.close();
    }
}

/// For a process with no main loop to wake (a simulated job): SIGTERM and SIGINT store
/// their number into the returned cell (0 until one arrives) instead of ending the
/// process, so the caller can finish its work, clean up and report which one came.
pub fn stop_signal_cell() -> Result<Arc<AtomicUsize>, DaemonError> {
    let cell = Arc::new(AtomicUsize::new(0));
    for signal in [SIGTERM, SIGINT] {
        signal_hook::flag::register_usize(signal, cell.clone(), signal as usize).map_err(
            |source| DaemonError::Io {
                what: "cannot register a handler for",
                path: format!("signal {signal}"),
                source,
            },
        )?;
    }
    Ok(cell)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    // One test: signals are process-wide, so parallel tests raising them would race.
    #[test]
    fn raised_signals_reach_the_watcher_and_the_cell() {
        let shutdown = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let watcher = SignalWatcher::spawn(shutdown.clone(), move || {
            let _ = tx.send(());
        })
        .expect("watcher");

        signal_hook::low_level::raise(SIGHUP).expect("raise HUP");
        rx.recv_timeout(Duration::from_secs(5))
            .expect("reload called");
        assert!(!shutdown.load(Ordering::SeqCst), "SIGHUP is no shutdown");

        signal_hook::low_level::raise(SIGTERM).expect("raise TERM");
        wait_for("the shutdown flag", || shutdown.load(Ordering::SeqCst));
        // A second stop signal does not end the process (we are still here).
        signal_hook::low_level::raise(SIGINT).expect("raise INT");
        assert!(rx.try_recv().is_err(), "no reload from a stop signal");
        watcher.stop();

        let cell = stop_signal_cell().expect("cell");
        assert_eq!(cell.load(Ordering::SeqCst), 0);
        signal_hook::low_level::raise(SIGINT).expect("raise INT");
        wait_for("the cell", || {
            cell.load(Ordering::SeqCst) == SIGINT as usize
        });
        // And through the kill wrapper, by PID, as the testbed sends it.
        crate::os::kill(std::process::id(), crate::os::Signal::TERM).expect("kill self");
        wait_for("the cell", || {
            cell.load(Ordering::SeqCst) == SIGTERM as usize
        });
    }
}
