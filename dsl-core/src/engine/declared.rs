//! (to be written: the trait a #[moe_model] expansion implements)
