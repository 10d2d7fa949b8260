//! Distributed checkpoints: each rank writes only what it owns; any layout,
//! or one rank, reads back only the slices it needs.
//!
//! A checkpoint is a directory `step-00000100/` under a checkpoint root
//! (`<run>/checkpoints/`), holding:
//! - `rank-00003.safetensors`: rank 3's pieces as 1-d tensors, streamed one
//!   piece at a time (parameters in their training dtype, f32 masters and
//!   AdamW moments in the optimizer's state dtype);
//! - `rank-00003.json`: rank 3's list of [`Piece`]s;
//! - `index.json`, written last by rank 0: every global tensor's shape and
//!   dtype, every piece (tensor, block, flat range, file, byte range,
//!   SHA-256), the step and the caller's metadata.
//!
//! A piece is a contiguous range of the row-major flattening of one block
//! of a global tensor: the distributed optimizer's chunk of a rank cuts its
//! blocks so (Megatron-Core's flattened ranges). Reading a region (a block
//! and a flat range of it, under the new layout) intersects it with the
//! stored pieces run by run ([`for_each_run`]), so no rank ever assembles a
//! whole tensor it does not own.
//!
//! Writes are atomic: everything goes to `step-N.tmp/`, every file is
//! fsynced, the directory renamed, then `latest` (a one-line file naming the
//! newest complete checkpoint) replaced by rename; older checkpoints beyond
//! `keep` are removed after. A crash at any moment leaves `latest` naming a
//! complete checkpoint. Every piece's SHA-256 is verified when it is read.
//!
//! The single-file format of earlier versions (`checkpoint/model.safetensors`
//! and `config.json`) is read as a source of whole-tensor pieces.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use foldmoe_kernels::{Backend, DType, HostData, ReduceOp, Tensor};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::model::Model;
use super::parallel::shard::{for_each_run, upload_host};
use super::parallel::trainer::Trainer;
use super::parallel::Ctx;
use crate::engine::optim::MASTER_SUFFIX;
use crate::engine::param::Param;
use crate::engine::{EngineError, Result};

/// Format name in `index.json`.
pub const FORMAT: &str = "foldmoe-dist-checkpoint-1";
/// The index file of a checkpoint directory.
pub const INDEX_FILE: &str = "index.json";
/// The file naming the newest complete checkpoint of a root.
pub const LATEST_FILE: &str = "latest";
/// Files of the single-file format of earlier versions.
const LEGACY_TENSORS: &str = "model.safetensors";
const LEGACY_CONFIG: &str = "config.json";

/// `(start, len)` along every dimension: a block of a global tensor.
type Block = Vec<(usize, usize)>;

/// What part of the training state a piece holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateKind {
    /// The parameter itself (training dtype).
    Param,
    /// Its f32 master copy.
    Master,
    /// AdamW first moment.
    ExpAvg,
    /// AdamW second moment.
    ExpAvgSq,
    /// A buffer that is not trained (the routers' expert biases).
    Buffer,
}

/// Element type of a stored piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoredDType {
    /// f32.
    F32,
    /// f64 (gradient-check models).
    F64,
    /// bf16 (the upper half of an f32).
    BF16,
}

impl StoredDType {
    fn of(dtype: DType) -> Result<Self> {
        match dtype {
            DType::F32 => Ok(StoredDType::F32),
            DType::F64 => Ok(StoredDType::F64),
            DType::BF16 => Ok(StoredDType::BF16),
            DType::I32 => Err(EngineError::Invalid(
                "checkpoints store float tensors only".into(),
            )),
        }
    }

    fn size(self) -> usize {
        match self {
            StoredDType::F32 => 4,
            StoredDType::F64 => 8,
            StoredDType::BF16 => 2,
        }
    }

    fn safetensors_name(self) -> &'static str {
        match self {
            StoredDType::F32 => "F32",
            StoredDType::F64 => "F64",
            StoredDType::BF16 => "BF16",
        }
    }
}

/// One stored piece: elements `flat.0..flat.1` of block `block` of the
/// global tensor `tensor`, in file `file` at bytes `bytes.0..bytes.1`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Piece {
    /// The global tensor's name (`blocks.3.moe.experts.w1`).
    pub tensor: String,
    /// What of it.
    pub kind: StateKind,
    /// The global tensor's shape.
    pub full_shape: Vec<usize>,
    /// `(start, len)` of the block along every dimension.
    pub block: Vec<(usize, usize)>,
    /// Range of the block's row-major elements held.
    pub flat: (usize, usize),
    /// Element type stored.
    pub dtype: StoredDType,
    /// File (in the checkpoint directory) holding it.
    pub file: String,
    /// Byte range in the file.
    pub bytes: (u64, u64),
    /// SHA-256 of those bytes.
    pub sha256: String,
}

/// A global tensor of the index.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TensorInfo {
    /// Its shape.
    pub shape: Vec<usize>,
    /// The dtype its pieces are stored in.
    pub dtype: StoredDType,
}

/// `index.json`.
#[derive(Serialize, Deserialize)]
struct Index<M> {
    format: String,
    step: u64,
    /// World size of the layout that wrote it.
    world: usize,
    tensors: BTreeMap<String, TensorInfo>,
    /// Bytes of every rank file.
    files: BTreeMap<String, u64>,
    pieces: Vec<Piece>,
    meta: M,
}

fn io_err(what: &str, path: &Path, e: impl std::fmt::Display) -> EngineError {
    EngineError::Invalid(format!("{what} {}: {e}", path.display()))
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = fs::File::create(path).map_err(|e| io_err("cannot create", path, e))?;
    f.write_all(bytes)
        .map_err(|e| io_err("cannot write", path, e))?;
    f.sync_all().map_err(|e| io_err("cannot sync", path, e))
}

fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("cannot sync directory", dir, e))
}

/// A world-wide barrier through a one-element all-reduce (every
/// communicator has one).
fn barrier<B: Backend>(ctx: &Ctx<B>) -> Result<()> {
    if ctx.rank.world.size() > 1 {
        let one = ctx.b.upload(HostData::F32(vec![1.0]), &[1])?;
        ctx.comm
            .all_reduce(ctx.b, &ctx.rank.world, &one, ReduceOp::Sum)?;
    }
    Ok(())
}

