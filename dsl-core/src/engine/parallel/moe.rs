//! The MoE layer over the folded expert mesh (docs/ARCHITECTURE.md §4; Megatron-Core's
//! `MoEAlltoAllTokenDispatcher`).
//!
//! ```text
//! route   this rank's sequence-parallel rows (router replicated over tp;
//!         balancing statistics summed over tp×cp, so the loss is the micro-batch's)
//! permute copies into expert-major order over all E experts
//! a2a-v   over ep: rows for experts [j·E/ep, (j+1)·E/ep) go to ep rank j
//! gather  within etp (the etp ranks hold the same experts, ffn split)
//! sort    received (source, expert) blocks into expert-major order
//! compute grouped GEMM over the E/ep local experts (ffn/etp each)
//! back    the same steps reversed: unsort, sum over etp and keep own rows,
//!         a2a-v back, un-permute weighted by the routing weights
//! shared  experts: tensor-parallel like the dense MLP
//! ```
//!
//! The token counts of the all-to-all are read on the host, as Megatron-Core
//! does before its all-to-all-v: the buffer sizes depend on them.
//!
//! Capacity mode keeps, for every micro-batch, exactly the copies one rank
//! would keep: the router decisions are gathered over tp×cp and the plan is made
//! over the whole micro-batch (Megatron-Core plans per sequence-parallel
//! shard, so its drops change with tp; ours do not). Padding to capacity is
//! not applied across ranks: padding rows are zeros and change no output or
//! gradient.

use foldmoe_kernels::{Backend, DropPolicy, HostData, RoutingPlan, Tensor};

use super::shard::upload_as;
use super::Ctx;
use crate::engine::moe::dispatcher::{CombineSaved, DispatchSaved, Dispatcher};
use crate::engine::moe::experts::{Experts, ExpertsSaved};
use crate::engine::moe::loss::TokenShard;
use crate::engine::moe::router::{Router, RouterSaved};
use crate::engine::moe::shared::{SharedExperts, SharedSaved};
use crate::engine::moe::{MoeLayer, MoeStats};
use crate::engine::param::{Module, Param};
use crate::engine::{EngineError, Result};
use crate::layout::cp_positions;
use crate::spec::{DropPolicySpec, LoadBalance, MoeSpec};

/// One rank's part of an MoE layer.
pub struct ParallelMoe<B: Backend> {
    /// The router over all E experts (replicated).
    pub router: Router<B>,
    /// This rank's experts `[E/ep, …]`, their ffn split over etp.
    pub experts: Experts<B>,
    /// Shared experts, ffn split over tp.
    pub shared: Option<SharedExperts<B>>,
    dispatcher: Dispatcher,
    spec: MoeSpec,
}

/// The token exchange of one forward: sizes and the sort order.
struct Exchange<B: Backend> {
    /// Rows sent to each ep rank.
    send_rows: Vec<usize>,
    /// Rows received from each ep rank.
    recv_rows: Vec<usize>,
    /// Rows of every etp member's received block, in etp order.
    etp_rows: Vec<usize>,
    /// `[M]` i32: the expert-major order as rows of the etp-gathered block.
    order: Tensor<B>,
}

/// What the layer's backward needs.
pub struct ParallelMoeSaved<B: Backend> {
    router: RouterSaved<B>,
    dispatch: DispatchSaved<B>,
    exchange: Option<Exchange<B>>,
    experts: Option<ExpertsSaved<B>>,
    combine: CombineSaved<B>,
    shared: Option<SharedSaved<B>>,
}

