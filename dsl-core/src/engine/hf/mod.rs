//! Hugging Face checkpoints in and out: Mixtral, Qwen3-MoE and DeepSeek-V3
//! `config.json` + safetensors (one file, or shards with
//! `model.safetensors.index.json`) ↔ foldmoe's distributed checkpoint.
//!
//! Import ([`import`]) reads the config into a [`ModelSpec`] ([`config`]),
//! memory-maps the safetensors files and writes the checkpoint for a chosen
//! layout through [`checkpoint::write_params`], one block of one tensor at a
//! time: each of foldmoe's tensors is assembled from its Hugging Face
//! tensors (below) only for the block a rank owns. Export ([`export`]) reads
//! the checkpoint one tensor at a time ([`Source::read_region`]) and writes
//! the Hugging Face tensors as they come, after a header planned from the
//! spec alone. Every Hugging Face tensor must be used once: a missing one,
//! one left over, or one of the wrong shape or dtype is an error naming it.
//!
//! | foldmoe | Hugging Face (under `model.layers.{l}.`) |
//! |---|---|
//! | `embed.weight` `[V, D]`, `head.weight` | `model.embed_tokens.weight`, `lm_head.weight` (as they are) |
//! | `final_norm.weight`, `attn_norm`, `ffn_norm` | `model.norm.weight`, `input_layernorm`, `post_attention_layernorm` |
//! | GQA `attn.wq`/`wk`/`wv` `[D, H·Hd]`, `attn.wo` `[H·Hd, D]` | `self_attn.{q,k,v,o}_proj.weight`, transposed (`Linear` is `[out, in]`) |
//! | `attn.q_norm`, `attn.k_norm` (`qk_norm`) | `self_attn.q_norm`, `self_attn.k_norm` |
//! | MLA `wq_a`, `q_norm`, `wq_b` (or `wq`), `wkv_a`, `kv_norm`, `wkv_b`, `wo` | `q_a_proj`, `q_a_layernorm`, `q_b_proj` (`q_proj`), `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`; transposed, rotary columns de-interleaved when `rope_interleave` |
//! | `mlp.w1`, `w3`, `w2`; `moe.shared_experts.*` | `mlp.gate_proj`, `up_proj`, `down_proj`; `mlp.shared_experts.*`, transposed |
//! | `moe.router.weight` `[D, E]`, `moe.router.expert_bias` | `mlp.gate.weight` (Mixtral: `block_sparse_moe.gate`) transposed, `mlp.gate.e_score_correction_bias` |
//! | `moe.experts.w1`, `w3` `[E, D, F]`, `w2` `[E, F, D]` | per expert `mlp.experts.{j}.{gate,up,down}_proj.weight` (Mixtral `block_sparse_moe.experts.{j}.w1/w3/w2`), or fused `mlp.experts.gate_up_proj [E, 2F, D]` / `down_proj [E, D, F]`; transposed |
//! | MTP module k: `mtp.{k}.enorm.weight`, `hnorm.weight`, `eh_proj.weight` `[2D, D]`, `norm.weight`, `block.*` | DeepSeek-V3's layer `L + k` (L = `num_hidden_layers`): `enorm`, `hnorm`, `eh_proj.weight` `[D, 2D]` transposed, `shared_head.norm`, and the block's tensors as a layer's |
//! | (the embedding and head, shared) | also that layer's `embed_tokens.weight` and `shared_head.head.weight`: checked equal to the main ones on import, written again on export |
//!
//! DeepSeek's fp8 release stores 2-d weights as e4m3 with a
//! `weight_scale_inv` per `weight_block_size` block: import multiplies them
//! back (the scales are used, not imported).

pub mod config;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use foldmoe_kernels::HostData;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use serde::Serialize;

pub use config::{Family, HfConfig};

use super::checkpoint::{self, ParamTensor, Source, StateKind, StoredDType};
use crate::engine::{EngineError, Result};
use crate::layout::Layout;
use crate::spec::{BlockGroup, FfnSpec, ModelSpec};

/// The single-file checkpoint and the index of a sharded one.
const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

fn err(msg: String) -> EngineError {
    EngineError::Invalid(msg)
}

fn io_err(what: &str, path: &Path, e: impl std::fmt::Display) -> EngineError {
    err(format!("{what} {}: {e}", path.display()))
}

/// Reads `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<HfConfig> {
    let path = dir.join("config.json");
    let text = fs::read_to_string(&path).map_err(|e| io_err("cannot read", &path, e))?;
    config::parse(&text, &path.display().to_string())
}

/// Every tensor of `spec`'s model, as the engine names and shapes them (its
/// parameters and the routers' expert biases), in the engine's order: the
/// main model's, then each MTP module's (`mtp.{k}.*`, its block one of the
/// last group).
pub fn model_tensors(spec: &ModelSpec) -> Vec<ParamTensor> {
    let (v, d) = (spec.vocab, spec.hidden);
    let mut params = Vec::new();
    let mut buffers = Vec::new();
    let param = |name: String, shape: &[usize]| ParamTensor {
        name,
        shape: shape.to_vec(),
        kind: StateKind::Param,
    };
    params.push(param("embed.weight".into(), &[v, d]));
    for l in 0..spec.layers() {
        let g = spec.group_of_layer(l).expect("layer in range");
        block_tensors(&format!("blocks.{l}"), g, d, &mut params, &mut buffers);
    }
    params.push(param("final_norm.weight".into(), &[d]));
    if !spec.tied_embeddings {
        params.push(param("head.weight".into(), &[v, d]));
    }
    if let Some(last) = spec.groups.last() {
        for k in 0..spec.mtp_layers {
            let p = format!("mtp.{k}");
            params.push(param(format!("{p}.enorm.weight"), &[d]));
            params.push(param(format!("{p}.hnorm.weight"), &[d]));
            params.push(param(format!("{p}.eh_proj.weight"), &[2 * d, d]));
            block_tensors(&format!("{p}.block"), last, d, &mut params, &mut buffers);
            params.push(param(format!("{p}.norm.weight"), &[d]));
        }
    }
    params.extend(buffers);
    params
}

