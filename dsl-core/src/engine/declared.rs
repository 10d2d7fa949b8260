//! What a `#[moe_model]` declaration becomes at run time: the [`MoeModel`]
//! trait its expansion implements, the [`LayoutChoice`] trait of its generated
//! layout enum, and [`build`], the one place a declared model is checked
//! against its layout and built.
//!
//! A declared model is a thin typed wrapper around the engine's [`Model`] (one
//! rank's shard under one of its layouts, the whole model on one rank): the
//! math lives once, in the engine; the wrapper adds the compile-time spec,
//! the named layouts and typed access to each declared group of blocks.
//!
//! A crate that declares models depends on `foldmoe-core` (with its default
//! `engine` feature) and `foldmoe-macros`; the expansion names everything
//! through `::foldmoe_core::engine::declared::__private`, so the model crate
//! needs no direct dependency on the kernel crate.

use std::ops::Range;

use foldmoe_kernels::{Backend, DType, Tensor};

use super::block::{Attn, Block, Ffn};
use super::mlp::SwiGluMlp;
use super::model::{Batch, ForwardOut, Model, ModelSaved};
use super::moe::experts::Experts;
use super::moe::router::Router;
use super::moe::shared::SharedExperts;
use super::moe::MoeLayer;
use super::parallel::{Exec, RankLayout};
use super::param::Module;
use super::{EngineError, Result};
use crate::layout::{self, Layout, LayoutSpec};
use crate::spec::ModelSpec;

/// One of a declared model's named layouts, chosen without strings: the
/// macro generates an enum with one variant per `layout(name = ...)`.
pub trait LayoutChoice: Copy + Eq + std::fmt::Debug + 'static {
    /// Every declared layout, in declaration order.
    const ALL: &'static [Self];

    /// The layout's declared name (`"h100x1024"`).
    fn name(self) -> &'static str;

    /// The layout as the IR the layout rules check.
    fn spec(self) -> LayoutSpec;

    /// The layout declared as `name`; an error lists the declared names.
    fn by_name(name: &str) -> std::result::Result<Self, String> {
        Self::ALL
            .iter()
            .copied()
            .find(|l| l.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|l| l.name()).collect();
                format!(
                    "unknown layout `{name}`; declared layouts: {}",
                    names.join(", ")
                )
            })
    }
}

/// A model declared with `#[moe_model]`: its spec and layouts are fixed at
/// compile time (and were checked there by the same rules [`build`] applies);
/// the model itself is the engine's [`Model`], reached through
/// [`MoeModel::model`].
pub trait MoeModel<B: Backend>: Module<B> + Sized {
    /// The generated enum of the declared layouts.
    type Layout: LayoutChoice;

    /// The model's spec, built from the declaration (no lookup at run time).
    fn spec() -> ModelSpec;

    /// Every declared layout, in declaration order.
    fn layouts() -> Vec<LayoutSpec> {
        Self::Layout::ALL.iter().map(|l| l.spec()).collect()
    }

    /// Builds the shard rank `rank` owns under `layout` (any world size;
    /// the whole model for a one-rank layout), weights from `seed`: what the
    /// engine trains on that rank. See [`build`].
    fn new(b: &B, layout: Self::Layout, rank: usize, seed: u64, dtype: DType) -> Result<Self>;

    /// The engine model of this rank.
    fn model(&self) -> &Model<B>;

    /// The engine model, mutably (its backward, loaded weights).
    fn model_mut(&mut self) -> &mut Model<B>;

    /// The engine model by value (to train it, or generate, without the wrapper).
    fn into_model(self) -> Model<B>;

    /// Loss of a micro-batch; see [`Model::forward`].
    fn forward(
        &self,
        exec: &Exec<B>,
        batch: Batch<'_, B>,
        seq_len: usize,
    ) -> Result<ForwardOut<B>> {
        self.model().forward(exec, batch, seq_len)
    }

    /// Gradients of the forward that produced `saved`; see [`Model::backward`].
    fn backward(&mut self, exec: &Exec<B>, saved: ModelSaved<B>, loss_scale: f64) -> Result<()> {
        self.model_mut().backward(exec, saved, loss_scale)
    }

    /// Inference logits; see [`Model::logits`].
    fn logits(&self, exec: &Exec<B>, tokens: &[i32], seq_len: usize) -> Result<Tensor<B>> {
        self.model().logits(exec, tokens, seq_len)
    }
}

