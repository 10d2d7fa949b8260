// The grouped GEMM over consecutive row blocks whose sizes live on the device
// (the MoE experts' GEMM), and its weight gradient. Dense GEMMs go through
// cuBLAS (linalg.rs). Shape letters: M rows, K inner, N columns, G groups.
//
// f32 and f64 use the simple kernels (one thread per output element, the
// group found by binary search over the offsets); bf16 uses the tensor-core
// kernels at the end of this file. Either way the sizes are read on the
// device, with no host sync.

// Offsets [G + 1] from sizes [G], on one warp (G is the expert count):
// chunks of 32 sizes, each an inclusive shuffle scan plus the running total.
// Negative sizes (the first one is reported) count as 0, and a total above M
// is reported and the offsets clamped to [0, M], so no later kernel can read
// or write out of bounds. Also the tile offsets [G + 1] of the tensor-core
// kernels: group g owns tiles tiles[g]..tiles[g + 1], ceil(size / tile_rows)
// of them. Launch: one block of 32 threads. (One thread walking the groups
// took 25 µs for 128 groups.)
__device__ __forceinline__ i64 warp_incl_scan(i64 v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        i64 u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
    }
    return v;
}
extern "C" __global__ void group_offsets(const int* sizes, int g, i64 m, i64* offs, ErrRec* err,
                                         unsigned int code_negative, unsigned int code_total, i64* tiles, i64 tile_rows) { pdl_enter();
    if (blockIdx.x != 0 || threadIdx.x >= 32) return;
    int lane = threadIdx.x;
    i64 carry = 0;
    int first_neg = -1;
    int neg_val = 0;
    if (lane == 0) offs[0] = 0;
    for (int base = 0; base < g; base += 32) {
        int i = base + lane;
        int s = i < g ? sizes[i] : 0;
        unsigned neg = __ballot_sync(0xffffffffu, s < 0);
        if (neg != 0 && first_neg < 0) {
            int l = __ffs(neg) - 1;
            first_neg = base + l;
            neg_val = __shfl_sync(0xffffffffu, s, l);
        }
        i64 v = warp_incl_scan(s < 0 ? 0 : (i64)s, lane);
        if (i < g) offs[i + 1] = carry + v;
        carry += __shfl_sync(0xffffffffu, v, 31);
    }
    if (lane == 0 && first_neg >= 0) report_err(err, code_negative, first_neg, (double)neg_val);
    i64 t = carry;
    if (lane == 0 && t > m) report_err(err, code_total, t, (double)t);
    // Each lane reads back only the offsets it wrote; a group's start comes
    // from the lane before (or the previous chunk's last lane).
    i64 tcarry = 0, prev_hi = 0;
    if (lane == 0) tiles[0] = 0;
    for (int base = 0; base < g; base += 32) {
        int i = base + lane;
        i64 hi = i < g ? offs[i + 1] : 0;
        hi = hi < m ? hi : m;
        i64 lo = __shfl_up_sync(0xffffffffu, hi, 1);
        if (lane == 0) lo = prev_hi;
        i64 cnt = i < g ? (hi - lo + tile_rows - 1) / tile_rows : 0;
        i64 v = warp_incl_scan(cnt, lane);
        if (i < g) {
            tiles[i + 1] = tcarry + v;
            if (t > m) offs[i + 1] = hi;
        }
        prev_hi = __shfl_sync(0xffffffffu, hi, 31);
        tcarry += __shfl_sync(0xffffffffu, v, 31);
    }
}

