//! The expansion: the struct becomes `Name<B: Backend>` wrapping the engine's
//! model, with an enum of its named layouts, an accessor per group, and the
//! `MoeModel` and `Module` impls. The spec is emitted as a struct literal, so
//! `spec()` builds it without any lookup at run time.
//!
//! Everything is named through `::foldmoe_core::engine::declared::__private`,
//! so a model crate needs only `foldmoe-core` (engine feature) and this crate.

use foldmoe_core::layout::LayoutSpec;
use foldmoe_core::spec::{
    AttentionSpec, BlockGroup, CapacitySpec, DropPolicySpec, FfnSpec, GemmPrecision, LoadBalance,
    MlaSpec, ModelSpec, MoeSpec, OffloadPart, Policy, RecomputePart, RouterDtype, RouterSpec,
    ScoreFunction,
};
use proc_macro2::{Literal, Span, TokenStream};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::ItemStruct;

use crate::ast::{Container, Decl, LayoutDecl};
use crate::ctxt::Ctxt;
use crate::{attr, check};

/// The attribute's entry point: parse, check, expand; errors are collected
/// and emitted together with the expansion (or a fallback item).
pub fn moe_model(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item: ItemStruct = match syn::parse2(item.clone()) {
        Ok(i) => i,
        Err(_) => {
            let err = syn::Error::new(
                Span::call_site(),
                "#[moe_model] goes on a struct whose fields are groups of blocks",
            );
            let err = err.to_compile_error();
            return quote!(#item #err);
        }
    };
    let cx = Ctxt::new();
    let (krate, attr) = split_crate_path(&cx, attr);
    let tokens = match Container::from_item(&cx, &item) {
        Some(c) => {
            let decl = attr::parse(&cx, attr, &c);
            // Rules run on a declaration that parsed cleanly: a missing or
            // mistyped key would otherwise come back as a second, confusing
            // rule error about its placeholder value.
            if cx.count() == 0 {
                check::check(&cx, &decl);
            }
            expand(&c, &decl, &krate)
        }
        None => fallback(&item),
    };
    match cx.check() {
        Ok(()) => tokens,
        Err(e) => {
            let e = e.to_compile_error();
            quote!(#tokens #e)
        }
    }
}

/// When the struct itself cannot be read, a minimal item of the same name, so
/// uses of it elsewhere do not add errors of their own (thiserror's fallback).
fn fallback(item: &ItemStruct) -> TokenStream {
    let (vis, ident) = (&item.vis, &item.ident);
    quote! {
        #vis struct #ident<B>(::core::marker::PhantomData<B>);
    }
}

/// The crate the expansion names everything through when the declaration
/// does not say `crate = "..."`: the facade, the one dependency a model
/// crate needs.
const DEFAULT_CRATE: &str = "::foldmoe";

/// Takes a leading `crate = "path"` out of the attribute (for crates that
/// depend on `foldmoe-core` instead of the facade): the path's tokens and the
/// rest of the attribute. The path must name a crate whose root re-exports
/// `__private` (the facade and `foldmoe_core` do).
fn split_crate_path(cx: &Ctxt, attr: TokenStream) -> (TokenStream, TokenStream) {
    let tokens: Vec<proc_macro2::TokenTree> = attr.clone().into_iter().collect();
    let is_punct = |t: &proc_macro2::TokenTree, c: char| matches!(t, proc_macro2::TokenTree::Punct(p) if p.as_char() == c);
    let default = || DEFAULT_CRATE.parse().unwrap_or_default();
    match tokens.as_slice() {
        [proc_macro2::TokenTree::Ident(key), eq, proc_macro2::TokenTree::Literal(lit), rest @ ..]
            if key == "crate" && is_punct(eq, '=') =>
        {
            let rest = match rest.split_first() {
                Some((comma, rest)) if is_punct(comma, ',') => rest,
                _ => rest,
            };
            let path = syn::parse2::<syn::LitStr>(lit.clone().into_token_stream())
                .and_then(|l| l.parse::<syn::Path>());
            match path {
                Ok(path) => (path.into_token_stream(), rest.iter().cloned().collect()),
                Err(_) => {
                    cx.error(
                        lit.span(),
                        "`crate` takes the path of the crate that re-exports foldmoe's \
                         expansion support, like `crate = \"foldmoe_core\"`",
                    );
                    (default(), rest.iter().cloned().collect())
                }
            }
        }
        _ => (default(), attr),
    }
}

/// The whole expansion of a parsed declaration.
fn expand(c: &Container, decl: &Decl, krate: &TokenStream) -> TokenStream {
    let p = quote!(#krate::__private);
    let span = decl.spans.root.unwrap_or_else(Span::call_site);
    let (vis, ident, attrs) = (c.vis, c.ident, c.attrs);
    let layout_ident = format_ident!("{}Layout", ident);
    let spec = spec_tokens(&p, &decl.spec);
    let (variants, choice) = layout_enum(&p, decl, &layout_ident);
    let groups = group_fields(&p, c, decl);
    let (fields, idents, names) = (&groups.fields, &groups.idents, &groups.names);
    let kinds = &groups.kinds;
    let doc_layouts = format!("The named layouts of [`{ident}`].");
    quote_spanned! {span=>
        #(#attrs)*
        #vis struct #ident<B: #p::Backend> {
            #fields
            __foldmoe_model: #p::Model<B>,
        }

        #[doc = #doc_layouts]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #vis enum #layout_ident {
            #variants
        }

        #choice

        impl<B: #p::Backend> #p::MoeModel<B> for #ident<B> {
            type Layout = #layout_ident;

            fn spec() -> #p::ModelSpec {
                #spec
            }

            fn from_model(mut model: #p::Model<B>) -> #p::Result<Self> {
                let spec = <Self as #p::MoeModel<B>>::spec();
                let mut groups = #p::GroupFields::take(&mut model, &spec)?;
                #(let #idents = groups.next::<#p::#kinds<B>>(#names)?;)*
                ::core::result::Result::Ok(Self {
                    #(#idents,)*
                    __foldmoe_model: model,
                })
            }

            fn into_model(mut self) -> #p::Model<B> {
                <Self as #p::MoeModel<B>>::join_groups(&mut self);
                self.__foldmoe_model
            }

            fn join_groups(&mut self) {
                let groups = #p::Vec::from([
                    #(#p::GroupField::<B>::take(&mut self.#idents),)*
                ]);
                self.__foldmoe_model.put_groups(groups);
            }

            fn split_groups(&mut self) {
                let mut groups = self.__foldmoe_model.take_groups().into_iter();
                #(#p::split_back(&mut groups, &mut self.#idents);)*
            }

            fn engine(&self) -> &#p::Model<B> {
                &self.__foldmoe_model
            }

            fn engine_mut(&mut self) -> &mut #p::Model<B> {
                &mut self.__foldmoe_model
            }
        }

        impl<B: #p::Backend> #p::Module<B> for #ident<B> {
            fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a #p::Param<B>)) {
                self.__foldmoe_model.visit_params_before_groups(f);
                #(#p::Module::visit_params(&*self.#idents, f);)*
                self.__foldmoe_model.visit_params_after_groups(f);
            }
            fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut #p::Param<B>)) {
                self.__foldmoe_model.visit_params_before_groups_mut(f);
                #(#p::Module::visit_params_mut(&mut *self.#idents, f);)*
                self.__foldmoe_model.visit_params_after_groups_mut(f);
            }
        }
    }
}

