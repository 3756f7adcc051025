//! PNG line charts for the summary of `starling demo`: reward and throughput
//! over training steps, one panel per quantity, stacked vertically.
//!
//! Everything is drawn by hand into an RGB buffer: lines with Bresenham's
//! algorithm (2 px wide) and text with a 5×7 bitmap font embedded in this
//! module. There is deliberately no dependency on system fonts or font crates,
//! because CI machines and fresh containers usually have no fonts installed;
//! the only dependency is the `png` crate, for encoding.
//!
//! Rendering never panics: points with a NaN, infinite or absurdly large
//! (beyond ±1e100) coordinate are skipped and break the line there, empty
//! series and panels are drawn as empty charts, and the image size is clamped
//! to at least 200×150 and at most 8192×8192.

use std::ffi::OsString;
use std::io::{self, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// One line of a panel.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    pub(crate) label: String,
    pub(crate) color: [u8; 3],
    pub(crate) points: Vec<(f64, f64)>,
}

/// One chart: stacked vertically with the others, sharing the x axis label.
#[derive(Debug, Clone)]
pub(crate) struct Panel {
    pub(crate) title: String,
    pub(crate) y_label: String,
    pub(crate) series: Vec<Series>,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum PlotError {
    #[error("write {path}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("encode PNG: {0}")]
    Encode(String),
}

/// Renders the panels into an RGB PNG of width×height at `path` (written to a
/// temporary file and renamed). The size is clamped as for [`render_rgb`].
pub(crate) fn render_png(
    panels: &[Panel],
    x_label: &str,
    width: u32,
    height: u32,
    path: &Path,
) -> Result<(), PlotError> {
    let (width, height) = clamp_size(width, height);
    let pixels = render_rgb(panels, x_label, width, height);
    let png = encode_png(&pixels, width, height)?;
    write_atomically(path, &png)
}

/// The same image as raw RGB8 pixels (row-major, width*height*3), for tests.
///
/// `width` and `height` are clamped to 200..=8192 and 150..=8192; the buffer
/// has the clamped size.
pub(crate) fn render_rgb(panels: &[Panel], x_label: &str, width: u32, height: u32) -> Vec<u8> {
    let (width, height) = clamp_size(width, height);
    let mut canvas = Canvas::new(width, height);
    let metrics = Metrics::choose(width, height, panels.len());
    let x_axis = Axis::fit(all_x_values(panels), all_x_integral(panels));
    let x_ticks = TickLabels::new(&x_axis);
    let charts: Vec<Chart<'_>> = panels.iter().map(Chart::new).collect();
    let grid = PageGrid::compute(&canvas, metrics, &charts, &x_ticks);

    if charts.is_empty() {
        let page = Rect::new(0, 0, canvas.width, canvas.height);
        canvas.text_centered(page, NO_DATA, MUTED, metrics.scale);
    }
    for (index, chart) in charts.iter().enumerate() {
        let layout = ChartLayout::compute(metrics, &grid, grid.slot(index), chart);
        draw_chart(&mut canvas, metrics, chart, &layout, &x_axis, &x_ticks);
    }
    draw_x_label(&mut canvas, metrics, &grid, x_label);
    canvas.into_pixels()
}

// ---------------------------------------------------------------------------
// Constants
// ---------------------------------------------------------------------------

type Rgb = [u8; 3];

const MIN_WIDTH: u32 = 200;
const MIN_HEIGHT: u32 = 150;
/// Keeps the buffer (at most 8192² × 3 bytes = 192 MiB) allocatable.
const MAX_SIDE: u32 = 8192;

const WHITE: Rgb = [255, 255, 255];
const INK: Rgb = [34, 34, 34];
const MUTED: Rgb = [110, 110, 110];
const GRID: Rgb = [228, 228, 228];

/// Lines are 2 px wide whatever the scale.
const LINE_WIDTH: i64 = 2;
/// Series with fewer points than this get a marker at each point.
const MARKER_LIMIT: usize = 40;
const NO_DATA: &str = "no data";

/// Coordinates beyond this magnitude are skipped, so that spans and tick
/// arithmetic stay finite.
const MAX_ABS: f64 = 1e100;
/// Fraction of the data span added on each side of an axis.
const AXIS_MARGIN: f64 = 0.05;
/// Spans smaller than this fraction of the values' magnitude count as constant.
const MIN_RELATIVE_SPAN: f64 = 1e-6;
/// Spans (and constants) smaller than this count as zero.
const MIN_SPAN: f64 = 1e-100;
const MIN_TICKS: usize = 4;
const MAX_TICKS: usize = 6;
/// Nice tick steps are these mantissas times a power of ten.
const STEP_MANTISSAS: [f64; 4] = [1.0, 2.0, 2.5, 5.0];
const MAX_DECIMALS: usize = 9;

fn clamp_size(width: u32, height: u32) -> (u32, u32) {
    (
        width.clamp(MIN_WIDTH, MAX_SIDE),
        height.clamp(MIN_HEIGHT, MAX_SIDE),
    )
}

// ---------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------

/// Sizes derived from the text scale (1 or 2 pixels per font pixel).
#[derive(Debug, Clone, Copy)]
struct Metrics {
    scale: i64,
}

impl Metrics {
    /// Doubles the font on images large enough to afford it.
    fn choose(width: u32, height: u32, panel_count: usize) -> Self {
        let per_panel = height as usize / panel_count.max(1);
        let large = width >= 560 && per_panel >= 200;
        Self {
            scale: if large { 2 } else { 1 },
        }
    }

    fn text_height(self) -> i64 {
        GLYPH_HEIGHT * self.scale
    }

    fn text_width(self, text: &str) -> i64 {
        text_width(text, self.scale)
    }

    fn line_height(self) -> i64 {
        self.text_height() + self.gap()
    }

    fn gap(self) -> i64 {
        4 * self.scale
    }

    fn margin(self) -> i64 {
        8 * self.scale
    }

    /// Between the x tick labels of a panel and the title of the next.
    fn panel_spacing(self) -> i64 {
        3 * self.gap()
    }

    fn tick_length(self) -> i64 {
        4 * self.scale
    }

    fn marker_radius(self) -> i64 {
        1 + self.scale
    }

    fn swatch_width(self) -> i64 {
        14 * self.scale
    }

