//! `simulate --plot`: a PNG of the bytes each iteration sends, one line
//! per method, as in the SPP paper's figures 4–7, with the line below
//! which the rest fits the downtime limit.

use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;
use tsubame_trace::simulate::SimResult;

/// Where TrueType fonts usually are (Debian's fonts-dejavu-core first).
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
];

fn register_font() -> anyhow::Result<()> {
    let bytes = FONTS.iter().find_map(|p| std::fs::read(p).ok()).ok_or_else(|| {
        anyhow!("--plot needs a TrueType font and found none (install one, e.g. apt install fonts-dejavu-core)")
    })?;
    // Registered once per process; plotters keeps a 'static reference.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("--plot: the font file could not be read"))
}

const COLORS: [RGBColor; 3] = [RGBColor(31, 119, 180), RGBColor(255, 127, 14), RGBColor(44, 160, 44)];

/// Draws `results` into a PNG at `path`. `limit_bytes`: what fits in the
/// downtime limit at the simulated bandwidth.
pub fn iterations_png(path: &Path, title: &str, results: &[SimResult], limit_bytes: f64) -> anyhow::Result<()> {
    register_font()?;
    let mib = |b: f64| (b / (1 << 20) as f64).max(0.01);
    let rows = results.iter().map(|r| r.iterations.len()).max().unwrap_or(1).max(2);
    let top = results.iter().flat_map(|r| &r.iterations).map(|i| mib(i.bytes)).fold(mib(limit_bytes), f64::max);
    let bottom = results
        .iter()
        .flat_map(|r| &r.iterations)
        .map(|i| mib(i.bytes))
        .fold(mib(limit_bytes), f64::min)
        .min(top / 10.0);
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(72)
            // From a power of ten: plotters labels a log axis from the
            // first power of ten inside it.
            .build_cartesian_2d(0f64..(rows - 1) as f64, (10f64.powf(bottom.log10().floor())..top * 1.5).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("iteration (the last is stop-and-copy)")
            .y_desc("MiB sent in the iteration")
            .x_labels(rows.min(25))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| if *y >= 10.0 { format!("{y:.0}") } else { format!("{y:.2}") })
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17))
            .draw()?;
        let limit = mib(limit_bytes);
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, limit), ((rows - 1) as f64, limit)],
                6,
                4,
                ShapeStyle::from(&BLACK.mix(0.6)).stroke_width(1),
            ))?
            .label("fits the downtime limit")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 24, y)], BLACK.mix(0.6)));
        for (r, color) in results.iter().zip(COLORS.iter().cycle()) {
            let points: Vec<(f64, f64)> = r.iterations.iter().map(|i| (i.index as f64, mib(i.bytes))).collect();
            let outcome =
                if r.converged { "converged".to_string() } else { format!("not converged, {}", r.stop_reason) };
            let label = format!(
                "{}: {} iterations, {:.1} s, downtime {:.0} ms ({outcome})",
                r.method.name(),
                r.iterations.len(),
                r.total_time_s,
                r.downtime_s * 1e3
            );
            let style = ShapeStyle::from(color).stroke_width(3);
            chart
                .draw_series(LineSeries::new(points.clone(), style))?
                .label(label)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], ShapeStyle::from(color).stroke_width(3)));
            chart.draw_series(points.into_iter().map(|p| Circle::new(p, 4, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 15))
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow!("--plot {}: {e}", path.display()))
}
