//! Model config files (TOML): the second front end of the model IR, beside
//! the `#[moe_model]` macro, for models chosen at launch rather than compiled
//! in.
//!
//! A config file says what the macro's attributes say, with the same key
//! names (the tables of [`keywords`]), and goes through the same rules
//! ([`ModelSpec::check`] and [`layout::check`]), so a mistake gets the
//! macro's message, pointed at the key path in the file instead of a span:
//!
//! ```toml
//! name = "tiny"
//! vocab = 256
//! hidden = 128
//! seq_len = 128
//!
//! [[layout]]               # one table per named layout, as layout(...)
//! name = "cpu"
//! world = 1
//!
//! [[blocks]]               # one table per group of blocks, as #[blocks(...)]
//! count = 3
//! recompute = ["moe_act"]  # policy keys sit in the group, as in the macro
//! precision = "bf16"
//! attention = { heads = 4, kv_heads = 2, head_dim = 32 }
//! [blocks.moe]             # or [blocks.dense] with ffn
//! experts = 16
//! top_k = 2
//! expert_ffn = 128
//! score = "softmax"        # keyword values are strings
//! capacity = { factor = 1.25, drop = "probs" }
//! ```
//!
//! The file is read as a plain TOML table and walked with the key tables
//! rather than through serde's derive with `deny_unknown_fields`: that way an
//! unknown key is refused just the same, but every mistake in the file is
//! reported at once (serde stops at the first), each names its key path and
//! value (`blocks[1].moe.top_k = 9`), and the accepted words cannot drift from
//! the macro's, being the same table.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use toml::{Table, Value};

use crate::layout::{self, LayoutSpec};
use crate::spec::{
    keywords, AttentionSpec, BlockGroup, CapacitySpec, FfnSpec, MlaSpec, ModelSpec, MoeSpec,
    Policy, RopeScaling, RouterSpec,
};

/// A model read from a config file: the same IR the macro produces.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The model, checked by [`ModelSpec::check`].
    pub spec: ModelSpec,
    /// Its named layouts in file order, each checked by [`layout::check`].
    pub layouts: Vec<LayoutSpec>,
}

/// One mistake in a config file.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    /// Where in the file: a key path such as `blocks[1].moe.top_k` or
    /// `layout[0].ep` (the nearest enclosing table when the rule is about a
    /// key left to its default; empty for the top level).
    pub key: String,
    /// The value as written at `key`, when it is a value and not a table.
    pub value: Option<String>,
    /// What is wrong and how to fix it (for rules: the macro's message).
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.value, self.key.is_empty()) {
            (Some(v), _) => write!(f, "{} = {v}: {}", self.key, self.message),
            (None, false) => write!(f, "{}: {}", self.key, self.message),
            (None, true) => f.write_str(&self.message),
        }
    }
}

/// Why a config file gave no model.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read the model config: {source}")]
    Read {
        /// The file.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not TOML.
    #[error("{file}: not valid TOML at line {line}, column {column}: {message}")]
    Syntax {
        /// The file.
        file: String,
        /// Line of the mistake, from 1.
        line: usize,
        /// Column of the mistake, from 1.
        column: usize,
        /// The TOML parser's message.
        message: String,
    },
    /// The file is TOML but not a valid model: every problem found.
    #[error("{}", invalid(file, problems))]
    Invalid {
        /// The file.
        file: String,
        /// Every problem: the keys and values of the top level, of each
        /// `[[blocks]]` and of each `[[layout]]`, else the model's and the
        /// layouts' rules.
        problems: Vec<Problem>,
    },
}

/// Every problem on one line after the file name, as the CLI prints errors.
fn invalid(file: &str, problems: &[Problem]) -> String {
    let all: Vec<String> = problems.iter().map(Problem::to_string).collect();
    format!("{file}: {}", all.join("; "))
}

/// Line and column (from 1) of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

impl ModelConfig {
    /// Reads a model from TOML text (named `model config` in errors).
    pub fn from_toml_str(text: &str) -> Result<ModelConfig, ConfigError> {
        Self::parse(text, "model config")
    }

    /// Reads a model from the TOML file at `path` (named by its path in errors).
    pub fn load(path: impl AsRef<Path>) -> Result<ModelConfig, ConfigError> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            file: file.clone(),
            source,
        })?;
        Self::parse(&text, &file)
    }

    /// The spec and layouts, as the macro's `MoeModel::spec()` and
    /// `layouts()` give them.
    pub fn into_parts(self) -> (ModelSpec, Vec<LayoutSpec>) {
        (self.spec, self.layouts)
    }

    /// The layout named `name`; an error lists the names in the file.
    pub fn layout(&self, name: &str) -> Result<&LayoutSpec, String> {
        self.layouts.iter().find(|l| l.name == name).ok_or_else(|| {
            let names: Vec<&str> = self.layouts.iter().map(|l| l.name.as_str()).collect();
            format!(
                "unknown layout `{name}`; the config declares: {}",
                names.join(", ")
            )
        })
    }

    /// Parses, then (when the file parsed cleanly, as the macro does, so a
    /// missing key does not come back as a rule error about its placeholder)
    /// runs every model and layout rule.
    fn parse(text: &str, file: &str) -> Result<ModelConfig, ConfigError> {
        let table: Table = text.parse().map_err(|e: toml::de::Error| {
            let (line, column) = line_column(text, e.span().map_or(0, |r| r.start));
            ConfigError::Syntax {
                file: file.to_string(),
                line,
                column,
                message: e.message().trim_end().to_string(),
            }
        })?;
        let mut cx = Cx::default();
        let config = read_model(&mut cx, &table);
        if cx.problems.is_empty() {
            check(&mut cx, &config);
        }
        if cx.problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid {
                file: file.to_string(),
                problems: cx.problems,
            })
        }
    }
}

