//! CPU implementation of `attention` ops (to be written).
