//! The curves CSV: a site's measured power–throughput points, one row per job and cap.
//!
//! ```text
//! job,cap_w,power_w,throughput[,gpus][,tier][,dram_copy_product][,power_sigma_w,throughput_sigma]
//! llama70b-pt,700,5520,7450,8,flex2,0.18
//! llama70b-pt,600,4740,7210,8,flex2,0.18
//! ```
//! - `job`: any name; rows of one job need not be adjacent.
//! - `cap_w`: per-GPU power cap, W, above 0 and at most [`MAX_CAP_W`]. The highest cap of
//!   a job is its uncapped point.
//! - `power_w`: the job's summed realised GPU power at that cap, W, at most
//!   [`MAX_CAP_W`] per GPU of the job.
//! - `throughput`: the job's rate at that cap (tokens/s or steps/s; one unit per job),
//!   at most [`MAX_THROUGHPUT`].
//! - `gpus`, `tier`, `dram_copy_product`: optional; when present, one value per job;
//!   `gpus` from 1 to [`MAX_JOB_GPUS`].
//! - `power_sigma_w`, `throughput_sigma`: optional, together: one standard error of the
//!   row's power (W) and throughput (its unit), ≥ 0 — how well the point is known, as
//!   the agents report it. `powerflexctl allocate` plans with them the way the
//!   controller does; without them it assumes its `--noise`.
//!
//! Columns may come in any order; other columns are ignored. Blank lines and lines that
//! start with `#` are skipped. Fields follow RFC 4180 (read and written by the `csv`
//! crate): a field with a comma or a quote is quoted, so a tier such as
//! `"max-slowdown=15%,x"` round-trips. Every error names the line and the column.

use crate::point::OperatingPoint;
use crate::units::Watts;

/// The most rows a curves file may hold: well above any site, low enough that a stray
/// multi-gigabyte file is refused instead of exhausting memory.
pub const MAX_ROWS: usize = 2_000_000;
/// The highest per-GPU cap a file may name, W: the largest accelerators today are near
/// 1.5 kW, and the controller believes no GPU limit above this either.
pub const MAX_CAP_W: f64 = 5_000.0;
/// The most GPUs one job may have: ten times a 10,000-node site of 8-GPU nodes is far
/// beyond any job today, and a value past it is a typo, not a job.
pub const MAX_JOB_GPUS: u32 = 800_000;
/// The highest throughput a row may give, per second: above any real training rate
/// (10^15 tokens/s), low enough that sums over a file stay finite.
pub const MAX_THROUGHPUT: f64 = 1e15;

/// One standard error of a point, as the agents report it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PointSigma {
    pub power_w: f64,
    pub throughput: f64,
}