/// The tensors of one block of group `g` under `p` (hidden size `d`): its
/// parameters onto `params`, its router's expert bias onto `buffers`.
fn block_tensors(
    p: &str,
    g: &BlockGroup,
    d: usize,
    params: &mut Vec<ParamTensor>,
    buffers: &mut Vec<ParamTensor>,
) {
    let mut put = |name: String, shape: &[usize]| {
        params.push(ParamTensor {
            name,
            shape: shape.to_vec(),
            kind: StateKind::Param,
        })
    };
    put(format!("{p}.attn_norm.weight"), &[d]);
    let a = &g.attention;
    match &a.mla {
        None => {
            let (q, kv) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
            put(format!("{p}.attn.wq"), &[d, q]);
            put(format!("{p}.attn.wk"), &[d, kv]);
            put(format!("{p}.attn.wv"), &[d, kv]);
            put(format!("{p}.attn.wo"), &[q, d]);
            if a.qk_norm {
                put(format!("{p}.attn.q_norm.weight"), &[a.head_dim]);
                put(format!("{p}.attn.k_norm.weight"), &[a.head_dim]);
            }
        }
        Some(m) => {
            let h = a.heads;
            let q = m.qk_nope_head_dim + m.qk_rope_head_dim;
            if m.q_lora_rank > 0 {
                put(format!("{p}.attn.wq_a"), &[d, m.q_lora_rank]);
                put(format!("{p}.attn.q_norm.weight"), &[m.q_lora_rank]);
                put(format!("{p}.attn.wq_b"), &[m.q_lora_rank, h * q]);
            } else {
                put(format!("{p}.attn.wq"), &[d, h * q]);
            }
            let l_r = m.kv_lora_rank + m.qk_rope_head_dim;
            put(format!("{p}.attn.wkv_a"), &[d, l_r]);
            put(format!("{p}.attn.kv_norm.weight"), &[m.kv_lora_rank]);
            let kv = h * (m.qk_nope_head_dim + m.v_head_dim);
            put(format!("{p}.attn.wkv_b"), &[m.kv_lora_rank, kv]);
            put(format!("{p}.attn.wo"), &[h * m.v_head_dim, d]);
        }
    }
    put(format!("{p}.ffn_norm.weight"), &[d]);
    match &g.ffn {
        FfnSpec::Dense { ffn } => {
            put(format!("{p}.mlp.w1"), &[d, *ffn]);
            put(format!("{p}.mlp.w3"), &[d, *ffn]);
            put(format!("{p}.mlp.w2"), &[*ffn, d]);
        }
        FfnSpec::Moe(m) => {
            if m.shared_ffn > 0 {
                let s = m.shared_ffn;
                put(format!("{p}.moe.shared_experts.w1"), &[d, s]);
                put(format!("{p}.moe.shared_experts.w3"), &[d, s]);
                put(format!("{p}.moe.shared_experts.w2"), &[s, d]);
                if m.shared_gate {
                    put(format!("{p}.moe.shared_experts.gate"), &[d, 1]);
                }
            }
            put(format!("{p}.moe.router.weight"), &[d, m.experts]);
            let (e, f) = (m.experts, m.expert_ffn);
            put(format!("{p}.moe.experts.w1"), &[e, d, f]);
            put(format!("{p}.moe.experts.w3"), &[e, d, f]);
            put(format!("{p}.moe.experts.w2"), &[e, f, d]);
            if m.router.expert_bias_rate.is_some() {
                buffers.push(ParamTensor {
                    name: format!("{p}.moe.router.expert_bias"),
                    shape: vec![e],
                    kind: StateKind::Buffer,
                });
            }
        }
    }
}

/// How the routed experts are stored on the Hugging Face side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertLayout {
    /// One tensor per expert and projection (what `save_pretrained` writes).
    PerExpert,
    /// `experts.gate_up_proj [E, 2F, D]` and `experts.down_proj [E, D, F]`.
    Fused,
}

/// One Hugging Face tensor's place in the files.
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    range: (usize, usize),
}

/// A Hugging Face checkpoint directory opened for reading: every
/// safetensors file memory-mapped, every tensor's place, and which tensors
/// import used.
pub struct HfSource {
    maps: Vec<memmap2::Mmap>,
    files: Vec<PathBuf>,
    tensors: BTreeMap<String, Entry>,
    used: RefCell<HashSet<String>>,
}

