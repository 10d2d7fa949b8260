//! CUDA causal grouped-query attention (kernels in `attention.cu`), with the
//! checks of `cpu/attention.rs`.
//!
//! Shape letters: B batch, S sequence, Hq query heads, Hkv kv heads, Hd head
//! dim.

use super::compile::ATTENTION;
use super::{float_sfx, grid_for, launch, Cuda};
use crate::backend::AttentionOps;
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::Tensor;

/// The largest head dim the per-row kernels hold in registers.
const MAX_HD: usize = 256;

/// `(B, S, Hq, Hkv, Hd)` after the CPU's checks, plus the kernels' limit.
fn check_qkv(
    op: &'static str,
    q: &Tensor<Cuda>,
    k: &Tensor<Cuda>,
    v: &Tensor<Cuda>,
) -> Result<(usize, usize, usize, usize, usize)> {
    let (b, s, hq, hd) = q.dims4(op)?;
    let (kb, ks, hkv, khd) = k.dims4(op)?;
    if (kb, ks, khd) != (b, s, hd) {
        return Err(shape_err(
            op,
            format!(
                "q has shape {:?} [B, S, Hq, Hd] but k has shape {:?}; k must be [{b}, {s}, Hkv, {hd}]",
                q.shape(),
                k.shape()
            ),
        ));
    }
    v.expect_shape(op, "v", k.shape())?;
    if hkv == 0 || !hq.is_multiple_of(hkv) {
        return Err(shape_err(
            op,
            format!(
                "Hq = {hq} query heads must be a positive multiple of Hkv = {hkv} kv heads \
                 (grouped-query attention shares each kv head among Hq / Hkv query heads)"
            ),
        ));
    }
    if hd == 0 {
        return Err(arg_err(
            op,
            "head dim Hd = 0: scores would be scaled by 1/sqrt(0)",
        ));
    }
    if hd > MAX_HD {
        return Err(arg_err(
            op,
            format!("head dim Hd = {hd} exceeds the {MAX_HD} the CUDA attention kernels support"),
        ));
    }
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        return Err(KernelError::DTypeMismatch {
            op,
            expected: q.dtype(),
            got: if k.dtype() != q.dtype() {
                k.dtype()
            } else {
                v.dtype()
            },
        });
    }
    Ok((b, s, hq, hkv, hd))
}

impl AttentionOps for Cuda {
    fn attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "attention";
        let sfx = float_sfx(OP, q.dtype())?;
        let (b, s, hq, hkv, hd) = check_qkv(OP, q, k, v)?;
        let o = self.alloc(OP, q.shape(), q.dtype())?;
        let lse = self.alloc(OP, &[b, hq, s], q.dtype())?;
        let rows = b * hq * s;
        if rows > 0 {
            let f = self.func(ATTENTION, &format!("attn_fwd_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(rows),
                q.storage().ptr(),
                k.storage().ptr(),
                v.storage().ptr(),
                o.storage().ptr(),
                lse.storage().ptr(),
                b as i64,
                s as i64,
                hq as i64,
                hkv as i64,
                hd as i64
            )?;
        }
        Ok((o, lse))
    }

    fn attention_backward(
        &self,
        d_o: &Tensor<Self>,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        o: &Tensor<Self>,
        lse: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "attention_backward";
        let sfx = float_sfx(OP, q.dtype())?;
        let (b, s, hq, hkv, hd) = check_qkv(OP, q, k, v)?;
        d_o.expect_shape(OP, "d_o", q.shape())?;
        o.expect_shape(OP, "o", q.shape())?;
        lse.expect_shape(OP, "lse", &[b, hq, s])?;
        for t in [d_o, o, lse] {
            t.expect_dtype(OP, q.dtype())?;
        }
        let dq = self.alloc(OP, q.shape(), q.dtype())?;
        let dk = self.alloc(OP, k.shape(), q.dtype())?;
        let dv = self.alloc(OP, v.shape(), q.dtype())?;
        let rows = b * hq * s;
        if rows == 0 {
            return Ok((dq, dk, dv));
        }
        let delta = self.alloc(OP, &[b, hq, s], q.dtype())?;
        let f = self.func(ATTENTION, &format!("attn_delta_{sfx}"))?;
        launch!(
            self,
            f,
            grid_for(rows),
            d_o.storage().ptr(),
            o.storage().ptr(),
            delta.storage().ptr(),
            b as i64,
            s as i64,
            hq as i64,
            hd as i64
        )?;
        let f = self.func(ATTENTION, &format!("attn_dq_{sfx}"))?;
        launch!(
            self,
            f,
            grid_for(rows),
            q.storage().ptr(),
            k.storage().ptr(),
            v.storage().ptr(),
            d_o.storage().ptr(),
            lse.storage().ptr(),
            delta.storage().ptr(),
            dq.storage().ptr(),
            b as i64,
            s as i64,
            hq as i64,
            hkv as i64,
            hd as i64
        )?;
        let f = self.func(ATTENTION, &format!("attn_dkv_{sfx}"))?;
        launch!(
            self,
            f,
            grid_for(b * hkv * s),
            q.storage().ptr(),
            k.storage().ptr(),
            v.storage().ptr(),
            d_o.storage().ptr(),
            lse.storage().ptr(),
            delta.storage().ptr(),
            dk.storage().ptr(),
            dv.storage().ptr(),
            b as i64,
            s as i64,
            hq as i64,
            hkv as i64,
            hd as i64
        )?;
        Ok((dq, dk, dv))
    }
}
