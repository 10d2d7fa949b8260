//! CPU activation offload: the "device" is host memory already, so an
//! offloaded tensor is a copy in a buffer of its own (the separate host
//! pool), and bringing it back is a copy again.

use super::Cpu;
use crate::backend::{Device, OffloadOps};
use crate::error::Result;
use crate::tensor::{DType, HostData, Tensor};

/// An offloaded CPU tensor: its values in a buffer of their own.
#[derive(Debug)]
pub struct CpuOffloaded {
    data: HostData,
    /// The tensor's dtype: bf16 travels as (exact) f32 host data.
    dtype: DType,
    shape: Vec<usize>,
}

impl OffloadOps for Cpu {
    type Offloaded = CpuOffloaded;

    fn offload(&self, t: &Tensor<Self>) -> Result<CpuOffloaded> {
        Ok(CpuOffloaded {
            data: self.download(t)?,
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
        })
    }

    fn prefetch(&self, _h: &mut CpuOffloaded) -> Result<()> {
        Ok(())
    }

    fn reload(&self, h: CpuOffloaded) -> Result<Tensor<Self>> {
        let t = self.upload(h.data, &h.shape)?;
        if t.dtype() == h.dtype {
            Ok(t)
        } else {
            // Exact: the values were bf16 already.
            self.cast(&t, h.dtype)
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::cpu::test_util::*;
    use crate::tensor::DType;

    /// Offloaded tensors come back bit for bit, in their dtype and shape,
    /// whatever happens to the original meanwhile, prefetched or not.
    fn offload_round_trips_exactly<B: TestOps>(d: &B) {
        let shapes: [&[usize]; 3] = [&[3, 5], &[1000], &[2, 3, 4]];
        for (i, shape) in shapes.iter().enumerate() {
            let n: usize = shape.iter().product();
            let v: Vec<f64> = (0..n).map(|j| (j as f64 * 0.37 + i as f64).sin()).collect();
            let t = d.t32(&v.iter().map(|&x| x as f32).collect::<Vec<_>>(), shape);
            // Every other tensor in bf16, which both backends store.
            let t = if i == 1 {
                d.cast(&t, DType::BF16).unwrap()
            } else {
                t
            };
            let dtype = t.dtype();
            let want = d.h64(&t);
            let mut h = d.offload(&t).unwrap();
            drop(t);
            // Other work reuses the memory before the tensor comes back.
            let other = d.t32(&vec![7.0; n], shape);
            if i % 2 == 0 {
                d.prefetch(&mut h).unwrap();
            }
            let back = d.reload(h).unwrap();
            assert_eq!((back.shape(), back.dtype()), (*shape, dtype));
            assert_eq!(d.h64(&back), want, "shape {shape:?}");
            assert_eq!(d.h64(&other), vec![7.0; n]);
        }
    }

    device_tests!(offload_round_trips_exactly);
}
