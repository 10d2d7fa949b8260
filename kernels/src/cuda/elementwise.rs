//! CUDA elementwise maps, activations, row/column broadcasts and reductions
//! (kernels in `elementwise.cu`). Mirrors `cpu/elementwise.rs`: the same
//! checks in the same order, so both backends return the same errors.
//!
//! Shape letters: R rows (all leading dims flattened), C columns (last dim).

use super::compile::ELEMENTWISE;
use super::{float_sfx, grid_for, launch, rows_cfg, warp_rows_cfg, Cuda};

use crate::backend::{swiglu_weighted_args, Device, ElementwiseOps};
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::{DType, Tensor};

/// The weighted SwiGLU kernels' launch: blocks of 8 warps (a warp, or in
/// the backward a block, per row group), at most 2048 of them striding over
/// the rest (elementwise.cu, "weighted SwiGLU").
fn swiglu_weighted_cfg(rows: usize) -> cudarc::driver::LaunchConfig {
    warp_rows_cfg(rows.min(8 * 2048))
}

/// Unary op codes of `unary_*` (the `UnaryOp` enum of elementwise.cu).
#[derive(Clone, Copy)]
enum Unary {
    Scale = 0,
    Silu,
    Sigmoid,
    LogSigmoid,
    RoundBf16,
    Sign,
    Ln,
    Recip,
}

/// Binary op codes of `binary_*` (the `BinaryOp` enum of elementwise.cu).
#[derive(Clone, Copy)]
enum Binary {
    Add = 0,
    Sub,
    Mul,
    SiluBackward,
    SigmoidBackward,
    Swiglu,
}

pub(crate) use crate::backend::rows_cols;

/// Errors unless `b` has `a`'s shape, then unless it has `a`'s dtype (the
/// CPU's order: shapes, then the typed views).
pub(crate) fn same_shape(op: &'static str, a: &Tensor<Cuda>, b: &Tensor<Cuda>) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(shape_err(
            op,
            format!(
                "operands have shapes {:?} and {:?}; they must be equal",
                a.shape(),
                b.shape()
            ),
        ));
    }
    b.expect_dtype(op, a.dtype())
}

