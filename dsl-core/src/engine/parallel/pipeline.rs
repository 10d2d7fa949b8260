//! Pipeline schedules (Megatron-Core's `forward_backward_pipelining_without_interleaving`
//! and `..._with_interleaving`) as pure functions, and the mailbox that
//! matches the activations and gradients a stage receives to the operations
//! that need them. [`turns`] gives the schedule as a stage runs it: one
//! operation at a time, or with the expert all-to-alls overlapped
//! (Megatron-Core's `--overlap-moe-expert-parallel-comm`), each steady
//! forward paired with the next backward.
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
    let phases = phases(pp, vpp, micro, stage, 0)?;
    let mut ops = phases.warmup;
    ops.extend(phases.steady.into_iter().flat_map(|(f, b)| [f, b]));
    ops.extend(phases.cooldown);
    Ok(ops)
}

/// One turn of a stage's schedule: an operation alone, or a forward and a
/// backward run together by [`crate::engine::model::Model::forward_backward_chunks`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn {
    /// One forward or backward.
    One(Op),
    /// The forward `f` interleaved with the backward `b` at the MoE
    /// layers' exchanges.
    Pair {
        /// The forward.
        f: Op,
        /// The backward.
        b: Op,
    },
}

/// The turns of pipeline rank `stage`: [`schedule`]'s operations one by
/// one, or, with `overlapped` (the expert all-to-alls overlapped,
/// Megatron-Core's `--overlap-moe-expert-parallel-comm`), one more warm-up
/// forward (so a steady backward never waits for the forward it is paired
/// with, which runs another micro-batch or chunk) and every steady forward
/// paired with the backward after it. The forwards and the backwards each
/// keep their order, so the losses and gradients are those of the plain
/// schedule; a stage holds up to one more chunk's activations (the pair's
/// backward frees its blocks as its forward saves its own). Where no stage
/// would pair anything (one micro-batch, or interleaving with
/// `micro == pp`) an overlapped schedule is an error: the flag would change
/// nothing. A stage with more warm-up forwards may pair nothing while the
/// last stage pairs.
pub fn turns(
    pp: usize,
    vpp: usize,
    micro: usize,
    stage: usize,
    overlapped: bool,
) -> Result<Vec<Turn>> {
    let phases = phases(pp, vpp, micro, stage, usize::from(overlapped))?;
    // The last stage has the fewest warm-up forwards: if it pairs nothing,
    // no stage does, and the flag would change nothing.
    if overlapped && stage + 1 < pp && phases.steady.is_empty() {
        turns(pp, vpp, micro, pp - 1, true)?;
    }
    if overlapped && stage + 1 == pp && phases.steady.is_empty() {
        return Err(EngineError::Invalid(format!(
            "--overlap-moe-expert-parallel-comm pairs each steady forward with a backward, but \
             {micro} micro-batch(es) per data-parallel rank under pp = {pp}, vpp = {vpp} leave \
             none to pair; use at least {} per data-parallel rank",
            if vpp == 1 { 2 } else { 2 * pp }
        )));
    }
    let mut turns: Vec<Turn> = phases.warmup.into_iter().map(Turn::One).collect();
    if overlapped {
        turns.extend(phases.steady.into_iter().map(|(f, b)| Turn::Pair { f, b }));
    } else {
        turns.extend(
            phases
                .steady
                .into_iter()
                .flat_map(|(f, b)| [Turn::One(f), Turn::One(b)]),
        );
    }
    turns.extend(phases.cooldown.into_iter().map(Turn::One));
    Ok(turns)
}

impl Turn {
    /// The turn's operations in the order their outputs are sent: a pair's
    /// forward output, then its backward's input gradient.
    pub fn ops(self) -> impl Iterator<Item = Op> {
        let (first, second) = match self {
            Turn::One(op) => (op, None),
            Turn::Pair { f, b } => (f, Some(b)),
        };
        std::iter::once(first).chain(second)
    }
}

/// A stage's schedule in its three phases.
struct Phases {
    /// Warm-up forwards.
    warmup: Vec<Op>,
    /// Steady one-forward-one-backward pairs, the forward first.
    steady: Vec<(Op, Op)>,
    /// Cool-down backwards.
    cooldown: Vec<Op>,
}

