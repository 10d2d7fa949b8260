//! `foldmoe bench`: throughput of one MoE layer, of a training step, and of
//! the layer's grouped GEMMs and the attention alone, as one JSON object on
//! stdout, so that runs can be compared with the PyTorch
//! peer in `benchmarks/` on the same GPU.
//!
//! Times are medians over `--iters` after `--warmup` untimed iterations.
//! `moe-layer`, `gemm` and `attention` on CUDA time each iteration between
//! two events on the device's queue, the iterations queued back to back with
//! no host wait between them: the PyTorch peer's method (`torch.cuda.Event`
//! pairs), so that both sides are timed alike. `moe-layer` also reports the
//! wall clock of iterations synchronised one by one (`wall_time_ms`), and
//! `model` and the CPU time only that way. FLOPs follow Megatron-LM's
//! throughput formula ([`ModelSpec::flops_per_token`]): the reported TFLOP/s
//! are the model's useful work, not what the kernels happen to execute.
//!
//! `bench model` times the engine's one training step, [`Trainer`]:
//! on one device at world = 1 (on this thread with the communicator of a
//! world of one, as `foldmoe train` runs one rank). Under `foldmoe launch`
//! (`launch --nproc-per-node N -- bench model --layout ep=N`), each process
//! is one rank of a parallel training step (on the communicator `train`
//! uses), and the run scales weakly: every dp rank takes its own micro-batch
//! of `--tokens` tokens, so the step's global batch is dp · `--tokens`.
//! Every iteration ends with a device synchronisation and a barrier over all
//! ranks, so rank 0's time of an iteration is that of the slowest rank
//! (plus the barrier); rank 0 alone prints the report, with its median.
//! `comm_exposed_ms` is rank 0's communication not hidden behind compute:
//! with NCCL, whose calls return once queued, the compute stream's waits
//! for collectives timed with device events
//! ([`Communicator::device_wait_time`]); on the host communicators, the
//! time rank 0 was blocked in calls and waits. `comm_share` is it over the
//! step time.

use std::time::Instant;

