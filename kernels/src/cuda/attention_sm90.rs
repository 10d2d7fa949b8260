//! Hopper (sm_90a) flash attention on TMA and wgmma (`attention_sm90.cu`,
//! FlashAttention-3's design: a producer warpgroup copying tiles with the
//! copy engine, two consumer warpgroups taking turns on the tensor cores
//! with the softmax of one key tile under the next tile's products).
//!
//! `attention.rs` asks [`Cuda::sm90_attention_fits`] (and, for the
//! backward, [`Cuda::sm90_attention_backward_fits`]) first and runs these
//! kernels where they fit: bf16 on an sm_90a device, 16-byte aligned
//! operands, head dims 64, 128 and 192 (192 is MLA's query/key width; the
//! backward at 192 is MLA's only, asked for through
//! `attention_backward_padded_values` with 128-wide values zero-padded, as
//! `mla.rs` builds them: it reads 128 value columns and reports nonzero
//! padding of v or dO as an invalid argument; a general Hd-192 backward
//! takes the other paths). `FOLDMOE_ATTENTION=mma` keeps the mma.sync
//! flash kernels (and `=cublas` the cuBLAS path) for comparisons.
//!
//! Shape letters: B batch, S sequence, Hq query heads, Hkv kv heads, Hd head
//! dim.

use std::sync::OnceLock;

use super::compile::ATTENTION_SM90;
use super::linalg::tma_map;
use super::{block_cfg, grid_for, launch, warp_rows_cfg, Cuda};
use crate::error::{KernelError, Result};
use crate::tensor::{DType, Tensor};

/// Threads of a block: two consumer warpgroups and one producer
/// (`FA3_THREADS`).
const THREADS: u32 = 384;

/// Queries of a forward block (`FA3_BM`).
const FWD_QUERIES: usize = 128;

/// The forward's key tile and pipeline stages for head dim `hd` (the
/// `FA3_FWD(HD, BN, STAGES)` instances of the `.cu` file).
fn fwd_tile(hd: usize) -> (usize, usize) {
    if hd == 192 {
        (96, 2)
    } else {
        (128, 2)
    }
}

/// Dynamic shared memory of the forward (`FA3_FWD_SMEM`): alignment slack,
/// the query tile, the K and V stages, the mbarriers.
fn fwd_smem(hd: usize) -> u32 {
    let (bn, stages) = fwd_tile(hd);
    (1024 + FWD_QUERIES * hd * 2 + 2 * stages * bn * hd * 2 + 256) as u32
}

/// Keys of a backward block (`FA3_BWD_KEYS`) and queries of its steps
/// (`FA3_BWD_Q`).
const BWD_KEYS: usize = 128;
const BWD_QUERIES: usize = 64;
/// The backward's kernel for head dim `hd`: its name suffix, the value
/// columns it reads and its Q / dO stages (the `FA3_BWD(NAME, HD, HV, NS)`
/// instances of the `.cu` file).
fn bwd_kernel(hd: usize) -> (&'static str, usize, usize) {
    match hd {
        64 => ("hd64", 64, 3),
        128 => ("hd128", 128, 3),
        _ => ("mla", MLA_VALUES, 2),
    }
}

/// MLA's value width inside the head dim 192 (`mla.rs` zero-pads to 192).
const MLA_VALUES: usize = 128;

/// Dynamic shared memory of the backward (`FA3_BWD_SMEM`): alignment slack,
/// K and V, the stages of Q and dO, two dSᵀ buffers, the dQ staging (64 × 64
/// f32 a warpgroup, but none at hd 64, which adds dQ from registers), the
/// ring of lse and delta (512 bytes a stage), the mbarriers.
fn bwd_smem(hd: usize) -> u32 {
    let (_, hv, stages) = bwd_kernel(hd);
    let stage = BWD_QUERIES * (hd + hv) * 2;
    let dq_staging = if hd == 64 {
        0
    } else {
        2 * BWD_QUERIES * 64 * 4
    };
    (1024 + BWD_KEYS * (hd + hv) * 2 + stages * (stage + 512) + 2 * 16384 + dq_staging + 64) as u32
}

/// Whether `FOLDMOE_ATTENTION` leaves these kernels on (read once).
fn allowed() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    *ALLOWED.get_or_init(|| {
        std::env::var("FOLDMOE_ATTENTION").map_or(true, |v| v != "mma" && v != "cublas")
    })
}

