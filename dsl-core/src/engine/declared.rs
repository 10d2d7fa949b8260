//! What a `#[moe_model]` declaration becomes at run time: the [`MoeModel`]
//! trait its expansion implements, the [`LayoutChoice`] trait of its generated
//! layout enum, and [`build`], the one place a declared model is checked
//! against its layout and built.
//!
//! A declared model is the engine's [`Model`] (one rank's shard under one of
//! its layouts, the whole model on one rank) with its groups of blocks as
//! typed fields ([`DenseGroup`], [`MoeGroup`]): the math lives once, in the
//! engine; the struct adds the compile-time spec, the named layouts and the
//! groups by name.
//!
//! A crate that declares models depends on `foldmoe-core` (with its default
//! `engine` feature) and `foldmoe-macros`; the expansion names everything
//! through `::foldmoe_core::engine::declared::__private`, so the model crate
//! needs no direct dependency on the kernel crate.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use foldmoe_kernels::{Backend, DType, Tensor};

use super::group::Group;
pub use super::group::{DenseGroup, GroupBlocks, MoeGroup};
use super::model::{Batch, ForwardOut, Model, ModelSaved};
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
/// compile time (and were checked there by the same rules [`build`] applies).
/// The struct owns this rank's part of each declared group as a field
/// ([`DenseGroup`] or [`MoeGroup`]); the rest of the engine's [`Model`]
/// (embedding, head, MTP) it keeps inside. [`MoeModel::model`] lends the
/// whole engine model, [`MoeModel::into_model`] gives it up to train.
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
    fn new(b: &B, layout: Self::Layout, rank: usize, seed: u64, dtype: DType) -> Result<Self> {
        let model = build(b, &Self::spec(), &layout.spec(), rank, seed, dtype)?;
        Self::from_model(model)
    }

    /// The declared struct over an engine model of its spec (one [`build`]
    /// made, or a loaded one): the model's groups move into the fields. An
    /// error names the difference when the model is of another spec.
    fn from_model(model: Model<B>) -> Result<Self>;

    /// The engine model, the fields' groups moved back into it (to train
    /// it, or generate, without the wrapper).
    fn into_model(self) -> Model<B>;

    /// The whole engine model, lent: the groups join it until the guard drops.
    fn model(&mut self) -> ModelGuard<'_, B, Self> {
        self.join_groups();
        ModelGuard {
            owner: self,
            _backend: PhantomData,
        }
    }

    /// Moves the fields' groups into the engine model (what [`Self::model`] lends).
    #[doc(hidden)]
    fn join_groups(&mut self);

    /// Moves them back into the fields.
    #[doc(hidden)]
    fn split_groups(&mut self);

    /// The engine model the struct keeps (without its groups unless joined).
    #[doc(hidden)]
    fn engine(&self) -> &Model<B>;

    /// Mutable [`Self::engine`].
    #[doc(hidden)]
    fn engine_mut(&mut self) -> &mut Model<B>;

    /// Loss of a micro-batch; see [`Model::forward`].
    fn forward(
        &mut self,
        exec: &Exec<B>,
        batch: Batch<'_, B>,
        seq_len: usize,
    ) -> Result<ForwardOut<B>> {
        self.model().forward(exec, batch, seq_len)
    }

    /// Gradients of the forward that produced `saved`; see [`Model::backward`].
    fn backward(&mut self, exec: &Exec<B>, saved: ModelSaved<B>, loss_scale: f64) -> Result<()> {
        self.model().backward(exec, saved, loss_scale)
    }

    /// Inference logits; see [`Model::logits`].
    fn logits(&mut self, exec: &Exec<B>, tokens: &[i32], seq_len: usize) -> Result<Tensor<B>> {
        self.model().logits(exec, tokens, seq_len)
    }
}

/// The engine model of a declared struct, lent by [`MoeModel::model`]; when
/// it drops, the groups go back to the struct's fields.
pub struct ModelGuard<'a, B: Backend, M: MoeModel<B>> {
    owner: &'a mut M,
    _backend: PhantomData<B>,
}

impl<B: Backend, M: MoeModel<B>> Deref for ModelGuard<'_, B, M> {
    type Target = Model<B>;
    fn deref(&self) -> &Model<B> {
        self.owner.engine()
    }
}

impl<B: Backend, M: MoeModel<B>> DerefMut for ModelGuard<'_, B, M> {
    fn deref_mut(&mut self) -> &mut Model<B> {
        self.owner.engine_mut()
    }
}