/// Problems so far, and for every key written, its key path and value by the
/// IR path the rules blame (the macro's `Spans`, with key paths for spans).
#[derive(Default)]
struct Cx {
    problems: Vec<Problem>,
    written: HashMap<String, (String, Option<String>)>,
}

impl Cx {
    fn problem(&mut self, key: &str, value: Option<String>, message: impl Into<String>) {
        self.problems.push(Problem {
            key: key.to_string(),
            value,
            message: message.into(),
        });
    }

    /// The key written for IR `path`, or for the nearest enclosing path
    /// written (`groups[1].moe.router.pre_softmax` → `blocks[1].moe`).
    fn find(&self, path: &str) -> (String, Option<String>) {
        let mut p = path;
        loop {
            if let Some(w) = self.written.get(p) {
                return w.clone();
            }
            match p.rfind(['.', '[']) {
                Some(i) if i > 0 => p = &p[..i],
                _ => return (String::new(), None),
            }
        }
    }
}

/// How a value is shown in a problem: as TOML writes it; tables not at all
/// (the key path names them).
fn shown(v: &Value) -> Option<String> {
    match v {
        Value::Table(_) => None,
        Value::Array(a) if a.iter().any(Value::is_table) => None,
        other => Some(other.to_string()),
    }
}

/// How a value was written, for "found ..." (the macro's words where TOML
/// has the same kind of value).
fn describe(v: &Value) -> String {
    match v {
        Value::String(s) => format!("the string {s:?}"),
        Value::Integer(i) => format!("the integer {i}"),
        Value::Float(f) => format!("the number {f}"),
        Value::Boolean(b) => format!("`{b}`"),
        Value::Datetime(d) => format!("the date {d}"),
        Value::Array(_) => "a list `[...]`".into(),
        Value::Table(_) => "a table".into(),
    }
}

/// One TOML table read with a key table: unknown keys are reported when it
/// is opened, and every known key written is recorded in [`Cx::written`].
struct Section<'t> {
    table: &'t Table,
    /// Key path of the table (`blocks[1].moe`; empty at the top level).
    key: String,
    /// IR path of the table (`groups[1].moe`; empty at the top level).
    ir: String,
    keys: &'static [(&'static str, &'static str)],
    /// Keys suggested for unknown ones (`hidden` for `hidden_size`): not
    /// reported missing too, which would say the same thing twice.
    suggested: Vec<&'static str>,
}

impl<'t> Section<'t> {
    /// Opens `table` at `key` / `ir`; `extra` keys are read by the caller
    /// (the top level's `blocks`) and accepted without being recorded.
    fn open(
        cx: &mut Cx,
        table: &'t Table,
        key: String,
        ir: String,
        keys: &'static [(&'static str, &'static str)],
        extra: &[&'static str],
    ) -> Self {
        let mut s = Section {
            table,
            key,
            ir,
            keys,
            suggested: Vec::new(),
        };
        for (k, v) in table {
            if extra.contains(&k.as_str()) {
                continue;
            }
            match keys.iter().find(|(name, _)| name == k) {
                Some((_, ir)) => {
                    let (kp, ip) = (s.key_path(k), s.ir_path(ir));
                    cx.written.insert(ip, (kp, shown(v)));
                }
                None => {
                    let mut names: Vec<&'static str> = keys.iter().map(|(n, _)| *n).collect();
                    names.extend(extra);
                    let suggestion = keywords::suggest(k, &names);
                    s.suggested.extend(suggestion);
                    let hint = suggestion
                        .map(|n| format!("did you mean `{n}`? "))
                        .unwrap_or_default();
                    cx.problem(
                        &s.key_path(k),
                        shown(v),
                        format!(
                            "unknown key `{k}` in {}; {hint}expected one of: {}",
                            s.what(),
                            names.join(", ")
                        ),
                    );
                }
            }
        }
        s
    }

    /// The table as a user would name it in a message.
    fn what(&self) -> String {
        if self.key.is_empty() {
            "the model's top level".into()
        } else {
            format!("`{}`", self.key)
        }
    }

    fn key_path(&self, k: &str) -> String {
        if self.key.is_empty() {
            k.to_string()
        } else {
            format!("{}.{k}", self.key)
        }
    }

    fn ir_path(&self, ir: &str) -> String {
        if self.ir.is_empty() {
            ir.to_string()
        } else {
            format!("{}.{ir}", self.ir)
        }
    }

    /// The IR path of key `k` (through the key table).
    fn ir_of(&self, k: &str) -> String {
        let ir = self
            .keys
            .iter()
            .find(|(n, _)| *n == k)
            .map_or(k, |(_, ir)| ir);
        self.ir_path(ir)
    }

    fn get(&self, k: &str) -> Option<&'t Value> {
        self.table.get(k)
    }

    fn wrong(&self, cx: &mut Cx, k: &str, v: &Value, expected: &str) {
        cx.problem(
            &self.key_path(k),
            shown(v),
            format!("`{k}` expects {expected}; found {}", describe(v)),
        );
    }