    /// Horizontal space between legend entries, and between title and legend.
    fn legend_spacing(self) -> i64 {
        3 * GLYPH_ADVANCE * self.scale
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Point {
    x: i64,
    y: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rect {
    left: i64,
    top: i64,
    width: i64,
    height: i64,
}

impl Rect {
    fn new(left: i64, top: i64, width: i64, height: i64) -> Self {
        Self {
            left,
            top,
            width,
            height,
        }
    }

    fn right(self) -> i64 {
        self.left + self.width - 1
    }

    fn bottom(self) -> i64 {
        self.top + self.height - 1
    }

    /// Too small to hold a chart: happens with many panels on a small image.
    fn is_degenerate(self) -> bool {
        self.width < 8 || self.height < 8
    }
}

/// A panel with its fitted y axis.
#[derive(Debug)]
struct Chart<'a> {
    panel: &'a Panel,
    y_axis: Axis,
    y_ticks: TickLabels,
}

impl<'a> Chart<'a> {
    fn new(panel: &'a Panel) -> Self {
        let y_values = panel
            .series
            .iter()
            .flat_map(plottable_points)
            .map(|(_, y)| y);
        let y_axis = Axis::fit(y_values, false);
        let y_ticks = TickLabels::new(&y_axis);
        Self {
            panel,
            y_axis,
            y_ticks,
        }
    }

    fn has_data(&self) -> bool {
        self.panel
            .series
            .iter()
            .any(|series| plottable_points(series).next().is_some())
    }
}

/// Where the panels go: one plot column shared by all panels (so that their x
/// axes line up) and one equal-height slot per panel.
#[derive(Debug)]
struct PageGrid {
    plot_left: i64,
    plot_right: i64,
    slots_top: i64,
    slot_height: i64,
    x_label_top: i64,
}

impl PageGrid {
    fn compute(
        canvas: &Canvas,
        metrics: Metrics,
        charts: &[Chart<'_>],
        x_ticks: &TickLabels,
    ) -> Self {
        let y_label_width = charts
            .iter()
            .map(|chart| chart.y_ticks.max_width(metrics))
            .max()
            .unwrap_or(0);
        let plot_left = metrics.margin()
            + metrics.text_height()
            + metrics.gap()
            + y_label_width
            + metrics.gap()
            + metrics.tick_length();
        let overhang = x_ticks.max_width(metrics) / 2;
        let plot_right = canvas.width - 1 - metrics.margin().max(overhang);
        let x_label_top = canvas.height - metrics.margin() - metrics.text_height();
        let slots_top = metrics.margin();
        let slots_height = x_label_top - metrics.gap() - slots_top;
        let count = i64::try_from(charts.len()).unwrap_or(i64::MAX).max(1);
        Self {
            plot_left,
            plot_right,
            slots_top,
            slot_height: slots_height / count,
            x_label_top,
        }
    }

    /// The full-width band of the panel at `index`.
    fn slot(&self, index: usize) -> Rect {
        let index = i64::try_from(index).unwrap_or(i64::MAX);
        let top = self
            .slots_top
            .saturating_add(index.saturating_mul(self.slot_height));
        Rect::new(0, top, self.plot_right + 1, self.slot_height)
    }

    fn plot_width(&self) -> i64 {
        self.plot_right - self.plot_left + 1
    }
}

/// Title, legend and plot area of one panel within its slot.
#[derive(Debug)]
struct ChartLayout {
    title: Point,
    /// Each legend line: where it starts and the series it holds.
    legend: Vec<(Point, Range<usize>)>,
    plot: Rect,
}

impl ChartLayout {
    /// The legend shares the title's line, right-aligned, when both fit; otherwise it gets
    /// lines of its own below the title, right-aligned, as many as its entries need.
    fn compute(metrics: Metrics, grid: &PageGrid, slot: Rect, chart: &Chart<'_>) -> Self {
        let series = &chart.panel.series;
        let title_width = metrics.text_width(&chart.panel.title);
        let rows = legend_rows(metrics, series, grid.plot_width());
        let shared_line = rows.len() <= 1
            && title_width + metrics.legend_spacing() + legend_width(metrics, series)
                <= grid.plot_width();
        let first_row = if shared_line { 0 } else { 1 };
        let header_lines = first_row + i64::try_from(rows.len()).unwrap_or(i64::MAX).max(1);
        let legend = rows
            .into_iter()
            .zip(first_row..)
            .map(|(row, line)| {
                let width = legend_width(metrics, &series[row.clone()]);
                let at = Point {
                    x: (grid.plot_right + 1 - width).max(grid.plot_left),
                    y: slot.top + line * metrics.line_height(),
                };
                (at, row)
            })
            .collect();
        let plot_top = slot.top + header_lines * metrics.line_height() + metrics.gap();
        let below_plot = metrics.tick_length() + metrics.line_height() + metrics.panel_spacing();
        let plot_bottom = slot.top + slot.height - below_plot;
        Self {
            title: Point {
                x: grid.plot_left,
                y: slot.top,
            },
            legend,
            plot: Rect::new(
                grid.plot_left,
                plot_top,
                grid.plot_width(),
                plot_bottom - plot_top + 1,
            ),
        }
    }
}

// ---------------------------------------------------------------------------
// Drawing
// ---------------------------------------------------------------------------

/// Maps data coordinates into a plot rectangle.
#[derive(Debug, Clone, Copy)]
struct Projection<'a> {
    plot: Rect,
    x_axis: &'a Axis,
    y_axis: &'a Axis,
}

impl Projection<'_> {
    fn x(&self, x: f64) -> i64 {
        self.plot.left + scale_to(self.x_axis.fraction(x), self.plot.width - 1)
    }

    fn y(&self, y: f64) -> i64 {
        self.plot.bottom() - scale_to(self.y_axis.fraction(y), self.plot.height - 1)
    }

    fn point(&self, (x, y): (f64, f64)) -> Point {
        Point {
            x: self.x(x),
            y: self.y(y),
        }
    }
}

/// `fraction` of `length` pixels, rounded (saturating casts never panic).
fn scale_to(fraction: f64, length: i64) -> i64 {
    (fraction * length as f64).round() as i64
}

fn draw_chart(
    canvas: &mut Canvas,
    metrics: Metrics,
    chart: &Chart<'_>,
    layout: &ChartLayout,
    x_axis: &Axis,
    x_ticks: &TickLabels,
) {
    let title = fit_text(&chart.panel.title, layout.plot.width, metrics.scale);
    draw_title(canvas, metrics, layout.title, title);
    for (origin, row) in &layout.legend {
        draw_legend(
            canvas,
            metrics,
            &chart.panel.series[row.clone()],
            *origin,
            layout.plot.right(),
        );
    }
    if layout.plot.is_degenerate() {
        return;
    }
    let projection = Projection {
        plot: layout.plot,
        x_axis,
        y_axis: &chart.y_axis,
    };
    draw_grid_lines(canvas, &projection);
    if chart.has_data() {
        for series in &chart.panel.series {
            draw_series(canvas, metrics, &projection, series);
        }
    } else {
        canvas.text_centered(layout.plot, NO_DATA, MUTED, metrics.scale);
    }
    canvas.frame(layout.plot, INK);
    draw_x_ticks(canvas, metrics, &projection, x_ticks);
    draw_y_ticks(canvas, metrics, &projection, &chart.y_ticks);
    draw_y_label(canvas, metrics, layout.plot, &chart.panel.y_label);
}

/// Bold (struck twice, 1 px apart) when the font is large enough to keep
/// the letters apart.
fn draw_title(canvas: &mut Canvas, metrics: Metrics, origin: Point, title: &str) {
    canvas.text(origin, title, INK, metrics.scale);
    if metrics.scale > 1 {
        let shifted = Point {
            x: origin.x + 1,
            ..origin
        };
        canvas.text(shifted, title, INK, metrics.scale);
    }
}

fn draw_grid_lines(canvas: &mut Canvas, projection: &Projection<'_>) {
    let plot = projection.plot;
    for &x in &projection.x_axis.ticks {
        canvas.fill_rect(Rect::new(projection.x(x), plot.top, 1, plot.height), GRID);
    }
    for &y in &projection.y_axis.ticks {
        canvas.fill_rect(Rect::new(plot.left, projection.y(y), plot.width, 1), GRID);
    }
}

/// Lines between consecutive valid points (an invalid point breaks the line),
/// plus a marker at each point when there are few of them.
fn draw_series(
    canvas: &mut Canvas,
    metrics: Metrics,
    projection: &Projection<'_>,
    series: &Series,
) {
    let mut previous: Option<Point> = None;
    for &point in &series.points {
        let current = is_plottable(point).then(|| projection.point(point));
        if let (Some(from), Some(to)) = (previous, current) {
            canvas.line(from, to, series.color);
        }
        previous = current;
    }
    if series.points.len() < MARKER_LIMIT {
        for point in plottable_points(series) {
            canvas.disc(
                projection.point(point),
                metrics.marker_radius(),
                series.color,
            );
        }
    }
}

fn draw_x_ticks(
    canvas: &mut Canvas,
    metrics: Metrics,
    projection: &Projection<'_>,
    ticks: &TickLabels,
) {
    let plot = projection.plot;
    let label_top = plot.bottom() + 1 + metrics.tick_length() + metrics.gap();
    let mut free_from = i64::MIN;
    for (&value, label) in projection.x_axis.ticks.iter().zip(&ticks.labels) {
        let x = projection.x(value);
        canvas.fill_rect(
            Rect::new(x, plot.bottom() + 1, 1, metrics.tick_length()),
            INK,
        );
        let width = metrics.text_width(label);
        let left = x - width / 2;
        if left >= free_from {
            canvas.text(
                Point {
                    x: left,
                    y: label_top,
                },
                label,
                INK,
                metrics.scale,
            );
            free_from = left + width + metrics.gap();
        }
    }
}

fn draw_y_ticks(
    canvas: &mut Canvas,
    metrics: Metrics,
    projection: &Projection<'_>,
    ticks: &TickLabels,
) {
    let plot = projection.plot;
    let label_right = plot.left - metrics.tick_length() - metrics.gap();
    let mut free_above = i64::MAX;
    for (&value, label) in projection.y_axis.ticks.iter().zip(&ticks.labels) {
        let y = projection.y(value);
        let tick = Rect::new(
            plot.left - metrics.tick_length(),
            y,
            metrics.tick_length(),
            1,
        );
        canvas.fill_rect(tick, INK);
        let top = y - metrics.text_height() / 2;
        if top + metrics.text_height() <= free_above {
            let left = label_right - metrics.text_width(label);
            canvas.text(Point { x: left, y: top }, label, INK, metrics.scale);
            free_above = top - metrics.gap();
        }
    }
}

/// The y label reads bottom to top, centred on the plot, at the left margin.
fn draw_y_label(canvas: &mut Canvas, metrics: Metrics, plot: Rect, label: &str) {
    let label = fit_text(label, plot.height, metrics.scale);
    let length = metrics.text_width(label);
    let origin = Point {
        x: metrics.margin(),
        y: plot.top + (plot.height + length) / 2,
    };
    canvas.text_upwards(origin, label, INK, metrics.scale);
}

fn legend_width(metrics: Metrics, series: &[Series]) -> i64 {
    let entries: i64 = series
        .iter()
        .map(|series| legend_entry_width(metrics, series))
        .sum();
    let count = i64::try_from(series.len()).unwrap_or(i64::MAX);
    entries + (count - 1).max(0) * metrics.legend_spacing()
}

/// The legend's entries in lines of at most `width` pixels, greedily, in order (an entry
/// wider than a line gets a line of its own and is cut off when drawn).
fn legend_rows(metrics: Metrics, series: &[Series], width: i64) -> Vec<Range<usize>> {
    let mut rows = Vec::new();
    let mut start = 0;
    let mut used = 0;
    for (i, entry) in series.iter().enumerate() {
        let w = legend_entry_width(metrics, entry);
        if i > start && used + metrics.legend_spacing() + w > width {
            rows.push(start..i);
            start = i;
            used = 0;
        }
        used += if i > start {
            metrics.legend_spacing() + w
        } else {
            w
        };
    }
    if start < series.len() {
        rows.push(start..series.len());
    }
    rows
}

fn legend_entry_width(metrics: Metrics, series: &Series) -> i64 {
    metrics.swatch_width() + metrics.gap() + metrics.text_width(&series.label)
}

/// Each entry: a short stroke of the series' colour, then its label; entries
/// are cut off at `right`.
fn draw_legend(
    canvas: &mut Canvas,
    metrics: Metrics,
    series: &[Series],
    origin: Point,
    right: i64,
) {
    let swatch_top = origin.y + (metrics.text_height() - LINE_WIDTH - 1) / 2;
    let mut left = origin.x;
    for entry in series {
        let label_left = left + metrics.swatch_width() + metrics.gap();
        if label_left > right {
            break;
        }
        let swatch = Rect::new(left, swatch_top, metrics.swatch_width(), LINE_WIDTH + 1);
        canvas.fill_rect(swatch, entry.color);
        let label = fit_text(&entry.label, right - label_left + 1, metrics.scale);
        let label_origin = Point {
            x: label_left,
            y: origin.y,
        };
        canvas.text(label_origin, label, INK, metrics.scale);
        left += legend_entry_width(metrics, entry) + metrics.legend_spacing();
    }
}

fn draw_x_label(canvas: &mut Canvas, metrics: Metrics, grid: &PageGrid, x_label: &str) {
    let x_label = fit_text(x_label, grid.plot_width(), metrics.scale);
    let width = metrics.text_width(x_label);
    let origin = Point {
        x: (grid.plot_left + (grid.plot_width() - width) / 2).max(0),
        y: grid.x_label_top,
    };
    canvas.text(origin, x_label, INK, metrics.scale);
}

// ---------------------------------------------------------------------------
// Data and axes
// ---------------------------------------------------------------------------

fn is_plottable((x, y): (f64, f64)) -> bool {
    x.is_finite() && y.is_finite() && x.abs() <= MAX_ABS && y.abs() <= MAX_ABS
}

fn plottable_points(series: &Series) -> impl Iterator<Item = (f64, f64)> + '_ {
    series
        .points
        .iter()
        .copied()
        .filter(|&point| is_plottable(point))
}

fn all_points(panels: &[Panel]) -> impl Iterator<Item = (f64, f64)> + '_ {
    panels
        .iter()
        .flat_map(|panel| &panel.series)
        .flat_map(plottable_points)
}

