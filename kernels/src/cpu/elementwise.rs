//! CPU implementation of `elementwise` ops (to be written).