impl<B: Backend, M: MoeModel<B>> Drop for ModelGuard<'_, B, M> {
    fn drop(&mut self) {
        self.owner.split_groups();
    }
}

/// The groups of an engine model handed out to a declared struct's fields
/// in declaration order, each checked to be of its field's kind.
#[doc(hidden)]
pub struct GroupFields<B: Backend> {
    model: String,
    groups: std::vec::IntoIter<Group<B>>,
    next: usize,
}

impl<B: Backend> GroupFields<B> {
    /// The groups of `model`, taken out of it; `declared` is the struct's
    /// spec, which the model's must equal.
    pub fn take(model: &mut Model<B>, declared: &ModelSpec) -> Result<Self> {
        if model.spec != *declared {
            return Err(EngineError::Invalid(format!(
                "the engine model is of spec `{}` ({} blocks), not the declared `{}` ({} blocks)",
                model.spec.name,
                model.spec.layers(),
                declared.name,
                declared.layers()
            )));
        }
        Ok(GroupFields {
            model: declared.name.clone(),
            groups: model.take_groups().into_iter(),
            next: 0,
        })
    }

    /// The next group, for field `field` of kind `G`.
    pub fn next<G: GroupField<B>>(&mut self, field: &str) -> Result<G> {
        let index = self.next;
        self.next += 1;
        match self.groups.next() {
            Some(group) => G::from_group(group).map_err(|group| {
                EngineError::Invalid(format!(
                    "model `{}`: field `{field}` is a {} group but the engine model's group                      {index} is {}",
                    self.model,
                    G::KIND,
                    group.kind()
                ))
            }),
            None => Err(EngineError::Invalid(format!(
                "model `{}`: field `{field}` is group {index} but the engine model has {index} groups",
                self.model
            ))),
        }
    }
}

/// A declared group's field type: [`DenseGroup`] or [`MoeGroup`].
#[doc(hidden)]
pub trait GroupField<B: Backend>: Sized {
    /// `"dense"` or `"MoE"`.
    const KIND: &'static str;
    /// The group if it is of this kind, else the group back.
    fn from_group(group: Group<B>) -> std::result::Result<Self, Group<B>>;
    /// The group as the engine model holds it.
    fn into_group(self) -> Group<B>;
    /// Moves the group out, leaving an empty one (while the model holds it).
    fn take(&mut self) -> Group<B>;
}

impl<B: Backend> GroupField<B> for DenseGroup<B> {
    const KIND: &'static str = "dense";
    fn from_group(group: Group<B>) -> std::result::Result<Self, Group<B>> {
        match group {
            Group::Dense(g) => Ok(g),
            other => Err(other),
        }
    }
    fn into_group(self) -> Group<B> {
        Group::Dense(self)
    }
    fn take(&mut self) -> Group<B> {
        Group::Dense(std::mem::replace(self, DenseGroup::empty()))
    }
}

impl<B: Backend> GroupField<B> for MoeGroup<B> {
    const KIND: &'static str = "MoE";
    fn from_group(group: Group<B>) -> std::result::Result<Self, Group<B>> {
        match group {
            Group::Moe(g) => Ok(g),
            other => Err(other),
        }
    }
    fn into_group(self) -> Group<B> {
        Group::Moe(self)
    }
    fn take(&mut self) -> Group<B> {
        Group::Moe(std::mem::replace(self, MoeGroup::empty()))
    }
}

/// Gives a declared struct's fields their groups back from its engine model
/// after [`MoeModel::join_groups`]; the groups are those it moved in, in
/// order, so a mismatch is a bug in the caller (a hidden API used by hand).
#[doc(hidden)]
pub fn split_back<B: Backend, G: GroupField<B>>(
    groups: &mut std::vec::IntoIter<Group<B>>,
    field: &mut G,
) {
    match groups.next().map(G::from_group) {
        Some(Ok(group)) => *field = group,
        _ => panic!("a declared model's groups were changed while its engine model was lent"),
    }
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
    pub use super::{
        build, split_back, DenseGroup, GroupField, GroupFields, LayoutChoice, MoeGroup, MoeModel,
        Registry,
    };
    pub use crate::engine::model::Model;
    pub use crate::engine::param::{Module, Param};
    pub use crate::engine::Result;
    pub use crate::layout::LayoutSpec;
    pub use crate::spec::*;
    pub use foldmoe_kernels::{Backend, DType};
    pub use std::string::String;
    pub use std::vec::Vec;
}
