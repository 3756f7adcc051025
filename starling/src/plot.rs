//! PNG line charts for the summaries of `starling demo` (`demo.rs`) and of the real run
//! (`real.rs`): reward, throughput, step and transfer times over training steps, one panel per
//! quantity, stacked vertically, sharing one x axis label at the bottom.
//!
//! A thin layer over [`plotters`]: [`Panel`]s and [`Series`] become plotters charts drawn into an
//! RGB buffer (`BitMapBackend`), which the `png` crate encodes and [`render_png`] writes to a
//! temporary file renamed into place, so that readers never see half an image (plotters' own
//! encoder would pull in the `image` crate and write in place). Text is DejaVu Sans, embedded in
//! the binary (`starling/assets/fonts/`, with its license) and registered with plotters'
//! `ab_glyph` backend: CI machines and fresh containers usually have no fonts, and no system
//! font or fontconfig is needed.
//!
//! What plotters does not decide is decided here: the axis ranges (padded; a constant or empty
//! range is widened so it never has zero width; steps are whole numbers when every x is), the
//! tick labels (compact: `0.25`, `12k`, `2.5M`), and the legend, which goes above each chart,
//! right-aligned, on the title's line when both fit and on as many lines of its own as its
//! entries need otherwise (plotters' legend is a box over the plot that hides the lines).
//!
//! Rendering never panics: points with a NaN, infinite or absurdly large (beyond ±1e100)
//! coordinate are skipped and break the line there, empty series and panels are drawn as empty
//! charts, a panel whose share of the image is too small for a chart keeps only its title and
//! legend (or nothing, if even those do not fit), and the image size is clamped to at least
//! 200×150 and at most 8192×8192.

use std::ffi::OsString;
use std::io::{self, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::backend::BitMapBackend;
use plotters::chart::{ChartBuilder, ChartContext};
use plotters::coord::Shift;
use plotters::coord::cartesian::Cartesian2d;
use plotters::coord::ranged1d::Ranged;
use plotters::coord::types::RangedCoordf64;
use plotters::drawing::{DrawingArea, DrawingAreaErrorKind, IntoDrawingArea};
use plotters::element::{Circle, Rectangle, Text};
use plotters::series::LineSeries;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{Color, FontStyle, IntoFont, RGBColor, TextStyle};

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
    #[error("draw the plot: {0}")]
    Draw(String),
    #[error("the embedded font (starling/assets/fonts/DejaVuSans.ttf) does not parse")]
    Font,
}

impl<E: std::error::Error + Send + Sync> From<DrawingAreaErrorKind<E>> for PlotError {
    fn from(error: DrawingAreaErrorKind<E>) -> Self {
        Self::Draw(error.to_string())
    }
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
    let pixels = render_rgb(panels, x_label, width, height)?;
    let png = encode_png(&pixels, width, height)?;
    write_atomically(path, &png)
}

/// The same image as raw RGB8 pixels (row-major, width*height*3).
///
/// `width` and `height` are clamped to 200..=8192 and 150..=8192; the buffer
/// has the clamped size.
pub(crate) fn render_rgb(
    panels: &[Panel],
    x_label: &str,
    width: u32,
    height: u32,
) -> Result<Vec<u8>, PlotError> {
    let (width, height) = clamp_size(width, height);
    register_font()?;
    let mut pixels = vec![0; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (width, height)).into_drawing_area();
        root.fill(&BACKGROUND)?;
        draw_page(&root, panels, x_label)?;
        root.present()?;
    }
    Ok(pixels)
}

// ---------------------------------------------------------------------------
// Constants and sizes
// ---------------------------------------------------------------------------

const MIN_WIDTH: u32 = 200;
const MIN_HEIGHT: u32 = 150;
/// Keeps the buffer (at most 8192² × 3 bytes = 192 MiB) allocatable.
const MAX_SIDE: u32 = 8192;

const BACKGROUND: RGBColor = RGBColor(255, 255, 255);
const INK: RGBColor = RGBColor(34, 34, 34);
const MUTED: RGBColor = RGBColor(110, 110, 110);
const GRID: RGBColor = RGBColor(228, 228, 228);

