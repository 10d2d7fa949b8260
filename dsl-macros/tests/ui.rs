//! Compile-fail and pass cases of `#[moe_model]`: one rule per file under
//! `tests/ui/<topic>/`, each with the exact error text in its `.stderr`;
//! `pass/` builds a small model and every model of `models/` (each model file
//! compiled as a module, so the case cannot drift from the shipped model).
//!
//! One `TestCases` on purpose: trybuild builds all cases of one instance in a
//! single cargo invocation against dependencies it builds once; a second
//! instance for the compile-fail cases alone would `cargo check` the
//! dependencies a second time.

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
    ] {
        t.compile_fail(format!("tests/ui/{topic}/*.rs"));
    }
    t.pass("tests/ui/pass/*.rs");
}
