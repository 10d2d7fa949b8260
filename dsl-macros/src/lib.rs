//! `#[moe_model]`: a Mixture-of-Experts model declared as an annotated struct.
//!
//! The pipeline is visible in the file names:
//! [`ast`] (the user's struct as a typed tree with its spans) →
//! [`attr`] (the attributes parsed into the IR, every key's span recorded) →
//! [`check`] (the IR checked by `foldmoe-core`'s own rules, each error mapped
//! back to the key it blames) → [`expand`] (the typed model, its layout enum
//! and its `MoeModel` impl). Errors are collected in a [`ctxt::Ctxt`], so every
//! mistake is reported at once, each at its own key.
//!
//! See the `#[moe_model]` documentation for the syntax.

mod ast;
mod attr;
mod check;
mod ctxt;
mod expand;

use proc_macro::TokenStream;

/// Declares an MoE model on a struct whose fields are its groups of blocks.
///
/// ```ignore
/// use foldmoe_core::engine::declared::MoeModel;
/// use foldmoe_macros::moe_model;
///
/// #[moe_model(name = "my-moe", vocab = 256, hidden = 64, seq_len = 32,
///     layout(name = "cpu", world = 1),
///     layout(name = "h100x8", world = 8, ep = 4))]
/// pub struct MyMoe {
///     #[blocks(count = 1, attention(heads = 4, kv_heads = 2, head_dim = 16), dense(ffn = 128))]
///     dense: Blocks,
///     #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 16),
///         moe(experts = 8, top_k = 2, expert_ffn = 32, shared_experts = 1),
///         recompute(moe_act), precision = bf16)]
///     moe: Blocks,
/// }
/// ```
///
/// Model keys: `name` (string, required), `vocab`, `hidden`, `seq_len`
/// (required), `norm_eps` (1e-5), `rope_theta` (10000.0), `tied_embeddings`
/// (false), `init_std` (0.02), `mtp_layers` (0), and one `layout(...)` per
/// named layout: `name`, `world` (required), `tp`, `cp`, `dp`, `pp`, `vpp`,
/// `ep`, `etp`, `edp`, `order` (string), `pp_layers = [..]`.
///
/// Group keys (`#[blocks(...)]` on each field, fields typed `Blocks`):
/// `count`; `attention(heads, kv_heads = heads, head_dim, mla(q_lora_rank = 0,
/// kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim), qk_norm,
/// precision = bf16 | fp8_blockwise)` (the projections' number format);
/// exactly one
/// of `dense(ffn)` and `moe(experts, top_k, expert_ffn, shared_experts |
/// shared_ffn, shared_gate, score = softmax | sigmoid, pre_softmax,
/// scaling_factor, groups, group_top_k, expert_bias = rate, load_balance =
/// none | aux | seq_aux | global_aux, aux_coef, z_loss, router_dtype = model |
/// fp32, capacity(factor, drop = probs | position, pad))`; `recompute(..)`, `offload(..)`, `store_fp8(..)`
/// and `precision = fp32 | bf16 | fp8 | fp8_blockwise` (the routed experts'
/// GEMMs: `bf16`, the default, or `fp8_blockwise` on an MoE group; the others
/// are an error saying so). A bool key written alone (`shared_gate`) means
/// `true`.
///
/// The struct becomes `Name<B: Backend>` implementing
/// `foldmoe_core::engine::declared::MoeModel<B>`, with an enum `NameLayout`
/// of the named layouts; each group field becomes that group as this rank
/// holds it, `DenseGroup<B>` or `MoeGroup<B>` (`m.moe.router(0)`,
/// `m.moe.experts_mut(1)`), and `m.model()` lends the whole engine model.
#[proc_macro_attribute]
pub fn moe_model(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::moe_model(attr.into(), item.into()).into()
}