/// `step-00000100`.
fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Bytes of host values as stored in `dtype` (little-endian), written
/// into one buffer without intermediate copies.
fn stored_bytes(data: &HostData, dtype: StoredDType) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() * dtype.size());
    match (data, dtype) {
        (HostData::F32(v), StoredDType::F32) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        (HostData::F64(v), StoredDType::F64) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        (HostData::F64(v), StoredDType::F32) => v
            .iter()
            .for_each(|&x| out.extend_from_slice(&(x as f32).to_le_bytes())),
        // A bf16 tensor downloads as f32s that are bf16 values: the upper
        // half of each is the bf16, exactly.
        (HostData::F32(v), StoredDType::BF16) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes())),
        (d, StoredDType::F64) => d
            .to_f64()
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        (d, StoredDType::F32) => d
            .to_f32()
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        (d, StoredDType::BF16) => d
            .to_f32()
            .iter()
            .for_each(|x| out.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes())),
    }
    out
}

/// What one rank writes: a piece's description and where its values are.
struct Planned<'a, B: Backend> {
    piece: Piece,
    source: &'a Tensor<B>,
    /// Offset of the piece's first element in `source` (flattened).
    offset: usize,
}

/// Writes this rank's part of the trainer's state as checkpoint step
/// `trainer.step_count()` under `root`, with `meta` in the index; keeps the
/// newest `keep` checkpoints. A collective: every rank of the world calls
/// it; it returns once the checkpoint is complete. Returns its directory.
/// The parameter all-gathers the last update left pending land first.
pub fn save<B: Backend, M: Serialize>(
    ctx: &Ctx<B>,
    trainer: &mut Trainer<B>,
    root: &Path,
    meta: &M,
    keep: usize,
) -> Result<PathBuf> {
    let b = ctx.b;
    trainer.settle_params(b)?;
    let trainer = &*trainer;
    let (me, world) = (ctx.rank.rank, ctx.rank.world.size());
    let step = trainer.step_count();
    let name = step_dir_name(step);
    let (dir, tmp) = (root.join(&name), root.join(format!("{name}.tmp")));
    if me == 0 {
        fs::create_dir_all(root).map_err(|e| io_err("cannot create", root, e))?;
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(|e| io_err("cannot clear", &tmp, e))?;
        }
        fs::create_dir_all(&tmp).map_err(|e| io_err("cannot create", &tmp, e))?;
    }
    barrier(ctx)?;
    let file = format!("rank-{me:05}.safetensors");
    let planned = plan_pieces(ctx, trainer, &file)?;
    let pieces = write_rank_file(b, &tmp.join(&file), planned)?;
    let list = serde_json::to_vec(&pieces)
        .map_err(|e| EngineError::Invalid(format!("cannot encode the piece list: {e}")))?;
    write_synced(&tmp.join(format!("rank-{me:05}.json")), &list)?;
    barrier(ctx)?;
    if me == 0 {
        finish(&tmp, &dir, root, &name, step, world, meta, keep)?;
    }
    barrier(ctx)?;
    Ok(dir)
}

/// Rank 0's part of a save: the index from every rank's list, the renames,
/// `latest`, and the removal of older checkpoints.
#[allow(clippy::too_many_arguments)]
fn finish<M: Serialize>(
    tmp: &Path,
    dir: &Path,
    root: &Path,
    name: &str,
    step: u64,
    world: usize,
    meta: &M,
    keep: usize,
) -> Result<()> {
    let mut pieces: Vec<Piece> = Vec::new();
    let mut files = BTreeMap::new();
    for r in 0..world {
        let list_path = tmp.join(format!("rank-{r:05}.json"));
        let text = fs::read(&list_path).map_err(|e| io_err("cannot read", &list_path, e))?;
        let list: Vec<Piece> = serde_json::from_slice(&text)
            .map_err(|e| io_err("malformed piece list", &list_path, e))?;
        let file = format!("rank-{r:05}.safetensors");
        let len = fs::metadata(tmp.join(&file))
            .map_err(|e| io_err("cannot stat", &tmp.join(&file), e))?
            .len();
        files.insert(file, len);
        pieces.extend(list);
    }
    let mut tensors = BTreeMap::new();
    for p in &pieces {
        tensors.entry(p.tensor.clone()).or_insert(TensorInfo {
            shape: p.full_shape.clone(),
            dtype: if p.kind == StateKind::Param {
                p.dtype
            } else {
                StoredDType::F32
            },
        });
    }
    let index = Index {
        format: FORMAT.to_string(),
        step,
        world,
        tensors,
        files,
        pieces,
        meta,
    };
    let json = serde_json::to_vec_pretty(&index)
        .map_err(|e| EngineError::Invalid(format!("cannot encode the checkpoint index: {e}")))?;
    write_synced(&tmp.join(INDEX_FILE), &json)?;
    sync_dir(tmp)?;
    // A checkpoint of this step already there (a resumed run saving again)
    // moves aside until the new one is in place.
    let old = root.join(format!("{name}.old"));
    if dir.exists() {
        if old.exists() {
            fs::remove_dir_all(&old).map_err(|e| io_err("cannot clear", &old, e))?;
        }
        fs::rename(dir, &old).map_err(|e| io_err("cannot move aside", dir, e))?;
    }
    fs::rename(tmp, dir).map_err(|e| io_err("cannot move into place", dir, e))?;
    sync_dir(root)?;
    let latest_tmp = root.join(format!("{LATEST_FILE}.tmp"));
    write_synced(&latest_tmp, format!("{name}\n").as_bytes())?;
    fs::rename(&latest_tmp, root.join(LATEST_FILE))
        .map_err(|e| io_err("cannot update", &root.join(LATEST_FILE), e))?;
    sync_dir(root)?;
    if old.exists() {
        fs::remove_dir_all(&old).map_err(|e| io_err("cannot remove", &old, e))?;
    }
    prune(root, name, keep.max(1))
}

/// Removes complete checkpoints older than the newest `keep` (never
/// `current`) and leftovers of interrupted saves.
fn prune(root: &Path, current: &str, keep: usize) -> Result<()> {
    let mut steps = Vec::new();
    let entries = fs::read_dir(root).map_err(|e| io_err("cannot list", root, e))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("step-") else {
            continue;
        };
        if rest.ends_with(".tmp") || rest.ends_with(".old") {
            fs::remove_dir_all(entry.path())
                .map_err(|e| io_err("cannot remove", &entry.path(), e))?;
        } else if let Ok(step) = rest.parse::<u64>() {
            steps.push((step, name));
        }
    }
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for (_, name) in steps.into_iter().take(excess) {
        if name != current {
            let path = root.join(&name);
            fs::remove_dir_all(&path).map_err(|e| io_err("cannot remove", &path, e))?;
        }
    }
    Ok(())
}

