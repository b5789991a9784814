//! The curves CSV: a site's measured power–throughput points, one row per job and cap.
//!
//! ```text
//! job,cap_w,power_w,throughput[,gpus][,tier][,dram_copy_product]
//! llama70b-pt,700,5520,7450,8,flex2,0.18
//! llama70b-pt,600,4740,7210,8,flex2,0.18
//! ```
//! - `job`: any name; rows of one job need not be adjacent.
//! - `cap_w`: per-GPU power cap, W. The highest cap of a job is its uncapped point.
//! - `power_w`: the job's summed realised GPU power at that cap, W.
//! - `throughput`: the job's rate at that cap (tokens/s or steps/s; one unit per job).
//! - `gpus`, `tier`, `dram_copy_product`: optional; when present, one value per job.
//!
//! Columns may come in any order; other columns are ignored. Blank lines and lines that
//! start with `#` are skipped. Fields follow RFC 4180 (read and written by the `csv`
//! crate): a field with a comma or a quote is quoted, so a tier such as
//! `"max-slowdown=15%,x"` round-trips. Every error names the line and the column.

use crate::curve::OperatingPoint;
use crate::units::Watts;

/// The most rows a curves file may hold: well above any site, low enough that a stray
/// multi-gigabyte file is refused instead of exhausting memory.
pub const MAX_ROWS: usize = 2_000_000;

/// One job's measured curve and what the file says about it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobCurveRecord {
    pub job: String,
    pub gpus: Option<u32>,
    pub tier: Option<String>,
    pub dram_copy_product: Option<f64>,
    /// Points sorted by cap, caps unique.
    pub points: Vec<OperatingPoint>,
}

impl JobCurveRecord {
    /// The uncapped point (highest cap).
    pub fn uncapped(&self) -> Option<&OperatingPoint> {
        self.points.last()
    }
}

/// What is wrong with a curves file.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CurvesError {
    #[error("the curves file is empty; expected a header such as job,cap_w,power_w,throughput")]
    Empty,
    #[error("line {line}: header lacks column \"{column}\"; required: job, cap_w, power_w, throughput (optional: gpus, tier, dram_copy_product)")]
    MissingColumn { line: usize, column: &'static str },
    #[error("line {line}: column \"{column}\" appears twice in the header")]
    DuplicateColumn { line: usize, column: String },
    #[error("line {line}: expected {expected} fields as in the header, found {found}")]
    FieldCount {
        line: usize,
        expected: usize,
        found: usize,
    },
    #[error("line {line}, column {column}: {message}")]
    BadValue {
        line: usize,
        column: &'static str,
        message: String,
    },
    #[error("line {line}: job \"{job}\" has cap {cap_w} W twice")]
    DuplicateCap {
        line: usize,
        job: String,
        cap_w: f64,
    },
    #[error("line {line}, column {column}: job \"{job}\" already has {column} = {previous}, this row says {found}")]
    Inconsistent {
        line: usize,
        job: String,
        column: &'static str,
        previous: String,
        found: String,
    },
    #[error("job \"{job}\" has {points} point(s); a curve needs the uncapped point and at least one capped point")]
    TooFewPoints { job: String, points: usize },
    #[error("the curves file has more than {max} rows")]
    TooManyRows { max: usize },
    #[error("the curves file has a header but no rows")]
    NoRows,
    #[error("line {line}: not readable as CSV: {message}; expected comma-separated fields, quoted with \" when they hold a comma or a quote")]
    Csv { line: usize, message: String },
}

struct Columns {
    job: usize,
    cap: usize,
    power: usize,
    throughput: usize,
    gpus: Option<usize>,
    tier: Option<usize>,
    dram: Option<usize>,
    count: usize,
}

fn parse_header(line_no: usize, names: &[&str]) -> Result<Columns, CurvesError> {
    for (i, name) in names.iter().enumerate() {
        if names[..i].contains(name) {
            return Err(CurvesError::DuplicateColumn {
                line: line_no,
                column: (*name).to_string(),
            });
        }
    }
    let find = |name: &'static str| names.iter().position(|n| *n == name);
    let need = |name: &'static str| {
        find(name).ok_or(CurvesError::MissingColumn {
            line: line_no,
            column: name,
        })
    };
    Ok(Columns {
        job: need("job")?,
        cap: need("cap_w")?,
        power: need("power_w")?,
        throughput: need("throughput")?,
        gpus: find("gpus"),
        tier: find("tier"),
        dram: find("dram_copy_product"),
        count: names.len(),
    })
}