impl<B: Backend> ParallelMoeSaved<B> {
    /// Lists the saved tensors with the single-rank layer's slots, in
    /// forward order: router, routing plan, exchange order, experts,
    /// expert outputs, routing weights, shared experts.
    pub(crate) fn visit_saved(
        &mut self,
        f: &mut dyn FnMut(crate::engine::activations::Slot, &mut Tensor<B>),
    ) {
        use crate::engine::activations::Slot as S;
        use crate::memory::Part;
        self.router.visit_saved(f);
        self.dispatch.visit_saved(f);
        if let Some(x) = &mut self.exchange {
            f(S::kept(Part::RoutedExperts), &mut x.order);
        }
        if let Some(x) = &mut self.experts {
            x.visit_saved(f);
        }
        self.combine.visit_saved(f);
        if let Some(s) = &mut self.shared {
            s.visit_saved(f);
        }
    }
}

impl<B: Backend> ParallelMoe<B> {
    /// The expert-mesh form of `layer`, whose experts and shared experts are
    /// already this rank's blocks (drawn under its shard plan).
    pub fn from_layer(layer: MoeLayer<B>, spec: &MoeSpec) -> Self {
        let MoeLayer {
            router,
            dispatcher,
            experts,
            shared,
            ..
        } = layer;
        ParallelMoe {
            router,
            experts,
            shared,
            dispatcher,
            spec: spec.clone(),
        }
    }

    /// `x: [T/(tp·cp), D]` (this rank's rows of a micro-batch of `tokens`) →
    /// `[T/(tp·cp), D]`.
    pub fn forward(
        &self,
        ctx: &Ctx<B>,
        x_td: &Tensor<B>,
        seq_len: usize,
        tokens: usize,
    ) -> Result<(Tensor<B>, ParallelMoeSaved<B>, MoeStats<B>)> {
        let b = ctx.b;
        let rank = ctx.rank;
        let (t_local, _) = x_td.dims2("ParallelMoe::forward")?;
        // Rows numbered within this cp rank's tokens: B sequences of S/cp each.
        let shard = TokenShard {
            offset: rank.tp_index * t_local,
            total: tokens,
            segment: if self.spec.router.load_balance == LoadBalance::SeqAux {
                seq_len
            } else {
                tokens
            },
            cp: rank.cp.size(),
        };
        let reduce = |x: &Tensor<B>| ctx.sum_over(&rank.tp_cp, x);
        let (routing, router) = self.router.forward_shard(b, x_td, shard, &reduce)?;
        let (idx, weights) = (&routing.idx_tk, &routing.weights_tk);
        let (x_nd, dispatch) = match &self.spec.capacity {
            None => self.dispatcher.dispatch(b, x_td, idx, weights)?,
            Some(_) => {
                let plan = self.capacity_plan(ctx, idx, weights, shard, seq_len)?;
                self.dispatcher.dispatch_planned(b, x_td, plan)?
            }
        };
        let (y_nd, exchange, experts) = self.compute(ctx, &x_nd, dispatch.counts_e())?;
        let (mut y_td, combine) = self.dispatcher.combine(b, y_nd, &dispatch, weights)?;
        let shared = match &self.shared {
            Some(s) => {
                let (ys_full, saved) = s.forward(b, &ctx.gather_tp(x_td)?)?;
                b.axpy(&mut y_td, 1.0, &ctx.scatter_tp(&ys_full)?)?;
                Some(saved)
            }
            None => None,
        };
        let saved = ParallelMoeSaved {
            router,
            dispatch,
            exchange,
            experts,
            combine,
            shared,
        };
        let stats = MoeStats {
            aux_loss: routing.aux_loss,
            z_loss: routing.z_loss,
            load: routing.load_e,
        };
        Ok((y_td, saved, stats))
    }

