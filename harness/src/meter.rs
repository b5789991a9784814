//! What the site's meter reads: one sample every 50 ms of the site's clock.

/// One 50 ms sample of the meter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub t_ms: u64,
    /// Every GPU's noise-free draw, summed, W.
    pub draw_w: f64,
    /// The budget in force at that instant (base or `budget set`, less the events'
    /// stepped cuts, from the controller's saved state), W.
    pub budget_w: f64,
}
