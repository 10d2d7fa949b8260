use super::Device;
use crate::error::Result;
use crate::tensor::Tensor;

/// Normalisation and positional encoding.
pub trait NormOps: Device {
    /// RMSNorm over the last dim: `y = x / rms(x) * w`, `x: [R, D]`, `w: [D]`.
    /// Returns `(y, rstd: [R])`, `rstd = 1 / sqrt(mean(x²) + eps)`.
    fn rms_norm(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        eps: f64,
    ) -> Result<(Tensor<Self>, Tensor<Self>)>;
    /// Gradients `(dx, dw)` of RMSNorm.
    fn rms_norm_backward(
        &self,
        dy: &Tensor<Self>,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        rstd: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)>;
    /// Rotary embedding (rotate-half form) of `x: [B, S, H, Hd]` with the
    /// frequencies of `rope`, at positions `0..S` of every sequence or, given
    /// `positions: [B, S]` (i32, each ≥ 0), at those (Megatron's
    /// `--reset-position-ids`: positions restart after each end-of-document).
    /// `inverse` applies the transpose, which is the backward: the rotation
    /// by the negative angle, times the same YaRN attention factor.
    fn rope(
        &self,
        x: &Tensor<Self>,
        rope: Rope,
        inverse: bool,
        positions: Option<&Tensor<Self>>,
    ) -> Result<Tensor<Self>>;
}

/// The rotary frequencies of a head dim `Hd`: pair `i < Hd/2` turns by
/// `pos · f_i`, `f_i = θ^(−2i/Hd)`, optionally rescaled by YaRN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// Base θ.
    pub theta: f64,
    /// YaRN's frequency ramp and attention factor, if scaled.
    pub yarn: Option<Yarn>,
}

impl Rope {
    /// Plain RoPE of base `theta`.
    pub fn plain(theta: f64) -> Self {
        Rope { theta, yarn: None }
    }

    /// The frequency of pair `i` of a head dim `hd` (f64).
    pub fn frequency(&self, i: usize, hd: usize) -> f64 {
        let f = self.theta.powf(-2.0 * i as f64 / hd as f64);
        match self.yarn {
            None => f,
            Some(y) => y.blend(i, f),
        }
    }

    /// The factor on cos and sin (YaRN's attention factor; 1 unscaled).
    pub fn amplitude(&self) -> f64 {
        self.yarn.map_or(1.0, |y| y.attention_factor)
    }

    /// Errors unless θ is finite and > 0, `hd` even and the YaRN
    /// parameters finite with `factor ≥ 1`.
    pub(crate) fn check(&self, op: &'static str, hd: usize) -> Result<()> {
        use crate::error::arg_err;
        if !hd.is_multiple_of(2) {
            return Err(arg_err(
                op,
                format!("head dim Hd = {hd} must be even to pair its halves"),
            ));
        }
        if !(self.theta.is_finite() && self.theta > 0.0) {
            return Err(arg_err(
                op,
                format!("theta = {} must be finite and > 0", self.theta),
            ));
        }
        if let Some(y) = self.yarn {
            let finite = [y.factor, y.low, y.high, y.attention_factor]
                .iter()
                .all(|v| v.is_finite());
            if !finite || y.factor < 1.0 || y.high <= y.low {
                return Err(arg_err(
                    op,
                    format!(
                        "YaRN factor = {}, ramp {}..{}, attention factor {}: the factor must be \
                         ≥ 1 and the ramp a finite increasing range",
                        y.factor, y.low, y.high, y.attention_factor
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// YaRN scaling of RoPE (Peng et al. 2023, as transformers' DeepSeek-V3
/// computes it): pair `i`'s frequency blends the interpolated `f_i / factor`
/// (weight `r_i`) with the original `f_i` (weight `1 − r_i`), the ramp
/// `r_i = clamp((i − low) / (high − low), 0, 1)`: high-frequency pairs keep
/// their rotation, low-frequency ones are stretched by the factor. cos and
/// sin are multiplied by `attention_factor`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// The context stretch.
    pub factor: f64,
    /// Start of the ramp (pair index).
    pub low: f64,
    /// End of the ramp (pair index, > `low`).
    pub high: f64,
    /// Factor on cos and sin.
    pub attention_factor: f64,
}

impl Yarn {
    /// YaRN of a rotary dim `dim` and base `theta` from the published
    /// `rope_scaling` fields: the ramp from the dims whose wavelengths turn
    /// `beta_fast` and `beta_slow` times over `original_max_position`
    /// (floored and ceiled, clipped to `0..dim−1`, widened by 0.001 when
    /// empty), and the attention factor `m(factor, mscale) /
    /// m(factor, mscale_all_dim)` where both are given (else `m(factor, 1)`),
    /// `m(s, k) = 0.1·k·ln s + 1` for `s > 1` (1 otherwise).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        theta: f64,
        dim: usize,
        factor: f64,
        original_max_position: f64,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
    ) -> Self {
        let correction = |rotations: f64| {
            dim as f64 * (original_max_position / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let low = correction(beta_fast).floor().max(0.0);
        let mut high = correction(beta_slow).ceil().min(dim as f64 - 1.0);
        if high == low {
            high += 0.001;
        }
        let attention_factor = match (mscale, mscale_all_dim) {
            (Some(a), Some(b)) if a != 0.0 && b != 0.0 => {
                yarn_mscale(factor, a) / yarn_mscale(factor, b)
            }
            _ => yarn_mscale(factor, 1.0),
        };
        Yarn {
            factor,
            low,
            high,
            attention_factor,
        }
    }

    /// Pair `i`'s frequency given its unscaled `f`.
    pub fn blend(&self, i: usize, f: f64) -> f64 {
        let ramp = ((i as f64 - self.low) / (self.high - self.low)).clamp(0.0, 1.0);
        f / self.factor * ramp + f * (1.0 - ramp)
    }
}

/// YaRN's magnitude correction `0.1·k·ln s + 1` of a stretch `s > 1` (1 for
/// `s ≤ 1`); DeepSeek-V3 also multiplies the softmax scale by
/// `yarn_mscale(factor, mscale_all_dim)²`.
pub fn yarn_mscale(s: f64, k: f64) -> f64 {
    if s <= 1.0 {
        1.0
    } else {
        0.1 * k * s.ln() + 1.0
    }
}

/// Checks `positions` against `x: [B, S, ..]`: `[B, S]` i32. The values
/// are read by the kernel (a negative one is the caller's bug, the engine
/// builds them).
pub(crate) fn check_positions<B: Device>(
    op: &'static str,
    x: &Tensor<B>,
    positions: Option<&Tensor<B>>,
) -> Result<()> {
    if let Some(p) = positions {
        p.expect_shape(op, "positions", &x.shape()[..2])?;
        p.expect_dtype(op, crate::tensor::DType::I32)?;
    }
    Ok(())
}

/// `(R, D)` of `x` after checking `w: [D]` and `D > 0`: the checks every
/// backend's RMSNorm makes before touching data.
pub(crate) fn check_norm_args<B: Device>(
    op: &'static str,
    x: &Tensor<B>,
    w: &Tensor<B>,
) -> Result<(usize, usize)> {
    let (r, d, _) = super::rows_cols(op, x)?;
    if w.shape() != [d] {
        return Err(crate::error::shape_err(
            op,
            format!(
                "x has shape {:?}, so the weight must have shape [{d}], got {:?}",
                x.shape(),
                w.shape()
            ),
        ));
    }
    if d == 0 {
        return Err(crate::error::KernelError::Empty {
            op,
            what: "normalised (last) dimension",
        });
    }
    Ok((r, d))
}