/// The pieces this rank owns: for every bucket it writes, each part of a
/// parameter its optimizer chunk holds, as the parameter, its master (if
/// kept) and its two moments; plus, on the first rank of each stage's
/// attention group, the routers' expert biases.
fn plan_pieces<'a, B: Backend>(
    ctx: &Ctx<B>,
    trainer: &'a Trainer<B>,
    file: &str,
) -> Result<Vec<Planned<'a, B>>> {
    let mut info: Vec<(String, Vec<usize>, Block, DType)> = Vec::new();
    let mut values: Vec<&'a Tensor<B>> = Vec::new();
    trainer.try_visit_params(&mut |_, p| {
        let (full_shape, block) = global_block(p);
        info.push((p.name.clone(), full_shape, block, p.value.dtype()));
        values.push(&p.value);
        Ok(())
    })?;
    let mut out = Vec::new();
    let piece = |tensor: &str,
                 kind,
                 full_shape: &[usize],
                 block: &[(usize, usize)],
                 lo,
                 hi,
                 dtype|
     -> Result<Piece> {
        Ok(Piece {
            tensor: tensor.to_string(),
            kind,
            full_shape: full_shape.to_vec(),
            block: block.to_vec(),
            flat: (lo, hi),
            dtype: StoredDType::of(dtype)?,
            file: file.to_string(),
            bytes: (0, 0),
            sha256: String::new(),
        })
    };
    for part in trainer.chunk_parts() {
        if !trainer.writes_bucket(part.bucket) {
            continue;
        }
        let (name, full_shape, block, dtype) = &info[part.param];
        let value = values[part.param];
        out.push(Planned {
            piece: piece(
                name,
                StateKind::Param,
                full_shape,
                block,
                part.lo,
                part.hi,
                *dtype,
            )?,
            source: value,
            offset: part.lo,
        });
        let (m, v, master) = trainer.bucket_state(part.bucket);
        let mut state = vec![(StateKind::ExpAvg, m), (StateKind::ExpAvgSq, v)];
        if let Some(w) = master {
            state.insert(0, (StateKind::Master, w));
        }
        for (kind, t) in state {
            out.push(Planned {
                piece: piece(name, kind, full_shape, block, part.lo, part.hi, t.dtype())?,
                source: t,
                offset: part.at,
            });
        }
    }
    let rank = ctx.rank;
    if rank.tp_index == 0 && rank.dp_index == 0 && rank.cp_index == 0 {
        let mut failed = None;
        trainer.model.visit_buffers(&mut |name, bias| {
            if failed.is_some() {
                return;
            }
            let n = bias.numel();
            match piece(name, StateKind::Buffer, &[n], &[(0, n)], 0, n, bias.dtype()) {
                Ok(piece) => out.push(Planned {
                    piece,
                    source: bias,
                    offset: 0,
                }),
                Err(e) => failed = Some(e),
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
    }
    Ok(out)
}

/// Writes `planned` as one safetensors file at `path`: the header first
/// (every piece's size is known), then each piece downloaded and written in
/// turn, so the host holds one piece at a time. Returns the pieces with
/// their byte ranges and checksums.
fn write_rank_file<B: Backend>(
    b: &B,
    path: &Path,
    planned: Vec<Planned<'_, B>>,
) -> Result<Vec<Piece>> {
    let (head, mut pieces) = file_layout(planned.iter().map(|p| p.piece.clone()).collect())?;
    let mut f = fs::File::create(path).map_err(|e| io_err("cannot create", path, e))?;
    let mut w = std::io::BufWriter::new(&mut f);
    w.write_all(&head)
        .map_err(|e| io_err("cannot write", path, e))?;
    for (p, piece) in planned.iter().zip(&mut pieces) {
        let n = piece.flat.1 - piece.flat.0;
        // A 1-d source (an optimizer chunk) gives its piece by a copy of the
        // piece alone; a parameter (one piece per rank: its chunk overlap)
        // is read whole to the host and cut there, so the device allocates
        // nothing beyond one piece.
        let host = if p.source.shape().len() == 1 {
            b.download(&b.narrow(p.source, p.offset, n)?)?
        } else {
            slice_host(b.download(p.source)?, p.offset, n)
        };
        let bytes = stored_bytes(&host, piece.dtype);
        piece.sha256 = hex(&Sha256::digest(&bytes));
        w.write_all(&bytes)
            .map_err(|e| io_err("cannot write", path, e))?;
    }
    w.flush().map_err(|e| io_err("cannot write", path, e))?;
    drop(w);
    f.sync_all().map_err(|e| io_err("cannot sync", path, e))?;
    Ok(pieces)
}

/// The safetensors header of a rank file holding `pieces` in order (its
/// 8-byte length, then the JSON padded to a multiple of 8 bytes), and the
/// pieces with their byte ranges in the file.
fn file_layout(mut pieces: Vec<Piece>) -> Result<(Vec<u8>, Vec<Piece>)> {
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (i, p) in pieces.iter_mut().enumerate() {
        let n = p.flat.1 - p.flat.0;
        let len = (n * p.dtype.size()) as u64;
        header.insert(
            format!("{i:06}.{}.{:?}", p.tensor, p.kind),
            serde_json::json!({
                "dtype": p.dtype.safetensors_name(),
                "shape": [n],
                "data_offsets": [at, at + len],
            }),
        );
        p.bytes = (at, at + len);
        at += len;
    }
    header.insert(
        "__metadata__".into(),
        serde_json::json!({ "format": FORMAT }),
    );
    let mut json = serde_json::to_vec(&header)
        .map_err(|e| EngineError::Invalid(format!("cannot encode a shard header: {e}")))?;
    // safetensors pads the header with spaces to a multiple of 8 bytes.
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let start = 8 + json.len() as u64;
    for p in &mut pieces {
        p.bytes = (start + p.bytes.0, start + p.bytes.1);
    }
    let mut head = (json.len() as u64).to_le_bytes().to_vec();
    head.extend_from_slice(&json);
    Ok((head, pieces))
}

/// One global tensor of a checkpoint written without a trainer
/// ([`write_params`]): a parameter or a buffer.
#[derive(Clone, Debug)]
pub struct ParamTensor {
    /// Its name (`blocks.3.moe.experts.w1`).
    pub name: String,
    /// Its global shape.
    pub shape: Vec<usize>,
    /// [`StateKind::Param`] or [`StateKind::Buffer`].
    pub kind: StateKind,
}

/// Gives the values of a block (`(start, len)` per dimension, row-major) of
/// tensor `i` of a [`write_params`] list.
pub type FetchBlock<'a> = dyn FnMut(usize, &[(usize, usize)]) -> Result<HostData> + 'a;

/// Writes checkpoint directory `dir` (step `step`) holding `tensors` alone,
/// no optimizer state, as the ranks of `layout` would hold them (model
/// conversion; `load_params` and `load` read it under any layout, moments
/// starting at zero): each rank's file gets the blocks its [`ShardPlan`](crate::engine::parallel::ShardPlan)
/// gives it of the tensors its pipeline stage holds, a block replicated
/// over several ranks written by the first only, buffers by rank 0.
/// `fetch(i, block)` gives the values of a block of `tensors[i]`
/// (row-major); tensors are asked for one block at a time, in order, and
/// written as they come, so no more than one block is held. The files are
/// written to `dir.tmp` and renamed into place once complete.
#[allow(clippy::too_many_arguments)]
pub fn write_params<M: Serialize>(
    dir: &Path,
    spec: &crate::spec::ModelSpec,
    layout: &crate::layout::Layout,
    tensors: &[ParamTensor],
    dtype: StoredDType,
    step: u64,
    meta: &M,
    fetch: &mut FetchBlock<'_>,
) -> Result<()> {
    use super::parallel::{RankLayout, ShardPlan};
    let world = layout.world;
    // (rank, tensor index, block) of every piece, each block once.
    let mut owned: Vec<Vec<(usize, Block)>> = vec![Vec::new(); world];
    let mut seen: HashSet<(usize, Block)> = HashSet::new();
    for (r, mine) in owned.iter_mut().enumerate() {
        let rank = RankLayout::new(layout, r)?;
        let plan = ShardPlan::new(spec, &rank);
        let last = rank.pp_index + 1 == rank.pp.size();
        for (i, t) in tensors.iter().enumerate() {
            let held = match t.name.strip_prefix("blocks.") {
                Some(rest) => rest
                    .split('.')
                    .next()
                    .and_then(|l| l.parse::<usize>().ok())
                    .is_some_and(|l| plan.layers().contains(&l)),
                None if t.name == "embed.weight" => rank.pp_index == 0,
                None => last,
            };
            if !held {
                continue;
            }
            let block = match t.kind {
                StateKind::Buffer => t.shape.iter().map(|&n| (0, n)).collect(),
                _ => plan.shard_of(&t.name, &t.shape)?.ranges(),
            };
            if seen.insert((i, block.clone())) {
                mine.push((i, block));
            }
        }
    }
    let tmp = PathBuf::from(format!("{}.tmp", dir.display()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err("cannot clear", &tmp, e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| io_err("cannot create", &tmp, e))?;
    let mut writers = Vec::with_capacity(world);
    let mut all: Vec<Vec<Piece>> = Vec::with_capacity(world);
    for (r, mine) in owned.iter().enumerate() {
        let file = format!("rank-{r:05}.safetensors");
        let pieces = mine
            .iter()
            .map(|(i, block)| {
                let t = &tensors[*i];
                Piece {
                    tensor: t.name.clone(),
                    kind: t.kind,
                    full_shape: t.shape.clone(),
                    block: block.clone(),
                    flat: (0, block.iter().map(|b| b.1).product()),
                    dtype,
                    file: file.clone(),
                    bytes: (0, 0),
                    sha256: String::new(),
                }
            })
            .collect();
        let (head, pieces) = file_layout(pieces)?;
        let path = tmp.join(&file);
        let f = fs::File::create(&path).map_err(|e| io_err("cannot create", &path, e))?;
        let mut w = std::io::BufWriter::new(f);
        w.write_all(&head)
            .map_err(|e| io_err("cannot write", &path, e))?;
        writers.push((path, w));
        all.push(pieces);
    }
    // Tensor-major, so each file receives its pieces in its own order.
    let mut next = vec![0usize; world];
    for i in 0..tensors.len() {
        for r in 0..world {
            while let Some((j, block)) = owned[r].get(next[r]) {
                if *j != i {
                    break;
                }
                let values = fetch(i, block)?;
                let piece = &mut all[r][next[r]];
                if values.len() != piece.flat.1 {
                    return Err(EngineError::Invalid(format!(
                        "tensor {}: {} values given for a block of {}",
                        piece.tensor,
                        values.len(),
                        piece.flat.1
                    )));
                }
                let bytes = stored_bytes(&values, dtype);
                piece.sha256 = hex(&Sha256::digest(&bytes));
                let (path, w) = &mut writers[r];
                w.write_all(&bytes)
                    .map_err(|e| io_err("cannot write", path, e))?;
                next[r] += 1;
            }
        }
    }
    let mut files = BTreeMap::new();
    for (path, w) in writers {
        let f = w
            .into_inner()
            .map_err(|e| io_err("cannot write", &path, e.error()))?;
        f.sync_all().map_err(|e| io_err("cannot sync", &path, e))?;
        let len = f
            .metadata()
            .map_err(|e| io_err("cannot stat", &path, e))?
            .len();
        let name = path.file_name().map(|n| n.to_string_lossy().to_string());
        files.insert(name.unwrap_or_default(), len);
    }
    let pieces: Vec<Piece> = all.into_iter().flatten().collect();
    let tensors_info = tensors
        .iter()
        .map(|t| {
            let info = TensorInfo {
                shape: t.shape.clone(),
                dtype,
            };
            (t.name.clone(), info)
        })
        .collect();
    let index = Index {
        format: FORMAT.to_string(),
        step,
        world,
        tensors: tensors_info,
        files,
        pieces,
        meta,
    };
    let json = serde_json::to_vec_pretty(&index)
        .map_err(|e| EngineError::Invalid(format!("cannot encode the checkpoint index: {e}")))?;
    write_synced(&tmp.join(INDEX_FILE), &json)?;
    sync_dir(&tmp)?;
    if dir.exists() {
        fs::remove_dir_all(dir).map_err(|e| io_err("cannot replace", dir, e))?;
    }
    fs::rename(&tmp, dir).map_err(|e| io_err("cannot move into place", dir, e))
}

/// A checkpoint opened for reading: its pieces by tensor and kind, its files
/// memory-mapped, each piece verified the first time it is read.
pub struct Source {
    dir: PathBuf,
    step: u64,
    tensors: BTreeMap<String, TensorInfo>,
    pieces: HashMap<(String, StateKind), Vec<Piece>>,
    files: HashMap<String, memmap2::Mmap>,
    verified: Mutex<HashSet<(String, u64)>>,
}

/// Finds the checkpoint `path` names: a checkpoint directory (with
/// `index.json`), a root or run directory whose `latest` names one, or a
/// checkpoint of the earlier single-file format.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    for root in [path.to_path_buf(), path.join("checkpoints")] {
        if root.join(INDEX_FILE).exists() || root.join(LEGACY_CONFIG).exists() {
            return Ok(root);
        }
        let latest = root.join(LATEST_FILE);
        if latest.exists() {
            let name =
                fs::read_to_string(&latest).map_err(|e| io_err("cannot read", &latest, e))?;
            let dir = root.join(name.trim());
            if dir.join(INDEX_FILE).exists() {
                return Ok(dir);
            }
            // A save interrupted between moving a same-step checkpoint aside
            // and renaming the new one into place.
            let old = root.join(format!("{}.old", name.trim()));
            if old.join(INDEX_FILE).exists() {
                return Ok(old);
            }
            return Err(EngineError::Invalid(format!(
                "{} names checkpoint {}, which is missing or incomplete (no {INDEX_FILE})",
                latest.display(),
                dir.display()
            )));
        }
    }
    for legacy in [
        path.to_path_buf(),
        path.join("checkpoint"),
        path.join("checkpoint.old"),
    ] {
        if legacy.join(LEGACY_CONFIG).exists() && legacy.join(LEGACY_TENSORS).exists() {
            return Ok(legacy);
        }
    }
    Err(EngineError::Invalid(format!(
        "no checkpoint in {} (expected {INDEX_FILE}, a {LATEST_FILE} file, or checkpoint/)",
        path.display()
    )))
}

fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let f = fs::File::open(path).map_err(|e| io_err("cannot open checkpoint file", path, e))?;
    // SAFETY: checkpoint files are not modified while a run reads them (a
    // save writes a new directory); every piece read is verified anyway.
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| io_err("cannot map checkpoint file", path, e))
}