impl HfSource {
    /// Opens `dir`: `model.safetensors.index.json` and the shards it names,
    /// or `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join(INDEX);
        let names: Vec<String> = if index.exists() {
            let text = fs::read_to_string(&index).map_err(|e| io_err("cannot read", &index, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| io_err("malformed index", &index, e))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| err(format!("{}: no weight_map", index.display())))?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect();
            files.sort();
            files.dedup();
            files
        } else if dir.join(SINGLE).exists() {
            vec![SINGLE.to_string()]
        } else {
            return Err(err(format!(
                "{}: no {SINGLE} and no {INDEX}",
                dir.display()
            )));
        };
        let mut src = HfSource {
            maps: Vec::new(),
            files: Vec::new(),
            tensors: BTreeMap::new(),
            used: RefCell::new(HashSet::new()),
        };
        for (i, name) in names.iter().enumerate() {
            let path = dir.join(name);
            let f = fs::File::open(&path).map_err(|e| io_err("cannot open", &path, e))?;
            // SAFETY: the files are read-only inputs, not modified while read.
            let map =
                unsafe { memmap2::Mmap::map(&f) }.map_err(|e| io_err("cannot map", &path, e))?;
            let (n, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| io_err("not a safetensors file:", &path, format!("{e:?}")))?;
            let start = 8 + n;
            for (tname, info) in meta.tensors() {
                let range = (start + info.data_offsets.0, start + info.data_offsets.1);
                if range.1 > map.len() {
                    return Err(err(format!(
                        "{}: tensor {tname} ends past the file (truncated)",
                        path.display()
                    )));
                }
                let entry = Entry {
                    file: i,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    range,
                };
                if src.tensors.insert(tname.clone(), entry).is_some() {
                    return Err(err(format!("tensor {tname} is stored twice")));
                }
            }
            src.maps.push(map);
            src.files.push(path);
        }
        Ok(src)
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The names of the tensors no import step used.
    fn unused(&self) -> Vec<&str> {
        let used = self.used.borrow();
        self.tensors
            .keys()
            .filter(|k| !used.contains(*k))
            .map(String::as_str)
            .collect()
    }

    /// Checks that tensor `copy` holds exactly what `main` does (dtype,
    /// shape and bytes, compared in place in the mapped files) and marks
    /// it used: DeepSeek-V3's MTP copies of the embedding and head.
    fn check_copy(&self, copy: &str, main: &str) -> Result<()> {
        let entry = |name: &str| {
            self.tensors.get(name).ok_or_else(|| {
                err(format!(
                    "tensor {name} is missing from the Hugging Face checkpoint"
                ))
            })
        };
        let (c, m) = (entry(copy)?, entry(main)?);
        let bytes = |e: &Entry| &self.maps[e.file][e.range.0..e.range.1];
        if c.dtype != m.dtype || c.shape != m.shape || bytes(c) != bytes(m) {
            return Err(err(format!(
                "tensor {copy} differs from {main}: foldmoe's multi-token-prediction modules \
                 share the main model's embedding and head, so the two must be equal"
            )));
        }
        self.used.borrow_mut().insert(copy.to_string());
        Ok(())
    }

    /// Tensor `name` as f32 values, checked to have `shape`; fp8 weights
    /// multiplied by their `weight_scale_inv` blocks.
    fn read(&self, name: &str, shape: &[usize], fp8_block: Option<[usize; 2]>) -> Result<Vec<f32>> {
        let e = self.tensors.get(name).ok_or_else(|| {
            err(format!(
                "tensor {name} is missing from the Hugging Face checkpoint"
            ))
        })?;
        if e.shape != shape {
            return Err(err(format!(
                "tensor {name} has shape {:?}, the config gives {shape:?}",
                e.shape
            )));
        }
        self.used.borrow_mut().insert(name.to_string());
        let bytes = &self.maps[e.file][e.range.0..e.range.1];
        let mut vals = decode(name, e.dtype, bytes)?;
        if e.dtype == Dtype::F8_E4M3 {
            let block = fp8_block.ok_or_else(|| {
                err(format!(
                    "tensor {name} is fp8 but the config has no quantization_config"
                ))
            })?;
            let scale_name = format!("{name}_scale_inv");
            let [rows, cols] = match shape {
                [r, c] => [*r, *c],
                _ => return Err(err(format!("fp8 tensor {name} is not 2-d"))),
            };
            let grid = [rows.div_ceil(block[0]), cols.div_ceil(block[1])];
            let scale = self.read(&scale_name, &grid, None)?;
            for (i, row) in vals.chunks_mut(cols).enumerate() {
                for (j, x) in row.iter_mut().enumerate() {
                    *x *= scale[(i / block[0]) * grid[1] + j / block[1]];
                }
            }
        }
        Ok(vals)
    }
}

/// Little-endian values of `dtype` as f32.
fn decode(name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    let two = |f: fn(u16) -> f32| {
        bytes
            .chunks_exact(2)
            .map(|c| f(u16::from_le_bytes([c[0], c[1]])))
            .collect()
    };
    Ok(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => two(|b| f32::from_bits(u32::from(b) << 16)),
        Dtype::F16 => two(f16_to_f32),
        Dtype::F8_E4M3 => bytes.iter().map(|&b| e4m3_to_f32(b)).collect(),
        other => {
            return Err(err(format!(
                "tensor {name} is {other:?}; import reads F32, BF16, F16 and F8_E4M3"
            )))
        }
    })
}

/// `x` rounded to bfloat16 (nearest, ties to even; NaN stays NaN): exact
/// for a value that came from bf16.
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// IEEE half to f32.
fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((h >> 10) & 0x1f);
    let man = f32::from(h & 0x3ff);
    sign * match exp {
        0 => man * 2f32.powi(-24),
        31 if man == 0.0 => f32::INFINITY,
        31 => f32::NAN,
        _ => (1.0 + man / 1024.0) * 2f32.powi(exp - 15),
    }
}

/// OCP e4m3 (`float8_e4m3fn`: bias 7, no infinities, S.1111.111 is NaN).
fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0xf);
    let man = f32::from(b & 0x7);
    sign * match (exp, b & 0x7f) {
        (_, 0x7f) => f32::NAN,
        (0, _) => man / 8.0 * 2f32.powi(-6),
        _ => (1.0 + man / 8.0) * 2f32.powi(exp - 7),
    }
}