/// The phases of [`schedule`] with `extra` more warm-up forwards (capped
/// at all of them).
fn phases(pp: usize, vpp: usize, micro: usize, stage: usize, extra: usize) -> Result<Phases> {
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
        (pp - stage - 1 + extra).min(total)
    } else if micro == pp {
        total
    } else {
        ((pp - stage - 1) * 2 + (vpp - 1) * pp + extra).min(total)
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
    Ok(Phases {
        warmup: (0..warmup).map(|k| op(Pass::F, k)).collect(),
        steady: (0..total - warmup)
            .map(|k| (op(Pass::F, warmup + k), op(Pass::B, k)))
            .collect(),
        cooldown: (total - warmup..total).map(|k| op(Pass::B, k)).collect(),
    })
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
    /// order) for the step's `micro` micro-batches, every rank running the
    /// [`turns`] of `overlapped`.
    pub fn new(
        pp_group: &[usize],
        me: usize,
        vpp: usize,
        micro: usize,
        overlapped: bool,
    ) -> Result<Self> {
        let pp = pp_group.len();
        let last = pp * vpp - 1;
        let mut expected: HashMap<usize, VecDeque<Tag>> = HashMap::new();
        for (p, &peer) in pp_group.iter().enumerate() {
            let sent = turns(pp, vpp, micro, p, overlapped)?
                .into_iter()
                .flat_map(Turn::ops);
            for op in sent {
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
        simulate_turns(pp, vpp, micro, false)
    }

    /// [`simulate`] over [`turns`]: a pair runs once both its forward's
    /// and its backward's inputs are there (its backward cannot wait for
    /// its own forward); a pair's forward counts as held before its
    /// backward frees one.
    fn simulate_turns(pp: usize, vpp: usize, micro: usize, overlapped: bool) -> Vec<usize> {
        let scheds: Vec<Vec<Turn>> = (0..pp)
            .map(|p| turns(pp, vpp, micro, p, overlapped).unwrap())
            .collect();
        let last = pp * vpp - 1;
        let mut done: std::collections::HashSet<(Pass, usize, usize)> = Default::default();
        let mut pos = vec![0; pp];
        let mut held = vec![0usize; pp];
        let mut peak = vec![0usize; pp];
        loop {
            let mut progressed = false;
            for p in 0..pp {
                let Some(&turn) = scheds[p].get(pos[p]) else {
                    continue;
                };
                let ready = |op: Op| {
                    let s = op.chunk * pp + p;
                    match op.pass {
                        Pass::F => s == 0 || done.contains(&(Pass::F, op.micro, s - 1)),
                        Pass::B => {
                            done.contains(&(Pass::F, op.micro, s))
                                && (s == last || done.contains(&(Pass::B, op.micro, s + 1)))
                        }
                    }
                };
                if turn.ops().all(ready) {
                    for op in turn.ops() {
                        done.insert((op.pass, op.micro, op.chunk * pp + p));
                        if op.pass == Pass::F {
                            held[p] += 1;
                            peak[p] = peak[p].max(held[p]);
                        } else {
                            held[p] -= 1;
                        }
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
    fn overlapped_turns_keep_each_pass_in_order_and_never_deadlock() {
        for pp in 1..=4 {
            for vpp in 1..=3 {
                if pp == 1 && vpp > 1 {
                    continue;
                }
                for micro in 1..=9 {
                    if vpp > 1 && micro % pp != 0 {
                        continue;
                    }
                    // Nothing to pair anywhere: refused on every stage.
                    let none = if vpp == 1 { micro < 2 } else { micro == pp };
                    if none {
                        for stage in 0..pp {
                            let err = turns(pp, vpp, micro, stage, true).unwrap_err();
                            assert!(err.to_string().contains("none to pair"), "{err}");
                        }
                        continue;
                    }
                    let plain_peak = simulate(pp, vpp, micro);
                    let peak = simulate_turns(pp, vpp, micro, true);
                    for stage in 0..pp {
                        let at = format!("pp {pp} vpp {vpp} m {micro} stage {stage}");
                        let plain = schedule(pp, vpp, micro, stage).unwrap();
                        let overlapped = turns(pp, vpp, micro, stage, true).unwrap();
                        let ops: Vec<Op> = overlapped.iter().flat_map(|t| t.ops()).collect();
                        let of = |ops: &[Op], pass| -> Vec<Op> {
                            ops.iter().copied().filter(|o| o.pass == pass).collect()
                        };
                        assert_eq!(of(&ops, Pass::F), of(&plain, Pass::F), "{at}");
                        assert_eq!(of(&ops, Pass::B), of(&plain, Pass::B), "{at}");
                        let pairs = overlapped
                            .iter()
                            .filter(|t| matches!(t, Turn::Pair { .. }))
                            .count();
                        // Every steady forward pairs: all but the warm-up.
                        let warmup = overlapped
                            .iter()
                            .take_while(|t| matches!(t, Turn::One(o) if o.pass == Pass::F))
                            .count();
                        assert_eq!(pairs, micro * vpp - warmup, "{at}");
                        assert!(
                            peak[stage] <= plain_peak[stage] + 1,
                            "{at}: holds {} > {} + 1",
                            peak[stage],
                            plain_peak[stage]
                        );
                        let plain_turns = turns(pp, vpp, micro, stage, false).unwrap();
                        let plain_ops: Vec<Op> = plain_turns.iter().flat_map(|t| t.ops()).collect();
                        assert_eq!(plain_ops, plain, "{at}");
                    }
                }
            }
        }
        // pp = 1: F0, then F(k+1) with B(k), then the last backward.
        let one = |pass, micro| Op {
            pass,
            micro,
            chunk: 0,
        };
        let t = turns(1, 1, 3, 0, true).unwrap();
        assert_eq!(
            t,
            vec![
                Turn::One(one(Pass::F, 0)),
                Turn::Pair {
                    f: one(Pass::F, 1),
                    b: one(Pass::B, 0)
                },
                Turn::Pair {
                    f: one(Pass::F, 2),
                    b: one(Pass::B, 1)
                },
                Turn::One(one(Pass::B, 2)),
            ]
        );
    }

    #[test]
    fn interleaving_refuses_micro_batches_not_a_multiple_of_pp() {
        let err = schedule(2, 2, 3, 0).unwrap_err().to_string();
        assert!(err.contains("multiple of pp = 2"), "{err}");
    }
}
