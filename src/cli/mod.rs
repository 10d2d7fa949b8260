//! The command line of foldmoe for any binary: `train` (the default),
//! `launch`, `generate`, `plan`, `bench`, `preprocess`, `train-tokenizer`, `report`,
//! over the models of the
//! [`Registry`] the binary gives [`main`]. The `foldmoe` command is
//! `foldmoe::cli::main(foldmoe::models::registry())`; a model crate's binary is
//! `foldmoe::cli::main(foldmoe::models![MyMoe, MyMoeSmall])`.

mod bench;
mod convert;
mod dist;
mod error;
mod generate;
mod launch;
mod plan;
mod plot;
mod preprocess;
mod report;
mod score;
mod settings;
mod tensorboard;
mod train;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use clap::{Parser, Subcommand};
use foldmoe::core::engine::declared::Registry;
use foldmoe::kernels::comm::rendezvous::DistEnv;
use foldmoe::kernels::cpu::Cpu;
use foldmoe::kernels::cuda::Cuda;

use crate::cli::error::CliError;
use crate::cli::settings::TrainOptions;

/// Train and run Mixture-of-Experts language models.
#[derive(Parser)]
#[command(name = "foldmoe", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model on the bundled text or Megatron datasets (the default command).
    Train(Box<TrainOptions>),
    /// Run a command (`train`) as one process per rank on this node.
    Launch(launch::LaunchOptions),
    /// Parameters, FLOPs per token, process groups, memory per GPU and communication of a model under a layout.
    Plan {
        /// Model name (default: the binary's first model, `tiny` for `foldmoe`).
        #[arg(long)]
        model: Option<String>,
        /// Model config file (TOML, the keys of `#[moe_model]`), instead of `--model`.
        #[arg(long, value_name = "FILE", conflicts_with = "model")]
        model_config: Option<PathBuf>,
        /// Layout, e.g. `world=1024,pp=16,ep=64` (default: the model's first declared layout).
        #[arg(long)]
        layout: Option<String>,
        /// World size (overrides the layout's).
        #[arg(long)]
        ranks: Option<usize>,
        /// Rank whose process groups are listed.
        #[arg(long, default_value_t = 0)]
        rank: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Sequences per micro-batch, for the activation estimate.
        #[arg(long, default_value_t = 1)]
        micro_batch_size: usize,
        /// Micro-batches per step on each dp rank (default: pp, the fewest that fill the 1F1B pipeline).
        #[arg(long)]
        micro_batches: Option<usize>,
        /// Recompute these parts in every group (`norm,moe_act`, `block`; `none`: keep all), instead of the declared policy.
        #[arg(long, value_name = "LIST")]
        recompute: Option<String>,
        /// Offload these tensors to host memory in every group (`qkv,expert_fc1`; `none`), instead of the declared policy.
        #[arg(long, value_name = "LIST")]
        offload: Option<String>,
        /// Store these saved tensors in fp8 (e4m3) in every group (`expert_fc1,moe_act`; `none`), instead of the declared policy.
        #[arg(long = "store-fp8", value_name = "LIST")]
        store_fp8: Option<String>,
        /// Plan for `train --overlap-moe-expert-parallel-comm`: one more model chunk counted in flight (a bound).
        #[arg(long)]
        overlap_moe_expert_parallel_comm: bool,
    },
    /// Time one MoE layer or a training step; prints JSON (see benchmarks/README.md).
    Bench(bench::BenchOptions),
    /// Tokenize a .jsonl or text file into a Megatron indexed dataset (PATH.bin, PATH.idx).
    Preprocess(preprocess::PreprocessOptions),
    /// Train a byte-level BPE tokenizer.json on text or .jsonl files.
    TrainTokenizer(preprocess::TrainTokenizerOptions),
    /// Per-token log-probabilities, mean loss and perplexity of a text under a checkpoint.
    Score {
        /// Run directory or checkpoint directory.
        #[arg(long)]
        checkpoint: PathBuf,
        /// Text file to score.
        #[arg(
            long,
            value_name = "FILE",
            conflicts_with = "data_path",
            required_unless_present = "data_path"
        )]
        input: Option<PathBuf>,
        /// Megatron indexed dataset to score instead (`PATH` of
        /// `PATH.bin`/`PATH.idx`): each document on its own.
        #[arg(long, value_name = "PATH")]
        data_path: Option<PathBuf>,
        /// Hugging Face `tokenizer.json` that reads the text (default: one token per byte).
        #[arg(long, value_name = "FILE")]
        tokenizer: Option<PathBuf>,
        /// Print JSON with every token's log-probability.
        #[arg(long)]
        json: bool,
    },
    /// Print a run's summary (loss, validation loss, expert loads) and redraw its loss.png and load_heatmap.png.
    Report {
        /// The run directory (`--out` of `train`).
        #[arg(value_name = "RUN_DIR")]
        run_dir: PathBuf,
    },
    /// Convert Hugging Face models (Mixtral, Qwen3-MoE, DeepSeek-V3) to foldmoe checkpoints and back.
    Convert(convert::ConvertOptions),
    /// Continue a prompt with a trained checkpoint.
    Generate {
        /// Run directory or checkpoint directory.
        #[arg(long)]
        checkpoint: PathBuf,
        /// Text to continue.
        #[arg(long, default_value = "")]
        prompt: String,
        /// Bytes to generate.
        #[arg(long, default_value_t = 200)]
        tokens: usize,
        /// Sampling temperature (0: greedy).
        #[arg(long, default_value_t = 0.8)]
        temperature: f64,
        /// Sampling seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write control bytes as they are even on a terminal (by default a
        /// terminal gets them as `\xNN`).
        #[arg(long)]
        raw: bool,
    },
}

