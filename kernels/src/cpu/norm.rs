//! CPU implementation of `norm` ops (to be written).
