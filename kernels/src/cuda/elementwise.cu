// Elementwise maps, broadcasts, casts and reductions (ElementwiseOps and the
// Device trait's zeros/cast). Shape letters: R rows, C columns (last dim).

// ---- conversions shared by fill and cast --------------------------------

__device__ __forceinline__ double to_f64(int x) { return (double)x; }

template <typename T> __device__ __forceinline__ T from_f64(double x);
template <> __device__ __forceinline__ float from_f64<float>(double x) { return __double2float_rn(x); }
template <> __device__ __forceinline__ double from_f64<double>(double x) { return x; }
template <> __device__ __forceinline__ bf16 from_f64<bf16>(double x) { return __double2bfloat16(x); }
// Float → i32 truncates toward zero and saturates, NaN → 0 (Rust's `as`).
template <> __device__ __forceinline__ int from_f64<int>(double x) {
    if (isnan(x)) return 0;
    if (x >= 2147483647.0) return 2147483647;
    if (x <= -2147483648.0) return (-2147483647 - 1);
    return (int)trunc(x);
}

// Every dtype pair goes through double: exact for every source value, so the
// one rounding is the final narrowing (as the CPU backend does).
template <typename S, typename D> __device__ void cast_impl(const S* in, D* out, i64 n) {
    GRID_LOOP(i, n) out[i] = from_f64<D>(to_f64(in[i]));
}
#define CAST_TO(sfx_s, S) \
    extern "C" __global__ void cast_##sfx_s##_f32(const S* in, float* out, i64 n) { pdl_enter(); cast_impl<S, float>(in, out, n); } \
    extern "C" __global__ void cast_##sfx_s##_f64(const S* in, double* out, i64 n) { pdl_enter(); cast_impl<S, double>(in, out, n); } \
    extern "C" __global__ void cast_##sfx_s##_bf16(const S* in, bf16* out, i64 n) { pdl_enter(); cast_impl<S, bf16>(in, out, n); } \
    extern "C" __global__ void cast_##sfx_s##_i32(const S* in, int* out, i64 n) { pdl_enter(); cast_impl<S, int>(in, out, n); }
CAST_TO(f32, float)
CAST_TO(f64, double)
CAST_TO(bf16, bf16)
CAST_TO(i32, int)

template <typename T> __device__ void fill_impl(T* out, i64 n, double v) {
    T x = from_f64<T>(v);
    GRID_LOOP(i, n) out[i] = x;
}
#define FILL(sfx, T) \
    extern "C" __global__ void fill_##sfx(T* out, i64 n, double v) { pdl_enter(); fill_impl<T>(out, n, v); }
FOR_FLOATS(FILL)
FILL(i32, int)

// ---- unary maps ----------------------------------------------------------

// Round-to-nearest-even on the f32 bit pattern (see the CPU's f32_to_bf16_bits).
__device__ __forceinline__ float round_bf16_f32(float x) {
    unsigned int b = __float_as_uint(x);
    if (isnan(x)) return __uint_as_float((b & 0xffff0000u) | 0x00400000u);
    unsigned int lsb = (b >> 16) & 1u;
    return __uint_as_float((b + 0x7fffu + lsb) & 0xffff0000u);
}

// f64 → f32 rounding to odd, so the second rounding to bf16 is correct.
__device__ __forceinline__ float f64_to_f32_odd(double x) {
    float f = __double2float_rn(x);
    if (isnan(x) || (double)f == x) return f;
    unsigned int b = __float_as_uint(f);
    if (fabs((double)f) > fabs(x)) b -= 1u;
    return __uint_as_float(b | 1u);
}

__device__ __forceinline__ float round_bf16_(float x) { return round_bf16_f32(x); }
__device__ __forceinline__ double round_bf16_(double x) { return (double)round_bf16_f32(f64_to_f32_odd(x)); }
__device__ __forceinline__ bf16 round_bf16_(bf16 x) { return x; }

enum UnaryOp { U_SCALE = 0, U_SILU, U_SIGMOID, U_LOG_SIGMOID, U_ROUND_BF16, U_SIGN, U_LN, U_RECIP };