impl Source {
    /// Opens the checkpoint `path` names ([`resolve`]) and returns it with
    /// its step and metadata.
    pub fn open<M: DeserializeOwned>(path: &Path) -> Result<(Self, M)> {
        let dir = resolve(path)?;
        if dir.join(INDEX_FILE).exists() {
            Self::open_index(&dir)
        } else {
            Self::open_legacy(&dir)
        }
    }

    /// The step the checkpoint was written at.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every global tensor, with its shape and stored dtype.
    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    fn open_index<M: DeserializeOwned>(dir: &Path) -> Result<(Self, M)> {
        let path = dir.join(INDEX_FILE);
        let text = fs::read(&path).map_err(|e| io_err("cannot read", &path, e))?;
        let index: Index<M> = serde_json::from_slice(&text)
            .map_err(|e| io_err("malformed checkpoint index", &path, e))?;
        if index.format != FORMAT {
            return Err(EngineError::Invalid(format!(
                "checkpoint index {} has format `{}`, expected `{FORMAT}`",
                path.display(),
                index.format
            )));
        }
        let mut files = HashMap::new();
        for (name, &len) in &index.files {
            let fpath = dir.join(name);
            if !fpath.exists() {
                return Err(EngineError::Invalid(format!(
                    "checkpoint file {} is missing ({} lists it)",
                    fpath.display(),
                    path.display()
                )));
            }
            let map = map_file(&fpath)?;
            if map.len() as u64 != len {
                return Err(EngineError::Invalid(format!(
                    "checkpoint file {} has {} bytes, the index records {len}: truncated or altered",
                    fpath.display(),
                    map.len()
                )));
            }
            files.insert(name.clone(), map);
        }
        let mut pieces: HashMap<(String, StateKind), Vec<Piece>> = HashMap::new();
        for p in index.pieces {
            let Some(map) = files.get(&p.file) else {
                return Err(EngineError::Invalid(format!(
                    "checkpoint index {} names tensor {} in file {}, which it does not list",
                    path.display(),
                    p.tensor,
                    p.file
                )));
            };
            let size = (p.flat.1 - p.flat.0) * p.dtype.size();
            if p.bytes.1 > map.len() as u64 || p.bytes.1 - p.bytes.0 != size as u64 {
                return Err(EngineError::Invalid(format!(
                    "checkpoint file {}: tensor {} ({:?}) at bytes {}..{} does not fit the file \
                     of {} bytes or its {} elements",
                    p.file,
                    p.tensor,
                    p.kind,
                    p.bytes.0,
                    p.bytes.1,
                    map.len(),
                    p.flat.1 - p.flat.0
                )));
            }
            pieces
                .entry((p.tensor.clone(), p.kind))
                .or_default()
                .push(p);
        }
        Ok((
            Source {
                dir: dir.to_path_buf(),
                step: index.step,
                tensors: index.tensors,
                pieces,
                files,
                verified: Mutex::new(HashSet::new()),
            },
            index.meta,
        ))
    }

