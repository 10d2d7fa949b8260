//! `foldmoe score`: per-token log-probabilities of a text under a
//! checkpoint, with the mean loss and perplexity (evaluation, and parity
//! checks against other frameworks); or of every document of a Megatron
//! indexed dataset, each scored on its own (windows never cross a
//! document boundary, so a document's score does not depend on its
//! neighbours or on the order of the file).

use std::path::Path;

use foldmoe::core::engine::model::Model;
use foldmoe::core::engine::parallel::Exec;
use foldmoe::data::indexed::IndexedDataset;
use foldmoe::data::Tokenizer;
use foldmoe::kernels::Backend;
use serde::Serialize;

use crate::cli::error::CliError;
use crate::cli::train::load_model;

/// What `score` measures.
#[derive(Serialize, Debug)]
pub struct Scores {
    /// Tokens predicted (every token of the input but the first).
    pub tokens: usize,
    /// Mean negative log-probability, nats per token.
    pub mean_loss: f64,
    /// `exp(mean_loss)`.
    pub perplexity: f64,
    /// The input's token ids.
    pub token_ids: Vec<i32>,
    /// `log p(token_ids[i + 1] | token_ids[..=i])` for each predicted token,
    /// in the window the model sees (the input is cut into windows of
    /// `seq_len + 1` tokens overlapping by one).
    pub token_logprobs: Vec<f64>,
}

