//! `foldmoe bench`: throughput of one MoE layer and of a training step, as
//! one JSON object on stdout, so that runs can be compared with the PyTorch
//! peer in `benchmarks/` on the same GPU.
//!
//! Times are wall-clock around work the device has finished (the backend is
//! synchronised before and after each iteration), medians over `--iters`
//! after `--warmup` untimed iterations. FLOPs follow Megatron-LM's
//! throughput formula ([`ModelSpec::flops_per_token`]): the reported TFLOP/s
//! are the model's useful work, not what the kernels happen to execute.

use std::time::Instant;

use foldmoe::core::engine::model::Model;
use foldmoe::core::engine::moe::MoeLayer;
use foldmoe::core::engine::trainer::{TrainConfig, Trainer};
use foldmoe::core::spec::{FfnSpec, ModelSpec, MoeSpec};
use foldmoe::kernels::cpu::Cpu;
use foldmoe::kernels::cuda::Cuda;
use foldmoe::kernels::{Backend, DType, HostData, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use crate::error::CliError;

/// Dense bf16 tensor-core peak of an H100/H200 SXM (FLOP/s), the MFU
/// denominator Megatron-Core's reports use.
const HOPPER_BF16_PEAK: f64 = 989e12;

/// What `foldmoe bench` measures.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchKind {
    /// Forward + backward of one MoE layer (router, dispatch, experts, combine).
    MoeLayer,
    /// One training step (forward, backward, AdamW) of a model cut to `--layers`.
    Model,
}

/// Flags of `foldmoe bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchOptions {
    /// What to measure.
    #[arg(value_enum)]
    pub kind: BenchKind,
    /// Device: `cpu` or `cuda`.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Model whose dimensions are used (its first MoE block group for `moe-layer`).
    #[arg(long, default_value = "qwen3-30b-a3b")]
    pub model: String,
    /// Blocks kept for `model` (the first ones of the declaration).
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Sequence length (default: the model's).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Tokens per iteration (a multiple of the sequence length for `model`).
    #[arg(long, default_value_t = 16384)]
    pub tokens: usize,
    /// Element type of parameters and activations: `bf16` or `f32`
    /// (default: bf16 on cuda, f32 on the cpu, which has no bf16 kernels).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Untimed iterations first (kernel compilation, allocator warm-up).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Timed iterations.
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
}