fn all_x_values(panels: &[Panel]) -> impl Iterator<Item = f64> + '_ {
    all_points(panels).map(|(x, _)| x)
}

/// Whether every x is a whole number (training steps): x ticks are then
/// integers too.
fn all_x_integral(panels: &[Panel]) -> bool {
    all_x_values(panels).all(|x| x.fract().abs() < f64::EPSILON)
}

/// An axis range with its "nice" ticks (multiples of 1, 2, 2.5 or 5 × 10^k).
///
/// Invariant: `lo < hi`, both finite, and every tick lies within them.
#[derive(Debug, Clone, PartialEq)]
struct Axis {
    lo: f64,
    hi: f64,
    step: f64,
    ticks: Vec<f64>,
}

impl Axis {
    /// Fits an axis around the values (which must be finite and within
    /// [`MAX_ABS`]), with a small margin; around `0..=1` when there are none.
    fn fit(values: impl Iterator<Item = f64>, integral: bool) -> Self {
        let data = data_bounds(values).unwrap_or(Bounds { lo: 0.0, hi: 1.0 });
        let padded = padded_range(data, integral);
        let step = nice_step(padded, integral);
        let range = widen_to_ticks(padded, data, step, integral);
        Self {
            lo: range.lo,
            hi: range.hi,
            step,
            ticks: tick_values(range, step),
        }
    }