impl Cuda {
    /// Whether the wgmma kernels take attention over `q`, `k`, `v` with
    /// `(B, S, Hq, Hkv, Hd)` already checked: bf16, an sm_90a device, Hd
    /// 64, 128 or 192, a non-empty problem whose tile count fits an i32,
    /// 16-byte aligned bases.
    pub(crate) fn sm90_attention_fits(
        &self,
        tensors: &[&Tensor<Self>],
        (b, s, hq, hkv, hd): (usize, usize, usize, usize, usize),
    ) -> bool {
        let lim = i32::MAX as usize;
        allowed()
            && self.arch() == "sm_90a"
            && tensors.iter().all(|t| t.dtype() == DType::BF16)
            && matches!(hd, 64 | 128 | 192)
            && b > 0
            && s > 0
            && hkv > 0
            && s < lim
            && s.div_ceil(FWD_QUERIES) * hq * b < lim
            && tensors.iter().all(|t| t.storage().ptr() % 16 == 0)
    }

    /// The forward: `(o [B, S, Hq, Hd], lse [B, Hq, S] f32)`; the caller has
    /// checked the shapes and [`Self::sm90_attention_fits`].
    pub(crate) fn sm90_attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        (b, s, hq, hkv, hd): (usize, usize, usize, usize, usize),
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "attention";
        let o = self.alloc(OP, q.shape(), DType::BF16)?;
        let lse = self.alloc(OP, &[b, hq, s], DType::F32)?;
        let (bn, _) = fwd_tile(hd);
        let dims = |h: usize| [hd as u64, h as u64, s as u64, b as u64];
        let tq = tma_map(
            OP,
            q.storage().ptr(),
            &dims(hq),
            &[64, 1, FWD_QUERIES as u32, 1],
        )?;
        let tk = tma_map(OP, k.storage().ptr(), &dims(hkv), &[64, 1, bn as u32, 1])?;
        let tv = tma_map(OP, v.storage().ptr(), &dims(hkv), &[64, 1, bn as u32, 1])?;
        let smem = fwd_smem(hd);
        self.bind()?;
        let f = self.func_smem(ATTENTION_SM90, &format!("fa3_fwd_bf16_hd{hd}"), smem)?;
        // Persistent: one block per multiprocessor (or per tile, if fewer).
        let grid = self.persistent_grid(s.div_ceil(FWD_QUERIES) * hq * b)?;
        let cfg = block_cfg((grid, 1, 1), THREADS, smem);
        let scale_log2 = std::f64::consts::LOG2_E / (hd as f64).sqrt();
        launch!(
            self,
            f,
            cfg,
            tq,
            tk,
            tv,
            o.storage().ptr(),
            lse.storage().ptr(),
            s as i32,
            b as i32,
            hq as i32,
            hkv as i32,
            scale_log2 as f32
        )?;
        Ok((o, lse))
    }

    /// Whether the wgmma backward takes the problem: as
    /// [`Self::sm90_attention_fits`], and at Hd 192 only MLA's values
    /// (`value_dim` 128, zero-padded): the kernel there is MLA's, since two
    /// 64 × 192 f32 accumulators of dK and dV would not fit a consumer's
    /// registers.
    pub(crate) fn sm90_attention_backward_fits(
        &self,
        tensors: &[&Tensor<Self>],
        dims: (usize, usize, usize, usize, usize),
        value_dim: Option<usize>,
    ) -> bool {
        (dims.4 != 192 || value_dim == Some(MLA_VALUES)) && self.sm90_attention_fits(tensors, dims)
    }

    /// The backward: `(dq, dk, dv)` from the forward's `o` and f32 `lse`;
    /// the caller has checked the shapes and
    /// [`Self::sm90_attention_backward_fits`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sm90_attention_backward(
        &self,
        d_o: &Tensor<Self>,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        o: &Tensor<Self>,
        lse: &Tensor<Self>,
        (b, s, hq, hkv, hd): (usize, usize, usize, usize, usize),
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "attention_backward";
        let sp = s.div_ceil(BWD_QUERIES) * BWD_QUERIES;
        let rows = b * hq * sp;
        let lse2 = self.scratch(OP, rows * 4)?;
        let delta = self.scratch(OP, rows * 4)?;
        // The dQ accumulator, tile by tile: fa3_bwd_prep zeroes it (the
        // blocks add into it).
        let dq_acc = self.scratch(OP, rows * hd * 4)?;
        self.bind()?;
        // The multiprocessor count (a grid of one block per SM).
        let sms = self.persistent_grid(usize::MAX)? as usize;
        let f = self.func(ATTENTION_SM90, "fa3_bwd_prep")?;
        launch!(
            self,
            f,
            // At most 16 blocks an SM, each warp striding over the rows
            // (fa3_bwd_prep).
            warp_rows_cfg(rows.min(8 * 16 * sms)),
            d_o.storage().ptr(),
            o.storage().ptr(),
            lse.storage().ptr(),
            lse2.ptr(),
            delta.ptr(),
            dq_acc.ptr(),
            // rows · hd is a multiple of 4 (hd is 64, 128 or 192).
            (rows * hd / 4) as i64,
            b as i32,
            s as i32,
            sp as i32,
            hq as i32,
            hd as i32,
            // MLA's O is zero past its 128 value columns: delta reads those.
            (if hd == 192 { MLA_VALUES } else { hd }) as i32
        )?;
        let dk = self.alloc(OP, k.shape(), DType::BF16)?;
        let dv = self.alloc(OP, v.shape(), DType::BF16)?;
        let dims = |h: usize| [hd as u64, h as u64, s as u64, b as u64];
        let qbox = [64, 1, BWD_QUERIES as u32, 1];
        let kbox = [64, 1, BWD_KEYS as u32, 1];
        let tq = tma_map(OP, q.storage().ptr(), &dims(hq), &qbox)?;
        let tdo = tma_map(OP, d_o.storage().ptr(), &dims(hq), &qbox)?;
        let tk = tma_map(OP, k.storage().ptr(), &dims(hkv), &kbox)?;
        let tv = tma_map(OP, v.storage().ptr(), &dims(hkv), &kbox)?;
        let smem = bwd_smem(hd);
        let (name, _, _) = bwd_kernel(hd);
        if hd == 192 {
            self.mla_padding_check(v, d_o)?;
        }
        let f = self.func_smem(ATTENTION_SM90, &format!("fa3_bwd_bf16_{name}"), smem)?;
        let cfg = block_cfg(
            ((s.div_ceil(BWD_KEYS) * hkv * b) as u32, 1, 1),
            THREADS,
            smem,
        );
        let scale = 1.0 / (hd as f64).sqrt();
        launch!(
            self,
            f,
            cfg,
            tq,
            tk,
            tv,
            tdo,
            lse2.ptr(),
            delta.ptr(),
            dq_acc.ptr(),
            dk.storage().ptr(),
            dv.storage().ptr(),
            s as i32,
            b as i32,
            hq as i32,
            hkv as i32,
            scale as f32,
            (scale * std::f64::consts::LOG2_E) as f32
        )?;
        let dq = self.alloc(OP, q.shape(), DType::BF16)?;
        let f = self.func(ATTENTION_SM90, "fa3_dq_convert")?;
        launch!(
            self,
            f,
            cudarc::driver::LaunchConfig {
                // A block per 64-query tile of one head (fa3_dq_convert).
                grid_dim: ((b * hq * s.div_ceil(64)).min(1 << 30) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            dq_acc.ptr(),
            dq.storage().ptr(),
            b as i32,
            s as i32,
            hq as i32,
            hd as i32,
            scale as f32
        )?;
        Ok((dq, dk, dv))
    }

    /// MLA's backward reads 128 of v's and dO's 192 columns: a nonzero
    /// padding element (which it would drop) is reported at the next read as
    /// an invalid argument naming it (`fa3_pad_check`, no host wait).
    fn mla_padding_check(&self, v: &Tensor<Self>, d_o: &Tensor<Self>) -> Result<()> {
        const OP: &str = "attention_backward";
        let code = |what: &'static str| {
            self.check(move |index, value| KernelError::InvalidArgument {
                op: OP,
                detail: format!(
                    "head dim 192 runs MLA's kernel, whose values are {MLA_VALUES} wide and \
                     zero-padded: {what} element {index} (column {}) is {value}",
                    index % 192
                ),
            })
        };
        let (cv, cdo) = (code("v")?, code("d_o")?);
        let (nv, ndo) = (v.numel() / 192, d_o.numel() / 192);
        let f = self.func(ATTENTION_SM90, "fa3_pad_check")?;
        launch!(
            self,
            f,
            grid_for((nv + ndo) * 8),
            v.storage().ptr(),
            d_o.storage().ptr(),
            nv as i64,
            ndo as i64,
            self.err_ptr(),
            cv,
            cdo
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::AttentionOps as _;
    use crate::backend::Device as _;
    use crate::cpu::test_util::{t32, Compare, TestDevice as _};
    use crate::cpu::Cpu;
    use crate::tensor::{DType, Tensor};

    /// On an sm_90a device the wgmma kernels are the ones that run (forward
    /// and backward at every head dim, MLA's values zero-padded; S = 1, ragged
    /// S, GQA 1 and 8, several key and query tiles so the pipelines' stages
    /// wrap, enough tiles at one shape that persistent blocks take more than
    /// one), and they match the CPU in bf16 with peaked scores: o, lse, and
    /// dq, dk, dv given the device's own o and lse on both sides.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn wgmma_attention_matches_the_cpu() {
        let Some(d) = crate::cuda::require_sm90_test_device() else {
            return;
        };
        let mut c = Compare::new(&d, DType::BF16, 7);
        for (b, s, hq, hkv, hd) in [
            (1, 1, 8, 8, 128),
            (2, 300, 8, 1, 64),
            (1, 700, 8, 1, 128),
            (1, 129, 4, 4, 128),
            (1, 500, 2, 1, 192),
            (2, 333, 16, 2, 192),
            // 144 tiles: past one per multiprocessor, so blocks take several.
            (2, 1100, 8, 2, 64),
        ] {
            let (q, qc) = c.rand(&[b, s, hq, hd], 3.0);
            let (k, kc) = c.rand(&[b, s, hkv, hd], 3.0);
            let hv = if hd == 192 { 128 } else { hd };
            let (v, vc) = c.rand_padded(&[b, s, hkv, hd], 1.0, hv);
            assert!(
                d.sm90_attention_fits(&[&q, &k, &v], (b, s, hq, hkv, hd)),
                "the wgmma kernels take Hd {hd}"
            );
            let (o, lse) = d.attention(&q, &k, &v, None).unwrap();
            let (oc, lsec) = Cpu.attention(&qc, &kc, &vc, None).unwrap();
            let what = format!("B={b} S={s} Hq={hq} Hkv={hkv} Hd={hd}");
            c.check(&format!("wgmma o {what}"), &o, &oc);
            c.check(&format!("wgmma lse {what}"), &lse, &lsec);
            let value_dim = (hd == 192).then_some(hv);
            assert!(d.sm90_attention_backward_fits(&[&q, &k, &v], (b, s, hq, hkv, hd), value_dim));
            if hd == 192 {
                // A general Hd-192 backward (no value width) is not MLA's kernel.
                assert!(!d.sm90_attention_backward_fits(&[&q, &k, &v], (b, s, hq, hkv, hd), None));
            }
            let same = |t: &Tensor<crate::cuda::Cuda>| {
                let h: Vec<f32> = d.h64(t).iter().map(|&x| x as f32).collect();
                t32(&h, t.shape())
            };
            let (d_o, d_oc) = c.rand_padded(&[b, s, hq, hd], 1.0, hv);
            let (dq, dk, dv) = d
                .attention_backward_padded_values(&d_o, &q, &k, &v, &o, &lse, None, hv)
                .unwrap();
            let (dqc, dkc, dvc) = Cpu
                .attention_backward(&d_oc, &qc, &kc, &vc, &same(&o), &same(&lse), None)
                .unwrap();
            c.check(&format!("wgmma dq {what}"), &dq, &dqc);
            c.check(&format!("wgmma dk {what}"), &dk, &dkc);
            c.check(&format!("wgmma dv {what}"), &dv, &dvc);
        }
        c.report("wgmma attention");
    }

    /// MLA's backward (Hd 192, values 128 wide): nonzero padding in v or dO
    /// is a typed error naming the element, not a wrong result.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn mla_backward_rejects_nonzero_value_padding() {
        let Some(d) = crate::cuda::require_sm90_test_device() else {
            return;
        };
        let mut c = Compare::new(&d, DType::BF16, 5);
        let (b, s, hq, hkv, hd) = (1, 70, 2, 1, 192);
        let (q, _) = c.rand(&[b, s, hq, hd], 1.0);
        let (k, _) = c.rand(&[b, s, hkv, hd], 1.0);
        let (v, _) = c.rand_padded(&[b, s, hkv, hd], 1.0, 128);
        let (o, lse) = d.attention(&q, &k, &v, None).unwrap();
        for (what, vp, dp) in [("v", 150, 128), ("d_o", 128, 131)] {
            let (v2, _) = c.rand_padded(&[b, s, hkv, hd], 1.0, vp);
            let (d_o, _) = c.rand_padded(&[b, s, hq, hd], 1.0, dp);
            let err = d
                .attention_backward_padded_values(&d_o, &q, &k, &v2, &o, &lse, None, 128)
                .and_then(|(dq, _, _)| d.download(&dq).map(|_| ()))
                .expect_err("nonzero padding must be reported");
            let msg = err.to_string();
            assert!(
                msg.contains("invalid argument") && msg.contains(&format!("{what} element")),
                "{msg}"
            );
        }
    }
}