// One kernel for every unary map: the switch is uniform across the grid, so
// it costs a branch, not divergence. `sign`, `ln` and `recip` check their
// domain and report the first offender through `err` with `code`.
template <typename T>
__device__ void unary_impl(const T* x, T* out, i64 n, int op, double s, ErrRec* err, unsigned int code) {
    typedef acc_t<T> A;
    GRID_LOOP(i, n) {
        A v = to_acc(x[i]);
        A r;
        switch (op) {
        case U_SCALE: r = v * (A)s; break;
        case U_SILU: r = v * sigmoid_(v); break;
        case U_SIGMOID: r = sigmoid_(v); break;
        case U_LOG_SIGMOID: {
            double d = (double)v;
            r = (A)(fmin(d, 0.0) - log1p(exp(-fabs(d))));
            break;
        }
        case U_ROUND_BF16: out[i] = round_bf16_(x[i]); continue;
        case U_SIGN:
            if (isnan(v)) { report_err(err, code, i, (double)v); r = (A)0; break; }
            r = v > (A)0 ? (A)1 : (v < (A)0 ? (A)-1 : (A)0);
            break;
        case U_LN:
            if (isnan(v) || v < (A)0) { report_err(err, code, i, (double)v); r = (A)0; break; }
            r = log_(v);
            break;
        case U_RECIP:
            if (isnan(v) || v == (A)0) { report_err(err, code, i, (double)v); r = (A)0; break; }
            r = (A)1 / v;
            break;
        default: r = v;
        }
        out[i] = from_acc<T>(r);
    }
}
#define UNARY(sfx, T) \
    extern "C" __global__ void unary_##sfx(const T* x, T* out, i64 n, int op, double s, ErrRec* err, unsigned int code) { pdl_enter(); \
        unary_impl<T>(x, out, n, op, s, err, code); }
FOR_FLOATS(UNARY)

// ---- binary maps -----------------------------------------------------------

enum BinaryOp { B_ADD = 0, B_SUB, B_MUL, B_SILU_BWD, B_SIGMOID_BWD, B_SWIGLU };

// d silu(x) / dx from x and s = sigmoid(x).
template <typename A> __device__ __forceinline__ A silu_grad_of_(A x, A s) { return s * ((A)1 + x * ((A)1 - s)); }
template <typename A> __device__ __forceinline__ A silu_grad_(A x) { return silu_grad_of_(x, sigmoid_(x)); }

template <typename A> __device__ __forceinline__ A binary_apply(A x, A y, int op) {
    switch (op) {
    case B_ADD: return x + y;
    case B_SUB: return x - y;
    case B_MUL: return x * y;
    case B_SILU_BWD: return y * silu_grad_(x);
    case B_SIGMOID_BWD: return y * x * ((A)1 - x);
    case B_SWIGLU: return x * sigmoid_(x) * y;
    default: return x;
    }
}

