//! `powerflexctl accounting --plot`: ended jobs' energy records as an SVG — the GPU energy
//! each tier used on top, and below it the energy saved against running uncapped (an
//! ESTIMATE from each job's measured curve), stacked by whether the job ran in a grid
//! event.
//!
//! Drawn by hand like [`crate::plot`], and pure: records in, a document out. The caller
//! chooses the records (the controller already gives a user their own only).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use powerflex_proto::usage::{human_energy, JobEnergyRecord, J_PER_KWH};

use crate::plot::{escape, tick_step, trim_number};
use crate::CtlError;
use powerflex_controller_machine::schedule::utc_text;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 660.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 250.0;
const USED_PANEL: (f64, f64) = (100.0, 310.0);
const SAVED_PANEL: (f64, f64) = (380.0, 560.0);
/// Most bars drawn; the tiers that used the least energy beyond this share one bar.
pub const MAX_TIERS: usize = 12;
const USED_COLOUR: &str = "#1f77b4";
const IN_EVENTS_COLOUR: &str = "#ff7f0e";
const OUTSIDE_EVENTS_COLOUR: &str = "#7f7f7f";
/// Roughly how wide one character of an 11 px label is, px: wider labels are slanted.
const CHAR_W: f64 = 6.2;

/// One tier's sums over the records.
#[derive(Debug, Clone, PartialEq)]
pub struct TierEnergy {
    /// The tier in `--power-flex` form, as the records name it (or "N other tiers").
    pub tier: String,
    pub jobs: usize,
    pub energy_j: f64,
    /// Jobs that spent any time in a grid event (`event_s` > 0).
    pub jobs_in_events: usize,
    /// Σ `saved_estimate_j` of the jobs that ran in an event, J (ESTIMATE).
    pub saved_in_events_j: f64,
    /// Σ `saved_estimate_j` of the other jobs, J (ESTIMATE).
    pub saved_outside_events_j: f64,
    /// Jobs without a measured curve, so without an estimate.
    pub jobs_without_estimate: usize,
}

impl TierEnergy {
    fn new(tier: String) -> TierEnergy {
        TierEnergy {
            tier,
            jobs: 0,
            energy_j: 0.0,
            jobs_in_events: 0,
            saved_in_events_j: 0.0,
            saved_outside_events_j: 0.0,
            jobs_without_estimate: 0,
        }
    }

    fn add(&mut self, other: &TierEnergy) {
        self.jobs += other.jobs;
        self.energy_j += other.energy_j;
        self.jobs_in_events += other.jobs_in_events;
        self.saved_in_events_j += other.saved_in_events_j;
        self.saved_outside_events_j += other.saved_outside_events_j;
        self.jobs_without_estimate += other.jobs_without_estimate;
    }

    pub fn saved_j(&self) -> f64 {
        self.saved_in_events_j + self.saved_outside_events_j
    }
}

/// The records summed per tier, in tier order; past [`MAX_TIERS`], the tiers that used
/// the least energy are summed into one last entry named for how many they are.
pub fn by_tier(records: &[JobEnergyRecord]) -> Vec<TierEnergy> {
    let mut tiers: BTreeMap<&str, TierEnergy> = BTreeMap::new();
    for r in records {
        let t = tiers
            .entry(r.tier.as_str())
            .or_insert_with(|| TierEnergy::new(r.tier.clone()));
        t.jobs += 1;
        t.energy_j += r.energy_j;
        let in_event = r.event_s > 0.0;
        t.jobs_in_events += usize::from(in_event);
        match (r.saved_estimate_j, in_event) {
            (Some(s), true) => t.saved_in_events_j += s,
            (Some(s), false) => t.saved_outside_events_j += s,
            (None, _) => t.jobs_without_estimate += 1,
        }
    }
    let mut all: Vec<TierEnergy> = tiers.into_values().collect();
    if all.len() > MAX_TIERS {
        let mut by_energy: Vec<usize> = (0..all.len()).collect();
        by_energy.sort_by(|&a, &b| all[b].energy_j.total_cmp(&all[a].energy_j));
        let rest: Vec<usize> = by_energy[MAX_TIERS - 1..].to_vec();
        let mut other = TierEnergy::new(format!("{} other tiers", rest.len()));
        for &i in &rest {
            other.add(&all[i]);
        }
        let mut i = 0;
        all.retain(|_| {
            i += 1;
            !rest.contains(&(i - 1))
        });
        all.push(other);
    }
    all
}

