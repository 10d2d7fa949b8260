//! Text generation from a trained model, byte by byte.

use foldmoe::core::engine::model::Model;
use foldmoe::core::engine::parallel::Exec;
use foldmoe::data::ByteTokenizer;
use foldmoe::kernels::Backend;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::cli::error::CliError;
use crate::cli::train::load_model;

/// Most bytes one `generate` makes (about four hours on the CPU at 14 ms a
/// byte): a larger `--tokens` is a one-line error, not an endless run.
pub const MAX_GENERATE_TOKENS: usize = 1_000_000;

/// Samples `count` tokens after `prompt` (temperature 0: greedy), feeding the
/// last `seq_len` tokens as context each time (no KV cache: the model is
/// small), handing each to `on_token` as soon as it is drawn; `on_token`
/// returns `false` to stop early (Ctrl-C), keeping what was made.
pub fn sample<B: Backend>(
    b: &B,
    model: &Model<B>,
    prompt: &[i32],
    count: usize,
    temperature: f64,
    seed: u64,
    on_token: &mut dyn FnMut(i32) -> Result<bool, CliError>,
) -> Result<Vec<i32>, CliError> {
    let seq = model.spec.seq_len;
    let vocab = model.spec.vocab;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut ids = prompt.to_vec();
    if ids.is_empty() {
        ids.push(i32::from(b'\n'));
    }
    let exec = Exec::solo(b);
    for _ in 0..count {
        let window = &ids[ids.len().saturating_sub(seq)..];
        let logits = b
            .download(&model.logits(&exec, window, window.len())?)?
            .to_f64();
        let last = &logits[(window.len() - 1) * vocab..window.len() * vocab];
        let next = pick(last, temperature, &mut rng) as i32;
        ids.push(next);
        if !on_token(next)? {
            break;
        }
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

/// A byte as written to a terminal: newline and tab as they are, other
/// control bytes (ESC, NUL, DEL, ...) as `\xNN`, so model output cannot
/// drive the terminal; every other byte as it is (UTF-8 sequences intact).
pub fn escaped(byte: u8) -> Vec<u8> {
    match byte {
        b'\n' | b'\t' => vec![byte],
        0..=0x1f | 0x7f => format!("\\x{byte:02x}").into_bytes(),
        _ => vec![byte],
    }
}

/// `foldmoe generate`: loads a checkpoint and streams the prompt's
/// continuation to stdout byte by byte as it is made (control bytes
/// escaped on a terminal unless `raw`); `stop` (Ctrl-C) ends it after the
/// current byte, keeping what was printed. Returns the bytes made.
#[allow(clippy::too_many_arguments)]
pub fn run<B: Backend>(
    b: &B,
    checkpoint: &std::path::Path,
    prompt: &str,
    tokens: usize,
    temperature: f64,
    seed: u64,
    raw: bool,
    stop: &AtomicBool,
) -> Result<usize, CliError> {
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(CliError::usage(format!(
            "--temperature {temperature}: must be a finite number ≥ 0"
        )));
    }
    if tokens > MAX_GENERATE_TOKENS {
        return Err(CliError::usage(format!(
            "--tokens {tokens}: at most {MAX_GENERATE_TOKENS} bytes in one run"
        )));
    }
    let (model, _) = load_model(b, checkpoint)?;
    let tok = ByteTokenizer;
    let mut out = std::io::stdout().lock();
    let escape = !raw && out.is_terminal();
    let write = |out: &mut std::io::StdoutLock, bytes: &[u8]| -> Result<(), CliError> {
        for &byte in bytes {
            let shown = if escape { escaped(byte) } else { vec![byte] };
            out.write_all(&shown)
                .map_err(|e| CliError::usage(format!("cannot write the output: {e}")))?;
        }
        out.flush()
            .map_err(|e| CliError::usage(format!("cannot write the output: {e}")))
    };
    write(&mut out, prompt.as_bytes())?;
    let mut made = 0usize;
    sample(
        b,
        &model,
        &tok.encode(prompt)
            .into_iter()
            .map(|id| id as i32)
            .collect::<Vec<_>>(),
        tokens,
        temperature,
        seed,
        &mut |id| {
            write(&mut out, &[id as u8])?;
            made += 1;
            Ok(!stop.load(Ordering::SeqCst))
        },
    )?;
    write(&mut out, b"\n")?;
    Ok(made)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_bytes_are_escaped_and_text_is_not() {
        assert_eq!(escaped(0x1b), b"\\x1b".to_vec());
        assert_eq!(escaped(0), b"\\x00".to_vec());
        assert_eq!(escaped(0x7f), b"\\x7f".to_vec());
        for byte in [b'\n', b'\t', b'a', b' ', 0xc3, 0xa9] {
            assert_eq!(escaped(byte), vec![byte]);
        }
    }

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