    /// Reports that required key `k` is missing, at this table's key path.
    fn missing(&self, cx: &mut Cx, k: &str, example: &str) {
        if self.suggested.contains(&k) {
            return;
        }
        let whom = if self.key.is_empty() {
            "the model "
        } else {
            ""
        };
        cx.problem(
            &self.key,
            None,
            format!("{whom}needs `{k}`, like `{example}`"),
        );
    }

    fn int(&self, cx: &mut Cx, k: &str) -> Option<usize> {
        let v = self.get(k)?;
        let expected = format!("an integer, like `{k} = 8`");
        match v {
            Value::Integer(i) if *i < 0 => {
                cx.problem(
                    &self.key_path(k),
                    shown(v),
                    format!("`{k}` cannot be negative; found {i}, expected {expected}"),
                );
                None
            }
            Value::Integer(i) => match usize::try_from(*i) {
                Ok(n) => Some(n),
                Err(e) => {
                    cx.problem(
                        &self.key_path(k),
                        shown(v),
                        format!("`{k}` = {i} is not a usize: {e}"),
                    );
                    None
                }
            },
            _ => {
                self.wrong(cx, k, v, &expected);
                None
            }
        }
    }

    fn req_int(&self, cx: &mut Cx, k: &str) -> usize {
        match self.get(k) {
            Some(_) => self.int(cx, k).unwrap_or(0),
            None => {
                self.missing(cx, k, &format!("{k} = 8"));
                0
            }
        }
    }

    fn float(&self, cx: &mut Cx, k: &str) -> Option<f64> {
        let v = self.get(k)?;
        let expected = format!("a number, like `{k} = 1e-3`");
        let x = match v {
            Value::Float(f) => *f,
            Value::Integer(i) => *i as f64,
            _ => {
                self.wrong(cx, k, v, &expected);
                return None;
            }
        };
        if !x.is_finite() {
            cx.problem(
                &self.key_path(k),
                shown(v),
                format!("`{k}` = {x} is not a finite number"),
            );
            None
        } else if x < 0.0 {
            // As in the macro: no rate, coefficient or size is negative.
            cx.problem(
                &self.key_path(k),
                shown(v),
                format!("`{k}` cannot be negative; found {x}, expected {expected}"),
            );
            None
        } else {
            Some(x)
        }
    }

    fn bool(&self, cx: &mut Cx, k: &str) -> Option<bool> {
        let v = self.get(k)?;
        match v {
            Value::Boolean(b) => Some(*b),
            _ => {
                self.wrong(cx, k, v, &format!("a bool, like `{k} = true`"));
                None
            }
        }
    }

    fn string(&self, cx: &mut Cx, k: &str) -> Option<&'t str> {
        let v = self.get(k)?;
        match v {
            Value::String(s) => Some(s),
            _ => {
                self.wrong(cx, k, v, &format!("a string, like `{k} = \"...\"`"));
                None
            }
        }
    }

    /// `k = "word"` with `word` from `table`.
    fn keyword<T: Copy>(&self, cx: &mut Cx, k: &str, table: &[(&str, T)]) -> Option<T> {
        let v = self.get(k)?;
        let Value::String(word) = v else {
            let names: Vec<String> = table.iter().map(|(n, _)| format!("\"{n}\"")).collect();
            self.wrong(cx, k, v, &format!("one of {}", names.join(", ")));
            return None;
        };
        match keywords::lookup(table, &format!("`{k}` value"), word) {
            Ok(x) => Some(x),
            Err(msg) => {
                cx.problem(&self.key_path(k), shown(v), msg);
                None
            }
        }
    }

    /// `k = ["a", "b"]` with each word from `table`; each accepted word is
    /// recorded under its index, so a rule about one part names it.
    fn parts<T: Copy>(&self, cx: &mut Cx, k: &str, table: &[(&str, T)]) -> Vec<T> {
        let Some(v) = self.get(k) else {
            return Vec::new();
        };
        let Value::Array(items) = v else {
            self.wrong(
                cx,
                k,
                v,
                &format!("a list of parts, like `{k} = [\"{}\"]`", table[0].0),
            );
            return Vec::new();
        };
        let ir = self.ir_of(k);
        let mut out = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let at = format!("{}[{i}]", self.key_path(k));
            let Value::String(word) = item else {
                cx.problem(
                    &at,
                    shown(item),
                    format!(
                        "`{k}` holds part names as strings; found {}",
                        describe(item)
                    ),
                );
                continue;
            };
            match keywords::lookup(table, &format!("{k} part"), word) {
                Ok(x) => {
                    cx.written
                        .insert(format!("{ir}[{}]", out.len()), (at, shown(item)));
                    out.push(x);
                }
                Err(msg) => cx.problem(&at, shown(item), msg),
            }
        }
        out
    }

    /// `k = [1, 2]`.
    fn int_list(&self, cx: &mut Cx, k: &str) -> Option<Vec<usize>> {
        let v = self.get(k)?;
        let Value::Array(items) = v else {
            self.wrong(
                cx,
                k,
                v,
                &format!("a list of integers, like `{k} = [4, 4]`"),
            );
            return None;
        };
        let mut out = Vec::new();
        for item in items {
            match item {
                Value::Integer(i) if *i >= 0 => out.push(usize::try_from(*i).ok()?),
                _ => {
                    cx.problem(
                        &self.key_path(k),
                        shown(v),
                        format!("`{k}` holds whole numbers only; found {}", describe(item)),
                    );
                    return None;
                }
            }
        }
        Some(out)
    }

    /// The sub-table `k`, its keys from `keys`.
    fn section(
        &self,
        cx: &mut Cx,
        k: &str,
        keys: &'static [(&'static str, &'static str)],
    ) -> Option<Section<'t>> {
        let v = self.get(k)?;
        let Value::Table(t) = v else {
            self.wrong(cx, k, v, &format!("a table, like `[{}]`", self.key_path(k)));
            return None;
        };
        Some(Section::open(
            cx,
            t,
            self.key_path(k),
            self.ir_of(k),
            keys,
            &[],
        ))
    }

    /// The array of tables `k` (`[[layout]]`), each opened with `keys`; the
    /// i-th gets key path `k[i]` and IR path `ir[i]`.
    fn tables(
        &self,
        cx: &mut Cx,
        k: &str,
        ir: &str,
        keys: &'static [(&'static str, &'static str)],
    ) -> Vec<Section<'t>> {
        let Some(v) = self.get(k) else {
            return Vec::new();
        };
        let Value::Array(items) = v else {
            self.wrong(cx, k, v, &format!("a list of tables, written `[[{k}]]`"));
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let at = format!("{}[{i}]", self.key_path(k));
            let Value::Table(t) = item else {
                cx.problem(
                    &at,
                    shown(item),
                    format!("each `{k}` entry is a table, written `[[{k}]]`"),
                );
                continue;
            };
            cx.written.insert(format!("{ir}[{i}]"), (at.clone(), None));
            out.push(Section::open(cx, t, at, format!("{ir}[{i}]"), keys, &[]));
        }
        out
    }
}

