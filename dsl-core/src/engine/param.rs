//! Trainable parameters, their gradients, and deterministic initialisation.

use foldmoe_kernels::{Backend, DType, Device, HostData, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::parallel::shard::for_each_run;
use super::parallel::{ShardPlan, ShardSpec};
use super::Result;

/// A trainable tensor and the gradient accumulated into it.
pub struct Param<B: Device> {
    /// Stable dotted name (`blocks.3.attn.wq`), used for init seeds and checkpoints.
    pub name: String,
    /// The current value.
    pub value: Tensor<B>,
    /// Gradient accumulated by backward passes since the last `zero_grad`.
    /// Code other than [`Param::accumulate`] may replace it only once the
    /// backward passes of the step are done (reductions, clipping).
    pub grad: Tensor<B>,
    /// Whether the gradient is still zero (since `new`, `zero_grad` or
    /// `clear_grad`): the first accumulation then takes the incoming
    /// gradient as it is (a shared handle; copy-on-write keeps both safe)
    /// instead of adding it to zeros.
    grad_is_zero: bool,
    /// Whether the zero gradient was never written (`clear_grad`): `grad`
    /// is then an empty placeholder until an accumulation or
    /// [`Param::settle_grad`].
    grad_unwritten: bool,
    /// Where this tensor sits in the full parameter when it is one rank's
    /// shard (`None`: the whole parameter).
    pub shard: Option<Box<ShardSpec>>,
}

impl<B: Backend> Param<B> {
    /// Wraps `value` with a zero gradient of the same shape and dtype.
    pub fn new(b: &B, name: impl Into<String>, value: Tensor<B>) -> Result<Self> {
        let grad = b.zeros(value.shape(), value.dtype())?;
        Ok(Param {
            name: name.into(),
            value,
            grad,
            grad_is_zero: true,
            grad_unwritten: false,
            shard: None,
        })
    }

    /// Adds `g` into the gradient.
    pub fn accumulate(&mut self, b: &B, g: &Tensor<B>) -> Result<()> {
        let same_kind = g.shape() == self.value.shape() && g.dtype() == self.value.dtype();
        if self.grad_is_zero && same_kind {
            // 0 + g is g (up to the sign of a zero): skips a pass over the
            // gradient.
            self.grad = g.clone();
        } else {
            self.settle_grad(b)?;
            b.axpy(&mut self.grad, 1.0, g)?;
        }
        self.grad_is_zero = false;
        self.grad_unwritten = false;
        Ok(())
    }

    /// Resets the gradient to zero, written out.
    pub fn zero_grad(&mut self, b: &B) -> Result<()> {
        self.grad = b.zeros(self.value.shape(), self.value.dtype())?;
        self.grad_is_zero = true;
        self.grad_unwritten = false;
        Ok(())
    }

    /// Resets the gradient to zero without writing zeros (PyTorch's
    /// `set_to_none`): the old gradient's memory is freed at once, and the
    /// first accumulation takes its input as the gradient, so a step spends
    /// no pass over a gradient-sized buffer. Until an accumulation, read the
    /// gradient through [`Param::grad_or_zeros`] or call
    /// [`Param::settle_grad`] first.
    pub fn clear_grad(&mut self, b: &B) -> Result<()> {
        self.grad = b.zeros(&[0], self.value.dtype())?;
        self.grad_is_zero = true;
        self.grad_unwritten = true;
        Ok(())
    }

    /// Writes the zeros a [`Param::clear_grad`] left unwritten (a parameter
    /// no backward pass reached); nothing otherwise.
    pub fn settle_grad(&mut self, b: &B) -> Result<()> {
        if self.grad_unwritten {
            self.grad = b.zeros(self.value.shape(), self.value.dtype())?;
            self.grad_unwritten = false;
        }
        Ok(())
    }

    /// The gradient, or fresh zeros of the parameter's shape if it was
    /// cleared and not yet written (for readers that cannot settle it).
    pub fn grad_or_zeros(&self, b: &B) -> Result<Tensor<B>> {
        if self.grad_unwritten {
            Ok(b.zeros(self.value.shape(), self.value.dtype())?)
        } else {
            Ok(self.grad.clone())
        }
    }
}

/// Calls `f` on every parameter `visit` walks (e.g. a module's
/// `visit_params_mut`) and returns the first error; after one, the rest of
/// the walk skips `f` (a visitor cannot stop early).
pub fn try_each_param<B: Device>(
    visit: impl FnOnce(&mut dyn FnMut(&mut Param<B>)),
    mut f: impl FnMut(&mut Param<B>) -> Result<()>,
) -> Result<()> {
    let mut first = Ok(());
    visit(&mut |p| {
        if first.is_ok() {
            first = f(p);
        }
    });
    first
}

/// Anything holding parameters: visited in a fixed order (the declaration order).
pub trait Module<B: Device> {
    /// Calls `f` on every parameter.
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>));
    /// Calls `f` on every parameter, mutably.
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>));
}

