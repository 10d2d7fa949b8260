//! A declared group of blocks (`#[blocks(...)]`, one [`crate::spec::BlockGroup`])
//! as one rank holds it: the engine's [`super::model::Model`] owns its blocks
//! group by group, and a `#[moe_model]` struct's fields are these groups.
//!
//! [`GroupBlocks`] is what every group has (its blocks, their full-model
//! layer indices, the declared layer range); [`DenseGroup`] and [`MoeGroup`]
//! add typed access to what their feed-forward is. On a rank that holds
//! none of the group (a pipeline stage without it) the group is empty.

use std::ops::{Deref, DerefMut, Range};

use foldmoe_kernels::Backend;

use super::block::{Attn, Block, Ffn};
use super::mlp::SwiGluMlp;
use super::moe::experts::Experts;
use super::moe::router::Router;
use super::moe::shared::SharedExperts;
use super::moe::MoeLayer;
use super::param::{Module, Param};

/// The blocks of one declared group that this rank holds, in layer order.
pub struct GroupBlocks<B: Backend> {
    blocks: Vec<Block<B>>,
    /// The full model's layer index of each of `blocks`.
    layers: Vec<usize>,
    /// The group's layers in the full model (`start..start + count`).
    declared: Range<usize>,
}

impl<B: Backend> GroupBlocks<B> {
    fn new(blocks: Vec<Block<B>>, layers: Vec<usize>, declared: Range<usize>) -> Self {
        debug_assert_eq!(blocks.len(), layers.len());
        GroupBlocks {
            blocks,
            layers,
            declared,
        }
    }

    /// Blocks this rank holds.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether this rank holds none of the group.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The full model's layer index of this rank's first block of the group
    /// (the group's first layer when the rank holds none).
    pub fn first_layer(&self) -> usize {
        self.layers.first().copied().unwrap_or(self.declared.start)
    }

    /// The full model's layer index of each block this rank holds.
    pub fn layers(&self) -> &[usize] {
        &self.layers
    }

    /// The group's layers in the full model, as declared.
    pub fn declared_layers(&self) -> Range<usize> {
        self.declared.clone()
    }

    /// The blocks themselves.
    pub fn blocks(&self) -> &[Block<B>] {
        &self.blocks
    }

    /// The blocks, mutably (their weights; the group's shape is fixed).
    pub fn blocks_mut(&mut self) -> &mut [Block<B>] {
        &mut self.blocks
    }

    /// Block `i`'s attention.
    pub fn attention(&self, i: usize) -> Option<&Attn<B>> {
        self.blocks.get(i).map(|blk| &blk.attn)
    }

    /// Block `i`'s attention, mutably.
    pub fn attention_mut(&mut self, i: usize) -> Option<&mut Attn<B>> {
        self.blocks.get_mut(i).map(|blk| &mut blk.attn)
    }
}

impl<B: Backend> GroupBlocks<B> {
    /// No blocks: what a struct's field holds while its engine model has the group.
    fn empty() -> Self {
        GroupBlocks::new(Vec::new(), Vec::new(), 0..0)
    }
}

impl<B: Backend> Module<B> for GroupBlocks<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        for block in &self.blocks {
            block.visit_params(f);
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        for block in &mut self.blocks {
            block.visit_params_mut(f);
        }
    }
}

/// A declared dense group (`#[blocks(.., dense(..))]`): its blocks' MLPs are
/// dense SwiGLU shards.
pub struct DenseGroup<B: Backend>(GroupBlocks<B>);

/// A declared MoE group (`#[blocks(.., moe(..))]`): each block's router
/// (replicated on every rank), routed experts (this rank's `E/ep`, their ffn
/// split over etp) and shared experts.
pub struct MoeGroup<B: Backend>(GroupBlocks<B>);

impl<B: Backend> Deref for DenseGroup<B> {
    type Target = GroupBlocks<B>;
    fn deref(&self) -> &GroupBlocks<B> {
        &self.0
    }
}

impl<B: Backend> DerefMut for DenseGroup<B> {
    fn deref_mut(&mut self) -> &mut GroupBlocks<B> {
        &mut self.0
    }
}

impl<B: Backend> Deref for MoeGroup<B> {
    type Target = GroupBlocks<B>;
    fn deref(&self) -> &GroupBlocks<B> {
        &self.0
    }
}

