//! CPU implementation of `optim` ops (to be written).