    /// The single-file format: `config.json` (`{format, tensors_sha256,
    /// meta}`, the meta holding `step`) and `model.safetensors` with
    /// `param.<name>`, `optim.<name>.{exp_avg, exp_avg_sq, fp32_param}` and
    /// `expert_bias.<layer>` whole tensors.
    fn open_legacy<M: DeserializeOwned>(dir: &Path) -> Result<(Self, M)> {
        #[derive(Deserialize)]
        struct Envelope {
            tensors_sha256: String,
            meta: serde_json::Value,
        }
        let cfg_path = dir.join(LEGACY_CONFIG);
        let text = fs::read(&cfg_path).map_err(|e| io_err("cannot read", &cfg_path, e))?;
        let envelope: Envelope = serde_json::from_slice(&text)
            .map_err(|e| io_err("malformed checkpoint config", &cfg_path, e))?;
        let tpath = dir.join(LEGACY_TENSORS);
        let map = map_file(&tpath)?;
        let sum = hex(&Sha256::digest(&map[..]));
        if sum != envelope.tensors_sha256 {
            return Err(EngineError::Invalid(format!(
                "checkpoint {} is corrupt or truncated: SHA-256 {sum} ({} bytes) does not match \
                 {} recorded in {LEGACY_CONFIG}",
                tpath.display(),
                map.len(),
                envelope.tensors_sha256
            )));
        }
        let step = envelope
            .meta
            .get("step")
            .and_then(|s| s.as_u64())
            .unwrap_or(0);
        let meta: M = serde_json::from_value(envelope.meta)
            .map_err(|e| io_err("malformed checkpoint meta", &cfg_path, e))?;
        let st = safetensors::SafeTensors::deserialize(&map[..])
            .map_err(|e| io_err("malformed checkpoint tensors", &tpath, e))?;
        let data_start = 8 + u64::from_le_bytes(map[..8].try_into().expect("8 bytes")) as usize;
        let mut pieces: HashMap<(String, StateKind), Vec<Piece>> = HashMap::new();
        let mut tensors = BTreeMap::new();
        let base = map.as_ptr() as usize;
        for (key, view) in st.tensors() {
            let (tensor, kind) = if let Some(n) = key.strip_prefix("param.") {
                (n.to_string(), StateKind::Param)
            } else if let Some(n) = key.strip_prefix("expert_bias.") {
                (
                    format!("blocks.{n}.moe.router.expert_bias"),
                    StateKind::Buffer,
                )
            } else if let Some(rest) = key.strip_prefix("optim.") {
                let (n, suffix) = rest.rsplit_once('.').unwrap_or((rest, ""));
                let kind = match suffix {
                    "exp_avg" => StateKind::ExpAvg,
                    "exp_avg_sq" => StateKind::ExpAvgSq,
                    MASTER_SUFFIX => StateKind::Master,
                    _ => continue,
                };
                (n.to_string(), kind)
            } else {
                continue;
            };
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => StoredDType::F32,
                safetensors::Dtype::F64 => StoredDType::F64,
                other => {
                    return Err(EngineError::Invalid(format!(
                        "checkpoint tensor {key} has unsupported dtype {other:?}"
                    )))
                }
            };
            let data = view.data();
            let begin = (data.as_ptr() as usize - base) as u64;
            debug_assert!(begin as usize >= data_start);
            let shape = view.shape().to_vec();
            let n: usize = shape.iter().product();
            if kind == StateKind::Param || kind == StateKind::Buffer {
                tensors.insert(
                    tensor.clone(),
                    TensorInfo {
                        shape: shape.clone(),
                        dtype,
                    },
                );
            }
            pieces
                .entry((tensor.clone(), kind))
                .or_default()
                .push(Piece {
                    tensor,
                    kind,
                    block: shape.iter().map(|&d| (0, d)).collect(),
                    full_shape: shape,
                    flat: (0, n),
                    dtype,
                    file: LEGACY_TENSORS.into(),
                    bytes: (begin, begin + data.len() as u64),
                    // The whole file's checksum was verified above.
                    sha256: String::new(),
                });
        }
        let mut files = HashMap::new();
        files.insert(LEGACY_TENSORS.to_string(), map);
        Ok((
            Source {
                dir: dir.to_path_buf(),
                step,
                tensors,
                pieces,
                files,
                verified: Mutex::new(HashSet::new()),
            },
            meta,
        ))
    }

    /// Whether the checkpoint holds any `kind` piece of `tensor`.
    pub fn has(&self, tensor: &str, kind: StateKind) -> bool {
        self.pieces.contains_key(&(tensor.to_string(), kind))
    }

    /// The bytes of `piece`, verified against its checksum once.
    fn piece_bytes(&self, piece: &Piece) -> Result<&[u8]> {
        let map = &self.files[&piece.file];
        let bytes = &map[piece.bytes.0 as usize..piece.bytes.1 as usize];
        if !piece.sha256.is_empty() {
            let key = (piece.file.clone(), piece.bytes.0);
            let mut verified = self.verified.lock().expect("not poisoned");
            if !verified.contains(&key) {
                let sum = hex(&Sha256::digest(bytes));
                if sum != piece.sha256 {
                    return Err(EngineError::Invalid(format!(
                        "checkpoint file {} is corrupt: tensor {} ({:?}) at bytes {}..{} has \
                         SHA-256 {sum}, the index records {}",
                        self.dir.join(&piece.file).display(),
                        piece.tensor,
                        piece.kind,
                        piece.bytes.0,
                        piece.bytes.1,
                        piece.sha256
                    )));
                }
                verified.insert(key);
            }
        }
        Ok(bytes)
    }

    /// Elements `flat.0..flat.1` of block `block` of the global tensor
    /// `tensor` (`kind`), as f64 or f32 (`wide`), assembled from every
    /// stored piece that overlaps them; an error names the tensor when the
    /// checkpoint lacks it, or part of it, or has it in another shape.
    pub fn read_region(
        &self,
        tensor: &str,
        kind: StateKind,
        full_shape: &[usize],
        block: &[(usize, usize)],
        flat: (usize, usize),
        wide: bool,
    ) -> Result<HostData> {
        let pieces = self
            .pieces
            .get(&(tensor.to_string(), kind))
            .ok_or_else(|| {
                EngineError::Invalid(format!(
                "checkpoint {} holds no {kind:?} of tensor {tensor}; was it written for another \
                 model?",
                self.dir.display()
            ))
            })?;
        let n = flat.1 - flat.0;
        let mut out64 = if wide { vec![0.0f64; n] } else { Vec::new() };
        let mut out32 = if wide { Vec::new() } else { vec![0.0f32; n] };
        let mut covered = 0usize;
        let want = runs_in(full_shape, block, flat);
        for piece in pieces {
            if piece.full_shape != full_shape {
                return Err(EngineError::Invalid(format!(
                    "checkpoint tensor {tensor} has shape {:?}, the model expects {full_shape:?}",
                    piece.full_shape
                )));
            }
            let have = runs_in(full_shape, &piece.block, piece.flat);
            let mut bytes: Option<&[u8]> = None;
            let size = piece.dtype.size();
            // Both run lists ascend in global offset: merge them.
            let (mut i, mut j) = (0, 0);
            while i < want.len() && j < have.len() {
                let (wg, wl, wn) = want[i];
                let (hg, hl, hn) = have[j];
                let lo = wg.max(hg);
                let hi = (wg + wn).min(hg + hn);
                if lo < hi {
                    let src = match bytes {
                        Some(b) => b,
                        None => *bytes.insert(self.piece_bytes(piece)?),
                    };
                    let (dst, from) = (wl + (lo - wg), hl + (lo - hg));
                    for k in 0..hi - lo {
                        let at = (from + k) * size;
                        let x = &src[at..at + size];
                        let v = match piece.dtype {
                            StoredDType::F32 => f32::from_le_bytes(x.try_into().expect("4")) as f64,
                            StoredDType::F64 => f64::from_le_bytes(x.try_into().expect("8")),
                            StoredDType::BF16 => {
                                let bits = u16::from_le_bytes(x.try_into().expect("2"));
                                f32::from_bits(u32::from(bits) << 16) as f64
                            }
                        };
                        if wide {
                            out64[dst + k] = v;
                        } else {
                            out32[dst + k] = v as f32;
                        }
                    }
                    covered += hi - lo;
                }
                if wg + wn <= hg + hn {
                    i += 1;
                } else {
                    j += 1;
                }
            }
        }
        if covered != n {
            return Err(EngineError::Invalid(format!(
                "checkpoint {} holds {covered} of the {n} elements of {kind:?} of tensor {tensor} \
                 this rank needs (block {block:?}); a rank file is missing from the index?",
                self.dir.display()
            )));
        }
        Ok(if wide {
            HostData::F64(out64)
        } else {
            HostData::F32(out32)
        })
    }
}

