// Causal grouped-query attention, forward and backward: the elementwise
// kernels around the cuBLAS products of attention.rs.
// Shape letters: B batch, S sequence, Hq query heads, Hkv kv heads, Hd head
// dim, G = Hq / Hkv. Tensors are [B, S, H, Hd]; lse and delta are [B, Hq, S],
// lse in the accumulation type (f32 for bf16, as flash attention keeps it).
//
// attention.rs copies q, k, v (and dO) into head-major [B, H, S, Hd], so a
// kv head's G query heads are G·S consecutive rows; the scores of a chunk of
// kv heads are rows of S scores in the accumulation type, row r being query
// i = r % S of its head. The kernels here turn scores into probabilities
// (forward: with the row's log-sum-exp; backward: from the saved one) and
// probability gradients into score gradients.

__device__ __forceinline__ i64 at4(i64 b, i64 s, i64 h, i64 S, i64 H, i64 HD) { return ((b * S + s) * H + h) * HD; }

// Whether query i sees key j of batch b: causal, and with document ids
// (docs [B, S], non-null) only within the query's document.
__device__ __forceinline__ bool attn_visible(const int* docs, i64 b, i64 S, i64 i, i64 j) {
    return j <= i && (!docs || docs[b * S + j] == docs[b * S + i]);
}

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
    extern "C" __global__ void attn_heads_##sfx(const T* src, T* dst, i64 B, i64 S, i64 H, i64 D, int to_heads) { pdl_enter(); \
        attn_heads_impl<T>(src, dst, B, S, H, D, to_heads); }
FOR_FLOATS(ATTN_HEADS)

// Forward softmax, one block per score row: lse = log Σ_{j visible} exp(scale·s_j)
// and p_j = exp(scale·s_j − lse) for visible j, 0 elsewhere. Row r of the
// chunk is query i = r % S of kv head unit u0 + r / unit_rows, batch
// (that unit) / HKV (for the document ids).
template <typename T>
__device__ void attn_softmax_impl(const acc_t<T>* scores, T* p, acc_t<T>* lse, i64 rows, i64 S, double scale_d,
                                  const int* docs, i64 u0, i64 unit_rows, i64 HKV) {
    typedef acc_t<T> A;
    __shared__ A sh[32];
    A scale = (A)scale_d;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 i = r % S, b = (u0 + r / unit_rows) / HKV;
        const A* sr = scores + r * S;
        A m = neg_inf<A>();
        for (i64 j = threadIdx.x; j <= i; j += blockDim.x)
            if (attn_visible(docs, b, S, i, j)) m = fmax(m, sr[j] * scale);
        m = block_max(m, sh);
        A l = 0;
        for (i64 j = threadIdx.x; j <= i; j += blockDim.x)
            if (attn_visible(docs, b, S, i, j)) l += exp_(sr[j] * scale - m);
        l = block_sum(l, sh);
        A ls = m + log_(l);
        T* pr = p + r * S;
        for (i64 j = threadIdx.x; j < S; j += blockDim.x)
            pr[j] = from_acc<T>(attn_visible(docs, b, S, i, j) ? exp_(sr[j] * scale - ls) : (A)0);
        if (threadIdx.x == 0) lse[r] = ls;
    }
}
#define ATTN_SOFTMAX(sfx, T) \
    extern "C" __global__ void attn_softmax_##sfx(const acc_t<T>* scores, T* p, acc_t<T>* lse, i64 rows, i64 S, double scale, \
                                                  const int* docs, i64 u0, i64 unit_rows, i64 HKV) { pdl_enter(); \
        attn_softmax_impl<T>(scores, p, lse, rows, S, scale, docs, u0, unit_rows, HKV); }
FOR_FLOATS(ATTN_SOFTMAX)

// Backward: the forward's probabilities again, from the saved lse.
template <typename T>
__device__ void attn_probs_impl(const acc_t<T>* scores, T* p, const acc_t<T>* lse, i64 rows, i64 S, double scale_d,
                                const int* docs, i64 u0, i64 unit_rows, i64 HKV) {
    typedef acc_t<T> A;
    A scale = (A)scale_d;
    GRID_LOOP(idx, rows * S) {
        i64 r = idx / S, j = idx % S, i = r % S, b = (u0 + r / unit_rows) / HKV;
        p[idx] = from_acc<T>(attn_visible(docs, b, S, i, j) ? exp_(scores[idx] * scale - lse[r]) : (A)0);
    }
}
#define ATTN_PROBS(sfx, T) \
    extern "C" __global__ void attn_probs_##sfx(const acc_t<T>* scores, T* p, const acc_t<T>* lse, i64 rows, i64 S, double scale, \
                                                const int* docs, i64 u0, i64 unit_rows, i64 HKV) { pdl_enter(); \
        attn_probs_impl<T>(scores, p, lse, rows, S, scale, docs, u0, unit_rows, HKV); }
