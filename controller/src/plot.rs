//! `powerflexctl plot`: the controller's history as an SVG — budget against draw on top,
//! each job's per-GPU cap below, on one time axis.
//!
//! SVG is text, so it is written by hand here instead of pulling in a plotting crate;
//! every browser and image viewer opens it. Pure: samples in, a document out.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use powerflex_controller_machine::schedule::utc_text;
use powerflex_proto::status::{DomainSample, HistorySample as Sample};

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 640.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 180.0;
const TOP_PANEL: (f64, f64) = (60.0, 320.0);
const BOTTOM_PANEL: (f64, f64) = (370.0, 590.0);
/// Enough colours to tell a dozen jobs apart; past that they repeat with a dash.
const PALETTE: [&str; 12] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#393b79", "#637939",
];
/// Most job lines drawn; the rest are counted in the legend.
const MAX_JOBS: usize = 24;
/// Most power domains drawn in the top panel (the legend there has room for six).
const MAX_DOMAINS: usize = 6;
/// The domains' colours, apart from the site's budget (red) and draw (blue).
const DOMAIN_PALETTE: [&str; 6] = [
    "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
];

/// Errors of plotting: only "nothing to plot".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoSamples;

impl std::fmt::Display for NoSamples {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the controller has no history yet (it records one sample per allocation period); try again in a few seconds")
    }
}

/// "Nice" tick step (1, 2 or 5 × 10^k) giving about `count` ticks over `span`.
pub(crate) fn tick_step(span: f64, count: f64) -> f64 {
    let raw = (span / count).max(f64::MIN_POSITIVE);
    let magnitude = 10f64.powf(raw.log10().floor());
    let fraction = raw / magnitude;
    let nice = if fraction <= 1.0 {
        1.0
    } else if fraction <= 2.0 {
        2.0
    } else if fraction <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

/// The opening of a plot: the `<svg>` element of `width` × `height`, a white page, and
/// the bold title at `left` (the plots share one look).
pub(crate) fn open_svg(out: &mut String, width: f64, height: f64, left: f64, title: &str) {
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif">"#
    );
    let _ = writeln!(
        out,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{left}" y="24" font-size="16" font-weight="bold">{}</text>"#,
        escape(title)
    );
}

pub(crate) fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// What a reader of a plot sees as text: each `<text>` element's content without its
/// markup (a label broken into `<tspan>` lines reads as one), entities unescaped. For
/// tests and scripts that check a picture's labels, not only that it parses.
pub fn texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|element| {
            let inner = element.split_once('>')?.1.split("</text>").next()?;
            let mut text = String::new();
            let mut in_tag = false;
            for c in inner.chars() {
                match c {
                    '<' => in_tag = true,
                    '>' => in_tag = false,
                    c if !in_tag => text.push(c),
                    _ => {}
                }
            }
            Some(
                text.replace("&lt;", "<")
                    .replace("&gt;", ">")
                    .replace("&quot;", "\"")
                    .replace("&amp;", "&"),
            )
        })
        .collect()
}

/// Power in the unit that keeps the numbers short.
fn power_unit(max_w: f64) -> (f64, &'static str) {
    if max_w >= 2e6 {
        (1e6, "MW")
    } else if max_w >= 2e3 {
        (1e3, "kW")
    } else {
        (1.0, "W")
    }
}

struct Axis {
    t0_ms: u64,
    span_s: f64,
}

impl Axis {
    fn x(&self, t_ms: u64) -> f64 {
        let s = t_ms.saturating_sub(self.t0_ms) as f64 / 1000.0;
        LEFT + s / self.span_s * (WIDTH - LEFT - RIGHT)
    }
}

fn y_of(value: f64, (lo, hi): (f64, f64), (top, bottom): (f64, f64)) -> f64 {
    bottom - (value - lo) / (hi - lo) * (bottom - top)
}

