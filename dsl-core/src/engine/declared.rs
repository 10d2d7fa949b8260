//! What a `#[moe_model]` declaration becomes at run time: the [`MoeModel`]
//! trait its expansion implements, the [`LayoutChoice`] trait of its generated
//! layout enum, and [`build`], the one place a declared model is checked
//! against its layout and built.
//!
//! A declared model is a thin typed wrapper around the engine's [`Model`]: the
//! math lives once, in `model.rs`; the wrapper adds the compile-time spec, the
//! named layouts and typed access to each declared group of blocks.
//!
//! A crate that declares models depends on `foldmoe-core` (with its default
//! `engine` feature) and `foldmoe-macros`; the expansion names everything
//! through `::foldmoe_core::engine::declared::__private`, so the model crate
//! needs no direct dependency on the kernel crate.

use foldmoe_kernels::{Backend, DType, Tensor};

use super::model::{ForwardOut, Model, ModelSaved};
use super::parallel::{ParallelModel, RankLayout};
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

    /// Builds rank `rank` of the model under `layout`, weights from `seed`.
    fn new(b: &B, layout: Self::Layout, rank: usize, seed: u64, dtype: DType) -> Result<Self>;

    /// The shard that rank `rank` owns under `layout` (any world size),
    /// weights from `seed`: what the parallel runtime trains on that rank.
    fn shard(
        b: &B,
        layout: Self::Layout,
        rank: usize,
        seed: u64,
        dtype: DType,
    ) -> Result<ParallelModel<B>> {
        build_shard(b, &Self::spec(), &layout.spec(), rank, seed, dtype)
    }

    /// The engine model.
    fn model(&self) -> &Model<B>;

    /// The engine model, mutably (its backward, loaded weights).
    fn model_mut(&mut self) -> &mut Model<B>;

    /// The engine model by value (its forward and backward, or generation,
    /// without the wrapper).
    fn into_model(self) -> Model<B>;

    /// Loss of a batch; see [`Model::forward`].
    fn forward(
        &self,
        b: &B,
        tokens_bs: &Tensor<B>,
        targets_bs: &Tensor<B>,
    ) -> Result<ForwardOut<B>> {
        self.model().forward(b, tokens_bs, targets_bs)
    }

    /// Gradients of the forward that produced `saved`; see [`Model::backward`].
    fn backward(&mut self, b: &B, saved: ModelSaved<B>, loss_scale: f64) -> Result<()> {
        self.model_mut().backward(b, saved, loss_scale)
    }

    /// Inference logits; see [`Model::logits`].
    fn logits(&self, b: &B, tokens_bs: &Tensor<B>) -> Result<Tensor<B>> {
        self.model().logits(b, tokens_bs)
    }
}

/// Checks `layout` against `spec` with the same rules the macro ran at compile
/// time (a spec or layout built by hand, or changed since, is caught here) and
/// builds the whole model for a one-rank layout.
///
/// A layout with `world > 1` is an error pointing at [`build_shard`]: a rank
/// of a parallel layout holds a shard, not the whole model.
pub fn build<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    layout: &LayoutSpec,
    rank: usize,
    seed: u64,
    dtype: DType,
) -> Result<Model<B>> {
    checked_layout(spec, layout, rank)?;
    if layout.world > 1 {
        return Err(EngineError::Invalid(format!(
            "layout `{}` spans world = {} ranks: rank {rank} holds a shard of the model, built \
             by `MoeModel::shard` (or `build_shard`) and trained by the Parallel Folding runtime",
            layout.name, layout.world
        )));
    }
    Model::new(b, spec, seed, dtype)
}

/// Checks `layout` against `spec` like [`build`] and builds the shard rank
/// `rank` owns, shard first: the rank draws only its blocks of the weights
/// one rank would draw from `seed` (see [`ParallelModel::new`]).
pub fn build_shard<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    layout: &LayoutSpec,
    rank: usize,
    seed: u64,
    dtype: DType,
) -> Result<ParallelModel<B>> {
    let checked = checked_layout(spec, layout, rank)?;
    let rank_layout = RankLayout::new(&checked, rank)?;
    ParallelModel::new(b, spec, rank_layout, seed, dtype)
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
    pub use super::{build, build_shard, LayoutChoice, MoeModel};
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
