//! What the decision refuses to be set up with.

/// Why a site config gives no allocation settings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecideError {
    /// The GPU model asked for is none of the site's.
    #[error("GPU model \"{name}\" is not in the site config; it has: {}", .known.join(", "))]
    UnknownGpuModel {
        name: String,
        /// The site's models, in the config's order.
        known: Vec<String>,
    },
    /// The site config names no GPU model, so no cap step or fail-safe cap applies.
    #[error("the site config has no GPU model")]
    NoGpuModel,
}