FOR_FLOATS(ATTN_PROBS)

// Score gradients, in place over the probabilities: ds = p·(dp − delta)·scale
// (zero past the diagonal, where p is).
template <typename T>
__device__ void attn_dscores_impl(const acc_t<T>* dp, T* p_ds, const acc_t<T>* delta, i64 rows, i64 S, double scale_d) {
    typedef acc_t<T> A;
    A scale = (A)scale_d;
    GRID_LOOP(idx, rows * S) {
        i64 r = idx / S;
        A ds = to_acc(p_ds[idx]) * (dp[idx] - delta[r]);
        p_ds[idx] = from_acc<T>(ds * scale);
    }
}
#define ATTN_DSCORES(sfx, T) \
    extern "C" __global__ void attn_dscores_##sfx(const acc_t<T>* dp, T* p_ds, const acc_t<T>* delta, i64 rows, i64 S, double scale) { pdl_enter(); \
        attn_dscores_impl<T>(dp, p_ds, delta, rows, S, scale); }
FOR_FLOATS(ATTN_DSCORES)

// delta[b, h, i] = dO_i · O_i.
template <typename T>
__device__ void attn_delta_impl(const T* d_o, const T* o, acc_t<T>* delta, i64 B, i64 S, i64 HQ, i64 HD) {
    typedef acc_t<T> A;
    GRID_LOOP(row, B * HQ * S) {
        i64 i = row % S, h = (row / S) % HQ, b = row / (S * HQ);
        i64 at = at4(b, i, h, S, HQ, HD);
        A s = 0;
        for (i64 d = 0; d < HD; ++d) s += to_acc(d_o[at + d]) * to_acc(o[at + d]);
        delta[row] = s;
    }
}
#define ATTN_DELTA(sfx, T) \
    extern "C" __global__ void attn_delta_##sfx(const T* d_o, const T* o, acc_t<T>* delta, i64 B, i64 S, i64 HQ, i64 HD) { pdl_enter(); \
        attn_delta_impl<T>(d_o, o, delta, B, S, HQ, HD); }
FOR_FLOATS(ATTN_DELTA)


// ---- flash attention: bf16 on tensor cores ---------------------------------------------
//
// FlashAttention-2's scheme with mma.m16n8k16 (bf16 in, f32 accumulate),
// reading q, k, v, dO in their own [B, S, H, Hd] layout (row stride H·Hd).
// Shared tiles are [rows][Hd] with each row's 16-byte chunks XOR-swizzled
// by the row (fa_swz), so the eight row addresses of an ldmatrix and the
// 16-byte cp.async stores hit distinct banks. Fragment layouts (PTX ISA,
// mma.m16n8k16, lane l, g = l / 4, t = l % 4):
//   A 16×16: a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..), a[3] = (g+8, 2t+8..);
//   B 16×8:  b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8.., n g);
//   C 16×8:  c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..).
// So two adjacent C tiles of a score block are, packed to bf16, the A
// fragment of the next product (P·V, dS·K) with no trip through memory.
// ldmatrix_x4 lane l addresses row l % 8 of matrix l / 8 (see the callers).
//
// Softmax runs in base 2: x = s · scale · log2(e), lse = ln 2 · (m + log2 l).

#define FA_BM 64  // queries of a forward block: 16 per warp
#define FA_BN 64  // keys per step of the forward, and keys of a backward block
#define FA_BQ 32  // queries per step of the backward
#define FA_THREADS 128
#define FA_LN2 0.6931471805599453f

// Element (r, c) of a [rows][HD] bf16 tile, chunks swizzled by r % 8.
template <int HD> __device__ __forceinline__ int fa_swz(int r, int c) {
    return r * HD + (((c >> 3) ^ (r & 7)) << 3) + (c & 7);
}

