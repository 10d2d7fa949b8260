// The grouped GEMM over consecutive row blocks whose sizes live on the device
// (the MoE experts' GEMM), and its weight gradient. Dense GEMMs go through
// cuBLAS (linalg.rs). Shape letters: M rows, K inner, N columns, G groups.
//
// This is the simple, correct version: one thread per output element, the
// group found by binary search over the offsets. A tensor-core version will
// replace it; the interface (sizes read on the device, no host sync) stays.

#include <mma.h>

// Offsets [G + 1] from sizes [G], on one thread (G is the expert count).
// Negative sizes and a total above M are reported, and the offsets clamped
// to [0, M] so no later kernel can read or write out of bounds. Also the
// tile offsets [G + 1] of the tensor-core kernel: group g owns tiles
// tiles[g]..tiles[g + 1], ceil(size / tile_rows) of them.
extern "C" __global__ void group_offsets(const int* sizes, int g, i64 m, i64* offs, ErrRec* err,
                                         unsigned int code_negative, unsigned int code_total, i64* tiles, i64 tile_rows) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    i64 t = 0;
    offs[0] = 0;
    for (int i = 0; i < g; ++i) {
        i64 s = sizes[i];
        if (s < 0) {
            report_err(err, code_negative, i, (double)s);
            s = 0;
        }
        t += s;
        offs[i + 1] = t;
    }
    if (t > m) {
        report_err(err, code_total, t, (double)t);
        for (int i = 0; i <= g; ++i) offs[i] = offs[i] < m ? offs[i] : m;
    }
    tiles[0] = 0;
    for (int i = 0; i < g; ++i) tiles[i + 1] = tiles[i] + (offs[i + 1] - offs[i] + tile_rows - 1) / tile_rows;
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
    extern "C" __global__ void grouped_mm_##sfx(const T* x, const T* w, const i64* offs, T* out, i64 m, i64 k, i64 n, int g, int trans_w) { \
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
    extern "C" __global__ void grouped_wgrad_##sfx(const T* x, const T* dy, const i64* offs, T* dw, i64 k, i64 n) { \
        grouped_wgrad_impl<T>(x, dy, offs, dw, k, n); }
FOR_FLOATS(GROUPED_WGRAD)

// ---- bf16 tensor-core grouped GEMM -------------------------------------------------
//
// A block computes a 128 × 128 tile of one group's rows with 8 warps (2 × 4,
// 64 × 32 each) on WMMA 16 × 16 × 16 bf16 fragments with f32 accumulation.
// The grid's x covers the largest possible tile count (M / 128 + G); a block
// finds its group by binary search over the tile offsets and exits if it is
// past the last tile, so the launch needs no sizes from the host. Operand
// tiles are staged in shared memory with zero fill at every edge; results go
// through a per-warp staging tile so rows of the next group are never
// written. Rows past the last group are zeroed by the caller.

#define GM_BM 128
#define GM_BN 128
#define GM_BK 32
#define GM_APAD 8
#define GM_BPAD 8

using namespace nvcuda;

// Shared memory of one pipeline stage: the A tile and the B tile.
#define GM_A_ELEMS (GM_BM * (GM_BK + GM_APAD))
#define GM_B_ELEMS (GM_BN * (GM_BK + GM_BPAD) > GM_BK * (GM_BN + GM_BPAD) ? GM_BN * (GM_BK + GM_BPAD) : GM_BK * (GM_BN + GM_BPAD))