    /// Where `value` lies between `lo` (0) and `hi` (1).
    fn fraction(&self, value: f64) -> f64 {
        (value - self.lo) / (self.hi - self.lo)
    }
}

/// A closed interval.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Bounds {
    lo: f64,
    hi: f64,
}

fn data_bounds(values: impl Iterator<Item = f64>) -> Option<Bounds> {
    values.fold(None, |bounds, value| {
        let Bounds { lo, hi } = bounds.unwrap_or(Bounds {
            lo: value,
            hi: value,
        });
        Some(Bounds {
            lo: lo.min(value),
            hi: hi.max(value),
        })
    })
}

/// The data range plus margins; a constant (or nearly constant) range is
/// widened around its value so that it never has zero width.
fn padded_range(data: Bounds, integral: bool) -> Bounds {
    let span = data.hi - data.lo;
    let magnitude = data.lo.abs().max(data.hi.abs());
    if span > MIN_SPAN && span > magnitude * MIN_RELATIVE_SPAN {
        let pad = span * AXIS_MARGIN;
        return Bounds {
            lo: data.lo - pad,
            hi: data.hi + pad,
        };
    }
    let center = (data.lo + data.hi) / 2.0;
    let half = if integral {
        (center.abs() * 0.1).max(2.0)
    } else if center.abs() > MIN_SPAN {
        center.abs() * 0.1
    } else {
        1.0
    };
    Bounds {
        lo: center - half,
        hi: center + half,
    }
}

/// The smallest nice step giving at most [`MAX_TICKS`] ticks in `range`;
/// steps are whole numbers when `integral`.
fn nice_step(range: Bounds, integral: bool) -> f64 {
    let top_exponent = (range.hi - range.lo).log10().floor() as i32 + 1;
    let candidates = (top_exponent - 3..=top_exponent).flat_map(|exponent| {
        let power = 10f64.powi(exponent);
        STEP_MANTISSAS.iter().map(move |mantissa| mantissa * power)
    });
    candidates
        .filter(|step| !integral || (*step >= 1.0 && step.fract() == 0.0))
        .find(|&step| tick_count(range, step) <= MAX_TICKS)
        .unwrap_or_else(|| 10f64.powi(top_exponent))
}

/// Extends `range` when fewer than [`MIN_TICKS`] ticks fall inside: first to
/// the ticks just outside the data (so non-negative data keeps 0 as its lowest
/// tick), then, except on integral axes, to the ticks just outside `range`
/// (integral axes accept fewer ticks rather than showing a step of -1 for a
/// run of 0..=2 steps).
fn widen_to_ticks(range: Bounds, data: Bounds, step: f64, integral: bool) -> Bounds {
    if tick_count(range, step) >= MIN_TICKS {
        return range;
    }
    let widened = Bounds {
        lo: range.lo.min(tick_at_or_below(data.lo, step)),
        hi: range.hi.max(tick_at_or_above(data.hi, step)),
    };
    if tick_count(widened, step) >= MIN_TICKS || integral {
        return widened;
    }
    Bounds {
        lo: tick_at_or_below(widened.lo, step),
        hi: tick_at_or_above(widened.hi, step),
    }
}

fn tick_at_or_below(value: f64, step: f64) -> f64 {
    (value / step).floor() * step
}

fn tick_at_or_above(value: f64, step: f64) -> f64 {
    (value / step).ceil() * step
}

/// The first and last multiples of `step` within `range`.
fn tick_multiples(range: Bounds, step: f64) -> (i64, i64) {
    (
        (range.lo / step).ceil() as i64,
        (range.hi / step).floor() as i64,
    )
}

fn tick_count(range: Bounds, step: f64) -> usize {
    let (first, last) = tick_multiples(range, step);
    usize::try_from(last.saturating_sub(first).saturating_add(1)).unwrap_or(0)
}