/// One job's measured curve and what the file says about it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobCurveRecord {
    pub job: String,
    pub gpus: Option<u32>,
    pub tier: Option<String>,
    pub dram_copy_product: Option<f64>,
    /// Points sorted by cap, caps unique.
    pub points: Vec<OperatingPoint>,
    /// Each point's standard error, in the order of `points`, when the file gives them
    /// (`power_sigma_w`, `throughput_sigma`); empty otherwise.
    pub sigma: Vec<PointSigma>,
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
    #[error("line {line}: header lacks column \"{column}\"; required: job, cap_w, power_w, throughput (optional: gpus, tier, dram_copy_product, and power_sigma_w with throughput_sigma)")]
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
    /// `power_sigma_w` and `throughput_sigma`, which come together.
    sigma: Option<(usize, usize)>,
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
    let sigma = match (find("power_sigma_w"), find("throughput_sigma")) {
        (Some(p), Some(t)) => Some((p, t)),
        (None, None) => None,
        (Some(_), None) => {
            return Err(CurvesError::MissingColumn {
                line: line_no,
                column: "throughput_sigma",
            })
        }
        (None, Some(_)) => {
            return Err(CurvesError::MissingColumn {
                line: line_no,
                column: "power_sigma_w",
            })
        }
    };
    Ok(Columns {
        job: need("job")?,
        cap: need("cap_w")?,
        power: need("power_w")?,
        throughput: need("throughput")?,
        gpus: find("gpus"),
        tier: find("tier"),
        dram: find("dram_copy_product"),
        sigma,
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

/// A positive number no larger than `max`, which the message states with `unit`.
fn positive_at_most(
    line: usize,
    column: &'static str,
    text: &str,
    max: f64,
    unit: &str,
) -> Result<f64, CurvesError> {
    let v = positive(line, column, text)?;
    if v > max {
        return Err(CurvesError::BadValue {
            line,
            column,
            message: format!(
                "{} is implausible; accepted: above 0 and at most {max}{unit}",
                printable(text)
            ),
        });
    }
    Ok(v)
}

/// A standard error: finite and ≥ 0.
fn non_negative(line: usize, column: &'static str, text: &str) -> Result<f64, CurvesError> {
    match text.parse::<f64>() {
        Ok(v) if (0.0..=MAX_THROUGHPUT).contains(&v) => Ok(v),
        _ => Err(CurvesError::BadValue {
            line,
            column,
            message: format!(
                "\"{}\" is not a standard error; accepted: a number from 0 to {MAX_THROUGHPUT}",
                printable(text)
            ),
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
        let gpus = match cols.gpus.map(|i| fields[i]).filter(|s| !s.is_empty()) {
            None => None,
            Some(s) => match s.parse::<u32>() {
                Ok(g) if (1..=MAX_JOB_GPUS).contains(&g) => Some(g),
                _ => {
                    return Err(CurvesError::BadValue {
                        line,
                        column: "gpus",
                        message: format!(
                            "\"{}\" is not a number of GPUs; accepted: a whole number from 1 to {MAX_JOB_GPUS}",
                            printable(s)
                        ),
                    })
                }
            },
        };
        let max_power_w = MAX_CAP_W * f64::from(gpus.unwrap_or(MAX_JOB_GPUS));
        let point = OperatingPoint {
            cap_w: Watts(positive_at_most(
                line,
                "cap_w",
                fields[cols.cap],
                MAX_CAP_W,
                " W per GPU",
            )?),
            power_w: Watts(positive_at_most(
                line,
                "power_w",
                fields[cols.power],
                max_power_w,
                " W for the job's GPUs",
            )?),
            throughput: positive_at_most(
                line,
                "throughput",
                fields[cols.throughput],
                MAX_THROUGHPUT,
                " per second",
            )?,
        };
        let sigma = match cols.sigma {
            None => None,
            Some((p, t)) => Some(PointSigma {
                power_w: non_negative(line, "power_sigma_w", fields[p])?,
                throughput: non_negative(line, "throughput_sigma", fields[t])?,
            }),
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
                    sigma: Vec::new(),
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
        if let Some(sigma) = sigma {
            record.sigma.push(sigma);
        }
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
        if record.sigma.is_empty() {
            record
                .points
                .sort_by(|a, b| a.cap_w.0.total_cmp(&b.cap_w.0));
        } else {
            let mut pairs: Vec<(OperatingPoint, PointSigma)> = record
                .points
                .drain(..)
                .zip(record.sigma.drain(..))
                .collect();
            pairs.sort_by(|a, b| a.0.cap_w.0.total_cmp(&b.0.cap_w.0));
            (record.points, record.sigma) = pairs.into_iter().unzip();
        }
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
    // The standard-error columns only when every job has them (they come together).
    let with_sigma = !records.is_empty() && records.iter().all(|r| r.sigma.len() == r.points.len());
    let mut row = |fields: &[&str]| {
        // Writing to memory cannot fail, and every row has the header's fields.
        out.write_record(fields)
            .expect("a csv writer into memory does not fail");
    };
    let mut header = vec![
        "job",
        "cap_w",
        "power_w",
        "throughput",
        "gpus",
        "tier",
        "dram_copy_product",
    ];
    if with_sigma {
        header.extend(["power_sigma_w", "throughput_sigma"]);
    }
    row(&header);
    for r in records {
        let gpus = r.gpus.map_or(String::new(), |g| g.to_string());
        let dram = r
            .dram_copy_product
            .map_or(String::new(), |d| format!("{d:.3}"));
        for (i, p) in r.points.iter().enumerate() {
            let (cap, power, throughput) = (
                p.cap_w.0.to_string(),
                p.power_w.0.to_string(),
                p.throughput.to_string(),
            );
            let mut fields = vec![
                r.job.as_str(),
                &cap,
                &power,
                &throughput,
                &gpus,
                r.tier.as_deref().unwrap_or(""),
                &dram,
            ];
            let sigma = r
                .sigma
                .get(i)
                .map(|s| (s.power_w.to_string(), s.throughput.to_string()));
            if let (true, Some((sp, st))) = (with_sigma, &sigma) {
                fields.push(sp);
                fields.push(st);
            }
            row(&fields);
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
    fn uncertainty_columns_follow_their_points_through_sorting_and_writing() {
        let text = "job,cap_w,power_w,throughput,power_sigma_w,throughput_sigma\n\
                    a,300,2400,600,24,9\n\
                    a,700,5600,1000,56,4\n\
                    a,500,4000,900,40,6\n";
        let jobs = parse_curves(text).expect("parse");
        let caps: Vec<f64> = jobs[0].points.iter().map(|p| p.cap_w.0).collect();
        assert_eq!(caps, [300.0, 500.0, 700.0]);
        let sigma_t: Vec<f64> = jobs[0].sigma.iter().map(|s| s.throughput).collect();
        assert_eq!(sigma_t, [9.0, 6.0, 4.0], "each σ stays with its cap");
        assert_eq!(parse_curves(&write_curves(&jobs)).expect("reparse"), jobs);
        // One of the pair alone is refused, naming the other.
        let half = "job,cap_w,power_w,throughput,power_sigma_w\na,700,5600,1000,5\n";
        assert_eq!(
            parse_curves(half),
            Err(CurvesError::MissingColumn {
                line: 1,
                column: "throughput_sigma"
            })
        );
    }

    #[test]
    fn implausible_values_are_refused_with_the_accepted_range() {
        let head = "job,cap_w,power_w,throughput,gpus\n";
        let cases = [
            (
                "a,1e308,5600,1000,8\na,500,4000,900,8\n",
                "cap_w",
                "at most 5000 W per GPU",
            ),
            ("a,700,5600,1000,4000000000\n", "gpus", "from 1 to 800000"),
            (
                "a,700,56000,1000,8\na,500,4000,900,8\n",
                "power_w",
                "at most 40000 W",
            ),
            (
                "a,700,5600,1e300,8\na,500,4000,900,8\n",
                "throughput",
                "at most 1000000000000000",
            ),
        ];
        for (rows, column, accepted) in cases {
            match parse_curves(&format!("{head}{rows}")) {
                Err(CurvesError::BadValue {
                    line: 2,
                    column: c,
                    message,
                }) => {
                    assert_eq!(c, column, "{message}");
                    assert!(message.contains(accepted), "{message}");
                }
                other => panic!("{rows}: {other:?}"),
            }
        }
        let sigma =
            "job,cap_w,power_w,throughput,power_sigma_w,throughput_sigma\na,700,5600,1000,-1,2\n";
        assert!(matches!(
            parse_curves(sigma),
            Err(CurvesError::BadValue {
                column: "power_sigma_w",
                ..
            })
        ));
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
