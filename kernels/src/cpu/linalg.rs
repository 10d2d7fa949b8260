//! CPU implementation of `linalg` ops (to be written).
