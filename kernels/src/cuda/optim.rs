//! CUDA AdamW: one fused kernel (`optim.cu`) over parameter, gradient and
//! moments, with the hyper-parameter checks of `cpu/optim.rs`.

use super::compile::OPTIM;
use super::{float_sfx, grid_for, launch, Cuda};
use crate::backend::{AdamWConfig, OptimOps};
use crate::cpu::check_adamw_cfg;
use crate::error::{shape_err, KernelError, Result};
use crate::tensor::Tensor;

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
        let sfx = float_sfx(OP, param.dtype())?;
        check_adamw_cfg(OP, cfg)?;
        for (name, t) in [("grad", grad.shape()), ("m", m.shape()), ("v", v.shape())] {
            if t != param.shape() {
                return Err(shape_err(
                    OP,
                    format!(
                        "param has shape {:?} but {name} has shape {t:?}; they must be equal",
                        param.shape()
                    ),
                ));
            }
        }
        for t in [grad, &*m, &*v] {
            if t.dtype() != param.dtype() {
                return Err(KernelError::DTypeMismatch {
                    op: OP,
                    expected: param.dtype(),
                    got: t.dtype(),
                });
            }
        }
        self.make_unique(OP, param)?;
        self.make_unique(OP, m)?;
        self.make_unique(OP, v)?;
        let n = param.numel();
        if n == 0 {
            return Ok(());
        }
        // Bias corrections and step sizes in f64, rounded once in the kernel.
        let bc1 = 1.0 - cfg.beta1.powf(cfg.step as f64);
        let bc2 = 1.0 - cfg.beta2.powf(cfg.step as f64);
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
            cfg.beta1,
            cfg.beta2,
            1.0 - cfg.beta1,
            1.0 - cfg.beta2,
            1.0 - cfg.lr * cfg.weight_decay,
            cfg.lr / bc1,
            1.0 / bc2,
            cfg.eps
        )
    }
}
