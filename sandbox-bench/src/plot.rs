//! SVG plots (plotters' SVG backend: text is SVG `<text>`, no font library needed).

use std::path::Path;

use plotters::prelude::*;

use crate::run::TargetReport;
use crate::BenchError;

/// The plot files, in report order: (file name, title).
pub const PLOTS: [(&str, &str); 4] = [
    (
        "latency_cdf.svg",
        "Turn latency CDF (largest N run per target)",
    ),
    (
        "latency_vs_sessions.svg",
        "p50 and p95 turn latency vs concurrent sessions",
    ),
    (
        "memory_per_session.svg",
        "PSS per live session vs concurrent sessions",
    ),
    ("density.svg", "Live idle sandboxes held before a limit"),
];

fn err(file: &str, e: impl std::fmt::Display) -> BenchError {
    BenchError::Plot {
        file: file.to_string(),
        reason: e.to_string(),
    }
}

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    C[i % C.len()]
}

/// Writes every plot of [`PLOTS`] into `dir`.
///
/// # Errors
/// A plot that cannot be drawn or written.
pub fn write_all(dir: &Path, targets: &[TargetReport]) -> Result<(), BenchError> {
    latency_cdf(&dir.join(PLOTS[0].0), targets)?;
    latency_vs_sessions(&dir.join(PLOTS[1].0), targets)?;
    memory(&dir.join(PLOTS[2].0), targets)?;
    density(&dir.join(PLOTS[3].0), targets)?;
    Ok(())
}

fn name(p: &Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn latency_cdf(path: &Path, targets: &[TargetReport]) -> Result<(), BenchError> {
    let f = name(path);
    let series: Vec<(String, Vec<(f64, f64)>)> = targets
        .iter()
        .filter_map(|t| {
            let s = t
                .scales
                .iter()
                .rev()
                .find(|s| !s.latency_samples_us.is_empty())?;
            let mut v: Vec<u64> = s.latency_samples_us.clone();
            v.sort_unstable();
            let n = v.len() as f64;
            let pts = v
                .iter()
                .enumerate()
                .map(|(i, us)| ((*us as f64 / 1000.0).max(0.001), (i + 1) as f64 / n))
                .collect();
            Some((format!("{} (N={})", t.name, s.sessions), pts))
        })
        .collect();
    let (lo, hi) = bounds(series.iter().flat_map(|(_, p)| p.iter().map(|x| x.0)));
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&f, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(PLOTS[0].1, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1f64)
        .map_err(|e| err(&f, e))?;
    chart
        .configure_mesh()
        .x_desc("turn latency, ms (log)")
        .y_desc("fraction of turns")
        .draw()
        .map_err(|e| err(&f, e))?;
    for (i, (label, pts)) in series.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(|e| err(&f, e))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    legend(&mut chart, &f)?;
    root.present().map_err(|e| err(&f, e))
}

fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::MAX, f64::MIN);
    for v in values {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if lo > hi {
        return (0.01, 1.0);
    }
    let lo = (lo * 0.8).max(0.001);
    let hi = (hi * 1.25).max(lo * 10.0);
    (lo, hi)
}

fn legend<'a, DB: DrawingBackend + 'a, X: Ranged, Y: Ranged>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
    f: &str,
) -> Result<(), BenchError>
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| err(f, e))
}

