//! The loss curve of a run as a PNG (plotters, with a bundled font so no
//! system font library is needed).

use std::path::Path;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::cli::error::CliError;

static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// Draws training losses (one per step) and validation points `(step, loss)`.
pub fn loss_png(path: &Path, train: &[f64], val: &[(u64, f64)]) -> Result<(), CliError> {
    let err = |e: &dyn std::fmt::Display| CliError::io("cannot draw", path, e);
    // Registering twice is harmless; plotters keeps the first font per family.
    let _ = register_font("sans-serif", FontStyle::Normal, FONT);
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let finite = train
        .iter()
        .chain(val.iter().map(|(_, v)| v))
        .copied()
        .filter(|v| v.is_finite());
    let (lo, hi) = finite.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (lo, hi) = if lo > hi {
        (0.0, 1.0)
    } else {
        ((lo - 0.1).max(0.0), hi + 0.1)
    };
    let steps = train.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption("foldmoe: loss (nats per byte)", ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(1f64..steps.max(2.0), lo..hi)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(
            train.iter().enumerate().map(|(i, &l)| (i as f64 + 1.0, l)),
            &BLUE,
        ))
        .map_err(|e| err(&e))?
        .label("train")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    chart
        .draw_series(LineSeries::new(
            val.iter().map(|&(s, l)| (s as f64, l)),
            RED.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label("validation")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// The colour of a cell `ratio` times its layer's mean load: blue for idle,
/// white for the mean, red for `top` times the mean or more.
fn load_colour(ratio: f64, top: f64) -> RGBColor {
    let mix = |a: f64, b: f64, t: f64| (a + (b - a) * t.clamp(0.0, 1.0)).round() as u8;
    if ratio <= 1.0 {
        RGBColor(mix(40.0, 255.0, ratio), mix(90.0, 255.0, ratio), 255)
    } else {
        let t = (ratio - 1.0) / (top - 1.0).max(1e-9);
        RGBColor(255, mix(255.0, 40.0, t), mix(255.0, 40.0, t))
    }
}

/// Draws the layer × expert heatmap of tokens routed over a run of `steps`
/// steps: one row per MoE layer, a cell per expert coloured by its tokens
/// over the layer's mean (white: balanced), with the colour scale beside it.
pub fn load_heatmap_png(
    path: &Path,
    loads: &[crate::cli::report::LayerTotal],
    steps: usize,
) -> Result<(), CliError> {
    let err = |e: &dyn std::fmt::Display| CliError::io("cannot draw", path, e);
    let _ = register_font("sans-serif", FontStyle::Normal, FONT);
    let experts = loads
        .iter()
        .map(|l| l.tokens.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let rows = loads.len().max(1);
    let height = (160 + 36 * rows).clamp(300, 1400) as u32;
    let root = BitMapBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let ratios: Vec<Vec<f64>> = loads
        .iter()
        .map(|l| {
            let mean = l.tokens.iter().sum::<u64>() as f64 / l.tokens.len().max(1) as f64;
            l.tokens
                .iter()
                .map(|&t| if mean > 0.0 { t as f64 / mean } else { 1.0 })
                .collect()
        })
        .collect();
    let top = ratios.iter().flatten().copied().fold(2.0f64, f64::max);
    let (left, right) = root.split_horizontally(880);
    // Cell i spans i ± 0.5, so the integer ticks fall on cell centres; the
    // first layer is the top row.
    let (e, r) = (experts as f64, rows as f64);
    let mut chart = ChartBuilder::on(&left)
        .caption(
            format!(
                "foldmoe: tokens routed per expert over {steps} steps, against the layer's mean"
            ),
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(-0.5..e - 0.5, r - 0.5..-0.5)
        .map_err(|e| err(&e))?;
    // The index a tick names, when it falls on a cell's centre.
    let index = |v: f64, n: usize| {
        let i = v.round();
        ((v - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < n).then_some(i as usize)
    };
    let layer_of = |v: &f64| {
        index(*v, rows)
            .and_then(|i| loads.get(i))
            .map_or(String::new(), |l| format!("layer {}", l.layer))
    };
    let expert_of = |v: &f64| index(*v, experts).map_or(String::new(), |i| i.to_string());
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("expert")
        .x_labels(experts.min(32))
        .y_labels(rows)
        .x_label_formatter(&expert_of)
        .y_label_formatter(&layer_of)
        .draw()
        .map_err(|e| err(&e))?;
    let cells = ratios.iter().enumerate().flat_map(|(row, r)| {
        r.iter().enumerate().map(move |(e, &ratio)| {
            let (x, y) = (e as f64, row as f64);
            Rectangle::new(
                [(x - 0.5, y - 0.5), (x + 0.5, y + 0.5)],
                load_colour(ratio, top).filled(),
            )
        })
    });
    chart.draw_series(cells).map_err(|e| err(&e))?;
    // The colour scale: 0 (idle) at the bottom to `top` × the mean.
    let (_, h) = right.dim_in_pixel();
    let (y0, y1) = (60i32, h as i32 - 60);
    let steps_px = (y1 - y0).max(1);
    for px in 0..steps_px {
        let ratio = top * f64::from(steps_px - px) / f64::from(steps_px);
        right
            .draw(&Rectangle::new(
                [(20, y0 + px), (50, y0 + px + 1)],
                load_colour(ratio, top).filled(),
            ))
            .map_err(|e| err(&e))?;
    }
    let label_at = |ratio: f64| y0 + ((1.0 - ratio / top) * f64::from(steps_px)) as i32;
    for (ratio, text) in [
        (top, format!("{top:.1}×")),
        (1.0, "1× (mean)".to_string()),
        (0.0, "0 (idle)".to_string()),
    ] {
        right
            .draw(&Text::new(
                text,
                (56, label_at(ratio) - 7),
                ("sans-serif", 14).into_font(),
            ))
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_colours_run_blue_white_red() {
        assert_eq!(load_colour(1.0, 3.0), RGBColor(255, 255, 255));
        assert_eq!(load_colour(0.0, 3.0), RGBColor(40, 90, 255));
        assert_eq!(load_colour(3.0, 3.0), RGBColor(255, 40, 40));
        assert_eq!(load_colour(9.0, 3.0), RGBColor(255, 40, 40));
    }
}