// Copies rows row0.. row0 + ROWS of a [S][ld] bf16 matrix into a swizzled
// tile, zero-filling rows at or past S (cp.async; the caller commits).
template <int HD, int ROWS>
__device__ __forceinline__ void fa_load_tile(bf16* tile, const bf16* g, i64 ld, i64 row0, i64 S) {
    for (int e = threadIdx.x; e < ROWS * HD / 8; e += FA_THREADS) {
        int r = e / (HD / 8), c = (e % (HD / 8)) * 8;
        bool ok = row0 + r < S;
        load8_async(&tile[fa_swz<HD>(r, c)], g + (ok ? (row0 + r) * ld + c : 0), g, ok, 8, true);
    }
}

// A fragments (16 rows from r0, columns c0..c0 + 16) of a swizzled tile.
template <int HD> __device__ __forceinline__ void fa_lda(unsigned a[4], const bf16* tile, int r0, int c0) {
    int l = threadIdx.x & 31;
    ldmatrix_x4<false>(a, &tile[fa_swz<HD>(r0 + (l & 15), c0 + (l >> 4) * 8)]);
}

// B fragments of two n-tiles (rows n0..n0 + 16 of the tile are n, columns
// k0..k0 + 16 are k): b[0..1] for n0, b[2..3] for n0 + 8.
template <int HD> __device__ __forceinline__ void fa_ldb_nk(unsigned b[4], const bf16* tile, int n0, int k0) {
    int l = threadIdx.x & 31, m = l >> 3;
    ldmatrix_x4<false>(b, &tile[fa_swz<HD>(n0 + (l & 7) + (m >> 1) * 8, k0 + (m & 1) * 8)]);
}

// B fragments of two n-tiles from a tile stored [k][n] (rows k0..k0 + 16
// are k, columns n0..n0 + 16 are n), through the transposing ldmatrix.
template <int HD> __device__ __forceinline__ void fa_ldb_kn(unsigned b[4], const bf16* tile, int k0, int n0) {
    int l = threadIdx.x & 31, m = l >> 3;
    ldmatrix_x4<true>(b, &tile[fa_swz<HD>(k0 + (l & 7) + (m & 1) * 8, n0 + (m >> 1) * 8)]);
}