use foldmoe::core::engine::model::Model;
use foldmoe::core::engine::moe::MoeLayer;
use foldmoe::core::engine::optim::DdpConfig;
use foldmoe::core::engine::parallel::{Ctx, Exec, LayerGroups, RankLayout, Trainer};
use foldmoe::core::engine::param::{try_each_param, Init, Module as _};
use foldmoe::core::engine::trainer::TrainConfig;
use foldmoe::core::layout::Layout;
use foldmoe::core::spec::{FfnSpec, GemmPrecision, ModelSpec, MoeSpec};
use foldmoe::kernels::comm::rendezvous::DistEnv;
use foldmoe::kernels::comm::solo::SoloComm;
use foldmoe::kernels::comm::timed::TimedComm;
use foldmoe::kernels::cpu::Cpu;
use foldmoe::kernels::cuda::Cuda;
use foldmoe::kernels::fp8::Fp8Tiles;
use foldmoe::kernels::{Backend, Communicator, DType, Group, HostData, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use crate::cli::dist::{self, ProcessComm};
use crate::cli::error::CliError;

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
    /// The MoE layer's grouped GEMMs alone (fc1 and fc2 shapes: forward,
    /// data gradient, weight gradient), uniform groups.
    Gemm,
    /// Causal attention alone, forward and backward, at `--seq-len` and
    /// `--head-dim` (`--mla`: query/key 192, value 128).
    Attention,
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
    #[arg(long, alias = "seq")]
    pub seq_len: Option<usize>,
    /// `attention`: head dim (default: the model's).
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// `attention`: MLA's dims (DeepSeek-V3: query/key 192, value 128; the
    /// values go to the kernel zero-padded to 192, as the MLA block does).
    #[arg(long)]
    pub mla: bool,
    /// Tokens per iteration (a multiple of the sequence length for `model`);
    /// under `foldmoe launch`, each dp rank's micro-batch (per GPU when tp = 1).
    #[arg(long, default_value_t = 16384)]
    pub tokens: usize,
    /// Element type of parameters and activations: `bf16` or `f32`
    /// (default: bf16 on cuda, f32 on the cpu, whose bf16 is an emulation in
    /// f32 for tests, not faster).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Untimed iterations first (kernel compilation, allocator warm-up).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Timed iterations.
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// `model`: micro-batches each dp rank's `--tokens` are split into,
    /// accumulated in one step (through the pipeline schedule; at least 2
    /// for `--overlap-moe-expert-parallel-comm` to pair any).
    #[arg(long, default_value_t = 1)]
    pub micro_batches: usize,
    /// Parallel layout over the processes of `foldmoe launch` (`model`
    /// only), e.g. `ep=2`; default dp over all of them.
    #[arg(long)]
    pub layout: Option<String>,
    /// The routed experts' GEMMs in blockwise fp8, as `train --fp8`
    /// (`moe-layer` and `model`); FLOP/s and MFU are still counted against
    /// the dense bf16 peak. On sm_90a the forward and data-gradient products
    /// and the weight gradient run on the e4m3 wgmma kernels.
    /// `gemm`: also times the fp8 products on pre-quantised operands (rows
    /// `*_fp8`), beside the bf16 ones on the same shapes.
    #[arg(long)]
    pub fp8: bool,
    /// `moe-layer`, CUDA: after the eager timing, capture one iteration as a
    /// CUDA graph and time its replays too (reported under `graph`, with
    /// the gradients' agreement with the eager run).
    #[arg(long)]
    pub cuda_graph: bool,
    /// `model`: start the gradient buckets' reduce-scatters in the backward,
    /// as `train --overlap-grad-reduce`.
    #[arg(long)]
    pub overlap_grad_reduce: bool,
    /// `model`: overlap the parameter all-gathers with the updates, as
    /// `train --overlap-param-gather`.
    #[arg(long)]
    pub overlap_param_gather: bool,
    /// `model`: run each steady forward with the next backward, the expert
    /// all-to-alls overlapped, as `train --overlap-moe-expert-parallel-comm`.
    #[arg(long)]
    pub overlap_moe_expert_parallel_comm: bool,
    /// `model`: parameter elements per gradient bucket, as `train
    /// --ddp-bucket-size`.
    #[arg(long, value_name = "ELEMENTS")]
    pub ddp_bucket_size: Option<usize>,
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
    /// `(driver allocations, allocation retries)` of the device's caching
    /// allocator so far (CUDA): an iteration that needs either is not
    /// served from the cache.
    fn allocator_counts(&self) -> Option<(u64, u64)> {
        None
    }
    /// Seconds of each of `iters` runs of `step` queued back to back, each
    /// between two timing events on the device's queue, with no host wait
    /// until the last: the PyTorch peer's timing. `None` where the device
    /// keeps no such timeline (the CPU: time it by the wall clock).
    fn queued_times(
        &self,
        iters: usize,
        step: &mut dyn FnMut() -> Result<(), CliError>,
    ) -> Result<Option<Vec<f64>>, CliError> {
        let _ = (iters, step);
        Ok(None)
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
    /// Captures one run of `step` as a CUDA graph and returns its replay
    /// (which queues the same work without the host) and the bytes the graph
    /// holds; only CUDA has graphs.
    fn capture_step(
        &self,
        step: &mut dyn FnMut() -> Result<(), CliError>,
    ) -> Result<(Replay, usize), CliError> {
        let _ = step;
        Err(CliError::usage(
            "--cuda-graph: CUDA graphs need --device cuda",
        ))
    }
}

/// Queues one replay of a captured step.
type Replay = Box<dyn FnMut() -> Result<(), CliError>>;

impl BenchDevice for Cpu {
    fn finish(&self) -> Result<(), CliError> {
        Ok(())
    }
    fn label(&self) -> (&'static str, String) {
        ("cpu", format!("{} threads", self.threads()))
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
    fn allocator_counts(&self) -> Option<(u64, u64)> {
        Some(Cuda::allocator_counts(self))
    }
    fn queued_times(
        &self,
        iters: usize,
        step: &mut dyn FnMut() -> Result<(), CliError>,
    ) -> Result<Option<Vec<f64>>, CliError> {
        self.synchronize()?;
        let mut marks = Vec::with_capacity(iters);
        for _ in 0..iters {
            let start = self.mark()?;
            step()?;
            marks.push((start, self.mark()?));
        }
        // Kernel errors surface here, before any interval is read.
        self.synchronize()?;
        let times = marks
            .iter()
            .map(|(start, end)| Ok(start.ms_until(end)? / 1e3))
            .collect::<Result<Vec<_>, CliError>>()?;
        Ok(Some(times))
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
    fn capture_step(
        &self,
        step: &mut dyn FnMut() -> Result<(), CliError>,
    ) -> Result<(Replay, usize), CliError> {
        // The step's own error (a CliError) is kept aside: the capture only
        // carries kernel errors.
        let mut failed = None;
        let captured = self.capture(|_| {
            if let Err(e) = step() {
                failed = Some(e);
            }
            Ok(())
        });
        if let Some(e) = failed {
            return Err(e);
        }
        let (graph, ()) = captured?;
        let held = graph.held_bytes();
        Ok((Box::new(move || Ok(graph.replay()?)), held))
    }
}

/// Runs the benchmark `o` on the device it names and returns the report,
/// or `None` on a rank other than 0 of a multi-process run (see the module
/// docs), which reports nothing.
pub fn run(o: &BenchOptions) -> Result<Option<Value>, CliError> {
    let dist = DistEnv::from_env()?;
    let gpu = dist.as_ref().map_or(0, |env| env.local_rank);
    match o.device.as_str() {
        "cpu" => run_on(&Cpu, o, dist.as_ref()),
        "cuda" => run_on(&Cuda::new(gpu)?, o, dist.as_ref()),
        other => Err(CliError::usage(format!(
            "--device {other}: unknown device; use cpu or cuda"
        ))),
    }
}

fn run_on<B: BenchDevice + ProcessComm>(
    b: &B,
    o: &BenchOptions,
    dist: Option<&DistEnv>,
) -> Result<Option<Value>, CliError> {
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
    if o.kind != BenchKind::Attention && (o.head_dim.is_some() || o.mla) {
        return Err(CliError::usage(
            "--head-dim and --mla apply to bench attention only",
        ));
    }
    let model_only = [
        (o.micro_batches != 1, "--micro-batches"),
        (o.overlap_grad_reduce, "--overlap-grad-reduce"),
        (o.overlap_param_gather, "--overlap-param-gather"),
        (
            o.overlap_moe_expert_parallel_comm,
            "--overlap-moe-expert-parallel-comm",
        ),
        (o.ddp_bucket_size.is_some(), "--ddp-bucket-size"),
    ];
    if let Some((_, flag)) = model_only.iter().find(|(on, _)| *on) {
        if o.kind != BenchKind::Model {
            return Err(CliError::usage(format!(
                "{flag} applies to bench model only (the training step)"
            )));
        }
    }
    if o.fp8 && o.kind == BenchKind::Attention {
        return Err(CliError::usage(
            "--fp8 applies to bench gemm, moe-layer and model (the experts' GEMMs)",
        ));
    }
    let spec = bench_spec(o)?;
    let report = match (o.kind, dist) {
        (BenchKind::MoeLayer, None) if o.layout.is_none() => Some(moe_layer(b, o, &spec, dtype)?),
        (BenchKind::MoeLayer, _) => {
            return Err(CliError::usage(
                "bench moe-layer times one device: run it without foldmoe launch and --layout",
            ))
        }
        (BenchKind::Model, None) => match &o.layout {
            None => Some(model_step(b, o, &spec, dtype)?),
            Some(text) => {
                return Err(CliError::usage(format!(
                    "--layout {text}: a layout spans the processes of foldmoe launch; run \
                     `foldmoe launch --nproc-per-node N -- bench model --layout {text} ...`"
                )))
            }
        },
        (BenchKind::Model, Some(env)) => model_step_ranks(b, o, &spec, dtype, env)?,
        (BenchKind::Gemm | BenchKind::Attention, None) if o.layout.is_none() => {
            Some(if o.kind == BenchKind::Gemm {
                gemm(b, o, &spec, dtype)?
            } else {
                attention(b, o, &spec, dtype)?
            })
        }
        (BenchKind::Gemm | BenchKind::Attention, _) => return Err(CliError::usage(
            "bench gemm / attention time one device: run them without foldmoe launch and --layout",
        )),
    };
    Ok(report.map(|mut report| {
        report["backend"] = json!(backend);
        report["device"] = json!(device);
        report["dtype"] = json!(dtype_name);
        report["model"] = json!(o.model);
        report["fp8_experts"] = json!(o.fp8);
        report
    }))
}

/// The named model cut to `--layers` blocks, at `--seq-len`.
fn bench_spec(o: &BenchOptions) -> Result<ModelSpec, CliError> {
    let mut spec = super::registry()
        .spec(&o.model)
        .map_err(CliError::usage)?
        .first_layers(o.layers)
        .map_err(|e| CliError::usage(format!("--layers {}: {e}", o.layers)))?;
    if let Some(s) = o.seq_len {
        if s == 0 {
            return Err(CliError::usage("--seq-len 0: give at least one token"));
        }
        spec.seq_len = s;
    }
    if o.fp8 {
        spec.use_fp8_experts().map_err(CliError::usage)?;
    }
    Ok(spec)
}

/// Per-iteration times in seconds: `warmup` untimed runs of `step`, then
/// `iters` timed ones, each ending with `settle` (a device synchronisation,
/// and a barrier in a multi-process run), which also runs before the first.
fn time_iters(
    o: &BenchOptions,
    step: &mut dyn FnMut() -> Result<(), CliError>,
    settle: &dyn Fn() -> Result<(), CliError>,
) -> Result<Vec<f64>, CliError> {
    time_iters_counting(o, step, settle, &|| None).map(|(times, _)| times)
}

/// [`time_iters`], with the allocator's `counts` (see
/// [`BenchDevice::allocator_counts`]) over the timed iterations, as a JSON
/// object of per-iteration means (null where the device keeps none).
fn time_iters_counting(
    o: &BenchOptions,
    step: &mut dyn FnMut() -> Result<(), CliError>,
    settle: &dyn Fn() -> Result<(), CliError>,
    counts: &dyn Fn() -> Option<(u64, u64)>,
) -> Result<(Vec<f64>, Value), CliError> {
    // Progress goes to stderr (stdout is the report): a slow first step
    // (kernel compilation, allocator warm-up) is told apart from a hang.
    for i in 0..o.warmup {
        let t0 = Instant::now();
        step()?;
        settle()?;
        eprintln!(
            "bench: warm-up {}/{}: {:.3} s",
            i + 1,
            o.warmup,
            t0.elapsed().as_secs_f64()
        );
    }
    settle()?;
    let before = counts();
    let mut times = Vec::with_capacity(o.iters);
    for i in 0..o.iters {
        let t0 = Instant::now();
        step()?;
        settle()?;
        times.push(t0.elapsed().as_secs_f64());
        eprintln!(
            "bench: iteration {}/{}: {:.1} ms",
            i + 1,
            o.iters,
            times[i] * 1e3
        );
    }
    let per_iter = |n: u64| n as f64 / o.iters.max(1) as f64;
    let allocator = match (before, counts()) {
        (Some((a0, r0)), Some((a1, r1))) => json!({
            "driver_allocs_per_iter": per_iter(a1 - a0),
            "alloc_retries_per_iter": per_iter(r1 - r0),
        }),
        _ => Value::Null,
    };
    Ok((times, allocator))
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
    random_padded(b, shape, scale, seed, dtype, usize::MAX)
}

/// [`random`] with the last dimension's columns from `keep` on zero (MLA's
/// values, zero-padded to the query/key width as the MLA block gives them).
fn random_padded<B: Backend>(
    b: &B,
    shape: &[usize],
    scale: f32,
    seed: u64,
    dtype: DType,
    keep: usize,
) -> Result<Tensor<B>, CliError> {
    let n = shape.iter().product();
    let w = shape.last().copied().unwrap_or(1).max(1);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let x = rng.gen_range(-scale..scale);
            if i % w < keep {
                x
            } else {
                0.0
            }
        })
        .collect();
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
    let moe = first_moe(o, spec, "moe-layer")?;
    let (t, d) = (o.tokens, spec.hidden);
    let seq_len = spec.seq_len.min(t);
    if !t.is_multiple_of(seq_len) {
        return Err(CliError::usage(format!(
            "--tokens {t}: not a multiple of the sequence length {seq_len}"
        )));
    }
    // One rank: the layer's groups are all `[0]`, its collectives return at once.
    let groups = LayerGroups::single();
    let mut layer = MoeLayer::new(b, "bench.moe", spec, &moe, Init::full(1), dtype, groups)?;
    // The first MoE group's precision: declared, or set by `--fp8`.
    layer.experts.fp8 = spec
        .groups
        .iter()
        .find(|g| matches!(g.ffn, FfnSpec::Moe(_)))
        .is_some_and(|g| g.policy.precision == GemmPrecision::Fp8Blockwise);
    let exec = Exec::solo(b);
    let x = random(b, &[t, d], 1.0, 2, dtype)?;
    let dy = random(b, &[t, d], 1e-3, 3, dtype)?;
    let run = |layer: &mut MoeLayer<B>| -> Result<(), CliError> {
        // As in a training step (and the peer's `grad = None`): gradients
        // start from zero, not from the last iteration's, cleared without
        // writing zeros, which are written at the end for a parameter the
        // backward did not reach.
        try_each_param(|g| layer.visit_params_mut(g), |p| p.clear_grad(b))?;
        let (_y, saved, _stats) = layer.forward(&exec, &x, seq_len, t)?;
        layer.backward(&exec, &dy, saved, 1.0)?;
        try_each_param(|g| layer.visit_params_mut(g), |p| p.settle_grad(b))?;
        Ok(())
    };
    let mut step = || run(&mut layer);
    // One iteration alone to count its host waits (after compilation) and
    // the host time to queue it: when that is close to the iteration's time,
    // the device waits for launches.
    step()?;
    b.finish()?;
    let waits_before = b.host_waits();
    let t0 = Instant::now();
    step()?;
    let queue_ms = t0.elapsed().as_secs_f64() * 1e3;
    let waits = b.host_waits().zip(waits_before).map(|(a, z)| a - z);
    b.reset_peak();
    let (wall_times, allocator) =
        time_iters_counting(o, &mut step, &|| b.finish(), &|| b.allocator_counts())?;
    let (wall_median, wall_min) = median_min(&wall_times);
    let queued = b.queued_times(o.iters, &mut step)?;
    let (median, min) = median_min(queued.as_deref().unwrap_or(&wall_times));
    let flops = moe_flops_per_token(d, &moe) * t as f64;
    // The eager iterations' peak (a graph's held memory comes on top).
    let peak = b.peak_bytes();
    let graph = if o.cuda_graph {
        let eager = grad_sums(b, &layer)?;
        let (mut replay, held) = b.capture_step(&mut || run(&mut layer))?;
        eprintln!("bench: captured one iteration as a CUDA graph");
        let graph_times = time_iters(o, &mut replay, &|| b.finish())?;
        let replayed = grad_sums(b, &layer)?;
        let (g_median, g_min) = median_min(&graph_times);
        Some(json!({
            "time_ms": g_median * 1e3,
            "time_ms_min": g_min * 1e3,
            "tflops": flops / g_median / 1e12,
            "held_gib": held as f64 / (1u64 << 30) as f64,
            "grad_sums_max_rel_diff": max_rel_diff(&replayed, &eager),
        }))
    } else {
        None
    };
    Ok(json!({
        "bench": "moe-layer",
        "dims": {
            "tokens": t, "hidden": d, "experts": moe.experts, "top_k": moe.top_k,
            "expert_ffn": moe.expert_ffn, "shared_ffn": moe.shared_ffn, "seq_len": seq_len,
        },
        "flops": flops,
        "timing": timing_method(queued.is_some()),
        "time_ms": median * 1e3,
        "time_ms_min": min * 1e3,
        "tflops": flops / median / 1e12,
        "wall_time_ms": wall_median * 1e3,
        "wall_time_ms_min": wall_min * 1e3,
        "host_waits_per_iter": waits,
        "host_queue_ms": queue_ms,
        "peak_mem_gib": peak.map(|p| p as f64 / (1u64 << 30) as f64),
        "allocator": allocator,
        "iters": o.iters,
        "graph": graph,
    }))
}

/// The sum of squares of every parameter's gradient of `layer`, on the host:
/// a cheap fingerprint to compare two runs' gradients.
fn grad_sums<B: BenchDevice>(b: &B, layer: &MoeLayer<B>) -> Result<Vec<f64>, CliError> {
    let mut squares = Vec::new();
    layer.visit_params(&mut |p| squares.push(b.sum_squares(&p.grad)));
    squares
        .into_iter()
        .map(|s| Ok(b.download(&s?)?.to_f64()[0]))
        .collect()
}

/// The largest `|a - b| / max(|b|, tiny)` over paired values.
fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(f64::MIN_POSITIVE))
        .fold(0.0, f64::max)
}

