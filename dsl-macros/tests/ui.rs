//! Compile-fail cases of `#[moe_model]`: one rule per file under
//! `tests/ui/<topic>/`, each with the exact error text in its `.stderr`.
//!
//! Only compile-fail cases live here: trybuild builds every dependency and
//! dev-dependency of this crate again in its own project, and these cases
//! need only the macro and its light `foldmoe-core` (no default features).
//! Models that pass the macro and are built on the engine (a model declared
//! in place and every model of `models/`) are tested in the root crate, in
//! `tests/declared_models.rs`.
//!
//! One `TestCases` on purpose: trybuild builds all cases of one instance in a
//! single cargo invocation against dependencies it builds once; a second
//! instance would `cargo check` the dependencies a second time.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    for topic in [
        "attr",
        "value",
        "layout",
        "routing",
        "policy",
        "precision",
        "multi",
        "rope",
    ] {
        t.compile_fail(format!("tests/ui/{topic}/*.rs"));
    }
}
