//! The agent's persisted state file, as a restart reads it (possibly truncated or
//! corrupt): loading never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = serde_json::from_slice::<powerflex_agent_machine::saved::PersistedState>(data);
});
