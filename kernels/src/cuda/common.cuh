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

// The first statement of every kernel (a CPU test checks each entry point):
// under programmatic dependent launch (mod.rs, `FOLDMOE_PDL=1`, sm_90+) a
// kernel's blocks may start while the kernel before it in the stream still
// runs, so each waits here until that kernel has completed and its writes are
// visible — before any global read or write — and then lets the next
// kernel's blocks be scheduled into the SMs its own finished blocks free.
// What is saved is the launch latency between kernels, not their work. Both
// instructions are no-ops in a kernel launched the ordinary way.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

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

// Warp-per-row kernels: this warp's first row and the warps of the grid
// (the stride of a grid-stride loop over rows).
__device__ __forceinline__ i64 warp_row0() { return ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ i64 warp_count() { return ((i64)gridDim.x * blockDim.x) >> 5; }

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

// ---- tensor-core building blocks (bf16, sm_80+) ----------------------------------------

// Copies 8 consecutive bf16 (16 bytes) when they are all in bounds and
// `vec` says rows are 16-byte aligned, else element by element with zeros
// past `limit` or when `ok` is false.
__device__ __forceinline__ void load8(bf16* dst, const bf16* src, bool ok, i64 avail, bool vec) {
    if (ok && vec && avail >= 8) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        return;
    }
    bf16 zero = __float2bfloat16_rn(0.0f);
    for (int i = 0; i < 8; ++i) dst[i] = (ok && i < avail) ? src[i] : zero;
}

// Like load8, but asynchronous (cp.async, zero-filling what is out of
// bounds) when rows are 16-byte aligned; `safe` is any valid address, read
// instead of `src` when nothing is copied. Unaligned rows fall back to load8.
__device__ __forceinline__ void load8_async(bf16* dst, const bf16* src, const bf16* safe, bool ok, i64 avail, bool vec) {
    if (!vec) {
        load8(dst, src, ok, avail, false);
        return;
    }
    int bytes = !ok || avail <= 0 ? 0 : (avail >= 8 ? 16 : (int)avail * 2);
    unsigned sdst = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sdst), "l"(bytes ? src : safe), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ldmatrix: four 8 × 8 bf16 matrices from shared memory; lane l gives the
// address of row l % 8 of matrix l / 8, and register j receives matrix j.
// With TRANS each matrix arrives transposed.
template <bool TRANS> __device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const bf16* smem_row) {
    unsigned a = (unsigned)__cvta_generic_to_shared(smem_row);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// c += a · b on a 16 × 8 × 16 tile: a row-major (4 registers), b
// column-major (2), c f32 (4), in the fragment layouts of PTX's
// mma.m16n8k16.
__device__ __forceinline__ void mma_bf16_16816(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c[0] += a · b[0..1] and c[1] += a · b[2..3]: the two n-tiles of one
// ldmatrix_x4 load of B.
__device__ __forceinline__ void mma_bf16_16816_x2(float (*c)[4], const unsigned a[4], const unsigned b[4]) {
    mma_bf16_16816(c[0], a, b);
    mma_bf16_16816(c[1], a, b + 2);
}

// Two floats as a packed bf16 pair (lo in the low half), the register form
// of an mma operand.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// Eight consecutive bf16 (16-byte aligned) as floats, in one load; and back.
__device__ __forceinline__ void load8f(const bf16* p, float f[8]) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    for (int u = 0; u < 4; ++u) {
        float2 t = __bfloat1622float2(h[u]);
        f[2 * u] = t.x;
        f[2 * u + 1] = t.y;
    }
}
__device__ __forceinline__ void store8f(bf16* p, const float f[8]) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
    for (int u = 0; u < 4; ++u) h[u] = __floats2bfloat162_rn(f[2 * u], f[2 * u + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
}

// ---------------------------------------------------------------------------
// Hopper (sm_90a) helpers shared by the TMA + wgmma kernels
// (grouped_sm90.cu, attention_sm90.cu); nothing for other architectures.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// A CUtensorMap (128 opaque bytes, linalg.rs's TmaMap), passed by value as a
// __grid_constant__ parameter.
struct __align__(128) TmaMap {
    unsigned long long v[16];
};

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// mbarriers in shared memory (addresses from smem_u32).
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n"
            "}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// TMA tile copies global -> shared, completing on mbarrier bar.
__device__ __forceinline__ void tma_2d(unsigned dst, const TmaMap* map, unsigned bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
            dst),
        "l"((unsigned long long)map), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}
__device__ __forceinline__ void tma_3d(unsigned dst, const TmaMap* map, unsigned bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(
            dst),
        "l"((unsigned long long)map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}
__device__ __forceinline__ void tma_4d(unsigned dst, const TmaMap* map, unsigned bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
        "[%2];\n" ::"r"(dst),
        "l"((unsigned long long)map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator (or register-operand) reads or
// writes across a wgmma fence, commit or wait.
template <int N> __device__ __forceinline__ void wg_pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N> __device__ __forceinline__ void wg_pin(unsigned (&p)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(p[i][e])::"memory");
}

// Skewed consumers of a warp-specialised GEMM (grouped_sm90.cu,
// fp8_sm90.cu): the two consumer warpgroups split each output tile's rows
// and read the same pipeline stages, so started together they reach their
// epilogues together and the tensor cores idle while both store. Warpgroup 1
// instead waits (named barrier BAR, 256 threads) until warpgroup 0 has
// issued its first `steps` pipeline steps, and nothing re-aligns them after:
// each one's epilogue then runs while the other's wgmmas have the tensor
// cores to themselves (measured in NOTES.md, session 47: it pays only in
// the fp8 weight gradient). `steps` is clamped to the ring's `stages`
// (warpgroup 0 issues that many without warpgroup 1 releasing any); 0 turns
// it off. Every member is called warp-uniformly by a whole consumer
// warpgroup.
template <int BAR> struct WgSkew {
    // Warpgroup 0: steps still to issue before it arrives (0 once it has).
    int left;
    __device__ __forceinline__ void begin(int wg, int steps, int stages) {
        steps = steps < stages ? steps : stages;
        left = wg == 0 ? steps : 0;
        if (wg == 1 && steps > 0) asm volatile("bar.sync %0, 256;\n" ::"n"(BAR) : "memory");
    }
    // After each step's wgmmas are issued.
    __device__ __forceinline__ void issued() {
        if (left > 0 && --left == 0) arrive();
    }
    // Warpgroup 0 arrives now if it has not yet (fewer steps, or a wait
    // ahead that needs warpgroup 1).
    __device__ __forceinline__ void end() {
        if (left > 0) {
            left = 0;
            arrive();
        }
    }
    __device__ __forceinline__ void arrive() { asm volatile("bar.arrive %0, 256;\n" ::"n"(BAR) : "memory"); }
};
// The skew in pipeline steps of the bf16 grouped GEMMs, of the fp8 forward
// and data gradient, and of the fp8 weight gradient (compile.rs sets them
// from FOLDMOE_GEMM_SKEW for comparisons).
#ifndef FOLDMOE_GW_SKEW
#define FOLDMOE_GW_SKEW 0
#endif
#ifndef FOLDMOE_F8_SKEW
#define FOLDMOE_F8_SKEW 0
#endif
#ifndef FOLDMOE_F8W_SKEW
#define FOLDMOE_F8W_SKEW 6
#endif

// A wgmma shared-memory descriptor with the 128-byte swizzle.
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
