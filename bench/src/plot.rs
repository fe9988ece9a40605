//! Charts of bench figures (`attnstore bench --plot DIR`, `inspect --plot`, `eval --plot`):
//! line charts drawn with `plotters` into SVG (text stays text) and rasterized to PNG with
//! `resvg` using the machine's fonts (without any, the PNG has no labels; the SVG always
//! does). A chart is data ([`Chart`]): the bench rows are turned into charts by
//! [`bench_charts`] and [`hit_ratio_chart`], and the CLI builds the real-model ones.

use crate::report::Row;
use crate::{Error, Result};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One line of a chart: `(x, y)` points in x order.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The legend's name.
    pub name: String,
    /// The points; drawn joined in this order, each marked.
    pub points: Vec<(f64, f64)>,
    /// Drawn thinner with hollow markers: a reference curve such as the oracle's.
    pub reference: bool,
    /// Palette index of the colour; `None`: by position (black for a reference curve).
    pub color: Option<usize>,
}

impl Series {
    /// A series of `points`, sorted by x.
    pub fn new(name: impl Into<String>, mut points: Vec<(f64, f64)>) -> Self {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        Self { name: name.into(), points, reference: false, color: None }
    }

    /// The same series in palette colour `i` (to pair a curve with its reference).
    pub fn colored(mut self, i: usize) -> Self {
        self.color = Some(i);
        self
    }

    /// The same series drawn as a reference curve.
    pub fn reference(mut self) -> Self {
        self.reference = true;
        self
    }
}

/// An axis: its label and whether it is logarithmic.
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    /// The label.
    pub label: String,
    /// Log scale (every value must be positive; others are dropped).
    pub log: bool,
}

impl Axis {
    /// A linear axis.
    pub fn linear(label: impl Into<String>) -> Self {
        Self { label: label.into(), log: false }
    }

    /// A logarithmic axis.
    pub fn log(label: impl Into<String>) -> Self {
        Self { label: label.into(), log: true }
    }
}

/// A line chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    /// The title.
    pub title: String,
    /// The x axis.
    pub x: Axis,
    /// The y axis.
    pub y: Axis,
    /// The lines.
    pub series: Vec<Series>,
}

impl Chart {
    /// The finite points of every series that the axes can show (positive on a log axis).
    fn shown(&self) -> Vec<Series> {
        let ok = |v: f64, log: bool| v.is_finite() && (!log || v > 0.0);
        self.series
            .iter()
            .map(|s| Series {
                points: s.points.iter().copied().filter(|&(x, y)| ok(x, self.x.log) && ok(y, self.y.log)).collect(),
                ..s.clone()
            })
            .filter(|s| !s.points.is_empty())
            .collect()
    }
}

/// The range an axis shows for `values` (log10 of them on a log axis), padded, and
/// never empty.
fn axis_range(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    // Log axes come as log10 values: the same padding spans a factor there.
    let pad = match (hi > lo, log) {
        (true, _) => 0.05 * (hi - lo),
        (false, true) => 0.2,
        (false, false) => 0.5 * lo.abs().max(1.0),
    };
    (lo - pad, hi + pad)
}

/// Plotters' error as the bench's.
fn plot_err(e: impl std::fmt::Display) -> Error {
    Error::Plot(e.to_string())
}

