//! A communicator that measures the time its collectives cost, for the
//! parallel runtime's "share of step time in communication" figures: the
//! exposed time (the caller blocked in a call, or in [`Pending::wait`] for
//! a started one: time it could not compute) and the total time the
//! collectives ran (a started collective's time on the progress thread
//! counted whole, overlapped with compute or not).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Communicator, Group, Pending, ReduceOp};
use crate::backend::Device;
use crate::error::Result;
use crate::tensor::Tensor;

/// The two clocks of a [`TimedComm`], shared with the [`Pending`] handles
/// of its started collectives.
#[derive(Default)]
pub(crate) struct Meter {
    /// Nanoseconds the caller was blocked in calls and waits.
    blocked: AtomicU64,
    /// Nanoseconds collectives ran, on whichever thread.
    ran: AtomicU64,
}

impl Meter {
    /// Adds `blocked` to the exposed time and `ran` to the total.
    pub(crate) fn add(&self, blocked: Duration, ran: Duration) {
        let nanos = |d: Duration| d.as_nanos().min(u128::from(u64::MAX)) as u64;
        self.blocked.fetch_add(nanos(blocked), Ordering::Relaxed);
        self.ran.fetch_add(nanos(ran), Ordering::Relaxed);
    }
}

/// Wraps another communicator and adds up the time spent inside its calls
/// (waiting for peers included: that is time a rank cannot compute), and
/// the time its started collectives ran.
pub struct TimedComm<'a, B: Device> {
    inner: &'a dyn Communicator<B>,
    meter: Arc<Meter>,
}

impl<'a, B: Device> TimedComm<'a, B> {
    /// Measures calls made through it to `inner`.
    pub fn new(inner: &'a dyn Communicator<B>) -> Self {
        TimedComm {
            inner,
            meter: Arc::new(Meter::default()),
        }
    }

    /// Exposed time so far: spent blocked in calls, and in the waits of
    /// started collectives.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.meter.blocked.load(Ordering::Relaxed))
    }

    /// Total time collectives ran so far: the blocking calls', and the
    /// started ones' on the progress thread (as measured when waited for).
    pub fn busy(&self) -> Duration {
        Duration::from_nanos(self.meter.ran.load(Ordering::Relaxed))
    }

    fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        let spent = start.elapsed();
        self.meter.add(spent, spent);
        out
    }

    /// A started collective: the start counts as exposed, and the wait
    /// measures the rest (all of it exposed where the inner communicator
    /// ran the collective at the start).
    fn started(&self, f: impl FnOnce() -> Result<Pending<B>>) -> Result<Pending<B>> {
        let start = Instant::now();
        let pending = f()?;
        let spent = start.elapsed();
        let ran = if pending.finished_at_start() {
            spent
        } else {
            Duration::ZERO
        };
        self.meter.add(spent, ran);
        Ok(pending.metered(Arc::clone(&self.meter)))
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
    fn device_wait_time(&self) -> Result<Option<std::time::Duration>> {
        self.inner.device_wait_time()
    }
    fn reduce_scatter_start(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Pending<B>> {
        self.started(|| self.inner.reduce_scatter_start(b, group, t))
    }
    fn all_gather_start(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Pending<B>> {
        self.started(|| self.inner.all_gather_start(b, group, t))
    }
    fn all_to_all_v_start(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Pending<B>> {
        self.started(|| {
            self.inner
                .all_to_all_v_start(b, group, t, send_rows, recv_rows)
        })
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

    #[test]
    fn a_started_collective_counts_its_run_whole_and_only_its_wait_as_exposed() {
        let results = run_local(2, Duration::from_secs(5), |comm| {
            let timed = TimedComm::new(&comm as &dyn Communicator<Cpu>);
            if Communicator::<Cpu>::rank(&timed) == 1 {
                std::thread::sleep(Duration::from_millis(100));
            }
            let t = Cpu.upload(HostData::F32(vec![1.0, 2.0]), &[2])?;
            let p = timed.reduce_scatter_start(&Cpu, &Group::new(vec![0, 1]), &t)?;
            // Rank 0 computes while its collective waits for rank 1.
            if Communicator::<Cpu>::rank(&timed) == 0 {
                std::thread::sleep(Duration::from_millis(100));
            }
            let part = p.wait()?;
            Ok((Cpu.download(&part)?, timed.elapsed(), timed.busy()))
        });
        let (part, exposed, busy) = results[0].as_ref().unwrap();
        assert_eq!(part, &HostData::F32(vec![2.0]));
        // The collective ran while rank 0 slept: it waited for rank 1's
        // sleep on the progress thread, and that time is not exposed.
        assert!(busy > exposed, "busy {busy:?}, exposed {exposed:?}");
    }
}