/// The first MoE block's dims of `spec`, or a usage error naming `what`.
fn first_moe(o: &BenchOptions, spec: &ModelSpec, what: &str) -> Result<MoeSpec, CliError> {
    spec.groups
        .iter()
        .find_map(|g| match &g.ffn {
            FfnSpec::Moe(m) => Some(m.clone()),
            FfnSpec::Dense { .. } => None,
        })
        .ok_or_else(|| {
            CliError::usage(format!(
                "{what}: {} has no MoE block in its first {} layers",
                o.model, o.layers
            ))
        })
}

/// Median seconds of `f` over `--iters` after `--warmup`: timed on the
/// device with the calls queued back to back where it can
/// ([`BenchDevice::queued_times`]), else by the wall clock around each
/// synchronised call.
fn time_op(
    b: &impl BenchDevice,
    o: &BenchOptions,
    f: &mut dyn FnMut() -> Result<(), CliError>,
) -> Result<f64, CliError> {
    // At least one warm-up: the first call compiles the kernels.
    let opts = BenchOptions {
        warmup: o.warmup.max(1),
        ..o.clone()
    };
    let wall = time_iters(&opts, f, &|| b.finish())?;
    let times = b.queued_times(o.iters, f)?.unwrap_or(wall);
    Ok(median_min(&times).0)
}