fn latency_vs_sessions(path: &Path, targets: &[TargetReport]) -> Result<(), BenchError> {
    let f = name(path);
    let pts = |t: &TargetReport, p95: bool| -> Vec<(f64, f64)> {
        t.scales
            .iter()
            .filter(|s| s.latency.count > 0)
            .map(|s| {
                let v = if p95 { s.latency.p95 } else { s.latency.p50 };
                (s.sessions as f64, v.max(0.001))
            })
            .collect()
    };
    let all: Vec<(f64, f64)> = targets
        .iter()
        .flat_map(|t| pts(t, true).into_iter().chain(pts(t, false)))
        .collect();
    let (ylo, yhi) = bounds(all.iter().map(|p| p.1));
    let xhi = all.iter().map(|p| p.0).fold(1.0, f64::max) * 1.5;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&f, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(PLOTS[1].1, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((0.8f64..xhi).log_scale(), (ylo..yhi).log_scale())
        .map_err(|e| err(&f, e))?;
    chart
        .configure_mesh()
        .x_desc("concurrent sessions (log)")
        .y_desc("turn latency, ms (log); solid p50, thin + dots p95")
        .draw()
        .map_err(|e| err(&f, e))?;
    for (i, t) in targets.iter().enumerate() {
        let c = color(i);
        let p50 = pts(t, false);
        if p50.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(p50.iter().copied(), c.stroke_width(2)))
            .map_err(|e| err(&f, e))?
            .label(t.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        let p95 = pts(t, true);
        chart
            .draw_series(LineSeries::new(p95.iter().copied(), c.stroke_width(1)))
            .map_err(|e| err(&f, e))?;
        chart
            .draw_series(p95.iter().map(|p| Circle::new(*p, 3, c.filled())))
            .map_err(|e| err(&f, e))?;
    }
    legend(&mut chart, &f)?;
    root.present().map_err(|e| err(&f, e))
}

fn memory(path: &Path, targets: &[TargetReport]) -> Result<(), BenchError> {
    let f = name(path);
    let pts = |t: &TargetReport, busy: bool| -> Vec<(f64, f64)> {
        t.scales
            .iter()
            .filter(|s| s.opened > 0)
            .map(|s| {
                let v = if busy {
                    s.busy_mib_per_session
                } else {
                    s.idle_mib_per_session
                };
                (s.sessions as f64, v)
            })
            .collect()
    };
    let all: Vec<(f64, f64)> = targets
        .iter()
        .flat_map(|t| pts(t, true).into_iter().chain(pts(t, false)))
        .collect();
    let yhi = all.iter().map(|p| p.1).fold(1.0, f64::max) * 1.15;
    let xhi = all.iter().map(|p| p.0).fold(1.0, f64::max) * 1.5;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&f, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(PLOTS[2].1, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((0.8f64..xhi).log_scale(), 0f64..yhi)
        .map_err(|e| err(&f, e))?;
    chart
        .configure_mesh()
        .x_desc("concurrent sessions (log)")
        .y_desc("MiB PSS per session; solid busy (peak), dots idle")
        .draw()
        .map_err(|e| err(&f, e))?;
    for (i, t) in targets.iter().enumerate() {
        let c = color(i);
        let busy = pts(t, true);
        if busy.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(busy.iter().copied(), c.stroke_width(2)))
            .map_err(|e| err(&f, e))?
            .label(t.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(
                pts(t, false)
                    .into_iter()
                    .map(|p| Circle::new(p, 4, c.filled())),
            )
            .map_err(|e| err(&f, e))?;
    }
    legend(&mut chart, &f)?;
    root.present().map_err(|e| err(&f, e))
}

fn density(path: &Path, targets: &[TargetReport]) -> Result<(), BenchError> {
    let f = name(path);
    let bars: Vec<(String, usize)> = targets
        .iter()
        .filter_map(|t| match &t.density {
            Some(Ok(d)) => Some((t.name.clone(), d.held)),
            _ => None,
        })
        .collect();
    let n = bars.len().max(1);
    let yhi = bars.iter().map(|b| b.1).max().unwrap_or(1).max(1) as f64 * 1.15;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&f, e))?;
    let labels: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(PLOTS[3].1, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..yhi)
        .map_err(|e| err(&f, e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 0.01 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("live idle sandboxes (see the report for each limit)")
        .draw()
        .map_err(|e| err(&f, e))?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, b)| {
            let x = i as f64;
            Rectangle::new([(x - 0.3, 0.0), (x + 0.3, b.1 as f64)], color(i).filled())
        }))
        .map_err(|e| err(&f, e))?;
    root.present().map_err(|e| err(&f, e))
}