/// The family the embedded font is registered under: plotters' default, so
/// that any text plotters styles itself finds it too.
const FONT_FAMILY: &str = "sans-serif";
static DEJAVU_SANS: &[u8] = include_bytes!("../assets/fonts/DejaVuSans.ttf");

/// Lines are 2 px wide whatever the text size.
const LINE_WIDTH: u32 = 2;
/// The legend's colour swatches are this many pixels tall.
const SWATCH_HEIGHT: i32 = 3;
/// Series with fewer points than this get a marker at each point.
const MARKER_LIMIT: usize = 40;
const NO_DATA: &str = "no data";

/// Coordinates beyond this magnitude are skipped.
const MAX_ABS: f64 = 1e100;
/// Fraction of the data span added on each side of an axis.
const AXIS_MARGIN: f64 = 0.05;
/// Spans smaller than this fraction of the values' magnitude count as constant.
const MIN_RELATIVE_SPAN: f64 = 1e-6;
/// Spans (and constants) smaller than this count as zero.
const MIN_SPAN: f64 = 1e-100;
const MAX_DECIMALS: usize = 9;

fn clamp_size(width: u32, height: u32) -> (u32, u32) {
    (
        width.clamp(MIN_WIDTH, MAX_SIDE),
        height.clamp(MIN_HEIGHT, MAX_SIDE),
    )
}

/// Registers the embedded font with plotters, once per process.
fn register_font() -> Result<(), PlotError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let registered = REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, DEJAVU_SANS).is_ok()
    });
    if *registered {
        Ok(())
    } else {
        Err(PlotError::Font)
    }
}

/// Every size derives from the text size, larger on images that can afford it.
#[derive(Debug, Clone, Copy)]
struct Metrics {
    font_px: i32,
}

impl Metrics {
    fn choose(width: u32, height: u32, panel_count: usize) -> Self {
        let per_panel = height as usize / panel_count.max(1);
        let large = width >= 560 && per_panel >= 200;
        Self {
            font_px: if large { 16 } else { 11 },
        }
    }

    fn text(self) -> TextStyle<'static> {
        (FONT_FAMILY, self.font_px).into_font().color(&INK)
    }

    /// The height of a line of text, leading included.
    fn line(self) -> i32 {
        self.font_px * 3 / 2
    }

    /// Where a line's text is anchored below the line's top: plotters' `ab_glyph`
    /// backend draws the glyphs' tops about an eighth of the size above the anchor.
    fn text_offset(self) -> i32 {
        self.font_px / 4
    }

    fn gap(self) -> i32 {
        (self.font_px / 3).max(2)
    }

    fn margin(self) -> i32 {
        self.font_px / 2
    }

    fn tick(self) -> i32 {
        (self.font_px / 4).max(2)
    }

    fn swatch_width(self) -> i32 {
        self.font_px * 3 / 2
    }

    /// Between legend entries, and between the title and the legend.
    fn legend_spacing(self) -> i32 {
        self.font_px * 3 / 2
    }

    fn marker_radius(self) -> i32 {
        2 + self.font_px / 12
    }

    /// Below a chart's x tick labels, before the next panel's title.
    fn panel_spacing(self) -> i32 {
        self.font_px
    }
}

type Area<'b> = DrawingArea<BitMapBackend<'b>, Shift>;
type Chart2d<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Text width in pixels as plotters will draw it.
fn text_width(area: &Area<'_>, style: &TextStyle<'_>, text: &str) -> Result<i32, PlotError> {
    let (width, _) = area.estimate_text_size(text, style)?;
    Ok(i32::try_from(width).unwrap_or(i32::MAX))
}

/// The longest prefix of `text` (whole characters) no wider than `max`.
fn fit_text(
    text: &str,
    max: i32,
    width: impl Fn(&str) -> Result<i32, PlotError>,
) -> Result<&str, PlotError> {
    if width(text)? <= max {
        return Ok(text);
    }
    let mut fitted = "";
    for (end, ch) in text.char_indices() {
        let prefix = &text[..end + ch.len_utf8()];
        if width(prefix)? > max {
            break;
        }
        fitted = prefix;
    }
    Ok(fitted)
}

