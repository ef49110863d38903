//! `recsys sweep`'s chart: NDCG@10 loss against latency for every variant, drawn by plotters as
//! SVG (axes with units, the quality budget, the Pareto front, the recommended variant ringed) and
//! rasterised to PNG by resvg (plotters' own bitmap backend would need a font library; resvg reads
//! the SVG's text with the system fonts).

use plotters::prelude::*;

use crate::error::{CliError, Result};
use crate::output::tell;

/// Pixels of the SVG; the PNG is twice as large.
pub const WIDTH: u32 = 780;
pub const HEIGHT: u32 = 440;
/// The PNG's scale over the SVG.
const PNG_SCALE: f32 = 2.0;

/// One variant as the chart shows it.
pub struct Point<'a> {
    pub variant: &'a str,
    pub latency_ms: f64,
    /// NDCG@10 loss against fp32, in percent.
    pub loss_percent: f64,
}

/// What was drawn: the SVG, and each variant's centre in its pixels (for the test, and for
/// anyone checking the picture).
pub struct Chart {
    pub svg: String,
    /// Read by the chart's test only: where each point landed.
    #[cfg_attr(not(test), allow(dead_code))]
    pub centres: Vec<(i32, i32)>,
}

/// Indices of the variants on the Pareto front (no other is both faster and better), fastest
/// first.
fn pareto_front(points: &[Point<'_>]) -> Vec<usize> {
    let mut front: Vec<usize> = (0..points.len())
        .filter(|&i| {
            let p = &points[i];
            !points.iter().enumerate().any(|(j, q)| {
                j != i
                    && q.latency_ms <= p.latency_ms
                    && q.loss_percent <= p.loss_percent
                    && (q.latency_ms < p.latency_ms || q.loss_percent < p.loss_percent)
            })
        })
        .collect();
    front.sort_by(|&a, &b| points[a].latency_ms.total_cmp(&points[b].latency_ms));
    front
}

fn drawing_error<E: std::fmt::Display>(e: E) -> CliError {
    CliError::Input(format!("internal error: cannot draw the sweep chart: {e}"))
}

/// Draws the chart. `batch` is the batch size the latency was measured at; `budget_percent` the
/// loss the recommendation stays within; `recommended` the recommended variant's name.
pub fn draw(
    points: &[Point<'_>],
    batch: usize,
    budget_percent: f64,
    recommended: &str,
) -> Result<Chart> {
    let x_max = points
        .iter()
        .map(|p| p.latency_ms)
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.15;
    let y_min = points.iter().map(|p| p.loss_percent).fold(0.0, f64::min) - 0.1;
    let y_max = points
        .iter()
        .map(|p| p.loss_percent)
        .fold(budget_percent, f64::max)
        + 0.1;
    let front = pareto_front(points);
    let blue = RGBColor(0x33, 0x66, 0xcc);
    let grey = RGBColor(0x99, 0x99, 0x99);
    let red = RGBColor(0xcc, 0x33, 0x33);
    let mut svg = String::new();
    let mut centres = Vec::with_capacity(points.len());
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(drawing_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("NDCG@10 loss against latency at batch {batch}"),
                ("sans-serif", 18),
            )
            .margin(16)
            .margin_right(150)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..x_max, y_min..y_max)
            .map_err(drawing_error)?;
        chart
            .configure_mesh()
            .x_desc(format!("latency p50 at batch {batch} (ms)"))
            .y_desc("NDCG@10 loss vs fp32 (%)")
            .x_label_formatter(&|v| format!("{v:.3}"))
            .y_label_formatter(&|v| format!("{v:.2}"))
            .draw()
            .map_err(drawing_error)?;
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, budget_percent), (x_max, budget_percent)],
                6,
                4,
                red.stroke_width(1),
            ))
            .map_err(drawing_error)?
            .label(format!("budget {budget_percent:.2} %"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], red));
        chart
            .draw_series(LineSeries::new(
                front
                    .iter()
                    .map(|&i| (points[i].latency_ms, points[i].loss_percent)),
                blue.stroke_width(2),
            ))
            .map_err(drawing_error)?
            .label("Pareto front")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], blue.stroke_width(2)));
        for (i, p) in points.iter().enumerate() {
            let colour = if front.contains(&i) { blue } else { grey };
            // Variants often sit on top of each other: stagger the labels.
            let label_offset = (10, -14 - 13 * (i % 4) as i32);
            let at = (p.latency_ms, p.loss_percent);
            chart
                .draw_series(std::iter::once(
                    EmptyElement::at(at)
                        + Circle::new((0, 0), 5, colour.filled())
                        + Text::new(p.variant.to_string(), label_offset, ("sans-serif", 12)),
                ))
                .map_err(drawing_error)?;
            if p.variant == recommended {
                chart
                    .draw_series(std::iter::once(
                        EmptyElement::at(at)
                            + Circle::new((0, 0), 10, red.stroke_width(2))
                            + Text::new(
                                "recommended".to_string(),
                                (12, 6),
                                ("sans-serif", 11).into_font().color(&red),
                            ),
                    ))
                    .map_err(drawing_error)?;
            }
            centres.push(chart.backend_coord(&at));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(drawing_error)?;
        root.present().map_err(drawing_error)?;
    }
    Ok(Chart { svg, centres })
}

