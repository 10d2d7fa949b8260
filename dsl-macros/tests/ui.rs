//! Compile-fail and pass cases of `#[moe_model]`: one rule per file under
//! `tests/ui/<topic>/`, each with the exact error text in its `.stderr`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    for topic in ["attr", "layout", "policy", "routing", "multi"] {
        t.compile_fail(format!("tests/ui/{topic}/*.rs"));
    }
    t.pass("tests/ui/pass/*.rs");
}