// bf16 maps are memory-bound: where every operand is 16-byte aligned, a
// thread takes 8 consecutive elements with one 16-byte access per operand
// (load8f / store8f; the same per-element math, so the results are those of
// the scalar loop), and the scalar grid loop covers the last n % 8.
template <typename T> struct IsBf16 { static constexpr bool v = false; };
template <> struct IsBf16<bf16> { static constexpr bool v = true; };
__device__ __forceinline__ bool al16(const void* p) { return ((unsigned long long)p & 15) == 0; }
#define GRID_LOOP_FROM(i, s, n) \
    for (i64 i = (s) + (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

template <typename T> __device__ void binary_impl(const T* a, const T* b, T* out, i64 n, int op) {
    typedef acc_t<T> A;
    i64 start = 0;
    if constexpr (IsBf16<T>::v) {
        if (al16(a) && al16(b) && al16(out)) {
            start = n & ~7LL;
            GRID_LOOP(j, start >> 3) {
                float x[8], y[8], r[8];
                load8f(a + 8 * j, x);
                load8f(b + 8 * j, y);
#pragma unroll
                for (int u = 0; u < 8; ++u) r[u] = binary_apply<float>(x[u], y[u], op);
                store8f(out + 8 * j, r);
            }
        }
    }
    GRID_LOOP_FROM(i, start, n) out[i] = from_acc<T>(binary_apply<A>(to_acc(a[i]), to_acc(b[i]), op));
}
#define BINARY(sfx, T) \
    extern "C" __global__ void binary_##sfx(const T* a, const T* b, T* out, i64 n, int op) { pdl_enter(); binary_impl<T>(a, b, out, n, op); }
FOR_FLOATS(BINARY)

// One sigmoid serves both gradients (its exp and IEEE division are most of
// the op's arithmetic).
template <typename A> __device__ __forceinline__ void swiglu_bwd_apply(A gv, A uv, A d, A& dg, A& du) {
    A s = sigmoid_(gv);
    dg = d * uv * silu_grad_of_(gv, s);
    du = d * gv * s;
}

template <typename T>
__device__ void swiglu_bwd_impl(const T* g, const T* u, const T* dy, T* dg, T* du, i64 n) {
    typedef acc_t<T> A;
    i64 start = 0;
    if constexpr (IsBf16<T>::v) {
        if (al16(g) && al16(u) && al16(dy) && al16(dg) && al16(du)) {
            start = n & ~7LL;
            GRID_LOOP(j, start >> 3) {
                float gv[8], uv[8], d[8], rg[8], ru[8];
                load8f(g + 8 * j, gv);
                load8f(u + 8 * j, uv);
                load8f(dy + 8 * j, d);
#pragma unroll
                for (int e = 0; e < 8; ++e) swiglu_bwd_apply<float>(gv[e], uv[e], d[e], rg[e], ru[e]);
                store8f(dg + 8 * j, rg);
                store8f(du + 8 * j, ru);
            }
        }
    }
    GRID_LOOP_FROM(i, start, n) {
        A rg, ru;
        swiglu_bwd_apply<A>(to_acc(g[i]), to_acc(u[i]), to_acc(dy[i]), rg, ru);
        dg[i] = from_acc<T>(rg);
        du[i] = from_acc<T>(ru);
    }
}
#define SWIGLU_BWD(sfx, T) \
    extern "C" __global__ void swiglu_bwd_##sfx(const T* g, const T* u, const T* dy, T* dg, T* du, i64 n) { pdl_enter(); \
        swiglu_bwd_impl<T>(g, u, dy, dg, du, n); }
FOR_FLOATS(SWIGLU_BWD)

// ---- weighted SwiGLU: the MoE experts' activation with the routing weights ----
// bf16 rows of a multiple of 8 with 16-byte aligned operands (the experts'
// case): 8 columns a thread per 16-byte access, consecutive threads on
// consecutive chunks of the flattened rows, as the unweighted maps run (a
// warp per row of 768 left a warp 3 chunks of work: 0.26 / 0.37 ms at
// 131072 × 768 against the unweighted ops' 0.12 / 0.26; a warp's 3 chunks
// loaded together, 0.38 / 0.43, for the registers). The backward's d p[r] =
// Σ_c dy · silu(g) · u: each block takes SWW_ROWS rows at a time, its
// threads the rows' chunks in order, each chunk's partial sum to shared
// memory; then warp w sums row w's partials (lane-strided, a butterfly: a
// fixed order, the same every run). Other dtypes and shapes: a warp per
// row, a column a lane.
#define SWW_ROWS 8
#define SWW_MAX_CHUNKS 4096

// The bf16 paths' sigmoid: __expf (ex2.approx; 2 + 1.16 |x| ulp) and
// __fdividef (2 ulp; 0 once 1 + e^-x passes 2^126, i.e. x below about -87),
// so a relative error under 1e-5 for |x| < 80, far below bf16's 2^-9
// rounding of the result, in a third of the instructions of sigmoid_'s
// expf and IEEE division, which made these kernels issue-bound (ncu: 78 %
// of issue slots busy at 62 % of DRAM bandwidth). f32 and f64 keep sigmoid_.
__device__ __forceinline__ float sigmoid_bf16_path(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// out[r, c] = silu(g[r, c]) · u[r, c] · p[r].
template <typename T>
__device__ void swiglu_w_impl(const T* __restrict__ g, const T* __restrict__ u, const T* __restrict__ p,
                              T* __restrict__ out, i64 n, i64 f) {
    typedef acc_t<T> A;
    if constexpr (IsBf16<T>::v) {
        if (f % 8 == 0 && al16(g) && al16(u) && al16(out)) {
            i64 cpr = f / 8;
            GRID_LOOP(j, n * cpr) {
                i64 row = j / cpr;
                float pr = to_acc(p[row]), gv[8], uv[8], r[8];
                load8f(g + 8 * j, gv);
                load8f(u + 8 * j, uv);
#pragma unroll
                for (int e = 0; e < 8; ++e) r[e] = gv[e] * sigmoid_bf16_path(gv[e]) * uv[e] * pr;
                store8f(out + 8 * j, r);
            }
            return;
        }
    }
    int lane = threadIdx.x & 31;
    for (i64 row = warp_row0(); row < n; row += warp_count()) {
        A pr = to_acc(p[row]);
        for (i64 c = row * f + lane; c < (row + 1) * f; c += 32) {
            A gv = to_acc(g[c]);
            out[c] = from_acc<T>(gv * sigmoid_(gv) * to_acc(u[c]) * pr);
        }
    }
}
#define SWIGLU_W(sfx, T) \
    extern "C" __global__ void swiglu_w_##sfx(const T* g, const T* u, const T* p, T* out, i64 n, i64 f) { pdl_enter(); \
        swiglu_w_impl<T>(g, u, p, out, n, f); }
FOR_FLOATS(SWIGLU_W)

// With a = silu(g) · u and da = dy · p[r]: dg = da · u · silu'(g), du = da ·
// silu(g), dp[r] = Σ_c dy · a (one sigmoid an element, sg, serves all three).
template <typename A>
__device__ __forceinline__ void swiglu_w_bwd_apply_s(A gv, A uv, A d, A pr, A sg, A& dg, A& du, A& s) {
    s += d * (gv * sg * uv);
    A da = d * pr;
    dg = da * uv * silu_grad_of_(gv, sg);
    du = da * gv * sg;
}
template <typename A> __device__ __forceinline__ void swiglu_w_bwd_apply(A gv, A uv, A d, A pr, A& dg, A& du, A& s) {
    swiglu_w_bwd_apply_s(gv, uv, d, pr, sigmoid_(gv), dg, du, s);
}
// The bf16 path (blocks of 256 threads: SWW_ROWS warps, one a row for the sums).
__device__ void swiglu_w_bwd_rows_bf16(const bf16* __restrict__ g, const bf16* __restrict__ u,
                                       const bf16* __restrict__ p, const bf16* __restrict__ dy, bf16* __restrict__ dg,
                                       bf16* __restrict__ du, bf16* __restrict__ dp, i64 n, int cpr) {
    __shared__ float part[SWW_MAX_CHUNKS];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (i64 r0 = (i64)blockIdx.x * SWW_ROWS; r0 < n; r0 += (i64)gridDim.x * SWW_ROWS) {
        int rows = (int)min((i64)SWW_ROWS, n - r0), chunks = rows * cpr;
        for (int j = threadIdx.x; j < chunks; j += blockDim.x) {
            int rr = j / cpr;
            i64 c = (r0 * cpr + j) * 8;
            float pr = to_acc(p[r0 + rr]), gv[8], uv[8], d[8], rg[8], ru[8], s = 0.f;
            load8f(g + c, gv);
            load8f(u + c, uv);
            load8f(dy + c, d);
#pragma unroll
            for (int e = 0; e < 8; ++e)
                swiglu_w_bwd_apply_s<float>(gv[e], uv[e], d[e], pr, sigmoid_bf16_path(gv[e]), rg[e], ru[e], s);
            store8f(dg + c, rg);
            store8f(du + c, ru);
            part[j] = s;
        }
        __syncthreads();
        if (w < rows) {
            float s = 0.f;
            for (int q = lane; q < cpr; q += 32) s += part[w * cpr + q];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) dp[r0 + w] = __float2bfloat16_rn(s);
        }
        __syncthreads();
    }
}
template <typename T>
__device__ void swiglu_w_bwd_impl(const T* __restrict__ g, const T* __restrict__ u, const T* __restrict__ p,
                                  const T* __restrict__ dy, T* __restrict__ dg, T* __restrict__ du, T* __restrict__ dp,
                                  i64 n, i64 f) {
    typedef acc_t<T> A;
    if constexpr (IsBf16<T>::v) {
        if (f % 8 == 0 && f / 8 * SWW_ROWS <= SWW_MAX_CHUNKS && al16(g) && al16(u) && al16(dy) && al16(dg) &&
            al16(du)) {
            swiglu_w_bwd_rows_bf16(g, u, p, dy, dg, du, dp, n, (int)(f / 8));
            return;
        }
    }
    int lane = threadIdx.x & 31;
    for (i64 row = warp_row0(); row < n; row += warp_count()) {
        A pr = to_acc(p[row]), s = 0;
        for (i64 c = row * f + lane; c < (row + 1) * f; c += 32) {
            A rg, ru;
            swiglu_w_bwd_apply<A>(to_acc(g[c]), to_acc(u[c]), to_acc(dy[c]), pr, rg, ru, s);
            dg[c] = from_acc<T>(rg);
            du[c] = from_acc<T>(ru);
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) dp[row] = from_acc<T>(s);
    }
}
#define SWIGLU_W_BWD(sfx, T) \
    extern "C" __global__ void swiglu_w_bwd_##sfx(const T* g, const T* u, const T* p, const T* dy, T* dg, T* du, T* dp, \
                                                  i64 n, i64 f) { pdl_enter(); \
        swiglu_w_bwd_impl<T>(g, u, p, dy, dg, du, dp, n, f); }