// ---------------------------------------------------------------------------
// Page layout
// ---------------------------------------------------------------------------

/// A panel with its fitted y axis.
#[derive(Debug)]
struct Chart<'a> {
    panel: &'a Panel,
    y_axis: Axis,
}

impl Chart<'_> {
    fn has_data(&self) -> bool {
        self.panel
            .series
            .iter()
            .any(|series| plottable_points(series).next().is_some())
    }
}

/// The horizontal layout every panel shares, so that their x axes line up.
#[derive(Debug, Clone, Copy)]
struct Columns {
    /// Left of the y tick labels and the y label.
    y_area: i32,
    plot_left: i32,
    plot_right: i32,
    right_margin: i32,
}

impl Columns {
    fn plot_width(self) -> i32 {
        self.plot_right - self.plot_left + 1
    }
}

fn draw_page(root: &Area<'_>, panels: &[Panel], x_label: &str) -> Result<(), PlotError> {
    let (width, height) = root.dim_in_pixel();
    let metrics = Metrics::choose(width, height, panels.len());
    let text = metrics.text();
    let measure = |s: &str| text_width(root, &text, s);
    let (width, height) = (
        i32::try_from(width).unwrap_or(i32::MAX),
        i32::try_from(height).unwrap_or(i32::MAX),
    );
    if panels.is_empty() {
        let centred = text.pos(Pos::new(HPos::Center, VPos::Center));
        root.draw_text(NO_DATA, &centred.color(&MUTED), (width / 2, height / 2))?;
        return Ok(());
    }

    let x_label_top = height - metrics.margin() - metrics.line();
    let slots_top = metrics.margin();
    let count = i32::try_from(panels.len()).unwrap_or(i32::MAX);
    let slot_height = (x_label_top - slots_top) / count;
    // At most one tick per line of the plot's height (about four lines go to the header and
    // the x tick labels); plotters' 1, 2, 5 steps usually take fewer.
    let y_ticks = usize::try_from((slot_height - 4 * metrics.line()) / metrics.line()).unwrap_or(0);
    let charts: Vec<Chart<'_>> = panels
        .iter()
        .map(|panel| Chart {
            panel,
            y_axis: Axis::fit(
                panel
                    .series
                    .iter()
                    .flat_map(plottable_points)
                    .map(|(_, y)| y),
                false,
                y_ticks.clamp(4, 6),
            ),
        })
        .collect();
    let mut y_label_width = 0;
    for chart in &charts {
        for label in chart.y_axis.labels() {
            y_label_width = y_label_width.max(measure(&label)?);
        }
    }
    let y_area = metrics.line() + metrics.gap() + y_label_width + 2 * metrics.tick();
    let plot_left = metrics.margin() + y_area;
    let x_ticks = usize::try_from((width - plot_left) / (6 * metrics.font_px)).unwrap_or(0);
    let x_axis = Axis::fit(
        all_x_values(panels),
        all_x_integral(panels),
        x_ticks.clamp(4, 10),
    );
    let mut x_label_width = 0;
    for label in x_axis.labels() {
        x_label_width = x_label_width.max(measure(&label)?);
    }
    let right_margin = metrics.margin().max(x_label_width / 2 + 1);
    let columns = Columns {
        y_area,
        plot_left,
        plot_right: width - 1 - right_margin,
        right_margin,
    };
    if columns.plot_width() < 4 * metrics.font_px {
        return Ok(());
    }

    for (index, chart) in (0..).zip(&charts) {
        let top = slots_top + index * slot_height;
        let slot = root.clone().shrink((0, top), (width, slot_height));
        draw_panel(&slot, metrics, columns, chart, &x_axis)?;
    }

    let x_label = fit_text(x_label, columns.plot_width(), measure)?;
    let at = (
        columns.plot_left + columns.plot_width() / 2,
        x_label_top + metrics.text_offset(),
    );
    root.draw_text(x_label, &text.pos(Pos::new(HPos::Center, VPos::Top)), at)?;
    Ok(())
}

