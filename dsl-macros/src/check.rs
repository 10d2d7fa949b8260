//! The rules, run at compile time by calling the very functions the runtime
//! calls — [`ModelSpec::check`](foldmoe_core::spec::ModelSpec::check) and
//! [`foldmoe_core::layout::check`] — so the macro and a launch can never
//! disagree. Nothing here re-implements a rule: each error the core returns
//! blames an IR path or a layout key, and is reported at the span where that
//! key was written (or the nearest enclosing key when it was left to its
//! default).

use std::panic::{catch_unwind, AssertUnwindSafe};

use foldmoe_core::layout;

use crate::ast::Decl;
use crate::ctxt::Ctxt;

/// Runs every model and layout rule and reports each violation at its key.
pub fn check(cx: &Ctxt, decl: &Decl) {
    model_rules(cx, decl);
    for (j, l) in decl.layouts.iter().enumerate() {
        layout_rules(cx, decl, j, l);
    }
}

/// The model rules (`ModelSpec::check`): every `SpecError.path` names the IR
/// field it blames, which [`crate::ast::Spans`] maps back to the key.
fn model_rules(cx: &Ctxt, decl: &Decl) {
    let result = guarded(cx, decl, "model", || decl.spec.check());
    if let Some(Err(errs)) = result {
        for e in errs {
            cx.error(decl.spans.find(&e.path), e.message);
        }
    }
}

/// The layout rules (`layout::check`) for the `j`-th layout: each
/// `LayoutError.field` names the layout key it blames.
fn layout_rules(cx: &Ctxt, decl: &Decl, j: usize, l: &crate::ast::LayoutDecl) {
    let result = guarded(cx, decl, "layout", || layout::check(&l.spec, &decl.spec));
    if let Some(Err(errs)) = result {
        for e in errs {
            let span = decl.spans.find(&format!("layouts[{j}].{}", e.field));
            cx.error(span, format!("layout `{}`: {}", e.layout, e.message));
        }
    }
}

/// Runs a core check; a panic inside it (a bug there, never the user's) is
/// turned into an error instead of crashing the compiler.
fn guarded<T>(cx: &Ctxt, decl: &Decl, what: &str, f: impl FnOnce() -> T) -> Option<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => Some(v),
        Err(_) => {
            cx.error(
                decl.spans.find(""),
                format!("internal error: foldmoe-core's {what} rules panicked on this declaration; please report it"),
            );
            None
        }
    }
}