/// `[rows, cols]` row-major → `[cols, rows]`.
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for i in 0..rows {
        for j in 0..cols {
            out[j * rows + i] = v[i * cols + j];
        }
    }
    out
}

/// The rotary-dims permutation of one head's `rope` columns starting at
/// `at`: DeepSeek stores them as interleaved pairs `(x0, x1), (x2, x3), …`
/// (`rope_interleave`), foldmoe's RoPE rotates halves. Column `at + j` of
/// foldmoe's layout is column `at + src(j)` of DeepSeek's.
fn rope_src(j: usize, rope: usize) -> usize {
    let half = rope / 2;
    if j < half {
        2 * j
    } else {
        2 * (j - half) + 1
    }
}

/// Where one foldmoe tensor comes from.
enum Recipe {
    /// A Hugging Face tensor as it is.
    Same(String),
    /// A `Linear.weight` `[out, in]`, transposed; with rotary columns
    /// (`(period, first, width)`: in each `period` of output columns, the
    /// `width` from `first` on) de-interleaved.
    Linear(String, Option<(usize, usize, usize)>),
    /// Routed experts `w1`, `w3` or `w2` of a layer.
    Experts { moe: String, which: Proj },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Proj {
    Gate,
    Up,
    Down,
}

/// The Hugging Face side of a conversion: family, rope layout, fp8 blocks
/// and the expert layout.
struct Naming<'a> {
    cfg: &'a HfConfig,
    experts: ExpertLayout,
    /// Mixtral's MoE prefix: `block_sparse_moe` (its published checkpoints)
    /// or `mlp` (transformers 5's own module names).
    mixtral_moe: &'static str,
}

impl Naming<'_> {
    /// The MoE module of Hugging Face layer `l` (an MTP module's too).
    fn moe_prefix(&self, l: usize) -> String {
        match self.cfg.family {
            Family::Mixtral => format!("model.layers.{l}.{}", self.mixtral_moe),
            _ => format!("model.layers.{l}.mlp"),
        }
    }

    /// Per-expert tensor of expert `j`.
    fn expert_name(&self, moe: &str, j: usize, which: Proj) -> String {
        let p = match (self.cfg.family, which) {
            (Family::Mixtral, Proj::Gate) => "w1",
            (Family::Mixtral, Proj::Up) => "w3",
            (Family::Mixtral, Proj::Down) => "w2",
            (_, Proj::Gate) => "gate_proj",
            (_, Proj::Up) => "up_proj",
            (_, Proj::Down) => "down_proj",
        };
        format!("{moe}.experts.{j}.{p}.weight")
    }

    /// The Hugging Face copies of foldmoe tensor `name` beside its own:
    /// each DeepSeek-V3 MTP module's `embed_tokens` and `shared_head.head`
    /// (the main model's embedding and head, which foldmoe's modules share).
    fn copies(&self, name: &str) -> Vec<String> {
        let spec = &self.cfg.spec;
        let mtp = |part: &str| -> Vec<String> {
            (0..spec.mtp_layers)
                .map(|k| format!("model.layers.{}.{part}.weight", spec.layers() + k))
                .collect()
        };
        match name {
            "embed.weight" if spec.tied_embeddings => {
                let mut v = mtp("embed_tokens");
                v.extend(mtp("shared_head.head"));
                v
            }
            "embed.weight" => mtp("embed_tokens"),
            "head.weight" => mtp("shared_head.head"),
            _ => Vec::new(),
        }
    }

    /// The recipe of foldmoe tensor `name`.
    fn recipe(&self, name: &str) -> Result<Recipe> {
        let spec = &self.cfg.spec;
        let unknown = || err(format!("tensor {name} has no Hugging Face counterpart"));
        match name {
            "embed.weight" => return Ok(Recipe::Same("model.embed_tokens.weight".into())),
            "head.weight" => return Ok(Recipe::Same("lm_head.weight".into())),
            "final_norm.weight" => return Ok(Recipe::Same("model.norm.weight".into())),
            _ => {}
        }
        // Block l of the main model, or MTP module k: DeepSeek-V3 stores it
        // as layer L + k, its block's tensors named as a layer's.
        let (l, part, g) = if let Some(rest) = name.strip_prefix("blocks.") {
            let (l, part) = rest.split_once('.').ok_or_else(unknown)?;
            let l: usize = l.parse().map_err(|_| unknown())?;
            (l, part, spec.group_of_layer(l).ok_or_else(unknown)?)
        } else if let Some(rest) = name.strip_prefix("mtp.") {
            let (k, part) = rest.split_once('.').ok_or_else(unknown)?;
            let k: usize = k.parse().map_err(|_| unknown())?;
            if k >= spec.mtp_layers {
                return Err(unknown());
            }
            let l = spec.layers() + k;
            let at = format!("model.layers.{l}");
            match part {
                "enorm.weight" | "hnorm.weight" => return Ok(Recipe::Same(format!("{at}.{part}"))),
                "norm.weight" => return Ok(Recipe::Same(format!("{at}.shared_head.norm.weight"))),
                // [2D, D], embedding rows first: HF's Linear(2D → D) of
                // cat(enorm(e), hnorm(h)), transposed.
                "eh_proj.weight" => {
                    return Ok(Recipe::Linear(format!("{at}.eh_proj.weight"), None))
                }
                _ => {}
            }
            let part = part.strip_prefix("block.").ok_or_else(unknown)?;
            (l, part, spec.groups.last().ok_or_else(unknown)?)
        } else {
            return Err(unknown());
        };
        let at = format!("model.layers.{l}");
        let lin = |hf: &str| Ok(Recipe::Linear(format!("{at}.{hf}.weight"), None));
        let same = |hf: &str| Ok(Recipe::Same(format!("{at}.{hf}")));
        let moe = self.moe_prefix(l);
        let rope = match (&g.attention.mla, self.cfg.rope_interleave) {
            (Some(m), true) => Some(m),
            _ => None,
        };
        // A query projection: each head's rotary columns de-interleaved.
        let query = |hf: &str| {
            let perm = rope.map(|m| {
                let q = m.qk_nope_head_dim + m.qk_rope_head_dim;
                (q, m.qk_nope_head_dim, m.qk_rope_head_dim)
            });
            Ok(Recipe::Linear(format!("{at}.self_attn.{hf}.weight"), perm))
        };
        match part {
            "attn_norm.weight" => same("input_layernorm.weight"),
            "ffn_norm.weight" => same("post_attention_layernorm.weight"),
            "attn.wo" => lin("self_attn.o_proj"),
            "attn.wk" => lin("self_attn.k_proj"),
            "attn.wv" => lin("self_attn.v_proj"),
            "attn.wq" => query("q_proj"),
            "attn.q_norm.weight" if g.attention.mla.is_none() => same("self_attn.q_norm.weight"),
            "attn.k_norm.weight" => same("self_attn.k_norm.weight"),
            "attn.wq_a" => lin("self_attn.q_a_proj"),
            "attn.q_norm.weight" => same("self_attn.q_a_layernorm.weight"),
            "attn.wq_b" => query("q_b_proj"),
            "attn.wkv_a" => {
                let perm = rope.map(|m| {
                    let w = m.kv_lora_rank + m.qk_rope_head_dim;
                    (w, m.kv_lora_rank, m.qk_rope_head_dim)
                });
                Ok(Recipe::Linear(
                    format!("{at}.self_attn.kv_a_proj_with_mqa.weight"),
                    perm,
                ))
            }
            "attn.kv_norm.weight" => same("self_attn.kv_a_layernorm.weight"),
            "attn.wkv_b" => lin("self_attn.kv_b_proj"),
            "mlp.w1" => lin("mlp.gate_proj"),
            "mlp.w3" => lin("mlp.up_proj"),
            "mlp.w2" => lin("mlp.down_proj"),
            "moe.shared_experts.w1" => lin("mlp.shared_experts.gate_proj"),
            "moe.shared_experts.w3" => lin("mlp.shared_experts.up_proj"),
            "moe.shared_experts.w2" => lin("mlp.shared_experts.down_proj"),
            "moe.router.weight" => Ok(Recipe::Linear(format!("{moe}.gate.weight"), None)),
            "moe.router.expert_bias" => {
                Ok(Recipe::Same(format!("{moe}.gate.e_score_correction_bias")))
            }
            "moe.experts.w1" => Ok(Recipe::Experts {
                moe,
                which: Proj::Gate,
            }),
            "moe.experts.w3" => Ok(Recipe::Experts {
                moe,
                which: Proj::Up,
            }),
            "moe.experts.w2" => Ok(Recipe::Experts {
                moe,
                which: Proj::Down,
            }),
            _ => Err(unknown()),
        }
    }
}