/// How `b`'s op times are taken ([`time_op`]), for the report.
fn op_timing(b: &impl BenchDevice) -> Result<&'static str, CliError> {
    Ok(timing_method(b.queued_times(0, &mut || Ok(()))?.is_some()))
}

/// What a report's times are: see the module docs.
fn timing_method(queued: bool) -> &'static str {
    if queued {
        "device events, iterations queued back to back"
    } else {
        "wall clock, each iteration synchronised"
    }
}

/// `bench gemm`: the grouped GEMMs of the first MoE block on
/// `--tokens · top_k` routed rows in `experts` equal groups: fc1 (one of the
/// gate / up projections, hidden → expert_ffn) and fc2 (expert_ffn →
/// hidden), each as the forward (`x · w[g]`), the data gradient
/// (`dy · w[g]ᵀ`) and the weight gradient (`x_gᵀ dy_g`); 2·M·K·N FLOPs each.
/// With `--fp8`, the same three products on blockwise e4m3 operands
/// quantised once before the timing (`x`, `dy` in 1 × 128 row tiles for the
/// forward and data gradient, in per-group column tiles for the weight
/// gradient; `w` in 128 × 128 blocks stored as each product reads it),
/// output in the bench's dtype; `fp8_vs_bf16` is the bf16 time over the
/// fp8 one. (Where a product has no fp8 kernel — every product off
/// Hopper — its row times the emulation: dequantise, then the f32 grouped
/// GEMM.)
fn gemm<B: BenchDevice>(
    b: &B,
    o: &BenchOptions,
    spec: &ModelSpec,
    dtype: DType,
) -> Result<Value, CliError> {
    let moe = first_moe(o, spec, "gemm")?;
    let (m, g) = (o.tokens * moe.top_k, moe.experts);
    if !m.is_multiple_of(g) {
        return Err(CliError::usage(format!(
            "--tokens {}: {m} routed rows do not split into {g} equal groups",
            o.tokens
        )));
    }
    let sizes = b.upload(HostData::I32(vec![(m / g) as i32; g]), &[g])?;
    let mut rows = Vec::new();
    for (name, k, n) in [
        ("fc1", spec.hidden, moe.expert_ffn),
        ("fc2", moe.expert_ffn, spec.hidden),
    ] {
        let x = random(b, &[m, k], 1.0, 5, dtype)?;
        let w = random(b, &[g, k, n], 0.02, 6, dtype)?;
        let dy = random(b, &[m, n], 1.0, 7, dtype)?;
        let flops = 2.0 * (m * k * n) as f64;
        let fwd = time_op(b, o, &mut || {
            b.grouped_matmul(&x, &w, &sizes, false)?;
            Ok(())
        })?;
        let dgrad = time_op(b, o, &mut || {
            b.grouped_matmul(&dy, &w, &sizes, true)?;
            Ok(())
        })?;
        let wgrad = time_op(b, o, &mut || {
            b.grouped_matmul_weight_grad(&x, &dy, &sizes)?;
            Ok(())
        })?;
        for (product, t) in [("forward", fwd), ("dgrad", dgrad), ("wgrad", wgrad)] {
            rows.push(json!({
                "shape": name, "product": product, "m": m, "k": k, "n": n, "groups": g,
                "time_ms": t * 1e3, "tflops": flops / t / 1e12,
            }));
        }
        if o.fp8 {
            let q = |t: &Tensor<B>, tiles, s: bool| b.quantize_fp8(t, tiles, s.then_some(&sizes));
            let (xr, dyr) = (
                q(&x, Fp8Tiles::Rows, false)?,
                q(&dy, Fp8Tiles::Rows, false)?,
            );
            let (xc, dyc) = (
                q(&x, Fp8Tiles::GroupColumns, true)?,
                q(&dy, Fp8Tiles::GroupColumns, true)?,
            );
            let wt = q(&w, Fp8Tiles::Blocks { transposed: true }, false)?;
            let wn = q(&w, Fp8Tiles::Blocks { transposed: false }, false)?;
            let fwd8 = time_op(b, o, &mut || {
                b.grouped_matmul_fp8(&xr, &wt, &sizes, false, dtype)?;
                Ok(())
            })?;
            let dgrad8 = time_op(b, o, &mut || {
                b.grouped_matmul_fp8(&dyr, &wn, &sizes, true, dtype)?;
                Ok(())
            })?;
            let wgrad8 = time_op(b, o, &mut || {
                b.grouped_matmul_weight_grad_fp8(&xc, &dyc, &sizes, dtype)?;
                Ok(())
            })?;
            for (product, t, t16) in [
                ("forward_fp8", fwd8, fwd),
                ("dgrad_fp8", dgrad8, dgrad),
                ("wgrad_fp8", wgrad8, wgrad),
            ] {
                rows.push(json!({
                    "shape": name, "product": product, "m": m, "k": k, "n": n, "groups": g,
                    "time_ms": t * 1e3, "tflops": flops / t / 1e12, "fp8_vs_bf16": t16 / t,
                }));
            }
        }
    }
    Ok(json!({ "bench": "gemm", "timing": op_timing(b)?, "results": rows, "iters": o.iters }))
}

