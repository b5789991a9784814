//! The site config (powerflex.toml): parse and validate, never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use powerflex_core::config::SiteConfig;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = SiteConfig::from_toml_str(text);
    }
});
