//! Pipeline schedules (Megatron-Core's `forward_backward_pipelining_without_interleaving`
//! and `..._with_interleaving`) as pure functions, and the mailbox that
//! matches the activations and gradients a stage receives to the operations
//! that need them.
//!
//! Virtual stage `s = v·pp + p` is model chunk `v` of pipeline rank `p`
//! (the layout module's `stage_layers`). A forward of virtual stage `s`
//! sends its output to `s + 1`; a backward sends the input gradient to `s − 1`.

use std::collections::{HashMap, VecDeque};

use foldmoe_kernels::{Backend, Tensor};

use super::Ctx;
use crate::engine::{EngineError, Result};

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Forward of a micro-batch through a model chunk.
    F,
    /// Backward of a micro-batch through a model chunk.
    B,
}

/// One step of a stage's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Op {
    /// Forward or backward.
    pub pass: Pass,
    /// Micro-batch index.
    pub micro: usize,
    /// Model chunk of this rank (`0..vpp`).
    pub chunk: usize,
}

/// The ordered operations of pipeline rank `stage` over `micro` micro-batches:
/// warm-up forwards, steady one-forward-one-backward, cool-down backwards.
/// Without interleaving the warm-up is `pp − stage − 1` forwards, so a stage
/// holds at most `pp − stage` micro-batches' activations; with `vpp > 1`
/// it is Megatron's `2·(pp − stage − 1) + (vpp − 1)·pp` chunk-forwards (all of
/// them when `micro == pp`), and `micro` must be a multiple of `pp` because
/// chunks advance in groups of `pp` micro-batches.
pub fn schedule(pp: usize, vpp: usize, micro: usize, stage: usize) -> Result<Vec<Op>> {
    if pp == 0 || vpp == 0 || micro == 0 || stage >= pp {
        return Err(EngineError::Invalid(format!(
            "pipeline schedule: pp = {pp}, vpp = {vpp}, {micro} micro-batches, stage {stage}: \
             each must be at least 1 and the stage below pp"
        )));
    }
    if vpp > 1 && !micro.is_multiple_of(pp) {
        return Err(EngineError::Invalid(format!(
            "interleaved pipeline (vpp = {vpp}) needs the micro-batches per step ({micro}) to be \
             a multiple of pp = {pp}; use {} or {} micro-batches per data-parallel rank",
            micro / pp * pp,
            micro.div_ceil(pp) * pp
        )));
    }
    let total = micro * vpp;
    let warmup = if vpp == 1 {
        (pp - stage - 1).min(total)
    } else if micro == pp {
        total
    } else {
        ((pp - stage - 1) * 2 + (vpp - 1) * pp).min(total)
    };
    // The k-th forward (backward) of this rank: micro-batches advance in
    // groups of pp, each group passing every chunk (in reverse for backward).
    let op = |pass: Pass, k: usize| {
        let in_group = k % (pp * vpp);
        let chunk = in_group / pp;
        Op {
            pass,
            micro: k / (pp * vpp) * pp + in_group % pp,
            chunk: if pass == Pass::F {
                chunk
            } else {
                vpp - 1 - chunk
            },
        }
    };
    let mut ops = Vec::with_capacity(2 * total);
    ops.extend((0..warmup).map(|k| op(Pass::F, k)));
    for k in 0..total - warmup {
        ops.push(op(Pass::F, warmup + k));
        ops.push(op(Pass::B, k));
    }
    ops.extend((total - warmup..total).map(|k| op(Pass::B, k)));
    Ok(ops)
}

/// What a message carries: an activation into, or a gradient out of,
/// virtual stage `stage` for micro-batch `micro`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tag {
    /// `F`: the input activation of `stage`; `B`: the gradient of `stage`'s output.
    pub pass: Pass,
    /// Micro-batch index.
    pub micro: usize,
    /// The receiving virtual stage.
    pub stage: usize,
}