fn tick_values(range: Bounds, step: f64) -> Vec<f64> {
    let (first, last) = tick_multiples(range, step);
    // The bound only guards against float surprises; nice_step keeps it small.
    (first..=last)
        .take(4 * MAX_TICKS)
        .map(|multiple| multiple as f64 * step)
        .collect()
}

/// The printed ticks of an axis.
#[derive(Debug, Clone, PartialEq)]
struct TickLabels {
    labels: Vec<String>,
}

impl TickLabels {
    fn new(axis: &Axis) -> Self {
        Self {
            labels: format_ticks(&axis.ticks, axis.step),
        }
    }

    fn max_width(&self, metrics: Metrics) -> i64 {
        self.labels
            .iter()
            .map(|label| metrics.text_width(label))
            .max()
            .unwrap_or(0)
    }
}

/// Compact labels sharing one unit: `0.25`, `1500`, `12k`, `2.5M`, `4e-5`;
/// the decimals are the fewest that print every multiple of `step` exactly.
fn format_ticks(ticks: &[f64], step: f64) -> Vec<String> {
    let largest = ticks
        .iter()
        .fold(0.0f64, |largest, tick| largest.max(tick.abs()));
    let (divisor, suffix) = tick_unit(largest);
    let decimals = decimals_for(step / divisor);
    ticks
        .iter()
        .map(|&tick| format_tick(tick, step, divisor, decimals, &suffix))
        .collect()
}

/// The divisor and suffix for ticks whose largest magnitude is `largest`:
/// plain up to 9999, then k, M and G, and scientific beyond (or below 0.001).
fn tick_unit(largest: f64) -> (f64, String) {
    if largest >= 1e12 || (largest > 0.0 && largest < 1e-3) {
        let exponent = largest.log10().floor() as i32;
        (10f64.powi(exponent), format!("e{exponent}"))
    } else if largest >= 1e9 {
        (1e9, "G".to_owned())
    } else if largest >= 1e6 {
        (1e6, "M".to_owned())
    } else if largest >= 1e4 {
        (1e3, "k".to_owned())
    } else {
        (1.0, String::new())
    }
}

fn format_tick(tick: f64, step: f64, divisor: f64, decimals: usize, suffix: &str) -> String {
    if tick.abs() < step * 1e-6 {
        return "0".to_owned();
    }
    let digits = format!("{:.*}", decimals, tick / divisor);
    let digits = if digits.contains('.') {
        digits.trim_end_matches('0').trim_end_matches('.')
    } else {
        &digits
    };
    format!("{digits}{suffix}")
}

/// The fewest decimals that print multiples of `step` exactly.
fn decimals_for(step: f64) -> usize {
    (0..MAX_DECIMALS)
        .find(|&decimals| {
            let scaled = step * 10f64.powi(decimals as i32);
            (scaled - scaled.round()).abs() < 1e-6 * scaled.abs().max(1.0)
        })
        .unwrap_or(MAX_DECIMALS)
}

// ---------------------------------------------------------------------------
// Canvas
// ---------------------------------------------------------------------------

/// An RGB8 pixel buffer; every drawing operation clips to it.
#[derive(Debug)]
struct Canvas {
    width: i64,
    height: i64,
    pixels: Vec<u8>,
}

impl Canvas {
    fn new(width: u32, height: u32) -> Self {
        Self {
            width: i64::from(width),
            height: i64::from(height),
            pixels: WHITE.repeat(width as usize * height as usize),
        }
    }

    fn into_pixels(self) -> Vec<u8> {
        self.pixels
    }

    fn put(&mut self, x: i64, y: i64, color: Rgb) {
        if !(0..self.width).contains(&x) || !(0..self.height).contains(&y) {
            return;
        }
        let Ok(index) = usize::try_from((y * self.width + x) * 3) else {
            return;
        };
        if let Some(pixel) = self.pixels.get_mut(index..index + 3) {
            pixel.copy_from_slice(&color);
        }
    }

    fn fill_rect(&mut self, rect: Rect, color: Rgb) {
        let (left, right) = (rect.left.max(0), (rect.left + rect.width).min(self.width));
        let (top, bottom) = (rect.top.max(0), (rect.top + rect.height).min(self.height));
        for y in top..bottom {
            for x in left..right {
                self.put(x, y, color);
            }
        }
    }

    /// A 1 px outline just inside `rect`.
    fn frame(&mut self, rect: Rect, color: Rgb) {
        self.fill_rect(Rect::new(rect.left, rect.top, rect.width, 1), color);
        self.fill_rect(Rect::new(rect.left, rect.bottom(), rect.width, 1), color);
        self.fill_rect(Rect::new(rect.left, rect.top, 1, rect.height), color);
        self.fill_rect(Rect::new(rect.right(), rect.top, 1, rect.height), color);
    }

    /// Bresenham's line with a square brush of [`LINE_WIDTH`] px.
    fn line(&mut self, from: Point, to: Point, color: Rgb) {
        let (from, to) = (self.clamp(from), self.clamp(to));
        let (dx, dy) = ((to.x - from.x).abs(), -(to.y - from.y).abs());
        let (step_x, step_y) = ((to.x - from.x).signum(), (to.y - from.y).signum());
        let mut error = dx + dy;
        let mut current = from;
        let offset = (LINE_WIDTH - 1) / 2;
        loop {
            let brush = Rect::new(
                current.x - offset,
                current.y - offset,
                LINE_WIDTH,
                LINE_WIDTH,
            );
            self.fill_rect(brush, color);
            if current == to {
                break;
            }
            let doubled = 2 * error;
            if doubled >= dy {
                error += dy;
                current.x += step_x;
            }
            if doubled <= dx {
                error += dx;
                current.y += step_y;
            }
        }
    }

    /// Keeps line endpoints near the canvas, bounding Bresenham's loop even
    /// for wild coordinates (all projected data lies inside anyway).
    fn clamp(&self, point: Point) -> Point {
        Point {
            x: point.x.clamp(-LINE_WIDTH, self.width + LINE_WIDTH),
            y: point.y.clamp(-LINE_WIDTH, self.height + LINE_WIDTH),
        }
    }

    fn disc(&mut self, center: Point, radius: i64, color: Rgb) {
        for dy in -radius..=radius {
            for dx in -radius..=radius {
                if dx * dx + dy * dy <= radius * radius + radius {
                    self.put(center.x + dx, center.y + dy, color);
                }
            }
        }
    }