/// Energy in the unit that keeps the axis' numbers short (kWh as `sreport` and the
/// accounting table use it).
fn energy_unit(max_abs_j: f64) -> (f64, &'static str) {
    if max_abs_j >= 2000.0 * J_PER_KWH {
        (1000.0 * J_PER_KWH, "MWh")
    } else if max_abs_j >= 0.1 * J_PER_KWH {
        (J_PER_KWH, "kWh")
    } else if max_abs_j >= 3600.0 {
        (3600.0, "Wh")
    } else {
        (1.0, "J")
    }
}

/// Three significant digits, trailing zeros trimmed: a bar's label.
pub(crate) fn significant(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return "0".into();
    }
    let digits = (2 - x.abs().log10().floor() as i32).max(0) as usize;
    let text = format!("{x:.digits$}");
    if text.contains('.') {
        trim_number(text.parse().unwrap_or(x))
    } else {
        text
    }
}

/// One panel: its pixel span, its value range in J and the unit its axis reads in.
struct Panel {
    top: f64,
    bottom: f64,
    lo_j: f64,
    hi_j: f64,
    scale: f64,
    unit: &'static str,
}

impl Panel {
    /// A panel showing values from `lo_j` (≤ 0) to `hi_j` (≥ 0), with room above and
    /// below for the bars' labels.
    fn new((top, bottom): (f64, f64), lo_j: f64, hi_j: f64) -> Panel {
        let (scale, unit) = energy_unit(lo_j.abs().max(hi_j.abs()));
        let (mut lo_j, mut hi_j) = (lo_j.min(0.0) * 1.15, hi_j.max(0.0) * 1.15);
        if hi_j - lo_j <= 0.0 {
            hi_j = scale;
            lo_j = 0.0;
        }
        Panel {
            top,
            bottom,
            lo_j,
            hi_j,
            scale,
            unit,
        }
    }

    fn y(&self, j: f64) -> f64 {
        self.bottom - (j - self.lo_j) / (self.hi_j - self.lo_j) * (self.bottom - self.top)
    }

    fn label(&self, j: f64) -> String {
        format!("{} {}", significant(j / self.scale), self.unit)
    }

    /// The frame, the y ticks in the panel's unit, the zero line and the y axis' title.
    fn frame(&self, out: &mut String, y_label: &str) {
        let right = WIDTH - RIGHT;
        let _ = writeln!(
            out,
            r##"<rect x="{LEFT}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#444"/>"##,
            top = self.top,
            w = right - LEFT,
            h = self.bottom - self.top
        );
        let step = tick_step((self.hi_j - self.lo_j) / self.scale, 5.0) * self.scale;
        let mut v = (self.lo_j / step).ceil() * step;
        while v <= self.hi_j + step * 1e-9 {
            let y = self.y(v);
            let _ = writeln!(
                out,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{right}" y2="{y:.1}" stroke="#ddd"/><text x="{tx}" y="{ty:.1}" text-anchor="end" font-size="11">{label}</text>"##,
                tx = LEFT - 6.0,
                ty = y + 4.0,
                label = trim_number(v / self.scale)
            );
            v += step;
        }
        if self.lo_j < 0.0 {
            let y = self.y(0.0);
            let _ = writeln!(
                out,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{right}" y2="{y:.1}" stroke="#444"/>"##
            );
        }
        let my = (self.top + self.bottom) / 2.0;
        let _ = writeln!(
            out,
            r#"<text x="22" y="{my:.1}" font-size="12" transform="rotate(-90 22 {my:.1})" text-anchor="middle">{label} ({unit})</text>"#,
            label = escape(y_label),
            unit = self.unit
        );
    }