// The group of `row`: the last g with offs[g] <= row, or -1 past the end.
__device__ __forceinline__ int find_group(const i64* offs, int g, i64 row) {
    if (row >= offs[g]) return -1;
    int lo = 0, hi = g - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (offs[mid] <= row) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// out[r, n] = Σ_k x[r, k] · w[g(r), k, n] (w[g, n, k] with trans_w); rows past
// the last group are zero. Block (16, 16): x = column, y = row.
template <typename T>
__device__ void grouped_mm_impl(const T* x, const T* w, const i64* offs, T* out, i64 m, i64 k, i64 n, int g, int trans_w) {
    typedef acc_t<T> A;
    extern __shared__ i64 so[];
    for (int i = threadIdx.y * blockDim.x + threadIdx.x; i <= g; i += blockDim.x * blockDim.y) so[i] = offs[i];
    __syncthreads();
    i64 row = (i64)blockIdx.y * blockDim.y + threadIdx.y;
    i64 col = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= m || col >= n) return;
    int grp = find_group(so, g, row);
    A acc = 0;
    if (grp >= 0) {
        const T* xr = x + row * k;
        const T* wg = w + (i64)grp * k * n;
        if (trans_w) {
            const T* wc = wg + col * k;
            for (i64 j = 0; j < k; ++j) acc += to_acc(xr[j]) * to_acc(wc[j]);
        } else {
            for (i64 j = 0; j < k; ++j) acc += to_acc(xr[j]) * to_acc(wg[j * n + col]);
        }
    }
    out[row * n + col] = from_acc<T>(acc);
}
#define GROUPED_MM(sfx, T) \
    extern "C" __global__ void grouped_mm_##sfx(const T* x, const T* w, const i64* offs, T* out, i64 m, i64 k, i64 n, int g, int trans_w) { pdl_enter(); \
        grouped_mm_impl<T>(x, w, offs, out, m, k, n, g, trans_w); }
FOR_FLOATS(GROUPED_MM)

// dw[g, kk, nn] = Σ_{r in group g} x[r, kk] · dy[r, nn]; grid z = group.
template <typename T>
__device__ void grouped_wgrad_impl(const T* x, const T* dy, const i64* offs, T* dw, i64 k, i64 n) {
    typedef acc_t<T> A;
    i64 g = blockIdx.z;
    i64 kk = (i64)blockIdx.y * blockDim.y + threadIdx.y;
    i64 nn = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (kk >= k || nn >= n) return;
    A acc = 0;
    for (i64 r = offs[g]; r < offs[g + 1]; ++r) acc += to_acc(x[r * k + kk]) * to_acc(dy[r * n + nn]);
    dw[(g * k + kk) * n + nn] = from_acc<T>(acc);
}
#define GROUPED_WGRAD(sfx, T) \
    extern "C" __global__ void grouped_wgrad_##sfx(const T* x, const T* dy, const i64* offs, T* dw, i64 k, i64 n) { pdl_enter(); \
        grouped_wgrad_impl<T>(x, dy, offs, dw, k, n); }
FOR_FLOATS(GROUPED_WGRAD)