/// The chart as SVG text, `width × height` pixels.
pub fn svg(chart: &Chart, width: u32, height: u32) -> Result<String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        // The legend gets a panel of its own on the right: it never covers a line.
        let (root, legend_area) = root.split_horizontally(width.saturating_sub(LEGEND_WIDTH));
        let shown = chart.shown();
        legend(&legend_area, &shown)?;
        // A log axis plots log10 of its values on a linear scale, labelled with the values:
        // evenly spaced labels at every size (plotters' log scale labels only decades).
        let (lx, ly) = (chart.x.log, chart.y.log);
        let to = |v: f64, log: bool| if log { v.log10() } else { v };
        let shown: Vec<Series> = shown
            .into_iter()
            .map(|s| Series { points: s.points.iter().map(|&(x, y)| (to(x, lx), to(y, ly))).collect(), ..s })
            .collect();
        let xs = axis_range(shown.iter().flat_map(|s| s.points.iter().map(|p| p.0)), lx);
        let ys = axis_range(shown.iter().flat_map(|s| s.points.iter().map(|p| p.1)), ly);
        let label = |v: f64, log: bool| tick(if log { 10f64.powf(v) } else { v });
        let mut ctx = ChartBuilder::on(&root)
            .caption(&chart.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(xs.0..xs.1, ys.0..ys.1)
            .map_err(plot_err)?;
        ctx.configure_mesh()
            .x_labels(8)
            .y_labels(8)
            .x_label_formatter(&|v| label(*v, lx))
            .y_label_formatter(&|v| label(*v, ly))
            .light_line_style(WHITE.mix(0.0))
            .x_desc(&chart.x.label)
            .y_desc(&chart.y.label)
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 15))
            .draw()
            .map_err(plot_err)?;
        for (i, s) in shown.iter().enumerate() {
            let color = color_of(s, i);
            let width = if s.reference { 1 } else { 2 };
            ctx.draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(width))).map_err(plot_err)?;
            let marker = if s.reference { color.stroke_width(1) } else { color.filled() };
            ctx.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, marker))).map_err(plot_err)?;
        }
        root.present().map_err(plot_err)?;
    }
    Ok(out)
}

/// Width of the legend panel, pixels.
const LEGEND_WIDTH: u32 = 270;

/// A series' colour: its own palette index, else black for a reference curve, else by position.
fn color_of(s: &Series, i: usize) -> RGBAColor {
    match (s.color, s.reference) {
        (Some(c), _) => Palette99::pick(c).to_rgba(),
        (None, true) => BLACK.to_rgba(),
        (None, false) => Palette99::pick(i).to_rgba(),
    }
}

/// The legend: one line per series, its colour, marker and name.
fn legend<DB: DrawingBackend>(area: &DrawingArea<DB, plotters::coord::Shift>, shown: &[Series]) -> Result<()> {
    for (i, s) in shown.iter().enumerate() {
        let color = color_of(s, i);
        let y = 56 + 22 * i as i32;
        let width = if s.reference { 1 } else { 2 };
        area.draw(&PathElement::new(vec![(6, y), (34, y)], color.stroke_width(width))).map_err(plot_err)?;
        let marker = if s.reference { color.stroke_width(1) } else { color.filled() };
        area.draw(&Circle::new((20, y), 3, marker)).map_err(plot_err)?;
        area.draw(&Text::new(s.name.clone(), (42, y - 8), ("sans-serif", 13))).map_err(plot_err)?;
    }
    Ok(())
}

/// A tick label: three significant digits at most, no trailing zeros; scientific below 0.01.
fn tick(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    if v.abs() >= 100.0 {
        return format!("{v:.0}");
    }
    if v.abs() < 0.01 {
        return format!("{v:.1e}").replace(".0e", "e");
    }
    let decimals = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    let s = format!("{v:.decimals$}");
    match s.contains('.') {
        true => s.trim_end_matches('0').trim_end_matches('.').to_string(),
        false => s,
    }
}