FOR_FLOATS(SWIGLU_W_BWD)

// y += alpha * x, in place.
template <typename T> __device__ void axpy_impl(T* y, const T* x, i64 n, double alpha) {
    typedef acc_t<T> A;
    A a = (A)alpha;
    i64 start = 0;
    if constexpr (IsBf16<T>::v) {
        if (al16(y) && al16(x)) {
            start = n & ~7LL;
            GRID_LOOP(j, start >> 3) {
                float yv[8], xv[8];
                load8f(y + 8 * j, yv);
                load8f(x + 8 * j, xv);
#pragma unroll
                for (int e = 0; e < 8; ++e) yv[e] = yv[e] + a * xv[e];
                store8f(y + 8 * j, yv);
            }
        }
    }
    GRID_LOOP_FROM(i, start, n) y[i] = from_acc<T>(to_acc(y[i]) + a * to_acc(x[i]));
}
#define AXPY(sfx, T) \
    extern "C" __global__ void axpy_##sfx(T* y, const T* x, i64 n, double alpha) { pdl_enter(); axpy_impl<T>(y, x, n, alpha); }
FOR_FLOATS(AXPY)

// Row/column broadcasts: 0 = x * s[row], 1 = x * s[col], 2 = x + s[col].
template <typename T> __device__ void bcast_impl(const T* x, const T* s, T* out, i64 n, i64 c, int op) {
    typedef acc_t<T> A;
    GRID_LOOP(i, n) {
        A v = to_acc(x[i]);
        A r;
        if (op == 0) r = v * to_acc(s[i / c]);
        else if (op == 1) r = v * to_acc(s[i % c]);
        else r = v + to_acc(s[i % c]);
        out[i] = from_acc<T>(r);
    }
}
#define BCAST(sfx, T) \
    extern "C" __global__ void bcast_##sfx(const T* x, const T* s, T* out, i64 n, i64 c, int op) { pdl_enter(); bcast_impl<T>(x, s, out, n, c, op); }