/// What the benchmark needs from a backend beyond [`Backend`]: waiting for
/// queued work, naming the device, and counters only some backends keep.
pub trait BenchDevice: Backend {
    /// Blocks until every queued op has finished.
    fn finish(&self) -> Result<(), CliError>;
    /// `(backend, device name)` for the report.
    fn label(&self) -> (&'static str, String);
    /// Host waits so far (CUDA), to report how many an iteration needs.
    fn host_waits(&self) -> Option<u64> {
        None
    }
    /// Forgets the peak of device memory in use.
    fn reset_peak(&self) {}
    /// Peak device memory in use since [`BenchDevice::reset_peak`], in bytes.
    fn peak_bytes(&self) -> Option<usize> {
        None
    }
    /// Dense bf16 peak of the device in FLOP/s, where known (for MFU).
    fn peak_flops(&self) -> Option<f64> {
        None
    }
}

impl BenchDevice for Cpu {
    fn finish(&self) -> Result<(), CliError> {
        Ok(())
    }
    fn label(&self) -> (&'static str, String) {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        ("cpu", format!("{threads} threads"))
    }
}

impl BenchDevice for Cuda {
    fn finish(&self) -> Result<(), CliError> {
        Ok(self.synchronize()?)
    }
    fn label(&self) -> (&'static str, String) {
        ("cuda", self.name().to_string())
    }
    fn host_waits(&self) -> Option<u64> {
        Some(self.host_syncs())
    }
    fn reset_peak(&self) {
        self.reset_peak_memory()
    }
    fn peak_bytes(&self) -> Option<usize> {
        Some(self.memory_in_use().1)
    }
    fn peak_flops(&self) -> Option<f64> {
        // Hopper (sm_90): H100 and H200 share the 989 TFLOP/s dense bf16 peak.
        self.arch().starts_with("sm_90").then_some(HOPPER_BF16_PEAK)
    }
}

/// Runs the benchmark `o` on the device it names and returns the report.
pub fn run(o: &BenchOptions) -> Result<Value, CliError> {
    match o.device.as_str() {
        "cpu" => run_on(&Cpu, o),
        "cuda" => run_on(&Cuda::new(0)?, o),
        other => Err(CliError::usage(format!(
            "--device {other}: unknown device; use cpu or cuda"
        ))),
    }
}

fn run_on<B: BenchDevice>(b: &B, o: &BenchOptions) -> Result<Value, CliError> {
    let (backend, device) = b.label();
    let dtype_name = o
        .dtype
        .clone()
        .unwrap_or_else(|| if backend == "cpu" { "f32" } else { "bf16" }.into());
    let dtype = match dtype_name.as_str() {
        "bf16" => DType::BF16,
        "f32" => DType::F32,
        other => return Err(CliError::usage(format!("--dtype {other}: use bf16 or f32"))),
    };
    if o.iters == 0 {
        return Err(CliError::usage("--iters 0: time at least one iteration"));
    }
    if o.tokens == 0 {
        return Err(CliError::usage("--tokens 0: give at least one token"));
    }
    let spec = bench_spec(o)?;
    let mut report = match o.kind {
        BenchKind::MoeLayer => moe_layer(b, o, &spec, dtype)?,
        BenchKind::Model => model_step(b, o, &spec, dtype)?,
    };
    report["backend"] = json!(backend);
    report["device"] = json!(device);
    report["dtype"] = json!(dtype_name);
    report["model"] = json!(o.model);
    Ok(report)
}

/// The named model cut to `--layers` blocks, at `--seq-len`.
fn bench_spec(o: &BenchOptions) -> Result<ModelSpec, CliError> {
    let mut spec = foldmoe::models::by_name(&o.model).map_err(CliError::usage)?;
    if o.layers == 0 || o.layers > spec.layers() {
        return Err(CliError::usage(format!(
            "--layers {}: {} has {} blocks; keep between 1 and {}",
            o.layers,
            o.model,
            spec.layers(),
            spec.layers()
        )));
    }
    let mut left = o.layers;
    spec.groups.retain_mut(|g| {
        g.count = g.count.min(left);
        left -= g.count;
        g.count > 0
    });
    spec.mtp_layers = 0;
    if let Some(s) = o.seq_len {
        if s == 0 {
            return Err(CliError::usage("--seq-len 0: give at least one token"));
        }
        spec.seq_len = s;
    }
    Ok(spec)
}

/// Per-iteration times in seconds: `warmup` untimed runs of `step`, then
/// `iters` timed ones, each between two device synchronisations.
fn time_iters<B: BenchDevice>(
    b: &B,
    o: &BenchOptions,
    step: &mut dyn FnMut() -> Result<(), CliError>,
) -> Result<Vec<f64>, CliError> {
    for _ in 0..o.warmup {
        step()?;
    }
    b.finish()?;
    let mut times = Vec::with_capacity(o.iters);
    for _ in 0..o.iters {
        let t0 = Instant::now();
        step()?;
        b.finish()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    Ok(times)
}

/// `(median, min)` of `times`.
fn median_min(times: &[f64]) -> (f64, f64) {
    let mut t = times.to_vec();
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2], t[0])
}

fn random<B: Backend>(
    b: &B,
    shape: &[usize],
    scale: f32,
    seed: u64,
    dtype: DType,
) -> Result<Tensor<B>, CliError> {
    let n = shape.iter().product();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-scale..scale)).collect();
    let t = b.upload(HostData::F32(v), shape)?;
    Ok(if dtype == DType::F32 {
        t
    } else {
        b.cast(&t, dtype)?
    })
}

/// Training FLOPs of one MoE layer per token (Megatron's counting: router
/// and the experts a token visits, forward + backward = 3× forward).
fn moe_flops_per_token(hidden: usize, m: &MoeSpec) -> f64 {
    let (d, e, k) = (hidden as f64, m.experts as f64, m.top_k as f64);
    let expert = 2.0 * 3.0 * d * m.expert_ffn as f64;
    let shared = 2.0 * 3.0 * d * m.shared_ffn as f64;
    3.0 * (2.0 * d * e + k * expert + shared)
}

