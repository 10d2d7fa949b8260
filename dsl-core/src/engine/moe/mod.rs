//! The MoE layer: route → dispatch → compute → combine (to be written).