// ---- bf16 tensor-core grouped GEMM (mma.sync m16n8k16) ------------------------------
//
// One main loop serves the three products. A block computes a 128 × 256 tile
// C = A · B with 8 warps (2 × 4, each 64 × 64 = 4 × 8 mma tiles of 16 × 8),
// stepping the inner dimension 64 at a time through a 4-stage cp.async
// pipeline in dynamic shared memory (4 × 48 KiB = 192 KiB, see
// TC_SMEM_BYTES and linalg.rs), with f32 accumulation:
//   grouped_mm_tc_bf16_nn: A = x rows [128][64 of K], B = w[g] [64 of K][256 of N];
//   grouped_mm_tc_bf16_nt: A as above,               B = w[g] [256 of N][64 of K];
//   grouped_wgrad_tc_bf16: A = xᵀ, staged as x [64 rows][128 of K],
//                          B = dy [64 rows][256 of N] (the reduction runs
//                          over the group's rows).
// Every operand tile is stored as it lies in global memory (rows of 16-byte
// chunks, loaded by cp.async with zero fill past every edge) and swizzled:
// chunk c of row r sits at chunk c ^ (r % 8) of that row (tc_swz). Rows are
// 128, 256 or 512 bytes, so the 8 rows an ldmatrix reads at one logical
// chunk land in 8 different 16-byte bank groups: no bank conflicts, no padding.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 bf16; lane = 4·gid + tig):
//   A (16 × 16, row): reg0 = (row gid,   k 2tig..+1), reg1 = (row gid+8, k 2tig..+1),
//                     reg2 = (row gid,   k 2tig+8..+9), reg3 = (row gid+8, k 2tig+8..+9);
//   B (16 × 8, col):  reg0 = (k 2tig..+1, col gid), reg1 = (k 2tig+8..+9, col gid);
//   C (16 × 8, f32):  c0, c1 = (row gid, col 2tig..+1), c2, c3 = (row gid+8, same cols).
// ldmatrix.x4: lane l gives the address of row l % 8 of matrix j = l / 8 and
// register j receives matrix j; without .trans lane t holds (row t/4, cols
// 2(t%4)..+1) of each matrix, with .trans (rows 2(t%4)..+1, col t/4). So:
//   A stored [m][k], no trans: matrices (m0-7,k0-7) (m8-15,k0-7) (m0-7,k8-15)
//     (m8-15,k8-15) = reg0..3; lane l points at row m = l % 16, k chunk l / 16.
//   A stored [k][m], .trans: matrix (k rows, m cols) transposed gives (m gid,
//     k 2tig..): reg0..3 = (k0-7,m0-7) (k0-7,m8-15) (k8-15,m0-7) (k8-15,m8-15);
//     lane l: k row = l % 8 + 8·(j / 2), m chunk = j % 2.
//   B stored [n][k], no trans: (n gid, k 2tig..) is B's layout: matrices
//     (n0-7,k0-7) (n0-7,k8-15) = regs of n-tile 0, (n8-15,k0-7) (n8-15,k8-15)
//     = n-tile 1; lane l: n row = l % 8 + 8·(j / 2), k chunk = j % 2.
//   B stored [k][n], .trans: (k 2tig.., n gid) is B's layout: matrices
//     (k0-7,n0-7) (k8-15,n0-7) = n-tile 0, (k0-7,n8-15) (k8-15,n8-15) = n-tile 1;
//     lane l: k row = l % 8 + 8·(j % 2), n chunk = j / 2.
// The result goes through shared memory (bf16, rows padded to 264) so each
// thread stores 16 bytes at a time, only rows and columns inside the
// block's bounds (never rows of another group).

#define TC_BM 128
#define TC_BN 256
#define TC_BK 64
#define TC_STAGES 4
#define TC_THREADS 256
#define TC_A_ELEMS (TC_BM * TC_BK)
#define TC_B_ELEMS (TC_BK * TC_BN)
#define TC_STAGE_ELEMS (TC_A_ELEMS + TC_B_ELEMS)
#define TC_OUT_LD (TC_BN + 8)
// 196608 bytes; linalg.rs's TC_SMEM_BYTES must agree.
#define TC_SMEM_BYTES (TC_STAGES * TC_STAGE_ELEMS * 2)

// Element offset of chunk c (8 bf16) of row r in a swizzled tile with
// `chunks` chunks per row (8, 16 or 32).
__device__ __forceinline__ int tc_swz(int r, int c, int chunks) { return (r * chunks + (c ^ (r & 7))) << 3; }

// Issues the copies of a ROWS × (CHUNKS · 8) tile: row r, column c of the
// tile is base[(row0 + r) · ld + col0 + c], zero where row0 + r >= row_lim
// or col0 + c >= col_lim. `vec`: rows are 16-byte aligned (ld % 8 == 0),
// else element loads.
template <int ROWS, int CHUNKS>
__device__ __forceinline__ void tc_load_tile(bf16* s, const bf16* base, i64 ld, i64 row0, i64 row_lim, i64 col0,
                                             i64 col_lim, bool vec) {
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / TC_THREADS; ++i) {
        int e = threadIdx.x + i * TC_THREADS;
        int r = e / CHUNKS, c = e % CHUNKS;
        i64 gr = row0 + r, gc = col0 + c * 8;
        load8_async(s + tc_swz(r, c, CHUNKS), base + gr * ld + gc, base, gr < row_lim, col_lim - gc, vec);
    }
}