FOR_FLOATS(BCAST)

// ---- row kernels: one block per row -----------------------------------------

template <typename T> __device__ void softmax_impl(const T* x, T* out, i64 r, i64 c) {
    typedef acc_t<T> A;
    __shared__ A sh[32];
    for (i64 row = blockIdx.x; row < r; row += gridDim.x) {
        const T* xr = x + row * c;
        T* orow = out + row * c;
        A mx = neg_inf<A>();
        for (i64 j = threadIdx.x; j < c; j += blockDim.x) mx = fmax(mx, to_acc(xr[j]));
        mx = block_max(mx, sh);
        A s = 0;
        for (i64 j = threadIdx.x; j < c; j += blockDim.x) s += exp_(to_acc(xr[j]) - mx);
        s = block_sum(s, sh);
        A inv = (A)1 / s;
        for (i64 j = threadIdx.x; j < c; j += blockDim.x) orow[j] = from_acc<T>(exp_(to_acc(xr[j]) - mx) * inv);
    }
}
#define SOFTMAX(sfx, T) \
    extern "C" __global__ void softmax_##sfx(const T* x, T* out, i64 r, i64 c) { pdl_enter(); softmax_impl<T>(x, out, r, c); }
FOR_FLOATS(SOFTMAX)

template <typename T> __device__ void softmax_bwd_impl(const T* y, const T* dy, T* out, i64 r, i64 c) {
    typedef acc_t<T> A;
    __shared__ A sh[32];
    for (i64 row = blockIdx.x; row < r; row += gridDim.x) {
        const T* yr = y + row * c;
        const T* dr = dy + row * c;
        A s = 0;
        for (i64 j = threadIdx.x; j < c; j += blockDim.x) s += to_acc(yr[j]) * to_acc(dr[j]);
        s = block_sum(s, sh);
        for (i64 j = threadIdx.x; j < c; j += blockDim.x)
            out[row * c + j] = from_acc<T>(to_acc(yr[j]) * (to_acc(dr[j]) - s));
    }
}
#define SOFTMAX_BWD(sfx, T) \
    extern "C" __global__ void softmax_bwd_##sfx(const T* y, const T* dy, T* out, i64 r, i64 c) { pdl_enter(); softmax_bwd_impl<T>(y, dy, out, r, c); }