/// Receives the pipeline messages of one rank. The communicator delivers a
/// pair's tensors in order, but with interleaving one peer sends both
/// activations and gradients, in its own schedule's order, which differs from
/// the order this rank needs them: since every schedule is a pure function,
/// the mailbox knows what each peer's next tensor is and keeps the ones not
/// needed yet.
pub struct Mailbox<B: Backend> {
    /// Per sending global rank, the tags of its messages to this rank, in order.
    expected: HashMap<usize, VecDeque<Tag>>,
    /// Messages received ahead of their use.
    kept: HashMap<Tag, Tensor<B>>,
}

/// The sender's virtual stage of a message with `tag`.
fn source_stage(tag: &Tag) -> usize {
    match tag.pass {
        Pass::F => tag.stage - 1,
        Pass::B => tag.stage + 1,
    }
}

impl<B: Backend> Mailbox<B> {
    /// The mailbox of pipeline rank `me` of `pp_group` (global ranks in pp
    /// order) for the step's `micro` micro-batches.
    pub fn new(pp_group: &[usize], me: usize, vpp: usize, micro: usize) -> Result<Self> {
        let pp = pp_group.len();
        let last = pp * vpp - 1;
        let mut expected: HashMap<usize, VecDeque<Tag>> = HashMap::new();
        for (p, &peer) in pp_group.iter().enumerate() {
            for op in schedule(pp, vpp, micro, p)? {
                let s = op.chunk * pp + p;
                let tag = match op.pass {
                    Pass::F if s < last => Tag {
                        pass: Pass::F,
                        micro: op.micro,
                        stage: s + 1,
                    },
                    Pass::B if s > 0 => Tag {
                        pass: Pass::B,
                        micro: op.micro,
                        stage: s - 1,
                    },
                    _ => continue,
                };
                if tag.stage % pp == me {
                    expected.entry(peer).or_default().push_back(tag);
                }
            }
        }
        Ok(Mailbox {
            expected,
            kept: HashMap::new(),
        })
    }

