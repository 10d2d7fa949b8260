// Prepended to every kernel module of the CUDA backend (kernels/src/cuda/*.cu).
//
// Conventions:
// - pointers arrive as 64-bit device addresses, sizes as `long long`;
// - every float kernel is written once as a template over the storage type T
//   (float, double, __nv_bfloat16) and computes in `acc_t<T>` (double for
//   double, float otherwise); `FOR_FLOATS` stamps out one extern "C" entry
//   point per dtype, named `<kernel>_<f32|f64|bf16>`;
// - data-dependent errors (a NaN where none is allowed, an index out of range)
//   cannot be returned from a kernel without a host synchronisation, so the
//   kernel records the first one in the device's `ErrRec`, writes a harmless
//   value instead, and the host reports it at its next read.
#include <cuda_bf16.h>

typedef long long i64;
typedef __nv_bfloat16 bf16;

#define FOR_FLOATS(M) M(f32, float) M(f64, double) M(bf16, bf16)

// The first error of a stream: `code` names the host-side check that failed
// (0 = none), `index` and `value` say where and what.
struct ErrRec {
    unsigned int code;
    unsigned int pad;
    i64 index;
    double value;
};

// Records an error unless one is already recorded (the first one wins).
__device__ __forceinline__ void report_err(ErrRec* e, unsigned int code, i64 index, double value) {
    if (atomicCAS(&e->code, 0u, code) == 0u) {
        e->index = index;
        e->value = value;
    }
}

template <typename T> struct AccT { typedef float type; };
template <> struct AccT<double> { typedef double type; };
template <typename T> using acc_t = typename AccT<T>::type;

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(bf16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> x);
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }
template <> __device__ __forceinline__ bf16 from_acc<bf16>(float x) { return __float2bfloat16_rn(x); }

// Widens any storage type to double (error values, f64 accumulations).
__device__ __forceinline__ double to_f64(float x) { return (double)x; }
__device__ __forceinline__ double to_f64(double x) { return x; }
__device__ __forceinline__ double to_f64(bf16 x) { return (double)__bfloat162float(x); }

// exp/log/sqrt for both accumulation types (overloads pick the precision).
__device__ __forceinline__ float exp_(float x) { return expf(x); }
__device__ __forceinline__ double exp_(double x) { return exp(x); }
__device__ __forceinline__ float log_(float x) { return logf(x); }
__device__ __forceinline__ double log_(double x) { return log(x); }
__device__ __forceinline__ float sqrt_(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt_(double x) { return sqrt(x); }

// +∞ in f64 (NVRTC has no INFINITY macro without the host headers).
__device__ __forceinline__ double inf64() { return __longlong_as_double(0x7ff0000000000000LL); }

template <typename A> __device__ __forceinline__ A neg_inf() { return -(A)__int_as_float(0x7f800000); }

// Grid-stride loop over `n` elements.
#define GRID_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// Sum of `v` over a block of up to 1024 threads (a multiple of 32); every
// thread gets the total. `sh` holds at least 32 values. Warps reduce by
// shuffles in a fixed order, so the result is deterministic.
template <typename A> __device__ A block_sum(A v, A* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : (A)0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Maximum of `v` over the block, like `block_sum`.
template <typename A> __device__ A block_max(A v, A* sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : neg_inf<A>();
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Logistic function, split by sign so `exp` never overflows.
template <typename A> __device__ __forceinline__ A sigmoid_(A x) {
    if (x >= (A)0) return (A)1 / ((A)1 + exp_(-x));
    A e = exp_(x);
    return e / ((A)1 + e);
}
