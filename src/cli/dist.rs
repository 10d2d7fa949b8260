//! What `train` and `bench` share to run as one rank of a multi-process run
//! (`foldmoe launch`): the layout over the ranks, and this process's
//! communicator (TCP on the CPU, NCCL on CUDA), so both commands read
//! `--layout` and connect in one way.

use std::time::Duration;

use foldmoe::core::engine::parallel::RankLayout;
use foldmoe::core::layout::{self, Layout, LayoutSpec};
use foldmoe::core::spec::ModelSpec;
use foldmoe::kernels::comm::rendezvous::{DistEnv, Rendezvous};
use foldmoe::kernels::comm::tcp::TcpComm;
use foldmoe::kernels::cpu::Cpu;
use foldmoe::kernels::cuda::nccl::{NcclComm, UNIQUE_ID_BYTES};
use foldmoe::kernels::cuda::Cuda;
use foldmoe::kernels::{Backend, Communicator, Group};

use crate::cli::error::CliError;

/// The layout `text` (`--layout`) over `ranks` ranks, checked against
/// `spec` with the same messages as the macro. No text means dp over all
/// ranks, and no layout at all for one rank (a plain one-rank run). A
/// `world` in the text must agree with `ranks`, which an error names as
/// `{ranks_from} {ranks}` (`--ranks 2`, `WORLD_SIZE = 2`). The name of one
/// of `declared` (the model's declared layouts, `--layout dgx-h100`)
/// selects that layout, whose world must agree with `ranks` too.
pub fn resolve_layout(
    text: Option<&str>,
    ranks: usize,
    ranks_from: &str,
    spec: &ModelSpec,
    declared: &[LayoutSpec],
) -> Result<Option<Layout>, CliError> {
    let text = match (text, ranks) {
        (None, 1) => return Ok(None),
        (Some(t), _) => t,
        (None, _) => "",
    };
    if let Some(named) = declared.iter().find(|l| l.name == text.trim()) {
        if named.world != ranks {
            return Err(CliError::usage(format!(
                "--layout {text}: the declared layout spans world = {} but {ranks_from} {ranks}; \
                 they must agree",
                named.world
            )));
        }
        let layout = layout::check(named, spec).map_err(|errors| {
            let msgs: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
            CliError::usage(format!("--layout {text}: {}", msgs.join("; ")))
        })?;
        return Ok(Some(layout));
    }
    let mut layout_spec =
        LayoutSpec::parse(text).map_err(|e| CliError::usage(format!("--layout {text}: {e}")))?;
    if text.split(',').any(|kv| kv.trim().starts_with("world")) {
        if layout_spec.world != ranks {
            return Err(CliError::usage(format!(
                "--layout {text}: world = {} but {ranks_from} {ranks}; they must agree (or leave \
                 world out)",
                layout_spec.world
            )));
        }
    } else {
        layout_spec.world = ranks;
    }
    let layout = layout::check(&layout_spec, spec).map_err(|errors| {
        let msgs: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
        CliError::usage(format!("--layout {text}: {}", msgs.join("; ")))
    })?;
    Ok(Some(layout))
}

/// This process's communicator in a run of `env.world` processes, with the
/// groups of this rank under `layout` ready (no layout: the world alone).
pub fn connect<B: ProcessComm>(
    b: &B,
    env: &DistEnv,
    timeout: Duration,
    layout: Option<&Layout>,
) -> Result<Box<dyn Communicator<B>>, CliError> {
    let groups = match layout {
        Some(layout) => RankLayout::new(layout, env.rank)?.groups(),
        None => vec![Group::new((0..env.world).collect())],
    };
    b.process_comm(env, timeout, &groups)
}

/// A backend whose processes can form a multi-process run.
pub trait ProcessComm: Backend {
    /// The communicator of this process, rank `env.rank` of `env.world`,
    /// with a communicator ready for each of `groups` (this rank's groups,
    /// kind by kind, in the same order on every rank). Blocks until every
    /// rank has joined, or `timeout` passes.
    fn process_comm(
        &self,
        env: &DistEnv,
        timeout: Duration,
        groups: &[Group],
    ) -> Result<Box<dyn Communicator<Self>>, CliError>;
}

impl ProcessComm for Cpu {
    /// A full TCP mesh; it serves any group, so `groups` is not needed.
    fn process_comm(
        &self,
        env: &DistEnv,
        timeout: Duration,
        _groups: &[Group],
    ) -> Result<Box<dyn Communicator<Self>>, CliError> {
        Ok(Box::new(TcpComm::connect(env, timeout)?))
    }
}

impl ProcessComm for Cuda {
    /// NCCL on GPU `env.local_rank` (this handle's): rank 0 makes the NCCL
    /// unique id and the rendezvous on MASTER_ADDR:MASTER_PORT hands it to
    /// every rank; then each of `groups` gets its NCCL communicator.
    fn process_comm(
        &self,
        env: &DistEnv,
        timeout: Duration,
        groups: &[Group],
    ) -> Result<Box<dyn Communicator<Self>>, CliError> {
        let rendezvous = Rendezvous::connect(env, timeout)?;
        let id = match env.rank {
            0 => Some(NcclComm::unique_id()?),
            _ => None,
        };
        let blob = rendezvous.broadcast_blob(id.as_ref().map(|id| &id[..]))?;
        let id: [u8; UNIQUE_ID_BYTES] = blob.try_into().map_err(|b: Vec<u8>| {
            CliError::usage(format!(
                "rank {}: the NCCL id from rank 0 has {} bytes, not {UNIQUE_ID_BYTES}",
                env.rank,
                b.len()
            ))
        })?;
        Ok(Box::new(NcclComm::new(
            self, env.rank, env.world, &id, groups,
        )?))
    }
}