impl Default for Command {
    fn default() -> Self {
        Command::Train(Box::default())
    }
}

/// Fails with a clear message unless the named device (GPU `ordinal` for
/// cuda) can be used.
fn check_device(name: &str, ordinal: usize) -> Result<(), CliError> {
    if name == "cuda" {
        Cuda::new(ordinal)?;
    }
    Ok(())
}

fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command.unwrap_or_default() {
        Command::Train(opts) => {
            // Started by `foldmoe launch` (or torchrun-style variables):
            // this process is one rank of a multi-process run.
            let dist = DistEnv::from_env()?;
            let gpu = dist.as_ref().map_or(0, |env| env.local_rank);
            if let Some(device) = &opts.device {
                check_device(device, gpu)?;
            }
            let stop = Arc::new(AtomicBool::new(false));
            let flag = stop.clone();
            ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
                .map_err(|e| CliError::usage(format!("cannot install the Ctrl-C handler: {e}")))?;
            // The run goes to the backend it names; a device that cannot be
            // used was refused above, so nothing falls back to the CPU.
            let cuda = opts.device.as_deref() == Some("cuda");
            match dist {
                None if cuda => train::run(&Cuda::new(0)?, *opts, stop),
                None => train::run(&Cpu, *opts, stop),
                Some(env) => {
                    let timeout = launch::comm_timeout()?;
                    if cuda {
                        train::run_process(&Cuda::new(gpu)?, *opts, stop, &env, timeout)
                    } else {
                        train::run_process(&Cpu, *opts, stop, &env, timeout)
                    }
                }
            }
        }
        Command::Launch(opts) => launch::run(opts),
        Command::Plan {
            model,
            model_config,
            layout,
            ranks,
            rank,
            json,
            micro_batch_size,
            micro_batches,
            recompute,
            offload,
            store_fp8,
            overlap_moe_expert_parallel_comm,
        } => {
            let model = model.unwrap_or_else(|| registry().default_name().unwrap_or("tiny").into());
            let source = match &model_config {
                Some(path) => plan::ModelSource::Config(path),
                None => plan::ModelSource::Name(&model),
            };
            let memory = plan::MemoryFlags {
                micro_batch_size,
                micro_batches,
                recompute: recompute.as_deref(),
                offload: offload.as_deref(),
                store_fp8: store_fp8.as_deref(),
                overlap_moe_comm: overlap_moe_expert_parallel_comm,
            };
            println!(
                "{}",
                plan::run(source, layout.as_deref(), ranks, rank, json, &memory)?
            );
            Ok(())
        }
        Command::Score {
            checkpoint,
            input,
            data_path,
            tokenizer,
            json,
        } => {
            let tok = tokenizer.as_deref();
            let line = match (input, data_path) {
                (Some(input), _) => score::run(&Cpu, &checkpoint, &input, tok, json)?,
                (None, Some(prefix)) => score::run_dataset(&Cpu, &checkpoint, &prefix, json)?,
                (None, None) => unreachable!("clap requires --input or --data-path"),
            };
            println!("{line}");
            Ok(())
        }
        Command::Report { run_dir } => {
            println!("{}", report::run(&run_dir)?);
            Ok(())
        }
        Command::Convert(opts) => {
            println!("{}", convert::run(&opts)?);
            Ok(())
        }
        Command::Preprocess(o) => {
            println!("{}", preprocess::run(&o)?);
            Ok(())
        }
        Command::TrainTokenizer(o) => {
            println!("{}", preprocess::train_tokenizer(&o)?);
            Ok(())
        }
        Command::Bench(o) => {
            if let Some(report) = bench::run(&o)? {
                println!("{report}");
            }
            Ok(())
        }
        Command::Generate {
            checkpoint,
            prompt,
            tokens,
            temperature,
            seed,
            raw,
        } => {
            let stop = Arc::new(AtomicBool::new(false));
            let flag = stop.clone();
            ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
                .map_err(|e| CliError::usage(format!("cannot install the Ctrl-C handler: {e}")))?;
            let made = generate::run(
                &Cpu,
                &checkpoint,
                &prompt,
                tokens,
                temperature,
                seed,
                raw,
                &stop,
            )?;
            if stop.load(Ordering::SeqCst) {
                return Err(CliError::Exit {
                    code: 130,
                    msg: format!("interrupted after {made} bytes"),
                });
            }
            Ok(())
        }
    }
}

