//! The crate's one error type. Each area has its own typed enum (`PartialEq`, so tests
//! assert the exact variant); [`Error`] gathers them for callers that mix areas.

use crate::allocate::AllocationError;
use crate::config::ConfigError;
use crate::curve::CurveError;
use crate::curves_csv::CurvesError;
use crate::evaluate::EvaluateError;
use crate::flex::FlexError;
use crate::gpus::GpuListError;
use crate::slurm_record::SlurmRecordError;
use crate::units::{PowerParseError, ShareParseError};
use crate::workload::PaperTableError;

/// Any error from powerflex-core. Messages are lowercase, without a trailing period,
/// and name what was wrong and what is accepted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Flex(#[from] FlexError),
    #[error(transparent)]
    Curve(#[from] CurveError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Curves(#[from] CurvesError),
    #[error(transparent)]
    Allocation(#[from] AllocationError),
    #[error(transparent)]
    Evaluate(#[from] EvaluateError),
    #[error(transparent)]
    Power(#[from] PowerParseError),
    #[error(transparent)]
    Share(#[from] ShareParseError),
    #[error(transparent)]
    PaperTable(#[from] PaperTableError),
    #[error(transparent)]
    GpuList(#[from] GpuListError),
    #[error(transparent)]
    SlurmRecord(#[from] SlurmRecordError),
}
