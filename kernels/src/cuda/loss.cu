// Cross-entropy over the vocabulary, fused with its softmax; the valid-token
// mask. Shape letters: T tokens, V vocabulary. Target -1 ignores a token.

// Calls f(j, x[j]) for the elements of a row of v that this thread owns
// (a block-stride loop): 8 at a time through 16-byte loads when T is bf16
// and v a multiple of 8 (rows then start 16-byte aligned), else one by one.
template <typename T, typename F> __device__ __forceinline__ void row_for_each(const T* xr, i64 v, F f) {
    if constexpr (sizeof(T) == 2) {
        if (v % 8 == 0) {
            for (i64 j8 = threadIdx.x; j8 < v / 8; j8 += blockDim.x) {
                uint4 raw = reinterpret_cast<const uint4*>(xr)[j8];
                const T* e = reinterpret_cast<const T*>(&raw);
                for (int u = 0; u < 8; ++u) f(j8 * 8 + u, to_acc(e[u]));
            }
            return;
        }
    }
    for (i64 j = threadIdx.x; j < v; j += blockDim.x) f(j, to_acc(xr[j]));
}

// 2^x by the special-function unit (ex2.approx: relative error ~2⁻²²).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// loss[t] = lse(x[t]) − x[t, target[t]], lse[t] = log Σ exp(x[t]); one block
// per token. Both are stored in the accumulation type (f32 for bf16 logits),
// unrounded. A target outside [-1, V) and a non-finite logit are reported;
// the token then counts as ignored so nothing is read out of bounds.
template <typename T>
__device__ void ce_fwd_impl(const T* x, const int* tg, acc_t<T>* loss, acc_t<T>* lse, i64 t, i64 v, ErrRec* err,
                            unsigned int code_target, unsigned int code_nonfinite) {
    typedef acc_t<T> A;
    __shared__ A sh[32];
    for (i64 row = blockIdx.x; row < t; row += gridDim.x) {
        const T* xr = x + row * v;
        int c = tg[row];
        if (c < -1 || (i64)c >= v) {
            if (threadIdx.x == 0) report_err(err, code_target, row, (double)c);
            c = -1;
        }
        // One pass with an online softmax: each thread keeps its running
        // maximum m and Σ exp(x − m); the block merges the pairs.
        A m = neg_inf<A>(), l = 0;
        auto one = [&](i64 j, A a) {
            if (!isfinite(a)) {
                report_err(err, code_nonfinite, row * v + j, (double)a);
                m = fmax(m, a);  // the row's lse becomes non-finite, as before
                return;
            }
            if (a > m) {
                l = l * exp_(m - a) + (A)1;
                m = a;
            } else {
                l += exp_(a - m);
            }
        };
        bool done = false;
        if constexpr (sizeof(T) == 2) {
            if (v % 8 == 0) {
                // bf16 rows of a multiple of 8 (the vocabulary): 8 logits a
                // 16-byte load, the maximum moved once per 8 and exp as
                // ex2.approx of (x − m)·log2 e (relative error ~2⁻²², far
                // below bf16's). With expf and a branch per logit the op
                // was instruction-bound at ~1.9× its memory time.
                const uint4* x8 = reinterpret_cast<const uint4*>(xr);
#pragma unroll 2
                for (i64 j8 = threadIdx.x; j8 < v / 8; j8 += blockDim.x) {
                    uint4 raw = x8[j8];
                    const T* e = reinterpret_cast<const T*>(&raw);
                    float a[8], lm = neg_inf<float>();
                    bool finite = true;
#pragma unroll
                    for (int u = 0; u < 8; ++u) {
                        a[u] = to_acc(e[u]);
                        finite = finite && isfinite(a[u]);
                        lm = fmaxf(lm, a[u]);
                    }
                    if (!finite) {
                        for (int u = 0; u < 8; ++u) one(j8 * 8 + u, a[u]);
                        continue;
                    }
                    if (lm > m) {
                        l *= fast_exp2((m - lm) * 1.4426950408889634f);
                        m = lm;
                    }
#pragma unroll
                    for (int u = 0; u < 8; ++u) l += fast_exp2((a[u] - m) * 1.4426950408889634f);
                }
                done = true;
            }
        }
        if (!done) row_for_each(xr, v, one);
        A mx = block_max(m, sh);
        A z;
        if (!isfinite(mx)) {
            z = mx;
        } else {
            A s = m == neg_inf<A>() ? (A)0 : l * exp_(m - mx);
            z = mx + log_(block_sum(s, sh));
        }
        if (threadIdx.x == 0) {
            lse[row] = z;
            loss[row] = c == -1 ? (A)0 : z - to_acc(xr[c]);
        }
    }
}
#define CE_FWD(sfx, T) \
    extern "C" __global__ void ce_fwd_##sfx(const T* x, const int* tg, acc_t<T>* loss, acc_t<T>* lse, i64 t, i64 v, \
                                            ErrRec* err, unsigned int code_target, unsigned int code_nonfinite) { pdl_enter(); \
        ce_fwd_impl<T>(x, tg, loss, lse, t, v, err, code_target, code_nonfinite); }
