//! Attribute parsing: `#[moe_model(...)]` and each field's `#[blocks(...)]`
//! become the IR ([`ModelSpec`], [`LayoutSpec`]), and the span of every key
//! written is recorded under the IR path the rules blame
//! (`groups[1].moe.router.groups`), so [`crate::check`] can point at it.
//!
//! Every keyword of the syntax is a constant in [`kw`]; policy part names come
//! from `foldmoe_core::spec::keywords`, the table config files use too.

use foldmoe_core::layout::LayoutSpec;
use foldmoe_core::spec::{
    keywords, AttentionSpec, BlockGroup, CapacitySpec, FfnSpec, MlaSpec, ModelSpec, MoeSpec,
    Policy, RopeScaling, RouterSpec,
};
use proc_macro2::{Span, TokenStream};
use quote::format_ident;
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Lit, Meta, Token};

use crate::ast::{span_of, Container, Decl, LayoutDecl, Spans};
use crate::ctxt::Ctxt;

/// The keywords of the syntax, in one place. The key and value tables are
/// `foldmoe_core::spec::keywords`', which config files read too, so the two
/// front ends accept the same words; each table pairs a key with the IR path
/// (relative to its section) that rules about it blame.
pub mod kw {
    use foldmoe_core::spec::keywords;

    pub use keywords::{DROP, LOAD_BALANCE, ROUTER_DTYPE, SCORE};

    /// The field attribute naming a group's settings.
    pub const BLOCKS: &str = "blocks";
    /// The placeholder type of a group field.
    pub const BLOCKS_TYPE: &str = "Blocks";
    /// A named layout inside `#[moe_model(...)]`.
    pub const LAYOUT: &str = "layout";

    /// Keys of `#[moe_model(...)]`.
    pub const MODEL: &[(&str, &str)] = keywords::MODEL_KEYS;
    /// Keys of `layout(...)`.
    pub const LAYOUT_KEYS: &[(&str, &str)] = keywords::LAYOUT_KEYS;
    /// Keys of `#[blocks(...)]`.
    pub const GROUP: &[(&str, &str)] = keywords::GROUP_KEYS;
    /// Keys of `attention(...)`.
    pub const ATTENTION: &[(&str, &str)] = keywords::ATTENTION_KEYS;
    /// Keys of `mla(...)`.
    pub const MLA: &[(&str, &str)] = keywords::MLA_KEYS;
    /// Keys of `dense(...)`.
    pub const DENSE: &[(&str, &str)] = keywords::DENSE_KEYS;
    /// Keys of `moe(...)`.
    pub const MOE: &[(&str, &str)] = keywords::MOE_KEYS;
    /// Keys of `capacity(...)`.
    pub const CAPACITY: &[(&str, &str)] = keywords::CAPACITY_KEYS;
    /// Keys of `rope_scaling(...)`.
    pub const ROPE_SCALING: &[(&str, &str)] = keywords::ROPE_SCALING_KEYS;
}

/// One `key`, `key = value` or `key(...)` as written.
struct Entry {
    key: String,
    span: Span,
    meta: Meta,
}

/// One parenthesised list of keys (`moe(...)`), its unknown and duplicate
/// keys already reported; typed getters report wrong values and missing keys.
struct Section<'c> {
    cx: &'c Ctxt,
    /// How the user wrote it, for messages: `moe(...)`.
    what: String,
    /// The span of the section's own keyword, blamed for missing keys.
    span: Span,
    /// IR path of the section (`groups[1].moe`).
    base: String,
    /// The key table, mapping keys to IR paths.
    keys: &'static [(&'static str, &'static str)],
    entries: Vec<Entry>,
    /// Keys suggested for unknown ones (`hidden` for `hidden_size`): not
    /// reported missing too, which would say the same thing twice.
    suggested: Vec<&'static str>,
}