    /// Accumulates the gradients and returns `dx: [T/tp, D]`.
    pub fn backward(
        &mut self,
        ctx: &Ctx<B>,
        dy_td: &Tensor<B>,
        saved: ParallelMoeSaved<B>,
        loss_scale: f64,
    ) -> Result<Tensor<B>> {
        let b = ctx.b;
        let ParallelMoeSaved {
            router,
            dispatch,
            exchange,
            experts,
            combine,
            shared,
        } = saved;
        let dx_shared = match (shared, self.shared.as_mut()) {
            (Some(saved), Some(s)) => {
                let d_full = s.backward(b, &ctx.gather_tp(dy_td)?, saved)?;
                Some(ctx.scatter_tp(&d_full)?)
            }
            _ => None,
        };
        let (dy_nd, dweights_tk) = self
            .dispatcher
            .combine_backward(b, dy_td, combine, &dispatch)?;
        let dx_nd = self.compute_backward(ctx, &dy_nd, exchange, experts)?;
        let mut dx_td = self.dispatcher.dispatch_backward(b, &dx_nd, dispatch)?;
        let dx_router = self.router.backward(b, &dweights_tk, router, loss_scale)?;
        b.axpy(&mut dx_td, 1.0, &dx_router)?;
        if let Some(d) = dx_shared {
            b.axpy(&mut dx_td, 1.0, &d)?;
        }
        Ok(dx_td)
    }

    /// Capacity plan of this rank's rows, made over the whole micro-batch in
    /// its token order (under cp the decisions of every tp×cp rank are put
    /// back in that order first, so drops by position match one rank's).
    fn capacity_plan(
        &self,
        ctx: &Ctx<B>,
        idx_tk: &Tensor<B>,
        weights_tk: &Tensor<B>,
        shard: TokenShard,
        seq_len: usize,
    ) -> Result<RoutingPlan<B>> {
        let b = ctx.b;
        let (t_local, k) = idx_tk.dims2("capacity_plan")?;
        let cap = self.spec.capacity.as_ref().ok_or_else(|| {
            EngineError::Invalid("capacity plan asked of a dropless layer".into())
        })?;
        let policy = match cap.drop_policy {
            DropPolicySpec::Probs => DropPolicy::Probs,
            DropPolicySpec::Position => DropPolicy::Position,
        };
        let e = self.spec.experts;
        let rank = ctx.rank;
        let cp = rank.cp.size();
        // The micro-batch token of row `row` of cp rank `cp_i`'s tokens.
        let token = |cp_i: usize, row: usize| -> usize {
            let held = seq_len / cp;
            let positions = cp_positions(seq_len, cp, cp_i);
            (row / held) * seq_len + positions[row % held]
        };
        let (idx_all, probs_all, rows) = if cp == 1 {
            let rows: Vec<usize> = (0..t_local).map(|t| shard.offset + t).collect();
            (ctx.gather_tp(idx_tk)?, ctx.gather_tp(weights_tk)?, rows)
        } else {
            let idx_g = b
                .download(&ctx.comm.all_gather(b, &rank.tp_cp, idx_tk)?)?
                .to_i32()?;
            let probs_g = b
                .download(&ctx.comm.all_gather(b, &rank.tp_cp, weights_tk)?)?
                .to_f64();
            let (mut idx_n, mut probs_n) = (vec![0i32; idx_g.len()], vec![0.0; probs_g.len()]);
            for (m, &r) in rank.tp_cp.ranks().iter().enumerate() {
                let c = rank.layout.attention_coords(r);
                for t in 0..t_local {
                    let (from, to) = ((m * t_local + t) * k, token(c.cp, c.tp * t_local + t) * k);
                    idx_n[to..to + k].copy_from_slice(&idx_g[from..from + k]);
                    probs_n[to..to + k].copy_from_slice(&probs_g[from..from + k]);
                }
            }
            let n = idx_n.len() / k;
            let rows: Vec<usize> = (0..t_local)
                .map(|t| token(rank.cp_index, rank.tp_index * t_local + t))
                .collect();
            (
                b.upload(HostData::I32(idx_n), &[n, k])?,
                upload_as(b, probs_n, &[n, k], weights_tk.dtype())?,
                rows,
            )
        };
        let capacity = self
            .dispatcher
            .capacity(shard.total)
            .unwrap_or(shard.total * k);
        let global = b.capacity_plan(&idx_all, &probs_all, e, capacity, policy, false)?;
        let slot = b.download(&global.slot)?.to_i32()?;
        let idx = b.download(&idx_all)?.to_i32()?;
        // Kept copies of this rank's rows, sorted by expert, stable in
        // (token, choice) order as the single-rank plan is.
        let mut kept: Vec<(i32, usize, usize)> = Vec::new();
        for (t, &row) in rows.iter().enumerate() {
            for j in 0..k {
                let g = row * k + j;
                if slot[g] >= 0 {
                    kept.push((idx[g], t, j));
                }
            }
        }
        kept.sort_by_key(|&(e, t, j)| (e, t, j));
        let mut row_src = Vec::with_capacity(kept.len());
        let mut local_slot = vec![-1i32; t_local * k];
        let mut counts = vec![0i32; e];
        for (n, &(expert, t, j)) in kept.iter().enumerate() {
            row_src.push(t as i32);
            local_slot[t * k + j] = n as i32;
            counts[expert as usize] += 1;
        }
        let n = row_src.len();
        Ok(RoutingPlan {
            row_src: b.upload(HostData::I32(row_src), &[n])?,
            slot: b.upload(HostData::I32(local_slot), &[t_local, k])?,
            counts: b.upload(HostData::I32(counts), &[e])?,
        })
    }