/// Column `c` of foldmoe's layout → column of the Hugging Face output dim.
fn src_col(c: usize, perm: Option<(usize, usize, usize)>) -> usize {
    match perm {
        Some((period, first, width)) => {
            let (head, j) = (c / period, c % period);
            if j >= first && j < first + width {
                head * period + first + rope_src(j - first, width)
            } else {
                c
            }
        }
        None => c,
    }
}

/// Values of `block` of a row-major tensor of `shape` given whole.
fn cut(full: &[f32], shape: &[usize], block: &[(usize, usize)]) -> Vec<f32> {
    let n: usize = block.iter().map(|b| b.1).product();
    let mut out = Vec::with_capacity(n);
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    let mut idx = vec![0usize; block.len()];
    if n == 0 {
        return out;
    }
    loop {
        let off: usize = idx
            .iter()
            .zip(block)
            .zip(&strides)
            .map(|((i, b), s)| (b.0 + i) * s)
            .sum();
        out.push(full[off]);
        let mut d = block.len();
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < block[d].1 {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// The expert layout and Mixtral MoE prefix of `src`, from the tensors of
/// its first MoE layer.
fn detect<'a>(src: &HfSource, cfg: &'a HfConfig) -> Naming<'a> {
    let spec = &cfg.spec;
    let first_moe = (0..spec.layers()).find(|&l| {
        matches!(
            spec.group_of_layer(l).map(|g| &g.ffn),
            Some(FfnSpec::Moe(_))
        )
    });
    let mixtral_moe = match first_moe {
        Some(l) if src.has(&format!("model.layers.{l}.mlp.gate.weight")) => "mlp",
        _ => "block_sparse_moe",
    };
    let mut naming = Naming {
        cfg,
        experts: ExpertLayout::PerExpert,
        mixtral_moe,
    };
    if let Some(l) = first_moe {
        if src.has(&format!("{}.experts.gate_up_proj", naming.moe_prefix(l))) {
            naming.experts = ExpertLayout::Fused;
        }
    }
    naming
}

/// How the Hugging Face checkpoint `dir` (of config `cfg`) stores its experts.
pub fn expert_layout(dir: &Path, cfg: &HfConfig) -> Result<ExpertLayout> {
    Ok(detect(&HfSource::open(dir)?, cfg).experts)
}

/// Imports the Hugging Face checkpoint `dir` (its config already read as
/// `cfg`) as a foldmoe checkpoint directory `out` laid out for `layout`
/// (step 0, `meta` in its index), tensors stored as f32. Returns the expert
/// layout found.
pub fn import<M: Serialize>(
    dir: &Path,
    cfg: &HfConfig,
    layout: &Layout,
    out: &Path,
    meta: &M,
) -> Result<ExpertLayout> {
    let src = HfSource::open(dir)?;
    let spec = &cfg.spec;
    let tensors = model_tensors(spec);
    let naming = detect(&src, cfg);
    let recipes = tensors
        .iter()
        .map(|t| naming.recipe(&t.name))
        .collect::<Result<Vec<_>>>()?;
    // The MTP modules' copies of the embedding and head, checked in place
    // before anything is written.
    for (t, r) in tensors.iter().zip(&recipes) {
        if let Recipe::Same(hf) = r {
            for copy in naming.copies(&t.name) {
                src.check_copy(&copy, hf)?;
            }
        }
    }
    let fp8 = cfg.fp8_block;
    let mut fetch = |i: usize, block: &[(usize, usize)]| -> Result<HostData> {
        let t = &tensors[i];
        let vals = match &recipes[i] {
            Recipe::Same(hf) => cut(&src.read(hf, &t.shape, fp8)?, &t.shape, block),
            Recipe::Linear(hf, perm) => {
                let (rows, cols) = (t.shape[0], t.shape[1]);
                // HF [out = cols, in = rows]: our (r, c) is its (src_col(c), r).
                let w = src.read(hf, &[cols, rows], fp8)?;
                let mut full = vec![0.0; rows * cols];
                for r in 0..rows {
                    for c in 0..cols {
                        full[r * cols + c] = w[src_col(c, *perm) * rows + r];
                    }
                }
                cut(&full, &t.shape, block)
            }
            Recipe::Experts { moe, which } => {
                let (e, rows, cols) = (t.shape[0], t.shape[1], t.shape[2]);
                let inner = [(0, 1), block[1], block[2]];
                let mut out = Vec::new();
                let fused = naming.experts == ExpertLayout::Fused;
                // Fused tensors are read once for the whole block's experts.
                let whole = if fused {
                    let (name, shape) = match which {
                        Proj::Down => (format!("{moe}.experts.down_proj"), vec![e, cols, rows]),
                        _ => (
                            format!("{moe}.experts.gate_up_proj"),
                            vec![e, 2 * cols, rows],
                        ),
                    };
                    Some(src.read(&name, &shape, fp8)?)
                } else {
                    None
                };
                for j in block[0].0..block[0].0 + block[0].1 {
                    // Expert j as HF [out = cols, in = rows].
                    let w = match &whole {
                        Some(all) => {
                            let per = all.len() / e;
                            let m = &all[j * per..(j + 1) * per];
                            match which {
                                Proj::Gate => m[..cols * rows].to_vec(),
                                Proj::Up => m[cols * rows..].to_vec(),
                                Proj::Down => m.to_vec(),
                            }
                        }
                        None => {
                            src.read(&naming.expert_name(moe, j, *which), &[cols, rows], fp8)?
                        }
                    };
                    out.extend(cut(&transpose(&w, cols, rows), &[1, rows, cols], &inner));
                }
                out
            }
        };
        Ok(HostData::F32(vals))
    };
    let written = checkpoint::write_params(
        out,
        spec,
        layout,
        &tensors,
        StoredDType::F32,
        0,
        meta,
        &mut fetch,
    );
    if let Err(e) = written {
        let _ = fs::remove_dir_all(format!("{}.tmp", out.display()));
        return Err(e);
    }
    let unused = src.unused();
    if let Some(first) = unused.first() {
        let _ = fs::remove_dir_all(out);
        return Err(err(format!(
            "tensor {first} of the Hugging Face checkpoint is not used by the {} model its \
             config describes ({} unused in all)",
            cfg.family.model_type(),
            unused.len()
        )));
    }
    Ok(naming.experts)
}

/// What an export writes: the Hugging Face tensors of every foldmoe tensor.
struct Planned {
    name: String,
    shape: Vec<usize>,
}

/// The Hugging Face tensors (names and shapes) foldmoe tensor `t` becomes.
fn hf_outputs(naming: &Naming<'_>, t: &ParamTensor) -> Result<Vec<Planned>> {
    let p = |name: String, shape: Vec<usize>| Planned { name, shape };
    Ok(match naming.recipe(&t.name)? {
        Recipe::Same(hf) => std::iter::once(hf)
            .chain(naming.copies(&t.name))
            .map(|name| p(name, t.shape.clone()))
            .collect(),
        Recipe::Linear(hf, _) => vec![p(hf, vec![t.shape[1], t.shape[0]])],
        Recipe::Experts { moe, which } => {
            let (e, rows, cols) = (t.shape[0], t.shape[1], t.shape[2]);
            match (naming.experts, which) {
                (ExpertLayout::PerExpert, w) => (0..e)
                    .map(|j| p(naming.expert_name(&moe, j, w), vec![cols, rows]))
                    .collect(),
                // Gate and up become one tensor: planned at the gate.
                (ExpertLayout::Fused, Proj::Gate) => {
                    vec![p(
                        format!("{moe}.experts.gate_up_proj"),
                        vec![e, 2 * cols, rows],
                    )]
                }
                (ExpertLayout::Fused, Proj::Up) => Vec::new(),
                (ExpertLayout::Fused, Proj::Down) => {
                    vec![p(format!("{moe}.experts.down_proj"), vec![e, cols, rows])]
                }
            }
        }
    })
}

/// The dtype an export writes its tensors in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDtype {
    /// IEEE single precision (`F32`, `float32`).
    F32,
    /// bfloat16, rounded to nearest even (`BF16`, `bfloat16`).
    Bf16,
}

