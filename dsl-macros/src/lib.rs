//! `#[moe_model]`: models declared as annotated structs (skeleton: the
//! attribute currently passes its item through unchanged; the parse → check →
//! expand pipeline lands with the DSL issue).

use proc_macro::TokenStream;

/// Declares an MoE model on a struct (not yet expanded: returns the item as is).
#[proc_macro_attribute]
pub fn moe_model(_attr: TokenStream, item: TokenStream) -> TokenStream {
    item
}
