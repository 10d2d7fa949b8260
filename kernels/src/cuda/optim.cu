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

// One element's update: the moments in place, returns the new weight.
// Decoupled decay scales p by (1 − lr·wd) before the Adam step.
template <typename A>
__device__ __forceinline__ A adamw_update(const AdamwCoeffs<A>& k, A p, A g, A& m, A& v) {
    g *= k.gscale;
    m = k.b1 * m + k.c1 * g;
    v = k.b2 * v + k.c2 * g * g;
    return p * k.decay - k.step * m / (sqrt_(v * k.inv_bc2) + k.eps);
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
    extern "C" __global__ void adamw_##sfx(T* p, const T* g, T* m, T* v, i64 n, AdamwScalars s) { \
        adamw_impl<T>(p, g, m, v, n, adamw_coeffs<acc_t<T> >(s)); }
FOR_FLOATS(ADAMW)

// Parameter and gradient of type T (bf16 or f32); master and moments f32,
// updated in f32; the parameter becomes the master rounded to T.
template <typename T>
__device__ void adamw_master_impl(T* p, const T* g, float* w, float* m, float* v, i64 n, AdamwCoeffs<float> k) {
    GRID_LOOP(i, n) {
        float mi = m[i], vi = v[i];
        float wi = adamw_update<float>(k, w[i], to_acc(g[i]), mi, vi);
        m[i] = mi;
        v[i] = vi;
        w[i] = wi;
        p[i] = from_acc<T>(wi);
    }
}
#define ADAMW_MASTER(sfx, T) \
    extern "C" __global__ void adamw_master_##sfx(T* p, const T* g, float* w, float* m, float* v, i64 n, AdamwScalars s) { \
        adamw_master_impl<T>(p, g, w, m, v, n, adamw_coeffs<float>(s)); }
ADAMW_MASTER(f32, float)
ADAMW_MASTER(bf16, bf16)