impl ExportDtype {
    /// `bf16` or `f32` (a flag's value); anything else is an error naming it.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" | "float32" => Ok(ExportDtype::F32),
            "bf16" | "bfloat16" => Ok(ExportDtype::Bf16),
            other => Err(err(format!("--dtype {other}: choose bf16 or f32"))),
        }
    }

    /// What a Hugging Face `config.json` says its weights are
    /// (`torch_dtype`, or transformers 5's `dtype`), when bf16 or f32.
    pub fn of_config(raw: &serde_json::Map<String, serde_json::Value>) -> Option<Self> {
        let named = raw.get("torch_dtype").or_else(|| raw.get("dtype"))?;
        match named.as_str()? {
            "float32" => Some(ExportDtype::F32),
            "bfloat16" => Some(ExportDtype::Bf16),
            _ => None,
        }
    }

    fn bytes(self) -> usize {
        match self {
            ExportDtype::F32 => 4,
            ExportDtype::Bf16 => 2,
        }
    }

    /// The safetensors header's name.
    fn safetensors(self) -> &'static str {
        match self {
            ExportDtype::F32 => "F32",
            ExportDtype::Bf16 => "BF16",
        }
    }

    /// The config's name (`torch_dtype`).
    fn torch(self) -> &'static str {
        match self {
            ExportDtype::F32 => "float32",
            ExportDtype::Bf16 => "bfloat16",
        }
    }
}