/// The models this process serves, set once by [`main`].
static REGISTRY: OnceLock<Registry> = OnceLock::new();

/// The models of this binary: what [`main`] was given (the shipped models
/// when the CLI's functions run without it, as in tests).
pub(crate) fn registry() -> &'static Registry {
    REGISTRY.get_or_init(foldmoe::models::registry)
}

/// Tells glibc's allocator to keep freed memory for reuse: a training step
/// frees and reallocates the same large activation buffers every op, and by
/// default glibc maps big ones afresh and returns the heap top to the
/// kernel, so each step pays page faults and zeroing for memory it just
/// gave back (13 % of the CPU time of a `tiny` step, BENCHMARKS.md). Up to
/// 1 GiB of freed heap is kept; buffers above 32 MiB (glibc's largest
/// threshold) are still mapped.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets allocator parameters; it is called before
    // any thread of this program starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// Runs the command line over `models` and exits: the whole of a binary's
/// `main`. Errors are one `error: ...` line on stderr and the exit status
/// they carry.
pub fn main(models: Registry) -> ! {
    // The first registration wins; a second call in one process keeps it.
    let _ = REGISTRY.set(models);
    keep_freed_memory();
    if let Err(e) = run(Cli::parse()) {
        // One write of the whole line: the ranks of `foldmoe launch` share
        // stderr, and `eprintln!` writes in pieces that would interleave.
        let line = format!("error: {e}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        std::process::exit(e.exit_code());
    }
    std::process::exit(0)
}