/// The runs of elements `flat` of block `block` of a tensor of
/// `full_shape`: `(global offset, offset in flat range, len)`, ascending.
fn runs_in(
    full_shape: &[usize],
    block: &[(usize, usize)],
    flat: (usize, usize),
) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    for_each_run(full_shape, block, |g, local, len| {
        let (lo, hi) = (local.max(flat.0), (local + len).min(flat.1));
        if lo < hi {
            out.push((g + (lo - local), lo - flat.0, hi - lo));
        }
    });
    out
}

/// Loads `source` into a freshly built trainer of any layout: every
/// parameter's block, this rank's chunks of the moments and masters, the
/// expert biases and the step. A master the checkpoint lacks starts as the
/// parameter (as a fresh optimizer's would); a master the trainer keeps
/// none of replaces the parameter (it is the exact weight). Not a
/// collective: each rank reads its own slices. Moments the checkpoint lacks
/// (one written by [`write_params`]) start at zero.
pub fn load<B: Backend>(b: &B, source: &Source, trainer: &mut Trainer<B>) -> Result<()> {
    // A pending all-gather would overwrite the loaded values when it lands.
    trainer.settle_params(b)?;
    let b_keeps_masters = trainer.has_masters();
    // (name, full shape, block, dtype, shard shape) of every parameter.
    type Held = (String, Vec<usize>, Block, DType, Vec<usize>);
    let mut blocks: Vec<Held> = Vec::new();
    trainer.try_visit_params(&mut |_, p| {
        let (full_shape, block) = global_block(p);
        blocks.push((
            p.name.clone(),
            full_shape,
            block,
            p.value.dtype(),
            p.value.shape().to_vec(),
        ));
        Ok(())
    })?;
    let read = |i: usize, kind: StateKind, flat: (usize, usize), wide: bool| -> Result<HostData> {
        let (name, full_shape, block, _, _) = &blocks[i];
        // A checkpoint of parameters alone (a converted model) starts the
        // moments at zero, as a fresh optimizer's.
        let moment = matches!(kind, StateKind::ExpAvg | StateKind::ExpAvgSq);
        if moment && !source.has(name, kind) {
            let n = flat.1 - flat.0;
            return Ok(if wide {
                HostData::F64(vec![0.0; n])
            } else {
                HostData::F32(vec![0.0; n])
            });
        }
        let kind = match kind {
            StateKind::Param if !b_keeps_masters && source.has(name, StateKind::Master) => {
                StateKind::Master
            }
            StateKind::Master if !source.has(name, StateKind::Master) => StateKind::Param,
            k => k,
        };
        source.read_region(name, kind, full_shape, block, flat, wide)
    };
    load_params(b, source, &mut trainer.model, !b_keeps_masters)?;
    let parts = trainer.chunk_parts();
    let buckets: HashSet<usize> = parts.iter().map(|p| p.bucket).collect();
    for bucket in buckets {
        let (m, _, master) = trainer.bucket_state(bucket);
        let dtype = m.dtype();
        let with_master = master.is_some();
        let chunk = trainer.bucket_chunk(bucket);
        let wide = dtype == DType::F64;
        let kinds = [StateKind::ExpAvg, StateKind::ExpAvgSq, StateKind::Master];
        // One state tensor at a time on the host, in its own width, and on
        // the device: each replaces its fresh counterpart before the next.
        for (slot, &kind) in kinds[..if with_master { 3 } else { 2 }].iter().enumerate() {
            let mut host = if wide {
                HostData::F64(vec![0.0; chunk])
            } else {
                HostData::F32(vec![0.0; chunk])
            };
            for part in parts.iter().filter(|p| p.bucket == bucket) {
                let vals = read(part.param, kind, (part.lo, part.hi), wide)?;
                let at = part.at..part.at + (part.hi - part.lo);
                match (&mut host, vals) {
                    (HostData::F64(h), HostData::F64(v)) => h[at].copy_from_slice(&v),
                    (HostData::F32(h), HostData::F32(v)) => h[at].copy_from_slice(&v),
                    _ => unreachable!("read_region returns the width asked for"),
                }
            }
            let t = upload_host(b, host, &[chunk], dtype)?;
            trainer.set_bucket_state(bucket, slot, t)?;
        }
    }
    trainer.set_step_count(source.step());
    Ok(())
}