/// Exports checkpoint `ckpt` (of `cfg.spec`) as a Hugging Face directory
/// `out`: `config.json` (`cfg.raw`, less an fp8 `quantization_config`, its
/// dtype `dtype`), and the tensors in `dtype` in files of at most
/// `max_shard_bytes` (one `model.safetensors`, or shards and
/// `model.safetensors.index.json`). Returns the files written.
pub fn export(
    source: &Source,
    cfg: &HfConfig,
    experts: ExpertLayout,
    out: &Path,
    max_shard_bytes: u64,
    dtype: ExportDtype,
) -> Result<Vec<PathBuf>> {
    let elem = dtype.bytes();
    let spec = &cfg.spec;
    let tensors = model_tensors(spec);
    // Mixtral's published per-expert names, or transformers 5's fused ones.
    let mixtral_moe = match experts {
        ExpertLayout::PerExpert => "block_sparse_moe",
        ExpertLayout::Fused => "mlp",
    };
    let naming = Naming {
        cfg,
        experts,
        mixtral_moe,
    };
    let mut plans = Vec::new();
    for t in &tensors {
        plans.push(hf_outputs(&naming, t)?);
    }
    // Files: tensors in order, a new file when the next would overflow.
    let mut files: Vec<Vec<(usize, usize)>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, outs) in plans.iter().enumerate() {
        for (k, o) in outs.iter().enumerate() {
            let bytes = (elem * o.shape.iter().product::<usize>()) as u64;
            if size > 0 && size + bytes > max_shard_bytes {
                files.push(Vec::new());
                size = 0;
            }
            size += bytes;
            files.last_mut().expect("one file").push((i, k));
        }
    }
    fs::create_dir_all(out).map_err(|e| io_err("cannot create", out, e))?;
    let n_files = files.len();
    let file_name = |f: usize| {
        if n_files == 1 {
            SINGLE.to_string()
        } else {
            format!("model-{:05}-of-{n_files:05}.safetensors", f + 1)
        }
    };
    let mut writers = Vec::new();
    let mut weight_map = serde_json::Map::new();
    let mut where_of = vec![Vec::new(); plans.len()];
    for (f, list) in files.iter().enumerate() {
        let mut header = serde_json::Map::new();
        let mut at = 0usize;
        for &(i, k) in list {
            let o = &plans[i][k];
            let len = elem * o.shape.iter().product::<usize>();
            header.insert(
                o.name.clone(),
                serde_json::json!({"dtype": dtype.safetensors(), "shape": o.shape, "data_offsets": [at, at + len]}),
            );
            weight_map.insert(o.name.clone(), file_name(f).into());
            where_of[i].push(f);
            at += len;
        }
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let mut json = serde_json::to_vec(&header)
            .map_err(|e| err(format!("cannot encode a safetensors header: {e}")))?;
        while json.len() % 8 != 0 {
            json.push(b' ');
        }
        let path = out.join(file_name(f));
        let file = fs::File::create(&path).map_err(|e| io_err("cannot create", &path, e))?;
        let mut w = std::io::BufWriter::new(file);
        w.write_all(&(json.len() as u64).to_le_bytes())
            .and_then(|_| w.write_all(&json))
            .map_err(|e| io_err("cannot write", &path, e))?;
        writers.push((path, w));
    }
    // Fused gate/up: the gate's tensor is written once both are read.
    let mut pending_gate: Option<Vec<f32>> = None;
    for (i, t) in tensors.iter().enumerate() {
        let whole: Vec<(usize, usize)> = t.shape.iter().map(|&n| (0, n)).collect();
        let n: usize = t.shape.iter().product();
        let vals = match source.read_region(&t.name, t.kind, &t.shape, &whole, (0, n), false)? {
            HostData::F32(v) => v,
            other => other.to_f32(),
        };
        let mut chunks: Vec<Vec<f32>> = Vec::new();
        match naming.recipe(&t.name)? {
            Recipe::Same(_) => {
                for _ in naming.copies(&t.name) {
                    chunks.push(vals.clone());
                }
                chunks.push(vals);
            }
            Recipe::Linear(_, perm) => {
                let (rows, cols) = (t.shape[0], t.shape[1]);
                let mut w = vec![0.0; rows * cols];
                for r in 0..rows {
                    for c in 0..cols {
                        w[src_col(c, perm) * rows + r] = vals[r * cols + c];
                    }
                }
                chunks.push(w);
            }
            Recipe::Experts { which, .. } => {
                let (e, rows, cols) = (t.shape[0], t.shape[1], t.shape[2]);
                let per: Vec<Vec<f32>> = vals
                    .chunks(rows * cols)
                    .map(|m| transpose(m, rows, cols))
                    .collect();
                match (experts, which) {
                    (ExpertLayout::PerExpert, _) => chunks.extend(per),
                    (ExpertLayout::Fused, Proj::Gate) => pending_gate = Some(per.concat()),
                    (ExpertLayout::Fused, Proj::Up) => {
                        let gate = pending_gate.take().ok_or_else(|| {
                            err(format!("tensor {}: the gate must come before it", t.name))
                        })?;
                        let m = rows * cols;
                        let mut fused = Vec::with_capacity(2 * e * m);
                        for (j, up) in per.iter().enumerate() {
                            fused.extend_from_slice(&gate[j * m..(j + 1) * m]);
                            fused.extend_from_slice(up);
                        }
                        // Written in the gate's place.
                        let f = where_of[i - 1][0];
                        write_values(&mut writers[f], &fused, dtype)?;
                    }
                    (ExpertLayout::Fused, Proj::Down) => chunks.push(per.concat()),
                }
            }
        }
        for (k, c) in chunks.iter().enumerate() {
            write_values(&mut writers[where_of[i][k]], c, dtype)?;
        }
    }
    let mut paths = Vec::new();
    for (path, w) in writers {
        let f = w
            .into_inner()
            .map_err(|e| io_err("cannot write", &path, e.error()))?;
        f.sync_all().map_err(|e| io_err("cannot sync", &path, e))?;
        paths.push(path);
    }
    if n_files > 1 {
        let total: u64 = plans
            .iter()
            .flatten()
            .map(|o| (elem * o.shape.iter().product::<usize>()) as u64)
            .sum();
        let index =
            serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let path = out.join(INDEX);
        let text = serde_json::to_string_pretty(&index).expect("JSON");
        fs::write(&path, text).map_err(|e| io_err("cannot write", &path, e))?;
        paths.push(path);
    }
    // The tensors are written dequantised, in `dtype`.
    let mut raw = cfg.raw.clone();
    raw.remove("quantization_config");
    raw.insert("dtype".into(), dtype.torch().into());
    raw.remove("torch_dtype");
    let path = out.join("config.json");
    let text = serde_json::to_string_pretty(&raw).expect("JSON");
    fs::write(&path, text + "\n").map_err(|e| io_err("cannot write", &path, e))?;
    paths.push(path);
    Ok(paths)
}

