//! CPU implementation of `routing` ops (to be written).