/// Rasterises the chart's SVG at twice its size. Labels need a system font; without one the PNG
/// is still written (points and lines only) and a warning says so.
pub fn png(svg: &str, what: &std::path::Path) -> Result<Vec<u8>> {
    use resvg::{tiny_skia, usvg};
    let mut options = usvg::Options::default();
    let fonts = options.fontdb_mut();
    fonts.load_system_fonts();
    // "sans-serif" maps to Arial unless told otherwise; use whatever sans face this machine has.
    let family = {
        let families: Vec<String> = fonts
            .faces()
            .flat_map(|f| f.families.iter().map(|(name, _)| name.clone()))
            .collect();
        families
            .iter()
            .find(|f| f.contains("Sans") && !f.contains("Mono"))
            .or(families.first())
            .cloned()
    };
    if let Some(family) = family {
        fonts.set_sans_serif_family(family);
    }
    if options.fontdb.is_empty() {
        tell!(
            "warning: no system fonts found; {} has no text labels (the SVG does)",
            what.display()
        );
    }
    let tree = usvg::Tree::from_str(svg, &options).map_err(drawing_error)?;
    let size = tree.size().to_int_size();
    let scale = PNG_SCALE as u32;
    let mut pixmap = tiny_skia::Pixmap::new(scale * size.width(), scale * size.height())
        .ok_or_else(|| drawing_error("an empty picture"))?;
    resvg::render(
        &tree,
        tiny_skia::Transform::from_scale(PNG_SCALE, PNG_SCALE),
        &mut pixmap.as_mut(),
    );
    pixmap.encode_png().map_err(drawing_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chart has the SVG's size and each variant's label, point and (for the recommended one)
    /// ring; in the PNG (twice the size) every variant's centre is painted in its colour.
    #[test]
    fn every_variant_is_drawn_where_its_numbers_put_it() {
        let points = [
            Point {
                variant: "fp32",
                latency_ms: 2.0,
                loss_percent: 0.0,
            },
            Point {
                variant: "fp16",
                latency_ms: 1.2,
                loss_percent: 0.05,
            },
            Point {
                variant: "int8-wo",
                latency_ms: 0.8,
                loss_percent: 0.4,
            },
            Point {
                variant: "bf16",
                latency_ms: 1.5,
                loss_percent: 0.6,
            },
        ];
        let chart = draw(&points, 64, 1.0, "int8-wo").unwrap();
        let svg = &chart.svg;
        assert!(
            svg.contains(&format!("width=\"{WIDTH}\""))
                && svg.contains(&format!("height=\"{HEIGHT}\""))
        );
        for p in &points {
            assert!(
                svg.contains(&format!("\n{}\n", p.variant)),
                "{} has no label",
                p.variant
            );
        }
        for text in [
            "recommended",
            "budget 1.00 %",
            "Pareto front",
            "(ms)",
            "(%)",
        ] {
            assert!(svg.contains(text), "{text}");
        }
        // Faster is left, a larger loss is higher (smaller y).
        let (fast, slow) = (chart.centres[2], chart.centres[0]);
        assert!(fast.0 < slow.0 && fast.1 < slow.1, "{:?}", chart.centres);

        let png = png(svg, std::path::Path::new("chart.png")).unwrap();
        let image = resvg::tiny_skia::Pixmap::decode_png(&png).unwrap();
        assert_eq!((image.width(), image.height()), (2 * WIDTH, 2 * HEIGHT));
        for (i, &(x, y)) in chart.centres.iter().enumerate() {
            let pixel = image
                .pixel(2 * x as u32, 2 * y as u32)
                .unwrap()
                .demultiply();
            // bf16 (slower and worse than fp16) is off the front: grey; the others are blue.
            let want = if i == 3 {
                (0x99, 0x99, 0x99)
            } else {
                (0x33, 0x66, 0xcc)
            };
            assert_eq!(
                (pixel.red(), pixel.green(), pixel.blue()),
                want,
                "{} at {x},{y}",
                points[i].variant
            );
        }
    }
}
