//! Checkpoints on disk: tensors in safetensors, everything else in a JSON
//! config that carries the SHA-256 of the tensor file.
//!
//! A checkpoint is a directory holding `model.safetensors` and `config.json`.
//! Writes are atomic at the directory level: the new checkpoint is written
//! and fsynced under `<dir>.tmp`, the old one moved to `<dir>.old`, the new
//! one renamed into place, the old one removed. A crash at any point leaves
//! either the old or the new checkpoint loadable ([`load`] falls back to
//! `<dir>.old` when `<dir>` is missing). Loading verifies the checksum, so a
//! truncated or altered tensor file is an error, never silent corruption.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use foldmoe_kernels::{Backend, DType, HostData, Tensor};
use safetensors::tensor::{Dtype, TensorView};
use serde::{de::DeserializeOwned, Serialize};
use sha2::{Digest, Sha256};

use super::block::Ffn;
use super::optim::MASTER_SUFFIX;
use super::parallel::model::ParallelFfn;
use super::parallel::trainer::exchange_over_pp;
use super::parallel::trainer::Gather;
use super::parallel::{Ctx, ParallelTrainer};
use super::param::Module;
use super::trainer::Trainer;
use super::{EngineError, Result};

/// File name of the tensors inside a checkpoint directory.
pub const TENSOR_FILE: &str = "model.safetensors";
/// File name of the JSON config inside a checkpoint directory.
pub const CONFIG_FILE: &str = "config.json";

/// One named tensor as stored: shape and host values (f32, f64 or i32).
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensor {
    /// Stable dotted name.
    pub name: String,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Values.
    pub data: HostData,
}

#[derive(Serialize, serde::Deserialize)]
struct Envelope<M> {
    format: String,
    tensors_sha256: String,
    meta: M,
}

const FORMAT: &str = "foldmoe-checkpoint-1";

fn io_err(what: &str, path: &Path, e: impl std::fmt::Display) -> EngineError {
    EngineError::Invalid(format!("{what} {}: {e}", path.display()))
}

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = fs::File::create(path).map_err(|e| io_err("cannot create", path, e))?;
    f.write_all(bytes)
        .map_err(|e| io_err("cannot write", path, e))?;
    f.sync_all().map_err(|e| io_err("cannot sync", path, e))
}

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(suffix);
    dir.with_file_name(name)
}