/// `bench attention`: causal grouped-query attention of the model's heads
/// on `--tokens / --seq-len` sequences, forward and backward timed apart.
/// FLOPs count the causal half as BENCHMARKS.md does: forward
/// B·Hq·S²·(Hqk + Hv) (2·B·Hq·S²·Hd at one head dim), backward twice that;
/// with `--mla` the counted value width is 128 though the kernel runs the
/// zero-padded 192.
fn attention<B: BenchDevice>(
    b: &B,
    o: &BenchOptions,
    spec: &ModelSpec,
    dtype: DType,
) -> Result<Value, CliError> {
    let a = &spec
        .groups
        .first()
        .ok_or_else(|| CliError::usage(format!("attention: {} has no blocks", o.model)))?
        .attention;
    let (hq, hkv) = (a.heads, a.kv_heads);
    let (hd, hv) = match (o.mla, o.head_dim) {
        (true, None | Some(192)) => (192, 128),
        (true, Some(h)) => {
            return Err(CliError::usage(format!(
                "--mla with --head-dim {h}: MLA's query/key width is 192"
            )))
        }
        (false, h) => (h.unwrap_or(a.head_dim), h.unwrap_or(a.head_dim)),
    };
    if hd == 0 {
        return Err(CliError::usage("--head-dim 0: give a positive head dim"));
    }
    let s = spec.seq_len;
    if !o.tokens.is_multiple_of(s) {
        return Err(CliError::usage(format!(
            "--tokens {}: not a multiple of the sequence length {s}",
            o.tokens
        )));
    }
    let batch = o.tokens / s;
    let q = random(b, &[batch, s, hq, hd], 1.0, 11, dtype)?;
    let k = random(b, &[batch, s, hkv, hd], 1.0, 12, dtype)?;
    // With --mla, v and the output's gradient are zero past the value width,
    // as the MLA block builds them (its backward may read only those columns).
    let v = random_padded(b, &[batch, s, hkv, hd], 1.0, 13, dtype, hv)?;
    let d_o = random_padded(b, &[batch, s, hq, hd], 1.0, 14, dtype, hv)?;
    let (out, lse) = b.attention(&q, &k, &v, None)?;
    let fwd = time_op(b, o, &mut || {
        b.attention(&q, &k, &v, None)?;
        Ok(())
    })?;
    let bwd = time_op(b, o, &mut || {
        b.attention_backward_padded_values(&d_o, &q, &k, &v, &out, &lse, None, hv)?;
        Ok(())
    })?;
    let fwd_flops = (batch * hq * s * s * (hd + hv)) as f64;
    Ok(json!({
        "bench": "attention",
        "timing": op_timing(b)?,
        "dims": { "batch": batch, "seq_len": s, "heads": hq, "kv_heads": hkv,
                  "head_dim": hd, "value_dim": hv, "causal": true },
        "forward_ms": fwd * 1e3,
        "forward_tflops": fwd_flops / fwd / 1e12,
        "backward_ms": bwd * 1e3,
        "backward_tflops": 2.0 * fwd_flops / bwd / 1e12,
        "iters": o.iters,
    }))
}