/// Where parameters' initial values come from: the run's seed and, for one
/// rank of a layout, the shard plan saying which block of each global tensor
/// the rank draws. Element `i` of a global tensor is the same number whatever
/// block it falls in (the generator is counter-based), so every layout, and
/// one rank, start from the same global weights, and no rank ever holds more
/// than its blocks.
#[derive(Clone, Copy, Debug)]
pub struct Init<'a> {
    /// Seed of the generator (with each tensor's name).
    pub seed: u64,
    plan: Option<&'a ShardPlan>,
}

impl Init<'static> {
    /// Whole tensors (one rank holding the whole model, layer tests).
    pub fn full(seed: u64) -> Self {
        Init { seed, plan: None }
    }
}

impl<'a> Init<'a> {
    /// The blocks `plan` gives its rank.
    pub fn sharded(seed: u64, plan: &'a ShardPlan) -> Self {
        Init {
            seed,
            plan: Some(plan),
        }
    }

    /// The block of the global tensor `name` of `full_shape` this rank
    /// holds (none: the whole tensor).
    pub fn shard_of(&self, name: &str, full_shape: &[usize]) -> Result<Option<ShardSpec>> {
        Ok(match self.plan {
            Some(plan) => Some(plan.shard_of(name, full_shape)?).filter(|s| !s.splits.is_empty()),
            None => None,
        })
    }

    /// The parameter `name` of global shape `full_shape` drawn from
    /// normal(0, `std`): this rank's block of it.
    pub fn normal<B: Backend>(
        &self,
        b: &B,
        name: String,
        full_shape: &[usize],
        std: f64,
        dtype: DType,
    ) -> Result<Param<B>> {
        let shard = self.shard_of(&name, full_shape)?;
        let ranges: Vec<(usize, usize)> = match &shard {
            Some(s) => s.ranges(),
            None => full_shape.iter().map(|&n| (0, n)).collect(),
        };
        let value = init_normal_block(b, full_shape, &ranges, std, self.seed, &name, dtype)?;
        let mut p = Param::new(b, name, value)?;
        p.shard = shard.map(Box::new);
        Ok(p)
    }
}

/// A normal(0, std) tensor whose values depend only on `(seed, name)`, so a
/// parameter's initial value does not change when other parameters are added
/// or when it is built on another device.
pub fn init_normal<B: Backend>(
    b: &B,
    shape: &[usize],
    std: f64,
    seed: u64,
    name: &str,
    dtype: DType,
) -> Result<Tensor<B>> {
    let whole: Vec<(usize, usize)> = shape.iter().map(|&n| (0, n)).collect();
    init_normal_block(b, shape, &whole, std, seed, name, dtype)
}