impl<'c> Section<'c> {
    /// Parses `tokens` as comma-separated keys of `keys`; records the span of
    /// every accepted key in `spans`.
    #[allow(clippy::too_many_arguments)]
    fn parse(
        cx: &'c Ctxt,
        spans: &mut Spans,
        what: String,
        span: Span,
        base: String,
        tokens: TokenStream,
        keys: &'static [(&'static str, &'static str)],
        repeatable: &[&str],
    ) -> Self {
        let mut s = Section {
            cx,
            what,
            span,
            base,
            keys,
            entries: Vec::new(),
            suggested: Vec::new(),
        };
        let metas = match Punctuated::<Meta, Token![,]>::parse_terminated.parse2(tokens) {
            Ok(m) => m,
            Err(e) => {
                cx.syn_error(e);
                return s;
            }
        };
        for meta in metas {
            let Some(ident) = meta.path().get_ident() else {
                cx.error(
                    span_of(meta.path()),
                    format!("expected a key of {}, found a path", s.what),
                );
                continue;
            };
            let key = ident.to_string();
            let Some(&(_, ir)) = keys.iter().find(|(k, _)| *k == key) else {
                let names: Vec<&str> = keys.iter().map(|(k, _)| *k).collect();
                let suggestion = keywords::suggest(&key, &names);
                s.suggested.extend(suggestion);
                let hint = suggestion
                    .map(|k| format!("did you mean `{k}`? "))
                    .unwrap_or_default();
                cx.error(
                    ident.span(),
                    format!(
                        "unknown key `{key}` in {}; {hint}expected one of: {}",
                        s.what,
                        names.join(", ")
                    ),
                );
                continue;
            };
            if !repeatable.contains(&key.as_str()) && s.entries.iter().any(|e| e.key == key) {
                cx.error(
                    ident.span(),
                    format!("duplicate key `{key}` in {}; keep one", s.what),
                );
                continue;
            }
            spans.insert(s.path(ir), ident.span());
            s.entries.push(Entry {
                key,
                span: ident.span(),
                meta,
            });
        }
        s
    }

    /// The IR path of `suffix` under this section.
    fn path(&self, suffix: &str) -> String {
        if self.base.is_empty() {
            suffix.to_string()
        } else {
            format!("{}.{suffix}", self.base)
        }
    }