/// The top level: global dims, `[[layout]]` and `[[blocks]]`.
fn read_model(cx: &mut Cx, table: &Table) -> ModelConfig {
    let s = Section::open(
        cx,
        table,
        String::new(),
        String::new(),
        keywords::MODEL_KEYS,
        &["blocks"],
    );
    let name = match s.get("name") {
        Some(_) => s.string(cx, "name").unwrap_or_default().to_string(),
        None => {
            s.missing(cx, "name", "name = \"my-moe\"");
            String::new()
        }
    };
    let vocab = s.req_int(cx, "vocab");
    let hidden = s.req_int(cx, "hidden");
    let seq_len = s.req_int(cx, "seq_len");
    let norm_eps = s
        .float(cx, "norm_eps")
        .unwrap_or(keywords::DEFAULT_NORM_EPS);
    let rope_theta = s
        .float(cx, "rope_theta")
        .unwrap_or(keywords::DEFAULT_ROPE_THETA);
    let rope_scaling = s
        .section(cx, "rope_scaling", keywords::ROPE_SCALING_KEYS)
        .map(|r| read_rope_scaling(cx, &r));
    let tied_embeddings = s.bool(cx, "tied_embeddings").unwrap_or(false);
    let init_std = s
        .float(cx, "init_std")
        .unwrap_or(keywords::DEFAULT_INIT_STD);
    let mtp_layers = s.int(cx, "mtp_layers").unwrap_or(0);
    let mtp_loss_coef = s
        .float(cx, "mtp_loss_coef")
        .unwrap_or(keywords::DEFAULT_MTP_LOSS_COEF);
    let blocks = s.tables(cx, "blocks", "groups", keywords::GROUP_KEYS);
    if s.get("blocks").is_none() {
        s.missing(
            cx,
            "blocks",
            "[[blocks]] with count, attention and dense or moe",
        );
    }
    let groups = blocks.iter().map(|b| read_group(cx, b)).collect();
    let layout_tables = s.tables(cx, "layout", "layouts", keywords::LAYOUT_KEYS);
    if s.get("layout").is_none() {
        s.missing(cx, "layout", "[[layout]] with name = \"cpu\" and world = 1");
    }
    let mut layouts: Vec<LayoutSpec> = Vec::new();
    for l in &layout_tables {
        let spec = read_layout(cx, l);
        if let Some(prev) = layouts.iter().position(|p| p.name == spec.name) {
            cx.problem(
                &l.key_path("name"),
                Some(format!("{:?}", spec.name)),
                format!(
                    "layout name {:?} repeats layout[{prev}]'s; give each layout its own name",
                    spec.name
                ),
            );
        }
        layouts.push(spec);
    }
    ModelConfig {
        spec: ModelSpec {
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
        },
        layouts,
    }
}

/// `[rope_scaling]`: `rope_type` and `factor`, `original_max_position_embeddings`
/// required, the betas defaulting to YaRN's 32 and 1.
fn read_rope_scaling(cx: &mut Cx, s: &Section) -> RopeScaling {
    let kind = match s.get("rope_type") {
        Some(_) => s.keyword(cx, "rope_type", keywords::ROPE_SCALING_TYPE),
        None => {
            s.missing(cx, "rope_type", "rope_type = \"yarn\"");
            None
        }
    };
    let factor = match s.get("factor") {
        Some(_) => s.float(cx, "factor").unwrap_or(1.0),
        None => {
            s.missing(cx, "factor", "factor = 4");
            1.0
        }
    };
    let mut r = RopeScaling::yarn(factor, s.req_int(cx, "original_max_position_embeddings"));
    r.kind = kind.unwrap_or(r.kind);
    r.beta_fast = s.float(cx, "beta_fast").unwrap_or(r.beta_fast);
    r.beta_slow = s.float(cx, "beta_slow").unwrap_or(r.beta_slow);
    r.mscale = s.float(cx, "mscale");
    r.mscale_all_dim = s.float(cx, "mscale_all_dim");
    r
}

