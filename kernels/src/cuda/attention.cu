// Causal grouped-query attention, forward and backward: the elementwise
// kernels around the cuBLAS products of attention.rs.
// Shape letters: B batch, S sequence, Hq query heads, Hkv kv heads, Hd head
// dim, G = Hq / Hkv. Tensors are [B, S, H, Hd]; lse and delta are [B, Hq, S].
//
// attention.rs copies q, k, v (and dO) into head-major [B, H, S, Hd], so a
// kv head's G query heads are G·S consecutive rows; the scores of a chunk of
// kv heads are rows of S scores in the accumulation type, row r being query
// i = r % S of its head. The kernels here turn scores into probabilities
// (forward: with the row's log-sum-exp; backward: from the saved one) and
// probability gradients into score gradients.

__device__ __forceinline__ i64 at4(i64 b, i64 s, i64 h, i64 S, i64 H, i64 HD) { return ((b * S + s) * H + h) * HD; }

// [B, S, H, D] → [B, H, S, D] (to_heads = 1) or back (to_heads = 0).
template <typename T>
__device__ void attn_heads_impl(const T* src, T* dst, i64 B, i64 S, i64 H, i64 D, int to_heads) {
    GRID_LOOP(idx, B * S * H * D) {
        i64 d = idx % D, t = idx / D;
        if (to_heads) {
            i64 s = t % S, h = (t / S) % H, b = t / (S * H);
            dst[idx] = src[at4(b, s, h, S, H, D) + d];
        } else {
            i64 h = t % H, s = (t / H) % S, b = t / (H * S);
            dst[idx] = src[((b * H + h) * S + s) * D + d];
        }
    }
}
#define ATTN_HEADS(sfx, T) \
    extern "C" __global__ void attn_heads_##sfx(const T* src, T* dst, i64 B, i64 S, i64 H, i64 D, int to_heads) { \
        attn_heads_impl<T>(src, dst, B, S, H, D, to_heads); }
FOR_FLOATS(ATTN_HEADS)

// Forward softmax, one block per score row: lse = log Σ_{j<=i} exp(scale·s_j)
// and p_j = exp(scale·s_j − lse) for j <= i, 0 past the diagonal.
template <typename T>
__device__ void attn_softmax_impl(const acc_t<T>* scores, T* p, T* lse, i64 rows, i64 S, double scale_d) {
    typedef acc_t<T> A;
    __shared__ A sh[32];
    A scale = (A)scale_d;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 i = r % S;
        const A* sr = scores + r * S;
        A m = neg_inf<A>();
        for (i64 j = threadIdx.x; j <= i; j += blockDim.x) m = fmax(m, sr[j] * scale);
        m = block_max(m, sh);
        A l = 0;
        for (i64 j = threadIdx.x; j <= i; j += blockDim.x) l += exp_(sr[j] * scale - m);
        l = block_sum(l, sh);
        A ls = m + log_(l);
        T* pr = p + r * S;
        for (i64 j = threadIdx.x; j < S; j += blockDim.x) pr[j] = from_acc<T>(j <= i ? exp_(sr[j] * scale - ls) : (A)0);
        if (threadIdx.x == 0) lse[r] = from_acc<T>(ls);
    }
}
#define ATTN_SOFTMAX(sfx, T) \
    extern "C" __global__ void attn_softmax_##sfx(const acc_t<T>* scores, T* p, T* lse, i64 rows, i64 S, double scale) { \
        attn_softmax_impl<T>(scores, p, lse, rows, S, scale); }
FOR_FLOATS(ATTN_SOFTMAX)

// Backward: the forward's probabilities again, from the saved lse.
template <typename T>
__device__ void attn_probs_impl(const acc_t<T>* scores, T* p, const T* lse, i64 rows, i64 S, double scale_d) {
    typedef acc_t<T> A;
    A scale = (A)scale_d;
    GRID_LOOP(idx, rows * S) {
        i64 r = idx / S, j = idx % S, i = r % S;
        p[idx] = from_acc<T>(j <= i ? exp_(scores[idx] * scale - to_acc(lse[r])) : (A)0);
    }
}
#define ATTN_PROBS(sfx, T) \
    extern "C" __global__ void attn_probs_##sfx(const acc_t<T>* scores, T* p, const T* lse, i64 rows, i64 S, double scale) { \
        attn_probs_impl<T>(scores, p, lse, rows, S, scale); }
FOR_FLOATS(ATTN_PROBS)

// Score gradients, in place over the probabilities: ds = p·(dp − delta)·scale
// (zero past the diagonal, where p is).
template <typename T>
__device__ void attn_dscores_impl(const acc_t<T>* dp, T* p_ds, const T* delta, i64 rows, i64 S, double scale_d) {
    typedef acc_t<T> A;
    A scale = (A)scale_d;
    GRID_LOOP(idx, rows * S) {
        i64 r = idx / S;
        A ds = to_acc(p_ds[idx]) * (dp[idx] - to_acc(delta[r]));
        p_ds[idx] = from_acc<T>(ds * scale);
    }
}
#define ATTN_DSCORES(sfx, T) \
    extern "C" __global__ void attn_dscores_##sfx(const acc_t<T>* dp, T* p_ds, const T* delta, i64 rows, i64 S, double scale) { \
        attn_dscores_impl<T>(dp, p_ds, delta, rows, S, scale); }
FOR_FLOATS(ATTN_DSCORES)

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

