// The fused AdamW step: one pass over parameter, gradient and both moments.

// Scalars (bias corrections, step sizes) arrive formed in f64 by the host,
// as on the CPU, and are rounded once to the compute type.
template <typename T>
__device__ void adamw_impl(T* p, const T* g, T* m, T* v, i64 n, double b1, double b2, double c1, double c2,
                           double decay, double step, double inv_bc2, double eps) {
    typedef acc_t<T> A;
    A B1 = (A)b1, B2 = (A)b2, C1 = (A)c1, C2 = (A)c2, D = (A)decay, S = (A)step, IB = (A)inv_bc2, E = (A)eps;
    GRID_LOOP(i, n) {
        A gi = to_acc(g[i]);
        A mi = B1 * to_acc(m[i]) + C1 * gi;
        A vi = B2 * to_acc(v[i]) + C2 * gi * gi;
        m[i] = from_acc<T>(mi);
        v[i] = from_acc<T>(vi);
        // Decoupled decay scales p by (1 − lr·wd) before the Adam step.
        p[i] = from_acc<T>(to_acc(p[i]) * D - S * mi / (sqrt_(vi * IB) + E));
    }
}
#define ADAMW(sfx, T) \
    extern "C" __global__ void adamw_##sfx(T* p, const T* g, T* m, T* v, i64 n, double b1, double b2, double c1, double c2, \
                                           double decay, double step, double inv_bc2, double eps) { \
        adamw_impl<T>(p, g, m, v, n, b1, b2, c1, c2, decay, step, inv_bc2, eps); }
FOR_FLOATS(ADAMW)
