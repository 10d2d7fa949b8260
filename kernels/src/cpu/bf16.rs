//! bf16 emulation on the CPU (docs/ARCHITECTURE.md §2): a bf16 tensor holds f32 values that
//! are exactly representable in bf16. Kernels read them as [`Bf16`], whose
//! arithmetic is plain f32 (a GPU kernel also accumulates bf16 inputs in f32),
//! and every bf16 output is rounded once, to nearest even, where the kernel
//! hands it to storage ([`super::FloatStorage::tensor`] and
//! [`super::FloatStorage::stored`]), so no kernel needs a bf16 code path of
//! its own.

use super::Float;

/// The kernel scalar of bf16 tensors: an f32. In storage it is always
/// bf16-representable; inside a kernel it is the unrounded f32 intermediate.
#[derive(Clone, Copy, Debug, Default, PartialEq, PartialOrd)]
#[repr(transparent)]
pub struct Bf16(f32);

impl Bf16 {
    /// Not a number (a poison value for buffers whose values are unspecified).
    pub(crate) const NAN: Bf16 = Bf16(f32::NAN);

    /// The bf16 value nearest to `x` (ties to even).
    pub fn round(x: f32) -> Self {
        Bf16(round_f32(x))
    }

    /// `x` unrounded: an f32 intermediate of a kernel.
    pub(crate) fn raw(x: f32) -> Self {
        Bf16(x)
    }

    /// The value as f32 (exact).
    pub fn to_f32(self) -> f32 {
        self.0
    }
}

/// Round-to-nearest-even of an f32 to bf16 (8 significant bits), as f32.
pub(crate) fn round_f32(x: f32) -> f32 {
    f32::from_bits(super::elementwise::f32_to_bf16_bits(x))
}

/// Round-to-nearest-even of an f64 to bf16, rounding once (through f32 by
/// rounding to odd, which keeps the second rounding correct).
pub(crate) fn round_f64(x: f64) -> f32 {
    round_f32(super::elementwise::f64_to_f32_odd(x))
}

macro_rules! bin_op {
    ($tr:ident, $f:ident, $atr:ident, $af:ident, $op:tt) => {
        impl std::ops::$tr for Bf16 {
            type Output = Bf16;
            #[inline]
            fn $f(self, o: Bf16) -> Bf16 {
                Bf16(self.0 $op o.0)
            }
        }
        impl std::ops::$atr for Bf16 {
            #[inline]
            fn $af(&mut self, o: Bf16) {
                self.0 = self.0 $op o.0;
            }
        }
    };
}
bin_op!(Add, add, AddAssign, add_assign, +);
bin_op!(Sub, sub, SubAssign, sub_assign, -);
bin_op!(Mul, mul, MulAssign, mul_assign, *);
bin_op!(Div, div, DivAssign, div_assign, /);

impl std::ops::Neg for Bf16 {
    type Output = Bf16;
    #[inline]
    fn neg(self) -> Bf16 {
        Bf16(-self.0)
    }
}

impl std::iter::Sum for Bf16 {
    fn sum<I: Iterator<Item = Bf16>>(iter: I) -> Bf16 {
        Bf16(iter.map(|x| x.0).sum())
    }
}