/// The SVG rasterized to PNG bytes with the machine's fonts.
pub fn png(svg: &str) -> Result<Vec<u8>> {
    let mut opt = resvg::usvg::Options::default();
    let fonts = opt.fontdb_mut();
    fonts.load_system_fonts();
    // The charts ask for `sans-serif`; fontdb maps it to Arial, which Linux rarely has.
    let families: Vec<String> = fonts.faces().flat_map(|f| f.families.iter().map(|(n, _)| n.clone())).collect();
    let preferred = ["DejaVu Sans", "Liberation Sans", "Noto Sans", "Arial", "Helvetica"];
    let sans = preferred
        .iter()
        .find(|p| families.iter().any(|f| f == *p))
        .map(|p| p.to_string())
        .or_else(|| families.iter().find(|f| f.contains("Sans")).cloned())
        .or_else(|| families.first().cloned());
    if let Some(family) = sans {
        fonts.set_sans_serif_family(family);
    }
    let tree = resvg::usvg::Tree::from_str(svg, &opt).map_err(plot_err)?;
    let size = tree.size().to_int_size();
    let mut pixmap = resvg::tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| Error::Plot(format!("cannot rasterize a {}x{} chart", size.width(), size.height())))?;
    resvg::render(&tree, resvg::tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap.encode_png().map_err(plot_err)
}

/// Writes `chart` as `DIR/STEM.svg` and `DIR/STEM.png` (creating `dir`), returning both paths.
pub fn write(dir: &Path, stem: &str, chart: &Chart) -> Result<Vec<PathBuf>> {
    let io = |what: &Path, e: std::io::Error| Error::Plot(format!("cannot write {}: {e}", what.display()));
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let text = svg(chart, 900, 560)?;
    let (svg_path, png_path) = (dir.join(format!("{stem}.svg")), dir.join(format!("{stem}.png")));
    std::fs::write(&svg_path, &text).map_err(|e| io(&svg_path, e))?;
    std::fs::write(&png_path, png(&text)?).map_err(|e| io(&png_path, e))?;
    Ok(vec![svg_path, png_path])
}

fn num(r: &Row, key: &str) -> Option<f64> {
    r.get(key).and_then(|v| v.as_f64())
}

fn text<'a>(r: &'a Row, key: &str) -> Option<&'a str> {
    r.get(key).and_then(|v| v.as_str())
}

/// A decode row's configuration as a legend name: method, selection mode and estimation
/// share (`wave per-kv-head est 0.232`, `pq per-query-head`, `oracle top-k`).
fn config_name(r: &Row) -> Option<String> {
    let method = text(r, "method")?;
    if method == "oracle_topk" {
        return Some("oracle top-k".into());
    }
    let mut name = method.to_string();
    if let Some(sel) = text(r, "selection") {
        name += &format!(" {sel}");
    }
    match r.get("estimate_frac") {
        Some(v) if v.is_string() => name += &format!(" est {}", v.as_str().unwrap_or_default()),
        Some(v) if v.is_number() => name += &format!(" est {}", v),
        _ => {}
    }
    Some(name)
}