/// The variants of the layout enum, and its `LayoutChoice` impl.
fn layout_enum(
    p: &TokenStream,
    decl: &Decl,
    layout_ident: &syn::Ident,
) -> (TokenStream, TokenStream) {
    let usable: Vec<(&syn::Ident, &LayoutDecl)> = decl
        .layouts
        .iter()
        .filter_map(|l| l.variant.as_ref().map(|v| (v, l)))
        .collect();
    let variants = usable.iter().map(|(v, l)| {
        let doc = layout_doc(&l.spec);
        quote!(#[doc = #doc] #v,)
    });
    let names = usable.iter().map(|(v, l)| {
        let name = &l.spec.name;
        quote!(Self::#v => #name,)
    });
    let specs = usable.iter().map(|(v, l)| {
        let lit = layout_tokens(p, l);
        quote!(Self::#v => #lit,)
    });
    let all = usable.iter().map(|(v, _)| quote!(Self::#v,));
    let choice = quote! {
        impl #p::LayoutChoice for #layout_ident {
            const ALL: &'static [Self] = &[#(#all)*];

            fn name(self) -> &'static str {
                match self {
                    #(#names)*
                }
            }

            fn spec(self) -> #p::LayoutSpec {
                match self {
                    #(#specs)*
                }
            }
        }
    };
    (quote!(#(#variants)*), choice)
}

/// A one-line doc of a layout: its name and the sizes given.
fn layout_doc(l: &LayoutSpec) -> String {
    let mut parts = vec![format!("world {}", l.world)];
    for (k, v) in [
        ("tp", l.tp),
        ("cp", l.cp),
        ("pp", l.pp),
        ("vpp", l.vpp),
        ("ep", l.ep),
        ("etp", l.etp),
    ] {
        if v > 1 {
            parts.push(format!("{k} {v}"));
        }
    }
    format!("`{}`: {}.", l.name, parts.join(", "))
}

/// `LayoutSpec { <the keys given>, ..Default::default() }`.
fn layout_tokens(p: &TokenStream, l: &LayoutDecl) -> TokenStream {
    let s = &l.spec;
    let fields = l.given.iter().map(|k| match *k {
        "name" => {
            let n = &s.name;
            quote!(name: #p::String::from(#n),)
        }
        "world" => usize_field("world", s.world),
        "tp" => usize_field("tp", s.tp),
        "cp" => usize_field("cp", s.cp),
        "pp" => usize_field("pp", s.pp),
        "vpp" => usize_field("vpp", s.vpp),
        "ep" => usize_field("ep", s.ep),
        "etp" => usize_field("etp", s.etp),
        "dp" => opt_usize_field("dp", s.dp),
        "edp" => opt_usize_field("edp", s.edp),
        "order" => {
            let o = &s.order;
            quote!(order: #p::String::from(#o),)
        }
        "pp_layers" => match &s.pp_layers {
            Some(v) => {
                let v = v.iter().map(|x| Literal::usize_unsuffixed(*x));
                quote!(pp_layers: ::core::option::Option::Some(#p::Vec::from([#(#v),*])),)
            }
            None => quote!(),
        },
        _ => quote!(),
    });
    quote! {
        #p::LayoutSpec { #(#fields)* ..::core::default::Default::default() }
    }
}

fn usize_field(name: &str, v: usize) -> TokenStream {
    let name = format_ident!("{}", name);
    let v = Literal::usize_unsuffixed(v);
    quote!(#name: #v,)
}

fn opt_usize_field(name: &str, v: Option<usize>) -> TokenStream {
    let name = format_ident!("{}", name);
    match v {
        Some(v) => {
            let v = Literal::usize_unsuffixed(v);
            quote!(#name: ::core::option::Option::Some(#v),)
        }
        None => quote!(),
    }
}

/// The struct's group fields, typed (`DenseGroup<B>` or `MoeGroup<B>`:
/// this rank's blocks of the group, with typed access to their layers), and
/// what the impls name them by.
struct GroupTokens {
    fields: TokenStream,
    idents: Vec<syn::Ident>,
    names: Vec<String>,
    kinds: Vec<syn::Ident>,
}

fn group_fields(p: &TokenStream, c: &Container, decl: &Decl) -> GroupTokens {
    let mut start = 0usize;
    let mut out = GroupTokens {
        fields: TokenStream::new(),
        idents: Vec::new(),
        names: Vec::new(),
        kinds: Vec::new(),
    };
    for (g, spec) in c.groups.iter().zip(&decl.spec.groups) {
        let end = start.saturating_add(spec.count);
        let (ident, vis, docs) = (g.ident, g.vis, &g.docs);
        let what = format!(
            "Blocks {start}..{end} of the model ({} {} block{}): this rank's blocks of \
             them (all on one rank; none on a pipeline stage without them).",
            spec.count,
            match spec.ffn {
                FfnSpec::Dense { .. } => "dense",
                FfnSpec::Moe(_) => "MoE",
            },
            if spec.count == 1 { "" } else { "s" }
        );
        let kind = match spec.ffn {
            FfnSpec::Dense { .. } => format_ident!("DenseGroup"),
            FfnSpec::Moe(_) => format_ident!("MoeGroup"),
        };
        let span = g.ident.span();
        out.fields.extend(quote_spanned! {span=>
            #(#docs)*
            #[doc = ""]
            #[doc = #what]
            #vis #ident: #p::#kind<B>,
        });
        out.idents.push(ident.clone());
        out.names.push(ident.to_string());
        out.kinds.push(kind);
        start = end;
    }
    out
}

fn lit_f64(v: f64) -> TokenStream {
    if v.is_finite() {
        let l = Literal::f64_suffixed(v);
        quote!(#l)
    } else {
        // Never reached from parsed input (non-finite numbers are rejected),
        // but a literal must not be built from one.
        quote!(::core::f64::NAN)
    }
}

/// The model spec as a struct literal.
fn spec_tokens(p: &TokenStream, s: &ModelSpec) -> TokenStream {
    let ModelSpec {
        name,
        vocab,
        hidden,
        seq_len,
        norm_eps,
        rope_theta,
        rope_scaling,
        tied_embeddings,
        init_std,
        groups,
        mtp_layers,
        mtp_loss_coef,
    } = s;
    let rope_scaling = rope_scaling_tokens(p, rope_scaling.as_ref());
    let (norm_eps, rope_theta, init_std, mtp_loss_coef) = (
        lit_f64(*norm_eps),
        lit_f64(*rope_theta),
        lit_f64(*init_std),
        lit_f64(*mtp_loss_coef),
    );
    let groups = groups.iter().map(|g| group_tokens(p, g));
    quote! {
        #p::ModelSpec {
            name: #p::String::from(#name),
            vocab: #vocab,
            hidden: #hidden,
            seq_len: #seq_len,
            norm_eps: #norm_eps,
            rope_theta: #rope_theta,
            rope_scaling: #rope_scaling,
            tied_embeddings: #tied_embeddings,
            init_std: #init_std,
            groups: #p::Vec::from([#(#groups),*]),
            mtp_layers: #mtp_layers,
            mtp_loss_coef: #mtp_loss_coef,
        }
    }
}

fn group_tokens(p: &TokenStream, g: &BlockGroup) -> TokenStream {
    let BlockGroup {
        count,
        attention,
        ffn,
        policy,
    } = g;
    let AttentionSpec {
        heads,
        kv_heads,
        head_dim,
        mla,
        qk_norm,
        precision,
    } = attention;
    let precision = precision_tokens(*precision);
    let mla = match mla {
        Some(MlaSpec {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        }) => quote! {
            ::core::option::Option::Some(#p::MlaSpec {
                q_lora_rank: #q_lora_rank,
                kv_lora_rank: #kv_lora_rank,
                qk_nope_head_dim: #qk_nope_head_dim,
                qk_rope_head_dim: #qk_rope_head_dim,
                v_head_dim: #v_head_dim,
            })
        },
        None => quote!(::core::option::Option::None),
    };
    let ffn = match ffn {
        FfnSpec::Dense { ffn } => quote!(#p::FfnSpec::Dense { ffn: #ffn }),
        FfnSpec::Moe(m) => {
            let m = moe_tokens(p, m);
            quote!(#p::FfnSpec::Moe(#m))
        }
    };
    let policy = policy_tokens(p, policy);
    quote! {
        #p::BlockGroup {
            count: #count,
            attention: #p::AttentionSpec {
                heads: #heads,
                kv_heads: #kv_heads,
                head_dim: #head_dim,
                mla: #mla,
                qk_norm: #qk_norm,
                precision: #p::GemmPrecision::#precision,
            },
            ffn: #ffn,
            policy: #policy,
        }
    }
}

/// The variant name of `precision`, for `GemmPrecision::#name`.
fn precision_tokens(precision: GemmPrecision) -> TokenStream {
    match precision {
        GemmPrecision::F32 => quote!(F32),
        GemmPrecision::Bf16 => quote!(Bf16),
        GemmPrecision::Fp8Tensorwise => quote!(Fp8Tensorwise),
        GemmPrecision::Fp8Blockwise => quote!(Fp8Blockwise),
    }
}

fn moe_tokens(p: &TokenStream, m: &MoeSpec) -> TokenStream {
    let MoeSpec {
        experts,
        top_k,
        expert_ffn,
        shared_ffn,
        shared_gate,
        router,
        capacity,
    } = m;
    let RouterSpec {
        score,
        pre_softmax,
        scaling_factor,
        groups,
        group_top_k,
        expert_bias_rate,
        load_balance,
        aux_coef,
        z_loss_coef,
        dtype,
    } = router;
    let router_dtype = match dtype {
        RouterDtype::Model => quote!(#p::RouterDtype::Model),
        RouterDtype::Fp32 => quote!(#p::RouterDtype::Fp32),
    };
    let score = match score {
        ScoreFunction::Softmax => quote!(#p::ScoreFunction::Softmax),
        ScoreFunction::Sigmoid => quote!(#p::ScoreFunction::Sigmoid),
    };
    let load_balance = match load_balance {
        LoadBalance::None => quote!(#p::LoadBalance::None),
        LoadBalance::Aux => quote!(#p::LoadBalance::Aux),
        LoadBalance::SeqAux => quote!(#p::LoadBalance::SeqAux),
        LoadBalance::GlobalAux => quote!(#p::LoadBalance::GlobalAux),
    };
    let bias = match expert_bias_rate {
        Some(r) => {
            let r = lit_f64(*r);
            quote!(::core::option::Option::Some(#r))
        }
        None => quote!(::core::option::Option::None),
    };
    let capacity = match capacity {
        Some(CapacitySpec {
            factor,
            drop_policy,
            pad_to_capacity,
        }) => {
            let factor = lit_f64(*factor);
            let drop = match drop_policy {
                DropPolicySpec::Probs => quote!(#p::DropPolicySpec::Probs),
                DropPolicySpec::Position => quote!(#p::DropPolicySpec::Position),
            };
            quote! {
                ::core::option::Option::Some(#p::CapacitySpec {
                    factor: #factor,
                    drop_policy: #drop,
                    pad_to_capacity: #pad_to_capacity,
                })
            }
        }
        None => quote!(::core::option::Option::None),
    };
    let (scaling_factor, aux_coef, z_loss_coef) = (
        lit_f64(*scaling_factor),
        lit_f64(*aux_coef),
        lit_f64(*z_loss_coef),
    );
    quote! {
        #p::MoeSpec {
            experts: #experts,
            top_k: #top_k,
            expert_ffn: #expert_ffn,
            shared_ffn: #shared_ffn,
            shared_gate: #shared_gate,
            router: #p::RouterSpec {
                score: #score,
                pre_softmax: #pre_softmax,
                scaling_factor: #scaling_factor,
                groups: #groups,
                group_top_k: #group_top_k,
                expert_bias_rate: #bias,
                load_balance: #load_balance,
                aux_coef: #aux_coef,
                z_loss_coef: #z_loss_coef,
                dtype: #router_dtype,
            },
            capacity: #capacity,
        }
    }
}

fn policy_tokens(p: &TokenStream, policy: &Policy) -> TokenStream {
    let recompute = policy.recompute.iter().map(|r| {
        let v = match r {
            RecomputePart::Norm => quote!(Norm),
            RecomputePart::CoreAttn => quote!(CoreAttn),
            RecomputePart::MlpAct => quote!(MlpAct),
            RecomputePart::MoeAct => quote!(MoeAct),
            RecomputePart::Router => quote!(Router),
            RecomputePart::SharedExperts => quote!(SharedExperts),
            RecomputePart::MlaUpProj => quote!(MlaUpProj),
            RecomputePart::Block => quote!(Block),
        };
        quote!(#p::RecomputePart::#v)
    });
    let offload = |parts: &[OffloadPart]| -> Vec<TokenStream> {
        parts
            .iter()
            .map(|o| {
                let v = match o {
                    OffloadPart::AttnNorm => quote!(AttnNorm),
                    OffloadPart::Qkv => quote!(Qkv),
                    OffloadPart::CoreAttn => quote!(CoreAttn),
                    OffloadPart::AttnProj => quote!(AttnProj),
                    OffloadPart::MlpNorm => quote!(MlpNorm),
                    OffloadPart::ExpertFc1 => quote!(ExpertFc1),
                    OffloadPart::MoeAct => quote!(MoeAct),
                };
                quote!(#p::OffloadPart::#v)
            })
            .collect()
    };
    let (off, fp8) = (offload(&policy.offload), offload(&policy.store_fp8));
    let precision = precision_tokens(policy.precision);
    quote! {
        #p::Policy {
            recompute: #p::Vec::from([#(#recompute),*]),
            offload: #p::Vec::from([#(#off),*]),
            store_fp8: #p::Vec::from([#(#fp8),*]),
            precision: #p::GemmPrecision::#precision,
        }
    }
}

/// `rope_scaling` as an `Option<RopeScaling>` literal.
fn rope_scaling_tokens(
    p: &TokenStream,
    r: Option<&foldmoe_core::spec::RopeScaling>,
) -> TokenStream {
    let Some(r) = r else {
        return quote!(::core::option::Option::None);
    };
    let opt = |v: Option<f64>| match v {
        Some(v) => {
            let v = lit_f64(v);
            quote!(::core::option::Option::Some(#v))
        }
        None => quote!(::core::option::Option::None),
    };
    let (factor, beta_fast, beta_slow) = (
        lit_f64(r.factor),
        lit_f64(r.beta_fast),
        lit_f64(r.beta_slow),
    );
    let (mscale, mscale_all_dim) = (opt(r.mscale), opt(r.mscale_all_dim));
    let original = r.original_max_position_embeddings;
    quote! {
        ::core::option::Option::Some(#p::RopeScaling {
            kind: #p::RopeScalingType::Yarn,
            factor: #factor,
            original_max_position_embeddings: #original,
            beta_fast: #beta_fast,
            beta_slow: #beta_slow,
            mscale: #mscale,
            mscale_all_dim: #mscale_all_dim,
        })
    }
}