/// Draws a panel's frame, its y ticks (in `scale` units) and the shared x ticks.
fn frame(
    out: &mut String,
    axis: &Axis,
    range: (f64, f64),
    panel: (f64, f64),
    scale: f64,
    y_label: &str,
) {
    let (top, bottom) = panel;
    let right = WIDTH - RIGHT;
    let _ = writeln!(
        out,
        r##"<rect x="{LEFT}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#444"/>"##,
        w = right - LEFT,
        h = bottom - top
    );
    let step = tick_step((range.1 - range.0) / scale, 5.0) * scale;
    let mut v = (range.0 / step).ceil() * step;
    while v <= range.1 + step * 1e-9 {
        let y = y_of(v, range, panel);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{right}" y2="{y:.1}" stroke="#ddd"/><text x="{tx}" y="{ty:.1}" text-anchor="end" font-size="11">{label}</text>"##,
            tx = LEFT - 6.0,
            ty = y + 4.0,
            label = trim_number(v / scale)
        );
        v += step;
    }
    let step_s = tick_step(axis.span_s, 8.0);
    let mut s = 0.0;
    while s <= axis.span_s + step_s * 1e-9 {
        let x = LEFT + s / axis.span_s * (right - LEFT);
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{bottom}" x2="{x:.1}" y2="{b2}" stroke="#444"/><text x="{x:.1}" y="{ty}" text-anchor="middle" font-size="11">{label}</text>"##,
            b2 = bottom + 4.0,
            ty = bottom + 16.0,
            label = trim_number(s)
        );
        s += step_s;
    }
    let _ = writeln!(
        out,
        r#"<text x="18" y="{my:.1}" font-size="12" transform="rotate(-90 18 {my:.1})" text-anchor="middle">{label}</text>"#,
        my = (top + bottom) / 2.0,
        label = escape(y_label)
    );
}

pub(crate) fn trim_number(v: f64) -> String {
    let text = format!("{v:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text == "-0" {
        "0".into()
    } else {
        text.into()
    }
}

