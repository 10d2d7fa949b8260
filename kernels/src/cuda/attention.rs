//! CUDA causal grouped-query attention (kernels in `attention.cu`), with the
//! checks of `cpu/attention.rs`.
//!
//! Shape letters: B batch, S sequence, Hq query heads, Hkv kv heads, Hd head
//! dim.

use super::compile::ATTENTION;
use super::{float_sfx, grid_for, launch, Cuda};
use crate::backend::AttentionOps;
use crate::error::{arg_err, Result};
use crate::tensor::Tensor;

/// The largest head dim the per-row kernels hold in registers.
const MAX_HD: usize = 256;

/// `(B, S, Hq, Hkv, Hd)` after every backend's checks, plus the kernels'
/// head-dim limit.
fn check_qkv(
    op: &'static str,
    q: &Tensor<Cuda>,
    k: &Tensor<Cuda>,
    v: &Tensor<Cuda>,
) -> Result<(usize, usize, usize, usize, usize)> {
    let dims = crate::backend::check_qkv(op, q, k, v)?;
    let hd = dims.4;
    if hd > MAX_HD {
        return Err(arg_err(
            op,
            format!("head dim Hd = {hd} exceeds the {MAX_HD} the CUDA attention kernels support"),
        ));
    }
    Ok(dims)
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