FOR_FLOATS(CE_FWD)

// dx[t] = dloss[t]·(exp(x[t] − lse[t]) − onehot(target[t])), zero for ignored
// (or invalid, reported) targets; one block per token. lse and dloss are in
// the accumulation type (as ce_fwd stores them); only dx is rounded to T.
template <typename T>
__device__ void ce_bwd_impl(const T* x, const int* tg, const acc_t<T>* lse, const acc_t<T>* dloss, T* dx, i64 t, i64 v,
                            ErrRec* err, unsigned int code_target) {
    typedef acc_t<T> A;
    for (i64 row = blockIdx.x; row < t; row += gridDim.x) {
        const T* xr = x + row * v;
        T* o = dx + row * v;
        int c = tg[row];
        if (c < -1 || (i64)c >= v) {
            if (threadIdx.x == 0) report_err(err, code_target, row, (double)c);
            c = -1;
        }
        if (c == -1) {
            for (i64 j = threadIdx.x; j < v; j += blockDim.x) o[j] = from_acc<T>((A)0);
            continue;
        }
        A z = lse[row], d = dloss[row];
        if constexpr (sizeof(T) == 2) {
            if (v % 8 == 0) {
                // 16-byte loads and stores (see row_for_each).
                for (i64 j8 = threadIdx.x; j8 < v / 8; j8 += blockDim.x) {
                    uint4 raw = reinterpret_cast<const uint4*>(xr)[j8], res;
                    const T* e = reinterpret_cast<const T*>(&raw);
                    T* r = reinterpret_cast<T*>(&res);
                    for (int u = 0; u < 8; ++u) {
                        A g = d * exp_(to_acc(e[u]) - z);
                        if (j8 * 8 + u == c) g -= d;
                        r[u] = from_acc<T>(g);
                    }
                    reinterpret_cast<uint4*>(o)[j8] = res;
                }
                continue;
            }
        }
        for (i64 j = threadIdx.x; j < v; j += blockDim.x) {
            A g = d * exp_(to_acc(xr[j]) - z);
            if (j == c) g -= d;
            o[j] = from_acc<T>(g);
        }
    }
}
#define CE_BWD(sfx, T) \
    extern "C" __global__ void ce_bwd_##sfx(const T* x, const int* tg, const acc_t<T>* lse, const acc_t<T>* dloss, T* dx, \
                                            i64 t, i64 v, ErrRec* err, unsigned int code_target) { pdl_enter(); \
        ce_bwd_impl<T>(x, tg, lse, dloss, dx, t, v, err, code_target); }
FOR_FLOATS(CE_BWD)

// 1 where target ≥ 0, 0 where it is -1; below -1 is reported (and gives 0).
template <typename T>
__device__ void valid_mask_impl(const int* tg, T* out, i64 n, ErrRec* err, unsigned int code) {
    GRID_LOOP(i, n) {
        int c = tg[i];
        if (c < -1) report_err(err, code, i, (double)c);
        out[i] = from_acc<T>((acc_t<T>)(c >= 0 ? 1 : 0));
    }
}
#define VALID_MASK(sfx, T) \
    extern "C" __global__ void valid_mask_##sfx(const int* tg, T* out, i64 n, ErrRec* err, unsigned int code) { pdl_enter(); \
        valid_mask_impl<T>(tg, out, n, err, code); }
FOR_FLOATS(VALID_MASK)