/// The model cut for `model`, checked, and its sequences per micro-batch.
fn checked_model(o: &BenchOptions, spec: &ModelSpec) -> Result<usize, CliError> {
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
    Ok(t / s)
}

/// `(inputs, targets)` of `n` random tokens each, the same on every rank
/// for the same `n`: a multi-process run draws the global batch and each
/// dp rank takes its part, so it steps on the batch one device would.
fn random_tokens(n: usize, vocab: usize) -> (Vec<i32>, Vec<i32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut tokens = || -> Vec<i32> { (0..n).map(|_| rng.gen_range(0..vocab as i32)).collect() };
    (tokens(), tokens())
}

/// `model` on one device: the engine's one-rank run, the layout `world = 1`
/// on this thread ([`SoloComm`], as `foldmoe train` runs one rank), through
/// the same [`rank_step`] as a rank of [`model_step_ranks`].
fn model_step<B: BenchDevice>(
    b: &B,
    o: &BenchOptions,
    spec: &ModelSpec,
    dtype: DType,
) -> Result<Value, CliError> {
    checked_model(o, spec)?;
    let layout = dist::resolve_layout(Some(""), 1, "one device:", spec, &[])?
        .expect("a layout text always resolves to a layout");
    let rank = RankLayout::new(&layout, 0)?;
    let report = rank_step(b, o, spec, dtype, &SoloComm, &layout, rank)?;
    Ok(report.expect("rank 0 reports"))
}

