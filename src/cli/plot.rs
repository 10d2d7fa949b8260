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