/// Title and legend above the chart; the chart below them, unless the slot is
/// too small to hold one.
fn draw_panel(
    slot: &Area<'_>,
    metrics: Metrics,
    columns: Columns,
    chart: &Chart<'_>,
    x_axis: &Axis,
) -> Result<(), PlotError> {
    let (_, slot_height) = slot.dim_in_pixel();
    let slot_height = i32::try_from(slot_height).unwrap_or(i32::MAX);
    if slot_height < 2 * metrics.line() {
        return Ok(());
    }
    let header_lines = draw_header(slot, metrics, columns, chart.panel)?;
    let header = header_lines * metrics.line() + metrics.gap();
    let x_area = 2 * metrics.tick() + metrics.line();
    let chart_height = slot_height - header - metrics.panel_spacing();
    if chart_height < x_area + 2 * metrics.line() {
        return Ok(());
    }
    let (width, _) = slot.dim_in_pixel();
    let area = slot.clone().shrink((0, header), (width, chart_height));
    let y_axis = &chart.y_axis;
    let mut context = ChartBuilder::on(&area)
        .margin_left(metrics.margin())
        .margin_right(columns.right_margin)
        .x_label_area_size(x_area)
        .y_label_area_size(columns.y_area)
        .build_cartesian_2d(x_axis.lo..x_axis.hi, y_axis.lo..y_axis.hi)?;

    let text = metrics.text();
    let measure = |s: &str| text_width(slot, &text, s);
    let plot_height = chart_height - x_area;
    let y_label = fit_text(&chart.panel.y_label, plot_height, measure)?;
    let format_x = |x: &f64| x_axis.format.format(*x);
    let format_y = |y: &f64| y_axis.format.format(*y);
    context
        .configure_mesh()
        .x_labels(x_axis.max_ticks)
        .y_labels(y_axis.max_ticks)
        .x_label_formatter(&format_x)
        .y_label_formatter(&format_y)
        .max_light_lines(0)
        .bold_line_style(GRID)
        .axis_style(INK)
        .set_all_tick_mark_size(metrics.tick())
        .label_style(text.clone())
        .axis_desc_style(text.clone())
        .y_desc(y_label)
        .draw()?;

    if chart.has_data() {
        for series in &chart.panel.series {
            draw_series(&mut context, metrics, series)?;
        }
    } else {
        let centre = ((x_axis.lo + x_axis.hi) / 2.0, (y_axis.lo + y_axis.hi) / 2.0);
        let style = text.pos(Pos::new(HPos::Center, VPos::Center)).color(&MUTED);
        context
            .plotting_area()
            .draw(&Text::new(NO_DATA, centre, style))?;
    }
    Ok(())
}

/// Lines between consecutive valid points (an invalid point breaks the line),
/// plus a marker at each point when there are few of them.
fn draw_series(
    context: &mut Chart2d<'_, '_>,
    metrics: Metrics,
    series: &Series,
) -> Result<(), PlotError> {
    let [r, g, b] = series.color;
    let color = RGBColor(r, g, b);
    for run in series.points.split(|&point| !is_plottable(point)) {
        if run.len() >= 2 {
            let style = color.stroke_width(LINE_WIDTH);
            context.draw_series(LineSeries::new(run.iter().copied(), style))?;
        }
    }
    if series.points.len() < MARKER_LIMIT {
        let radius = metrics.marker_radius();
        let markers =
            plottable_points(series).map(|point| Circle::new(point, radius, color.filled()));
        context.draw_series(markers)?;
    }
    Ok(())
}