fn moe_layer<B: BenchDevice>(
    b: &B,
    o: &BenchOptions,
    spec: &ModelSpec,
    dtype: DType,
) -> Result<Value, CliError> {
    let moe = spec
        .groups
        .iter()
        .find_map(|g| match &g.ffn {
            FfnSpec::Moe(m) => Some(m.clone()),
            FfnSpec::Dense { .. } => None,
        })
        .ok_or_else(|| {
            CliError::usage(format!(
                "moe-layer: {} has no MoE block in its first {} layers",
                o.model, o.layers
            ))
        })?;
    let (t, d) = (o.tokens, spec.hidden);
    let seq_len = spec.seq_len.min(t);
    if !t.is_multiple_of(seq_len) {
        return Err(CliError::usage(format!(
            "--tokens {t}: not a multiple of the sequence length {seq_len}"
        )));
    }
    let mut layer = MoeLayer::new(b, "bench.moe", d, &moe, spec.init_std, 1, dtype)?;
    let x = random(b, &[t, d], 1.0, 2, dtype)?;
    let dy = random(b, &[t, d], 1e-3, 3, dtype)?;
    let mut step = || -> Result<(), CliError> {
        let (_y, saved, _stats) = layer.forward(b, &x, seq_len)?;
        layer.backward(b, &dy, saved, 1.0)?;
        Ok(())
    };
    // One iteration alone to count its host waits (after compilation).
    step()?;
    b.finish()?;
    let waits_before = b.host_waits();
    step()?;
    let waits = b.host_waits().zip(waits_before).map(|(a, z)| a - z);
    b.reset_peak();
    let times = time_iters(b, o, &mut step)?;
    let (median, min) = median_min(&times);
    let flops = moe_flops_per_token(d, &moe) * t as f64;
    Ok(json!({
        "bench": "moe-layer",
        "dims": {
            "tokens": t, "hidden": d, "experts": moe.experts, "top_k": moe.top_k,
            "expert_ffn": moe.expert_ffn, "shared_ffn": moe.shared_ffn, "seq_len": seq_len,
        },
        "flops": flops,
        "time_ms": median * 1e3,
        "time_ms_min": min * 1e3,
        "tflops": flops / median / 1e12,
        "host_waits_per_iter": waits,
        "peak_mem_gib": b.peak_bytes().map(|p| p as f64 / (1u64 << 30) as f64),
        "iters": o.iters,
    }))
}

fn model_step<B: BenchDevice>(
    b: &B,
    o: &BenchOptions,
    spec: &ModelSpec,
    dtype: DType,
) -> Result<Value, CliError> {
    spec.check().map_err(|errs| {
        CliError::usage(format!(
            "{} cut to {} layers: {}",
            o.model,
            o.layers,
            errs.iter()
                .map(|e| format!("{}: {}", e.path, e.message))
                .collect::<Vec<_>>()
                .join("; ")
        ))
    })?;
    let (t, s) = (o.tokens, spec.seq_len);
    if !t.is_multiple_of(s) {
        return Err(CliError::usage(format!(
            "--tokens {t}: not a multiple of the sequence length {s} (set --seq-len)"
        )));
    }
    let seqs = t / s;
    let model = Model::new(b, spec, 1, dtype)?;
    let (params, active) = spec.param_counts();
    let mut trainer = Trainer::new(b, model, TrainConfig::default())?;
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut tokens = || -> Vec<i32> {
        (0..t)
            .map(|_| rng.gen_range(0..spec.vocab as i32))
            .collect()
    };
    let batch = [(
        b.upload(HostData::I32(tokens()), &[seqs, s])?,
        b.upload(HostData::I32(tokens()), &[seqs, s])?,
    )];
    let mut last_loss = f64::NAN;
    b.reset_peak();
    let mut step = || -> Result<(), CliError> {
        last_loss = trainer.step(b, &batch)?.loss;
        Ok(())
    };
    let times = time_iters(b, o, &mut step)?;
    let (median, min) = median_min(&times);
    let flops = spec.flops_per_token() as f64 * t as f64;
    let tflops = flops / median / 1e12;
    Ok(json!({
        "bench": "model",
        "dims": {
            "layers": spec.layers(), "hidden": spec.hidden, "vocab": spec.vocab,
            "seq_len": s, "tokens": t, "params": params, "active_params": active,
        },
        "flops_per_step": flops,
        "time_ms": median * 1e3,
        "time_ms_min": min * 1e3,
        "tokens_per_s": t as f64 / median,
        "tflops": tflops,
        "mfu": b.peak_flops().map(|p| tflops * 1e12 / p),
        "peak_mem_gib": b.peak_bytes().map(|p| p as f64 / (1u64 << 30) as f64),
        "last_loss": last_loss,
        "iters": o.iters,
    }))
}