    /// Runs the permuted rows `x: [N, D]` (expert-major over all E, `counts:
    /// [E]`) through the experts wherever they live; returns `[N, D]`.
    #[allow(clippy::type_complexity)]
    fn compute(
        &self,
        ctx: &Ctx<B>,
        x_nd: &Tensor<B>,
        counts_e: &Tensor<B>,
    ) -> Result<(Tensor<B>, Option<Exchange<B>>, Option<ExpertsSaved<B>>)> {
        let b = ctx.b;
        let rank = ctx.rank;
        let (ep, etp) = (rank.ep.size(), rank.etp.size());
        if ep == 1 && etp == 1 {
            let (y, saved) = self.experts.forward(b, x_nd, counts_e)?;
            return Ok((y, None, Some(saved)));
        }
        let e = self.spec.experts;
        let local = e / ep;
        let counts = b.download(counts_e)?.to_i32()?;
        let send_rows: Vec<usize> = (0..ep)
            .map(|j| {
                counts[j * local..(j + 1) * local]
                    .iter()
                    .map(|&c| c as usize)
                    .sum()
            })
            .collect();
        let (x_recv, recv_rows) = ctx.comm.all_to_all_v(b, &rank.ep, x_nd, &send_rows)?;
        // Every ep rank's counts [ep, E], then every etp member's [etp·ep, E].
        let counts_1e = b.upload(HostData::I32(counts), &[1, e])?;
        let mut all_counts = ctx.comm.all_gather(b, &rank.ep, &counts_1e)?;
        let x_block = if etp > 1 {
            all_counts = ctx.comm.all_gather(b, &rank.etp, &all_counts)?;
            ctx.comm.all_gather(b, &rank.etp, &x_recv)?
        } else {
            x_recv
        };
        let all_counts = b.download(&all_counts)?.to_i32()?;
        // Block (m, s) holds, for each local expert l in order, the rows that
        // ep rank s of etp member m sent to this ep rank.
        let first = rank.ep_index * local;
        let rows_of =
            |m: usize, s: usize, l: usize| all_counts[(m * ep + s) * e + first + l] as usize;
        let mut block_start = vec![0usize; etp * ep];
        let mut etp_rows = vec![0usize; etp];
        let mut offset = 0;
        for m in 0..etp {
            for s in 0..ep {
                block_start[m * ep + s] = offset;
                let n: usize = (0..local).map(|l| rows_of(m, s, l)).sum();
                offset += n;
                etp_rows[m] += n;
            }
        }
        if offset != x_block.shape()[0] {
            return Err(EngineError::Invalid(format!(
                "expert exchange: received {} rows but the exchanged counts add up to {offset}",
                x_block.shape()[0]
            )));
        }
        let mut order = Vec::with_capacity(offset);
        let mut group_sizes = vec![0i32; local];
        for (l, size) in group_sizes.iter_mut().enumerate() {
            for m in 0..etp {
                for s in 0..ep {
                    let start =
                        block_start[m * ep + s] + (0..l).map(|i| rows_of(m, s, i)).sum::<usize>();
                    let n = rows_of(m, s, l);
                    order.extend((start..start + n).map(|r| r as i32));
                    *size += n as i32;
                }
            }
        }
        let order = b.upload(HostData::I32(order), &[offset])?;
        let groups = b.upload(HostData::I32(group_sizes), &[local])?;
        let x_sorted = b.embedding(&x_block, &order)?;
        let (y_sorted, saved) = self.experts.forward(b, &x_sorted, &groups)?;
        let mut y_block = b.embedding_backward(&y_sorted, &order, offset)?;
        let exchange = Exchange {
            send_rows,
            recv_rows,
            etp_rows,
            order,
        };
        if etp > 1 {
            y_block = ctx.sum_over(&rank.etp, &y_block)?;
            y_block = own_rows(b, &y_block, &exchange.etp_rows, rank.etp_index)?;
        }
        let (y_nd, _) = ctx
            .comm
            .all_to_all_v(b, &rank.ep, &y_block, &exchange.recv_rows)?;
        Ok((y_nd, Some(exchange), Some(saved)))
    }