FOR_FLOATS(SOFTMAX_BWD)

// Row reductions: 0 = logsumexp, 1 = sum, 2 = dot with `b`.
template <typename T> __device__ void reduce_rows_impl(const T* a, const T* b, T* out, i64 r, i64 c, int op) {
    typedef acc_t<T> A;
    __shared__ A sh[32];
    for (i64 row = blockIdx.x; row < r; row += gridDim.x) {
        const T* ar = a + row * c;
        A res;
        if (op == 0) {
            A mx = neg_inf<A>();
            for (i64 j = threadIdx.x; j < c; j += blockDim.x) mx = fmax(mx, to_acc(ar[j]));
            mx = block_max(mx, sh);
            // An infinite or NaN max is the answer itself (inf - inf is NaN).
            if (!isfinite(mx)) {
                res = mx;
            } else {
                A s = 0;
                for (i64 j = threadIdx.x; j < c; j += blockDim.x) s += exp_(to_acc(ar[j]) - mx);
                res = mx + log_(block_sum(s, sh));
            }
        } else {
            A s = 0;
            for (i64 j = threadIdx.x; j < c; j += blockDim.x)
                s += op == 1 ? to_acc(ar[j]) : to_acc(ar[j]) * to_acc(b[row * c + j]);
            res = block_sum(s, sh);
        }
        if (threadIdx.x == 0) out[row] = from_acc<T>(res);
    }
}
#define REDUCE_ROWS(sfx, T) \
    extern "C" __global__ void reduce_rows_##sfx(const T* a, const T* b, T* out, i64 r, i64 c, int op) { pdl_enter(); reduce_rows_impl<T>(a, b, out, r, c, op); }
