//! The user's declaration as a typed tree: the struct with its group fields
//! (keeping the syn nodes, for spans), and the [`Decl`] the attributes parse
//! into — the IR values plus, for every key written, where it was written.

use std::collections::HashMap;

use foldmoe_core::layout::LayoutSpec;
use foldmoe_core::spec::ModelSpec;
use proc_macro2::{Ident, Span};
use syn::{Attribute, Fields, ItemStruct, Type, Visibility};

use crate::attr::kw;
use crate::ctxt::Ctxt;

/// The annotated struct.
pub struct Container<'a> {
    /// The struct's name.
    pub ident: &'a Ident,
    /// Its visibility, given to the generated struct and layout enum.
    pub vis: &'a Visibility,
    /// Its attributes other than `#[moe_model]` (doc comments, derives...).
    pub attrs: &'a [Attribute],
    /// One group of blocks per field, in order.
    pub groups: Vec<GroupField<'a>>,
}

/// One field: a group of identical blocks.
pub struct GroupField<'a> {
    /// The field name, which names the generated accessor.
    pub ident: &'a Ident,
    /// The field's visibility, given to the accessor.
    pub vis: &'a Visibility,
    /// The field's doc comments, given to the accessor.
    pub docs: Vec<&'a Attribute>,
    /// The `#[blocks(...)]` attribute (absent: already reported).
    pub blocks: Option<&'a Attribute>,
}

/// Names the expansion defines on the model type; a group accessor with one
/// of these names would shadow them.
const RESERVED: &[&str] = &[
    "model",
    "model_mut",
    "into_model",
    "new",
    "spec",
    "layouts",
    "forward",
    "backward",
    "logits",
    "visit_params",
    "visit_params_mut",
];

impl<'a> Container<'a> {
    /// Reads the struct's shape; `None` when it is not a struct with named
    /// fields and no generics (then only a fallback item is emitted).
    pub fn from_item(cx: &Ctxt, item: &'a ItemStruct) -> Option<Self> {
        if !item.generics.params.is_empty() || item.generics.where_clause.is_some() {
            cx.error(
                span_of(&item.generics),
                "a #[moe_model] struct takes no generics; the macro adds the backend parameter `B`",
            );
            return None;
        }
        let Fields::Named(fields) = &item.fields else {
            cx.error(
                item.ident.span(),
                "#[moe_model] needs a struct with named fields, one per group of blocks: \
                 `dense: Blocks, moe: Blocks`",
            );
            return None;
        };
        let mut groups = Vec::new();
        for field in &fields.named {
            let Some(ident) = field.ident.as_ref() else {
                continue;
            };
            if RESERVED.contains(&ident.to_string().as_str()) {
                cx.error(
                    ident.span(),
                    format!("the group name `{ident}` is taken by the model's own methods; rename the field"),
                );
            }
            check_placeholder_type(cx, &field.ty);
            let mut blocks = None;
            let mut docs = Vec::new();
            for a in &field.attrs {
                if a.path().is_ident(kw::BLOCKS) {
                    if blocks.is_some() {
                        cx.error(
                            span_of(a),
                            "duplicate #[blocks(...)] on one field; merge them",
                        );
                    } else {
                        blocks = Some(a);
                    }
                } else if a.path().is_ident("doc") {
                    docs.push(a);
                } else {
                    cx.error(
                        span_of(a),
                        "a group field takes only #[blocks(...)] and doc comments",
                    );
                }
            }
            if blocks.is_none() {
                cx.error(
                    ident.span(),
                    format!("field `{ident}` needs #[blocks(count = .., attention(..), dense(..) or moe(..))]"),
                );
            }
            groups.push(GroupField {
                ident,
                vis: &field.vis,
                docs,
                blocks,
            });
        }
        Some(Container {
            ident: &item.ident,
            vis: &item.vis,
            attrs: &item.attrs,
            groups,
        })
    }
}

/// Group fields are written `name: Blocks`: the type is a placeholder that the
/// expansion replaces, so any other type is a misunderstanding worth naming.
fn check_placeholder_type(cx: &Ctxt, ty: &Type) {
    let ok = matches!(ty, Type::Path(p) if p.qself.is_none() && p.path.is_ident(kw::BLOCKS_TYPE));
    if !ok {
        cx.error(
            span_of(ty),
            "a group field has the placeholder type `Blocks`; the macro replaces it with \
             the group's typed blocks (`DenseGroup<B>` or `MoeGroup<B>`)",
        );
    }
}

/// The span of a whole syntax node (its first token's, joined when possible).
pub fn span_of(node: &impl quote::ToTokens) -> Span {
    let mut iter = node.to_token_stream().into_iter();
    let Some(first) = iter.next() else {
        return Span::call_site();
    };
    let start = first.span();
    iter.last()
        .and_then(|last| start.join(last.span()))
        .unwrap_or(start)
}

/// What the attributes say, as the IR the rules check.
pub struct Decl {
    /// The model.
    pub spec: ModelSpec,
    /// The named layouts, in order.
    pub layouts: Vec<LayoutDecl>,
    /// Where each key was written.
    pub spans: Spans,
}

/// One `layout(...)`.
pub struct LayoutDecl {
    /// The layout as the IR.
    pub spec: LayoutSpec,
    /// The keys written, so the expansion sets exactly those and leaves the
    /// rest to `LayoutSpec::default()`.
    pub given: Vec<&'static str>,
    /// The variant of the generated layout enum (`None`: the name was unusable).
    pub variant: Option<Ident>,
}

/// Spans of the keys written, by their path in the IR (`groups[1].moe.top_k`,
/// `layouts[0].ep`): the paths the rules blame.
#[derive(Default)]
pub struct Spans {
    map: HashMap<String, Span>,
    /// Blamed when nothing nearer was written: the `#[moe_model]` attribute.
    pub root: Option<Span>,
}

impl Spans {
    /// Records that `path` was written at `span` (the first record wins).
    pub fn insert(&mut self, path: String, span: Span) {
        self.map.entry(path).or_insert(span);
    }

    /// The span of `path`, or of the nearest enclosing path that was written
    /// (`groups[1].moe.router.pre_softmax` → `groups[1].moe`), or the root.
    pub fn find(&self, path: &str) -> Span {
        let mut p = path;
        loop {
            if let Some(s) = self.map.get(p) {
                return *s;
            }
            match p.rfind(['.', '[']) {
                Some(i) if i > 0 => p = &p[..i],
                _ => return self.root.unwrap_or_else(Span::call_site),
            }
        }
    }
}
