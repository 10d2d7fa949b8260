// fp8 (e4m3) storage of saved activations, one f32 scale per 1×128 block of
// a row: the device form of kernels/src/fp8.rs's host reference, with the
// same f32 steps, so codes and scales are equal bit for bit.
#include <cuda_fp8.h>

#define FP8_BLOCK 128

template <typename T> __device__ __forceinline__ float to_f32v(T x) { return (float)to_acc(x); }
template <> __device__ __forceinline__ float to_f32v<double>(double x) { return __double2float_rn(x); }

// A block of threads per row (grid-stride over rows); each warp takes the
// row's 128-element blocks in turn: four values a lane, the block's amax by
// shuffles, scale = amax / 448 (1 if the block is all zero), codes rounded to
// nearest even and saturated. Lanes take elements j·32 + lane, so the byte
// stores of a warp are contiguous.
template <typename T>
__device__ void fp8_compress_impl(const T* x, unsigned char* codes, float* scales, i64 rows, i64 cols) {
    const i64 bpr = (cols + FP8_BLOCK - 1) / FP8_BLOCK;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        for (i64 bi = warp; bi < bpr; bi += nw) {
            const i64 c0 = bi * FP8_BLOCK;
            const i64 len = min((i64)FP8_BLOCK, cols - c0);
            const T* src = x + r * cols + c0;
            float v[4];
            float amax = 0.f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int c = j * 32 + lane;
                v[j] = c < len ? to_f32v(src[c]) : 0.f;
                amax = fmaxf(amax, fabsf(v[j]));
            }
            for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            const float scale = amax > 0.f ? amax / 448.f : 1.f;
            if (lane == 0) scales[r * bpr + bi] = scale;
            unsigned char* dst = codes + r * cols + c0;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int c = j * 32 + lane;
                if (c < len) dst[c] = __nv_cvt_float_to_fp8(v[j] / scale, __NV_SATFINITE, __NV_E4M3);
            }
        }
    }
}

template <typename T> __device__ __forceinline__ T from_f32v(float v);
template <> __device__ __forceinline__ float from_f32v<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_f32v<double>(float v) { return (double)v; }
template <> __device__ __forceinline__ bf16 from_f32v<bf16>(float v) { return __float2bfloat16_rn(v); }

// A block of threads per row; each value is decode(code) · its block's scale
// in f32, then stored in T (rounded to nearest for bf16).
template <typename T>
__device__ void fp8_expand_impl(const unsigned char* codes, const float* scales, T* out, i64 rows, i64 cols) {
    const i64 bpr = (cols + FP8_BLOCK - 1) / FP8_BLOCK;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            const __half_raw h = __nv_cvt_fp8_to_halfraw(codes[r * cols + c], __NV_E4M3);
            const float v = __half2float(__half(h)) * scales[r * bpr + c / FP8_BLOCK];
            out[r * cols + c] = from_f32v<T>(v);
        }
    }
}

#define FP8(sfx, T) \
    extern "C" __global__ void fp8_compress_##sfx(const T* x, unsigned char* codes, float* scales, i64 rows, i64 cols) { \
        fp8_compress_impl<T>(x, codes, scales, rows, cols); } \
    extern "C" __global__ void fp8_expand_##sfx(const unsigned char* codes, const float* scales, T* out, i64 rows, i64 cols) { \
        fp8_expand_impl<T>(codes, scales, out, rows, cols); }
FOR_FLOATS(FP8)