    fn get(&self, key: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.key == key)
    }

    /// Reports that a required key is missing; `example` shows the syntax.
    fn missing(&self, key: &str, example: &str) {
        if self.suggested.contains(&key) {
            return;
        }
        self.cx.error(
            self.span,
            format!("{} needs `{key}`, like `{example}`", self.what),
        );
    }

    /// The literal of `key = <lit>`, or a report naming what was expected.
    fn lit<'e>(&self, e: &'e Entry, expected: &str) -> Option<&'e Lit> {
        if let Meta::NameValue(nv) = &e.meta {
            // No size, rate or coefficient of a model is negative, so a minus
            // sign gets its own message rather than "found an expression".
            if let Some(number) = negative(&nv.value) {
                self.cx.error(
                    e.span,
                    format!(
                        "`{}` cannot be negative; found {number}, expected {expected}",
                        e.key
                    ),
                );
                return None;
            }
            if let Expr::Lit(ExprLit { lit, .. }) = &nv.value {
                return Some(lit);
            }
        }
        self.wrong(e, expected);
        None
    }

    /// Reports a value of the wrong kind at its key.
    fn wrong(&self, e: &Entry, expected: &str) {
        self.cx.error(
            e.span,
            format!(
                "`{}` expects {expected}; found {}",
                e.key,
                describe(&e.meta)
            ),
        );
    }

    fn int(&self, key: &str) -> Option<usize> {
        let e = self.get(key)?;
        match self.lit(e, &format!("an integer, like `{key} = 8`"))? {
            Lit::Int(i) => match i.base10_parse::<usize>() {
                Ok(v) => Some(v),
                Err(err) => {
                    self.cx
                        .error(i.span(), format!("`{key}` = {i} is not a usize: {err}"));
                    None
                }
            },
            _ => {
                self.wrong(e, &format!("an integer, like `{key} = 8`"));
                None
            }
        }
    }

    fn req_int(&self, key: &str) -> usize {
        match self.get(key) {
            Some(_) => self.int(key).unwrap_or(0),
            None => {
                self.missing(key, &format!("{key} = 8"));
                0
            }
        }
    }

    fn float(&self, key: &str) -> Option<f64> {
        let e = self.get(key)?;
        let expected = format!("a number, like `{key} = 1e-3`");
        let parsed = match self.lit(e, &expected)? {
            Lit::Float(f) => f.base10_parse::<f64>(),
            Lit::Int(i) => i.base10_parse::<f64>(),
            _ => {
                self.wrong(e, &expected);
                return None;
            }
        };
        match parsed {
            Ok(v) if v.is_finite() => Some(v),
            Ok(v) => {
                self.cx
                    .error(e.span, format!("`{key}` = {v} is not a finite number"));
                None
            }
            Err(err) => {
                self.cx.error(e.span, format!("`{key}`: {err}"));
                None
            }
        }
    }

    /// `key = true|false`, or `key` alone for `true`.
    fn bool(&self, key: &str) -> Option<bool> {
        let e = self.get(key)?;
        if let Meta::Path(_) = e.meta {
            return Some(true);
        }
        match self.lit(e, &format!("a bool, like `{key} = true`"))? {
            Lit::Bool(b) => Some(b.value),
            _ => {
                self.wrong(e, &format!("a bool, like `{key} = true`"));
                None
            }
        }
    }

    fn string(&self, key: &str) -> Option<(String, Span)> {
        let e = self.get(key)?;
        match self.lit(e, &format!("a string, like `{key} = \"...\"`"))? {
            Lit::Str(s) => Some((s.value(), s.span())),
            _ => {
                self.wrong(e, &format!("a string, like `{key} = \"...\"`"));
                None
            }
        }
    }

    /// `key = word` with `word` from `table`.
    fn keyword<T: Copy>(&self, key: &str, table: &[(&str, T)]) -> Option<T> {
        let e = self.get(key)?;
        let names: Vec<&str> = table.iter().map(|(k, _)| *k).collect();
        let expected = format!("one of {}", names.join(", "));
        let word = match &e.meta {
            Meta::NameValue(nv) => match &nv.value {
                Expr::Path(p) if p.qself.is_none() => p.path.get_ident(),
                _ => None,
            },
            _ => None,
        };
        let Some(word) = word else {
            self.wrong(e, &expected);
            return None;
        };
        match keywords::lookup(table, &format!("`{key}` value"), &word.to_string()) {
            Ok(v) => Some(v),
            Err(msg) => {
                self.cx.error(word.span(), msg);
                None
            }
        }
    }

    /// `key = [1, 2, 3]`.
    fn int_list(&self, key: &str) -> Option<Vec<usize>> {
        let e = self.get(key)?;
        let expected = format!("a list of integers, like `{key} = [4, 4]`");
        let Meta::NameValue(nv) = &e.meta else {
            self.wrong(e, &expected);
            return None;
        };
        let Expr::Array(arr) = &nv.value else {
            self.wrong(e, &expected);
            return None;
        };
        let mut out = Vec::new();
        for el in &arr.elems {
            match el {
                Expr::Lit(ExprLit {
                    lit: Lit::Int(i), ..
                }) => match i.base10_parse::<usize>() {
                    Ok(v) => out.push(v),
                    Err(err) => {
                        self.cx.error(i.span(), format!("`{key}`: {err}"));
                        return None;
                    }
                },
                other => {
                    self.cx
                        .error(span_of(other), format!("`{key}` holds integers only"));
                    return None;
                }
            }
        }
        Some(out)
    }

    /// `key(a, b)` with each word from `table`; the span of each accepted
    /// word is recorded under its index (`groups[0].policy.recompute[1]`), so
    /// a rule about one part points at that word, not at the list's key.
    fn parts<T: Copy>(&self, spans: &mut Spans, key: &str, table: &[(&str, T)]) -> Vec<T> {
        let Some(e) = self.get(key) else {
            return Vec::new();
        };
        let Meta::List(list) = &e.meta else {
            self.wrong(e, &format!("a list of parts, like `{key}({})`", table[0].0));
            return Vec::new();
        };
        let words = match Punctuated::<syn::Ident, Token![,]>::parse_terminated
            .parse2(list.tokens.clone())
        {
            Ok(w) => w,
            Err(err) => {
                self.cx.syn_error(err);
                return Vec::new();
            }
        };
        let ir = self
            .keys
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(key, |(_, ir)| ir);
        let base = self.path(ir);
        let mut out = Vec::new();
        for w in words {
            match keywords::lookup(table, &format!("{key} part"), &w.to_string()) {
                Ok(v) => {
                    spans.insert(format!("{base}[{}]", out.len()), w.span());
                    out.push(v);
                }
                Err(msg) => self.cx.error(w.span(), msg),
            }
        }
        out
    }

    /// The nested section `key(...)`, its keys from `keys`.
    fn section(
        &self,
        spans: &mut Spans,
        key: &str,
        keys: &'static [(&'static str, &'static str)],
    ) -> Option<Section<'c>> {
        let e = self.get(key)?;
        self.nested(spans, e, keys)
    }

    fn nested(
        &self,
        spans: &mut Spans,
        e: &Entry,
        keys: &'static [(&'static str, &'static str)],
    ) -> Option<Section<'c>> {
        let Meta::List(list) = &e.meta else {
            self.wrong(e, &format!("a list, like `{}(...)`", e.key));
            return None;
        };
        let ir = self
            .keys
            .iter()
            .find(|(k, _)| *k == e.key)
            .map_or(e.key.as_str(), |(_, ir)| ir);
        Some(Section::parse(
            self.cx,
            spans,
            format!("{}(...)", e.key),
            e.span,
            self.path(ir),
            list.tokens.clone(),
            keys,
            &[],
        ))
    }
}