/// The global shape of parameter `p` and the block of it the rank holds.
fn global_block<B: Backend>(p: &Param<B>) -> (Vec<usize>, Block) {
    match &p.shard {
        Some(s) => (s.full_shape.clone(), s.ranges()),
        None => (
            p.value.shape().to_vec(),
            p.value.shape().iter().map(|&n| (0, n)).collect(),
        ),
    }
}

/// Elements `offset .. offset + n` of host values.
fn slice_host(data: HostData, offset: usize, n: usize) -> HostData {
    match data {
        HostData::F32(v) => HostData::F32(v[offset..offset + n].to_vec()),
        HostData::F64(v) => HostData::F64(v[offset..offset + n].to_vec()),
        HostData::I32(v) => HostData::I32(v[offset..offset + n].to_vec()),
    }
}

/// Loads into `model` (any layout) every parameter's block and the routers'
/// expert biases from `source`. With `prefer_masters`, a parameter whose f32
/// master the checkpoint keeps is read from it (the exact weight of a bf16
/// run: what generation and a trainer without masters want).
pub fn load_params<B: Backend>(
    b: &B,
    source: &Source,
    model: &mut Model<B>,
    prefer_masters: bool,
) -> Result<()> {
    let mut outcome: Result<()> = Ok(());
    let mut visit = |p: &mut Param<B>| {
        if outcome.is_err() {
            return;
        }
        outcome = (|| {
            let (full_shape, block) = global_block(p);
            let kind = if prefer_masters && source.has(&p.name, StateKind::Master) {
                StateKind::Master
            } else {
                StateKind::Param
            };
            let (dtype, shape) = (p.value.dtype(), p.value.shape().to_vec());
            let n = p.value.numel();
            let vals = source.read_region(
                &p.name,
                kind,
                &full_shape,
                &block,
                (0, n),
                dtype == DType::F64,
            )?;
            p.value = upload_host(b, vals, &shape, dtype)?;
            Ok(())
        })();
    };
    model.visit_dense_mut(&mut visit);
    model.visit_experts_mut(&mut visit);
    outcome?;
    model.replace_buffers(&mut |name, bias| {
        let (n, dtype) = (bias.numel(), bias.dtype());
        let vals = source.read_region(
            name,
            StateKind::Buffer,
            &[n],
            &[(0, n)],
            (0, n),
            dtype == DType::F64,
        )?;
        upload_host(b, vals, &[n], dtype)
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use super::{load, Source};
    use crate::engine::model::Model;
    use crate::engine::parallel::shard::cut_block;
    use crate::engine::parallel::{run_local_layout, RankLayout, Trainer};
    use crate::engine::trainer::TrainConfig;
    use crate::engine::Module;
    use crate::layout::{self, LayoutSpec};
    use crate::spec::{AttentionSpec, BlockGroup, FfnSpec, ModelSpec, MoeSpec, RouterSpec};
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::Device;
    use safetensors::tensor::{Dtype, TensorView};
    use sha2::{Digest, Sha256};

    fn spec() -> ModelSpec {
        let moe = MoeSpec {
            experts: 4,
            top_k: 2,
            expert_ffn: 16,
            shared_ffn: 8,
            shared_gate: false,
            router: RouterSpec::default(),
            capacity: None,
        };
        ModelSpec {
            name: "legacy".into(),
            vocab: 32,
            hidden: 16,
            seq_len: 8,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            tied_embeddings: false,
            init_std: 0.1,
            groups: vec![
                BlockGroup::new(1, AttentionSpec::gqa(4, 2, 4), FfnSpec::Dense { ffn: 16 }),
                BlockGroup::new(1, AttentionSpec::gqa(4, 2, 4), FfnSpec::Moe(moe)),
            ],
            mtp_layers: 0,
            mtp_loss_coef: 0.1,
        }
    }

    /// Writes the single-file format by hand: `param.<name>` and
    /// `optim.<name>.{exp_avg, exp_avg_sq}` f32 tensors, and the envelope with
    /// the file's SHA-256 and a meta holding `step`.
    fn write_legacy(dir: &std::path::Path, values: &[(String, Vec<usize>, Vec<f32>)], step: u64) {
        std::fs::create_dir_all(dir).unwrap();
        let mut named: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for (name, shape, vals) in values {
            let bytes = |scale: f32| -> Vec<u8> {
                vals.iter()
                    .flat_map(|v| (v * scale).to_le_bytes())
                    .collect()
            };
            named.push((format!("param.{name}"), shape.clone(), bytes(1.0)));
            named.push((format!("optim.{name}.exp_avg"), shape.clone(), bytes(0.5)));
            named.push((
                format!("optim.{name}.exp_avg_sq"),
                shape.clone(),
                bytes(0.25),
            ));
        }
        let views: Vec<(String, TensorView)> = named
            .iter()
            .map(|(n, s, b)| {
                (
                    n.clone(),
                    TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
                )
            })
            .collect();
        let bytes = safetensors::serialize(views, None).unwrap();
        let sum: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
        let config = serde_json::json!({
            "format": "foldmoe-checkpoint-1",
            "tensors_sha256": sum,
            "meta": { "step": step },
        });
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    }

    /// The single-file checkpoint of earlier versions still loads, under any
    /// layout: its whole tensors are read as pieces, each rank taking its slices.
    #[test]
    fn a_single_file_checkpoint_loads_under_any_layout() {
        let spec = spec();
        let one = Model::single(&Cpu, &spec, 3, foldmoe_kernels::DType::F32).unwrap();
        let mut values = Vec::new();
        one.visit_params(&mut |p| {
            // Shifted, so a load that ignored the file would be caught.
            let v: Vec<f32> = Cpu
                .download(&p.value)
                .unwrap()
                .to_f32()
                .iter()
                .map(|x| x + 0.25)
                .collect();
            values.push((p.name.clone(), p.value.shape().to_vec(), v));
        });
        let want: HashMap<String, Vec<f64>> = values
            .iter()
            .map(|(n, _, v)| (n.clone(), v.iter().map(|&x| x as f64).collect()))
            .collect();
        let dir = std::env::temp_dir().join(format!("foldmoe-legacy-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_legacy(&dir.join("checkpoint"), &values, 3);
        let (source, meta) = Source::open::<serde_json::Value>(&dir).unwrap();
        assert_eq!(source.step(), 3);
        assert_eq!(meta["step"], 3);
        for text in [
            "world=1",
            "world=2,tp=2",
            "world=4,tp=2,ep=2",
            "world=2,pp=2",
        ] {
            let l = layout::check(&LayoutSpec::parse(text).unwrap(), &spec).unwrap();
            let results = run_local_layout(&Cpu, &l, Duration::from_secs(30), |ctx| {
                let rank = RankLayout::new(&l, ctx.rank.rank)?;
                let model = Model::new(&Cpu, &spec, rank, 9, foldmoe_kernels::DType::F32)?;
                let mut trainer = Trainer::new(&Cpu, model, TrainConfig::default())?;
                load(&Cpu, &source, &mut trainer)?;
                let mut got = Vec::new();
                let mut visit = |p: &crate::engine::Param<Cpu>| {
                    got.push((
                        p.name.clone(),
                        p.shard.clone(),
                        Cpu.download(&p.value).unwrap().to_f64(),
                    ))
                };
                trainer.model.visit_dense(&mut visit);
                trainer.model.visit_experts(&mut visit);
                Ok((trainer.step_count(), got))
            });
            for r in results {
                let (step, got) = r.unwrap();
                assert_eq!(step, 3, "{text}");
                for (name, shard, vals) in got {
                    let full = &want[&name];
                    let expect = match &shard {
                        Some(s) => cut_block(full, s),
                        None => full.clone(),
                    };
                    assert_eq!(vals, expect, "{text}: {name}");
                }
            }
        }
        // A byte changed in the file is refused with its checksum.
        let path = dir.join("checkpoint").join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 2] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = Source::open::<serde_json::Value>(&dir)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("corrupt or truncated"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
