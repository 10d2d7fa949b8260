// The fused AdamW step: one pass over parameter, gradient and both moments,
// either in the parameter's dtype (`adamw_*`) or on an f32 master copy
// (`adamw_master_*`). Both call `adamw_update`, the one statement of the
// arithmetic, as the CPU's two paths share `update` in cpu/optim.rs.

// Scalars (bias corrections, step sizes, the gradient scale) arrive formed
// in f64 by the host, as on the CPU, in one by-value struct (`Scalars` in
// optim.rs, same layout), and are rounded once to the compute type.
struct AdamwScalars {
    double b1, b2, c1, c2, decay, step, inv_bc2, eps, gscale;
};
template <typename A> struct AdamwCoeffs {
    A b1, b2, c1, c2, decay, step, inv_bc2, eps, gscale;
};

template <typename A> __device__ __forceinline__ AdamwCoeffs<A> adamw_coeffs(const AdamwScalars& s) {
    AdamwCoeffs<A> k;
    k.b1 = (A)s.b1; k.b2 = (A)s.b2; k.c1 = (A)s.c1; k.c2 = (A)s.c2;
    k.decay = (A)s.decay; k.step = (A)s.step; k.inv_bc2 = (A)s.inv_bc2; k.eps = (A)s.eps; k.gscale = (A)s.gscale;
    return k;
}

// Products and sums rounded one by one (never contracted into an FMA):
// whether the compiler fuses depends on the code around the statement, and
// the plain and master steps, scalar or four at a time, must agree bit for
// bit.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// One element's update: the moments in place, returns the new weight.
// Decoupled decay scales p by (1 − lr·wd) before the Adam step.
template <typename A>
__device__ __forceinline__ A adamw_update(const AdamwCoeffs<A>& k, A p, A g, A& m, A& v) {
    g = mul_rn(g, k.gscale);
    m = add_rn(mul_rn(k.b1, m), mul_rn(k.c1, g));
    v = add_rn(mul_rn(k.b2, v), mul_rn(mul_rn(k.c2, g), g));
    return add_rn(mul_rn(p, k.decay), -(mul_rn(k.step, m) / add_rn(sqrt_(mul_rn(v, k.inv_bc2)), k.eps)));
}


// Parameter, gradient and moments all of type T, computed in acc_t<T>.
template <typename T>
__device__ void adamw_impl(T* p, const T* g, T* m, T* v, i64 n, AdamwCoeffs<acc_t<T> > k) {
    typedef acc_t<T> A;
    GRID_LOOP(i, n) {
        A mi = to_acc(m[i]), vi = to_acc(v[i]);
        A pi = adamw_update<A>(k, to_acc(p[i]), to_acc(g[i]), mi, vi);
        m[i] = from_acc<T>(mi);
        v[i] = from_acc<T>(vi);
        p[i] = from_acc<T>(pi);
    }
}
#define ADAMW(sfx, T) \
    extern "C" __global__ void adamw_##sfx(T* p, const T* g, T* m, T* v, i64 n, AdamwScalars s) { pdl_enter(); \
        adamw_impl<T>(p, g, m, v, n, adamw_coeffs<acc_t<T> >(s)); }
FOR_FLOATS(ADAMW)

// Parameter and gradient of type T (bf16 or f32); master and moments f32,
// updated in f32; the parameter becomes the master rounded to T.
template <typename T>
__device__ void adamw_master_impl(T* p, const T* g, float* w, float* m, float* v, i64 n, AdamwCoeffs<float> k) {
    // Memory-bound (28 bytes an element at bf16): four elements a thread and
    // iteration with 16-byte loads and stores of the f32 arrays where every
    // base is 16-byte aligned (the pool's blocks are), one at a time for
    // the rest; the arithmetic is adamw_update's either way.
    bool vec = ((reinterpret_cast<unsigned long long>(p) | reinterpret_cast<unsigned long long>(g)) % (4 * sizeof(T)) == 0) &&
               ((reinterpret_cast<unsigned long long>(w) | reinterpret_cast<unsigned long long>(m) |
                 reinterpret_cast<unsigned long long>(v)) % 16 == 0);
    i64 done = 0;
    if (vec) {
        i64 n4 = n / 4;
        GRID_LOOP(q, n4) {
            float4 w4 = reinterpret_cast<const float4*>(w)[q], m4 = reinterpret_cast<const float4*>(m)[q],
                   v4 = reinterpret_cast<const float4*>(v)[q];
            T g4[4], p4[4];
            if constexpr (sizeof(T) == 2) {
                *reinterpret_cast<uint2*>(g4) = reinterpret_cast<const uint2*>(g)[q];
            } else {
                *reinterpret_cast<float4*>(g4) = reinterpret_cast<const float4*>(g)[q];
            }
            float* wv = &w4.x;
            float* mv = &m4.x;
            float* vv = &v4.x;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                wv[e] = adamw_update<float>(k, wv[e], to_acc(g4[e]), mv[e], vv[e]);
                p4[e] = from_acc<T>(wv[e]);
            }
            reinterpret_cast<float4*>(w)[q] = w4;
            reinterpret_cast<float4*>(m)[q] = m4;
            reinterpret_cast<float4*>(v)[q] = v4;
            if constexpr (sizeof(T) == 2) {
                reinterpret_cast<uint2*>(p)[q] = *reinterpret_cast<const uint2*>(p4);
            } else {
                reinterpret_cast<float4*>(p)[q] = *reinterpret_cast<const float4*>(p4);
            }
        }
        done = n4 * 4;
    }
    GRID_LOOP(j, n - done) {
        i64 i = done + j;
        float mi = m[i], vi = v[i];
        float wi = adamw_update<float>(k, w[i], to_acc(g[i]), mi, vi);
        m[i] = mi;
        v[i] = vi;
        w[i] = wi;
        p[i] = from_acc<T>(wi);
    }
}
#define ADAMW_MASTER(sfx, T) \
    extern "C" __global__ void adamw_master_##sfx(T* p, const T* g, float* w, float* m, float* v, i64 n, AdamwScalars s) { pdl_enter(); \
        adamw_master_impl<T>(p, g, w, m, v, n, adamw_coeffs<float>(s)); }
ADAMW_MASTER(f32, float)
ADAMW_MASTER(bf16, bf16)
