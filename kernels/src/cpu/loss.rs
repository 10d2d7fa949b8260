//! CPU implementation of `loss` ops (to be written).