    /// Left-to-right text with its top-left corner at `origin`.
    fn text(&mut self, origin: Point, text: &str, color: Rgb, scale: i64) {
        for (x, y) in glyph_pixels(text) {
            let cell = Rect::new(origin.x + x * scale, origin.y + y * scale, scale, scale);
            self.fill_rect(cell, color);
        }
    }

    /// Text rotated a quarter turn anticlockwise, reading bottom to top, with
    /// the bottom-left corner of its first glyph at `origin`.
    fn text_upwards(&mut self, origin: Point, text: &str, color: Rgb, scale: i64) {
        for (x, y) in glyph_pixels(text) {
            let cell = Rect::new(
                origin.x + y * scale,
                origin.y - (x + 1) * scale,
                scale,
                scale,
            );
            self.fill_rect(cell, color);
        }
    }

    fn text_centered(&mut self, area: Rect, text: &str, color: Rgb, scale: i64) {
        let origin = Point {
            x: area.left + (area.width - text_width(text, scale)) / 2,
            y: area.top + (area.height - GLYPH_HEIGHT * scale) / 2,
        };
        self.text(origin, text, color, scale);
    }
}

// ---------------------------------------------------------------------------
// Font
// ---------------------------------------------------------------------------

const GLYPH_WIDTH: i64 = 5;
const GLYPH_HEIGHT: i64 = 7;
/// Glyph width plus one column of spacing.
const GLYPH_ADVANCE: i64 = 6;

/// 5×7 glyphs, one byte per row from the top, bit 4 the leftmost column.
/// Lower-case letters are drawn with the upper-case glyphs.
const FONT: [(char, [u8; 7]); 48] = [
    (' ', [0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]),
    ('0', [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E]),
    ('1', [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E]),
    ('2', [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F]),
    ('3', [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E]),
    ('4', [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02]),
    ('5', [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E]),
    ('6', [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E]),
    ('7', [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08]),
    ('8', [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E]),
    ('9', [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C]),
    ('A', [0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11]),
    ('B', [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E]),
    ('C', [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E]),
    ('D', [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C]),
    ('E', [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F]),
    ('F', [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10]),
    ('G', [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F]),
    ('H', [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11]),
    ('I', [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E]),
    ('J', [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C]),
    ('K', [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11]),
    ('L', [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F]),
    ('M', [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11]),
    ('N', [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11]),
    ('O', [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E]),
    ('P', [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10]),
    ('Q', [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D]),
    ('R', [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11]),
    ('S', [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E]),
    ('T', [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04]),
    ('U', [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E]),
    ('V', [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04]),
    ('W', [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A]),
    ('X', [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11]),
    ('Y', [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04]),
    ('Z', [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F]),
    ('.', [0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C]),
    (',', [0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08]),
    ('-', [0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00]),
    ('+', [0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00]),
    ('/', [0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00]),
    (':', [0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00]),
    ('(', [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02]),
    (')', [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08]),
    ('%', [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03]),
    ('=', [0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00]),
    ('_', [0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F]),
];

/// A question mark, drawn for `?` and every character the font lacks.
const UNKNOWN_GLYPH: [u8; 7] = [0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04];

fn glyph(ch: char) -> [u8; 7] {
    let ch = ch.to_ascii_uppercase();
    FONT.iter()
        .find(|(known, _)| *known == ch)
        .map_or(UNKNOWN_GLYPH, |(_, rows)| *rows)
}

/// The lit font pixels of `text` at scale 1, relative to its top-left corner.
fn glyph_pixels(text: &str) -> impl Iterator<Item = (i64, i64)> + '_ {
    (0i64..).zip(text.chars()).flat_map(|(index, ch)| {
        let left = index * GLYPH_ADVANCE;
        (0i64..).zip(glyph(ch)).flat_map(move |(y, bits)| {
            (0..GLYPH_WIDTH)
                .filter(move |x| bits & (0x10 >> x) != 0)
                .map(move |x| (left + x, y))
        })
    })
}

/// The longest prefix of `text` at most `max_width` pixels wide.
fn fit_text(text: &str, max_width: i64, scale: i64) -> &str {
    let fitting = (max_width + scale) / (GLYPH_ADVANCE * scale).max(1);
    let fitting = usize::try_from(fitting).unwrap_or(0);
    text.char_indices()
        .nth(fitting)
        .and_then(|(end, _)| text.get(..end))
        .unwrap_or(text)
}

fn text_width(text: &str, scale: i64) -> i64 {
    let chars = i64::try_from(text.chars().count()).unwrap_or(i64::MAX);
    (chars.saturating_mul(GLYPH_ADVANCE) - 1)
        .max(0)
        .saturating_mul(scale)
}

// ---------------------------------------------------------------------------
// PNG output
// ---------------------------------------------------------------------------

