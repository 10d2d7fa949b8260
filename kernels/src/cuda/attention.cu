// Causal grouped-query attention, forward and backward.
// Shape letters: B batch, S sequence, Hq query heads, Hkv kv heads, Hd head
// dim, G = Hq / Hkv. Tensors are [B, S, H, Hd]; lse and delta are [B, Hq, S].
//
// This is the simple, correct version: one thread per query row (forward,
// dq) or key row (dk, dv), walking the other side with an online softmax or
// the recomputed probabilities, each output written by one thread in a fixed
// order (deterministic, no atomics). A tiled flash-attention kernel will
// replace it; the interface stays.

#define MAX_HD 256

__device__ __forceinline__ i64 at4(i64 b, i64 s, i64 h, i64 S, i64 H, i64 HD) { return ((b * S + s) * H + h) * HD; }

template <typename T>
__device__ void attn_fwd_impl(const T* q, const T* k, const T* v, T* o, T* lse, i64 B, i64 S, i64 HQ, i64 HKV, i64 HD) {
    typedef acc_t<T> A;
    A acc[MAX_HD];
    i64 G = HQ / HKV;
    // Formed in f64 and rounded once, as on the CPU.
    A scale = (A)(1.0 / sqrt((double)HD));
    GRID_LOOP(row, B * HQ * S) {
        i64 i = row % S, h = (row / S) % HQ, b = row / (S * HQ);
        i64 kh = h / G;
        const T* qi = q + at4(b, i, h, S, HQ, HD);
        A m = neg_inf<A>(), l = 0;
        for (i64 d = 0; d < HD; ++d) acc[d] = 0;
        for (i64 j = 0; j <= i; ++j) {
            const T* kj = k + at4(b, j, kh, S, HKV, HD);
            const T* vj = v + at4(b, j, kh, S, HKV, HD);
            A s = 0;
            for (i64 d = 0; d < HD; ++d) s += to_acc(qi[d]) * to_acc(kj[d]);
            s *= scale;
            A mn = fmax(m, s);
            A corr = exp_(m - mn), p = exp_(s - mn);
            l = l * corr + p;
            for (i64 d = 0; d < HD; ++d) acc[d] = acc[d] * corr + p * to_acc(vj[d]);
            m = mn;
        }
        T* oi = o + at4(b, i, h, S, HQ, HD);
        for (i64 d = 0; d < HD; ++d) oi[d] = from_acc<T>(acc[d] / l);
        lse[(b * HQ + h) * S + i] = from_acc<T>(m + log_(l));
    }
}
#define ATTN_FWD(sfx, T) \
    extern "C" __global__ void attn_fwd_##sfx(const T* q, const T* k, const T* v, T* o, T* lse, i64 B, i64 S, i64 HQ, i64 HKV, i64 HD) { \
        attn_fwd_impl<T>(q, k, v, o, lse, B, S, HQ, HKV, HD); }
FOR_FLOATS(ATTN_FWD)

// delta[b, h, i] = dO_i · O_i.
template <typename T>
__device__ void attn_delta_impl(const T* d_o, const T* o, T* delta, i64 B, i64 S, i64 HQ, i64 HD) {
    typedef acc_t<T> A;
    GRID_LOOP(row, B * HQ * S) {
        i64 i = row % S, h = (row / S) % HQ, b = row / (S * HQ);
        i64 at = at4(b, i, h, S, HQ, HD);
        A s = 0;
        for (i64 d = 0; d < HD; ++d) s += to_acc(d_o[at + d]) * to_acc(o[at + d]);
        delta[row] = from_acc<T>(s);
    }
}
#define ATTN_DELTA(sfx, T) \
    extern "C" __global__ void attn_delta_##sfx(const T* d_o, const T* o, T* delta, i64 B, i64 S, i64 HQ, i64 HD) { \
        attn_delta_impl<T>(d_o, o, delta, B, S, HQ, HD); }
FOR_FLOATS(ATTN_DELTA)

// (p, ds) of query i (head h) against key j (kv head kh): the probability
// from lse and p·(dO_i·v_j − delta_i), before the scale factor.
template <typename T>
__device__ __forceinline__ void attn_p_ds(const T* q, const T* k, const T* v, const T* d_o, acc_t<T> lse_i, acc_t<T> delta_i,
                                          i64 b, i64 i, i64 h, i64 j, i64 kh, i64 S, i64 HQ, i64 HKV, i64 HD, acc_t<T> scale,
                                          acc_t<T>* p_out, acc_t<T>* ds_out) {
    typedef acc_t<T> A;
    const T* qi = q + at4(b, i, h, S, HQ, HD);
    const T* oi = d_o + at4(b, i, h, S, HQ, HD);
    const T* kj = k + at4(b, j, kh, S, HKV, HD);
    const T* vj = v + at4(b, j, kh, S, HKV, HD);
    A s = 0, dp = 0;
    for (i64 d = 0; d < HD; ++d) {
        s += to_acc(qi[d]) * to_acc(kj[d]);
        dp += to_acc(oi[d]) * to_acc(vj[d]);
    }
    A p = exp_(s * scale - lse_i);
    *p_out = p;
    *ds_out = p * (dp - delta_i);
}

