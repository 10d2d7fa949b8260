//! Text generation from a trained model, byte by byte.

use foldmoe::core::engine::data::ByteTokenizer;
use foldmoe::core::engine::parallel::{Ctx, ParallelModel};
use foldmoe::kernels::comm::solo::SoloComm;
use foldmoe::kernels::Backend;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::CliError;
use crate::train::load_model;

/// Samples `count` tokens after `prompt` (temperature 0: greedy), feeding the
/// last `seq_len` tokens as context each time (no KV cache: the model is small).
pub fn sample<B: Backend>(
    b: &B,
    model: &ParallelModel<B>,
    prompt: &[i32],
    count: usize,
    temperature: f64,
    seed: u64,
) -> Result<Vec<i32>, CliError> {
    let seq = model.spec.seq_len;
    let vocab = model.spec.vocab;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut ids = prompt.to_vec();
    if ids.is_empty() {
        ids.push(i32::from(b'\n'));
    }
    let ctx = Ctx {
        b,
        comm: &SoloComm,
        rank: &model.rank,
    };
    for _ in 0..count {
        let window = &ids[ids.len().saturating_sub(seq)..];
        let logits = b
            .download(&model.logits(&ctx, window, window.len())?)?
            .to_f64();
        let last = &logits[(window.len() - 1) * vocab..window.len() * vocab];
        ids.push(pick(last, temperature, &mut rng) as i32);
    }
    Ok(ids[prompt.len().max(1).min(ids.len())..].to_vec())
}

/// Index drawn from `softmax(logits / temperature)`, or the arg-max at 0.
fn pick(logits: &[f64], temperature: f64, rng: &mut ChaCha8Rng) -> usize {
    let argmax = logits
        .iter()
        .enumerate()
        .fold(0, |best, (i, &v)| if v > logits[best] { i } else { best });
    if temperature <= 0.0 {
        return argmax;
    }
    let max = logits[argmax];
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| ((l - max) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut r = rng.gen::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        r -= w;
        if r <= 0.0 {
            return i;
        }
    }
    argmax
}

/// `foldmoe generate`: loads a checkpoint and prints the prompt's continuation.
pub fn run<B: Backend>(
    b: &B,
    checkpoint: &std::path::Path,
    prompt: &str,
    tokens: usize,
    temperature: f64,
    seed: u64,
) -> Result<String, CliError> {
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(CliError::usage(format!(
            "--temperature {temperature}: must be a finite number ≥ 0"
        )));
    }
    let (model, _) = load_model(b, checkpoint)?;
    let tok = ByteTokenizer;
    let out = sample(b, &model, &tok.encode(prompt), tokens, temperature, seed)?;
    Ok(format!("{prompt}{}", tok.decode(&out)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_pick_is_argmax_and_sampling_follows_weights() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(pick(&[0.1, 3.0, -1.0], 0.0, &mut rng), 1);
        let mut hits = [0usize; 2];
        for _ in 0..2000 {
            hits[pick(&[0.0, 2f64.ln()], 1.0, &mut rng)] += 1;
        }
        // p = [1/3, 2/3]
        assert!(
            (hits[1] as f64 / 2000.0 - 2.0 / 3.0).abs() < 0.04,
            "{hits:?}"
        );
    }
}