/// `model` as rank `env.rank` of a multi-process run under `--layout`
/// (default dp over all ranks); the report on rank 0 only.
fn model_step_ranks<B: BenchDevice + ProcessComm>(
    b: &B,
    o: &BenchOptions,
    spec: &ModelSpec,
    dtype: DType,
    env: &DistEnv,
) -> Result<Option<Value>, CliError> {
    checked_model(o, spec)?;
    // Everything that can be refused is checked before connecting, so a bad
    // flag stops every rank at once instead of leaving peers waiting.
    let text = o.layout.as_deref().unwrap_or("");
    let declared = super::registry()
        .layouts(&o.model)
        .map(|(_, layouts)| layouts)
        .unwrap_or_default();
    let layout = dist::resolve_layout(Some(text), env.world, "WORLD_SIZE =", spec, &declared)?
        .expect("a layout text always resolves to a layout");
    let rank = RankLayout::new(&layout, env.rank)?;
    let comm = dist::connect(b, env, crate::cli::launch::comm_timeout()?, Some(&layout))?;
    let outcome = rank_step(b, o, spec, dtype, comm.as_ref(), &layout, rank);
    // A failed rank ends its communicator, so its peers stop too.
    if let Err(e) = &outcome {
        comm.abort(&e.to_string());
    }
    outcome
}