fn positive(line: usize, column: &'static str, text: &str) -> Result<f64, CurvesError> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(CurvesError::BadValue {
            line,
            column,
            message: format!("\"{}\" is not a positive number", printable(text)),
        }),
    }
}

/// Shows user text safely in a message: control characters escaped, long text cut.
fn printable(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(40)
        .flat_map(char::escape_default)
        .collect();
    if text.chars().count() > 40 {
        out.push('…');
    }
    out
}

/// The data rows of a curves file with their line numbers: comments (`#`, also after
/// leading blanks, as before quoting was supported) and blank lines skipped.
fn rows(text: &str) -> impl Iterator<Item = Result<(usize, csv::StringRecord), CurvesError>> + '_ {
    let reader = csv::ReaderBuilder::new()
        .has_headers(false)
        // Field counts are checked against the header here, with the line in the message.
        .flexible(true)
        .trim(csv::Trim::All)
        .from_reader(text.as_bytes());
    reader
        .into_records()
        .map(|row| {
            row.map(|r| {
                let line = r.position().map_or(0, |p| p.line() as usize);
                (line, r)
            })
            .map_err(|e| CurvesError::Csv {
                line: e.position().map_or(0, |p| p.line() as usize),
                message: e.to_string(),
            })
        })
        .filter(|row| match row {
            Ok((_, r)) => {
                let first = r.get(0).unwrap_or("");
                !(first.starts_with('#') || (r.len() == 1 && first.is_empty()))
            }
            Err(_) => true,
        })
}

/// Parses a curves file. Jobs come back in order of first appearance.
pub fn parse_curves(text: &str) -> Result<Vec<JobCurveRecord>, CurvesError> {
    // A byte-order mark from a spreadsheet export is not part of the first column's name.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = rows(text);
    let (header_line, header) = lines.next().ok_or(CurvesError::Empty)??;
    let names: Vec<&str> = header.iter().collect();
    let cols = parse_header(header_line, &names)?;
    let mut jobs: Vec<JobCurveRecord> = Vec::new();
    let mut index: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    // Caps seen per job (bit patterns): duplicate detection in constant time per row.
    let mut seen_caps: Vec<std::collections::HashSet<u64>> = Vec::new();
    let mut rows = 0usize;
    for row in lines {
        let (line, record) = row?;
        rows += 1;
        if rows > MAX_ROWS {
            return Err(CurvesError::TooManyRows { max: MAX_ROWS });
        }
        let fields: Vec<&str> = record.iter().collect();
        if fields.len() != cols.count {
            return Err(CurvesError::FieldCount {
                line,
                expected: cols.count,
                found: fields.len(),
            });
        }
        let job = fields[cols.job];
        if job.is_empty() {
            return Err(CurvesError::BadValue {
                line,
                column: "job",
                message: "empty job name".to_string(),
            });
        }
        let point = OperatingPoint {
            cap_w: Watts(positive(line, "cap_w", fields[cols.cap])?),
            power_w: Watts(positive(line, "power_w", fields[cols.power])?),
            throughput: positive(line, "throughput", fields[cols.throughput])?,
        };
        let gpus = match cols.gpus.map(|i| fields[i]).filter(|s| !s.is_empty()) {
            None => None,
            Some(s) => match s.parse::<u32>() {
                Ok(g) if g > 0 => Some(g),
                _ => {
                    return Err(CurvesError::BadValue {
                        line,
                        column: "gpus",
                        message: format!("\"{}\" is not a whole number of GPUs ≥ 1", printable(s)),
                    })
                }
            },
        };
        let tier = cols
            .tier
            .map(|i| fields[i])
            .filter(|s| !s.is_empty())
            .map(str::to_string);
        let dram = match cols.dram.map(|i| fields[i]).filter(|s| !s.is_empty()) {
            None => None,
            Some(s) => match s.parse::<f64>() {
                Ok(v) if v.is_finite() && (0.0..=1.0).contains(&v) => Some(v),
                _ => {
                    return Err(CurvesError::BadValue {
                        line,
                        column: "dram_copy_product",
                        message: format!("\"{}\" is not a fraction between 0 and 1", printable(s)),
                    })
                }
            },
        };
        let slot = match index.get(job) {
            Some(&i) => i,
            None => {
                index.insert(job.to_string(), jobs.len());
                seen_caps.push(std::collections::HashSet::new());
                jobs.push(JobCurveRecord {
                    job: job.to_string(),
                    gpus,
                    tier: tier.clone(),
                    dram_copy_product: dram,
                    points: Vec::new(),
                });
                jobs.len() - 1
            }
        };
        let record = &mut jobs[slot];
        check_same(line, job, "gpus", &record.gpus, &gpus)?;
        check_same(line, job, "tier", &record.tier, &tier)?;
        check_same(
            line,
            job,
            "dram_copy_product",
            &record.dram_copy_product,
            &dram,
        )?;
        if !seen_caps[slot].insert(point.cap_w.0.to_bits()) {
            return Err(CurvesError::DuplicateCap {
                line,
                job: job.to_string(),
                cap_w: point.cap_w.0,
            });
        }
        record.points.push(point);
    }
    if jobs.is_empty() {
        return Err(CurvesError::NoRows);
    }
    for record in &mut jobs {
        if record.points.len() < 2 {
            return Err(CurvesError::TooFewPoints {
                job: record.job.clone(),
                points: record.points.len(),
            });
        }
        record
            .points
            .sort_by(|a, b| a.cap_w.0.total_cmp(&b.cap_w.0));
    }
    Ok(jobs)
}

