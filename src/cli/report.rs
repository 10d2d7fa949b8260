//! `foldmoe report RUN_DIR`: a run's summary read from its `metrics.jsonl`
//! (and `summary.json` once the run has finished), and its two plots drawn
//! again: `loss.png` and `load_heatmap.png`. `train` draws them at its end
//! through the same [`write_plots`], from the same log.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use crate::cli::error::CliError;

/// Tokens routed to each expert of one MoE layer, summed over a run.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerTotal {
    /// The layer's index among the model's blocks.
    pub layer: usize,
    /// Token copies routed to each expert.
    pub tokens: Vec<u64>,
}

/// How evenly one layer's tokens are spread over its experts (Megatron-LM
/// issue #2398 asks for these per layer): 1, 1 and 0 when perfectly even.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoadStats {
    /// The busiest expert's tokens over the mean.
    pub max_over_mean: f64,
    /// The idlest expert's tokens over the mean.
    pub min_over_mean: f64,
    /// Standard deviation over the mean (coefficient of variation).
    pub cv: f64,
}

/// [`LoadStats`] of one layer's tokens per expert (all 1/1/0 when it routed
/// nothing, which only an empty batch does).
pub fn load_stats(tokens: &[u64]) -> LoadStats {
    let n = tokens.len().max(1) as f64;
    let mean = tokens.iter().sum::<u64>() as f64 / n;
    if mean <= 0.0 {
        return LoadStats {
            max_over_mean: 1.0,
            min_over_mean: 1.0,
            cv: 0.0,
        };
    }
    let max = tokens.iter().copied().max().unwrap_or(0) as f64;
    let min = tokens.iter().copied().min().unwrap_or(0) as f64;
    let var = tokens
        .iter()
        .map(|&t| (t as f64 - mean).powi(2))
        .sum::<f64>()
        / n;
    LoadStats {
        max_over_mean: max / mean,
        min_over_mean: min / mean,
        cv: var.sqrt() / mean,
    }
}

/// A run's `metrics.jsonl`, one line a step.
#[derive(Debug, Default)]
pub struct RunLog {
    /// Training loss of each step, in order.
    pub losses: Vec<f64>,
    /// `(step, validation loss)` where one was measured.
    pub val_losses: Vec<(u64, f64)>,
    /// The last step's number, learning rate, gradient norm and tokens/s.
    pub last: Option<(u64, f64, f64, f64)>,
    /// Mean tokens/s over the logged steps.
    pub mean_tokens_per_s: f64,
    /// Tokens routed per expert of each MoE layer over the run, by layer.
    pub loads: Vec<LayerTotal>,
}

impl RunLog {
    /// Reads `dir/metrics.jsonl`; a missing file or a line that is not a
    /// step's record is a one-line error naming it.
    pub fn read(dir: &Path) -> Result<Self, CliError> {
        if !dir.is_dir() {
            return Err(CliError::usage(format!(
                "{}: no such run directory",
                dir.display()
            )));
        }
        let path = dir.join("metrics.jsonl");
        let text = std::fs::read_to_string(&path).map_err(|e| {
            CliError::usage(format!(
                "{}: cannot read ({e}); not a foldmoe run directory?",
                path.display()
            ))
        })?;
        let mut log = RunLog::default();
        let mut loads: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
        let mut tokens_per_s = 0.0;
        for (i, line) in text.lines().enumerate() {
            let bad = |what: &str| {
                CliError::usage(format!(
                    "{} line {}: {what}; the log is corrupt",
                    path.display(),
                    i + 1
                ))
            };
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value =
                serde_json::from_str(line).map_err(|e| bad(&format!("not JSON ({e})")))?;
            let num = |key: &str| v[key].as_f64().ok_or_else(|| bad(&format!("no `{key}`")));
            let step = v["step"].as_u64().ok_or_else(|| bad("no `step`"))?;
            log.losses.push(num("loss")?);
            if let Some(val) = v["val_loss"].as_f64() {
                log.val_losses.push((step, val));
            }
            let tps = num("tokens_per_s")?;
            tokens_per_s += tps;
            log.last = Some((step, num("lr")?, num("grad_norm")?, tps));
            if let Some(map) = v["expert_load"].as_object() {
                for (key, counts) in map {
                    let layer = key
                        .strip_prefix("layer_")
                        .and_then(|n| n.parse::<usize>().ok())
                        .ok_or_else(|| bad(&format!("expert_load key {key:?} is not layer_N")))?;
                    let counts: Vec<u64> = counts
                        .as_array()
                        .and_then(|a| a.iter().map(|c| c.as_u64()).collect())
                        .ok_or_else(|| {
                            bad(&format!("expert_load {key} is not a list of counts"))
                        })?;
                    let total = loads.entry(layer).or_insert_with(|| vec![0; counts.len()]);
                    if total.len() != counts.len() {
                        return Err(bad(&format!(
                            "expert_load {key} has {} experts, earlier lines {}",
                            counts.len(),
                            total.len()
                        )));
                    }
                    for (t, c) in total.iter_mut().zip(counts) {
                        *t += c;
                    }
                }
            }
        }
        if log.losses.is_empty() {
            return Err(CliError::usage(format!(
                "{}: no steps logged yet",
                path.display()
            )));
        }
        log.mean_tokens_per_s = tokens_per_s / log.losses.len() as f64;
        log.loads = loads
            .into_iter()
            .map(|(layer, tokens)| LayerTotal { layer, tokens })
            .collect();
        Ok(log)
    }
}