impl<B: Backend> DerefMut for MoeGroup<B> {
    fn deref_mut(&mut self) -> &mut GroupBlocks<B> {
        &mut self.0
    }
}

impl<B: Backend> DenseGroup<B> {
    /// A placeholder with no blocks.
    pub(crate) fn empty() -> Self {
        DenseGroup(GroupBlocks::empty())
    }

    /// Block `i`'s dense MLP.
    pub fn mlp(&self, i: usize) -> Option<&SwiGluMlp<B>> {
        match &self.0.blocks.get(i)?.ffn {
            Ffn::Dense(mlp) => Some(&**mlp),
            Ffn::Moe(_) => None,
        }
    }

    /// Block `i`'s dense MLP, mutably.
    pub fn mlp_mut(&mut self, i: usize) -> Option<&mut SwiGluMlp<B>> {
        match &mut self.0.blocks.get_mut(i)?.ffn {
            Ffn::Dense(mlp) => Some(&mut **mlp),
            Ffn::Moe(_) => None,
        }
    }
}

impl<B: Backend> MoeGroup<B> {
    /// A placeholder with no blocks.
    pub(crate) fn empty() -> Self {
        MoeGroup(GroupBlocks::empty())
    }

    /// Block `i`'s MoE layer.
    pub fn moe(&self, i: usize) -> Option<&MoeLayer<B>> {
        self.0.blocks.get(i)?.moe()
    }

    /// Block `i`'s MoE layer, mutably.
    pub fn moe_mut(&mut self, i: usize) -> Option<&mut MoeLayer<B>> {
        self.0.blocks.get_mut(i)?.moe_mut()
    }

    /// Block `i`'s router.
    pub fn router(&self, i: usize) -> Option<&Router<B>> {
        self.moe(i).map(|m| &m.router)
    }

    /// Block `i`'s router, mutably.
    pub fn router_mut(&mut self, i: usize) -> Option<&mut Router<B>> {
        self.moe_mut(i).map(|m| &mut m.router)
    }

    /// Block `i`'s routed experts: this rank's `E/ep`, their ffn split over etp.
    pub fn experts(&self, i: usize) -> Option<&Experts<B>> {
        self.moe(i).map(|m| &m.experts)
    }

    /// Block `i`'s routed experts, mutably.
    pub fn experts_mut(&mut self, i: usize) -> Option<&mut Experts<B>> {
        self.moe_mut(i).map(|m| &mut m.experts)
    }

    /// Block `i`'s shared experts, when the group has them.
    pub fn shared_experts(&self, i: usize) -> Option<&SharedExperts<B>> {
        self.moe(i).and_then(|m| m.shared.as_ref())
    }

    /// Block `i`'s shared experts, mutably.
    pub fn shared_experts_mut(&mut self, i: usize) -> Option<&mut SharedExperts<B>> {
        self.moe_mut(i).and_then(|m| m.shared.as_mut())
    }
}

/// One declared group as the engine's model owns it.
pub enum Group<B: Backend> {
    /// A dense group.
    Dense(DenseGroup<B>),
    /// An MoE group.
    Moe(MoeGroup<B>),
}

impl<B: Backend> Group<B> {
    /// The group of `blocks` (full-model layers `layers`, each block's ffn
    /// of the group's kind) declared over `declared`; `moe` says which kind.
    pub(crate) fn new(
        moe: bool,
        blocks: Vec<Block<B>>,
        layers: Vec<usize>,
        declared: Range<usize>,
    ) -> Self {
        let core = GroupBlocks::new(blocks, layers, declared);
        if moe {
            Group::Moe(MoeGroup(core))
        } else {
            Group::Dense(DenseGroup(core))
        }
    }

    /// What every group has.
    pub fn blocks(&self) -> &GroupBlocks<B> {
        match self {
            Group::Dense(g) => g,
            Group::Moe(g) => g,
        }
    }

    pub(crate) fn blocks_mut(&mut self) -> &mut GroupBlocks<B> {
        match self {
            Group::Dense(g) => g,
            Group::Moe(g) => g,
        }
    }

    /// `"dense"` or `"MoE"`, for errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Group::Dense(_) => "dense",
            Group::Moe(_) => "MoE",
        }
    }
}