// TRANS = false: w[g] is [K, N], staged row-major [BK][BN]; TRANS = true:
// w[g] is [N, K], staged as [BN][BK] and read as a column-major operand, so
// both layouts load 16 bytes at a time along their contiguous dimension.
// Two stages: the tiles of step k0 + BK are copied (cp.async) while the
// tensor cores work on those of k0. The output staging tile reuses the
// operand buffers once the loop is done (static shared memory is 48 KiB).
template <bool TRANS>
__device__ void grouped_mm_tc_impl(const bf16* __restrict__ x, const bf16* __restrict__ w, const i64* __restrict__ offs,
                                   const i64* __restrict__ tiles, bf16* __restrict__ out, i64 k, i64 n, int g) {
    __shared__ __align__(128) bf16 smem[2 * (GM_A_ELEMS + GM_B_ELEMS)];
    i64 tile = blockIdx.x;
    if (tile >= tiles[g]) return;
    int lo = 0, hi = g - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (tiles[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    int grp = lo;
    i64 row0 = offs[grp] + (tile - tiles[grp]) * GM_BM;
    i64 row_end = offs[grp + 1];
    i64 col0 = (i64)blockIdx.y * GM_BN;
    const bf16* wg = w + (i64)grp * k * n;
    bool vec_k = (k % 8) == 0, vec_n = (n % 8) == 0;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int wm = warp >> 2, wn = warp & 3;  // warp tile: rows wm*64.., cols wn*32..
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    // Issues the copies of the tiles at k0 into stage `st`.
    auto load_tiles = [&](i64 k0, int st) {
        bf16* as = smem + st * (GM_A_ELEMS + GM_B_ELEMS);
        bf16* bsm = as + GM_A_ELEMS;
        // A: 128 × 32, 8 elements per thread-step along k.
        for (int e = threadIdx.x; e < GM_BM * GM_BK / 8; e += 256) {
            int r = e / (GM_BK / 8), c = (e % (GM_BK / 8)) * 8;
            i64 gr = row0 + r, gc = k0 + c;
            load8_async(&as[r * (GM_BK + GM_APAD) + c], x + gr * k + gc, x, gr < row_end, k - gc, vec_k);
        }
        if (!TRANS) {
            // B: [BK][BN + pad], 8 elements along n.
            for (int e = threadIdx.x; e < GM_BK * GM_BN / 8; e += 256) {
                int r = e / (GM_BN / 8), c = (e % (GM_BN / 8)) * 8;
                i64 gr = k0 + r, gc = col0 + c;
                load8_async(&bsm[r * (GM_BN + GM_BPAD) + c], wg + gr * n + gc, w, gr < k, n - gc, vec_n);
            }
        } else {
            // B^T: [BN][BK + pad], 8 elements along k.
            for (int e = threadIdx.x; e < GM_BN * GM_BK / 8; e += 256) {
                int c = e / (GM_BK / 8), r = (e % (GM_BK / 8)) * 8;
                i64 gr = k0 + r, gc = col0 + c;
                load8_async(&bsm[c * (GM_BK + GM_APAD) + r], wg + gc * k + gr, w, gc < n, k - gr, vec_k);
            }
        }
        cp_async_commit();
    };
    load_tiles(0, 0);
    int st = 0;
    for (i64 k0 = 0; k0 < k; k0 += GM_BK, st ^= 1) {
        if (k0 + GM_BK < k) {
            load_tiles(k0 + GM_BK, st ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16* as = smem + st * (GM_A_ELEMS + GM_B_ELEMS);
        const bf16* bsm = as + GM_A_ELEMS;
        for (int kk = 0; kk < GM_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[4];
            for (int i = 0; i < 4; ++i)
                wmma::load_matrix_sync(fa[i], &as[(wm * 64 + i * 16) * (GM_BK + GM_APAD) + kk], GM_BK + GM_APAD);
            if (!TRANS) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb[2];
                for (int j = 0; j < 2; ++j)
                    wmma::load_matrix_sync(fb[j], &bsm[kk * (GM_BN + GM_BPAD) + wn * 32 + j * 16], GM_BN + GM_BPAD);
                for (int i = 0; i < 4; ++i)
                    for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
            } else {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb[2];
                for (int j = 0; j < 2; ++j)
                    wmma::load_matrix_sync(fb[j], &bsm[(wn * 32 + j * 16) * (GM_BK + GM_APAD) + kk], GM_BK + GM_APAD);
                for (int i = 0; i < 4; ++i)
                    for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
            }
        }
        // The next step's copies go into the stage just read.
        __syncthreads();
    }
    float* stage = reinterpret_cast<float*>(smem) + warp * 256;
    for (int i = 0; i < 4; ++i) {
        for (int j = 0; j < 2; ++j) {
            wmma::store_matrix_sync(stage, acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                i64 gr = row0 + wm * 64 + i * 16 + e / 16;
                i64 gc = col0 + wn * 32 + j * 16 + e % 16;
                if (gr < row_end && gc < n) out[gr * n + gc] = __float2bfloat16_rn(stage[e]);
            }
            __syncwarp();
        }
    }
}

// One entry point per layout: a runtime switch would inline both and double
// the static shared memory past the 48 KiB limit.
extern "C" __global__ void __launch_bounds__(256) grouped_mm_tc_bf16_nn(
    const bf16* x, const bf16* w, const i64* offs, const i64* tiles, bf16* out, i64 k, i64 n, int g) {
    grouped_mm_tc_impl<false>(x, w, offs, tiles, out, k, n, g);
}
extern "C" __global__ void __launch_bounds__(256) grouped_mm_tc_bf16_nt(
    const bf16* x, const bf16* w, const i64* offs, const i64* tiles, bf16* out, i64 k, i64 n, int g) {
    grouped_mm_tc_impl<true>(x, w, offs, tiles, out, k, n, g);
}

// ---- bf16 tensor-core grouped weight gradient ----------------------------------------
//
// dw[g] = x_gᵀ · dy_g: a block computes a 128 × 128 tile of one group's
// [K, N] gradient (grid z = group), summing over that group's rows 32 at a
// time, so the reduction length comes from the device offsets. xᵀ is staged
// as [rows][K-tile] (16-byte loads along x's contiguous K) and read as a
// column-major operand; dy as [rows][N-tile], row-major. Rows past the
// group's end load as zeros, and an empty group writes a zero gradient.
extern "C" __global__ void __launch_bounds__(256) grouped_wgrad_tc_bf16(
    const bf16* __restrict__ x, const bf16* __restrict__ dy, const i64* __restrict__ offs, bf16* __restrict__ dw,
    i64 k, i64 n) {
    __shared__ __align__(32) bf16 xs[GM_BK][GM_BM + GM_APAD];
    __shared__ __align__(32) bf16 ds[GM_BK][GM_BN + GM_BPAD];
    __shared__ __align__(32) float stage[8][16 * 16];
    int grp = blockIdx.z;
    i64 k0 = (i64)blockIdx.y * GM_BM, col0 = (i64)blockIdx.x * GM_BN;
    i64 row_beg = offs[grp], row_end = offs[grp + 1];
    bool vec_k = (k % 8) == 0, vec_n = (n % 8) == 0;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int wm = warp >> 2, wn = warp & 3;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    for (i64 r0 = row_beg; r0 < row_end; r0 += GM_BK) {
        for (int e = threadIdx.x; e < GM_BK * GM_BM / 8; e += 256) {
            int r = e / (GM_BM / 8), c = (e % (GM_BM / 8)) * 8;
            i64 gr = r0 + r, gc = k0 + c;
            load8(&xs[r][c], x + gr * k + gc, gr < row_end && gc < k, k - gc, vec_k);
        }
        for (int e = threadIdx.x; e < GM_BK * GM_BN / 8; e += 256) {
            int r = e / (GM_BN / 8), c = (e % (GM_BN / 8)) * 8;
            i64 gr = r0 + r, gc = col0 + c;
            load8(&ds[r][c], dy + gr * n + gc, gr < row_end && gc < n, n - gc, vec_n);
        }
        __syncthreads();
        for (int kk = 0; kk < GM_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> fa[4];
            for (int i = 0; i < 4; ++i) wmma::load_matrix_sync(fa[i], &xs[kk][wm * 64 + i * 16], GM_BM + GM_APAD);
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb[2];
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &ds[kk][wn * 32 + j * 16], GM_BN + GM_BPAD);
            for (int i = 0; i < 4; ++i)
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }
    bf16* out = dw + (i64)grp * k * n;
    for (int i = 0; i < 4; ++i) {
        for (int j = 0; j < 2; ++j) {
            wmma::store_matrix_sync(stage[warp], acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                i64 gr = k0 + wm * 64 + i * 16 + e / 16;
                i64 gc = col0 + wn * 32 + j * 16 + e % 16;
                if (gr < k && gc < n) out[gr * n + gc] = __float2bfloat16_rn(stage[warp][e]);
            }
            __syncwarp();
        }
    }
}