    /// Backward of [`Self::compute`]: `dy: [N, D]` → `dx: [N, D]`.
    fn compute_backward(
        &mut self,
        ctx: &Ctx<B>,
        dy_nd: &Tensor<B>,
        exchange: Option<Exchange<B>>,
        experts: Option<ExpertsSaved<B>>,
    ) -> Result<Tensor<B>> {
        let b = ctx.b;
        let rank = ctx.rank;
        let saved = experts.ok_or_else(|| {
            EngineError::Invalid("MoE backward: the experts' saved state is missing".into())
        })?;
        let Some(ex) = exchange else {
            return self.experts.backward(b, dy_nd, saved);
        };
        let (dy_recv, _) = ctx.comm.all_to_all_v(b, &rank.ep, dy_nd, &ex.send_rows)?;
        let dy_block = if rank.etp.size() > 1 {
            ctx.comm.all_gather(b, &rank.etp, &dy_recv)?
        } else {
            dy_recv
        };
        let rows = dy_block.shape()[0];
        let dy_sorted = b.embedding(&dy_block, &ex.order)?;
        let dx_sorted = self.experts.backward(b, &dy_sorted, saved)?;
        let mut dx_block = b.embedding_backward(&dx_sorted, &ex.order, rows)?;
        if rank.etp.size() > 1 {
            dx_block = ctx.sum_over(&rank.etp, &dx_block)?;
            dx_block = own_rows(b, &dx_block, &ex.etp_rows, rank.etp_index)?;
        }
        let (dx_nd, _) = ctx
            .comm
            .all_to_all_v(b, &rank.ep, &dx_block, &ex.recv_rows)?;
        Ok(dx_nd)
    }

    /// Parameters replicated over the expert mesh's data dimension: router
    /// and shared experts (dense: reduced like attention).
    pub fn visit_dense(&self, f: &mut dyn FnMut(&Param<B>)) {
        self.router.visit_params(f);
        if let Some(s) = &self.shared {
            s.visit_params(f);
        }
    }

    /// Mutable [`Self::visit_dense`].
    pub fn visit_dense_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        self.router.visit_params_mut(f);
        if let Some(s) = &mut self.shared {
            s.visit_params_mut(f);
        }
    }
}

/// Member `index`'s rows of a block made of consecutive per-member row counts.
fn own_rows<B: Backend>(b: &B, x: &Tensor<B>, rows: &[usize], index: usize) -> Result<Tensor<B>> {
    let start: usize = rows[..index].iter().sum();
    Ok(b.narrow(x, start, rows[index])?)
}
