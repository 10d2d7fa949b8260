//! CUDA AdamW: one fused kernel (`optim.cu`) over parameter, gradient and
//! moments, in the parameter's dtype or on an f32 master copy, with the
//! argument checks of `backend/optim.rs`.

use super::compile::OPTIM;
use super::{float_sfx, grid_for, launch, Cuda};
use crate::backend::{check_adamw_args, check_adamw_master_args, AdamWConfig, OptimOps};
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels' trailing argument (`AdamwScalars` in `optim.cu`, same
/// layout): the step's scalars formed in f64, rounded once in the kernel.
#[repr(C)]
#[derive(Clone, Copy)]
struct Scalars {
    b1: f64,
    b2: f64,
    /// 1 − β1.
    c1: f64,
    /// 1 − β2.
    c2: f64,
    /// 1 − lr·wd.
    decay: f64,
    /// lr / bc1.
    step: f64,
    /// 1 / bc2.
    inv_bc2: f64,
    eps: f64,
    grad_scale: f64,
}

// SAFETY: a plain `repr(C)` struct of f64, passed by value as the kernel's
// `AdamwScalars`, whose fields are the same nine doubles in the same order.
unsafe impl cudarc::driver::DeviceRepr for Scalars {}

fn scalars(cfg: &AdamWConfig) -> Scalars {
    let bc1 = 1.0 - cfg.beta1.powf(cfg.step as f64);
    let bc2 = 1.0 - cfg.beta2.powf(cfg.step as f64);
    Scalars {
        b1: cfg.beta1,
        b2: cfg.beta2,
        c1: 1.0 - cfg.beta1,
        c2: 1.0 - cfg.beta2,
        decay: 1.0 - cfg.lr * cfg.weight_decay,
        step: cfg.lr / bc1,
        inv_bc2: 1.0 / bc2,
        eps: cfg.eps,
        grad_scale: cfg.grad_scale,
    }
}

impl OptimOps for Cuda {
    fn adamw_step(
        &self,
        param: &mut Tensor<Self>,
        grad: &Tensor<Self>,
        m: &mut Tensor<Self>,
        v: &mut Tensor<Self>,
        cfg: &AdamWConfig,
    ) -> Result<()> {
        const OP: &str = "adamw_step";
        check_adamw_args(OP, param, grad, m, v, cfg)?;
        let sfx = float_sfx(OP, param.dtype())?;
        self.make_unique(OP, param)?;
        self.make_unique(OP, m)?;
        self.make_unique(OP, v)?;
        let n = param.numel();
        if n == 0 {
            return Ok(());
        }
        let f = self.func(OPTIM, &format!("adamw_{sfx}"))?;
        launch!(
            self,
            f,
            grid_for(n),
            param.storage().ptr(),
            grad.storage().ptr(),
            m.storage().ptr(),
            v.storage().ptr(),
            n as i64,
            scalars(cfg)
        )
    }

    fn adamw_step_master(
        &self,
        param: &mut Tensor<Self>,
        grad: &Tensor<Self>,
        master: &mut Tensor<Self>,
        m: &mut Tensor<Self>,
        v: &mut Tensor<Self>,
        cfg: &AdamWConfig,
    ) -> Result<()> {
        const OP: &str = "adamw_step_master";
        check_adamw_master_args(OP, param, grad, master, m, v, cfg)?;
        let sfx = float_sfx(OP, param.dtype())?;
        self.make_unique(OP, param)?;
        self.make_unique(OP, master)?;
        self.make_unique(OP, m)?;
        self.make_unique(OP, v)?;
        let n = param.numel();
        if n == 0 {
            return Ok(());
        }
        let f = self.func(OPTIM, &format!("adamw_master_{sfx}"))?;
        launch!(
            self,
            f,
            grid_for(n),
            param.storage().ptr(),
            grad.storage().ptr(),
            master.storage().ptr(),
            m.storage().ptr(),
            v.storage().ptr(),
            n as i64,
            scalars(cfg)
        )
    }
}