/// Draws the title and the legend at the top of the slot and returns how many
/// lines they take: the legend shares the title's line, right-aligned, when both
/// fit; otherwise it gets lines of its own below the title, right-aligned, as
/// many as its entries need (an entry wider than the plot is cut off).
fn draw_header(
    slot: &Area<'_>,
    metrics: Metrics,
    columns: Columns,
    panel: &Panel,
) -> Result<i32, PlotError> {
    let text = metrics.text();
    let measure = |s: &str| text_width(slot, &text, s);
    let line_width = columns.plot_width();
    let title = fit_text(&panel.title, line_width, measure)?;
    let label_left = metrics.swatch_width() + metrics.gap();
    let mut labels = Vec::with_capacity(panel.series.len());
    for series in &panel.series {
        labels.push(fit_text(&series.label, line_width - label_left, measure)?);
    }
    let mut widths = Vec::with_capacity(labels.len());
    for label in &labels {
        widths.push(label_left + measure(label)?);
    }
    let spacing = metrics.legend_spacing();
    let rows = legend_rows(&widths, spacing, line_width);
    let shared_line =
        rows.len() <= 1 && measure(title)? + spacing + row_width(&widths, spacing) <= line_width;
    let first_line = if shared_line { 0 } else { 1 };

    let anchored = text.pos(Pos::new(HPos::Left, VPos::Top));
    let title_at = (columns.plot_left, metrics.text_offset());
    slot.draw_text(title, &anchored, title_at)?;
    for (row, line) in rows.iter().zip(first_line..) {
        let top = line * metrics.line();
        let mut left = (columns.plot_right + 1 - row_width(&widths[row.clone()], spacing))
            .max(columns.plot_left);
        for index in row.clone() {
            let [r, g, b] = panel.series[index].color;
            let swatch_top = top + metrics.text_offset() + metrics.font_px / 4;
            // Filled rectangles exclude their bottom-right corner.
            let swatch = [
                (left, swatch_top),
                (left + metrics.swatch_width(), swatch_top + SWATCH_HEIGHT),
            ];
            slot.draw(&Rectangle::new(swatch, RGBColor(r, g, b).filled()))?;
            let label_at = (left + label_left, top + metrics.text_offset());
            slot.draw_text(labels[index], &anchored, label_at)?;
            left += widths[index] + spacing;
        }
    }
    Ok(first_line + i32::try_from(rows.len()).unwrap_or(i32::MAX).max(1))
}

/// The width of legend entries of these widths on one line.
fn row_width(widths: &[i32], spacing: i32) -> i32 {
    let count = i32::try_from(widths.len()).unwrap_or(i32::MAX);
    widths.iter().sum::<i32>() + (count - 1).max(0) * spacing
}

/// The legend's entries in lines of at most `line_width` pixels, greedily, in
/// order; an entry wider than a line gets a line of its own.
fn legend_rows(widths: &[i32], spacing: i32, line_width: i32) -> Vec<Range<usize>> {
    let mut rows = Vec::new();
    let mut start = 0;
    let mut used = 0;
    for (i, &width) in widths.iter().enumerate() {
        if i > start && used + spacing + width > line_width {
            rows.push(start..i);
            start = i;
            used = 0;
        }
        used += if i > start { spacing + width } else { width };
    }
    if start < widths.len() {
        rows.push(start..widths.len());
    }
    rows
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

fn all_x_values(panels: &[Panel]) -> impl Iterator<Item = f64> + '_ {
    panels
        .iter()
        .flat_map(|panel| &panel.series)
        .flat_map(plottable_points)
        .map(|(x, _)| x)
}

/// Whether every x is a whole number (training steps): x ticks are then
/// integers too.
fn all_x_integral(panels: &[Panel]) -> bool {
    all_x_values(panels).all(|x| x.fract().abs() < f64::EPSILON)
}

/// An axis range, the ticks plotters will put on it and their format.
///
/// Invariant: `lo < hi`, both finite.
#[derive(Debug, Clone, PartialEq)]
struct Axis {
    lo: f64,
    hi: f64,
    /// The most ticks plotters may choose (it picks 1, 2 or 5 × 10^k steps).
    max_ticks: usize,
    ticks: Vec<f64>,
    format: TickFormat,
}