impl Cuda {
    fn unary(
        &self,
        op: &'static str,
        x: &Tensor<Self>,
        u: Unary,
        s: f64,
        code: u32,
    ) -> Result<Tensor<Self>> {
        let sfx = float_sfx(op, x.dtype())?;
        let out = self.alloc(op, x.shape(), x.dtype())?;
        let n = x.numel();
        if n > 0 {
            let f = self.func(ELEMENTWISE, &format!("unary_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(n),
                x.storage().ptr(),
                out.storage().ptr(),
                n as i64,
                u as i32,
                s,
                self.err_ptr(),
                code
            )?;
        }
        Ok(out)
    }

    /// [`Cuda::unary`] with a domain check: a NaN is reported as
    /// [`KernelError::NonFinite`], a value outside the domain as an invalid
    /// argument explained by `rule` (the CPU's messages).
    fn checked_unary(
        &self,
        op: &'static str,
        x: &Tensor<Self>,
        u: Unary,
        rule: &'static str,
    ) -> Result<Tensor<Self>> {
        float_sfx(op, x.dtype())?;
        let shape = x.shape().to_vec();
        let code = self.check(move |i, value| {
            if value.is_nan() {
                KernelError::NonFinite {
                    op,
                    what: "x",
                    value,
                }
            } else {
                arg_err(
                    op,
                    format!("element {i} of x (shape {shape:?}) is {value}; {rule}"),
                )
            }
        })?;
        self.unary(op, x, u, 0.0, code)
    }

    fn binary(
        &self,
        op: &'static str,
        a: &Tensor<Self>,
        b: &Tensor<Self>,
        k: Binary,
    ) -> Result<Tensor<Self>> {
        let sfx = float_sfx(op, a.dtype())?;
        same_shape(op, a, b)?;
        let out = self.alloc(op, a.shape(), a.dtype())?;
        let n = a.numel();
        if n > 0 {
            let f = self.func(ELEMENTWISE, &format!("binary_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(n),
                a.storage().ptr(),
                b.storage().ptr(),
                out.storage().ptr(),
                n as i64,
                k as i32
            )?;
        }
        Ok(out)
    }

    /// `x` broadcast against a row (`op` 0) or column vector (1: multiply,
    /// 2: add).
    fn bcast(
        &self,
        name: &'static str,
        x: &Tensor<Self>,
        s: &Tensor<Self>,
        op: i32,
    ) -> Result<Tensor<Self>> {
        let sfx = float_sfx(name, x.dtype())?;
        let (r, c, lead) = rows_cols(name, x)?;
        let ok = if op == 0 {
            s.shape() == lead || s.shape() == [r]
        } else {
            s.shape() == [c]
        };
        if !ok {
            let detail = if op == 0 {
                format!(
                    "x has shape {:?} ({r} rows), so the row vector must have shape [{r}] or {lead:?}, got {:?}",
                    x.shape(),
                    s.shape()
                )
            } else {
                format!(
                    "x has shape {:?} ({c} columns), so the column vector must have shape [{c}], got {:?}",
                    x.shape(),
                    s.shape()
                )
            };
            return Err(shape_err(name, detail));
        }
        s.expect_dtype(name, x.dtype())?;
        let out = self.alloc(name, x.shape(), x.dtype())?;
        let n = x.numel();
        if n > 0 {
            let f = self.func(ELEMENTWISE, &format!("bcast_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(n),
                x.storage().ptr(),
                s.storage().ptr(),
                out.storage().ptr(),
                n as i64,
                c as i64,
                op
            )?;
        }
        Ok(out)
    }

    /// Row reductions of `reduce_rows_*`: 0 logsumexp, 1 sum, 2 dot with `b`.
    fn reduce_rows(
        &self,
        name: &'static str,
        a: &Tensor<Self>,
        b: &Tensor<Self>,
        op: i32,
    ) -> Result<Tensor<Self>> {
        let sfx = float_sfx(name, a.dtype())?;
        if op == 2 {
            same_shape(name, a, b)?;
        }
        let (r, c, lead) = rows_cols(name, a)?;
        if op == 0 && c == 0 && r > 0 {
            return Err(KernelError::Empty {
                op: name,
                what: "last dimension",
            });
        }
        let out = self.alloc(name, lead, a.dtype())?;
        if r > 0 {
            let f = self.func(ELEMENTWISE, &format!("reduce_rows_{sfx}"))?;
            launch!(
                self,
                f,
                rows_cfg(r, 256),
                a.storage().ptr(),
                b.storage().ptr(),
                out.storage().ptr(),
                r as i64,
                c as i64,
                op
            )?;
        }
        Ok(out)
    }

    /// Softmax-like row maps: `softmax_*` (`dy` unused) or `softmax_bwd_*`.
    fn row_map(
        &self,
        name: &'static str,
        kernel: &str,
        y: &Tensor<Self>,
        dy: Option<&Tensor<Self>>,
    ) -> Result<Tensor<Self>> {
        let sfx = float_sfx(name, y.dtype())?;
        if let Some(dy) = dy {
            same_shape(name, y, dy)?;
        }
        let (r, c, _) = rows_cols(name, y)?;
        let out = self.alloc(name, y.shape(), y.dtype())?;
        if r * c > 0 {
            let f = self.func(ELEMENTWISE, &format!("{kernel}_{sfx}"))?;
            match dy {
                None => launch!(
                    self,
                    f,
                    rows_cfg(r, 256),
                    y.storage().ptr(),
                    out.storage().ptr(),
                    r as i64,
                    c as i64
                )?,
                Some(dy) => launch!(
                    self,
                    f,
                    rows_cfg(r, 256),
                    y.storage().ptr(),
                    dy.storage().ptr(),
                    out.storage().ptr(),
                    r as i64,
                    c as i64
                )?,
            }
        }
        Ok(out)
    }

    /// Sum of all elements (or of their squares) in f64, as a `[1]` tensor.
    fn total(&self, name: &'static str, x: &Tensor<Self>, squares: bool) -> Result<Tensor<Self>> {
        // Enough blocks to keep every SM streaming (the finish adds the
        // partials serially, which is cheap at this count).
        const BLOCKS: usize = 2048;
        let sfx = float_sfx(name, x.dtype())?;
        let n = x.numel();
        let blocks = n.div_ceil(256).clamp(1, BLOCKS);
        let partials = self.scratch(name, blocks * 8)?;
        let out = self.alloc(name, &[1], x.dtype())?;
        let f = self.func(ELEMENTWISE, &format!("total_{sfx}"))?;
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            f,
            cfg,
            x.storage().ptr(),
            partials.ptr(),
            n as i64,
            squares as i32
        )?;
        let f = self.func(ELEMENTWISE, &format!("total_finish_{sfx}"))?;
        launch!(
            self,
            f,
            rows_cfg(1, 256),
            partials.ptr(),
            out.storage().ptr(),
            blocks as i32
        )?;
        Ok(out)
    }
}

impl ElementwiseOps for Cuda {
    fn add(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.binary("add", a, b, Binary::Add)
    }

    fn sub(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.binary("sub", a, b, Binary::Sub)
    }

    fn mul(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.binary("mul", a, b, Binary::Mul)
    }

    fn scale(&self, a: &Tensor<Self>, s: f64) -> Result<Tensor<Self>> {
        self.unary("scale", a, Unary::Scale, s, 0)
    }

    fn axpy(&self, y: &mut Tensor<Self>, alpha: f64, x: &Tensor<Self>) -> Result<()> {
        const OP: &str = "axpy";
        let sfx = float_sfx(OP, y.dtype())?;
        if y.shape() != x.shape() {
            return Err(shape_err(
                OP,
                format!(
                    "y has shape {:?}, x has shape {:?}; they must be equal",
                    y.shape(),
                    x.shape()
                ),
            ));
        }
        x.expect_dtype(OP, y.dtype())?;
        self.make_unique(OP, y)?;
        let n = y.numel();
        if n > 0 {
            let f = self.func(ELEMENTWISE, &format!("axpy_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(n),
                y.storage().ptr(),
                x.storage().ptr(),
                n as i64,
                alpha
            )?;
        }
        Ok(())
    }

    fn fill(&self, shape: &[usize], value: f64, dtype: DType) -> Result<Tensor<Self>> {
        const OP: &str = "fill";
        if value.is_nan() {
            return Err(KernelError::NonFinite {
                op: OP,
                what: "value",
                value,
            });
        }
        let sfx = match dtype {
            DType::F64 => "f64",
            DType::F32 | DType::BF16 => {
                let (overflows, max) = if dtype == DType::F32 {
                    (!(value as f32).is_finite(), f32::MAX as f64)
                } else {
                    (
                        !half::bf16::from_f64(value).is_finite(),
                        half::bf16::MAX.to_f64(),
                    )
                };
                if value.is_finite() && overflows {
                    return Err(arg_err(
                        OP,
                        format!(
                            "value {value:e} is beyond {dtype:?}'s range (±{max:e}); use F64 or pass ±inf explicitly"
                        ),
                    ));
                }
                if dtype == DType::F32 {
                    "f32"
                } else {
                    "bf16"
                }
            }
            DType::I32 => {
                let (lo, hi) = (i32::MIN as f64, i32::MAX as f64);
                if value.fract() != 0.0 || value < lo || value > hi {
                    return Err(arg_err(
                        OP,
                        format!("value {value} is not an integer in [{lo}, {hi}], so it cannot fill an I32 tensor"),
                    ));
                }
                "i32"
            }
        };
        let out = self.alloc(OP, shape, dtype)?;
        let n = out.numel();
        if n > 0 {
            let f = self.func(ELEMENTWISE, &format!("fill_{sfx}"))?;
            launch!(self, f, grid_for(n), out.storage().ptr(), n as i64, value)?;
        }
        Ok(out)
    }

    fn sign(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.checked_unary("sign", x, Unary::Sign, "")
    }

    fn ln(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.checked_unary(
            "ln",
            x,
            Unary::Ln,
            "the natural log is defined for x ≥ 0 only",
        )
    }

    fn recip(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.checked_unary(
            "recip",
            x,
            Unary::Recip,
            "zero has no reciprocal; add an epsilon (or clamp) before recip",
        )
    }

    fn silu(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.unary("silu", x, Unary::Silu, 0.0, 0)
    }

    fn silu_backward(&self, x: &Tensor<Self>, dy: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.binary("silu_backward", x, dy, Binary::SiluBackward)
    }

    fn swiglu(&self, gate: &Tensor<Self>, up: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.binary("swiglu", gate, up, Binary::Swiglu)
    }

    fn swiglu_weighted(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        probs: &Tensor<Self>,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "swiglu_weighted";
        let sfx = float_sfx(OP, gate.dtype())?;
        let (n, f) = swiglu_weighted_args(OP, gate, up, probs, None)?;
        let out = self.alloc(OP, gate.shape(), gate.dtype())?;
        if n * f > 0 {
            let func = self.func(ELEMENTWISE, &format!("swiglu_w_{sfx}"))?;
            launch!(
                self,
                func,
                swiglu_weighted_cfg(n),
                gate.storage().ptr(),
                up.storage().ptr(),
                probs.storage().ptr(),
                out.storage().ptr(),
                n as i64,
                f as i64
            )?;
        }
        Ok(out)
    }

    fn swiglu_weighted_backward(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        probs: &Tensor<Self>,
        dy: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "swiglu_weighted_backward";
        let sfx = float_sfx(OP, gate.dtype())?;
        let (n, f) = swiglu_weighted_args(OP, gate, up, probs, Some(dy))?;
        let dg = self.alloc(OP, gate.shape(), gate.dtype())?;
        let du = self.alloc(OP, gate.shape(), gate.dtype())?;
        // Rows without columns have d probs 0 (the kernel's empty sums).
        let dp = self.zeros(&[n], gate.dtype())?;
        if n * f > 0 {
            let func = self.func(ELEMENTWISE, &format!("swiglu_w_bwd_{sfx}"))?;
            launch!(
                self,
                func,
                swiglu_weighted_cfg(n),
                gate.storage().ptr(),
                up.storage().ptr(),
                probs.storage().ptr(),
                dy.storage().ptr(),
                dg.storage().ptr(),
                du.storage().ptr(),
                dp.storage().ptr(),
                n as i64,
                f as i64
            )?;
        }
        Ok((dg, du, dp))
    }

    fn swiglu_backward(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        dy: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "swiglu_backward";
        let sfx = float_sfx(OP, gate.dtype())?;
        same_shape(OP, gate, up)?;
        same_shape(OP, gate, dy)?;
        let dg = self.alloc(OP, gate.shape(), gate.dtype())?;
        let du = self.alloc(OP, gate.shape(), gate.dtype())?;
        let n = gate.numel();
        if n > 0 {
            let f = self.func(ELEMENTWISE, &format!("swiglu_bwd_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(n),
                gate.storage().ptr(),
                up.storage().ptr(),
                dy.storage().ptr(),
                dg.storage().ptr(),
                du.storage().ptr(),
                n as i64
            )?;
        }
        Ok((dg, du))
    }

    fn sigmoid(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.unary("sigmoid", x, Unary::Sigmoid, 0.0, 0)
    }

    fn sigmoid_backward(&self, y: &Tensor<Self>, dy: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.binary("sigmoid_backward", y, dy, Binary::SigmoidBackward)
    }

    fn log_sigmoid(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.unary("log_sigmoid", x, Unary::LogSigmoid, 0.0, 0)
    }

    fn softmax(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.row_map("softmax", "softmax", x, None)
    }

    fn softmax_backward(&self, y: &Tensor<Self>, dy: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.row_map("softmax_backward", "softmax_bwd", y, Some(dy))
    }

    fn logsumexp(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.reduce_rows("logsumexp", x, x, 0)
    }

    fn round_bf16(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.unary("round_bf16", x, Unary::RoundBf16, 0.0, 0)
    }

    fn mul_rows(&self, x: &Tensor<Self>, s: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.bcast("mul_rows", x, s, 0)
    }

    fn mul_cols(&self, x: &Tensor<Self>, s: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.bcast("mul_cols", x, s, 1)
    }

    fn add_cols(&self, x: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.bcast("add_cols", x, b, 2)
    }

    fn sum_rows(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.reduce_rows("sum_rows", x, x, 1)
    }

    fn sum_cols(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        const OP: &str = "sum_cols";
        let sfx = float_sfx(OP, x.dtype())?;
        let (r, c, _) = rows_cols(OP, x)?;
        let out = self.alloc(OP, &[c], x.dtype())?;
        if c > 0 {
            // Runs of rows so that about 2 blocks per multiprocessor of an
            // H200 work (at least 64 rows a run).
            let col_blocks = c.div_ceil(32);
            let runs = 264usize
                .div_ceil(col_blocks)
                .clamp(1, r.div_ceil(64).max(1));
            let per = r.div_ceil(runs).max(1);
            let runs = r.div_ceil(per).max(1);
            let part = self.scratch(OP, runs * c * 8)?;
            let f = self.func(ELEMENTWISE, &format!("sum_cols_part_{sfx}"))?;
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: (col_blocks as u32, runs as u32, 1),
                block_dim: (32, 8, 1),
                shared_mem_bytes: 0,
            };
            launch!(
                self,
                f,
                cfg,
                x.storage().ptr(),
                part.ptr(),
                r as i64,
                c as i64,
                per as i64
            )?;
            let f = self.func(ELEMENTWISE, &format!("sum_cols_fin_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(c),
                part.ptr(),
                out.storage().ptr(),
                runs as i64,
                c as i64
            )?;
        }
        Ok(out)
    }

    fn dot_rows(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.reduce_rows("dot_rows", a, b, 2)
    }

    fn sum(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.total("sum", x, false)
    }

    fn sum_squares(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.total("sum_squares", x, true)
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::{Device, ElementwiseOps};
    use crate::cpu::test_util::Compare;
    use crate::cpu::Cpu;
    use crate::tensor::{DType, HostData};

    /// The bf16 maps with a 16-byte loop (binary ops such as swiglu,
    /// swiglu_backward, axpy) against the CPU at lengths around multiples
    /// of 8 (the scalar tail alone, the vector loop alone, both), each output
    /// allocated from a pool left full of NaN blocks of its size, so an
    /// element either loop fails to write shows up.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn bf16_vector_maps_match_cpu_at_odd_lengths() {
        let d = crate::cuda::require_test_device();
        for n in [1usize, 7, 8, 9, 63, 64, 1021, 4096 + 5] {
            let poison = || {
                let nan = d.upload(HostData::F32(vec![f32::NAN; n]), &[n]).unwrap();
                let held: Vec<_> = (0..4).map(|_| d.cast(&nan, DType::BF16).unwrap()).collect();
                drop(held);
            };
            let mut k = Compare::new(&d, DType::BF16, 90 + n as u64);
            let (x, xc) = k.rand(&[n], 4.0);
            let (y, yc) = k.rand(&[n], 1.0);
            let (p, pc) = k.rand(&[n], 1.0);
            poison();
            k.check("mul", &d.mul(&x, &y).unwrap(), &Cpu.mul(&xc, &yc).unwrap());
            poison();
            k.check(
                "swiglu",
                &d.swiglu(&x, &y).unwrap(),
                &Cpu.swiglu(&xc, &yc).unwrap(),
            );
            poison();
            let (dg, du) = d.swiglu_backward(&x, &y, &p).unwrap();
            let (dgc, duc) = Cpu.swiglu_backward(&xc, &yc, &pc).unwrap();
            k.check("swiglu_backward d gate", &dg, &dgc);
            k.check("swiglu_backward d up", &du, &duc);
            let (mut a, mut ac) = k.rand(&[n], 2.0);
            d.axpy(&mut a, -0.75, &y).unwrap();
            Cpu.axpy(&mut ac, -0.75, &yc).unwrap();
            k.check("axpy", &a, &ac);
        }
    }
}