/// The charts of an `attnstore bench` run, as `(file stem, chart)`: per context length the
/// accuracy/cost frontier (relative error against exactly attended tokens per method over
/// the budget scales, with the oracle top-k's curve), and decode latency against context
/// length per method (at the first budget scale), with exact attention and the memory-read
/// ceiling.
pub fn bench_charts(rows: &[Row]) -> Vec<(String, Chart)> {
    let decode: Vec<&Row> = rows.iter().filter(|r| text(r, "bench") == Some("decode")).collect();
    let mut charts = Vec::new();
    let mut lengths: Vec<u64> = decode.iter().filter_map(|r| num(r, "tokens")).map(|t| t as u64).collect();
    lengths.sort_unstable();
    lengths.dedup();
    for &tokens in &lengths {
        let mut by_config: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for r in decode.iter().filter(|r| num(r, "tokens") == Some(tokens as f64)) {
            let (Some(name), Some(x), Some(y)) = (config_name(r), num(r, "exact_tokens"), num(r, "rel_l2_error"))
            else {
                continue;
            };
            by_config.entry(name).or_default().push((x, y));
        }
        let oracle = by_config.remove("oracle top-k");
        let mut series: Vec<Series> = by_config.into_iter().map(|(n, p)| Series::new(n, p)).collect();
        if let Some(p) = oracle {
            series.push(Series::new("oracle top-k (same tokens)", p).reference());
        }
        if series.is_empty() {
            continue;
        }
        charts.push((
            format!("frontier_{}", token_label(tokens)),
            Chart {
                title: format!("Accuracy/cost frontier at {} tokens", token_label(tokens)),
                x: Axis::log("tokens attended exactly per query head"),
                y: Axis::log("relative L2 error of the output"),
                series,
            },
        ));
    }
    // Latency at the budget as given (scale 1), else at the first scale measured.
    let scales: Vec<f64> = decode.iter().filter_map(|r| num(r, "scale")).collect();
    let first_scale = scales.iter().copied().find(|&s| s == 1.0).or(scales.first().copied());
    let mut by_config: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in &decode {
        if num(r, "scale").is_some() && num(r, "scale") != first_scale {
            continue;
        }
        let (Some(name), Some(x), Some(y)) = (config_name(r), num(r, "tokens"), num(r, "time_us")) else { continue };
        by_config.entry(name).or_default().push((x, y));
    }
    let mut series: Vec<Series> = by_config.into_iter().map(|(n, p)| Series::new(n, p)).collect();
    let mem: Vec<(f64, f64)> = rows
        .iter()
        .filter(|r| text(r, "bench") == Some("memread"))
        .filter_map(|r| Some((num(r, "tokens")?, num(r, "time_us")?)))
        .collect();
    if !mem.is_empty() {
        series.push(Series::new("memory-read ceiling (all KV)", mem).reference());
    }
    if !series.is_empty() {
        charts.push((
            "latency".into(),
            Chart {
                title: "Decode step latency against context length (one layer, CPU)".into(),
                x: Axis::log("context length (tokens)"),
                y: Axis::log("plan + execute time per step (µs)"),
                series,
            },
        ));
    }
    charts
}

/// `131072` as `128K`, `1048576` as `1M`.
fn token_label(t: u64) -> String {
    if t >= 1 << 20 && t.is_multiple_of(1 << 20) {
        format!("{}M", t >> 20)
    } else if t >= 1024 && t.is_multiple_of(1024) {
        format!("{}K", t >> 10)
    } else {
        t.to_string()
    }
}

/// One decode step's tier counts, for [`hit_ratio_chart`]: per tier `(name, hits, misses)`
/// of that step alone.
#[derive(Debug, Clone, PartialEq)]
pub struct TierSample {
    /// The decode step.
    pub step: usize,
    /// Per tier: name, hits and misses during the step.
    pub tiers: Vec<(&'static str, u64, u64)>,
}

/// Per tier, the hit ratio of each decode step and the cumulative one, against the step.
pub fn hit_ratio_chart(samples: &[TierSample], title: &str) -> Chart {
    // Per tier: per-step points, cumulative points, hits and misses so far.
    type Points = Vec<(f64, f64)>;
    let mut per_tier: BTreeMap<&'static str, (Points, Points, u64, u64)> = BTreeMap::new();
    for s in samples {
        for &(tier, hits, misses) in &s.tiers {
            let e = per_tier.entry(tier).or_default();
            e.2 += hits;
            e.3 += misses;
            if hits + misses > 0 {
                e.0.push((s.step as f64, hits as f64 / (hits + misses) as f64));
            }
            if e.2 + e.3 > 0 {
                e.1.push((s.step as f64, e.2 as f64 / (e.2 + e.3) as f64));
            }
        }
    }
    let mut series = Vec::new();
    for (i, (tier, (step, cumulative, ..))) in per_tier.into_iter().enumerate() {
        if !step.is_empty() {
            series.push(Series::new(format!("{tier} tier, per step"), step).colored(i));
            series.push(Series::new(format!("{tier} tier, cumulative"), cumulative).reference().colored(i));
        }
    }
    Chart { title: title.into(), x: Axis::linear("decode step"), y: Axis::linear("hit ratio"), series }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_row(method: &str, tokens: u64, scale: f64, exact: f64, err: f64, us: f64) -> Row {
        let mut r = Row::new("decode", method);
        r.set("tokens", tokens)
            .set("scale", scale)
            .set("exact_tokens", exact)
            .set("rel_l2_error", err)
            .set("time_us", us)
            .set("selection", "per-kv-head");
        r
    }

    #[test]
    fn bench_rows_become_a_frontier_per_length_and_one_latency_chart() {
        let mut rows = Vec::new();
        for (t, us) in [(32768u64, 100.0), (131072, 400.0)] {
            for (s, x, e) in [(0.5, 500.0, 0.2), (1.0, 1000.0, 0.1), (2.0, 2000.0, 0.05)] {
                rows.push(decode_row("wave", t, s, x, e, us * s));
                rows.push(decode_row("oracle_topk", t, s, x, e / 2.0, us));
            }
        }
        let charts = bench_charts(&rows);
        let names: Vec<&str> = charts.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["frontier_32K", "frontier_128K", "latency"]);
        let frontier = &charts[0].1;
        assert_eq!(frontier.series.len(), 2);
        assert_eq!(frontier.series[0].points, [(500.0, 0.2), (1000.0, 0.1), (2000.0, 0.05)]);
        assert!(frontier.series[1].reference && frontier.series[1].points[0] == (500.0, 0.1));
        // Latency only at scale 1: one point per length.
        let wave = charts[2].1.series.iter().find(|s| s.name.starts_with("wave")).unwrap();
        assert_eq!(wave.points, [(32768.0, 100.0), (131072.0, 400.0)]);
    }