// The same copies for a tile wholly inside the matrix with 16-byte aligned
// rows (the common case: no bounds to check). `base` is the tile's corner.
// Thread t copies chunk t % CHUNKS of rows t / CHUNKS + i · (256 / CHUNKS);
// 256 / CHUNKS is a multiple of 8, so every row a thread copies has the
// same swizzle and its shared offsets step by a constant.
template <int ROWS, int CHUNKS>
__device__ __forceinline__ void tc_load_tile_full(bf16* s, const bf16* base, i64 ld) {
    constexpr int STEP = TC_THREADS / CHUNKS;
    int r = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
    const bf16* src = base + r * ld + c * 8;
    unsigned dst = (unsigned)__cvta_generic_to_shared(s + tc_swz(r, c, CHUNKS));
#pragma unroll
    for (int i = 0; i < ROWS / STEP; ++i)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + i * STEP * CHUNKS * 16),
                     "l"(src + i * STEP * ld));
}

// acc += A · B over one stage (64 of the inner dimension). A_KM: A is
// stored [k][m] (the wgrad's x tile), else [m][k]. B_NK: B is stored [n][k]
// (w of the nt product), else [k][n].
template <bool A_KM, bool B_NK>
__device__ __forceinline__ void tc_compute_stage(const bf16* as, const bf16* bs, float (&acc)[4][8][4], int wm, int wn,
                                                 int lane) {
    int j = lane >> 3;
#pragma unroll
    for (int ks = 0; ks < TC_BK / 16; ++ks) {
        unsigned a[4][4], b[8][2];
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
            if (!A_KM) {
                int r = wm * 64 + mi * 16 + (lane & 15);
                ldmatrix_x4<false>(a[mi], as + tc_swz(r, ks * 2 + (lane >> 4), TC_BK / 8));
            } else {
                int r = ks * 16 + (lane & 7) + (j >> 1) * 8;
                ldmatrix_x4<true>(a[mi], as + tc_swz(r, (wm * 64 + mi * 16) / 8 + (j & 1), TC_BM / 8));
            }
        }
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            unsigned t[4];
            int nb = wn * 64 + np * 16;
            if (B_NK) {
                int r = nb + (lane & 7) + (j >> 1) * 8;
                ldmatrix_x4<false>(t, bs + tc_swz(r, ks * 2 + (j & 1), TC_BK / 8));
            } else {
                int r = ks * 16 + (lane & 7) + (j & 1) * 8;
                ldmatrix_x4<true>(t, bs + tc_swz(r, nb / 8 + (j >> 1), TC_BN / 8));
            }
            b[2 * np][0] = t[0];
            b[2 * np][1] = t[1];
            b[2 * np + 1][0] = t[2];
            b[2 * np + 1][1] = t[3];
        }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int ni = 0; ni < 8; ++ni) mma_bf16_16816(acc[mi][ni], a[mi], b[ni]);
    }
}

// The pipelined main loop over `nk` steps; load(step, stage_ptr) issues the
// copies of a step's A tile (at stage_ptr) and B tile (at + TC_A_ELEMS).
// Step kt waits for its own copies (at most STAGES - 2 newer groups pending),
// then a barrier, after which the stage read at kt - 1 is refilled with step
// kt + STAGES - 1 while the tensor cores work on step kt. Ends with all
// copies done and a barrier, so the caller may reuse the shared memory.
template <bool A_KM, bool B_NK, class Load>
__device__ __forceinline__ void tc_mainloop(bf16* smem, int nk, Load load, float (&acc)[4][8][4]) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int wm = warp >> 2, wn = warp & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][jj][e] = 0.0f;
#pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) {
        if (s < nk) load(s, smem + s * TC_STAGE_ELEMS);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<TC_STAGES - 2>();
        __syncthreads();
        int nx = kt + TC_STAGES - 1;
        if (nx < nk) load(nx, smem + (nx % TC_STAGES) * TC_STAGE_ELEMS);
        cp_async_commit();
        const bf16* st = smem + (kt % TC_STAGES) * TC_STAGE_ELEMS;
        tc_compute_stage<A_KM, B_NK>(st, st + TC_A_ELEMS, acc, wm, wn, lane);
    }
    cp_async_wait<0>();
    __syncthreads();
}