/// Scores token `ids` with the checkpoint `checkpoint`.
pub fn score_ids<B: Backend>(b: &B, checkpoint: &Path, ids: &[i32]) -> Result<Scores, CliError> {
    let (model, _) = load_model(b, checkpoint)?;
    let vocab = model.spec.vocab;
    if let Some((i, &t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(CliError::usage(format!(
            "--input: token {i} is {t}, outside the model's vocabulary of {vocab} (without \
             --tokenizer, one id per byte)"
        )));
    }
    if ids.len() < 2 {
        return Err(CliError::usage(
            "--input: needs at least two tokens (the first is only context)".to_string(),
        ));
    }
    score_with(b, &model, ids)
}

/// Scores `ids` (at least two, each in the vocabulary) with `model`: the
/// ids cut into windows of `seq_len + 1` overlapping by one.
fn score_with<B: Backend>(b: &B, model: &Model<B>, ids: &[i32]) -> Result<Scores, CliError> {
    let (vocab, seq) = (model.spec.vocab, model.spec.seq_len);
    let exec = Exec::solo(b);
    let mut logprobs = Vec::with_capacity(ids.len() - 1);
    let mut start = 0;
    while start + 1 < ids.len() {
        let end = (start + seq).min(ids.len() - 1);
        let window = &ids[start..end];
        let logits = b
            .download(&model.logits(&exec, window, window.len())?)?
            .to_f64();
        for (row, &target) in logits.chunks(vocab).zip(&ids[start + 1..=end]) {
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + row.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
            logprobs.push(row[target as usize] - lse);
        }
        start = end;
    }
    let mean_loss = -logprobs.iter().sum::<f64>() / logprobs.len() as f64;
    Ok(Scores {
        tokens: logprobs.len(),
        mean_loss,
        perplexity: mean_loss.exp(),
        token_ids: ids.to_vec(),
        token_logprobs: logprobs,
    })
}

/// What `score --data-path` measures: every document's score and their
/// token-weighted mean.
#[derive(Serialize, Debug)]
pub struct DatasetScores {
    /// Documents scored (those of at least two tokens).
    pub documents: usize,
    /// Documents of fewer than two tokens (nothing to predict), skipped.
    pub skipped: usize,
    /// Tokens predicted over all documents.
    pub tokens: usize,
    /// Mean negative log-probability over every predicted token.
    pub mean_loss: f64,
    /// `exp(mean_loss)`.
    pub perplexity: f64,
    /// Per document (in the dataset's order): its index, tokens predicted
    /// and mean loss.
    pub per_document: Vec<DocumentScore>,
}

/// One document's score in [`DatasetScores`].
#[derive(Serialize, Debug)]
pub struct DocumentScore {
    /// Index of the document in the dataset.
    pub document: usize,
    /// Tokens predicted.
    pub tokens: usize,
    /// Mean negative log-probability.
    pub mean_loss: f64,
}

/// Scores every document of the indexed dataset `prefix` with the
/// checkpoint `checkpoint`; a missing, truncated or corrupt dataset, or a
/// token outside the model's vocabulary, is a one-line error.
pub fn score_dataset<B: Backend>(
    b: &B,
    checkpoint: &Path,
    prefix: &Path,
) -> Result<DatasetScores, CliError> {
    let data = IndexedDataset::open(prefix)?;
    let (model, _) = load_model(b, checkpoint)?;
    let vocab = model.spec.vocab;
    let di = data.document_indices();
    let (mut per_document, mut skipped, mut loss_sum) = (Vec::new(), 0, 0.0);
    for d in 0..data.documents() {
        let mut ids = Vec::new();
        for seq in di[d] as usize..di[d + 1] as usize {
            ids.extend(data.sequence(seq)?);
        }
        if let Some((i, &t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(CliError::usage(format!(
                "--data-path {}: document {d} token {i} is {t}, outside the model's \
                 vocabulary of {vocab}",
                prefix.display()
            )));
        }
        if ids.len() < 2 {
            skipped += 1;
            continue;
        }
        let ids: Vec<i32> = ids.into_iter().map(|t| t as i32).collect();
        let s = score_with(b, &model, &ids)?;
        loss_sum += s.mean_loss * s.tokens as f64;
        per_document.push(DocumentScore {
            document: d,
            tokens: s.tokens,
            mean_loss: s.mean_loss,
        });
    }
    let tokens: usize = per_document.iter().map(|d| d.tokens).sum();
    if tokens == 0 {
        return Err(CliError::usage(format!(
            "--data-path {}: no document has two tokens to score",
            prefix.display()
        )));
    }
    let mean_loss = loss_sum / tokens as f64;
    Ok(DatasetScores {
        documents: per_document.len(),
        skipped,
        tokens,
        mean_loss,
        perplexity: mean_loss.exp(),
        per_document,
    })
}

/// `foldmoe score --data-path`: the report line, or the JSON of
/// [`DatasetScores`].
pub fn run_dataset<B: Backend>(
    b: &B,
    checkpoint: &Path,
    prefix: &Path,
    json: bool,
) -> Result<String, CliError> {
    let s = score_dataset(b, checkpoint, prefix)?;
    if json {
        return Ok(serde_json::to_string(&s).expect("JSON"));
    }
    Ok(format!(
        "{}: {} documents ({} too short, skipped), {} tokens scored, mean loss {:.4} \
         nats/token, perplexity {:.3}",
        prefix.display(),
        s.documents,
        s.skipped,
        s.tokens,
        s.mean_loss,
        s.perplexity
    ))
}

/// `foldmoe score`: the report line, or JSON with every token's
/// log-probability; the text read with `tokenizer` (a `tokenizer.json`;
/// `None`: one token per byte, any bytes).
pub fn run<B: Backend>(
    b: &B,
    checkpoint: &Path,
    input: &Path,
    tokenizer: Option<&Path>,
    json: bool,
) -> Result<String, CliError> {
    let bytes = std::fs::read(input).map_err(|e| CliError::io("--input: cannot read", input, e))?;
    let ids: Vec<i32> = match tokenizer {
        None => bytes.iter().map(|&x| i32::from(x)).collect(),
        Some(path) => {
            let text = String::from_utf8(bytes).map_err(|e| {
                CliError::usage(format!("--input {}: not UTF-8 text: {e}", input.display()))
            })?;
            Tokenizer::load(Some(path))?
                .encode(&text)?
                .into_iter()
                .map(|t| t as i32)
                .collect()
        }
    };
    let s = score_ids(b, checkpoint, &ids)?;
    if json {
        return Ok(serde_json::to_string(&s).expect("JSON"));
    }
    Ok(format!(
        "{}: {} tokens scored, mean loss {:.4} nats/token, perplexity {:.3}",
        input.display(),
        s.tokens,
        s.mean_loss,
        s.perplexity
    ))
}
