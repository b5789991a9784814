//! A curves CSV as `powerflexctl pfi|allocate|evaluate` read it, and what they compute
//! from what parses: PFI per job.
#![no_main]
use libfuzzer_sys::fuzz_target;
use powerflex_core::curves_csv::parse_curves;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(records) = parse_curves(text) {
        for r in &records {
            let _ = powerflex_core::pfi::pfi(&r.points);
        }
    }
});