/// This rank's blocks of a declared dense group (`#[blocks(.., dense(..))]`):
/// what the group's accessor returns, with typed access to each block's
/// attention and MLP. On a pipeline stage without the group it is empty.
pub struct DenseGroup<'a, B: Backend> {
    blocks: &'a [Block<B>],
    mlps: Vec<&'a SwiGluMlp<B>>,
    first_layer: usize,
}

/// This rank's blocks of a declared MoE group (`#[blocks(.., moe(..))]`),
/// with typed access to each block's router, routed experts (the rank's
/// experts under ep) and shared experts.
pub struct MoeGroup<'a, B: Backend> {
    blocks: &'a [Block<B>],
    moes: Vec<&'a MoeLayer<B>>,
    first_layer: usize,
}

impl<'a, B: Backend> DenseGroup<'a, B> {
    /// The group `layers` (full-model indices) of `model`, as this rank holds it.
    pub fn of(model: &'a Model<B>, layers: Range<usize>) -> Self {
        let blocks = model.blocks_of_layers(layers.clone());
        let first_layer = first_held_layer(model, &layers, blocks.len());
        let mlps = blocks
            .iter()
            .filter_map(|blk| match &blk.ffn {
                Ffn::Dense(mlp) => Some(&**mlp),
                Ffn::Moe(_) => None,
            })
            .collect();
        DenseGroup {
            blocks,
            mlps,
            first_layer,
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

    /// The full model's layer index of this rank's first block of the group.
    pub fn first_layer(&self) -> usize {
        self.first_layer
    }

    /// The blocks themselves.
    pub fn blocks(&self) -> &'a [Block<B>] {
        self.blocks
    }

    /// Block `i`'s attention.
    pub fn attention(&self, i: usize) -> Option<&'a Attn<B>> {
        self.blocks.get(i).map(|blk| &blk.attn)
    }

    /// Block `i`'s dense MLP.
    pub fn mlp(&self, i: usize) -> Option<&'a SwiGluMlp<B>> {
        self.mlps.get(i).copied()
    }
}

impl<'a, B: Backend> MoeGroup<'a, B> {
    /// The group `layers` (full-model indices) of `model`, as this rank holds it.
    pub fn of(model: &'a Model<B>, layers: Range<usize>) -> Self {
        let blocks = model.blocks_of_layers(layers.clone());
        let first_layer = first_held_layer(model, &layers, blocks.len());
        let moes = blocks.iter().filter_map(|blk| blk.moe()).collect();
        MoeGroup {
            blocks,
            moes,
            first_layer,
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

    /// The full model's layer index of this rank's first block of the group.
    pub fn first_layer(&self) -> usize {
        self.first_layer
    }

    /// The blocks themselves.
    pub fn blocks(&self) -> &'a [Block<B>] {
        self.blocks
    }

    /// Block `i`'s attention.
    pub fn attention(&self, i: usize) -> Option<&'a Attn<B>> {
        self.blocks.get(i).map(|blk| &blk.attn)
    }

    /// Block `i`'s MoE layer.
    pub fn moe(&self, i: usize) -> Option<&'a MoeLayer<B>> {
        self.moes.get(i).copied()
    }

    /// Block `i`'s router (replicated on every rank).
    pub fn router(&self, i: usize) -> Option<&'a Router<B>> {
        self.moe(i).map(|m| &m.router)
    }

    /// Block `i`'s routed experts: this rank's `E/ep`, their ffn split over etp.
    pub fn experts(&self, i: usize) -> Option<&'a Experts<B>> {
        self.moe(i).map(|m| &m.experts)
    }

    /// Block `i`'s shared experts, when the group has them.
    pub fn shared_experts(&self, i: usize) -> Option<&'a SharedExperts<B>> {
        self.moe(i).and_then(|m| m.shared.as_ref())
    }
}

/// The full-model index of the first of `held` blocks of `layers` on this rank.
fn first_held_layer<B: Backend>(model: &Model<B>, layers: &Range<usize>, held: usize) -> usize {
    model
        .global_layers()
        .iter()
        .copied()
        .find(|l| layers.contains(l))
        .filter(|_| held > 0)
        .unwrap_or(layers.start)
}

