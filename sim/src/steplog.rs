//! The step log `powerflex-simjob` writes (one CSV row per completed step) and the demo
//! reads, in one place so writer and reader cannot drift apart. Read and written with the
//! `csv` crate: the header names the columns, and a reader follows the names, not the
//! positions.
//!
//! ```text
//! # powerflex-simjob: SIMULATED training job 12, profile … (comment lines start with #)
//! simulated,step,tokens,elapsed_s,tokens_per_s,cap_min_w,cap_max_w,unix_ms
//! true,1,32768,1.000,32768.0,700,700,1796144400000
//! ```

use std::io::Write;

use serde::{Deserialize, Serialize};

/// One completed step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    /// Always true: the job is SIMULATED, and every row says so.
    pub simulated: bool,
    /// Steps completed so far, from 1.
    pub step: u64,
    /// Tokens trained so far.
    pub tokens: u64,
    /// Simulated seconds since the first step began.
    pub elapsed_s: f64,
    /// Tokens per simulated second during this step.
    pub tokens_per_s: f64,
    /// Lowest and highest power cap among the job's GPUs during the step, whole W (as
    /// the log always printed them).
    pub cap_min_w: u32,
    pub cap_max_w: u32,
    /// Wall-clock end of the step, Unix milliseconds.
    pub unix_ms: u64,
}

/// Why a step log could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StepLogError {
    #[error("step log line {line}: {message}; expected the columns simulated,step,tokens,elapsed_s,tokens_per_s,cap_min_w,cap_max_w,unix_ms")]
    Row { line: u64, message: String },
    #[error("cannot write the step log: {0}")]
    Write(#[from] csv::Error),
    #[error("cannot write the step log: {0}")]
    Io(#[from] std::io::Error),
}

/// Writes a step log: the comment, the header, then one row per [`StepLogWriter::step`],
/// each flushed so a reader sees whole rows while the job runs.
#[derive(Debug)]
pub struct StepLogWriter<W: Write> {
    out: csv::Writer<W>,
}

impl<W: Write> StepLogWriter<W> {
    /// Starts a log with a `# comment` line (newlines in it become spaces).
    pub fn new(mut out: W, comment: &str) -> Result<Self, StepLogError> {
        writeln!(out, "# {}", comment.replace(['\n', '\r'], " "))?;
        let mut out = csv::WriterBuilder::new()
            .has_headers(false)
            .from_writer(out);
        out.write_record([
            "simulated",
            "step",
            "tokens",
            "elapsed_s",
            "tokens_per_s",
            "cap_min_w",
            "cap_max_w",
            "unix_ms",
        ])?;
        out.flush()?;
        Ok(Self { out })
    }

    pub fn step(&mut self, row: &StepRow) -> Result<(), StepLogError> {
        self.out.serialize(row)?;
        self.out.flush()?;
        Ok(())
    }
}

/// Reads a step log. The file may be read while the job is still writing it, so an
/// unreadable *last* line is a row in progress and is left out; an unreadable row before
/// it is an error.
pub fn read_steps(text: &str) -> Result<Vec<StepRow>, StepLogError> {
    let mut reader = csv::ReaderBuilder::new()
        .comment(Some(b'#'))
        .trim(csv::Trim::All)
        .from_reader(text.as_bytes());
    let complete = text.ends_with('\n');
    let mut rows = Vec::new();
    let mut records = reader.deserialize::<StepRow>().peekable();
    while let Some(row) = records.next() {
        match row {
            Ok(row) => rows.push(row),
            Err(_) if records.peek().is_none() && !complete => break,
            Err(e) => {
                return Err(StepLogError::Row {
                    line: e.position().map_or(0, csv::Position::line),
                    message: e.to_string(),
                })
            }
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(step: u64) -> StepRow {
        StepRow {
            simulated: true,
            step,
            tokens: step * 1000,
            elapsed_s: step as f64 * 1.25,
            tokens_per_s: 800.0,
            cap_min_w: 500,
            cap_max_w: 700,
            unix_ms: 1_796_144_400_000 + step,
        }
    }

    #[test]
    fn written_rows_read_back() {
        let mut log = StepLogWriter::new(Vec::new(), "SIMULATED job 7,\nprofile a").expect("new");
        log.step(&row(1)).expect("row");
        log.step(&row(2)).expect("row");
        let text = String::from_utf8(log.out.into_inner().expect("bytes")).expect("utf-8");
        assert!(
            text.starts_with("# SIMULATED job 7, profile a\nsimulated,step,"),
            "{text}"
        );
        assert_eq!(read_steps(&text).expect("read"), vec![row(1), row(2)]);
    }

    #[test]
    fn a_row_in_progress_is_left_out_but_a_bad_row_before_it_is_an_error() {
        let header =
            "# c\nsimulated,step,tokens,elapsed_s,tokens_per_s,cap_min_w,cap_max_w,unix_ms\n";
        let whole = "true,1,1000,1.25,800,500,700,1796144400001\n";
        let partial = format!("{header}{whole}true,2,20");
        assert_eq!(read_steps(&partial).expect("read"), vec![row(1)]);
        let bad = format!("{header}true,x,1000,1.25,800,500,700,1\n{whole}");
        assert!(
            matches!(read_steps(&bad), Err(StepLogError::Row { line: 3, .. })),
            "{:?}",
            read_steps(&bad)
        );
        assert_eq!(read_steps(header).expect("empty").len(), 0);
    }
}