/// One `[[layout]]`: the keys given, the rest `LayoutSpec::default()`.
fn read_layout(cx: &mut Cx, s: &Section) -> LayoutSpec {
    let mut l = LayoutSpec::default();
    match s.get("name") {
        Some(_) => {
            if let Some(name) = s.string(cx, "name") {
                if name.is_empty() {
                    cx.problem(
                        &s.key_path("name"),
                        Some("\"\"".into()),
                        "the layout name is empty; name it, like `name = \"cpu\"`",
                    );
                }
                l.name = name.to_string();
            }
        }
        None => s.missing(cx, "name", "name = \"cpu\""),
    }
    l.world = s.req_int(cx, "world");
    for (key, field) in [
        ("tp", &mut l.tp),
        ("cp", &mut l.cp),
        ("pp", &mut l.pp),
        ("vpp", &mut l.vpp),
        ("ep", &mut l.ep),
        ("etp", &mut l.etp),
    ] {
        if let Some(v) = s.int(cx, key) {
            *field = v;
        }
    }
    l.dp = s.int(cx, "dp");
    l.edp = s.int(cx, "edp");
    if let Some(order) = s.string(cx, "order") {
        l.order = order.to_string();
    }
    l.pp_layers = s.int_list(cx, "pp_layers");
    l
}

/// One `[[blocks]]` group.
fn read_group(cx: &mut Cx, s: &Section) -> BlockGroup {
    let count = s.req_int(cx, "count");
    let attention = match s.section(cx, "attention", keywords::ATTENTION_KEYS) {
        Some(a) => read_attention(cx, &a),
        None => {
            if s.get("attention").is_none() {
                s.missing(
                    cx,
                    "attention",
                    "attention = { heads = 8, kv_heads = 2, head_dim = 64 }",
                );
            }
            AttentionSpec::gqa(0, 0, 0)
        }
    };
    let dense = s.section(cx, "dense", keywords::DENSE_KEYS);
    let moe = s.section(cx, "moe", keywords::MOE_KEYS);
    let ffn = match (dense, moe) {
        (Some(d), None) => FfnSpec::Dense {
            ffn: d.req_int(cx, "ffn"),
        },
        (None, Some(m)) => FfnSpec::Moe(read_moe(cx, &m)),
        (Some(_), Some(m)) => {
            cx.problem(
                &m.key,
                None,
                "a group has either dense or moe, not both; split it into two [[blocks]]",
            );
            FfnSpec::Dense { ffn: 0 }
        }
        (None, None) => {
            if s.get("dense").is_none() && s.get("moe").is_none() {
                cx.problem(
                    &s.key,
                    None,
                    "needs its feed-forward part, dense or moe, like `dense = { ffn = 1024 }`",
                );
            }
            FfnSpec::Dense { ffn: 0 }
        }
    };
    let policy = Policy {
        recompute: s.parts(cx, "recompute", keywords::RECOMPUTE),
        offload: s.parts(cx, "offload", keywords::OFFLOAD),
        store_fp8: s.parts(cx, "store_fp8", keywords::OFFLOAD),
        precision: s
            .keyword(cx, "precision", keywords::PRECISION)
            .unwrap_or(Policy::default().precision),
    };
    BlockGroup {
        count,
        attention,
        ffn,
        policy,
    }
}

/// `attention`: `kv_heads` defaults to `heads`, and with MLA `head_dim` to
/// the query/key head dim, as in the macro.
fn read_attention(cx: &mut Cx, s: &Section) -> AttentionSpec {
    let heads = s.req_int(cx, "heads");
    let kv_heads = s.int(cx, "kv_heads").unwrap_or(heads);
    let mla = s.section(cx, "mla", keywords::MLA_KEYS).map(|m| MlaSpec {
        q_lora_rank: m.int(cx, "q_lora_rank").unwrap_or(0),
        kv_lora_rank: m.req_int(cx, "kv_lora_rank"),
        qk_nope_head_dim: m.req_int(cx, "qk_nope_head_dim"),
        qk_rope_head_dim: m.req_int(cx, "qk_rope_head_dim"),
        v_head_dim: m.req_int(cx, "v_head_dim"),
    });
    let head_dim = match (&mla, s.get("head_dim")) {
        (_, Some(_)) => s.int(cx, "head_dim").unwrap_or(0),
        (Some(m), None) => m.qk_nope_head_dim + m.qk_rope_head_dim,
        (None, None) => {
            s.missing(cx, "head_dim", "head_dim = 128");
            0
        }
    };
    AttentionSpec {
        heads,
        kv_heads,
        head_dim,
        mla,
        qk_norm: s.bool(cx, "qk_norm").unwrap_or(false),
        precision: s
            .keyword(cx, "precision", keywords::PRECISION)
            .unwrap_or_default(),
    }
}