FOR_FLOATS(REDUCE_ROWS)

// Column sums `[R, C] -> [C]` in two deterministic passes. First: block
// (x, y) of (32, 8) threads owns 32 columns of the y-th run of `per` rows;
// its 8 row lanes stride over the run and are added in lane order into
// part[y, col] (the accumulation type). Then each column adds its runs in
// order.
template <typename T> __device__ void sum_cols_part_impl(const T* x, acc_t<T>* part, i64 r, i64 c, i64 per) {
    typedef acc_t<T> A;
    __shared__ A sh[8][33];
    i64 col = (i64)blockIdx.x * 32 + threadIdx.x;
    i64 lo = (i64)blockIdx.y * per, hi = lo + per < r ? lo + per : r;
    A s = 0;
    if (col < c)
        for (i64 row = lo + threadIdx.y; row < hi; row += 8) s += to_acc(x[row * c + col]);
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < c) {
        A t = 0;
        for (int k = 0; k < 8; ++k) t += sh[k][threadIdx.x];
        part[(i64)blockIdx.y * c + col] = t;
    }
}
template <typename T> __device__ void sum_cols_fin_impl(const acc_t<T>* part, T* out, i64 runs, i64 c) {
    typedef acc_t<T> A;
    GRID_LOOP(col, c) {
        A t = 0;
        for (i64 y = 0; y < runs; ++y) t += part[y * c + col];
        out[col] = from_acc<T>(t);
    }
}
#define SUM_COLS(sfx, T) \
    extern "C" __global__ void sum_cols_part_##sfx(const T* x, acc_t<T>* part, i64 r, i64 c, i64 per) { pdl_enter(); \
        sum_cols_part_impl<T>(x, part, r, c, per); } \
    extern "C" __global__ void sum_cols_fin_##sfx(const acc_t<T>* part, T* out, i64 runs, i64 c) { pdl_enter(); \
        sum_cols_fin_impl<T>(part, out, runs, c); }
FOR_FLOATS(SUM_COLS)

// Whole-tensor sums in f64, in two deterministic passes: each block of the
// first writes one partial (its grid-stride share), the second adds the
// partials in block order.
template <typename T> __device__ void total_impl(const T* x, double* partials, i64 n, int squares) {
    __shared__ double sh[32];
    double s = 0;
    i64 done = 0;
    if constexpr (sizeof(T) == 2) {
        // bf16 from a 16-byte aligned start: eight elements per load, summed
        // in f32 (eight terms, relative error ~1e-7), then added in f64.
        if ((reinterpret_cast<unsigned long long>(x) & 15) == 0) done = n / 8 * 8;
        GRID_LOOP(j, done / 8) {
            float v[8], t = 0.f;
            load8f(reinterpret_cast<const bf16*>(x) + j * 8, v);
            for (int u = 0; u < 8; ++u) t += squares ? v[u] * v[u] : v[u];
            s += (double)t;
        }
    }
    GRID_LOOP(i, n - done) {
        double v = to_f64(x[done + i]);
        s += squares ? v * v : v;
    }
    s = block_sum(s, sh);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}
#define TOTAL(sfx, T) \
    extern "C" __global__ void total_##sfx(const T* x, double* partials, i64 n, int squares) { pdl_enter(); total_impl<T>(x, partials, n, squares); }
FOR_FLOATS(TOTAL)

// One block adds the partials, each thread a fixed stride of them, then the
// block's deterministic reduction.
template <typename T> __device__ void total_finish_impl(const double* partials, T* out, int np) {
    __shared__ double sh[32];
    double s = 0;
    for (int i = threadIdx.x; i < np; i += blockDim.x) s += partials[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) out[0] = from_f64<T>(s);
}
#define TOTAL_FINISH(sfx, T) \
    extern "C" __global__ void total_finish_##sfx(const double* partials, T* out, int np) { pdl_enter(); total_finish_impl<T>(partials, out, np); }
FOR_FLOATS(TOTAL_FINISH)