fn check_same<T: PartialEq + std::fmt::Debug>(
    line: usize,
    job: &str,
    column: &'static str,
    previous: &Option<T>,
    found: &Option<T>,
) -> Result<(), CurvesError> {
    if previous != found {
        let show = |v: &Option<T>| {
            v.as_ref()
                .map_or("(empty)".to_string(), |v| format!("{v:?}"))
        };
        return Err(CurvesError::Inconsistent {
            line,
            job: job.to_string(),
            column,
            previous: show(previous),
            found: show(found),
        });
    }
    Ok(())
}

/// Writes records back as a curves file (with every optional column), quoting any field
/// that needs it.
pub fn write_curves(records: &[JobCurveRecord]) -> String {
    let mut out = csv::Writer::from_writer(Vec::new());
    let mut row = |fields: [&str; 7]| {
        // Writing to memory cannot fail, and every row has the header's seven fields.
        out.write_record(fields)
            .expect("a csv writer into memory does not fail");
    };
    row([
        "job",
        "cap_w",
        "power_w",
        "throughput",
        "gpus",
        "tier",
        "dram_copy_product",
    ]);
    for r in records {
        let gpus = r.gpus.map_or(String::new(), |g| g.to_string());
        let dram = r
            .dram_copy_product
            .map_or(String::new(), |d| format!("{d:.3}"));
        for p in &r.points {
            row([
                &r.job,
                &p.cap_w.0.to_string(),
                &p.power_w.0.to_string(),
                &p.throughput.to_string(),
                &gpus,
                r.tier.as_deref().unwrap_or(""),
                &dram,
            ]);
        }
    }
    let bytes = out
        .into_inner()
        .expect("a csv writer into memory does not fail");
    String::from_utf8(bytes).expect("csv writes the UTF-8 it was given")
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "\
# measured on 8x H200
job,cap_w,power_w,throughput,gpus
a,700,5600,1000,8
a,500,4000,900,8
b,700,4400,300,4
b,300,1200,180,4
a,300,2400,600,8
";

    #[test]
    fn parses_and_groups_by_job() {
        let jobs = parse_curves(GOOD).expect("parse");
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[0].job, "a");
        assert_eq!(jobs[0].gpus, Some(8));
        let caps: Vec<f64> = jobs[0].points.iter().map(|p| p.cap_w.0).collect();
        assert_eq!(caps, vec![300.0, 500.0, 700.0]);
        assert_eq!(jobs[1].uncapped().map(|p| p.throughput), Some(300.0));
    }

    #[test]
    fn round_trips_through_writer() {
        let jobs = parse_curves(GOOD).expect("parse");
        let again = parse_curves(&write_curves(&jobs)).expect("reparse");
        assert_eq!(jobs, again);
    }

    #[test]
    fn errors_name_line_and_column() {
        let cases: Vec<(&str, CurvesError)> = vec![
            ("", CurvesError::Empty),
            (
                "job,cap_w,power_w\n",
                CurvesError::MissingColumn {
                    line: 1,
                    column: "throughput",
                },
            ),
            (
                "job,cap_w,cap_w,power_w,throughput\n",
                CurvesError::DuplicateColumn {
                    line: 1,
                    column: "cap_w".into(),
                },
            ),
            ("job,cap_w,power_w,throughput\n", CurvesError::NoRows),
            (
                "job,cap_w,power_w,throughput\na,700,5600\n",
                CurvesError::FieldCount {
                    line: 2,
                    expected: 4,
                    found: 3,
                },
            ),
            (
                "job,cap_w,power_w,throughput\na,700,lots,1\n",
                CurvesError::BadValue {
                    line: 2,
                    column: "power_w",
                    message: "\"lots\" is not a positive number".into(),
                },
            ),
            (
                "job,cap_w,power_w,throughput\na,700,1,1\na,700,1,1\n",
                CurvesError::DuplicateCap {
                    line: 3,
                    job: "a".into(),
                    cap_w: 700.0,
                },
            ),
            (
                "job,cap_w,power_w,throughput\na,700,1,1\n",
                CurvesError::TooFewPoints {
                    job: "a".into(),
                    points: 1,
                },
            ),
            (
                "job,cap_w,power_w,throughput,gpus\na,700,1,1,8\na,600,1,1,4\n",
                CurvesError::Inconsistent {
                    line: 3,
                    job: "a".into(),
                    column: "gpus",
                    previous: "8".into(),
                    found: "4".into(),
                },
            ),
            (
                "job,cap_w,power_w,throughput\na,-700,1,1\n",
                CurvesError::BadValue {
                    line: 2,
                    column: "cap_w",
                    message: "\"-700\" is not a positive number".into(),
                },
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(parse_curves(text), Err(expected), "input {text:?}");
        }
    }

    #[test]
    fn messages_are_readable() {
        let err = parse_curves("job,cap_w,power_w,throughput\na,700,NaN,1\n").expect_err("nan");
        assert_eq!(
            err.to_string(),
            "line 2, column power_w: \"NaN\" is not a positive number"
        );
    }

    /// The README: the `tier` column takes any --power-flex value, a comma included.
    #[test]
    fn quoted_fields_round_trip() {
        let text = "job,cap_w,power_w,throughput,gpus,tier\n\
            \"llama, 70b\",700,5600,1000,8,\"max-slowdown=15%,notify\"\n\
            \"llama, 70b\",500,4000,900,8,\"max-slowdown=15%,notify\"\n\
            \"say \"\"hi\"\"\",700,700,10,1,flex2\n\
            \"say \"\"hi\"\"\",300,300,5,1,flex2\n";
        let jobs = parse_curves(text).expect("parse");
        assert_eq!(jobs[0].job, "llama, 70b");
        assert_eq!(jobs[0].tier.as_deref(), Some("max-slowdown=15%,notify"));
        assert_eq!(jobs[1].job, "say \"hi\"");
        let written = write_curves(&jobs);
        assert!(written.contains("\"max-slowdown=15%,notify\""), "{written}");
        assert_eq!(parse_curves(&written).expect("reparse"), jobs);
    }

    /// Extra columns after the known ones (as in the Zeus NSDI'23 export) are ignored,
    /// indented comments and blank lines skipped, and lines counted as in the file.
    #[test]
    fn extra_columns_comments_and_line_numbers() {
        let text = "# exported\n\
            job,cap_w,power_w,throughput,gpus,gpu,max_power_w,throughput_unit,workload\n\
            \n\
            z|RTX6000|a,100,96.6,174.4,1,RTX6000,260,epochs/hour,cifar100/shufflenetv2\n   \n\
            \x20 # a note\n\
            z|RTX6000|a,260,250.0,300.0,1,RTX6000,260,epochs/hour,cifar100/shufflenetv2\n\
            z|RTX6000|a,lots,250.0,300.0,1,RTX6000,260,epochs/hour,cifar100/shufflenetv2\n";
        assert_eq!(
            parse_curves(text),
            Err(CurvesError::BadValue {
                line: 8,
                column: "cap_w",
                message: "\"lots\" is not a positive number".into(),
            })
        );
        let good: String = text.lines().take(7).map(|l| format!("{l}\n")).collect();
        let jobs = parse_curves(&good).expect("parse");
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0].points.len(), 2);
        assert_eq!(jobs[0].gpus, Some(1));
    }

    #[test]
    fn byte_order_mark_and_small_rates_are_fine() {
        let jobs = parse_curves(
            "\u{feff}job,cap_w,power_w,throughput\na,700,5600,0.004\na,500,4000,0.003\n",
        )
        .expect("parse");
        assert_eq!(jobs[0].points[1].throughput, 0.004);
        assert_eq!(
            parse_curves(&write_curves(&jobs)).expect("round trip"),
            jobs
        );
    }
}
