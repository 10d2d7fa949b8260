//! foldmoe's kernel layer: the [`Backend`] trait and its devices.
//!
//! - [`cpu::Cpu`]: the reference backend and the default device (f32, f64 for
//!   gradient checks), multi-threaded with rayon.
//! - [`cuda::Cuda`]: the GPU backend on cudarc (dynamic loading: it builds
//!   everywhere and names what is missing where no GPU or driver is found);
//! - [`comm`]: collectives between ranks ([`comm::Communicator`]).

pub mod backend;
pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod error;
pub mod fp8;
pub mod gradcheck;
pub mod tensor;

pub use backend::{
    AdamWConfig, AttentionOps, Backend, Device, DropPolicy, ElementwiseOps, Fp8Ops,
    GatheredGemmOps, LinalgOps, LossOps, NormOps, OffloadOps, OptimOps, Rope, RoutingOps,
    RoutingPlan, Yarn,
};
pub use comm::{Communicator, Group, Pending, ReduceOp};
pub use error::{KernelError, Result};
pub use tensor::{DType, HostData, StorageInfo, Tensor};