/// `moe`: experts, shared experts, router (defaults `RouterSpec::default()`)
/// and capacity, as in the macro.
fn read_moe(cx: &mut Cx, s: &Section) -> MoeSpec {
    let experts = s.req_int(cx, "experts");
    let top_k = s.req_int(cx, "top_k");
    let expert_ffn = s.req_int(cx, "expert_ffn");
    // Megatron sizes the shared experts' MLP as their count times the routed
    // experts' ffn; a different size is written as shared_ffn.
    let shared_ffn = match (s.int(cx, "shared_experts"), s.get("shared_ffn")) {
        (Some(_), Some(v)) => {
            cx.problem(
                &s.key_path("shared_ffn"),
                shown(v),
                "give shared_experts (a count) or shared_ffn (a size), not both",
            );
            0
        }
        (Some(n), None) => n.checked_mul(expert_ffn).unwrap_or_else(|| {
            cx.problem(
                &s.key_path("shared_experts"),
                Some(n.to_string()),
                format!("shared_experts = {n} × expert_ffn = {expert_ffn} overflows"),
            );
            0
        }),
        (None, _) => s.int(cx, "shared_ffn").unwrap_or(0),
    };
    let d = RouterSpec::default();
    let router = RouterSpec {
        score: s.keyword(cx, "score", keywords::SCORE).unwrap_or(d.score),
        pre_softmax: s.bool(cx, "pre_softmax").unwrap_or(d.pre_softmax),
        scaling_factor: s.float(cx, "scaling_factor").unwrap_or(d.scaling_factor),
        groups: s.int(cx, "groups").unwrap_or(d.groups),
        group_top_k: s.int(cx, "group_top_k").unwrap_or(d.group_top_k),
        expert_bias_rate: s.float(cx, "expert_bias").or(d.expert_bias_rate),
        load_balance: s
            .keyword(cx, "load_balance", keywords::LOAD_BALANCE)
            .unwrap_or(d.load_balance),
        aux_coef: s.float(cx, "aux_coef").unwrap_or(d.aux_coef),
        z_loss_coef: s.float(cx, "z_loss").unwrap_or(d.z_loss_coef),
        dtype: s
            .keyword(cx, "router_dtype", keywords::ROUTER_DTYPE)
            .unwrap_or(d.dtype),
    };
    let capacity = s
        .section(cx, "capacity", keywords::CAPACITY_KEYS)
        .map(|c| CapacitySpec {
            factor: match c.get("factor") {
                Some(_) => c.float(cx, "factor").unwrap_or(1.0),
                None => {
                    c.missing(cx, "factor", "factor = 1.25");
                    1.0
                }
            },
            drop_policy: c
                .keyword(cx, "drop", keywords::DROP)
                .unwrap_or(keywords::DROP[0].1),
            pad_to_capacity: c.bool(cx, "pad").unwrap_or(false),
        });
    MoeSpec {
        experts,
        top_k,
        expert_ffn,
        shared_ffn,
        shared_gate: s.bool(cx, "shared_gate").unwrap_or(false),
        router,
        capacity,
    }
}