impl Axis {
    /// Fits an axis around the values (which must be finite and within
    /// [`MAX_ABS`]), with a small margin; around `0..=1` when there are none.
    /// When `integral`, the bounds and the tick steps are whole numbers.
    fn fit(values: impl Iterator<Item = f64>, integral: bool, max_ticks: usize) -> Self {
        let data = data_bounds(values).unwrap_or(Bounds { lo: 0.0, hi: 1.0 });
        let Bounds { lo, hi } = padded_range(data, integral);
        let (lo, hi, max_ticks) = if integral {
            let (lo, hi) = (lo.floor(), hi.ceil());
            // Fewer ticks than whole numbers in the range keep plotters' step at 1 or more.
            let whole = (hi - lo) as usize;
            (lo, hi, max_ticks.min(whole.saturating_add(1)))
        } else {
            (lo, hi, max_ticks)
        };
        let ticks = RangedCoordf64::from(lo..hi).key_points(max_ticks);
        let step = match ticks[..] {
            [first, second, ..] => second - first,
            _ => hi - lo,
        };
        Self {
            lo,
            hi,
            max_ticks,
            format: TickFormat::new(&ticks, step),
            ticks,
        }
    }

    fn labels(&self) -> impl Iterator<Item = String> + '_ {
        self.ticks.iter().map(|&tick| self.format.format(tick))
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

/// Compact tick labels sharing one unit: `0.25`, `1500`, `12k`, `2.5M`, `4e-5`;
/// the decimals are the fewest that print every multiple of the step exactly.
#[derive(Debug, Clone, PartialEq)]
struct TickFormat {
    step: f64,
    divisor: f64,
    decimals: usize,
    suffix: String,
}

impl TickFormat {
    fn new(ticks: &[f64], step: f64) -> Self {
        let largest = ticks
            .iter()
            .fold(0.0f64, |largest, tick| largest.max(tick.abs()));
        let (divisor, suffix) = tick_unit(largest);
        Self {
            step,
            divisor,
            decimals: decimals_for(step / divisor),
            suffix,
        }
    }

    fn format(&self, tick: f64) -> String {
        if tick.abs() < self.step.abs() * 1e-6 {
            return "0".to_owned();
        }
        let digits = format!("{:.*}", self.decimals, tick / self.divisor);
        let digits = if digits.contains('.') {
            digits.trim_end_matches('0').trim_end_matches('.')
        } else {
            &digits
        };
        format!("{digits}{}", self.suffix)
    }
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
// PNG file
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

    type Rgb = [u8; 3];
    type TestResult = Result<(), Box<dyn std::error::Error>>;