// Writes the block's 128 × 256 result: element (r, c) to out[(row0 + r) · ld
// + col0 + c] where row0 + r < row_lim and col0 + c < col_lim. `vec`: ld % 8
// == 0 (16-byte stores). `smem` must be free (after tc_mainloop).
__device__ __forceinline__ void tc_store(bf16* smem, float (&acc)[4][8][4], bf16* out, i64 ld, i64 row0, i64 row_lim,
                                         i64 col0, i64 col_lim, bool vec) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int wm = warp >> 2, wn = warp & 3;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
            int r = wm * 64 + mi * 16 + (lane >> 2), c = wn * 64 + ni * 8 + (lane & 3) * 2;
            *reinterpret_cast<unsigned*>(smem + r * TC_OUT_LD + c) = pack_bf16(acc[mi][ni][0], acc[mi][ni][1]);
            *reinterpret_cast<unsigned*>(smem + (r + 8) * TC_OUT_LD + c) = pack_bf16(acc[mi][ni][2], acc[mi][ni][3]);
        }
    __syncthreads();
#pragma unroll 4
    for (int e = threadIdx.x; e < TC_BM * TC_BN / 8; e += TC_THREADS) {
        int r = e / (TC_BN / 8), c = (e % (TC_BN / 8)) * 8;
        i64 gr = row0 + r, gc = col0 + c;
        if (gr >= row_lim || gc >= col_lim) continue;
        const bf16* s = smem + r * TC_OUT_LD + c;
        bf16* d = out + gr * ld + gc;
        if (vec && gc + 8 <= col_lim) {
            *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s);
        } else {
            for (int q = 0; q < 8 && gc + q < col_lim; ++q) d[q] = s[q];
        }
    }
}

extern __shared__ __align__(128) bf16 tc_smem[];

// out[r, :] = x[r, :] · w[g(r)] for the rows of one 128-row tile of one group
// (w[g] is [K, N], or [N, K] with TRANS). The 1-d grid covers the largest
// possible tile count (M / 128 + G) times the column tiles, column tiles
// fastest (blocks running together share x's rows in L2); a block finds its
// group by binary search over the tile offsets and exits if it is past the
// last tile, so the launch needs no sizes from the host. Rows past the last
// group are zeroed by the caller.
template <bool TRANS>
__device__ __forceinline__ void tc_grouped_mm(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                              const i64* __restrict__ offs, const i64* __restrict__ tiles,
                                              bf16* __restrict__ out, i64 k, i64 n, int g) {
    i64 ncol = (n + TC_BN - 1) / TC_BN;
    i64 tile = (i64)blockIdx.x / ncol;
    i64 col0 = ((i64)blockIdx.x % ncol) * TC_BN;
    if (g <= 0 || tile >= tiles[g]) return;
    int lo = 0, hi = g - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (tiles[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    int grp = lo;
    i64 row0 = offs[grp] + (tile - tiles[grp]) * TC_BM;
    i64 row_end = offs[grp + 1];
    const bf16* wg = w + (i64)grp * k * n;
    bool vec_k = (k % 8) == 0, vec_n = (n % 8) == 0;
    float acc[4][8][4];
    int nk = (int)((k + TC_BK - 1) / TC_BK);
    bool full = row0 + TC_BM <= row_end && col0 + TC_BN <= n && k % TC_BK == 0 && vec_k && vec_n;
    // nn only: in a group's last, partial row tile the w tiles still lie
    // wholly inside w[g] when the column tile does, so they load without
    // bounds checks (for nt the extra path made ptxas spill, and nt with
    // uneven groups measured as fast as with uniform ones).
    bool b_in = !TRANS && col0 + TC_BN <= n && k % TC_BK == 0 && vec_n;
    if (full) {
        const bf16* xa = x + row0 * k;
        const bf16* wb = TRANS ? wg + col0 * k : wg + col0;
        tc_mainloop<false, TRANS>(tc_smem, nk, [&](int step, bf16* s) {
            i64 k0 = (i64)step * TC_BK;
            tc_load_tile_full<TC_BM, TC_BK / 8>(s, xa + k0, k);
            if (TRANS)
                tc_load_tile_full<TC_BN, TC_BK / 8>(s + TC_A_ELEMS, wb + k0, k);
            else
                tc_load_tile_full<TC_BK, TC_BN / 8>(s + TC_A_ELEMS, wb + k0 * n, n);
        }, acc);
    } else {
        tc_mainloop<false, TRANS>(tc_smem, nk, [&](int step, bf16* s) {
            i64 k0 = (i64)step * TC_BK;
            tc_load_tile<TC_BM, TC_BK / 8>(s, x, k, row0, row_end, k0, k, vec_k);
            if (b_in)
                tc_load_tile_full<TC_BK, TC_BN / 8>(s + TC_A_ELEMS, wg + k0 * n + col0, n);
            else if (TRANS)
                tc_load_tile<TC_BN, TC_BK / 8>(s + TC_A_ELEMS, wg, k, col0, n, k0, k, vec_k);
            else
                tc_load_tile<TC_BK, TC_BN / 8>(s + TC_A_ELEMS, wg, n, k0, k, col0, n, vec_n);
        }, acc);
    }
    tc_store(tc_smem, acc, out, n, row0, row_end, col0, n, vec_n);
}

// Two entry points: each inlines one layout. Dynamic shared memory
// TC_SMEM_BYTES; grid ((M / 128 + G) · ceil(N / 256)), block 256.
extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) grouped_mm_tc_bf16_nn(
    const bf16* x, const bf16* w, const i64* offs, const i64* tiles, bf16* out, i64 k, i64 n, int g) { pdl_enter();
    tc_grouped_mm<false>(x, w, offs, tiles, out, k, n, g);
}
extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) grouped_mm_tc_bf16_nt(
    const bf16* x, const bf16* w, const i64* offs, const i64* tiles, bf16* out, i64 k, i64 n, int g) { pdl_enter();
    tc_grouped_mm<true>(x, w, offs, tiles, out, k, n, g);
}