    /// A bar from `from_j` to `to_j` at `x` (its centre), with a tooltip.
    fn bar(
        &self,
        out: &mut String,
        x: f64,
        width: f64,
        (from_j, to_j): (f64, f64),
        colour: &str,
        tip: &str,
    ) {
        let (y1, y2) = (self.y(from_j), self.y(to_j));
        let _ = writeln!(
            out,
            r#"<rect x="{bx:.1}" y="{by:.1}" width="{width:.1}" height="{h:.1}" fill="{colour}"><title>{tip}</title></rect>"#,
            bx = x - width / 2.0,
            by = y1.min(y2),
            h = (y1 - y2).abs(),
            tip = escape(tip)
        );
    }
}

/// A tier's name as lines that fit its bar's slot: broken after its commas
/// (`flex3,` / `preempt=suspend`), and in a smaller font where one piece is still too
/// wide. Returns the lines and the font size, px.
fn label_lines(text: &str, slot: f64) -> (Vec<String>, f64) {
    let room = slot * 0.95;
    let fits = |s: &str| s.chars().count() as f64 * CHAR_W <= room;
    let mut lines: Vec<String> = Vec::new();
    for piece in text.split_inclusive(',') {
        match lines.last_mut() {
            Some(last) if fits(&format!("{last}{piece}")) => last.push_str(piece),
            _ => lines.push(piece.to_string()),
        }
    }
    let widest = lines.iter().map(|l| l.chars().count()).max().unwrap_or(1) as f64;
    let size = (11.0 * room / (widest * CHAR_W)).clamp(7.0, 11.0);
    (lines, size)
}

/// Line height of a tier's label, px.
const LABEL_LINE: f64 = 13.0;

/// A tier's name under a bar, centred, on as many lines as [`label_lines`] says.
fn tier_label(out: &mut String, x: f64, y: f64, slot: f64, text: &str) {
    let (lines, size) = label_lines(text, slot);
    let _ = write!(
        out,
        r#"<text x="{x:.1}" y="{y}" font-size="{size:.1}" text-anchor="middle">"#
    );
    for (i, line) in lines.iter().enumerate() {
        let dy = if i == 0 { 0.0 } else { LABEL_LINE };
        let _ = write!(
            out,
            r#"<tspan x="{x:.1}" dy="{dy}">{}</tspan>"#,
            escape(line)
        );
    }
    out.push_str("</text>\n");
}

fn legend_box(out: &mut String, y: f64, colour: &str, lines: &[&str]) {
    let x = WIDTH - RIGHT + 16.0;
    let _ = writeln!(
        out,
        r#"<rect x="{x}" y="{by}" width="14" height="14" fill="{colour}"/>"#,
        by = y - 11.0
    );
    for (i, line) in lines.iter().enumerate() {
        let _ = writeln!(
            out,
            r#"<text x="{tx}" y="{ty}" font-size="11">{}</text>"#,
            escape(line),
            tx = x + 20.0,
            ty = y + 14.0 * i as f64
        );
    }
}