/// A polyline through `points`; with `step`, a staircase (values hold until the next
/// sample, which is how the budget and caps behave).
fn polyline(
    points: &[(f64, f64)],
    colour: &str,
    width: f64,
    dash: Option<&str>,
    step: bool,
) -> String {
    let mut coords = String::new();
    let mut previous: Option<(f64, f64)> = None;
    for &(x, y) in points {
        if let (true, Some((_, py))) = (step, previous) {
            let _ = write!(coords, "{x:.1},{py:.1} ");
        }
        let _ = write!(coords, "{x:.1},{y:.1} ");
        previous = Some((x, y));
    }
    let dash = dash.map_or(String::new(), |d| format!(r#" stroke-dasharray="{d}""#));
    format!(
        r#"<polyline fill="none" stroke="{colour}" stroke-width="{width}"{dash} points="{}"/>"#,
        coords.trim_end()
    )
}

fn legend_entry(out: &mut String, y: f64, colour: &str, dash: Option<&str>, label: &str) {
    let x = WIDTH - RIGHT + 14.0;
    let dash = dash.map_or(String::new(), |d| format!(r#" stroke-dasharray="{d}""#));
    let _ = writeln!(
        out,
        r#"<line x1="{x}" y1="{y}" x2="{x2}" y2="{y}" stroke="{colour}" stroke-width="2"{dash}/><text x="{tx}" y="{ty}" font-size="11">{label}</text>"#,
        x2 = x + 22.0,
        tx = x + 28.0,
        ty = y + 4.0,
        label = escape(label)
    );
}

/// Something that happened, drawn across both panels on the time axis: a dashed line at
/// `from_ms`, or a shaded band from `from_ms` to `to_ms`; its label reads down from the
/// top of the power panel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    /// Unix ms.
    pub from_ms: u64,
    /// Unix ms; `None` for an instant.
    pub to_ms: Option<u64>,
    pub label: String,
}

/// Renders the samples (oldest first) as a standalone SVG document.
pub fn render_svg(samples: &[Sample], title: &str) -> Result<String, NoSamples> {
    render_svg_marked(samples, title, &[])
}

/// [`render_svg`] with `marks` drawn over it (marks outside the samples' span are left
/// out: the axis is the samples').
pub fn render_svg_marked(
    samples: &[Sample],
    title: &str,
    marks: &[Mark],
) -> Result<String, NoSamples> {
    let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
        return Err(NoSamples);
    };
    let axis = Axis {
        t0_ms: first.t_ms,
        span_s: ((last.t_ms.saturating_sub(first.t_ms)) as f64 / 1000.0).max(1.0),
    };
    let simulated = samples.iter().any(|s| s.simulated);
    let mut out = String::new();
    open_svg(&mut out, WIDTH, HEIGHT, LEFT, title);
    let _ = writeln!(
        out,
        r##"<text x="{LEFT}" y="44" font-size="12" fill="#555">{} samples over {} s{}</text>"##,
        samples.len(),
        if axis.span_s >= 10.0 {
            format!("{:.0}", axis.span_s)
        } else {
            trim_number(axis.span_s)
        },
        if simulated {
            " · SIMULATED GPUs (powerflex-sim)"
        } else {
            ""
        }
    );

    // Top panel: budget and draw.
    let max_power = samples
        .iter()
        .flat_map(|s| {
            std::iter::once(s.budget_w.max(s.draw_w))
                .chain(s.domains.values().map(|d| d.budget_w.max(d.draw_w)))
        })
        .fold(0.0, f64::max)
        .max(1.0);
    let (scale, unit) = power_unit(max_power);
    let power_range = (0.0, max_power * 1.08);
    frame(
        &mut out,
        &axis,
        power_range,
        TOP_PANEL,
        scale,
        &format!("GPU power ({unit})"),
    );
    let budget: Vec<(f64, f64)> = samples
        .iter()
        .map(|s| (axis.x(s.t_ms), y_of(s.budget_w, power_range, TOP_PANEL)))
        .collect();
    let draw: Vec<(f64, f64)> = samples
        .iter()
        .map(|s| (axis.x(s.t_ms), y_of(s.draw_w, power_range, TOP_PANEL)))
        .collect();
    out.push_str(&polyline(&budget, "#d62728", 2.0, Some("6 3"), true));
    out.push('\n');
    out.push_str(&polyline(&draw, "#1f77b4", 2.0, None, false));
    out.push('\n');
    legend_entry(
        &mut out,
        TOP_PANEL.0 + 14.0,
        "#d62728",
        Some("6 3"),
        "budget",
    );
    legend_entry(&mut out, TOP_PANEL.0 + 32.0, "#1f77b4", None, "draw");
    // Power domains the samples carry (the top ones, and any an event cuts): each one's
    // budget dashed and its draw solid, thinner, in its own colour. A line breaks where
    // a sample does not carry the domain.
    let mut domains: Vec<&str> = Vec::new();
    for s in samples {
        for name in s.domains.keys() {
            if !domains.contains(&name.as_str()) {
                domains.push(name);
            }
        }
    }
    let mut legend_y = TOP_PANEL.0 + 50.0;
    for (n, name) in domains.iter().take(MAX_DOMAINS).enumerate() {
        let colour = DOMAIN_PALETTE[n % DOMAIN_PALETTE.len()];
        let budget_of: fn(&DomainSample) -> f64 = |d| d.budget_w;
        let draw_of: fn(&DomainSample) -> f64 = |d| d.draw_w;
        for (value, dash) in [(budget_of, Some("6 3")), (draw_of, None)] {
            let mut run: Vec<(f64, f64)> = Vec::new();
            for s in samples {
                match s.domains.get(*name) {
                    Some(d) => run.push((axis.x(s.t_ms), y_of(value(d), power_range, TOP_PANEL))),
                    None if !run.is_empty() => {
                        out.push_str(&polyline(&run, colour, 1.0, dash, dash.is_some()));
                        out.push('\n');
                        run.clear();
                    }
                    None => {}
                }
            }
            if !run.is_empty() {
                out.push_str(&polyline(&run, colour, 1.0, dash, dash.is_some()));
                out.push('\n');
            }
        }
        legend_entry(
            &mut out,
            legend_y,
            colour,
            None,
            &format!("{name}: budget, draw"),
        );
        legend_y += 18.0;
    }

    // Bottom panel: per-job caps. A job's line breaks where it has no cap.
    let mut jobs: BTreeMap<&str, Vec<Option<(u64, f64)>>> = BTreeMap::new();
    for (i, s) in samples.iter().enumerate() {
        for (job, &cap) in &s.caps {
            let series = jobs
                .entry(job.as_str())
                .or_insert_with(|| vec![None; samples.len()]);
            series[i] = Some((s.t_ms, cap));
        }
    }
    let max_cap = samples
        .iter()
        .flat_map(|s| s.caps.values().copied())
        .fold(0.0, f64::max)
        .max(1.0);
    let cap_range = (0.0, max_cap * 1.08);
    frame(
        &mut out,
        &axis,
        cap_range,
        BOTTOM_PANEL,
        1.0,
        "per-GPU cap (W)",
    );
    let mut legend_y = BOTTOM_PANEL.0 + 14.0;
    for (n, (job, series)) in jobs.iter().take(MAX_JOBS).enumerate() {
        let colour = PALETTE[n % PALETTE.len()];
        let dash = (n >= PALETTE.len()).then_some("4 2");
        let mut run: Vec<(f64, f64)> = Vec::new();
        for point in series.iter().chain(std::iter::once(&None)) {
            match point {
                Some((t, cap)) => run.push((axis.x(*t), y_of(*cap, cap_range, BOTTOM_PANEL))),
                None if !run.is_empty() => {
                    out.push_str(&polyline(&run, colour, 1.5, dash, true));
                    out.push('\n');
                    run.clear();
                }
                None => {}
            }
        }
        if legend_y < HEIGHT - 20.0 {
            legend_entry(&mut out, legend_y, colour, dash, &format!("job {job}"));
            legend_y += 18.0;
        }
    }
    if jobs.len() > MAX_JOBS {
        let _ = writeln!(
            out,
            r#"<text x="{x}" y="{legend_y}" font-size="11">+{} more jobs not drawn</text>"#,
            jobs.len() - MAX_JOBS,
            x = WIDTH - RIGHT + 14.0
        );
    }
    if jobs.is_empty() {
        let _ = writeln!(
            out,
            r##"<text x="{x}" y="{y}" font-size="12" fill="#555" text-anchor="middle">no managed jobs in this period</text>"##,
            x = (LEFT + WIDTH - RIGHT) / 2.0,
            y = (BOTTOM_PANEL.0 + BOTTOM_PANEL.1) / 2.0
        );
    }
    draw_marks(&mut out, &axis, last.t_ms, marks);
    let _ = writeln!(
        out,
        r#"<text x="{x}" y="{y}" font-size="12" text-anchor="middle">seconds since {t0}</text>"#,
        x = (LEFT + WIDTH - RIGHT) / 2.0,
        y = HEIGHT - 16.0,
        t0 = utc_text(first.t_ms)
    );
    out.push_str("</svg>\n");
    Ok(out)
}

/// Labels closer than this, px, would overprint: the later one moves right.
const MARK_LABEL_GAP: f64 = 11.0;

/// Bands first (translucent, so the lines stay readable), then the instants' lines.
fn draw_marks(out: &mut String, axis: &Axis, last_ms: u64, marks: &[Mark]) {
    let (top, bottom) = (TOP_PANEL.0, BOTTOM_PANEL.1);
    let visible = |t: u64| t >= axis.t0_ms && t <= last_ms;
    let mut label_xs: Vec<f64> = Vec::new();
    for m in marks {
        let x = axis.x(m.from_ms.clamp(axis.t0_ms, last_ms));
        match m.to_ms {
            Some(to)
                if visible(m.from_ms)
                    || visible(to)
                    || (m.from_ms < axis.t0_ms && to > last_ms) =>
            {
                let x2 = axis.x(to.clamp(axis.t0_ms, last_ms));
                let _ = writeln!(
                    out,
                    r##"<rect x="{x:.1}" y="{top}" width="{w:.1}" height="{h}" fill="#ff7f0e" fill-opacity="0.12"/>"##,
                    w = (x2 - x).max(1.0),
                    h = bottom - top
                );
            }
            None if visible(m.from_ms) => {
                let _ = writeln!(
                    out,
                    r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{bottom}" stroke="#555" stroke-width="1" stroke-dasharray="2 3"/>"##
                );
            }
            _ => continue,
        }
        let ty = top + 6.0;
        let mut tx = x + 3.0;
        while label_xs.iter().any(|&o| (o - tx).abs() < MARK_LABEL_GAP) {
            tx += MARK_LABEL_GAP;
        }
        label_xs.push(tx);
        let _ = writeln!(
            out,
            r##"<text x="{tx:.1}" y="{ty}" font-size="10" fill="#333" transform="rotate(90 {tx:.1} {ty})">{label}</text>"##,
            label = escape(&m.label)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_ms: u64, budget_w: f64, draw_w: f64, caps: &[(&str, f64)]) -> Sample {
        Sample {
            t_ms,
            budget_w,
            draw_w,
            caps: caps.iter().map(|(j, c)| (j.to_string(), *c)).collect(),
            simulated: true,
            domains: BTreeMap::new(),
        }
    }

    /// A domain the samples carry gets its budget and its draw, in its own colour, and a
    /// legend line; its lines break where a sample lacks it.
    #[test]
    fn a_domain_in_the_samples_gets_its_budget_and_draw() {
        let with = |t_ms: u64, feed: Option<(f64, f64)>| Sample {
            domains: feed
                .map(|(budget_w, draw_w)| ("feed-b".to_string(), DomainSample { budget_w, draw_w }))
                .into_iter()
                .collect(),
            ..sample(t_ms, 9000.0, 8000.0, &[])
        };
        let samples = [
            with(1_000, Some((5000.0, 4000.0))),
            with(2_000, Some((3000.0, 2900.0))),
            with(3_000, None),
            with(4_000, Some((5000.0, 4100.0))),
        ];
        let svg = render_svg(&samples, "t").expect("svg");
        assert!(
            texts(&svg).iter().any(|t| t == "feed-b: budget, draw"),
            "{svg}"
        );
        // Site budget and draw, then the feed's budget and draw in two runs each.
        assert_eq!(svg.matches("<polyline").count(), 6);
        assert!(svg.contains(DOMAIN_PALETTE[0]));
    }

    #[test]
    fn nothing_to_plot_is_an_error_not_an_empty_picture() {
        assert_eq!(render_svg(&[], "t"), Err(NoSamples));
    }

    #[test]
    fn draws_budget_draw_and_one_line_per_job_with_gaps() {
        let samples = [
            sample(1_000, 4000.0, 3500.0, &[("7", 700.0)]),
            sample(2_000, 2000.0, 1900.0, &[("7", 350.0), ("8", 300.0)]),
            sample(3_000, 2000.0, 1950.0, &[("8", 300.0)]),
            sample(4_000, 2000.0, 1950.0, &[("7", 400.0), ("8", 300.0)]),
        ];
        let svg = render_svg(&samples, "site <a&b>").expect("svg");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("site &lt;a&amp;b&gt;"), "title is escaped");
        assert!(svg.contains("SIMULATED"));
        assert!(svg.contains("GPU power (kW)"));
        assert!(svg.contains(">job 7<") && svg.contains(">job 8<"));
        // budget + draw + job 7 in two runs (gap at t=3 s) + job 8 in one run.
        assert_eq!(svg.matches("<polyline").count(), 5);
        // The budget staircase starts at the left edge at 4 kW of a 4.32 kW axis.
        let top = y_of(4000.0, (0.0, 4000.0 * 1.08), TOP_PANEL);
        assert!(svg.contains(&format!("{LEFT:.1},{top:.1}")), "{svg}");
    }

    #[test]
    fn marks_draw_a_band_and_a_line_inside_the_span_only() {
        let samples = [
            sample(1_000, 4000.0, 3500.0, &[]),
            sample(9_000, 2000.0, 1900.0, &[]),
        ];
        let mark = |from_ms, to_ms, label: &str| Mark {
            from_ms,
            to_ms,
            label: label.into(),
        };
        let marks = [
            mark(3_000, Some(6_000), "event <in force>"),
            mark(4_000, None, "job 3 suspended"),
            mark(20_000, None, "after the samples"),
        ];
        let svg = render_svg_marked(&samples, "t", &marks).expect("svg");
        assert_eq!(svg.matches("fill-opacity=\"0.12\"").count(), 1);
        assert_eq!(svg.matches("stroke-dasharray=\"2 3\"").count(), 1);
        assert!(svg.contains(">event &lt;in force&gt;<") && svg.contains(">job 3 suspended<"));
        assert!(
            !svg.contains("after the samples"),
            "outside the axis: left out"
        );
        // The band spans 3 s to 6 s of an 8 s axis.
        let x = |s: f64| LEFT + s / 8.0 * (WIDTH - LEFT - RIGHT);
        assert!(svg.contains(&format!("<rect x=\"{:.1}\"", x(2.0))), "{svg}");
        assert_eq!(
            render_svg(&samples, "t"),
            render_svg_marked(&samples, "t", &[])
        );
        // Two instants at one time: the second label moves right instead of overprinting.
        let same = [mark(4_000, None, "a"), mark(4_000, None, "b")];
        let svg = render_svg_marked(&samples, "t", &same).expect("svg");
        let label_x = |label: &str| -> f64 {
            let end = svg.find(&format!(">{label}</text>")).expect("label");
            let start = svg[..end].rfind("<text x=\"").expect("text") + 9;
            svg[start..]
                .split('"')
                .next()
                .and_then(|x| x.parse().ok())
                .expect("x")
        };
        assert!(
            (label_x("b") - label_x("a") - MARK_LABEL_GAP).abs() < 0.05,
            "{svg}"
        );
    }

    #[test]
    fn utc_text_is_the_calendar_date() {
        assert_eq!(utc_text(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc_text(951_782_400_000), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc_text(1_795_971_593_413), "2026-11-29 16:59:53 UTC");
    }

    #[test]
    fn texts_are_what_a_reader_sees() {
        let svg = r#"<svg><text x="1">a &amp; b</text><text x="2" y="3"><tspan>flex3,</tspan><tspan dy="13">preempt=suspend</tspan></text><line/></svg>"#;
        assert_eq!(texts(svg), ["a & b", "flex3,preempt=suspend"]);
    }

    #[test]
    fn ticks_are_round_numbers() {
        assert_eq!(tick_step(100.0, 5.0), 20.0);
        assert_eq!(tick_step(850_000.0, 5.0), 200_000.0);
        assert_eq!(tick_step(7.0, 8.0), 1.0);
        assert_eq!(trim_number(1.50), "1.5");
        assert_eq!(trim_number(-0.0), "0");
    }
}