/// The model rules and every layout's rules, each problem at the key its
/// rule blames, with the macro's message (layout ones prefixed with the
/// layout's name, as the macro does).
fn check(cx: &mut Cx, config: &ModelConfig) {
    if let Err(errs) = config.spec.check() {
        for e in errs {
            let (key, value) = cx.find(&e.path);
            cx.problem(&key, value, e.message);
        }
    }
    for (j, l) in config.layouts.iter().enumerate() {
        if let Err(errs) = layout::check(l, &config.spec) {
            for e in errs {
                let (key, value) = cx.find(&format!("layouts[{j}].{}", e.field));
                cx.problem(&key, value, format!("layout `{}`: {}", e.layout, e.message));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{GemmPrecision, LoadBalance, RecomputePart, ScoreFunction};

    const SMALL: &str = r#"
name = "ui"
vocab = 32
hidden = 16
seq_len = 8

[[layout]]
name = "cpu"
world = 1

[[layout]]
name = "gpu8"
world = 8
tp = 2
ep = 4

[[blocks]]
count = 1
attention = { heads = 4, kv_heads = 2, head_dim = 4 }
dense = { ffn = 32 }

[[blocks]]
count = 2
recompute = ["moe_act", "norm"]
precision = "bf16"
attention = { heads = 4, kv_heads = 2, head_dim = 4, qk_norm = true }
[blocks.moe]
experts = 8
top_k = 2
expert_ffn = 8
shared_experts = 1
score = "softmax"
z_loss = 1e-3
capacity = { factor = 1.25, drop = "position", pad = true }
"#;

    fn problems(text: &str) -> Vec<String> {
        match ModelConfig::from_toml_str(text) {
            Err(ConfigError::Invalid { problems, .. }) => {
                problems.iter().map(|p| p.to_string()).collect()
            }
            other => panic!("expected problems, got {other:?}"),
        }
    }

    /// `SMALL` with `from` replaced by `to` (which must occur).
    fn edit(from: &str, to: &str) -> String {
        assert!(SMALL.contains(from), "{from}");
        SMALL.replacen(from, to, 1)
    }

    /// `attention = { ..., precision = ... }`: fp8_blockwise is read onto
    /// the attention; dims that break the fp8 GEMMs' 16-byte rows, a
    /// precision not executed, and an unknown word are problems naming the
    /// value.
    #[test]
    fn attention_precision_is_read_and_checked() {
        let fp8 = |head_dim: usize, word: &str| {
            edit(
                "attention = { heads = 4, kv_heads = 2, head_dim = 4, qk_norm = true }",
                &format!(
                    "attention = {{ heads = 4, kv_heads = 2, head_dim = {head_dim}, precision = \"{word}\" }}"
                ),
            )
        };
        let c = ModelConfig::from_toml_str(&fp8(16, "fp8_blockwise")).unwrap();
        assert_eq!(
            c.spec.groups[1].attention.precision,
            GemmPrecision::Fp8Blockwise
        );
        assert_eq!(c.spec.groups[0].attention.precision, GemmPrecision::Bf16);
        let p = problems(&fp8(4, "fp8_blockwise"));
        assert!(
            p.iter().any(|m| m.contains("blocks[1].attention.precision")
                && m.contains("need head_dim = 4 to be a multiple of 16; pad it to 16")),
            "{p:?}"
        );
        let p = problems(&fp8(16, "fp8"));
        assert!(
            p.iter()
                .any(|m| m.contains("precision = fp8: this GEMM precision is not executed yet")),
            "{p:?}"
        );
        let p = problems(&fp8(16, "fp4"));
        assert!(p.iter().any(|m| m.contains("fp4")), "{p:?}");
    }

    #[test]
    fn reads_the_same_ir_as_the_macro_would() {
        let c = ModelConfig::from_toml_str(SMALL).unwrap();
        let s = &c.spec;
        assert_eq!((s.name.as_str(), s.vocab, s.layers()), ("ui", 32, 3));
        assert_eq!(s.norm_eps, keywords::DEFAULT_NORM_EPS);
        let g = &s.groups[1];
        assert_eq!(
            g.policy.recompute,
            [RecomputePart::MoeAct, RecomputePart::Norm]
        );
        assert_eq!(g.policy.precision, GemmPrecision::Bf16);
        assert!(g.attention.qk_norm && !s.groups[0].attention.qk_norm);
        let FfnSpec::Moe(m) = &g.ffn else {
            panic!("group 1 is MoE")
        };
        assert_eq!(m.shared_ffn, 8);
        assert_eq!(m.router.score, ScoreFunction::Softmax);
        assert_eq!(m.router.load_balance, LoadBalance::Aux);
        assert_eq!(m.router.z_loss_coef, 1e-3);
        let cap = m.capacity.as_ref().unwrap();
        assert!(cap.pad_to_capacity && cap.factor == 1.25);
        assert_eq!(c.layouts.len(), 2);
        assert_eq!(c.layout("gpu8").unwrap().ep, 4);
        assert_eq!(c.layout("gpu8").unwrap().dp, None);
        assert!(c.layout("tpu").unwrap_err().contains("declares: cpu, gpu8"));
    }

    #[test]
    fn rule_violations_carry_the_macro_message_at_the_key_path() {
        let text = edit("top_k = 2", "top_k = 9").replacen("ep = 4", "ep = 3", 1);
        assert_eq!(
            problems(&text),
            [
                "blocks[1].moe.top_k = 9: top_k = 9 must be in 1..=8 (the number of experts)",
                "layout[1].world = 8: layout `gpu8`: etp(1) × ep(3) × pp(1) = 3 does not divide world = 8; make etp·ep·pp one of {1, 2, 4, 8}",
                "layout[1].ep = 3: layout `gpu8`: ep = 3 does not divide experts = 8; choose ep in {1, 2, 4, 8}",
            ]
        );
    }

    #[test]
    fn policy_problems_name_the_part() {
        let text = edit(
            r#"recompute = ["moe_act", "norm"]"#,
            r#"recompute = ["norm", "mlp_act"]"#,
        );
        assert_eq!(
            problems(&text),
            ["blocks[1].recompute[1] = \"mlp_act\": recompute part `mlp_act` needs a dense MLP, which this group does not have; remove it"]
        );
        let text = edit(
            r#"recompute = ["moe_act", "norm"]"#,
            r#"recompute = ["moe_activation"]"#,
        );
        assert_eq!(
            problems(&text),
            ["blocks[1].recompute[0] = \"moe_activation\": unknown recompute part `moe_activation`; choose one of norm, core_attn, mlp_act, moe_act, router, shared_experts, mla_up_proj, block"]
        );
    }

    /// `router_dtype` (Megatron-Core's `--moe-router-dtype`): `fp32` is read
    /// onto the router, the default is the model's dtype, and another value
    /// is a problem naming the choices.
    #[test]
    fn router_dtype_is_read_and_checked() {
        use crate::spec::RouterDtype;
        let router = |text: &str| {
            let c = ModelConfig::from_toml_str(text).unwrap();
            match &c.spec.groups[1].ffn {
                FfnSpec::Moe(m) => m.router.dtype,
                FfnSpec::Dense { .. } => panic!("group 1 is MoE"),
            }
        };
        assert_eq!(router(SMALL), RouterDtype::Model);
        let fp32 = edit("z_loss = 1e-3", "z_loss = 1e-3\nrouter_dtype = \"fp32\"");
        assert_eq!(router(&fp32), RouterDtype::Fp32);
        let fp16 = edit("z_loss = 1e-3", "z_loss = 1e-3\nrouter_dtype = \"fp16\"");
        assert_eq!(
            problems(&fp16),
            ["blocks[1].moe.router_dtype = \"fp16\": unknown `router_dtype` value `fp16`; choose one of model, fp32"]
        );
    }

    #[test]
    fn every_parse_problem_is_reported_at_once() {
        let text = edit("z_loss = 1e-3", "z_los = 1e-3")
            .replacen("experts = 8", "experts = -8", 1)
            .replacen("vocab = 32", "vocab = \"32\"", 1)
            .replacen(r#"score = "softmax""#, r#"score = "relu""#, 1)
            .replacen("tp = 2", "tp = 2\ntp_size = 2", 1);
        let got = problems(&text);
        assert_eq!(
            got,
            [
                "vocab = \"32\": `vocab` expects an integer, like `vocab = 8`; found the string \"32\"",
                "blocks[1].moe.z_los = 0.001: unknown key `z_los` in `blocks[1].moe`; did you mean `z_loss`? expected one of: experts, top_k, expert_ffn, shared_experts, shared_ffn, shared_gate, score, pre_softmax, scaling_factor, groups, group_top_k, expert_bias, load_balance, aux_coef, z_loss, router_dtype, capacity",
                "blocks[1].moe.experts = -8: `experts` cannot be negative; found -8, expected an integer, like `experts = 8`",
                "blocks[1].moe.score = \"relu\": unknown `score` value `relu`; choose one of softmax, sigmoid",
                "layout[1].tp_size = 2: unknown key `tp_size` in `layout[1]`; did you mean `tp`? expected one of: name, world, tp, cp, dp, pp, vpp, ep, etp, edp, order, pp_layers",
            ],
            "{got:#?}"
        );
    }

    /// `[rope_scaling]`: YaRN in Hugging Face's names, the betas defaulted;
    /// a stretch below 1, betas the wrong way round or another type are
    /// problems at their keys.
    #[test]
    fn rope_scaling_reads_and_its_rules_name_the_key() {
        let yarn = "seq_len = 8\n\n[rope_scaling]\nrope_type = \"yarn\"\nfactor = 40\n\
                    original_max_position_embeddings = 4\nmscale_all_dim = 1.0\n";
        let c = ModelConfig::from_toml_str(&edit("seq_len = 8\n", yarn)).unwrap();
        let mut want = crate::spec::RopeScaling::yarn(40.0, 4);
        want.mscale_all_dim = Some(1.0);
        assert_eq!(c.spec.rope_scaling, Some(want));
        let bad =
            |from: &str, to: &str| problems(&edit("seq_len = 8\n", &yarn.replacen(from, to, 1)));
        assert_eq!(
            bad("factor = 40", "factor = 0.5"),
            ["rope_scaling.factor = 0.5: factor = 0.5; YaRN stretches the context by a finite factor ≥ 1"]
        );
        assert_eq!(
            bad("factor = 40", "factor = 40\nbeta_fast = 1\nbeta_slow = 2"),
            ["rope_scaling.beta_fast = 1: beta_fast = 1 is not above beta_slow = 2; the ramp runs from beta_slow up to beta_fast (32 and 1 by default)"]
        );
        assert_eq!(
            bad("\"yarn\"", "\"llama3\""),
            ["rope_scaling.rope_type = \"llama3\": unknown `rope_type` value `llama3`; choose one of yarn"]
        );
    }

    #[test]
    fn missing_keys_name_the_table_and_an_example() {
        let text = edit("top_k = 2\n", "");
        assert_eq!(
            problems(&text),
            ["blocks[1].moe: needs `top_k`, like `top_k = 8`"]
        );
        let text = SMALL.replace("[[layout]]\nname = \"cpu\"\nworld = 1\n\n[[layout]]\nname = \"gpu8\"\nworld = 8\ntp = 2\nep = 4\n", "");
        assert_eq!(
            problems(&text),
            ["the model needs `layout`, like `[[layout]] with name = \"cpu\" and world = 1`"]
        );
    }

    #[test]
    fn a_suggested_key_is_not_also_reported_missing() {
        let text = SMALL.replacen("hidden = 16", "hidden_size = 16", 1);
        assert_eq!(
            problems(&text),
            ["hidden_size = 16: unknown key `hidden_size` in the model's top level; did you mean `hidden`? expected one of: name, vocab, hidden, seq_len, norm_eps, rope_theta, rope_scaling, tied_embeddings, init_std, mtp_layers, mtp_loss_coef, layout, blocks"]
        );
    }

    #[test]
    fn duplicate_layout_names_are_refused() {
        let text = edit("name = \"gpu8\"", "name = \"cpu\"");
        assert_eq!(
            problems(&text),
            ["layout[1].name = \"cpu\": layout name \"cpu\" repeats layout[0]'s; give each layout its own name"]
        );
    }

    #[test]
    fn syntax_and_read_errors_name_the_file() {
        let e = ModelConfig::from_toml_str("name = \"x\"\nvocab = ")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("model config: not valid TOML at line 2, column 9: "),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
        let e = ModelConfig::load("/nonexistent/model.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("/nonexistent/model.toml: cannot read the model config"),
            "{e}"
        );
    }

    #[test]
    fn a_rule_about_a_default_names_the_enclosing_table() {
        // pre_softmax is not written: the rule blames top_k, which is.
        let text = edit("top_k = 2", "top_k = 1");
        assert_eq!(
            problems(&text),
            ["blocks[1].moe.top_k = 1: top_k = 1 with softmax after top-k gives every token weight 1 and no router gradient; set pre_softmax"]
        );
        // vpp is not a key of either layout here: the layout table is named.
        let text = edit("world = 8", "world = 8\npp = 2");
        assert_eq!(
            problems(&text),
            ["layout[1].pp = 2: layout `gpu8`: layers = 3 do not split evenly over pp(2) × vpp(1) = 2 stages; declare pp_layers with 2 entries summing to 3 (e.g. [2, 1]), or choose pp·vpp in {1, 3}"]
        );
    }
}
