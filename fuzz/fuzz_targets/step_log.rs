//! A simulated job's step log as the demo reads it (`powerflex_sim::steplog`): no panic,
//! and rows that read write back and read again unchanged.
#![no_main]
use libfuzzer_sys::fuzz_target;
use powerflex_sim::steplog::{read_steps, StepLogWriter};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(rows) = read_steps(text) else {
        return;
    };
    // NaN is a valid f64 in a log but never equal to itself; the property is for numbers.
    if rows
        .iter()
        .any(|r| !(r.elapsed_s.is_finite() && r.tokens_per_s.is_finite()))
    {
        return;
    }
    let mut bytes = Vec::new();
    {
        let mut log = StepLogWriter::new(&mut bytes, "fuzz").expect("write to memory");
        for r in &rows {
            log.step(r).expect("write to memory");
        }
    }
    let again = read_steps(std::str::from_utf8(&bytes).expect("utf-8")).expect("reads back");
    assert_eq!(again, rows);
});