/// The models a binary knows by name: what `foldmoe::cli::main` serves
/// (`train --model NAME`, `plan`, `bench`, ...). Built from declared model
/// types (`foldmoe::models![Tiny, MyMoe]`); the first is the default. The
/// only place a model is looked up by its name.
#[derive(Clone, Debug)]
pub struct Registry {
    entries: Vec<RegistryEntry>,
}

/// One model of a [`Registry`]: its declared name and declaration.
#[derive(Clone, Debug)]
pub struct RegistryEntry {
    /// The declared `name = "..."`.
    pub name: String,
    spec: fn() -> ModelSpec,
    layouts: fn() -> Vec<LayoutSpec>,
}

impl Registry {
    /// A registry of `entries` (see [`Registry::entry`]), in order.
    pub fn new(entries: Vec<RegistryEntry>) -> Self {
        Registry { entries }
    }

    /// The entry of declared model `M` (any backend names its declaration;
    /// the spec does not depend on it).
    pub fn entry<M: MoeModel<foldmoe_kernels::cpu::Cpu>>() -> RegistryEntry {
        RegistryEntry {
            name: M::spec().name,
            spec: M::spec,
            layouts: M::layouts,
        }
    }

    /// The names, in registration order.
    pub fn names(&self) -> Vec<&str> {
        self.entries.iter().map(|e| e.name.as_str()).collect()
    }

    /// The first model's name: the default of `train`; `None` when empty.
    pub fn default_name(&self) -> Option<&str> {
        self.entries.first().map(|e| e.name.as_str())
    }

    /// A model's spec by name; an error lists the known names.
    pub fn spec(&self, name: &str) -> std::result::Result<ModelSpec, String> {
        self.find(name).map(|e| (e.spec)())
    }

    /// A model's spec and declared layouts by name; an error lists the
    /// known names.
    pub fn layouts(&self, name: &str) -> std::result::Result<(ModelSpec, Vec<LayoutSpec>), String> {
        self.find(name).map(|e| ((e.spec)(), (e.layouts)()))
    }

    fn find(&self, name: &str) -> std::result::Result<&RegistryEntry, String> {
        self.entries.iter().find(|e| e.name == name).ok_or_else(|| {
            format!(
                "unknown model `{name}`; known models: {}",
                self.names().join(", ")
            )
        })
    }
}

/// Checks `layout` against `spec` with the same rules the macro ran at compile
/// time (a spec or layout built by hand, or changed since, is caught here) and
/// builds the shard rank `rank` owns, shard first: the rank draws only its
/// blocks of the weights one rank would draw from `seed` (see [`Model::new`]).
pub fn build<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    layout: &LayoutSpec,
    rank: usize,
    seed: u64,
    dtype: DType,
) -> Result<Model<B>> {
    let checked = checked_layout(spec, layout, rank)?;
    let rank_layout = RankLayout::new(&checked, rank)?;
    Model::new(b, spec, rank_layout, seed, dtype)
}

/// The spec and layout checked (every rule, every violation in the error)
/// and `rank` inside the layout's world.
fn checked_layout(spec: &ModelSpec, layout: &LayoutSpec, rank: usize) -> Result<Layout> {
    spec.check().map_err(EngineError::Spec)?;
    let checked = layout::check(layout, spec).map_err(|errs| {
        let text: Vec<String> = errs
            .iter()
            .map(|e| format!("{}: {}", e.field, e.message))
            .collect();
        EngineError::Invalid(format!(
            "layout `{}` of model `{}` is invalid: {}",
            layout.name,
            spec.name,
            text.join("; ")
        ))
    })?;
    if rank >= layout.world {
        return Err(EngineError::Invalid(format!(
            "rank {rank} is outside layout `{}` (world = {}); choose a rank in 0..{}",
            layout.name, layout.world, layout.world
        )));
    }
    Ok(checked)
}

/// Names the expansion of `#[moe_model]` refers to; not a public API.
#[doc(hidden)]
pub mod __private {
    pub use super::{build, DenseGroup, LayoutChoice, MoeGroup, MoeModel, Registry};
    pub use crate::engine::block::Block;
    pub use crate::engine::model::Model;
    pub use crate::engine::param::{Module, Param};
    pub use crate::engine::Result;
    pub use crate::layout::LayoutSpec;
    pub use crate::spec::*;
    pub use foldmoe_kernels::{Backend, DType};
    pub use std::string::String;
    pub use std::vec::Vec;
}
