//! The daemons' signals, shared by `powerflexd` and `powerflex-ctld`: SIGTERM and SIGINT
//! become a shutdown flag, SIGHUP a reload request, both seen by one watcher thread (the
//! handlers only store to atomics, which is all a signal handler may safely do).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

static STOP: AtomicBool = AtomicBool::new(false);
static RELOAD: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

extern "C" fn on_hangup(_: libc::c_int) {
    RELOAD.store(true, Ordering::SeqCst);
}

/// Installs the handlers and starts the watcher: it sets `shutdown` on SIGTERM/SIGINT,
/// calls `on_reload` on SIGHUP (re-read the config, hand it to the main loop), and ends
/// once `shutdown` is set, by a signal or by the daemon itself.
pub fn spawn_watcher(
    shutdown: Arc<AtomicBool>,
    mut on_reload: impl FnMut() + Send + 'static,
) -> JoinHandle<()> {
    let handlers: [(libc::c_int, extern "C" fn(libc::c_int)); 3] = [
        (libc::SIGTERM, on_stop),
        (libc::SIGINT, on_stop),
        (libc::SIGHUP, on_hangup),
    ];
    for (signal, handler) in handlers {
        // SAFETY: each handler only stores to an atomic, which is async-signal-safe.
        #[allow(unsafe_code)]
        unsafe {
            libc::signal(signal, handler as *const () as libc::sighandler_t);
        }
    }
    std::thread::spawn(move || {
        while !shutdown.load(Ordering::SeqCst) {
            if STOP.load(Ordering::SeqCst) {
                shutdown.store(true, Ordering::SeqCst);
            }
            if RELOAD.swap(false, Ordering::SeqCst) {
                on_reload();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    })
}