/// How a value was written, for "found ..." in messages.
fn describe(meta: &Meta) -> String {
    match meta {
        Meta::Path(_) => "the key alone, without a value".into(),
        Meta::List(_) => "a list `(...)`".into(),
        Meta::NameValue(nv) => match &nv.value {
            Expr::Lit(ExprLit { lit, .. }) => match lit {
                Lit::Str(s) => format!("the string {:?}", s.value()),
                Lit::Int(i) => format!("the integer {i}"),
                Lit::Float(f) => format!("the number {f}"),
                Lit::Bool(b) => format!("`{}`", b.value),
                _ => "a literal of another kind".into(),
            },
            Expr::Path(p) => match p.path.get_ident() {
                Some(i) => format!("`{i}`"),
                None => "a path".into(),
            },
            Expr::Array(_) => "a list `[...]`".into(),
            Expr::Unary(_) => match negative(&nv.value) {
                Some(number) => format!("the negative number {number}"),
                None => "a negated value".into(),
            },
            _ => "an expression".into(),
        },
    }
}

/// `-8` or `-1e-3` as written, when `value` is a negated number literal:
/// either a minus applied to a literal or, as syn parses the last value of a
/// list, one negative literal.
fn negative(value: &Expr) -> Option<String> {
    let u = match value {
        Expr::Unary(u) => u,
        Expr::Lit(ExprLit {
            lit: lit @ (Lit::Int(_) | Lit::Float(_)),
            ..
        }) => {
            let text = quote::ToTokens::to_token_stream(lit).to_string();
            return text.starts_with('-').then_some(text);
        }
        _ => return None,
    };
    match (&u.op, &*u.expr) {
        (syn::UnOp::Neg(_), Expr::Lit(ExprLit { lit, .. })) => match lit {
            Lit::Int(i) => Some(format!("-{i}")),
            Lit::Float(f) => Some(format!("-{f}")),
            _ => None,
        },
        _ => None,
    }
}