/// Draws `dir/loss.png` and, for a model with MoE layers,
/// `dir/load_heatmap.png` from `log`.
pub fn write_plots(dir: &Path, log: &RunLog) -> Result<(), CliError> {
    crate::cli::plot::loss_png(&dir.join("loss.png"), &log.losses, &log.val_losses)?;
    if !log.loads.is_empty() {
        crate::cli::plot::load_heatmap_png(
            &dir.join("load_heatmap.png"),
            &log.loads,
            log.losses.len(),
        )?;
    }
    Ok(())
}

/// The report of the run in `dir` (the plots redrawn on the way).
pub fn run(dir: &Path) -> Result<String, CliError> {
    let log = RunLog::read(dir)?;
    // summary.json is there once a run has finished; it is optional here.
    let summary: Option<serde_json::Value> = std::fs::read_to_string(dir.join("summary.json"))
        .ok()
        .map(|text| {
            serde_json::from_str(&text).map_err(|e| {
                CliError::usage(format!(
                    "{}: not JSON ({e}); the summary is corrupt",
                    dir.join("summary.json").display()
                ))
            })
        })
        .transpose()?;
    write_plots(dir, &log)?;
    let mut out = String::new();
    let steps = log.losses.len();
    let model = summary
        .as_ref()
        .and_then(|s| s["model"].as_str().map(str::to_owned));
    let _ = writeln!(
        out,
        "run {}: {}{steps} steps logged{}",
        dir.display(),
        model.map_or(String::new(), |m| format!("model `{m}`, ")),
        if summary.is_some() {
            ""
        } else {
            " (no summary.json: the run has not finished)"
        }
    );
    let (first, last) = (log.losses[0], log.losses[steps - 1]);
    let _ = write!(out, "loss {last:.4} (step 1: {first:.4})");
    if let Some(&(step, val)) = log.val_losses.last() {
        let _ = write!(out, ", validation loss {val:.4} at step {step}");
    }
    out.push('\n');
    if let Some((step, lr, grad_norm, _)) = log.last {
        let _ = writeln!(
            out,
            "step {step}: lr {lr:.3e}, grad norm {grad_norm:.4}; {:.0} tokens/s over the logged steps",
            log.mean_tokens_per_s
        );
    }
    if let Some(s) = &summary {
        if let (Some(wall), Some(total), Some(active)) = (
            s["wall_s"].as_f64(),
            s["params_total"].as_u64(),
            s["params_active"].as_u64(),
        ) {
            let _ = writeln!(
                out,
                "{:.2} M parameters ({:.2} M active per token), {wall:.1} s of training",
                total as f64 / 1e6,
                active as f64 / 1e6
            );
        }
    }
    if log.loads.is_empty() {
        out.push_str("no MoE layers: no expert loads\n");
    } else {
        out.push_str("expert load over the run (tokens routed; max, min and std over the mean):\n");
        for l in &log.loads {
            let s = load_stats(&l.tokens);
            let idle = l.tokens.iter().filter(|&&t| t == 0).count();
            let _ = writeln!(
                out,
                "  layer {:>3}: {} tokens over {} experts, max {:.2}, min {:.2}, std {:.2}, {idle} idle",
                l.layer,
                l.tokens.iter().sum::<u64>(),
                l.tokens.len(),
                s.max_over_mean,
                s.min_over_mean,
                s.cv
            );
        }
    }
    let _ = write!(
        out,
        "plots: {}{}",
        dir.join("loss.png").display(),
        if log.loads.is_empty() {
            String::new()
        } else {
            format!(", {}", dir.join("load_heatmap.png").display())
        }
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_stats_of_even_and_skewed_layers() {
        assert_eq!(
            load_stats(&[4, 4, 4, 4]),
            LoadStats {
                max_over_mean: 1.0,
                min_over_mean: 1.0,
                cv: 0.0
            }
        );
        // Mean 4, std sqrt((16 + 16 + 0 + 0) / 4) = 2√2.
        let s = load_stats(&[8, 0, 4, 4]);
        assert_eq!((s.max_over_mean, s.min_over_mean), (2.0, 0.0));
        assert!((s.cv - 8f64.sqrt() / 4.0).abs() < 1e-12);
        assert_eq!(load_stats(&[0, 0]).max_over_mean, 1.0);
    }

    #[test]
    fn log_sums_loads_and_names_a_bad_line() {
        let dir = std::env::temp_dir().join(format!("foldmoe-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let line = |step: u64, val: Option<f64>, load: &str| {
            format!(
                r#"{{"step":{step},"loss":2.5,"val_loss":{},"lr":0.001,"grad_norm":1.0,"tokens_per_s":100.0,"expert_load":{load}}}"#,
                val.map_or("null".into(), |v| v.to_string())
            )
        };
        let text = [
            line(1, None, r#"{"layer_1":[3,1],"layer_3":[2,2]}"#),
            line(2, Some(2.0), r#"{"layer_1":[0,4],"layer_3":[1,3]}"#),
        ]
        .join("\n");
        std::fs::write(dir.join("metrics.jsonl"), &text).unwrap();
        let log = RunLog::read(&dir).unwrap();
        assert_eq!(log.losses, [2.5, 2.5]);
        assert_eq!(log.val_losses, [(2, 2.0)]);
        let want = [(1, vec![3, 5]), (3, vec![3, 5])];
        let got: Vec<(usize, Vec<u64>)> = log
            .loads
            .iter()
            .map(|l| (l.layer, l.tokens.clone()))
            .collect();
        assert_eq!(got, want);
        std::fs::write(dir.join("metrics.jsonl"), format!("{text}\n{{\"step\": 3")).unwrap();
        let err = RunLog::read(&dir).unwrap_err().to_string();
        assert!(err.contains("metrics.jsonl line 3: not JSON"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