template <typename T>
__device__ void attn_dq_impl(const T* q, const T* k, const T* v, const T* d_o, const T* lse, const T* delta, T* dq,
                             i64 B, i64 S, i64 HQ, i64 HKV, i64 HD) {
    typedef acc_t<T> A;
    A acc[MAX_HD];
    i64 G = HQ / HKV;
    // Formed in f64 and rounded once, as on the CPU.
    A scale = (A)(1.0 / sqrt((double)HD));
    GRID_LOOP(row, B * HQ * S) {
        i64 i = row % S, h = (row / S) % HQ, b = row / (S * HQ);
        i64 kh = h / G;
        A li = to_acc(lse[row]), di = to_acc(delta[row]);
        for (i64 d = 0; d < HD; ++d) acc[d] = 0;
        for (i64 j = 0; j <= i; ++j) {
            A p, ds;
            attn_p_ds<T>(q, k, v, d_o, li, di, b, i, h, j, kh, S, HQ, HKV, HD, scale, &p, &ds);
            const T* kj = k + at4(b, j, kh, S, HKV, HD);
            A c = ds * scale;
            for (i64 d = 0; d < HD; ++d) acc[d] += c * to_acc(kj[d]);
        }
        T* out = dq + at4(b, i, h, S, HQ, HD);
        for (i64 d = 0; d < HD; ++d) out[d] = from_acc<T>(acc[d]);
    }
}
#define ATTN_DQ(sfx, T) \
    extern "C" __global__ void attn_dq_##sfx(const T* q, const T* k, const T* v, const T* d_o, const T* lse, const T* delta, T* dq, \
                                             i64 B, i64 S, i64 HQ, i64 HKV, i64 HD) { \
        attn_dq_impl<T>(q, k, v, d_o, lse, delta, dq, B, S, HQ, HKV, HD); }
FOR_FLOATS(ATTN_DQ)

// dk, dv of key j of kv head kh: summed over its G query heads, then the
// queries i >= j, in order.
template <typename T>
__device__ void attn_dkv_impl(const T* q, const T* k, const T* v, const T* d_o, const T* lse, const T* delta, T* dk, T* dv,
                              i64 B, i64 S, i64 HQ, i64 HKV, i64 HD) {
    typedef acc_t<T> A;
    A ak[MAX_HD], av[MAX_HD];
    i64 G = HQ / HKV;
    // Formed in f64 and rounded once, as on the CPU.
    A scale = (A)(1.0 / sqrt((double)HD));
    GRID_LOOP(row, B * HKV * S) {
        i64 j = row % S, kh = (row / S) % HKV, b = row / (S * HKV);
        for (i64 d = 0; d < HD; ++d) { ak[d] = 0; av[d] = 0; }
        for (i64 g = 0; g < G; ++g) {
            i64 h = kh * G + g;
            for (i64 i = j; i < S; ++i) {
                i64 r = (b * HQ + h) * S + i;
                A p, ds;
                attn_p_ds<T>(q, k, v, d_o, to_acc(lse[r]), to_acc(delta[r]), b, i, h, j, kh, S, HQ, HKV, HD, scale, &p, &ds);
                const T* qi = q + at4(b, i, h, S, HQ, HD);
                const T* oi = d_o + at4(b, i, h, S, HQ, HD);
                A c = ds * scale;
                for (i64 d = 0; d < HD; ++d) {
                    av[d] += p * to_acc(oi[d]);
                    ak[d] += c * to_acc(qi[d]);
                }
            }
        }
        i64 at = at4(b, j, kh, S, HKV, HD);
        for (i64 d = 0; d < HD; ++d) {
            dk[at + d] = from_acc<T>(ak[d]);
            dv[at + d] = from_acc<T>(av[d]);
        }
    }
}
#define ATTN_DKV(sfx, T) \
    extern "C" __global__ void attn_dkv_##sfx(const T* q, const T* k, const T* v, const T* d_o, const T* lse, const T* delta, T* dk, T* dv, \
                                              i64 B, i64 S, i64 HQ, i64 HKV, i64 HD) { \
        attn_dkv_impl<T>(q, k, v, d_o, lse, delta, dk, dv, B, S, HQ, HKV, HD); }
FOR_FLOATS(ATTN_DKV)
