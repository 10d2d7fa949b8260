//! Freed CPU buffers kept for the next op that needs one of the same length.
//!
//! A training step allocates the same output sizes every step, and an op's
//! `vec![0; n]` output cost more than the op on the 2-core box: the memset
//! and the first-touch page faults run on the calling thread while rayon's
//! workers wait (a third of a 2-thread `tiny` step's wall time on the main
//! thread, by `perf`). [`super::HostBuf`] gives its buffer back here when it
//! is freed; [`take`] hands it out again without clearing it, for an output
//! that the op overwrites whole. The recycled values are old but valid
//! floats, so nothing here is unsafe; in tests and debug builds they are
//! poisoned (NaN) so that a kernel reading an element it did not write fails
//! its tests instead of passing on stale zeros.

use std::collections::BTreeMap;
use std::sync::Mutex;

use rayon::prelude::*;

use super::Bf16;

/// Buffers smaller than this are not kept: `malloc` serves them from its own
/// free lists without page faults, and the lock would cost more.
///
/// Tests pool every non-empty buffer, so that each kernel's small test cases run on
/// poisoned recycled buffers too.
const MIN_POOLED_BYTES: usize = if cfg!(test) { 1 } else { 64 << 10 };

/// The most bytes the pool keeps per element type: about a `tiny` step's
/// activations at 4096 tokens with room to spare. Past it the lengths used
/// longest ago are dropped first (a change of shapes, as between tests or
/// from training to evaluation, leaves buffers no op asks for again).
const MAX_POOLED_BYTES: usize = 1 << 30;

/// Elements below this many are cleared on one thread by [`zeroed`].
const PARALLEL_FILL_MIN: usize = 1 << 16;

/// The free buffers of one element type, by length.
pub struct Pool<T> {
    shelf: Mutex<Shelf<T>>,
}

struct Shelf<T> {
    /// The free buffers of each length, and when that length was last
    /// given back or handed out (a count of those events).
    by_len: BTreeMap<usize, (u64, Vec<Vec<T>>)>,
    bytes: usize,
    clock: u64,
}

impl<T> Shelf<T> {
    /// Drops the buffers of the lengths used longest ago until `incoming`
    /// more bytes fit under [`MAX_POOLED_BYTES`].
    fn make_room(&mut self, incoming: usize) {
        while self.bytes + incoming > MAX_POOLED_BYTES {
            let Some((&oldest, _)) = self.by_len.iter().min_by_key(|(_, (used, _))| *used) else {
                return;
            };
            if let Some((_, freed)) = self.by_len.remove(&oldest) {
                self.bytes -= freed.len() * oldest * std::mem::size_of::<T>();
            }
        }
    }
}

impl<T> Pool<T> {
    const fn new() -> Self {
        Pool {
            shelf: Mutex::new(Shelf {
                by_len: BTreeMap::new(),
                bytes: 0,
                clock: 0,
            }),
        }
    }
}

/// An element type with a pool of its own.
pub trait Pooled: Copy + Send + Sync + 'static {
    /// The value a recycled buffer is filled with in tests and debug builds.
    const POISON: Self;
    /// Zero, what new buffers and [`zeroed`] hold.
    const ZEROED: Self;
    /// The pool of this type.
    fn pool() -> &'static Pool<Self>;
}

macro_rules! pooled {
    ($t:ty, $poison:expr, $zero:expr) => {
        impl Pooled for $t {
            const POISON: Self = $poison;
            const ZEROED: Self = $zero;
            fn pool() -> &'static Pool<Self> {
                static POOL: Pool<$t> = Pool::new();
                &POOL
            }
        }
    };
}
pooled!(f32, f32::NAN, 0.0);
pooled!(f64, f64::NAN, 0.0);
pooled!(Bf16, Bf16::NAN, <Bf16 as super::Float>::ZERO);
pooled!(i32, i32::MIN, 0);

fn pooled_len<T>(n: usize) -> bool {
    n * std::mem::size_of::<T>() >= MIN_POOLED_BYTES
}

/// Keeps `v` for a later [`take`] of its length (what a freed
/// [`super::HostBuf`] does with its buffer).
pub(crate) fn recycle<T: Pooled>(mut v: Vec<T>) {
    if !pooled_len::<T>(v.len()) {
        return;
    }
    v.shrink_to_fit();
    let bytes = v.len() * std::mem::size_of::<T>();
    let Ok(mut shelf) = T::pool().shelf.lock() else {
        return;
    };
    if bytes > MAX_POOLED_BYTES {
        return;
    }
    shelf.make_room(bytes);
    shelf.bytes += bytes;
    shelf.clock += 1;
    let now = shelf.clock;
    let entry = shelf.by_len.entry(v.len()).or_default();
    entry.0 = now;
    entry.1.push(v);
}

/// A buffer of `n` elements whose values are unspecified: the caller writes
/// every one before the buffer becomes a tensor. A recycled buffer when the
/// pool has one of that length, else a new zeroed one.
pub(crate) fn take<T: Pooled>(n: usize) -> Vec<T> {
    if pooled_len::<T>(n) {
        let reused = T::pool().shelf.lock().ok().and_then(|mut shelf| {
            shelf.clock += 1;
            let now = shelf.clock;
            let (used, free) = shelf.by_len.get_mut(&n)?;
            let v = free.pop()?;
            *used = now;
            shelf.bytes -= n * std::mem::size_of::<T>();
            Some(v)
        });
        if let Some(mut v) = reused {
            if cfg!(any(test, debug_assertions)) {
                v.fill(T::POISON);
            }
            return v;
        }
    }
    vec![T::ZEROED; n]
}

/// A copy of `src` in a recycled buffer when there is one.
pub(crate) fn copied<T: Pooled>(src: &[T]) -> Vec<T> {
    let mut v = take::<T>(src.len());
    v.copy_from_slice(src);
    v
}

/// A buffer of `n` zeros: a recycled one cleared on rayon's pool, or a new
/// one.
pub(crate) fn zeroed<T: Pooled>(n: usize) -> Vec<T> {
    let mut v = take::<T>(n);
    v.par_chunks_mut(PARALLEL_FILL_MIN)
        .for_each(|c| c.fill(T::ZEROED));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_buffer_is_handed_out_again_poisoned() {
        // A length no other test uses, so that the buffer found is this one.
        let n = (MIN_POOLED_BYTES / 8) + 12_345;
        let v = vec![1.0f64; n];
        let ptr = v.as_ptr();
        recycle(v);
        let again = take::<f64>(n);
        assert_eq!(again.len(), n);
        assert_eq!(again.as_ptr(), ptr);
        assert!(again.iter().all(|x| x.is_nan()));
        recycle(again);
        assert!(zeroed::<f64>(n).iter().all(|&x| x == 0.0));
    }
}