/// Parses `#[moe_model(<attr>)]` and every field's `#[blocks(...)]`.
pub fn parse(cx: &Ctxt, attr: TokenStream, c: &Container) -> Decl {
    let mut spans = Spans::default();
    spans.root = Some(Span::call_site());
    spans.insert("groups".into(), c.ident.span());
    let s = Section::parse(
        cx,
        &mut spans,
        "#[moe_model(...)]".into(),
        Span::call_site(),
        String::new(),
        attr,
        kw::MODEL,
        &[kw::LAYOUT],
    );
    let name = match s.get("name") {
        Some(_) => s.string("name").map(|(n, _)| n).unwrap_or_default(),
        None => {
            s.missing("name", "name = \"my-moe\"");
            String::new()
        }
    };
    let defaults = (
        keywords::DEFAULT_NORM_EPS,
        keywords::DEFAULT_ROPE_THETA,
        keywords::DEFAULT_INIT_STD,
    );
    let mut groups = Vec::new();
    for (i, g) in c.groups.iter().enumerate() {
        groups.push(match g.blocks {
            Some(a) => parse_group(cx, &mut spans, i, a),
            None => BlockGroup::new(0, AttentionSpec::gqa(0, 0, 0), FfnSpec::Dense { ffn: 0 }),
        });
    }
    let spec = ModelSpec {
        name,
        vocab: s.req_int("vocab"),
        hidden: s.req_int("hidden"),
        seq_len: s.req_int("seq_len"),
        norm_eps: s.float("norm_eps").unwrap_or(defaults.0),
        rope_theta: s.float("rope_theta").unwrap_or(defaults.1),
        rope_scaling: s
            .section(&mut spans, "rope_scaling", kw::ROPE_SCALING)
            .map(|r| parse_rope_scaling(&r)),
        tied_embeddings: s.bool("tied_embeddings").unwrap_or(false),
        init_std: s.float("init_std").unwrap_or(defaults.2),
        groups,
        mtp_layers: s.int("mtp_layers").unwrap_or(0),
        mtp_loss_coef: s
            .float("mtp_loss_coef")
            .unwrap_or(foldmoe_core::spec::keywords::DEFAULT_MTP_LOSS_COEF),
    };
    let mut layouts: Vec<LayoutDecl> = Vec::new();
    for (j, e) in s.entries.iter().filter(|e| e.key == kw::LAYOUT).enumerate() {
        spans.insert(format!("layouts[{j}]"), e.span);
        let Some(l) = s.nested(&mut spans, e, kw::LAYOUT_KEYS) else {
            continue;
        };
        let mut l = Section {
            base: format!("layouts[{j}]"),
            ..l
        };
        // Re-record this layout's keys under its own index (nested() used the
        // model-level path `layout`).
        for en in &l.entries {
            spans.insert(format!("layouts[{j}].{}", en.key), en.span);
        }
        l.what = format!("layout(...) #{}", j + 1);
        layouts.push(parse_layout(cx, &l, &layouts));
    }
    if layouts.is_empty() && cx.count() == 0 {
        cx.error(
            Span::call_site(),
            "declare at least one layout, like `layout(name = \"cpu\", world = 1)`",
        );
    }
    Decl {
        spec,
        layouts,
        spans,
    }
}

/// `rope_scaling(rope_type = yarn, factor, original_max_position_embeddings, ...)`,
/// the betas defaulting to YaRN's 32 and 1.
fn parse_rope_scaling(s: &Section) -> RopeScaling {
    let kind = match s.get("rope_type") {
        Some(_) => s.keyword("rope_type", keywords::ROPE_SCALING_TYPE),
        None => {
            s.missing("rope_type", "rope_type = yarn");
            None
        }
    };
    let factor = match s.get("factor") {
        Some(_) => s.float("factor").unwrap_or(1.0),
        None => {
            s.missing("factor", "factor = 4");
            1.0
        }
    };
    let mut r = RopeScaling::yarn(factor, s.req_int("original_max_position_embeddings"));
    r.kind = kind.unwrap_or(r.kind);
    r.beta_fast = s.float("beta_fast").unwrap_or(r.beta_fast);
    r.beta_slow = s.float("beta_slow").unwrap_or(r.beta_slow);
    r.mscale = s.float("mscale");
    r.mscale_all_dim = s.float("mscale_all_dim");
    r
}

/// One `layout(...)`: a [`LayoutSpec`] with the keys given, the rest default.
fn parse_layout(cx: &Ctxt, s: &Section, earlier: &[LayoutDecl]) -> LayoutDecl {
    let mut l = LayoutSpec::default();
    let mut variant = None;
    match s.string("name") {
        Some((name, span)) => {
            variant = variant_ident(&name);
            if variant.is_none() {
                cx.error(
                    span,
                    format!("layout name {name:?} has no letters or digits to name an enum variant; use a name like \"h100x64\""),
                );
            } else if let Some(prev) = earlier.iter().find(|d| d.variant == variant) {
                cx.error(
                    span,
                    format!(
                        "layout name {name:?} repeats {:?} (both become the variant `{}`); give each layout its own name",
                        prev.spec.name,
                        variant.as_ref().map(|v| v.to_string()).unwrap_or_default()
                    ),
                );
                variant = None;
            }
            l.name = name;
        }
        None if s.get("name").is_none() => s.missing("name", "name = \"cpu\""),
        None => {}
    }
    l.world = s.req_int("world");
    let set = |key: &str, field: &mut usize| {
        if let Some(v) = s.int(key) {
            *field = v;
        }
    };
    set("tp", &mut l.tp);
    set("cp", &mut l.cp);
    set("pp", &mut l.pp);
    set("vpp", &mut l.vpp);
    set("ep", &mut l.ep);
    set("etp", &mut l.etp);
    if let Some(v) = s.int("dp") {
        l.dp = Some(v);
    }
    if let Some(v) = s.int("edp") {
        l.edp = Some(v);
    }
    if let Some((v, _)) = s.string("order") {
        l.order = v;
    }
    if let Some(v) = s.int_list("pp_layers") {
        l.pp_layers = Some(v);
    }
    let given = kw::LAYOUT_KEYS
        .iter()
        .map(|(k, _)| *k)
        .filter(|k| s.get(k).is_some())
        .collect();
    LayoutDecl {
        spec: l,
        given,
        variant,
    }
}