// dw[g] = x_gᵀ · dy_g: a block computes a 128 × 256 tile of one group's
// [K, N] gradient (grid x = column tile, y = K tile, z = group), summing over
// that group's rows 64 at a time, so the reduction length comes from the
// device offsets. Rows past the group's end load as zeros, and an empty
// group writes a zero gradient. Dynamic shared memory TC_SMEM_BYTES.
// The bounds checks are per step: when the block's K × N tile lies inside
// the matrices, every step of 64 rows wholly inside the group loads without
// them and only the group's last, partial step (size % 64 rows) checks its
// rows (group sizes are rarely multiples of 64 after routing).
extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) grouped_wgrad_tc_bf16(
    const bf16* __restrict__ x, const bf16* __restrict__ dy, const i64* __restrict__ offs, bf16* __restrict__ dw,
    i64 k, i64 n) { pdl_enter();
    int grp = blockIdx.z;
    i64 k0 = (i64)blockIdx.y * TC_BM, col0 = (i64)blockIdx.x * TC_BN;
    i64 row_beg = offs[grp], row_end = offs[grp + 1];
    i64 rows = row_end > row_beg ? row_end - row_beg : 0;
    bool vec_k = (k % 8) == 0, vec_n = (n % 8) == 0;
    float acc[4][8][4];
    int nk = (int)((rows + TC_BK - 1) / TC_BK);
    bool tile_in = k0 + TC_BM <= k && col0 + TC_BN <= n && vec_k && vec_n;
    int nfull = tile_in ? (int)(rows / TC_BK) : 0;
    const bf16* xa = x + row_beg * k + k0;
    const bf16* db = dy + row_beg * n + col0;
    tc_mainloop<true, false>(tc_smem, nk, [&](int step, bf16* s) {
        i64 r = (i64)step * TC_BK;
        if (step < nfull) {
            tc_load_tile_full<TC_BK, TC_BM / 8>(s, xa + r * k, k);
            tc_load_tile_full<TC_BK, TC_BN / 8>(s + TC_A_ELEMS, db + r * n, n);
        } else {
            tc_load_tile<TC_BK, TC_BM / 8>(s, x, k, row_beg + r, row_end, k0, k, vec_k);
            tc_load_tile<TC_BK, TC_BN / 8>(s + TC_A_ELEMS, dy, n, row_beg + r, row_end, col0, n, vec_n);
        }
    }, acc);
    tc_store(tc_smem, acc, dw + (i64)grp * k * n, n, k0, k, col0, n, vec_n);
}