    /// The tensor with `tag`, receiving (and keeping) the sender's earlier
    /// messages first.
    pub fn take(&mut self, ctx: &Ctx<B>, pp_group: &[usize], tag: Tag) -> Result<Tensor<B>> {
        let peer = pp_group[source_stage(&tag) % pp_group.len()];
        while !self.kept.contains_key(&tag) {
            let next = self
                .expected
                .get_mut(&peer)
                .and_then(VecDeque::pop_front)
                .ok_or_else(|| {
                    EngineError::Invalid(format!(
                        "pipeline: rank {} waits for {tag:?} from rank {peer}, which sends no more",
                        ctx.rank.rank
                    ))
                })?;
            let t = ctx.comm.recv(ctx.b, peer)?;
            self.kept.insert(next, t);
        }
        Ok(self.kept.remove(&tag).expect("just checked"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs every stage's schedule against the others with buffered sends:
    /// a forward of virtual stage s > 0 waits for s − 1's forward of the same
    /// micro-batch, a backward waits for s + 1's backward (or, on the last
    /// virtual stage, its own forward). Panics on a deadlock; returns each
    /// stage's largest number of chunk activations held at once.
    fn simulate(pp: usize, vpp: usize, micro: usize) -> Vec<usize> {
        let scheds: Vec<Vec<Op>> = (0..pp)
            .map(|p| schedule(pp, vpp, micro, p).unwrap())
            .collect();
        let last = pp * vpp - 1;
        let mut done: std::collections::HashSet<(Pass, usize, usize)> = Default::default();
        let mut pos = vec![0; pp];
        let mut held = vec![0usize; pp];
        let mut peak = vec![0usize; pp];
        loop {
            let mut progressed = false;
            for p in 0..pp {
                let Some(op) = scheds[p].get(pos[p]) else {
                    continue;
                };
                let s = op.chunk * pp + p;
                let ready = match op.pass {
                    Pass::F => s == 0 || done.contains(&(Pass::F, op.micro, s - 1)),
                    Pass::B => {
                        done.contains(&(Pass::F, op.micro, s))
                            && (s == last || done.contains(&(Pass::B, op.micro, s + 1)))
                    }
                };
                if ready {
                    done.insert((op.pass, op.micro, s));
                    if op.pass == Pass::F {
                        held[p] += 1;
                        peak[p] = peak[p].max(held[p]);
                    } else {
                        held[p] -= 1;
                    }
                    pos[p] += 1;
                    progressed = true;
                }
            }
            if (0..pp).all(|p| pos[p] == scheds[p].len()) {
                return peak;
            }
            assert!(
                progressed,
                "pp {pp} vpp {vpp} m {micro}: deadlock at {pos:?}"
            );
        }
    }

    #[test]
    fn one_f_one_b_order_and_memory_bound() {
        for pp in 1..=4 {
            for micro in 1..=9 {
                for stage in 0..pp {
                    let ops = schedule(pp, 1, micro, stage).unwrap();
                    let warmup = (pp - stage - 1).min(micro);
                    // Warm-up forwards, then F/B alternating, then backwards,
                    // micro-batches in order in each pass.
                    let mut want = Vec::new();
                    let f = |m| Op {
                        pass: Pass::F,
                        micro: m,
                        chunk: 0,
                    };
                    let b = |m| Op {
                        pass: Pass::B,
                        micro: m,
                        chunk: 0,
                    };
                    want.extend((0..warmup).map(f));
                    for k in 0..micro - warmup {
                        want.push(f(warmup + k));
                        want.push(b(k));
                    }
                    want.extend((micro - warmup..micro).map(b));
                    assert_eq!(ops, want, "pp {pp} stage {stage} m {micro}");
                }
                let peak = simulate(pp, 1, micro);
                for (stage, &held) in peak.iter().enumerate() {
                    assert!(held <= pp, "stage {stage} holds {held} > pp = {pp}");
                    assert!(held <= (pp - stage).min(micro), "stage {stage}: {held}");
                }
            }
        }
    }

    #[test]
    fn interleaved_order_and_memory_bound() {
        for pp in 2..=4 {
            for vpp in 2..=3 {
                for groups in 1..=3 {
                    let micro = groups * pp;
                    let peak = simulate(pp, vpp, micro);
                    for (stage, &held) in peak.iter().enumerate() {
                        let ops = schedule(pp, vpp, micro, stage).unwrap();
                        // Every (micro-batch, chunk) once forward and once
                        // backward, the backward after the forward.
                        for m in 0..micro {
                            for c in 0..vpp {
                                let at = |pass| {
                                    ops.iter()
                                        .position(|o| {
                                            *o == Op {
                                                pass,
                                                micro: m,
                                                chunk: c,
                                            }
                                        })
                                        .unwrap()
                                };
                                assert!(at(Pass::F) < at(Pass::B));
                            }
                        }
                        assert_eq!(ops.len(), 2 * micro * vpp);
                        // Chunks go forward 0..vpp and backward vpp−1..0 in
                        // groups of pp micro-batches.
                        assert_eq!(ops[0].chunk, 0);
                        // Megatron's bound: warm-up plus the one in flight.
                        let bound = if micro == pp {
                            micro * vpp
                        } else {
                            ((pp - stage - 1) * 2 + (vpp - 1) * pp + 1).min(micro * vpp)
                        };
                        assert!(
                            held <= bound,
                            "pp {pp} vpp {vpp} m {micro} stage {stage}: {held} > {bound}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn interleaving_refuses_micro_batches_not_a_multiple_of_pp() {
        let err = schedule(2, 2, 3, 0).unwrap_err().to_string();
        assert!(err.contains("multiple of pp = 2"), "{err}");
    }
}