/// The block `ranges` of the tensor [`init_normal`] would draw for
/// `full_shape`: each run of the block is drawn from the generator moved to
/// the run's global offset (ChaCha is counter-based), so the values are
/// those of the whole tensor, without drawing the rest.
fn init_normal_block<B: Backend>(
    b: &B,
    full_shape: &[usize],
    ranges: &[(usize, usize)],
    std: f64,
    seed: u64,
    name: &str,
    dtype: DType,
) -> Result<Tensor<B>> {
    let rng = ChaCha8Rng::seed_from_u64(seed ^ fnv1a(name.as_bytes()));
    let shape: Vec<usize> = ranges.iter().map(|r| r.1).collect();
    let n: usize = shape.iter().product();
    let mut runs = Vec::new();
    for_each_run(full_shape, ranges, |full, block, len| {
        runs.push((full, block, len))
    });
    let mut vals = vec![0.0; n];
    let mut rest: &mut [f64] = &mut vals;
    let mut pieces = Vec::with_capacity(runs.len());
    for &(full, _, len) in &runs {
        let (piece, tail) = rest.split_at_mut(len);
        pieces.push((full, piece));
        rest = tail;
    }
    pieces
        .into_par_iter()
        .for_each(|(full, piece)| normal_samples_at(&rng, full, piece, std));
    let shape = &shape[..];
    let data = match dtype {
        DType::F64 => HostData::F64(vals),
        _ => HostData::F32(vals.iter().map(|&x| x as f32).collect()),
    };
    let t = b.upload(data, shape)?;
    if dtype == DType::F32 || dtype == DType::F64 {
        Ok(t)
    } else {
        Ok(b.cast(&t, dtype)?)
    }
}

/// A constant tensor (norm weights start at 1).
pub fn init_const<B: Backend>(
    b: &B,
    shape: &[usize],
    value: f64,
    dtype: DType,
) -> Result<Tensor<B>> {
    let n: usize = shape.iter().product();
    let data = match dtype {
        DType::F64 => HostData::F64(vec![value; n]),
        _ => HostData::F32(vec![value as f32; n]),
    };
    let t = b.upload(data, shape)?;
    // Integer and bf16 tensors arrive as f32 and take the requested dtype.
    if dtype == DType::F32 || dtype == DType::F64 {
        Ok(t)
    } else {
        Ok(b.cast(&t, dtype)?)
    }
}

/// Samples drawn in parallel by chunks, each chunk's generator moved to where
/// a serial draw would have reached: billions of parameters draw in seconds,
/// and the values do not depend on the number of threads.
const INIT_CHUNK: usize = 1 << 16;

/// ChaCha words (u32) one [`standard_normal`] sample consumes: two u64 draws
/// (a uniform in `[MIN_POSITIVE, 1)` takes one u64 and never retries).
const WORDS_PER_SAMPLE: u128 = 4;

/// Samples `offset .. offset + out.len()` of the normal(0, `std`) sequence
/// `rng` gives drawn one after another, in parallel by chunks.
fn normal_samples_at(rng: &ChaCha8Rng, offset: usize, out: &mut [f64], std: f64) {
    let start = rng.get_word_pos();
    out.par_chunks_mut(INIT_CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut rng = rng.clone();
            let at = (offset + c * INIT_CHUNK) as u128;
            rng.set_word_pos(start + at * WORDS_PER_SAMPLE);
            for x in chunk {
                *x = std * standard_normal(&mut rng);
            }
        });
}