fn write_values(
    w: &mut (PathBuf, std::io::BufWriter<fs::File>),
    v: &[f32],
    dtype: ExportDtype,
) -> Result<()> {
    let mut bytes = Vec::with_capacity(dtype.bytes() * v.len());
    for x in v {
        match dtype {
            ExportDtype::F32 => bytes.extend_from_slice(&x.to_le_bytes()),
            ExportDtype::Bf16 => bytes.extend_from_slice(&bf16_bits(*x).to_le_bytes()),
        }
    }
    w.1.write_all(&bytes)
        .map_err(|e| io_err("cannot write", &w.0, e))
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::DType;

    use super::*;
    use crate::engine::model::Model;
    use crate::engine::Module;

    /// `model_tensors` lists exactly what the engine builds, for a model of
    /// each family's shape (GQA + MoE, q/k norms + dense layers, MLA with
    /// shared experts and expert bias, and an MTP module).
    #[test]
    fn model_tensors_are_the_engines() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf");
        for family in [
            "mixtral",
            "qwen3_moe",
            "deepseek_v3",
            "deepseek_v3_yarn_mtp",
        ] {
            let mut spec = read_config(&fixtures.join(family)).unwrap().spec;
            if family == "qwen3_moe" {
                // A dense layer among the MoE ones, as mlp_only_layers makes.
                let mut dense = spec.groups[0].clone();
                dense.count = 1;
                dense.ffn = FfnSpec::Dense { ffn: 24 };
                spec.groups[0].count -= 1;
                spec.groups.insert(0, dense);
            }
            let b = Cpu;
            let model = Model::single(&b, &spec, 1, DType::F32).unwrap();
            let mut engine = Vec::new();
            model.visit_params(&mut |p| engine.push((p.name.clone(), p.value.shape().to_vec())));
            model.visit_buffers(&mut |name, bias| {
                engine.push((name.to_string(), bias.shape().to_vec()))
            });
            let ours: Vec<(String, Vec<usize>)> = model_tensors(&spec)
                .into_iter()
                .map(|t| (t.name, t.shape))
                .collect();
            engine.sort();
            let mut sorted = ours.clone();
            sorted.sort();
            assert_eq!(sorted, engine, "{family}");
        }
    }

    #[test]
    fn fp8_and_half_decoding() {
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xbe), -1.75);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert!(e4m3_to_f32(0x7f).is_nan());
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    }

    #[test]
    fn rope_columns_deinterleave() {
        // Per head of 6 = [nope 2 | rope 4]: rope (a0 b0 a1 b1) → (a0 a1 b0 b1).
        let perm = Some((6, 2, 4));
        let cols: Vec<usize> = (0..12).map(|c| src_col(c, perm)).collect();
        assert_eq!(cols, vec![0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]);
        assert_eq!(
            cut(&[0., 1., 2., 3., 4., 5.], &[2, 3], &[(1, 1), (1, 2)]),
            vec![4., 5.]
        );
    }
}
