//! `foldmoe plan --model-config FILE`: a model read from a TOML config file
//! plans exactly as the same model declared with `#[moe_model]`, and a bad
//! file fails with one error line naming the file, the key path, the value and
//! the macro's message.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{foldmoe, stderr};

/// A shipped config file, `models/configs/<name>.toml`.
fn shipped(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/configs")
        .join(format!("{name}.toml"))
        .to_str()
        .unwrap()
        .to_string()
}

/// `text` written to a scratch file named `tag.toml`.
fn scratch_config(tag: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("foldmoe-config-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{tag}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// Asserts a failed run with exactly one `error:` line containing every needle.
fn assert_fails_with(o: &Output, needles: &[&str]) {
    assert!(!o.status.success(), "expected failure: {}", stderr(o));
    let err = stderr(o);
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got {err:?}");
    for needle in needles {
        assert!(lines[0].contains(needle), "{:?} lacks {needle:?}", lines[0]);
    }
}

#[test]
fn a_config_file_plans_like_the_declared_model() {
    for (name, layout) in [("tiny", "world=4,ep=4"), ("deepseek-v3", "")] {
        let mut by_config = vec!["plan", "--json", "--rank", "1"];
        let mut by_name = by_config.clone();
        let path = shipped(name);
        by_config.extend(["--model-config", &path]);
        by_name.extend(["--model", name]);
        if !layout.is_empty() {
            by_config.extend(["--layout", layout]);
            by_name.extend(["--layout", layout]);
        }
        let (a, b) = (foldmoe(&by_config), foldmoe(&by_name));
        assert!(a.status.success(), "{name}: {}", stderr(&a));
        assert!(b.status.success(), "{name}: {}", stderr(&b));
        assert_eq!(
            String::from_utf8_lossy(&a.stdout),
            String::from_utf8_lossy(&b.stdout),
            "{name}"
        );
    }
}

#[test]
fn a_bad_config_file_fails_with_the_macro_message_at_its_key() {
    let text =
        std::fs::read_to_string(shipped("tiny"))
            .unwrap()
            .replacen("top_k = 2", "top_k = 17", 1);
    let path = scratch_config("bad-rule", &text);
    let o = foldmoe(&["plan", "--model-config", path.to_str().unwrap()]);
    // The sentence of dsl-macros/tests/ui/routing/top_k_exceeds_experts.stderr.
    assert_fails_with(
        &o,
        &[
            "--model-config",
            "bad-rule.toml",
            "blocks[1].moe.top_k = 17: top_k = 17 must be in 1..=16 (the number of experts)",
        ],
    );

    let text = std::fs::read_to_string(shipped("tiny"))
        .unwrap()
        .replacen("ep = 4", "ep = 3", 1)
        .replacen("z_loss", "z_los", 1);
    let path = scratch_config("bad-keys", &text);
    let o = foldmoe(&["plan", "--model-config", path.to_str().unwrap()]);
    // Parse problems first; the rules run once the file parses.
    assert_fails_with(
        &o,
        &[
            "blocks[1].moe.z_los = 0.001: unknown key `z_los`",
            "did you mean `z_loss`?",
        ],
    );

    let path = scratch_config("bad-toml", "name = \"x\"\nvocab = \n");
    let o = foldmoe(&["plan", "--model-config", path.to_str().unwrap()]);
    assert_fails_with(&o, &["bad-toml.toml: not valid TOML at line 2, column 9"]);

    let o = foldmoe(&["plan", "--model-config", "/nonexistent/model.toml"]);
    assert_fails_with(
        &o,
        &["/nonexistent/model.toml: cannot read the model config"],
    );
}

#[test]
fn a_declared_layout_of_a_config_file_is_checked_at_load() {
    let text = std::fs::read_to_string(shipped("tiny"))
        .unwrap()
        .replacen("ep = 4", "ep = 3", 1);
    let path = scratch_config("bad-layout", &text);
    let o = foldmoe(&["plan", "--model-config", path.to_str().unwrap()]);
    // The sentence of dsl-macros/tests/ui/layout/ep_does_not_divide_experts.stderr.
    assert_fails_with(
        &o,
        &["layout[1].ep = 3: layout `cpu-ep4`: ep = 3 does not divide experts = 16; choose ep in"],
    );
}

#[test]
fn model_and_model_config_exclude_each_other() {
    let path = shipped("tiny");
    let o = foldmoe(&["plan", "--model", "tiny", "--model-config", &path]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("cannot be used with"), "{}", stderr(&o));
}