// The A fragment of k-step kk of a product whose left operand is the C
// tiles `c` (16 rows, 8 columns each), rounded to bf16.
__device__ __forceinline__ void fa_c_to_a(unsigned a[4], const float (*c)[4], int kk) {
    a[0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
    a[1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
    a[2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// Forward: block (query tile, query head, batch), heaviest tiles first.
// Each warp owns 16 queries; K and V tiles of FA_BN keys stream through
// shared memory, the next K copied while P·V runs. With document ids
// (docs non-null, nondecreasing along the sequence) key tiles that end
// before the document of the tile's first query are skipped whole, and
// the rest masked per element.
template <int HD>
__device__ void flash_fwd_impl(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                               bf16* __restrict__ o, float* __restrict__ lse, i64 S, int HQ, int HKV, float scale_log2,
                               const int* __restrict__ docs) {
    __shared__ __align__(128) bf16 sq[FA_BM * HD];
    __shared__ __align__(128) bf16 sk[FA_BN * HD];
    __shared__ __align__(128) bf16 sv[FA_BN * HD];
    int nqt = (int)((S + FA_BM - 1) / FA_BM);
    int qt = nqt - 1 - (int)blockIdx.x;
    int h = blockIdx.y, b = blockIdx.z, hk = h / (HQ / HKV);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    i64 q0 = (i64)qt * FA_BM;
    i64 ldq = (i64)HQ * HD, ldk = (i64)HKV * HD;
    const bf16* qg = q + ((i64)b * S * HQ + h) * HD;
    const bf16* kg = k + ((i64)b * S * HKV + hk) * HD;
    const bf16* vg = v + ((i64)b * S * HKV + hk) * HD;
    const int* dg = docs ? docs + (i64)b * S : nullptr;
    // First key tile holding a key of the first query's document.
    int j0 = 0;
    if (dg)
        while (j0 < qt && dg[(i64)(j0 + 1) * FA_BN - 1] < dg[q0]) ++j0;
    fa_load_tile<HD, FA_BM>(sq, qg, ldq, q0, S);
    fa_load_tile<HD, FA_BN>(sk, kg, ldk, (i64)j0 * FA_BN, S);
    cp_async_commit();
    unsigned qf[HD / 16][4];
    float acc[HD / 8][4];
    for (int i = 0; i < HD / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_row[2] = {neg_inf<float>(), neg_inf<float>()}, l_row[2] = {0.f, 0.f};
    // Query of this thread's accumulator rows hr = 0, 1.
    i64 qrow = q0 + warp * 16 + (lane >> 2);
    // FA_BN == FA_BM: key tiles j0..qt, only the last causally masked.
    int nkt = qt + 1;
    int qd[2];
    for (int hr = 0; hr < 2; ++hr) qd[hr] = dg ? dg[min(qrow + hr * 8, S - 1)] : 0;
    for (int j = j0; j < nkt; ++j) {
        fa_load_tile<HD, FA_BN>(sv, vg, ldk, (i64)j * FA_BN, S);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (j == j0)
            for (int kk = 0; kk < HD / 16; ++kk) fa_lda<HD>(qf[kk], sq, warp * 16, kk * 16);
        float s[FA_BN / 8][4];
        for (int i = 0; i < FA_BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
        for (int kk = 0; kk < HD / 16; ++kk)
            for (int nt = 0; nt < FA_BN / 8; nt += 2) {
                unsigned bk[4];
                fa_ldb_nk<HD>(bk, sk, nt * 8, kk * 16);
                mma_bf16_16816_x2(&s[nt], qf[kk], bk);
            }
        __syncthreads();  // every warp is done with sk
        bool more = j + 1 < nkt;
        if (more) {
            fa_load_tile<HD, FA_BN>(sk, kg, ldk, (i64)(j + 1) * FA_BN, S);
            cp_async_commit();
        }
        for (int hr = 0; hr < 2; ++hr) {
            i64 qi = qrow + hr * 8;
            float mx = m_row[hr];
            for (int nt = 0; nt < FA_BN / 8; ++nt)
                for (int e = 0; e < 2; ++e) {
                    i64 kj = (i64)j * FA_BN + nt * 8 + (lane & 3) * 2 + e;
                    float x = s[nt][hr * 2 + e] * scale_log2;
                    if ((j == qt && kj > qi) || (dg && (kj >= S || dg[kj] != qd[hr]))) x = neg_inf<float>();
                    s[nt][hr * 2 + e] = x;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            // Without documents key 0 is never masked, so mx is finite from
            // the first step on; with them a row may see no key of a tile
            // yet (mx = −inf): nothing is rescaled and every p is 0.
            float mref = mx == neg_inf<float>() ? 0.f : mx;
            float alpha = mx == neg_inf<float>() ? 1.f : exp2f(m_row[hr] - mx);
            m_row[hr] = mx;
            float sum = 0.f;
            for (int nt = 0; nt < FA_BN / 8; ++nt)
                for (int e = 0; e < 2; ++e) {
                    float p = exp2f(s[nt][hr * 2 + e] - mref);
                    s[nt][hr * 2 + e] = p;
                    sum += p;
                }
            l_row[hr] = l_row[hr] * alpha + sum;
            for (int dt = 0; dt < HD / 8; ++dt) {
                acc[dt][hr * 2] *= alpha;
                acc[dt][hr * 2 + 1] *= alpha;
            }
        }
        if (more) cp_async_wait<1>(); else cp_async_wait<0>();
        __syncthreads();  // sv has arrived for every warp
        for (int kk = 0; kk < FA_BN / 16; ++kk) {
            unsigned pa[4];
            fa_c_to_a(pa, s, kk);
            for (int dt = 0; dt < HD / 8; dt += 2) {
                unsigned bv[4];
                fa_ldb_kn<HD>(bv, sv, kk * 16, dt * 8);
                mma_bf16_16816_x2(&acc[dt], pa, bv);
            }
        }
        __syncthreads();  // sv is free for the next step's copy
    }
    for (int hr = 0; hr < 2; ++hr) {
        float l = l_row[hr];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        i64 qi = qrow + hr * 8;
        if (qi >= S) continue;
        float inv = 1.f / l;
        bf16* orow = o + (((i64)b * S + qi) * HQ + h) * HD;
        for (int dt = 0; dt < HD / 8; ++dt)
            *reinterpret_cast<__nv_bfloat162*>(&orow[dt * 8 + (lane & 3) * 2]) =
                __floats2bfloat162_rn(acc[dt][hr * 2] * inv, acc[dt][hr * 2 + 1] * inv);
        if ((lane & 3) == 0) lse[((i64)b * HQ + h) * S + qi] = FA_LN2 * (m_row[hr] + log2f(l));
    }
}

#define FLASH_FWD(HD) \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_fwd_bf16_hd##HD( \
        const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, i64 S, int HQ, int HKV, float scale_log2, \
        const int* docs) { pdl_enter(); \
        flash_fwd_impl<HD>(q, k, v, o, lse, S, HQ, HKV, scale_log2, docs); }
FLASH_FWD(64)
FLASH_FWD(128)

// delta[b, h, i] = dO_i · O_i in f32, one warp per row; also zeroes the f32
// dQ accumulator rows of the same (b, i, h).
extern "C" __global__ void flash_delta_bf16(const bf16* d_o, const bf16* o, float* delta, float* dq_acc, i64 B, i64 S,
                                            i64 HQ, i64 HD) { pdl_enter();
    int lane = threadIdx.x & 31;
    i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < B * HQ * S; row += warps) {
        i64 i = row % S, h = (row / S) % HQ, b = row / (S * HQ);
        i64 at = at4(b, i, h, S, HQ, HD);
        float s = 0.f;
        for (i64 d = lane; d < HD; d += 32) {
            s += __bfloat162float(d_o[at + d]) * __bfloat162float(o[at + d]);
            dq_acc[at + d] = 0.f;
        }
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) delta[row] = s;
    }
}

// dq = scale · dq_acc, rounded to bf16.
extern "C" __global__ void flash_dq_bf16(const float* dq_acc, bf16* dq, i64 n, float scale) { pdl_enter();
    GRID_LOOP(i, n) dq[i] = __float2bfloat16_rn(dq_acc[i] * scale);
}

// Swizzled offset of (key r, query c) in the [FA_BN][FA_BQ] dS tile: rows
// are 64 bytes, so pairs of rows share a 128-byte line and the chunk is
// XORed with (r / 2) % 4.
__device__ __forceinline__ int fa_ds_swz(int r, int c) {
    return r * FA_BQ + (((c >> 3) ^ ((r >> 1) & 3)) << 3) + (c & 7);
}

// Adds (x, y) to two consecutive floats of global memory in one reduction.
// (Hopper's vector reduction; two scalar ones before it).
__device__ __forceinline__ void red_add2(float* p, float x, float y) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
    atomicAdd(p, x);
    atomicAdd(p + 1, y);
#endif
}

// Backward: block (key tile, kv head, batch), heaviest (earliest) key tiles
// first. K and V stay in shared memory; for each of the kv head's G query
// heads, query tiles of FA_BQ from the key tile's start to S stream through
// two buffers (the next copied while this one is used). Each warp owns 16
// keys: it recomputes Pᵀ = exp(K·Qᵀ·scale − lse) and accumulates
// dV += Pᵀ·dO, dK += dSᵀ·Q with dSᵀ = Pᵀ ∘ (V·dOᵀ − delta); the block's
// dS goes through shared memory into dQ += dS·K, added to an f32
// accumulator with vector reductions. dK gets the scale at the end, dQ in
// flash_dq_bf16. With document ids (docs non-null, nondecreasing) query
// tiles that start past the document of the key tile's last key are
// skipped whole, and the rest masked per element.
template <int HD>
__device__ void flash_bwd_impl(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                               const bf16* __restrict__ d_o, const float* __restrict__ lse, const float* __restrict__ delta,
                               float* __restrict__ dq_acc, bf16* __restrict__ dk, bf16* __restrict__ dv, i64 S, int HQ,
                               int HKV, float scale, const int* __restrict__ docs) {
    extern __shared__ __align__(128) unsigned char fa_dyn[];
    bf16* sk = reinterpret_cast<bf16*>(fa_dyn);
    bf16* sv = sk + FA_BN * HD;
    bf16* sq = sv + FA_BN * HD;          // two buffers of FA_BQ × HD
    bf16* sdo = sq + 2 * FA_BQ * HD;     // two buffers
    bf16* sds = sdo + 2 * FA_BQ * HD;    // FA_BN × FA_BQ
    float* slse = reinterpret_cast<float*>(sds + FA_BN * FA_BQ);  // two buffers of FA_BQ, log2 units
    float* sdelta = slse + 2 * FA_BQ;                             // two buffers
    const float LOG2E = 1.4426950408889634f;
    int kt = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    int G = HQ / HKV;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    i64 k0 = (i64)kt * FA_BN;
    i64 ldq = (i64)HQ * HD, ldk = (i64)HKV * HD;
    fa_load_tile<HD, FA_BN>(sk, k + ((i64)b * S * HKV + hk) * HD, ldk, k0, S);
    fa_load_tile<HD, FA_BN>(sv, v + ((i64)b * S * HKV + hk) * HD, ldk, k0, S);
    cp_async_commit();
    float dk_acc[HD / 8][4], dv_acc[HD / 8][4];
    for (int i = 0; i < HD / 8; ++i)
        for (int e = 0; e < 4; ++e) dk_acc[i][e] = dv_acc[i][e] = 0.f;
    int nq = (int)((S - k0 + FA_BQ - 1) / FA_BQ);  // query tiles from k0 on
    const int* dg = docs ? docs + (i64)b * S : nullptr;
    if (dg) {
        int last_doc = dg[min(k0 + FA_BN, S) - 1];
        while (nq > 1 && dg[k0 + (i64)(nq - 1) * FA_BQ] > last_doc) --nq;
    }
    int steps = G * nq;
    // Issues the copies of step `it` (query head, query tile) into buffer `buf`.
    auto load_step = [&](int it, int buf) {
        int h = hk * G + it / nq;
        i64 q0 = k0 + (i64)(it % nq) * FA_BQ;
        fa_load_tile<HD, FA_BQ>(sq + buf * FA_BQ * HD, q + ((i64)b * S * HQ + h) * HD, ldq, q0, S);
        fa_load_tile<HD, FA_BQ>(sdo + buf * FA_BQ * HD, d_o + ((i64)b * S * HQ + h) * HD, ldq, q0, S);
        cp_async_commit();
        // Queries past S: lse = +inf makes their probabilities 0.
        for (int e = threadIdx.x; e < FA_BQ; e += FA_THREADS) {
            i64 qi = q0 + e, row = ((i64)b * HQ + h) * S + qi;
            slse[buf * FA_BQ + e] = qi < S ? lse[row] * LOG2E : -neg_inf<float>();
            sdelta[buf * FA_BQ + e] = qi < S ? delta[row] : 0.f;
        }
    };
    if (steps > 0) load_step(0, 0);
    int key_row = warp * 16 + (lane >> 2);  // this thread's key rows key_row, key_row + 8 (in the tile)
    for (int it = 0; it < steps; ++it) {
        int buf = it & 1;
        int h = hk * G + it / nq;
        i64 q0 = k0 + (i64)(it % nq) * FA_BQ;
        if (it + 1 < steps) {
            load_step(it + 1, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16* tq = sq + buf * FA_BQ * HD;
        const bf16* tdo = sdo + buf * FA_BQ * HD;
        const float* tl = slse + buf * FA_BQ;
        const float* td = sdelta + buf * FA_BQ;
        // Sᵀ (16 keys × FA_BQ queries) = K_w · Qᵀ and dPᵀ = V_w · dOᵀ.
        float st[FA_BQ / 8][4], dpt[FA_BQ / 8][4];
        for (int i = 0; i < FA_BQ / 8; ++i)
            for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
        for (int kk = 0; kk < HD / 16; ++kk) {
            unsigned ak[4], av[4];
            fa_lda<HD>(ak, sk, warp * 16, kk * 16);
            fa_lda<HD>(av, sv, warp * 16, kk * 16);
            for (int nt = 0; nt < FA_BQ / 8; nt += 2) {
                unsigned bq[4], bd[4];
                fa_ldb_nk<HD>(bq, tq, nt * 8, kk * 16);
                fa_ldb_nk<HD>(bd, tdo, nt * 8, kk * 16);
                mma_bf16_16816_x2(&st[nt], ak, bq);
                mma_bf16_16816_x2(&dpt[nt], av, bd);
            }
        }
        // Pᵀ, then dSᵀ = Pᵀ ∘ (dPᵀ − delta) (unscaled), masked where query < key.
        for (int nt = 0; nt < FA_BQ / 8; ++nt)
            for (int e = 0; e < 4; ++e) {
                int kr = key_row + (e >> 1) * 8, qc = nt * 8 + (lane & 3) * 2 + (e & 1);
                i64 qi = q0 + qc, kj = k0 + kr;
                bool live = qi >= kj && (!dg || (qi < S && kj < S && dg[qi] == dg[kj]));
                float p = live ? exp2f(st[nt][e] * scale * LOG2E - tl[qc]) : 0.f;
                st[nt][e] = p;
                dpt[nt][e] = p * (dpt[nt][e] - td[qc]);
            }
        // dV += Pᵀ · dO and dK += dSᵀ · Q: k runs over the step's queries.
        for (int kq = 0; kq < FA_BQ / 16; ++kq) {
            unsigned pa[4], da[4];
            fa_c_to_a(pa, st, kq);
            fa_c_to_a(da, dpt, kq);
            for (int dt = 0; dt < HD / 8; dt += 2) {
                unsigned bd[4], bq[4];
                fa_ldb_kn<HD>(bd, tdo, kq * 16, dt * 8);
                fa_ldb_kn<HD>(bq, tq, kq * 16, dt * 8);
                mma_bf16_16816_x2(&dv_acc[dt], pa, bd);
                mma_bf16_16816_x2(&dk_acc[dt], da, bq);
            }
        }
        // dSᵀ to shared memory as bf16, the operand of dQ.
        for (int nt = 0; nt < FA_BQ / 8; ++nt)
            for (int hr = 0; hr < 2; ++hr) {
                int kr = key_row + hr * 8, qc = nt * 8 + (lane & 3) * 2;
                *reinterpret_cast<__nv_bfloat162*>(&sds[fa_ds_swz(kr, qc)]) =
                    __floats2bfloat162_rn(dpt[nt][hr * 2], dpt[nt][hr * 2 + 1]);
            }
        __syncthreads();
        // dQ (FA_BQ × HD) += dS · K: warp w takes queries (w % 2)·16.. and
        // head dims (w / 2)·HD/2..; A = dS from the [key][query] tile
        // through the transposing ldmatrix, B = K stored [key][d].
        {
            int qr0 = (warp & 1) * 16, d0 = (warp >> 1) * (HD / 2);
            float dq[HD / 16][4];
            for (int i = 0; i < HD / 16; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
            for (int kk = 0; kk < FA_BN / 16; ++kk) {
                unsigned a[4];
                int m = lane >> 3;
                ldmatrix_x4<true>(a, &sds[fa_ds_swz(kk * 16 + (m >> 1) * 8 + (lane & 7), qr0 + (m & 1) * 8)]);
                for (int dt = 0; dt < HD / 16; dt += 2) {
                    unsigned bk[4];
                    fa_ldb_kn<HD>(bk, sk, kk * 16, d0 + dt * 8);
                    mma_bf16_16816_x2(&dq[dt], a, bk);
                }
            }
            for (int hr = 0; hr < 2; ++hr) {
                i64 qi = q0 + qr0 + (lane >> 2) + hr * 8;
                if (qi >= S) continue;
                float* row = dq_acc + (((i64)b * S + qi) * HQ + h) * HD + d0 + (lane & 3) * 2;
                for (int dt = 0; dt < HD / 16; ++dt) red_add2(row + dt * 8, dq[dt][hr * 2], dq[dt][hr * 2 + 1]);
            }
        }
        __syncthreads();  // the buffers of this step and sds are free
    }
    for (int hr = 0; hr < 2; ++hr) {
        i64 kj = k0 + key_row + hr * 8;
        if (kj >= S) continue;
        i64 at = (((i64)b * S + kj) * HKV + hk) * HD + (lane & 3) * 2;
        for (int dt = 0; dt < HD / 8; ++dt) {
            *reinterpret_cast<__nv_bfloat162*>(&dk[at + dt * 8]) =
                __floats2bfloat162_rn(dk_acc[dt][hr * 2] * scale, dk_acc[dt][hr * 2 + 1] * scale);
            *reinterpret_cast<__nv_bfloat162*>(&dv[at + dt * 8]) =
                __floats2bfloat162_rn(dv_acc[dt][hr * 2], dv_acc[dt][hr * 2 + 1]);
        }
    }
}

#define FLASH_BWD(HD) \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_bwd_bf16_hd##HD( \
        const bf16* q, const bf16* k, const bf16* v, const bf16* d_o, const float* lse, const float* delta, \
        float* dq_acc, bf16* dk, bf16* dv, i64 S, int HQ, int HKV, float scale, const int* docs) { pdl_enter(); \
        flash_bwd_impl<HD>(q, k, v, d_o, lse, delta, dq_acc, dk, dv, S, HQ, HKV, scale, docs); }
FLASH_BWD(64)
FLASH_BWD(128)