impl Float for Bf16 {
    const ZERO: Self = Bf16(0.0);
    const ONE: Self = Bf16(1.0);
    const NEG_INF: Self = Bf16(f32::NEG_INFINITY);
    fn from_f64(x: f64) -> Self {
        // An f32 intermediate: rounded to bf16 only when stored.
        Bf16(x as f32)
    }
    fn to_f64(self) -> f64 {
        self.0 as f64
    }
    fn exp(self) -> Self {
        Bf16(super::exp_f32(self.0))
    }
    fn ln(self) -> Self {
        Bf16(self.0.ln())
    }
    fn sqrt(self) -> Self {
        Bf16(self.0.sqrt())
    }
    fn max(self, other: Self) -> Self {
        Bf16(self.0.max(other.0))
    }
    fn is_finite(self) -> bool {
        self.0.is_finite()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{
        AttentionOps, Device, ElementwiseOps, LinalgOps, LossOps, NormOps, OptimOps,
    };
    use crate::cpu::test_util::{h64, rng, t32, ti32, uniform};
    use crate::cpu::Cpu;
    use crate::tensor::{DType, Tensor};
    use crate::AdamWConfig;

    /// Random values rounded to bf16: the same inputs as a BF16 tensor and
    /// as an F32 one.
    fn inputs(seed: u64, shape: &[usize]) -> (Tensor<Cpu>, Tensor<Cpu>) {
        let n = shape.iter().product();
        let v: Vec<f32> = uniform(&mut rng(seed), n)
            .iter()
            .map(|&x| round_f32(x as f32))
            .collect();
        let f = t32(&v, shape);
        (Cpu.cast(&f, DType::BF16).unwrap(), f)
    }

    /// `got` is a BF16 tensor holding exactly `want` (an f32 result)
    /// rounded once to nearest even.
    fn rounded_once(what: &str, got: &Tensor<Cpu>, want: &Tensor<Cpu>) {
        assert_eq!(got.dtype(), DType::BF16, "{what}");
        assert_eq!(got.shape(), want.shape(), "{what}");
        let w: Vec<f64> = h64(want)
            .iter()
            .map(|&x| round_f32(x as f32) as f64)
            .collect();
        assert_eq!(h64(got), w, "{what}");
    }

    /// The emulation's contract, bit for bit: a bf16 op computes in f32 from
    /// the bf16 values and rounds each output once (so it equals the f32 op
    /// on the same values, rounded), in-place ops included; the output
    /// dtypes are CUDA's (attention's log-sum-exp and cross-entropy's loss
    /// and log-sum-exp stay f32, unrounded).
    #[test]
    fn ops_are_f32_ops_rounded_once() {
        let (a, af) = inputs(1, &[37, 70]);
        let (b, bf) = inputs(2, &[70, 21]);
        let (c, cf) = inputs(3, &[37, 70]);
        let mm = |x: &Tensor<Cpu>, y: &Tensor<Cpu>| Cpu.matmul(x, y, false, false).unwrap();
        rounded_once("matmul", &mm(&a, &b), &mm(&af, &bf));
        rounded_once(
            "add",
            &Cpu.add(&a, &c).unwrap(),
            &Cpu.add(&af, &cf).unwrap(),
        );
        rounded_once(
            "softmax",
            &Cpu.softmax(&a).unwrap(),
            &Cpu.softmax(&af).unwrap(),
        );
        rounded_once(
            "swiglu",
            &Cpu.swiglu(&a, &c).unwrap(),
            &Cpu.swiglu(&af, &cf).unwrap(),
        );
        rounded_once("sum", &Cpu.sum(&a).unwrap(), &Cpu.sum(&af).unwrap());
        let (w, wf) = inputs(4, &[70]);
        let (y, rstd) = Cpu.rms_norm(&a, &w, 1e-6).unwrap();
        let (yf, rstdf) = Cpu.rms_norm(&af, &wf, 1e-6).unwrap();
        rounded_once("rms_norm y", &y, &yf);
        rounded_once("rms_norm rstd", &rstd, &rstdf);
        let mut acc = a.clone();
        let mut accf = af.clone();
        Cpu.axpy(&mut acc, 0.3, &c).unwrap();
        Cpu.axpy(&mut accf, 0.3, &cf).unwrap();
        rounded_once("axpy (in place)", &acc, &accf);

        let targets = ti32(&(0..37).map(|i| i % 70 - 1).collect::<Vec<_>>(), &[37]);
        // Cross-entropy: loss and lse in f32 (not rounded); the backward
        // reads them in f32 and rounds only dlogits.
        let (loss, lse) = Cpu.cross_entropy(&a, &targets).unwrap();
        let (lossf, lsef) = Cpu.cross_entropy(&af, &targets).unwrap();
        assert_eq!((loss.dtype(), h64(&loss)), (DType::F32, h64(&lossf)));
        assert_eq!((lse.dtype(), h64(&lse)), (DType::F32, h64(&lsef)));
        let dloss = t32(
            &(0..37).map(|i| 0.1 + i as f32 / 7.0).collect::<Vec<_>>(),
            &[37],
        );
        rounded_once(
            "cross_entropy_backward",
            &Cpu.cross_entropy_backward(&a, &targets, &lse, &dloss)
                .unwrap(),
            &Cpu.cross_entropy_backward(&af, &targets, &lsef, &dloss)
                .unwrap(),
        );
        let mask = Cpu.valid_mask(&targets, DType::BF16).unwrap();
        rounded_once(
            "valid_mask",
            &mask,
            &Cpu.valid_mask(&targets, DType::F32).unwrap(),
        );

        // Attention: o in bf16, lse in f32 (not rounded), and the backward
        // reads that f32 lse.
        let shape = [2, 9, 4, 8];
        let ((q, qf), (k, kf), (v, vf)) = (
            inputs(5, &shape),
            inputs(6, &[2, 9, 2, 8]),
            inputs(7, &[2, 9, 2, 8]),
        );
        let (o, lse) = Cpu.attention(&q, &k, &v, None).unwrap();
        let (of, lsef) = Cpu.attention(&qf, &kf, &vf, None).unwrap();
        rounded_once("attention o", &o, &of);
        assert_eq!((lse.dtype(), h64(&lse)), (DType::F32, h64(&lsef)));
        let (d_o, d_of) = inputs(8, &shape);
        // The f32 backward gets the bf16 forward's o, as the bf16 one does.
        let o_as_f32 = Cpu.cast(&o, DType::F32).unwrap();
        let (dq, dk, dv) = Cpu
            .attention_backward(&d_o, &q, &k, &v, &o, &lse, None)
            .unwrap();
        let (dqf, dkf, dvf) = Cpu
            .attention_backward(&d_of, &qf, &kf, &vf, &o_as_f32, &lsef, None)
            .unwrap();
        rounded_once("attention dq", &dq, &dqf);
        rounded_once("attention dk", &dk, &dkf);
        rounded_once("attention dv", &dv, &dvf);
        let lse16 = Cpu.cast(&lse, DType::BF16).unwrap();
        assert!(matches!(
            Cpu.attention_backward(&d_o, &q, &k, &v, &o, &lse16, None),
            Err(crate::KernelError::DTypeMismatch {
                expected: DType::F32,
                got: DType::BF16,
                ..
            })
        ));

        // AdamW in bf16 state: every stored value rounded once per step.
        let cfg = AdamWConfig {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 1,
            grad_scale: 1.0,
        };
        let (g, gf) = inputs(9, &[37, 70]);
        let (mut p, mut pf) = (a.clone(), af.clone());
        let (mut m, mut mf) = (
            Cpu.zeros(&[37, 70], DType::BF16).unwrap(),
            Cpu.zeros(&[37, 70], DType::F32).unwrap(),
        );
        let (mut s, mut sf) = (m.clone(), mf.clone());
        Cpu.adamw_step(&mut p, &g, &mut m, &mut s, &cfg).unwrap();
        Cpu.adamw_step(&mut pf, &gf, &mut mf, &mut sf, &cfg)
            .unwrap();
        rounded_once("adamw param", &p, &pf);
        rounded_once("adamw m", &m, &mf);
        rounded_once("adamw v", &s, &sf);
        // With an f32 master: master and moments f32, the parameter rounded.
        let mut p = a.clone();
        let mut master = af.clone();
        let (mut m, mut s) = (
            Cpu.zeros(&[37, 70], DType::F32).unwrap(),
            Cpu.zeros(&[37, 70], DType::F32).unwrap(),
        );
        Cpu.adamw_step_master(&mut p, &g, &mut master, &mut m, &mut s, &cfg)
            .unwrap();
        assert_eq!(h64(&master), h64(&pf), "master is the f32 update");
        rounded_once("adamw_step_master param", &p, &master);
    }

    /// Nearest even against `half`'s conversion, on ties, near-ties,
    /// subnormals, overflow to infinity and NaN.
    #[test]
    fn rounds_like_half() {
        let mut xs = vec![
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        for base in [1.0f32, -3.0, 1e-3, 6.5e4, 3.3e38] {
            let b = base.to_bits();
            for d in [0x7fffu32, 0x8000, 0x8001, 0x18000, 0x17fff, 0x1] {
                xs.push(f32::from_bits(b + d));
            }
        }
        for x in xs {
            let want = half::bf16::from_f32(x).to_f32();
            assert_eq!(round_f32(x).to_bits(), want.to_bits(), "{x:e}");
            assert_eq!(Bf16::round(x).to_f32().to_bits(), want.to_bits());
        }
        assert!(round_f32(f32::NAN).is_nan());
        // f64 rounds once: just above a bf16 tie goes up, where f64 → f32
        // (to the tie) → bf16 (to even) would go down.
        let tie = f32::from_bits(0x3f80_8000) as f64;
        assert_eq!(round_f64(tie + 1e-12), f32::from_bits(0x3f81_0000));
        assert_eq!(round_f64(tie), 1.0);
    }
}
