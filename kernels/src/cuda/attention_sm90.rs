//! Hopper (sm_90a) flash attention on TMA and wgmma (`attention_sm90.cu`,
//! FlashAttention-3's design: a producer warpgroup copying tiles with the
//! copy engine, two consumer warpgroups taking turns on the tensor cores
//! with the softmax of one key tile under the next tile's products).
//!
//! `attention.rs` asks [`Cuda::sm90_attention_fits`] first and runs these
//! kernels where they fit: bf16 on an sm_90a device, head dims 64, 128 and
//! 192 (MLA's query/key width; `mla.rs` zero-pads its 128-wide values to
//! it), 16-byte aligned operands. `FOLDMOE_ATTENTION=mma` keeps the mma.sync
//! flash kernels (and `=cublas` the cuBLAS path) for comparisons.
//!
//! Shape letters: B batch, S sequence, Hq query heads, Hkv kv heads, Hd head
//! dim.

use std::sync::OnceLock;

use cudarc::driver::{sys, LaunchConfig};

use super::compile::ATTENTION_SM90;
use super::linalg::tma_map;
use super::{launch, Cuda};
use crate::error::Result;
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
        let sms = self
            .ctx()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| super::alloc::driver_err("reading the multiprocessor count", e))?;
        let tiles = s.div_ceil(FWD_QUERIES) * hq * b;
        let cfg = LaunchConfig {
            grid_dim: (tiles.clamp(1, sms.max(1) as usize) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
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
}

#[cfg(test)]
mod tests {
    use crate::backend::AttentionOps as _;
    use crate::cpu::test_util::Compare;
    use crate::cpu::Cpu;
    use crate::tensor::DType;

    /// On an sm_90a device the wgmma forward is the one that runs (every
    /// head dim, S = 1, ragged S, GQA 1 and 8, several key tiles so the
    /// pipeline's stages wrap), and it matches the CPU in bf16 with peaked
    /// scores; enough tiles at one shape that persistent blocks take more
    /// than one.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn wgmma_forward_matches_the_cpu() {
        let d = crate::cuda::require_test_device();
        if d.arch() != "sm_90a" {
            eprintln!("skipping: {} is not sm_90a", d.arch());
            return;
        }
        let mut c = Compare::new(&d, DType::BF16, 7);
        for (b, s, hq, hkv, hd) in [
            (1, 1, 8, 8, 128),
            (2, 300, 8, 1, 64),
            (1, 700, 8, 1, 128),
            (1, 129, 4, 4, 128),
            (1, 500, 2, 1, 192),
            // 144 tiles: past one per multiprocessor, so blocks take several.
            (2, 1100, 8, 2, 64),
        ] {
            let (q, qc) = c.rand(&[b, s, hq, hd], 3.0);
            let (k, kc) = c.rand(&[b, s, hkv, hd], 3.0);
            let (v, vc) = c.rand(&[b, s, hkv, hd], 1.0);
            assert!(
                d.sm90_attention_fits(&[&q, &k, &v], (b, s, hq, hkv, hd)),
                "the wgmma kernels take Hd {hd}"
            );
            let (o, lse) = d.attention(&q, &k, &v).unwrap();
            let (oc, lsec) = Cpu.attention(&qc, &kc, &vc).unwrap();
            let what = format!("B={b} S={s} Hq={hq} Hkv={hkv} Hd={hd}");
            c.check(&format!("wgmma o {what}"), &o, &oc);
            c.check(&format!("wgmma lse {what}"), &lse, &lsec);
        }
        c.report("wgmma attention forward");
    }
}