/// `"h100x1024"` → `H100x1024`, `"dgx-h100"` → `DgxH100`, `"8xh100"` → `L8xh100`.
fn variant_ident(name: &str) -> Option<proc_macro2::Ident> {
    let mut out = String::new();
    for part in name.split(|c: char| !c.is_ascii_alphanumeric()) {
        let mut chars = part.chars();
        if let Some(first) = chars.next() {
            out.push(first.to_ascii_uppercase());
            out.extend(chars);
        }
    }
    if out.is_empty() {
        return None;
    }
    if out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, 'L');
    }
    if out == "Self" {
        out.push('_');
    }
    Some(format_ident!("{}", out))
}

/// One field's `#[blocks(...)]` as a [`BlockGroup`] (index `i`).
fn parse_group(cx: &Ctxt, spans: &mut Spans, i: usize, attr: &syn::Attribute) -> BlockGroup {
    let base = format!("groups[{i}]");
    let kw_span = attr
        .path()
        .segments
        .first()
        .map_or(Span::call_site(), |s| s.ident.span());
    spans.insert(base.clone(), kw_span);
    let empty = BlockGroup::new(0, AttentionSpec::gqa(0, 0, 0), FfnSpec::Dense { ffn: 0 });
    let tokens = match &attr.meta {
        Meta::List(l) => l.tokens.clone(),
        _ => {
            cx.error(
                span_of(attr),
                "#[blocks] needs its settings: #[blocks(count = .., attention(..), dense(..) or moe(..))]",
            );
            return empty;
        }
    };
    let s = Section::parse(
        cx,
        spans,
        "#[blocks(...)]".into(),
        kw_span,
        base,
        tokens,
        kw::GROUP,
        &[],
    );
    let count = s.req_int("count");
    let attention = match s.section(spans, "attention", kw::ATTENTION) {
        Some(a) => parse_attention(spans, &a),
        None => {
            if s.get("attention").is_none() {
                s.missing(
                    "attention",
                    "attention(heads = 8, kv_heads = 2, head_dim = 64)",
                );
            }
            AttentionSpec::gqa(0, 0, 0)
        }
    };
    let dense = s.section(spans, "dense", kw::DENSE);
    let moe = s.section(spans, "moe", kw::MOE);
    let ffn = match (dense, moe) {
        (Some(d), None) => FfnSpec::Dense {
            ffn: d.req_int("ffn"),
        },
        (None, Some(m)) => FfnSpec::Moe(parse_moe(spans, &m)),
        (Some(_), Some(m)) => {
            cx.error(
                m.span,
                "a group has either dense(...) or moe(...), not both; split it into two fields",
            );
            FfnSpec::Dense { ffn: 0 }
        }
        (None, None) => {
            if s.get("dense").is_none() && s.get("moe").is_none() {
                cx.error(
                    s.span,
                    "#[blocks(...)] needs its feed-forward part, dense(...) or moe(...), like `dense(ffn = 1024)`",
                );
            }
            FfnSpec::Dense { ffn: 0 }
        }
    };
    let policy = Policy {
        recompute: s.parts(spans, "recompute", keywords::RECOMPUTE),
        offload: s.parts(spans, "offload", keywords::OFFLOAD),
        store_fp8: s.parts(spans, "store_fp8", keywords::OFFLOAD),
        precision: s
            .keyword("precision", keywords::PRECISION)
            .unwrap_or(Policy::default().precision),
    };
    BlockGroup {
        count,
        attention,
        ffn,
        policy,
    }
}

