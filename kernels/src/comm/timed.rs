//! A communicator that measures the wall time spent in its collectives, for
//! the parallel runtime's "share of step time in communication" figure.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Communicator, Group, Pending, ReduceOp};
use crate::backend::Device;
use crate::error::Result;
use crate::tensor::Tensor;

/// Wraps another communicator and adds up the time spent inside its calls
/// (waiting for peers included: that is time a rank cannot compute).
pub struct TimedComm<'a, B: Device> {
    inner: &'a dyn Communicator<B>,
    nanos: AtomicU64,
}

impl<'a, B: Device> TimedComm<'a, B> {
    /// Measures calls made through it to `inner`.
    pub fn new(inner: &'a dyn Communicator<B>) -> Self {
        TimedComm {
            inner,
            nanos: AtomicU64::new(0),
        }
    }

    /// Total time spent in calls so far.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::Relaxed))
    }

    fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        let spent = start.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
        self.nanos.fetch_add(spent, Ordering::Relaxed);
        out
    }
}

impl<B: Device> Communicator<B> for TimedComm<'_, B> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_reduce(&self, b: &B, group: &Group, t: &Tensor<B>, op: ReduceOp) -> Result<Tensor<B>> {
        self.timed(|| self.inner.all_reduce(b, group, t, op))
    }
    fn reduce_scatter(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Tensor<B>> {
        self.timed(|| self.inner.reduce_scatter(b, group, t))
    }
    fn all_gather(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Tensor<B>> {
        self.timed(|| self.inner.all_gather(b, group, t))
    }
    fn all_to_all_v(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
        send_rows: &[usize],
    ) -> Result<(Tensor<B>, Vec<usize>)> {
        self.timed(|| self.inner.all_to_all_v(b, group, t, send_rows))
    }
    fn broadcast(&self, b: &B, group: &Group, root: usize, t: &Tensor<B>) -> Result<Tensor<B>> {
        self.timed(|| self.inner.broadcast(b, group, root, t))
    }
    fn send(&self, b: &B, to: usize, t: &Tensor<B>) -> Result<()> {
        self.timed(|| self.inner.send(b, to, t))
    }
    fn recv(&self, b: &B, from: usize) -> Result<Tensor<B>> {
        self.timed(|| self.inner.recv(b, from))
    }
    fn barrier(&self, group: &Group) -> Result<()> {
        self.timed(|| self.inner.barrier(group))
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
    fn reduce_scatter_start(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Pending<B>> {
        self.timed(|| self.inner.reduce_scatter_start(b, group, t))
    }
    fn all_gather_start(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Pending<B>> {
        self.timed(|| self.inner.all_gather_start(b, group, t))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::TimedComm;
    use crate::comm::local::run_local;
    use crate::comm::{Communicator, Group, ReduceOp};
    use crate::cpu::Cpu;
    use crate::{Device, HostData};

    #[test]
    fn timed_comm_passes_results_through_and_counts_waiting() {
        let results = run_local(2, Duration::from_secs(5), |comm| {
            let timed = TimedComm::new(&comm as &dyn Communicator<Cpu>);
            if Communicator::<Cpu>::rank(&timed) == 1 {
                std::thread::sleep(Duration::from_millis(50));
            }
            let t = Cpu.upload(HostData::F32(vec![1.0, 2.0]), &[2])?;
            let sum = timed.all_reduce(&Cpu, &Group::new(vec![0, 1]), &t, ReduceOp::Sum)?;
            Ok((Cpu.download(&sum)?, timed.elapsed()))
        });
        let (sum, waited) = results[0].as_ref().unwrap();
        assert_eq!(sum, &HostData::F32(vec![2.0, 4.0]));
        // Rank 0 waited for rank 1's 50 ms sleep inside the collective.
        assert!(*waited >= Duration::from_millis(40), "{waited:?}");
    }
}