    const BLUE: Rgb = [31, 119, 180];
    const ORANGE: Rgb = [255, 127, 14];
    const GREEN: Rgb = [44, 160, 44];
    const PURPLE: Rgb = [148, 103, 189];
    const WHITE: Rgb = [255, 255, 255];

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
                    series("samples/s", GREEN, rising(30, 5e3, 6e3)),
                ],
            ),
        ]
    }

    fn pixels_of(pixels: &[u8], color: Rgb) -> impl Iterator<Item = usize> + '_ {
        pixels
            .chunks_exact(3)
            .enumerate()
            .filter(move |(_, pixel)| *pixel == color)
            .map(|(index, _)| index)
    }

    fn count_color(pixels: &[u8], color: Rgb) -> usize {
        pixels_of(pixels, color).count()
    }

    #[test]
    fn image_has_the_requested_size() -> TestResult {
        let pixels = render_rgb(&demo_panels(), "step", 640, 480)?;
        assert_eq!(pixels.len(), 640 * 480 * 3);
        Ok(())
    }

    #[test]
    fn tiny_sizes_are_clamped_to_the_minimum() -> TestResult {
        for (width, height) in [(0, 0), (1, 1), (199, 149), (10_000, 1)] {
            let pixels = render_rgb(&demo_panels(), "step", width, height)?;
            let (width, height) = clamp_size(width, height);
            assert_eq!(pixels.len(), width as usize * height as usize * 3);
        }
        Ok(())
    }

    #[test]
    fn every_series_color_appears() -> TestResult {
        let pixels = render_rgb(&demo_panels(), "step", 640, 480)?;
        for color in [BLUE, ORANGE, GREEN] {
            assert!(count_color(&pixels, color) > 0, "{color:?}");
        }
        Ok(())
    }

    #[test]
    fn lines_are_drawn_beyond_the_legend() -> TestResult {
        let empty = vec![panel("p", vec![series("s", BLUE, Vec::new())])];
        let full = vec![panel("p", vec![series("s", BLUE, rising(100, 0.0, 1.0))])];
        let legend_only = count_color(&render_rgb(&empty, "x", 640, 480)?, BLUE);
        let with_line = count_color(&render_rgb(&full, "x", 640, 480)?, BLUE);
        assert!(legend_only > 0, "the legend's swatch");
        assert!(
            with_line > legend_only + 500,
            "{with_line} vs {legend_only}"
        );
        Ok(())
    }

    #[test]
    fn a_legend_too_wide_for_one_line_wraps_and_shows_every_series() -> TestResult {
        // The real run's comparison: four modes with long names (the fourth was once cut off).
        let colors = [BLUE, ORANGE, GREEN, PURPLE];
        let names = [
            "delta (round 1)",
            "no-transfer (round 1)",
            "full-broadcast (round 1)",
            "full-broadcast-exclusive (round 1)",
        ];
        let panels = vec![panel(
            "reward per step",
            names
                .iter()
                .zip(colors)
                .map(|(name, color)| series(name, color, Vec::new()))
                .collect(),
        )];
        let (width, height) = (900, 720);
        let pixels = render_rgb(&panels, "step", width, height)?;
        let metrics = Metrics::choose(width, height, 1);
        let swatch = usize::try_from(metrics.swatch_width() * SWATCH_HEIGHT)?;
        let mut rows = Vec::new();
        for color in colors {
            // No data: the colour is only in the legend, so the whole swatch is in the image.
            assert_eq!(count_color(&pixels, color), swatch, "{color:?}");
            let first = pixels_of(&pixels, color).next().ok_or("no swatch")?;
            rows.push(first / width as usize);
        }
        rows.dedup();
        assert!(
            rows.len() >= 2,
            "the legend wraps: swatches on rows {rows:?}"
        );

        let rows = legend_rows(&[300, 350, 380, 500], 24, 700);
        assert_eq!(rows, vec![0..2, 2..3, 3..4]);
        let rows = legend_rows(&[200, 250, 380, 100], 24, 700);
        assert_eq!(rows, vec![0..2, 2..4]);
        assert_eq!(legend_rows(&[800, 10, 10], 24, 700), vec![0..1, 1..3]);
        assert_eq!(legend_rows(&[100], 24, 700), vec![0..1]);
        assert!(legend_rows(&[], 24, 700).is_empty());
        assert_eq!(row_width(&[200, 250], 24), 474);
        Ok(())
    }

    #[test]
    fn background_is_white() -> TestResult {
        let pixels = render_rgb(&demo_panels(), "step", 640, 480)?;
        assert_eq!(pixels.get(..3), Some(&WHITE[..]));
        assert!(count_color(&pixels, WHITE) > pixels.len() / 3 / 2);
        Ok(())
    }

    #[test]
    fn text_is_drawn_with_the_embedded_font() -> TestResult {
        let dark = |pixels: &[u8]| {
            pixels
                .chunks_exact(3)
                .filter(|pixel| pixel.iter().all(|&channel| channel < 160))
                .count()
        };
        let untitled = render_rgb(&[panel("", Vec::new())], "", 640, 480)?;
        let titled = render_rgb(&[panel("Reward per step", Vec::new())], "step", 640, 480)?;
        assert!(
            dark(&titled) > dark(&untitled) + 100,
            "{} vs {}",
            dark(&titled),
            dark(&untitled)
        );
        Ok(())
    }

    #[test]
    fn degenerate_inputs_do_not_panic() -> TestResult {
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
                let pixels = render_rgb(panels, "x \u{1F600} ünïcode", width, height)?;
                let (width, height) = clamp_size(width, height);
                assert_eq!(pixels.len(), width as usize * height as usize * 3);
            }
        }
        Ok(())
    }

    /// 2 to `max_ticks` ticks of a 1, 2 or 5 × 10^k step, within the axis, which
    /// holds the data.
    fn assert_nice(axis: &Axis, min: f64, max: f64, max_ticks: usize) {
        let count = axis.ticks.len();
        assert!((2..=max_ticks).contains(&count), "{min}..{max}: {axis:?}");
        assert!(axis.lo <= min && max <= axis.hi, "{min}..{max}: {axis:?}");
        assert!(
            axis.ticks.iter().all(|t| (axis.lo..=axis.hi).contains(t)),
            "{axis:?}"
        );
        let step = axis.ticks[1] - axis.ticks[0];
        let mantissa = step / 10f64.powf(step.log10().floor());
        let nice = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .any(|m| (m - mantissa).abs() < 1e-6);
        assert!(nice, "{min}..{max}: step {step}");
    }

    #[test]
    fn axes_have_a_few_nice_ticks() {
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
            for max_ticks in [4, 6, 10] {
                let axis = Axis::fit([min, max].into_iter(), false, max_ticks);
                assert_nice(&axis, min, max, max_ticks);
            }
        }
    }

    #[test]
    fn integral_axes_have_integer_ticks() {
        for span in (3..300).chain([999, 1000, 12_345, 1_000_000]) {
            for min in [0, 1, -7, 1000] {
                let (min, max) = (f64::from(min), f64::from(min + span));
                let axis = Axis::fit([min, max].into_iter(), true, 10);
                assert_nice(&axis, min, max, 10);
                assert!(
                    axis.ticks.iter().all(|tick| tick.fract() == 0.0),
                    "{axis:?}"
                );
            }
        }
        for values in [vec![5.0], vec![0.0, 1.0], vec![0.0, 2.0]] {
            let axis = Axis::fit(values.into_iter(), true, 10);
            assert!(!axis.ticks.is_empty(), "{axis:?}");
            assert!(
                axis.ticks.iter().all(|tick| tick.fract() == 0.0),
                "{axis:?}"
            );
            assert_eq!(axis.labels().filter(|l| l.contains('.')).count(), 0);
        }
    }

    #[test]
    fn constant_and_empty_axes_have_width() {
        for values in [vec![], vec![0.0], vec![2.0, 2.0], vec![-1e-200]] {
            let axis = Axis::fit(values.into_iter(), false, 6);
            assert!(axis.lo < axis.hi && axis.lo.is_finite(), "{axis:?}");
            assert!(!axis.ticks.is_empty(), "{axis:?}");
        }
    }

    fn format_ticks(ticks: &[f64], step: f64) -> Vec<String> {
        let format = TickFormat::new(ticks, step);
        ticks.iter().map(|&tick| format.format(tick)).collect()
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
            format_ticks(&[0.30000000000000004, 0.4, 0.5], 0.09999999999999998),
            ["0.3", "0.4", "0.5"]
        );
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
    fn fit_text_keeps_the_longest_fitting_prefix() -> TestResult {
        let chars = |s: &str| Ok(i32::try_from(s.chars().count()).unwrap_or(i32::MAX));
        assert_eq!(fit_text("reward", 1000, chars)?, "reward");
        assert_eq!(fit_text("reward", 3, chars)?, "rew");
        assert_eq!(fit_text("\u{e9}t\u{e9}", 2, chars)?, "\u{e9}t");
        assert_eq!(fit_text("reward", 0, chars)?, "");
        assert_eq!(fit_text("reward", -50, chars)?, "");
        Ok(())
    }

    #[test]
    fn render_png_writes_a_decodable_png() -> TestResult {
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
        let decoded = decoded.get(..info.buffer_size()).ok_or("short frame")?;
        assert_eq!(decoded, &render_rgb(&demo_panels(), "step", 640, 480)?[..]);
        for color in [BLUE, ORANGE, GREEN] {
            assert!(count_color(decoded, color) > 0, "{color:?}");
        }
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