/// Renders the records as a standalone SVG document: energy used per tier, and the
/// estimated energy saved per tier split by whether the jobs ran in grid events.
/// [`CtlError::NoRecords`] for none: an empty picture would look like zero energy.
pub fn render_energy_svg(records: &[JobEnergyRecord], title: &str) -> Result<String, CtlError> {
    if records.is_empty() {
        return Err(CtlError::NoRecords);
    }
    let tiers = by_tier(records);
    let simulated = records.iter().any(|r| r.simulated);
    let incomplete = records
        .iter()
        .filter(|r| !r.incomplete_nodes.is_empty())
        .count();
    let total_j: f64 = tiers.iter().map(|t| t.energy_j).sum();
    let saved_j: f64 = tiers.iter().map(TierEnergy::saved_j).sum();
    let without: usize = tiers.iter().map(|t| t.jobs_without_estimate).sum();
    let from = records.iter().map(|r| r.to_unix_ms).min().unwrap_or(0);
    let to = records.iter().map(|r| r.to_unix_ms).max().unwrap_or(0);

    let mut out = String::new();
    crate::plot::open_svg(&mut out, WIDTH, HEIGHT, LEFT, title);
    let span = if from == to {
        format!("ended at {}", utc_text(to))
    } else {
        format!("ended {} to {}", utc_text(from), utc_text(to))
    };
    let mut notes = vec![format!(
        "{} job{} {span}{}",
        records.len(),
        if records.len() == 1 { "" } else { "s" },
        if simulated {
            " · SIMULATED GPUs (powerflex-sim): every figure is a simulation's"
        } else {
            ""
        }
    )];
    notes.push(format!(
        "{} used, about {} saved (ESTIMATE: against running uncapped for the same work, from each job's measured curve)",
        human_energy(total_j),
        human_energy(saved_j)
    ));
    let mut caveats = Vec::new();
    if without > 0 {
        caveats.push(format!(
            "{without} job{} without a measured curve, so no estimate",
            if without == 1 { "" } else { "s" }
        ));
    }
    if incomplete > 0 {
        caveats.push(format!(
            "{incomplete} record{} incomplete (a node's final figures missing: lower bounds)",
            if incomplete == 1 { "" } else { "s" }
        ));
    }
    if !caveats.is_empty() {
        notes.push(caveats.join("; "));
    }
    for (i, note) in notes.iter().enumerate() {
        let _ = writeln!(
            out,
            r##"<text x="{LEFT}" y="{y}" font-size="{size}" fill="#555">{}</text>"##,
            escape(note),
            y = 44.0 + 15.0 * i as f64,
            size = if i == 0 { 12 } else { 11 }
        );
    }

    let slot = (WIDTH - LEFT - RIGHT) / tiers.len() as f64;
    // The jobs' counts go under the longest tier label.
    let label_rows = tiers
        .iter()
        .map(|t| label_lines(&t.tier, slot).0.len())
        .max()
        .unwrap_or(1);
    let jobs_line_y = SAVED_PANEL.1 + 16.0 + LABEL_LINE * label_rows as f64 + 2.0;
    let width = (slot * 0.5).min(70.0);
    let centre = |i: usize| LEFT + slot * (i as f64 + 0.5);

    // Energy used: one bar per tier, its value on top.
    let used = Panel::new(
        USED_PANEL,
        0.0,
        tiers.iter().map(|t| t.energy_j).fold(0.0, f64::max),
    );
    used.frame(&mut out, "GPU energy used");
    for (i, t) in tiers.iter().enumerate() {
        let x = centre(i);
        used.bar(
            &mut out,
            x,
            width,
            (0.0, t.energy_j),
            USED_COLOUR,
            &format!("{}: {:.0} J used by {} jobs", t.tier, t.energy_j, t.jobs),
        );
        let _ = writeln!(
            out,
            r#"<text x="{x:.1}" y="{y:.1}" font-size="11" text-anchor="middle">{}</text>"#,
            used.label(t.energy_j),
            y = used.y(t.energy_j) - 5.0
        );
        tier_label(&mut out, x, USED_PANEL.1 + 16.0, slot, &t.tier);
    }

    // Saved (ESTIMATE): stacked, positive parts up from zero and negative parts down
    // (a cap can cost energy: a job slowed more than its draw fell).
    let stacks: Vec<[(f64, f64); 2]> = tiers
        .iter()
        .map(|t| {
            let (mut up, mut down) = (0.0, 0.0);
            let mut span = |v: f64| {
                let base = if v >= 0.0 { &mut up } else { &mut down };
                let from = *base;
                *base += v;
                (from, *base)
            };
            [span(t.saved_in_events_j), span(t.saved_outside_events_j)]
        })
        .collect();
    let lo = stacks
        .iter()
        .flatten()
        .map(|s| s.0.min(s.1))
        .fold(0.0, f64::min);
    let hi = stacks
        .iter()
        .flatten()
        .map(|s| s.0.max(s.1))
        .fold(0.0, f64::max);
    let saved = Panel::new(SAVED_PANEL, lo, hi);
    saved.frame(&mut out, "energy saved, ESTIMATE");
    for (i, (t, stack)) in tiers.iter().zip(&stacks).enumerate() {
        let x = centre(i);
        let parts = [
            (
                t.saved_in_events_j,
                IN_EVENTS_COLOUR,
                "by jobs that ran in grid events",
            ),
            (
                t.saved_outside_events_j,
                OUTSIDE_EVENTS_COLOUR,
                "by jobs outside events",
            ),
        ];
        for ((value, colour, whose), span) in parts.into_iter().zip(stack) {
            if value == 0.0 {
                continue;
            }
            saved.bar(
                &mut out,
                x,
                width,
                *span,
                colour,
                &format!("{}: {:.0} J saved {whose} (ESTIMATE)", t.tier, value),
            );
            // The part's own figure inside it, where it fits.
            if (saved.y(span.0) - saved.y(span.1)).abs() >= 15.0 {
                let _ = writeln!(
                    out,
                    r#"<text x="{x:.1}" y="{y:.1}" font-size="10" fill="white" text-anchor="middle">{}</text>"#,
                    saved.label(value),
                    y = (saved.y(span.0) + saved.y(span.1)) / 2.0 + 3.5
                );
            }
        }
        let total = t.saved_j();
        let end = if total >= 0.0 {
            stack[0].1.max(stack[1].1).max(0.0)
        } else {
            stack[0].1.min(stack[1].1)
        };
        let _ = writeln!(
            out,
            r#"<text x="{x:.1}" y="{y:.1}" font-size="11" text-anchor="middle">{}</text>"#,
            if t.jobs_without_estimate == t.jobs {
                "no estimate".to_string()
            } else {
                saved.label(total)
            },
            y = if total >= 0.0 {
                saved.y(end) - 5.0
            } else {
                saved.y(end) + 13.0
            }
        );
        tier_label(&mut out, x, SAVED_PANEL.1 + 16.0, slot, &t.tier);
        let _ = writeln!(
            out,
            r##"<text x="{x:.1}" y="{y}" font-size="10" fill="#555" text-anchor="middle">{} job{}, {} in events</text>"##,
            t.jobs,
            if t.jobs == 1 { "" } else { "s" },
            t.jobs_in_events,
            y = jobs_line_y
        );
    }

    legend_box(
        &mut out,
        USED_PANEL.0 + 14.0,
        USED_COLOUR,
        &["GPU energy used"],
    );
    legend_box(
        &mut out,
        SAVED_PANEL.0 + 14.0,
        IN_EVENTS_COLOUR,
        &["saved by jobs that ran", "in grid events (ESTIMATE)"],
    );
    legend_box(
        &mut out,
        SAVED_PANEL.0 + 52.0,
        OUTSIDE_EVENTS_COLOUR,
        &["saved by jobs outside", "events (ESTIMATE)"],
    );
    let _ = writeln!(
        out,
        r#"<text x="{x}" y="{y}" font-size="12" text-anchor="middle">tier (--power-flex)</text>"#,
        x = (LEFT + WIDTH - RIGHT) / 2.0,
        y = HEIGHT - 10.0
    );
    out.push_str("</svg>\n");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_proto::usage::{EnergySource, RECORD_VERSION};

    fn record(
        job: &str,
        tier: &str,
        energy_j: f64,
        event_s: f64,
        saved: Option<f64>,
    ) -> JobEnergyRecord {
        JobEnergyRecord {
            version: RECORD_VERSION,
            simulated: true,
            job_id: job.into(),
            uid: 1000,
            tier: tier.into(),
            written_unix_ms: 1_795_971_600_000,
            from_unix_ms: 1_795_971_000_000,
            to_unix_ms: 1_795_971_593_413,
            gpus: 2,
            energy_j,
            energy_kwh: energy_j / J_PER_KWH,
            energy_source: EnergySource::Counter,
            avg_power_w: 600.0,
            peak_power_w: 1400.0,
            capped_pct: 50.0,
            event_s,
            power_throttled_pct: None,
            slowdown_pct: Some(5.0),
            bound_pct: Some(25.0),
            bound_held: Some(true),
            bound_judgement: None,
            saved_estimate_j: saved,
            tokens_per_j: None,
            pfi: Some(3.0),
            incomplete_nodes: vec![],
            nodes: vec![],
            account: None,
            run_start_unix_ms: None,
            revision: 1,
        }
    }

    /// Whether a `<text>` element (or a legend line) reads exactly `content`.
    fn has_text(svg: &str, content: &str) -> bool {
        crate::plot::texts(svg).iter().any(|t| t == content)
    }

    #[test]
    fn sums_energy_and_savings_per_tier_split_by_events() {
        let records = [
            record("1", "flex2", 360_000.0, 30.0, Some(18_000.0)),
            record("2", "flex2", 180_000.0, 0.0, Some(3_600.0)),
            record("3", "flex0", 720_000.0, 30.0, None),
            record("4", "flex3,preempt=suspend", 90_000.0, 12.5, Some(-360.0)),
        ];
        let tiers = by_tier(&records);
        let names: Vec<&str> = tiers.iter().map(|t| t.tier.as_str()).collect();
        assert_eq!(names, ["flex0", "flex2", "flex3,preempt=suspend"]);
        let flex2 = &tiers[1];
        assert_eq!(
            (flex2.jobs, flex2.energy_j, flex2.jobs_in_events),
            (2, 540_000.0, 1)
        );
        assert_eq!(
            (flex2.saved_in_events_j, flex2.saved_outside_events_j),
            (18_000.0, 3_600.0)
        );
        assert_eq!(tiers[0].jobs_without_estimate, 1);
        assert_eq!(tiers[0].saved_j(), 0.0);
        assert_eq!(tiers[2].saved_in_events_j, -360.0);
    }

    #[test]
    fn the_svg_names_every_tier_with_its_energy_and_estimated_savings() {
        let records = [
            record("1", "flex2", 360_000.0, 30.0, Some(18_000.0)),
            record("2", "flex2", 180_000.0, 0.0, Some(3_600.0)),
            record("3", "flex0", 720_000.0, 30.0, None),
            record("4", "flex3,preempt=suspend", 90_000.0, 12.5, Some(-360.0)),
        ];
        let svg = render_energy_svg(&records, "energy <site>").expect("svg");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(
            svg.contains(">energy &lt;site&gt;<") && has_text(&svg, "energy <site>"),
            "title escaped"
        );
        // Every tier named under both panels.
        let texts = crate::plot::texts(&svg);
        for tier in ["flex0", "flex2", "flex3,preempt=suspend"] {
            assert_eq!(texts.iter().filter(|t| *t == tier).count(), 2, "{tier}");
        }
        // Energy used: kWh on the axis (the largest tier, 0.2 kWh, is over 0.1 kWh),
        // each bar labelled with its value.
        assert!(svg.contains("GPU energy used (kWh)"), "{svg}");
        assert!(
            has_text(&svg, "0.2 kWh") && has_text(&svg, "0.15 kWh"),
            "{svg}"
        );
        assert!(has_text(&svg, "0.025 kWh"), "{svg}");
        // Saved: an ESTIMATE, in Wh (the largest stack is 21.6 kJ = 6 Wh), split by events.
        assert!(svg.contains("energy saved, ESTIMATE (Wh)"), "{svg}");
        assert!(has_text(&svg, "6 Wh"), "flex2's total: {svg}");
        assert!(has_text(&svg, "5 Wh"), "flex2's part in events: {svg}");
        assert!(
            has_text(&svg, "-0.1 Wh"),
            "a negative saving is shown as one: {svg}"
        );
        assert!(has_text(&svg, "no estimate"), "flex0 has no curve: {svg}");
        assert!(svg.contains("flex2: 18000 J saved by jobs that ran in grid events (ESTIMATE)"));
        assert!(svg.contains("flex2: 3600 J saved by jobs outside events (ESTIMATE)"));
        assert!(has_text(&svg, "2 jobs, 1 in events"), "{svg}");
        assert!(svg.contains("1 job without a measured curve, so no estimate"));
        // The totals, and what the figures are.
        assert!(svg.contains("4 jobs ended"), "{svg}");
        assert!(
            svg.contains("0.38 kWh used, about 5.9 Wh saved (ESTIMATE: against running uncapped"),
            "{svg}"
        );
        assert!(svg.contains("SIMULATED GPUs"));
        assert!(has_text(&svg, "in grid events (ESTIMATE)"), "legend");
        // Bar heights are to scale: flex0's 0.2 kWh against an axis to 0.23 kWh.
        let panel = Panel::new(USED_PANEL, 0.0, 720_000.0);
        let h = USED_PANEL.1 - panel.y(720_000.0);
        assert!(
            svg.contains(&format!(r#"height="{h:.1}" fill="{USED_COLOUR}""#)),
            "{svg}"
        );
    }

    #[test]
    fn nothing_to_plot_is_an_error_and_real_gpus_are_not_called_simulated() {
        assert!(matches!(
            render_energy_svg(&[], "t"),
            Err(CtlError::NoRecords)
        ));
        let mut r = record("9", "flex1", 1_000.0, 0.0, Some(50.0));
        r.simulated = false;
        let svg = render_energy_svg(&[r], "t").expect("svg");
        assert!(!svg.contains("SIMULATED"));
        assert!(
            svg.contains("GPU energy used (J)") && has_text(&svg, "1000 J"),
            "{svg}"
        );
        assert!(has_text(&svg, "1 job, 0 in events"), "{svg}");
    }

    #[test]
    fn beyond_the_most_tiers_the_smallest_share_one_bar() {
        let records: Vec<JobEnergyRecord> = (0..MAX_TIERS + 3)
            .map(|i| {
                record(
                    &i.to_string(),
                    &format!("max-slowdown={}%", i + 1),
                    1000.0 * (i + 1) as f64,
                    0.0,
                    None,
                )
            })
            .collect();
        let tiers = by_tier(&records);
        assert_eq!(tiers.len(), MAX_TIERS);
        let other = tiers.last().expect("other");
        assert_eq!(other.tier, "4 other tiers");
        assert_eq!((other.jobs, other.energy_j), (4, 10_000.0));
        assert_eq!(
            tiers.iter().map(|t| t.energy_j).sum::<f64>(),
            records.iter().map(|r| r.energy_j).sum::<f64>()
        );
    }

    #[test]
    fn a_tier_too_wide_for_its_slot_breaks_after_a_comma_then_shrinks() {
        // 21 characters at about 6.2 px do not fit a 124 px slot; each piece does.
        let (lines, size) = label_lines("flex3,preempt=suspend", 124.0);
        assert_eq!(
            (lines, size),
            (vec!["flex3,".to_string(), "preempt=suspend".into()], 11.0)
        );
        let (lines, size) = label_lines("flex3,preempt=suspend", 400.0);
        assert_eq!((lines.len(), size), (1, 11.0));
        // One piece wider than the slot: one line, a smaller font.
        let (lines, size) = label_lines("max-slowdown=12.5%", 80.0);
        assert_eq!(lines.len(), 1);
        assert!((7.0..11.0).contains(&size), "{size}");
        let mut out = String::new();
        tier_label(&mut out, 100.0, 300.0, 124.0, "flex3,preempt=suspend");
        assert!(
            out.contains(r#"<tspan x="100.0" dy="13">preempt=suspend</tspan>"#),
            "{out}"
        );
        assert_eq!(crate::plot::texts(&out), ["flex3,preempt=suspend"]);
    }

    #[test]
    fn labels_keep_three_significant_digits() {
        assert_eq!(significant(0.41234), "0.412");
        assert_eq!(significant(12.345), "12.3");
        assert_eq!(significant(1234.6), "1235");
        assert_eq!(significant(0.2), "0.2");
        assert_eq!(significant(-0.1), "-0.1");
        assert_eq!(significant(0.0), "0");
        assert_eq!(energy_unit(3600.0), (3600.0, "Wh"));
        assert_eq!(energy_unit(0.1 * J_PER_KWH), (J_PER_KWH, "kWh"));
    }
}