/// Serialises the tensors to safetensors bytes.
fn tensor_bytes(tensors: &[NamedTensor]) -> Result<Vec<u8>> {
    let raw: Vec<(Dtype, Vec<u8>)> = tensors
        .iter()
        .map(|t| match &t.data {
            HostData::F32(v) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            HostData::F64(v) => (Dtype::F64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            HostData::I32(v) => (Dtype::I32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        })
        .collect();
    let views = tensors
        .iter()
        .zip(&raw)
        .map(|(t, (dtype, bytes))| {
            TensorView::new(*dtype, t.shape.clone(), bytes)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| {
                    EngineError::Invalid(format!("tensor {} cannot be stored: {e}", t.name))
                })
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, None)
        .map_err(|e| EngineError::Invalid(format!("cannot serialise checkpoint tensors: {e}")))
}

/// Writes `tensors` and `meta` as the checkpoint directory `dir`, atomically.
pub fn save<M: Serialize>(dir: &Path, tensors: &[NamedTensor], meta: &M) -> Result<()> {
    let bytes = tensor_bytes(tensors)?;
    let envelope = Envelope {
        format: FORMAT.to_string(),
        tensors_sha256: hex_sha256(&bytes),
        meta,
    };
    let json = serde_json::to_vec_pretty(&envelope)
        .map_err(|e| EngineError::Invalid(format!("cannot serialise checkpoint config: {e}")))?;
    let tmp = sibling(dir, ".tmp");
    let old = sibling(dir, ".old");
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err("cannot clear", &tmp, e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| io_err("cannot create checkpoint directory", &tmp, e))?;
    write_synced(&tmp.join(TENSOR_FILE), &bytes)?;
    write_synced(&tmp.join(CONFIG_FILE), &json)?;
    if dir.exists() {
        if old.exists() {
            fs::remove_dir_all(&old).map_err(|e| io_err("cannot clear", &old, e))?;
        }
        fs::rename(dir, &old).map_err(|e| io_err("cannot move aside", dir, e))?;
    }
    fs::rename(&tmp, dir).map_err(|e| io_err("cannot move into place", dir, e))?;
    if old.exists() {
        fs::remove_dir_all(&old).map_err(|e| io_err("cannot remove", &old, e))?;
    }
    Ok(())
}

/// Reads and verifies the checkpoint `dir`: its tensors (in stored order) and meta.
pub fn load<M: DeserializeOwned>(dir: &Path) -> Result<(Vec<NamedTensor>, M)> {
    let dir = if !dir.exists() && sibling(dir, ".old").exists() {
        sibling(dir, ".old")
    } else {
        dir.to_path_buf()
    };
    if !dir.is_dir() {
        return Err(EngineError::Invalid(format!(
            "checkpoint {} not found (expected a directory with {TENSOR_FILE} and {CONFIG_FILE})",
            dir.display()
        )));
    }
    let cfg_path = dir.join(CONFIG_FILE);
    let json =
        fs::read(&cfg_path).map_err(|e| io_err("cannot read checkpoint config", &cfg_path, e))?;
    let envelope: Envelope<M> = serde_json::from_slice(&json)
        .map_err(|e| io_err("malformed checkpoint config", &cfg_path, e))?;
    if envelope.format != FORMAT {
        return Err(EngineError::Invalid(format!(
            "checkpoint {} has format `{}`, expected `{FORMAT}`",
            cfg_path.display(),
            envelope.format
        )));
    }
    let tpath = dir.join(TENSOR_FILE);
    let bytes =
        fs::read(&tpath).map_err(|e| io_err("cannot read checkpoint tensors", &tpath, e))?;
    let sum = hex_sha256(&bytes);
    if sum != envelope.tensors_sha256 {
        return Err(EngineError::Invalid(format!(
            "checkpoint {} is corrupt or truncated: SHA-256 {sum} ({} bytes) does not match {} recorded in {CONFIG_FILE}",
            tpath.display(),
            bytes.len(),
            envelope.tensors_sha256
        )));
    }
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| io_err("malformed checkpoint tensors", &tpath, e))?;
    // safetensors sorts by name; keep that order, callers look tensors up by name.
    let mut tensors = Vec::new();
    for (name, view) in st.tensors() {
        let b = view.data();
        let data = match view.dtype() {
            Dtype::F32 => HostData::F32(
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            Dtype::I32 => HostData::I32(
                b.chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            Dtype::F64 => HostData::F64(
                b.chunks_exact(8)
                    .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect(),
            ),
            other => {
                return Err(EngineError::Invalid(format!(
                    "checkpoint tensor {name} has unsupported dtype {other:?}"
                )))
            }
        };
        tensors.push(NamedTensor {
            name,
            shape: view.shape().to_vec(),
            data,
        });
    }
    Ok((tensors, envelope.meta))
}

/// Prefix of model parameters in a checkpoint.
const PARAM_PREFIX: &str = "param.";
/// Prefix of optimizer state in a checkpoint.
const OPT_PREFIX: &str = "optim.";
/// Prefix of expert-bias buffers (one per block with a biased router).
const BIAS_PREFIX: &str = "expert_bias.";

/// Everything a trainer needs to continue exactly: parameters, AdamW moments
/// and expert biases, read to the host.
pub fn trainer_tensors<B: Backend>(b: &B, trainer: &Trainer<B>) -> Result<Vec<NamedTensor>> {
    let mut out = Vec::new();
    let mut first_err = None;
    let mut push = |name: String, t: &Tensor<B>| match b.download(t) {
        Ok(data) => out.push(NamedTensor {
            name,
            shape: t.shape().to_vec(),
            data,
        }),
        Err(e) => {
            first_err.get_or_insert(e);
        }
    };
    trainer
        .model
        .visit_params(&mut |p| push(format!("{PARAM_PREFIX}{}", p.name), &p.value));
    trainer
        .opt
        .visit_state(&mut |name, t| push(format!("{OPT_PREFIX}{name}"), t));
    for (i, block) in trainer.model.blocks.iter().enumerate() {
        if let Ffn::Moe(moe) = &block.ffn {
            if let Some(bias) = moe.expert_bias() {
                push(format!("{BIAS_PREFIX}{i}"), bias);
            }
        }
    }
    match first_err {
        Some(e) => Err(e.into()),
        None => Ok(out),
    }
}

/// [`trainer_tensors`] of one rank of a parallel run: the full tensors,
/// gathered from every rank's shards (a collective: every rank calls it), under
/// the same names, so the checkpoint resumes under any layout or on one rank.
pub fn parallel_trainer_tensors<B: Backend>(
    ctx: &Ctx<B>,
    trainer: &mut ParallelTrainer<B>,
) -> Result<Vec<NamedTensor>> {
    let dtype = trainer.model.embed.table.value.dtype();
    let host = |vals: Vec<f64>| match dtype {
        DType::F64 => HostData::F64(vals),
        _ => HostData::F32(vals.into_iter().map(|x| x as f32).collect()),
    };
    let mut out = Vec::new();
    for (name, shape, vals) in trainer.gather_full(ctx, Gather::Values)? {
        out.push(NamedTensor {
            name: format!("{PARAM_PREFIX}{name}"),
            shape,
            data: host(vals),
        });
    }
    let mut state = vec![
        (Gather::ExpAvg, "exp_avg"),
        (Gather::ExpAvgSq, "exp_avg_sq"),
    ];
    if trainer.has_masters() {
        state.push((Gather::Master, MASTER_SUFFIX));
    }
    // f32 holds bf16 parameters, and their f32 moments and masters, exactly.
    for (what, suffix) in state {
        for (name, shape, vals) in trainer.gather_full(ctx, what)? {
            out.push(NamedTensor {
                name: format!("{OPT_PREFIX}{name}.{suffix}"),
                shape,
                data: host(vals),
            });
        }
    }
    // Each stage holds its layers' biases, named by the full model's index.
    let mut biases = Vec::new();
    let layers = trainer.model.global_layers();
    for (block, &i) in trainer.model.blocks.iter().zip(layers) {
        if let ParallelFfn::Moe(moe) = &block.ffn {
            if let Some(bias) = moe.router.expert_bias() {
                let vals = ctx.b.download(bias)?.to_f64();
                biases.push((format!("{BIAS_PREFIX}{i}"), bias.shape().to_vec(), vals));
            }
        }
    }
    for (name, shape, vals) in exchange_over_pp(ctx, biases)? {
        out.push(NamedTensor {
            name,
            shape,
            data: HostData::F32(vals.into_iter().map(|x| x as f32).collect()),
        });
    }
    Ok(out)
}

/// Makes the f32 master copies of a checkpoint fit the trainer's optimizer:
/// - a master the trainer keeps but the checkpoint lacks (written before
///   master copies, or by a run without them) starts as the checkpointed
///   parameter, as a fresh optimizer's would;
/// - a master the checkpoint has but the trainer keeps none of (a bf16 run
///   resumed in f32) becomes the parameter's value: it is the exact weight,
///   the stored parameter only its rounding.
fn reconcile_masters<B: Backend>(
    trainer: &Trainer<B>,
    by_name: &mut std::collections::HashMap<String, NamedTensor>,
) {
    let suffix = format!(".{MASTER_SUFFIX}");
    let mut kept = std::collections::HashSet::new();
    trainer.opt.visit_state(&mut |name, _| {
        if let Some(param) = name.strip_suffix(&suffix) {
            kept.insert(param.to_string());
        }
    });
    let mut params = Vec::new();
    trainer
        .model
        .visit_params(&mut |p| params.push(p.name.clone()));
    for param in params {
        let (pkey, mkey) = (
            format!("{PARAM_PREFIX}{param}"),
            format!("{OPT_PREFIX}{param}{suffix}"),
        );
        if kept.contains(&param) {
            if !by_name.contains_key(&mkey) {
                if let Some(p) = by_name.get(&pkey) {
                    let copy = NamedTensor {
                        name: mkey.clone(),
                        ..p.clone()
                    };
                    by_name.insert(mkey, copy);
                }
            }
        } else if let Some(master) = by_name.remove(&mkey) {
            if by_name.contains_key(&pkey) {
                by_name.insert(
                    pkey.clone(),
                    NamedTensor {
                        name: pkey,
                        ..master
                    },
                );
            }
        }
    }
}

/// Loads tensors written by [`trainer_tensors`] into `trainer`; every tensor
/// the trainer has must be present with the same shape, and none may be left
/// over, except f32 master copies, which [`reconcile_masters`] fits to the
/// trainer's optimizer (so checkpoints from before master copies load).
pub fn restore_trainer<B: Backend>(
    b: &B,
    trainer: &mut Trainer<B>,
    tensors: Vec<NamedTensor>,
) -> Result<()> {
    let mut by_name: std::collections::HashMap<String, NamedTensor> =
        tensors.into_iter().map(|t| (t.name.clone(), t)).collect();
    reconcile_masters(trainer, &mut by_name);
    let mut take = |name: String, into: &mut Tensor<B>| -> Result<()> {
        let t = by_name
            .remove(&name)
            .ok_or_else(|| EngineError::Invalid(format!("checkpoint has no tensor {name}")))?;
        if t.shape != into.shape() {
            return Err(EngineError::Invalid(format!(
                "checkpoint tensor {name} has shape {:?}, the model expects {:?}",
                t.shape,
                into.shape()
            )));
        }
        let dtype = into.dtype();
        let loaded = b.upload(t.data, &t.shape)?;
        *into = if loaded.dtype() == dtype {
            loaded
        } else {
            b.cast(&loaded, dtype)?
        };
        Ok(())
    };
    let mut result = Ok(());
    trainer.model.visit_params_mut(&mut |p| {
        if result.is_ok() {
            result = take(format!("{PARAM_PREFIX}{}", p.name), &mut p.value);
        }
    });
    trainer.opt.visit_state_mut(&mut |name, t| {
        if result.is_ok() {
            result = take(format!("{OPT_PREFIX}{name}"), t);
        }
    });
    result?;
    for (i, block) in trainer.model.blocks.iter_mut().enumerate() {
        if let Some(moe) = block.moe_mut() {
            if let Some(bias) = moe.expert_bias() {
                let mut bias = bias.clone();
                take(format!("{BIAS_PREFIX}{i}"), &mut bias)?;
                moe.set_expert_bias(bias)?;
            }
        }
    }
    if let Some(extra) = by_name.keys().next() {
        return Err(EngineError::Invalid(format!(
            "checkpoint tensor {extra} does not belong to this model ({} unused tensors); was it written for another model?",
            by_name.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("foldmoe-ckpt-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn sample() -> Vec<NamedTensor> {
        vec![
            NamedTensor {
                name: "a.w".into(),
                shape: vec![2, 3],
                data: HostData::F32(vec![1.0, -2.0, 3.5, 0.0, 1e-8, 7.0]),
            },
            NamedTensor {
                name: "b.bias".into(),
                shape: vec![2],
                data: HostData::F64(vec![0.25, -1.0]),
            },
            NamedTensor {
                name: "c.ids".into(),
                shape: vec![1],
                data: HostData::I32(vec![-7]),
            },
        ]
    }

    #[test]
    fn checkpoint_round_trips_and_replaces_atomically() {
        let dir = tmpdir("rt").join("ckpt");
        save(&dir, &sample(), &serde_json::json!({"step": 3})).unwrap();
        save(&dir, &sample(), &serde_json::json!({"step": 4})).unwrap();
        let (mut t, meta): (Vec<NamedTensor>, serde_json::Value) = load(&dir).unwrap();
        t.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(t, sample());
        assert_eq!(meta["step"], 4);
        assert!(!sibling(&dir, ".tmp").exists() && !sibling(&dir, ".old").exists());
    }

    #[test]
    fn truncated_checkpoint_is_detected() {
        let dir = tmpdir("trunc").join("ckpt");
        save(&dir, &sample(), &1u32).unwrap();
        let p = dir.join(TENSOR_FILE);
        let bytes = fs::read(&p).unwrap();
        fs::write(&p, &bytes[..bytes.len() - 5]).unwrap();
        let err = load::<u32>(&dir).unwrap_err().to_string();
        assert!(
            err.contains("corrupt or truncated") && err.contains(TENSOR_FILE),
            "{err}"
        );
    }

    #[test]
    fn altered_checkpoint_is_detected() {
        let dir = tmpdir("flip").join("ckpt");
        save(&dir, &sample(), &1u32).unwrap();
        let p = dir.join(TENSOR_FILE);
        let mut bytes = fs::read(&p).unwrap();
        let n = bytes.len();
        bytes[n - 2] ^= 0x10;
        fs::write(&p, &bytes).unwrap();
        assert!(load::<u32>(&dir)
            .unwrap_err()
            .to_string()
            .contains("does not match"));
    }

    #[test]
    fn missing_checkpoint_names_the_path() {
        let dir = tmpdir("missing").join("nothing-here");
        let err = load::<u32>(&dir).unwrap_err().to_string();
        assert!(
            err.contains("nothing-here") && err.contains("not found"),
            "{err}"
        );
    }

    #[test]
    fn interrupted_swap_falls_back_to_old() {
        let dir = tmpdir("swap").join("ckpt");
        save(&dir, &sample(), &9u32).unwrap();
        fs::rename(&dir, sibling(&dir, ".old")).unwrap();
        let (_, meta): (_, u32) = load(&dir).unwrap();
        assert_eq!(meta, 9);
    }

    /// A one-rank trainer with f32 master copies (forced on f32 parameters,
    /// so the master path is checked against exact f32 values) after three
    /// updates.
    fn trained_with_masters(seed: u64) -> Trainer<foldmoe_kernels::cpu::Cpu> {
        use super::super::optim::MasterWeights;
        use super::super::trainer::TrainConfig;
        use crate::engine::model::Model;
        use crate::engine::testutil::{small_spec, uniform};
        use crate::spec::FfnSpec;
        use foldmoe_kernels::cpu::Cpu;
        use foldmoe_kernels::Device;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let cfg = TrainConfig {
            master_weights: MasterWeights::Bf16AndF32,
            ..TrainConfig::default()
        };
        let model = Model::new(&Cpu, &spec, seed, DType::F32).unwrap();
        let mut trainer = Trainer::new(&Cpu, model, cfg).unwrap();
        for step in 0..3 {
            let mut s = step * 100;
            trainer.model.visit_params_mut(&mut |p| {
                s += 1;
                let g = uniform(s, p.grad.numel(), 1.0)
                    .iter()
                    .map(|&x| x as f32)
                    .collect();
                p.grad = Cpu.upload(HostData::F32(g), p.grad.shape()).unwrap();
            });
            trainer.opt.step(&Cpu, &mut trainer.model, 1e-2).unwrap();
        }
        trainer
    }

    fn sorted(mut t: Vec<NamedTensor>) -> Vec<NamedTensor> {
        t.sort_by(|a, b| a.name.cmp(&b.name));
        t
    }

    #[test]
    fn master_copies_are_saved_and_restored() {
        use foldmoe_kernels::cpu::Cpu;
        let saved = trainer_tensors(&Cpu, &trained_with_masters(3)).unwrap();
        assert!(saved
            .iter()
            .any(|t| t.name == "optim.embed.weight.fp32_param"));
        let mut fresh = trained_with_masters(4);
        restore_trainer(&Cpu, &mut fresh, saved.clone()).unwrap();
        assert_eq!(
            sorted(trainer_tensors(&Cpu, &fresh).unwrap()),
            sorted(saved)
        );
    }

    /// A checkpoint without master copies (written before them) loads: each
    /// master starts as its parameter. One with masters loads into a trainer
    /// that keeps none: the masters become the parameters.
    #[test]
    fn checkpoints_without_masters_load_and_masters_load_without_them() {
        use foldmoe_kernels::cpu::Cpu;
        let saved = trainer_tensors(&Cpu, &trained_with_masters(3)).unwrap();
        let old: Vec<NamedTensor> = saved
            .iter()
            .filter(|t| !t.name.ends_with(".fp32_param"))
            .cloned()
            .collect();
        assert!(old.len() < saved.len());
        let mut fresh = trained_with_masters(4);
        restore_trainer(&Cpu, &mut fresh, old).unwrap();
        assert_eq!(
            sorted(trainer_tensors(&Cpu, &fresh).unwrap()),
            sorted(saved.clone())
        );

        let mut shifted = saved;
        for t in &mut shifted {
            if t.name == "optim.embed.weight.fp32_param" {
                t.data = HostData::F32(t.data.to_f32().iter().map(|x| x + 0.5).collect());
            }
        }
        let want = shifted
            .iter()
            .find(|t| t.name == "optim.embed.weight.fp32_param")
            .unwrap()
            .data
            .clone();
        let cfg = super::super::trainer::TrainConfig::default();
        let model = crate::engine::model::Model::new(
            &Cpu,
            &crate::engine::testutil::small_spec(&[crate::spec::FfnSpec::Dense { ffn: 6 }], false),
            4,
            DType::F32,
        )
        .unwrap();
        let mut plain = Trainer::new(&Cpu, model, cfg).unwrap();
        assert!(!plain.opt.has_masters());
        restore_trainer(&Cpu, &mut plain, shifted).unwrap();
        let got = trainer_tensors(&Cpu, &plain).unwrap();
        assert!(got.iter().all(|t| !t.name.ends_with(".fp32_param")));
        let embed = got.iter().find(|t| t.name == "param.embed.weight").unwrap();
        assert_eq!(embed.data, want);
    }
}