/// Box–Muller standard normal sample.
fn standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
    let u2: f64 = rng.gen();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// FNV-1a hash: a stable (across builds and platforms) hash of a name.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::{DType, Device};

    use super::{init_const, init_normal, Param};

    fn vals(t: &foldmoe_kernels::Tensor<Cpu>) -> Vec<f64> {
        Cpu.download(t).unwrap().to_f64()
    }

    #[test]
    fn parallel_samples_are_the_serial_sequence() {
        use rand::SeedableRng;
        let rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let n = 2 * super::INIT_CHUNK + 123;
        let mut fast = vec![0.0; n];
        super::normal_samples_at(&rng, 0, &mut fast, 0.5);
        let mut serial = rng.clone();
        for (i, &x) in fast.iter().enumerate() {
            let want = 0.5 * super::standard_normal(&mut serial);
            assert_eq!(x.to_bits(), want.to_bits(), "sample {i}");
        }
    }

    /// A block drawn alone (a rank's shard) is, bit for bit, that block of
    /// the whole tensor, for blocks of whole rows and of column ranges.
    #[test]
    fn a_block_drawn_alone_is_that_block_of_the_whole_tensor() {
        use crate::engine::parallel::shard::{cut_block, ShardSpec, Split, SplitAxis};
        let b = Cpu;
        let shape = [6, 5, 8];
        let whole = vals(&init_normal(&b, &shape, 0.02, 7, "w", DType::F64).unwrap());
        for (dim, index, parts) in [(0, 1, 3), (2, 3, 4), (1, 0, 5)] {
            let spec = ShardSpec {
                full_shape: shape.to_vec(),
                splits: vec![Split {
                    axis: SplitAxis::Tp,
                    dim,
                    index,
                    parts,
                }],
            };
            let block =
                super::init_normal_block(&b, &shape, &spec.ranges(), 0.02, 7, "w", DType::F64)
                    .unwrap();
            assert_eq!(block.shape(), spec.shape().as_slice());
            assert_eq!(vals(&block), cut_block(&whole, &spec), "dim {dim}");
        }
    }

    #[test]
    fn init_depends_only_on_seed_and_name() {
        let b = Cpu;
        let a = vals(&init_normal(&b, &[64, 32], 0.02, 7, "blocks.0.attn.wq", DType::F64).unwrap());
        let again =
            vals(&init_normal(&b, &[64, 32], 0.02, 7, "blocks.0.attn.wq", DType::F64).unwrap());
        let other_name =
            vals(&init_normal(&b, &[64, 32], 0.02, 7, "blocks.0.attn.wk", DType::F64).unwrap());
        let other_seed =
            vals(&init_normal(&b, &[64, 32], 0.02, 8, "blocks.0.attn.wq", DType::F64).unwrap());
        assert_eq!(a, again);
        assert_ne!(a, other_name);
        assert_ne!(a, other_seed);
        // f32 is the f64 draw rounded.
        let a32 =
            vals(&init_normal(&b, &[64, 32], 0.02, 7, "blocks.0.attn.wq", DType::F32).unwrap());
        assert!(a.iter().zip(&a32).all(|(x, y)| (*x as f32) as f64 == *y));
        // Mean near 0 and std near 0.02 over 2048 draws.
        let n = a.len() as f64;
        let mean = a.iter().sum::<f64>() / n;
        let std = (a.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(mean.abs() < 0.002, "mean {mean}");
        assert!((std - 0.02).abs() < 0.002, "std {std}");
    }

    #[test]
    fn grad_accumulates_and_zeroes() {
        let b = Cpu;
        let mut p = Param::new(&b, "w", init_const(&b, &[3], 1.0, DType::F32).unwrap()).unwrap();
        assert_eq!(vals(&p.grad), vec![0.0; 3]);
        let g = init_const(&b, &[3], 0.5, DType::F32).unwrap();
        p.accumulate(&b, &g).unwrap();
        p.accumulate(&b, &g).unwrap();
        assert_eq!(vals(&p.grad), vec![1.0; 3]);
        p.zero_grad(&b).unwrap();
        assert_eq!(vals(&p.grad), vec![0.0; 3]);
        let wrong = init_const(&b, &[4], 0.5, DType::F32).unwrap();
        assert!(p.accumulate(&b, &wrong).is_err());
    }

    /// A cleared gradient reads as zeros before any accumulation, takes the
    /// first accumulation as it is, and refuses a misshapen one as before.
    #[test]
    fn cleared_grad_is_zero_until_written() {
        let b = Cpu;
        let mut p = Param::new(&b, "w", init_const(&b, &[3], 1.0, DType::F32).unwrap()).unwrap();
        let g = init_const(&b, &[3], 0.5, DType::F32).unwrap();
        p.accumulate(&b, &g).unwrap();
        p.clear_grad(&b).unwrap();
        assert_eq!(p.grad.numel(), 0, "nothing written, the old gradient freed");
        assert_eq!(vals(&p.grad_or_zeros(&b).unwrap()), vec![0.0; 3]);
        p.accumulate(&b, &g).unwrap();
        p.accumulate(&b, &g).unwrap();
        assert_eq!(vals(&p.grad), vec![1.0; 3]);
        p.clear_grad(&b).unwrap();
        p.settle_grad(&b).unwrap();
        assert_eq!(vals(&p.grad), vec![0.0; 3]);
        p.clear_grad(&b).unwrap();
        let wrong = init_const(&b, &[4], 0.5, DType::F32).unwrap();
        assert!(p.accumulate(&b, &wrong).is_err());
    }
}
