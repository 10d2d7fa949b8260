//! Models shipped with foldmoe. For now the default `tiny` model is built
//! directly as a [`ModelSpec`]; the `#[moe_model]` declarations replace this
//! with the DSL issue.

use foldmoe_core::spec::*;

/// The default model: a small MoE language model over bytes that trains on a
/// CPU in minutes: about 2.9 M parameters, 0.86 M active per token (a dense
/// first block, then three MoE blocks with 16 routed experts, top-2, and one
/// shared expert).
pub fn tiny() -> ModelSpec {
    let attention = AttentionSpec::gqa(4, 2, 32);
    ModelSpec {
        name: "tiny".into(),
        vocab: 256,
        hidden: 128,
        seq_len: 128,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        tied_embeddings: false,
        init_std: 0.02,
        groups: vec![
            BlockGroup::new(1, attention.clone(), FfnSpec::Dense { ffn: 384 }),
            BlockGroup::new(
                3,
                attention,
                FfnSpec::Moe(MoeSpec {
                    experts: 16,
                    top_k: 2,
                    expert_ffn: 128,
                    shared_ffn: 128,
                    shared_gate: false,
                    router: RouterSpec {
                        aux_coef: 1e-2,
                        z_loss_coef: 1e-3,
                        ..RouterSpec::default()
                    },
                    capacity: None,
                }),
            ),
        ],
        mtp_layers: 0,
    }
}

/// Looks a model up by name; an error lists the known names.
pub fn by_name(name: &str) -> Result<ModelSpec, String> {
    match name {
        "tiny" => Ok(tiny()),
        other => Err(format!("unknown model `{other}`; known models: tiny")),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tiny_is_valid() {
        super::tiny().check().unwrap();
    }
}