    #[test]
    fn hit_ratios_per_step_and_cumulative() {
        let samples = vec![
            TierSample { step: 0, tiers: vec![("gpu", 0, 10), ("host", 10, 0)] },
            TierSample { step: 1, tiers: vec![("gpu", 10, 0), ("host", 0, 0)] },
        ];
        let chart = hit_ratio_chart(&samples, "t");
        let gpu_step = chart.series.iter().find(|s| s.name == "gpu tier, per step").unwrap();
        assert_eq!(gpu_step.points, [(0.0, 0.0), (1.0, 1.0)]);
        let gpu_cum = chart.series.iter().find(|s| s.name == "gpu tier, cumulative").unwrap();
        assert_eq!(gpu_cum.points, [(0.0, 0.0), (1.0, 0.5)]);
        // A step without host reads has no per-step point but keeps the cumulative one.
        let host_step = chart.series.iter().find(|s| s.name == "host tier, per step").unwrap();
        assert_eq!(host_step.points.len(), 1);
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(tick(0.6000000000001), "0.6");
        assert_eq!(tick(0.0215), "0.0215");
        assert_eq!(tick(32768.0), "32768");
        assert_eq!(tick(12.5), "12.5");
        assert_eq!(tick(3.0), "3");
        assert_eq!(tick(1e-7), "1e-7");
        assert_eq!(tick(3.16e-6), "3.2e-6");
    }

    #[test]
    fn charts_render_to_svg_and_png_even_when_degenerate() {
        let one = Chart {
            title: "one point".into(),
            x: Axis::log("x"),
            y: Axis::log("y"),
            series: vec![Series::new("a", vec![(1000.0, 0.1), (f64::NAN, 1.0), (0.0, 1.0)])],
        };
        let empty = Chart { series: vec![], ..one.clone() };
        for chart in [one, empty] {
            let text = svg(&chart, 400, 300).unwrap();
            assert!(text.starts_with("<svg") && text.contains(&chart.title), "{}", &text[..100.min(text.len())]);
            let png = png(&text).unwrap();
            assert_eq!(&png[1..4], b"PNG");
        }
        let dir = tempfile::tempdir().unwrap();
        let written = write(dir.path(), "c", &hit_ratio_chart(&[], "none")).unwrap();
        assert!(written.iter().all(|p| p.exists()));
    }
}