/// One rank's share of [`model_step_ranks`] (or [`model_step`]'s only rank), on `comm`.
fn rank_step<B: BenchDevice>(
    b: &B,
    o: &BenchOptions,
    spec: &ModelSpec,
    dtype: DType,
    comm: &dyn Communicator<B>,
    layout: &Layout,
    rank: RankLayout,
) -> Result<Option<Value>, CliError> {
    let (t, s) = (o.tokens, spec.seq_len);
    let world = Group::new((0..layout.world).collect());
    let timed = TimedComm::new(comm);
    // A fresh trainer's moments are zero, so the shards start from
    // `Trainer::new` rather than from a full trainer's state.
    let t0 = Instant::now();
    let model = Model::new(b, spec, rank.clone(), 1, dtype)?;
    let cfg = TrainConfig {
        ddp: DdpConfig {
            overlap_grad_reduce: o.overlap_grad_reduce,
            overlap_param_gather: o.overlap_param_gather,
            bucket_size: o.ddp_bucket_size,
        },
        overlap_moe_comm: o.overlap_moe_expert_parallel_comm,
        ..TrainConfig::default()
    };
    let mut trainer = Trainer::new(b, model, cfg)?;
    eprintln!(
        "bench: rank {}: shard and optimizer ready at {:.1} s",
        rank.rank,
        t0.elapsed().as_secs_f64()
    );
    let ctx = Ctx {
        b,
        comm: &timed,
        rank: &rank,
    };
    let (dp, dp_i) = (rank.dp.size(), rank.dp_index);
    let m = o.micro_batches;
    if m == 0 || !t.is_multiple_of(m * s) {
        return Err(CliError::usage(format!(
            "--micro-batches {m}: --tokens {t} must split into that many micro-batches of \
             whole sequences of {s}"
        )));
    }
    let (x, y) = random_tokens(dp * t, spec.vocab);
    let per = t / m;
    let mine: Vec<(Vec<i32>, Vec<i32>)> = (0..m)
        .map(|k| {
            let at = dp_i * t + k * per;
            (x[at..at + per].to_vec(), y[at..at + per].to_vec())
        })
        .collect();
    let mut last_loss = f64::NAN;
    // Seconds of every step (warmup included) the rank was blocked in
    // collectives (exposed), and that collectives ran (total: started ones
    // on the progress thread too, overlapped with compute or not).
    let mut comm_seconds = Vec::with_capacity(o.warmup + o.iters);
    b.reset_peak();
    let mut step = || -> Result<(), CliError> {
        let before = (timed.elapsed(), timed.busy());
        last_loss = trainer.step(&ctx, &mine, s)?.loss;
        comm_seconds.push((
            (timed.elapsed() - before.0).as_secs_f64(),
            (timed.busy() - before.1).as_secs_f64(),
        ));
        Ok(())
    };
    // The compute stream's waits for communication of each iteration,
    // timed on the device (NCCL; `None` on the host communicators).
    let device_waits = std::cell::RefCell::new(Vec::new());
    // The barrier goes around `timed`: waiting there is not the step's.
    let settle = || -> Result<(), CliError> {
        b.finish()?;
        let waited = timed.device_wait_time()?;
        comm.barrier(&world)?;
        // The barrier's own device wait is not the step's either.
        comm.device_wait_time()?;
        device_waits.borrow_mut().push(waited);
        Ok(())
    };
    let (times, allocator) = time_iters_counting(o, &mut step, &settle, &|| b.allocator_counts())?;
    if rank.rank != 0 {
        return Ok(None);
    }
    let (median, min) = median_min(&times);
    let (params, active) = spec.param_counts();
    let global_tokens = dp * t;
    let flops = spec.flops_per_token() as f64 * global_tokens as f64;
    let tflops = flops / layout.world as f64 / median / 1e12;
    let timed = &comm_seconds[comm_seconds.len() - o.iters..];
    let host_exposed: f64 = timed.iter().map(|c| c.0).sum();
    let total: f64 = timed.iter().map(|c| c.1).sum();
    let per_step_ms = |s: f64| s / o.iters.max(1) as f64 * 1e3;
    // A device communicator's exposed time is the compute stream's timed
    // waits (its calls return once queued); a host one's, the time blocked.
    let device_waits = device_waits.into_inner();
    let device_exposed: Option<f64> = device_waits[device_waits.len() - o.iters..]
        .iter()
        .map(|w| w.map(|d| d.as_secs_f64()))
        .sum();
    let (exposed, exposed_source) = match device_exposed {
        Some(d) => (d, "device events"),
        None => (host_exposed, "host clock"),
    };
    Ok(Some(json!({
        "bench": "model",
        "dims": {
            "layers": spec.layers(), "hidden": spec.hidden, "vocab": spec.vocab,
            "seq_len": s, "tokens": t, "params": params, "active_params": active,
            "micro_batches": m,
        },
        "world": layout.world,
        "layout": layout.spec().to_string(),
        "overlap": {
            "grad_reduce": o.overlap_grad_reduce,
            "param_gather": o.overlap_param_gather,
            "moe_expert_parallel_comm": o.overlap_moe_expert_parallel_comm,
        },
        "tokens_per_step": global_tokens,
        "tokens_per_gpu": global_tokens as f64 / layout.world as f64,
        "flops_per_step": flops,
        "time_ms": median * 1e3,
        "time_ms_min": min * 1e3,
        "tokens_per_s": global_tokens as f64 / median,
        "tflops": tflops,
        "mfu": b.peak_flops().map(|p| tflops * 1e12 / p),
        "comm_share": exposed / times.iter().sum::<f64>(),
        "comm_exposed_ms": per_step_ms(exposed),
        "comm_exposed_source": exposed_source,
        "comm_blocked_host_ms": per_step_ms(host_exposed),
        "comm_total_ms": per_step_ms(total),
        "peak_mem_gib": b.peak_bytes().map(|p| p as f64 / (1u64 << 30) as f64),
        "allocator": allocator,
        "last_loss": last_loss,
        "iters": o.iters,
    })))
}