/// `attention(heads, kv_heads, head_dim, mla(...))`; `kv_heads` defaults to
/// `heads` (multi-head), and with MLA `head_dim` to the query/key head dim.
fn parse_attention(spans: &mut Spans, s: &Section) -> AttentionSpec {
    let heads = s.req_int("heads");
    let kv_heads = s.int("kv_heads").unwrap_or(heads);
    let mla = s.section(spans, "mla", kw::MLA).map(|m| MlaSpec {
        q_lora_rank: m.int("q_lora_rank").unwrap_or(0),
        kv_lora_rank: m.req_int("kv_lora_rank"),
        qk_nope_head_dim: m.req_int("qk_nope_head_dim"),
        qk_rope_head_dim: m.req_int("qk_rope_head_dim"),
        v_head_dim: m.req_int("v_head_dim"),
    });
    let head_dim = match (&mla, s.get("head_dim")) {
        (_, Some(_)) => s.int("head_dim").unwrap_or(0),
        (Some(m), None) => m.qk_nope_head_dim + m.qk_rope_head_dim,
        (None, None) => {
            s.missing("head_dim", "head_dim = 128");
            0
        }
    };
    AttentionSpec {
        heads,
        kv_heads,
        head_dim,
        mla,
        qk_norm: s.bool("qk_norm").unwrap_or(false),
        precision: s
            .keyword("precision", keywords::PRECISION)
            .unwrap_or_default(),
    }
}

/// `moe(...)`: experts, shared experts, router and capacity, router defaults
/// from `RouterSpec::default()`.
fn parse_moe(spans: &mut Spans, s: &Section) -> MoeSpec {
    let experts = s.req_int("experts");
    let top_k = s.req_int("top_k");
    let expert_ffn = s.req_int("expert_ffn");
    // Megatron sizes the shared experts' MLP as their count times the
    // routed experts' ffn; a different size is written as shared_ffn.
    let shared_ffn = match (s.int("shared_experts"), s.get("shared_ffn")) {
        (Some(_), Some(e)) => {
            s.cx.error(
                e.span,
                "give shared_experts (a count) or shared_ffn (a size), not both",
            );
            0
        }
        (Some(n), None) => n.checked_mul(expert_ffn).unwrap_or_else(|| {
            s.cx.error(
                s.span,
                format!("shared_experts = {n} × expert_ffn = {expert_ffn} overflows"),
            );
            0
        }),
        (None, _) => s.int("shared_ffn").unwrap_or(0),
    };
    let d = RouterSpec::default();
    let router = RouterSpec {
        score: s.keyword("score", kw::SCORE).unwrap_or(d.score),
        pre_softmax: s.bool("pre_softmax").unwrap_or(d.pre_softmax),
        scaling_factor: s.float("scaling_factor").unwrap_or(d.scaling_factor),
        groups: s.int("groups").unwrap_or(d.groups),
        group_top_k: s.int("group_top_k").unwrap_or(d.group_top_k),
        expert_bias_rate: s.float("expert_bias").or(d.expert_bias_rate),
        load_balance: s
            .keyword("load_balance", kw::LOAD_BALANCE)
            .unwrap_or(d.load_balance),
        aux_coef: s.float("aux_coef").unwrap_or(d.aux_coef),
        z_loss_coef: s.float("z_loss").unwrap_or(d.z_loss_coef),
        dtype: s
            .keyword("router_dtype", kw::ROUTER_DTYPE)
            .unwrap_or(d.dtype),
    };
    let capacity = s.section(spans, "capacity", kw::CAPACITY).map(|c| {
        let factor = match c.get("factor") {
            Some(_) => c.float("factor").unwrap_or(1.0),
            None => {
                c.missing("factor", "factor = 1.25");
                1.0
            }
        };
        CapacitySpec {
            factor,
            drop_policy: c.keyword("drop", kw::DROP).unwrap_or(kw::DROP[0].1),
            pad_to_capacity: c.bool("pad").unwrap_or(false),
        }
    });
    MoeSpec {
        experts,
        top_k,
        expert_ffn,
        shared_ffn,
        shared_gate: s.bool("shared_gate").unwrap_or(false),
        router,
        capacity,
    }
}
