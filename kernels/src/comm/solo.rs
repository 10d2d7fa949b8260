//! The communicator of a world of one rank: every group is that rank alone,
//! so every collective returns its input, on the caller's thread, with no
//! exchange. A one-rank run is the layout `world = 1` of the same engine.

use crate::backend::Device;
use crate::error::{KernelError, Result};
use crate::tensor::Tensor;

use super::{Communicator, Group, ReduceOp};

/// Rank 0 of a world of one.
#[derive(Clone, Copy, Debug, Default)]
pub struct SoloComm;

impl SoloComm {
    /// An error unless `group` is this rank alone.
    fn check(&self, op: &str, group: &Group) -> Result<()> {
        if group.ranks() == [0] {
            Ok(())
        } else {
            Err(KernelError::Comm {
                rank: 0,
                detail: format!(
                    "{op} on group {:?} in a world of one rank (only [0] exists)",
                    group.ranks()
                ),
            })
        }
    }
}

impl<B: Device> Communicator<B> for SoloComm {
    fn rank(&self) -> usize {
        0
    }

    fn world(&self) -> usize {
        1
    }

    fn all_reduce(&self, _b: &B, group: &Group, t: &Tensor<B>, _op: ReduceOp) -> Result<Tensor<B>> {
        self.check("all_reduce", group)?;
        Ok(t.clone())
    }

    fn reduce_scatter(&self, _b: &B, group: &Group, t: &Tensor<B>) -> Result<Tensor<B>> {
        self.check("reduce_scatter", group)?;
        Ok(t.clone())
    }

    fn all_gather(&self, _b: &B, group: &Group, t: &Tensor<B>) -> Result<Tensor<B>> {
        self.check("all_gather", group)?;
        Ok(t.clone())
    }

    fn all_to_all_v(
        &self,
        _b: &B,
        group: &Group,
        t: &Tensor<B>,
        send_rows: &[usize],
    ) -> Result<(Tensor<B>, Vec<usize>)> {
        self.check("all_to_all_v", group)?;
        let rows = t.shape().first().copied().unwrap_or(0);
        if send_rows != [rows] {
            return Err(KernelError::Comm {
                rank: 0,
                detail: format!(
                    "all_to_all_v: send_rows {send_rows:?} for a tensor of {rows} rows"
                ),
            });
        }
        Ok((t.clone(), vec![rows]))
    }

    fn broadcast(&self, _b: &B, group: &Group, root: usize, t: &Tensor<B>) -> Result<Tensor<B>> {
        self.check("broadcast", group)?;
        if root != 0 {
            return Err(KernelError::Comm {
                rank: 0,
                detail: format!("broadcast from group index {root} in a group of one"),
            });
        }
        Ok(t.clone())
    }

    fn send(&self, _b: &B, to: usize, _t: &Tensor<B>) -> Result<()> {
        Err(KernelError::Comm {
            rank: 0,
            detail: format!("send to rank {to} in a world of one rank"),
        })
    }

    fn recv(&self, _b: &B, from: usize) -> Result<Tensor<B>> {
        Err(KernelError::Comm {
            rank: 0,
            detail: format!("recv from rank {from} in a world of one rank"),
        })
    }

    fn barrier(&self, group: &Group) -> Result<()> {
        self.check("barrier", group)
    }

    fn abort(&self, _reason: &str) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Cpu;
    use crate::HostData;

    #[test]
    fn collectives_of_one_rank_return_their_input_and_other_groups_are_errors() {
        let b = Cpu;
        let t = b.upload(HostData::F32(vec![1.0, 2.0, 3.0]), &[3]).unwrap();
        let me = Group::new(vec![0]);
        let comm = SoloComm;
        let c: &dyn Communicator<Cpu> = &comm;
        for out in [
            c.all_reduce(&b, &me, &t, ReduceOp::Sum).unwrap(),
            c.all_gather(&b, &me, &t).unwrap(),
            c.reduce_scatter(&b, &me, &t).unwrap(),
            c.broadcast(&b, &me, 0, &t).unwrap(),
            c.all_to_all_v(&b, &me, &t, &[3]).unwrap().0,
        ] {
            assert_eq!(
                b.download(&out).unwrap(),
                HostData::F32(vec![1.0, 2.0, 3.0])
            );
        }
        let err = c
            .all_gather(&b, &Group::new(vec![0, 1]), &t)
            .unwrap_err()
            .to_string();
        assert!(err.contains("[0, 1]"), "{err}");
        assert!(c.send(&b, 1, &t).is_err() && c.recv(&b, 1).is_err());
    }
}
