//! Central finite-difference gradient checks in f64, used by every op's and
//! layer's `*_grad` test (kernels and engine alike).

/// Central differences `(f(x + h·e_i) - f(x - h·e_i)) / 2h` for every `i`.
pub fn numeric_grad(x: &[f64], h: f64, mut f: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    let mut xs = x.to_vec();
    (0..x.len())
        .map(|i| {
            let orig = xs[i];
            xs[i] = orig + h;
            let fp = f(&xs);
            xs[i] = orig - h;
            let fm = f(&xs);
            xs[i] = orig;
            (fp - fm) / (2.0 * h)
        })
        .collect()
}

/// Relative error `max|a - n| / max(max|n|, floor)`: the worst deviation
/// measured against the gradient's own scale (a per-element ratio would blow
/// up on entries that are zero up to rounding).
pub fn relative_error(analytic: &[f64], numeric: &[f64]) -> f64 {
    assert_eq!(analytic.len(), numeric.len(), "gradient lengths differ");
    let scale = numeric
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(1e-12);
    let worst = analytic
        .iter()
        .zip(numeric)
        .fold(0.0f64, |m, (a, n)| m.max((a - n).abs()));
    worst / scale
}

/// Asserts that `analytic` matches central differences of `f` at `x` within
/// relative error `tol`, naming `what` in the failure.
pub fn assert_grad(
    what: &str,
    x: &[f64],
    analytic: &[f64],
    tol: f64,
    f: impl FnMut(&[f64]) -> f64,
) {
    let numeric = numeric_grad(x, 1e-6, f);
    let err = relative_error(analytic, &numeric);
    assert!(
        err <= tol,
        "{what}: gradient relative error {err:.3e} > {tol:.0e}\n analytic {analytic:?}\n numeric  {numeric:?}"
    );
    let scale = numeric.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert!(
        scale > 0.0 || x.is_empty(),
        "{what}: gradient is identically zero; the check proves nothing"
    );
}