fn encode_png(pixels: &[u8], width: u32, height: u32) -> Result<Vec<u8>, PlotError> {
    let encode_error = |error: png::EncodingError| PlotError::Encode(error.to_string());
    let mut png = Vec::new();
    let mut encoder = png::Encoder::new(&mut png, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(encode_error)?;
    writer.write_image_data(pixels).map_err(encode_error)?;
    writer.finish().map_err(encode_error)?;
    Ok(png)
}

/// Writes `bytes` to a temporary file beside `path`, then renames it over
/// `path`, so that readers never see a half-written image.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), PlotError> {
    let io_error = |source| PlotError::Io {
        path: path.display().to_string(),
        source,
    };
    let temp = temp_path(path).ok_or_else(|| {
        io_error(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a file path",
        ))
    })?;
    let result = write_synced(&temp, bytes).and_then(|()| std::fs::rename(&temp, path));
    if result.is_err() {
        // Best effort: the write or rename error is the one worth reporting.
        let _ = std::fs::remove_file(&temp);
    }
    result.map_err(io_error)
}

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = std::fs::File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// `dir/.name.tmp<pid>` for `dir/name`; `None` when `path` names no file.
fn temp_path(path: &Path) -> Option<PathBuf> {
    let mut name = OsString::from(".");
    name.push(path.file_name()?);
    name.push(format!(".tmp{}", std::process::id()));
    Some(path.with_file_name(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLUE: Rgb = [31, 119, 180];
    const ORANGE: Rgb = [255, 127, 14];

    fn series(label: &str, color: Rgb, points: Vec<(f64, f64)>) -> Series {
        Series {
            label: label.to_owned(),
            color,
            points,
        }
    }

    fn panel(title: &str, series: Vec<Series>) -> Panel {
        Panel {
            title: title.to_owned(),
            y_label: "value".to_owned(),
            series,
        }
    }

    fn rising(steps: u32, from: f64, to: f64) -> Vec<(f64, f64)> {
        (0..=steps)
            .map(|step| {
                let t = f64::from(step) / f64::from(steps);
                (f64::from(step), from + (to - from) * t)
            })
            .collect()
    }

    fn demo_panels() -> Vec<Panel> {
        vec![
            panel("reward", vec![series("reward", BLUE, rising(30, 0.3, 0.8))]),
            panel(
                "throughput",
                vec![
                    series("tokens/s", ORANGE, rising(30, 9e3, 14e3)),
                    series("samples/s", [44, 160, 44], rising(30, 5e3, 6e3)),
                ],
            ),
        ]
    }

    fn count_color(pixels: &[u8], color: Rgb) -> usize {
        pixels
            .chunks_exact(3)
            .filter(|pixel| *pixel == color)
            .count()
    }

    #[test]
    fn image_has_the_requested_size() {
        let pixels = render_rgb(&demo_panels(), "step", 640, 480);
        assert_eq!(pixels.len(), 640 * 480 * 3);
    }

    #[test]
    fn tiny_sizes_are_clamped_to_the_minimum() {
        for (width, height) in [(0, 0), (1, 1), (199, 149), (10_000, 1)] {
            let pixels = render_rgb(&demo_panels(), "step", width, height);
            let (width, height) = clamp_size(width, height);
            assert_eq!(pixels.len(), width as usize * height as usize * 3);
        }
    }

    #[test]
    fn every_series_color_appears() {
        let pixels = render_rgb(&demo_panels(), "step", 640, 480);
        assert!(count_color(&pixels, BLUE) > 0);
        assert!(count_color(&pixels, ORANGE) > 0);
    }

    #[test]
    fn lines_are_drawn_beyond_the_legend() {
        let empty = vec![panel("p", vec![series("s", BLUE, Vec::new())])];
        let full = vec![panel("p", vec![series("s", BLUE, rising(100, 0.0, 1.0))])];
        let legend_only = count_color(&render_rgb(&empty, "x", 640, 480), BLUE);
        let with_line = count_color(&render_rgb(&full, "x", 640, 480), BLUE);
        assert!(
            with_line > legend_only + 500,
            "{with_line} vs {legend_only}"
        );
    }

    #[test]
    fn a_legend_too_wide_for_one_line_wraps_and_shows_every_series() {
        // The real run's comparison: four modes with long names (the fourth was cut off).
        let colors = [BLUE, ORANGE, [44, 160, 44], [148, 103, 189]];
        let names = [
            "delta (round 1)",
            "no-transfer (round 1)",
            "full-broadcast (round 1)",
            "full-broadcast-exclusive (round 1)",
        ];
        let empty = |n: usize| {
            vec![panel(
                "reward per step",
                names[..n]
                    .iter()
                    .zip(colors)
                    .map(|(name, c)| series(name, c, Vec::new()))
                    .collect(),
            )]
        };
        let pixels = render_rgb(&empty(4), "step", 900, 720);
        for c in colors {
            assert!(count_color(&pixels, c) > 0, "{c:?} is in the legend");
        }
        let metrics = Metrics::choose(900, 720, 1);
        let all = empty(4);
        let rows = legend_rows(metrics, &all[0].series, 700);
        assert!(rows.len() >= 2, "{rows:?}");
        assert_eq!(rows.first().map(|r| r.start), Some(0));
        assert_eq!(rows.last().map(|r| r.end), Some(4));
        for r in &rows {
            assert!(r.len() == 1 || legend_width(metrics, &all[0].series[r.clone()]) <= 700);
        }
        assert_eq!(legend_rows(metrics, &empty(1)[0].series, 700), vec![0..1]);
    }

    #[test]
    fn background_is_white() {
        let pixels = render_rgb(&demo_panels(), "step", 640, 480);
        assert_eq!(pixels.get(..3), Some(&WHITE[..]));
        assert!(count_color(&pixels, WHITE) > pixels.len() / 3 / 2);
    }

    #[test]
    fn degenerate_inputs_do_not_panic() {
        let odd_points = vec![
            (f64::NAN, 1.0),
            (1.0, f64::INFINITY),
            (2.0, f64::NEG_INFINITY),
            (3.0, f64::NAN),
            (f64::MAX, f64::MIN),
            (4.0, 1e300),
        ];
        let cases: Vec<Vec<Panel>> = vec![
            Vec::new(),
            vec![panel("", Vec::new())],
            vec![panel("empty", vec![series("", BLUE, Vec::new())])],
            vec![panel("nan", vec![series("nan", BLUE, odd_points.clone())])],
            vec![panel(
                "mixed",
                vec![series(
                    "m",
                    BLUE,
                    [odd_points, rising(5, 0.0, 1.0)].concat(),
                )],
            )],
            vec![panel("single", vec![series("one", BLUE, vec![(7.0, 0.5)])])],
            vec![panel(
                "constant",
                vec![series("c", BLUE, vec![(0.0, 2.0), (1.0, 2.0)])],
            )],
            vec![panel(
                "zero",
                vec![series("z", BLUE, vec![(0.0, 0.0), (0.0, 0.0)])],
            )],
            vec![panel(
                "tiny",
                vec![series("t", BLUE, vec![(1e-300, 1e-300), (2e-300, 3e-300)])],
            )],
            vec![panel(
                "huge",
                vec![series("h", BLUE, vec![(-1e100, 1e100), (1e100, -1e100)])],
            )],
            vec![panel(
                "close",
                vec![series("c", BLUE, vec![(0.0, 1.0), (1.0, 1.0 + 1e-12)])],
            )],
            vec![panel(
                &"long title ".repeat(50),
                vec![series(&"label ".repeat(40), BLUE, rising(3, 0.0, 1.0))],
            )],
            (0..300)
                .map(|_| panel("many", vec![series("s", BLUE, rising(3, 0.0, 1.0))]))
                .collect(),
        ];
        for panels in &cases {
            for (width, height) in [(0, 0), (200, 150), (640, 480), (1200, 300)] {
                let pixels = render_rgb(panels, "x \u{1F600} ünïcode", width, height);
                let (width, height) = clamp_size(width, height);
                assert_eq!(pixels.len(), width as usize * height as usize * 3);
            }
        }
    }

    fn assert_nice(axis: &Axis, min: f64, max: f64) {
        let count = axis.ticks.len();
        assert!(
            (MIN_TICKS..=MAX_TICKS).contains(&count),
            "{min}..{max}: {axis:?}"
        );
        assert!(axis.lo <= min && max <= axis.hi, "{min}..{max}: {axis:?}");
        let mantissa = axis.step / 10f64.powf(axis.step.log10().floor());
        let nice = [1.0, 2.0, 2.5, 5.0, 10.0]
            .iter()
            .any(|m| (m - mantissa).abs() < 1e-9);
        assert!(nice, "{min}..{max}: step {}", axis.step);
    }

    #[test]
    fn axes_have_four_to_six_nice_ticks() {
        let ranges = [
            (0.3, 0.8),
            (0.0, 1.0),
            (-5.0, 5.0),
            (9e3, 14e3),
            (1e-7, 3e-7),
            (123.0, 124.5),
        ];
        let spans = (0..200).map(|i| 1.37f64.powi(i - 100));
        let shifted = spans.flat_map(|span| [(0.0, span), (-span, 0.0), (span / 3.0, 2.0 * span)]);
        for (min, max) in ranges.into_iter().chain(shifted) {
            assert_nice(&Axis::fit([min, max].into_iter(), false), min, max);
        }
    }

    #[test]
    fn integral_axes_have_integer_ticks() {
        for span in (3..300).chain([999, 1000, 12_345, 1_000_000]) {
            for min in [0, 1, -7, 1000] {
                let (min, max) = (f64::from(min), f64::from(min + span));
                let axis = Axis::fit([min, max].into_iter(), true);
                assert_nice(&axis, min, max);
                assert!(
                    axis.ticks.iter().all(|tick| tick.fract() == 0.0),
                    "{axis:?}"
                );
            }
        }
        for values in [vec![5.0], vec![0.0, 1.0], vec![0.0, 2.0]] {
            let axis = Axis::fit(values.into_iter(), true);
            assert!(!axis.ticks.is_empty(), "{axis:?}");
            assert!(
                axis.ticks.iter().all(|tick| tick.fract() == 0.0),
                "{axis:?}"
            );
        }
    }

    #[test]
    fn constant_and_empty_axes_have_width() {
        for values in [vec![], vec![0.0], vec![2.0, 2.0], vec![-1e-200]] {
            let axis = Axis::fit(values.into_iter(), false);
            assert!(
                axis.lo < axis.hi && axis.fraction(axis.lo).is_finite(),
                "{axis:?}"
            );
        }
    }

    #[test]
    fn tick_labels_are_compact() {
        assert_eq!(
            format_ticks(&[0.0, 0.25, 0.5, 0.75, 1.0], 0.25),
            ["0", "0.25", "0.5", "0.75", "1"]
        );
        assert_eq!(
            format_ticks(&[0.0, 500.0, 1000.0, 1500.0], 500.0),
            ["0", "500", "1000", "1500"]
        );
        assert_eq!(
            format_ticks(&[10e3, 12e3, 14e3], 2e3),
            ["10k", "12k", "14k"]
        );
        assert_eq!(
            format_ticks(&[0.0, 5e3, 10e3, 15e3], 5e3),
            ["0", "5k", "10k", "15k"]
        );
        assert_eq!(format_ticks(&[1e4, 1.5e4, 2e4], 5e3), ["10k", "15k", "20k"]);
        assert_eq!(
            format_ticks(&[2.5e6, 5e6, 7.5e6, 10e6], 2.5e6),
            ["2.5M", "5M", "7.5M", "10M"]
        );
        assert_eq!(format_ticks(&[-0.1, 0.0, 0.1], 0.1), ["-0.1", "0", "0.1"]);
        assert_eq!(
            format_ticks(&[-2e6, 0.0, 2e6, 4e6, 6e6], 2e6),
            ["-2M", "0", "2M", "4M", "6M"]
        );
        assert_eq!(
            format_ticks(&[0.0, 5e5, 1e6, 1.5e6], 5e5),
            ["0", "0.5M", "1M", "1.5M"]
        );
        assert_eq!(
            format_ticks(&[0.0, 2e12, 4e12], 2e12),
            ["0", "2e12", "4e12"]
        );
        assert_eq!(
            format_ticks(&[2e-5, 4e-5, 6e-5], 2e-5),
            ["2e-5", "4e-5", "6e-5"]
        );
    }

    #[test]
    fn unknown_characters_use_the_fallback_glyph() {
        assert_eq!(glyph('a'), glyph('A'));
        assert_eq!(glyph('\u{e9}'), UNKNOWN_GLYPH);
        assert_eq!(text_width("", 2), 0);
        assert_eq!(text_width("ab", 1), 11);
    }

    #[test]
    fn fit_text_keeps_the_longest_fitting_prefix() {
        assert_eq!(fit_text("reward", 1000, 2), "reward");
        assert_eq!(fit_text("reward", text_width("rew", 2), 2), "rew");
        assert_eq!(fit_text("reward", text_width("rew", 2) - 1, 2), "re");
        assert_eq!(fit_text("\u{e9}t\u{e9}", text_width("xx", 1), 1), "\u{e9}t");
        assert_eq!(fit_text("reward", 0, 1), "");
        assert_eq!(fit_text("reward", -50, 1), "");
    }

    #[test]
    fn render_png_writes_a_decodable_png() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("plot.png");
        render_png(&demo_panels(), "step", 640, 480, &path)?;

        let bytes = std::fs::read(&path)?;
        assert_eq!(
            bytes.get(..8),
            Some(&[0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A][..])
        );
        let mut reader = png::Decoder::new(io::Cursor::new(bytes)).read_info()?;
        let mut decoded = vec![0; reader.output_buffer_size().ok_or("no buffer size")?];
        let info = reader.next_frame(&mut decoded)?;
        assert_eq!((info.width, info.height), (640, 480));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(
            decoded.get(..info.buffer_size()),
            Some(&render_rgb(&demo_panels(), "step", 640, 480)[..])
        );
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())?.collect::<Result<_, _>>()?;
        assert_eq!(leftovers.len(), 1, "temporary file left behind");
        Ok(())
    }

    #[test]
    fn render_png_reports_the_path_on_io_errors() {
        let missing = Path::new("/nonexistent-starling-dir/plot.png");
        let error = render_png(&demo_panels(), "step", 640, 480, missing);
        match error {
            Err(PlotError::Io { path, .. }) => assert_eq!(path, missing.display().to_string()),
            other => panic!("expected an I/O error, got {other:?}"),
        }
    }
}
