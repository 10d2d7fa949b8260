// fp8 (e4m3) storage of saved activations, one f32 scale per 1×128 block of
// a row: the device form of kernels/src/fp8.rs's host reference, with the
// same f32 steps, so codes and scales are equal bit for bit.
#include <cuda_fp8.h>

#define FP8_BLOCK 128

// A block's scale (amax / 448) and the factor its codes are made with (448 /
// amax: codes e4m3(x * factor), DeepSeek-V3's reference quantisation), as
// kernels/src/fp8.rs's block_scaling: (1, 1) where 448 / amax is not a finite
// f32 (an all-zero block, or amax below about 1.3e-36).
__device__ __forceinline__ float2 fp8_scaling(float amax) {
    const float f = 448.f / amax;
    return f <= 3.40282347e38f ? make_float2(amax / 448.f, f) : make_float2(1.f, 1.f);
}

template <typename T> __device__ __forceinline__ float to_f32v(T x) { return (float)to_acc(x); }
template <> __device__ __forceinline__ float to_f32v<double>(double x) { return __double2float_rn(x); }

// A block of threads per row (grid-stride over rows); each warp takes the
// row's 128-element blocks in turn: four values a lane, the block's amax by
// shuffles, scale = amax / 448 (1 if the block is all zero), codes rounded to
// nearest even and saturated. Lanes take elements j·32 + lane, so the byte
// stores of a warp are contiguous.
template <typename T>
__device__ void fp8_compress_impl(const T* x, unsigned char* codes, float* scales, i64 rows, i64 cols) {
    const i64 bpr = (cols + FP8_BLOCK - 1) / FP8_BLOCK;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        for (i64 bi = warp; bi < bpr; bi += nw) {
            const i64 c0 = bi * FP8_BLOCK;
            const i64 len = min((i64)FP8_BLOCK, cols - c0);
            const T* src = x + r * cols + c0;
            float v[4];
            float amax = 0.f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int c = j * 32 + lane;
                v[j] = c < len ? to_f32v(src[c]) : 0.f;
                amax = fmaxf(amax, fabsf(v[j]));
            }
            for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            const float2 sf = fp8_scaling(amax);
            if (lane == 0) scales[r * bpr + bi] = sf.x;
            unsigned char* dst = codes + r * cols + c0;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int c = j * 32 + lane;
                if (c < len) dst[c] = __nv_cvt_float_to_fp8(v[j] * sf.y, __NV_SATFINITE, __NV_E4M3);
            }
        }
    }
}

template <typename T> __device__ __forceinline__ T from_f32v(float v);
template <> __device__ __forceinline__ float from_f32v<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_f32v<double>(float v) { return (double)v; }
template <> __device__ __forceinline__ bf16 from_f32v<bf16>(float v) { return __float2bfloat16_rn(v); }

// A block of threads per row; each value is decode(code) · its block's scale
// in f32, then stored in T (rounded to nearest for bf16).
template <typename T>
__device__ void fp8_expand_impl(const unsigned char* codes, const float* scales, T* out, i64 rows, i64 cols) {
    const i64 bpr = (cols + FP8_BLOCK - 1) / FP8_BLOCK;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            const __half_raw h = __nv_cvt_fp8_to_halfraw(codes[r * cols + c], __NV_E4M3);
            const float v = __half2float(__half(h)) * scales[r * bpr + c / FP8_BLOCK];
            out[r * cols + c] = from_f32v<T>(v);
        }
    }
}

#define FP8(sfx, T) \
    extern "C" __global__ void fp8_compress_##sfx(const T* x, unsigned char* codes, float* scales, i64 rows, i64 cols) { pdl_enter(); \
        fp8_compress_impl<T>(x, codes, scales, rows, cols); } \
    extern "C" __global__ void fp8_expand_##sfx(const unsigned char* codes, const float* scales, T* out, i64 rows, i64 cols) { pdl_enter(); \
        fp8_expand_impl<T>(codes, scales, out, rows, cols); }
FOR_FLOATS(FP8)

// ---- Blockwise fp8 GEMM operands (kernels/src/fp8.rs: Fp8Tiles). Row tiles
// are the compression above; these are the weights' 128x128 blocks and the
// activations' per-group column tiles, each with the host reference's f32
// steps, so codes and scales are equal bit for bit.

__device__ __forceinline__ unsigned char e4m3_of(float v) {
    return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ float e4m3_value(unsigned char c) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3)));
}

// The block's amax over its 256 threads' `a` (every thread gets it).
__device__ __forceinline__ float block_amax_256(float a) {
    __shared__ float part[8];
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = a;
    __syncthreads();
    float m = part[0];
#pragma unroll
    for (int w = 1; w < 8; w++) m = fmaxf(m, part[w]);
    return m;
}

// A 128 x 128 bf16 tile in shared memory, 64 words a row (a word holds
// columns 2 cp and 2 cp + 1), the word of pair cp of row rho at rho * 64 +
// (cp ^ (rho / 4 % 32)): the 32 lanes of a warp that each read rows 4 l ..
// 4 l + 3 of one column (the transposed codes, four rows to a 4-byte store)
// meet 32 banks, and so do lanes reading along a row.
__device__ __forceinline__ int swz_word(int rho, int cp) { return rho * 64 + (cp ^ ((rho >> 2) & 31)); }
// Column col of row rho of such a tile, as f32.
__device__ __forceinline__ float swz_value(const unsigned* tw, int rho, int col) {
    const unsigned w = tw[swz_word(rho, col >> 1)];
    return __uint_as_float((col & 1) ? (w & 0xffff0000u) : (w << 16));
}

// The codes of eight consecutive values times `f`, packed in element order
// (one 8-byte store).
__device__ __forceinline__ uint2 e4m3_pack8(const float (&v)[8], float f) {
    unsigned lo = 0, hi = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        lo |= (unsigned)e4m3_of(v[e] * f) << (8 * e);
        hi |= (unsigned)e4m3_of(v[e + 4] * f) << (8 * e);
    }
    return make_uint2(lo, hi);
}
// The codes of rows rho0 .. rho0 + 3 of column col of a swz_word tile times
// `f`, packed in row order (one 4-byte store of the transposed codes).
__device__ __forceinline__ unsigned e4m3_pack4_down(const unsigned* tw, int rho0, int col, float f) {
    unsigned out = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) out |= (unsigned)e4m3_of(swz_value(tw, rho0 + q, col) * f) << (8 * q);
    return out;
}

// One block of 256 threads per 128x128 block (grid: column blocks, row
// blocks, matrices) of w [g, r, c]: scale = amax / 448 (1 if all zero) at
// scales[e][bi][bj] of the logical grid, codes at [e][i][j], or at [e][j][i]
// when transposed. The block is staged once in shared memory (swz_word's
// layout) with 16-byte loads where rows are a multiple of 8; codes along the
// stored rows: 8 a thread from registers (plain), or four rows of one column
// a thread (transposed, a warp's 128 rows of a column in one store; single
// bytes if r is not a multiple of 4) — the first version read the transposed
// case down the columns of global memory, one sector a value (~5x the memory
// time), the second stored a byte a thread.
template <typename T>
__device__ void fp8_quant_blocks_impl(const T* w, unsigned char* codes, float* scales, i64 r, i64 c, int transposed) {
    __shared__ __align__(16) unsigned tile_w[128 * 64];
    const i64 e = blockIdx.z, r0 = (i64)blockIdx.y * 128, c0 = (i64)blockIdx.x * 128;
    const i64 nr = min((i64)128, r - r0), nc = min((i64)128, c - c0);
    const T* src = w + e * r * c;
    unsigned char* dst = codes + e * r * c;
    const i64 gr = (r + 127) / 128, gc = (c + 127) / 128;
    if constexpr (sizeof(T) == 2) {
        if (nr == 128 && nc == 128 && c % 8 == 0) {
            float v[8][8];
            float a = 0.f;
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const int u = threadIdx.x + 256 * q, i = u >> 4, p = u & 15;
                const uint4 raw = *reinterpret_cast<const uint4*>(src + (r0 + i) * c + c0 + 8 * p);
                const unsigned* wd = reinterpret_cast<const unsigned*>(&raw);
                const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    v[q][k] = to_f32v(h[k]);
                    a = fmaxf(a, fabsf(v[q][k]));
                }
                if (transposed) {
#pragma unroll
                    for (int k = 0; k < 4; ++k) tile_w[swz_word(i, 4 * p + k)] = wd[k];
                }
            }
            const float2 sf = fp8_scaling(block_amax_256(a));
            const float f = sf.y;
            if (threadIdx.x == 0) scales[e * gr * gc + blockIdx.y * gc + blockIdx.x] = sf.x;
            if (!transposed) {
#pragma unroll
                for (int q = 0; q < 8; ++q) {
                    const int u = threadIdx.x + 256 * q, i = u >> 4, p = u & 15;
                    *reinterpret_cast<uint2*>(dst + (r0 + i) * c + c0 + 8 * p) = e4m3_pack8(v[q], f);
                }
            } else if (r % 4 == 0) {
                // block_amax_256's barrier ordered the tile's writes before these reads.
                for (int u = threadIdx.x; u < 128 * 32; u += 256) {
                    const int j = u >> 5, l = u & 31;
                    *reinterpret_cast<unsigned*>(dst + (c0 + j) * r + r0 + 4 * l) = e4m3_pack4_down(tile_w, 4 * l, j, f);
                }
            } else {
                for (int u = threadIdx.x; u < 128 * 128; u += 256) {
                    const int j = u >> 7, i = u & 127;
                    dst[(c0 + j) * r + r0 + i] = e4m3_of(swz_value(tile_w, i, j) * f);
                }
            }
            return;
        }
    }
    float a = 0.f;
    for (int idx = threadIdx.x; idx < 128 * 128; idx += 256) {
        const int i = idx >> 7, j = idx & 127;
        if (i < nr && j < nc) a = fmaxf(a, fabsf(to_f32v(src[(r0 + i) * c + c0 + j])));
    }
    const float2 sf = fp8_scaling(block_amax_256(a));
    if (threadIdx.x == 0) scales[e * gr * gc + blockIdx.y * gc + blockIdx.x] = sf.x;
    for (int idx = threadIdx.x; idx < 128 * 128; idx += 256) {
        // Stores run along the stored rows (the transpose's, if so).
        const int i = transposed ? (idx & 127) : (idx >> 7), j = transposed ? (idx >> 7) : (idx & 127);
        if (i < nr && j < nc) {
            const unsigned char q = e4m3_of(to_f32v(src[(r0 + i) * c + c0 + j]) * sf.y);
            if (transposed) dst[(c0 + j) * r + r0 + i] = q; else dst[(r0 + i) * c + c0 + j] = q;
        }
    }
}

// Tile `tile` of the per-group column tiling of m rows in `groups` groups
// (kernels/src/fp8.rs: group_column_tiles): a group's rows cut at the
// multiples of 128; its first row and row count, `cols` true. Rows are
// clamped to m, so sizes summing past m stay in bounds. For a tile past the
// groups' own, `cols` false and the q-th run of 128 rows past the groups
// (the one-pass quantisation gives those rows their row tiles; their column
// codes stay 0 and the tile's scales are 1). Enough spare tiles exist: the
// groups' tiles number at most ceil(used / 128) + G - 1 of the
// ceil(m / 128) + G, which leaves ceil((m - used) / 128).
__device__ void rows_cols_span(const int* sizes, i64 groups, i64 m, i64 tile, i64* row0, i64* rows, int* cols) {
    i64 start = 0, tile0 = 0;
    for (i64 g = 0; g < groups; g++) {
        const i64 end = min(start + max(sizes[g], 0), m);
        const i64 tiles = end > start ? (end - 1) / 128 - start / 128 + 1 : 0;
        if (tile < tile0 + tiles) {
            const i64 q = tile - tile0;
            // The first tile starts at the group's first row, the others at
            // a multiple of 128; each ends at the next multiple or the group's end.
            *row0 = q == 0 ? start : (start / 128 + q) * 128;
            *rows = min((*row0 / 128 + 1) * 128, end) - *row0;
            *cols = 1;
            return;
        }
        start = max(start, end);
        tile0 += tiles;
    }
    // start is now the rows the groups cover.
    *row0 = start + (tile - tile0) * 128;
    *rows = max((i64)0, min((i64)128, m - *row0));
    *cols = 0;
}

// Tile `tile` of the per-group column tiling: its first row and row count
// (0 rows for a tile past the groups' own).
__device__ void group_tile(const int* sizes, i64 groups, i64 m, i64 tile, i64* row0, i64* rows) {
    int cols;
    rows_cols_span(sizes, groups, m, tile, row0, rows, &cols);
    if (!cols) *row0 = *rows = 0;
}

// The block's share of a per-group column tiling: tile blockIdx.x (its
// first row and row count) and 32 columns from blockIdx.y · 32.
struct ColTile { i64 tile, row0, rows, c0, nc; };
__device__ ColTile block_col_tile(const int* sizes, i64 groups, i64 m, i64 k) {
    __shared__ i64 span[2];
    ColTile t;
    t.tile = blockIdx.x;
    t.c0 = (i64)blockIdx.y * 32;
    t.nc = min((i64)32, k - t.c0);
    if (threadIdx.x == 0) group_tile(sizes, groups, m, t.tile, &span[0], &span[1]);
    __syncthreads();
    t.row0 = span[0];
    t.rows = span[1];
    return t;
}

// One block of 256 threads per (tile, GC_COLS columns) of x [m, k], in
// chunks of GC_CHUNK columns: each column's amax over the tile's rows gives
// its scale at scales[tile][col] (1 for a tile past the groups), codes
// transposed at codes[col][row] (rows past the groups keep the zeros the
// buffer starts with). The tile's rows are found once per block (a walk
// over the groups by one thread; with a block per 32 columns that walk
// was repeated 64 times a tile at k = 2048), rows staged with 16-byte loads
// where k is a multiple of 8, the transposed stores a warp's 32 rows of one
// column.
#define GC_CHUNK 64
#define GC_COLS 512
template <typename T>
__device__ void fp8_quant_group_cols_impl(const T* x, unsigned char* codes, float* scales, const int* sizes,
                                          i64 m, i64 k, i64 groups, i64 tiles) {
    __shared__ float tile_v[128][GC_CHUNK + 1];
    __shared__ float part[4][GC_CHUNK];
    __shared__ float col_factor[GC_CHUNK];
    __shared__ i64 span[2];
    const i64 tile = blockIdx.x;
    if (threadIdx.x == 0) group_tile(sizes, groups, m, tile, &span[0], &span[1]);
    __syncthreads();
    const i64 row0 = span[0], rows = span[1];
    const i64 cend = min(k, (i64)(blockIdx.y + 1) * GC_COLS);
    for (i64 c0 = (i64)blockIdx.y * GC_COLS; c0 < cend; c0 += GC_CHUNK) {
        const int nc = (int)min((i64)GC_CHUNK, k - c0);
        bool vec = false;
        if constexpr (sizeof(T) == 2) vec = k % 8 == 0 && nc == GC_CHUNK;
        if (vec) {
            for (int u = threadIdx.x; u < 128 * (GC_CHUNK / 8); u += 256) {
                const int i = u / (GC_CHUNK / 8), p = u % (GC_CHUNK / 8);
                uint4 raw = make_uint4(0, 0, 0, 0);
                if (i < rows) raw = *reinterpret_cast<const uint4*>(x + (row0 + i) * k + c0 + 8 * p);
                const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
                for (int q = 0; q < 8; ++q) tile_v[i][8 * p + q] = to_f32v(h[q]);
            }
        } else {
            for (int u = threadIdx.x; u < 128 * GC_CHUNK; u += 256) {
                const int i = u / GC_CHUNK, j = u % GC_CHUNK;
                tile_v[i][j] = (i < rows && j < nc) ? to_f32v(x[(row0 + i) * k + c0 + j]) : 0.f;
            }
        }
        __syncthreads();
        {
            const int col = threadIdx.x % GC_CHUNK, pr = threadIdx.x / GC_CHUNK;
            float a = 0.f;
            for (int i = pr * 32; i < pr * 32 + 32; ++i) a = fmaxf(a, fabsf(tile_v[i][col]));
            part[pr][col] = a;
        }
        __syncthreads();
        if (threadIdx.x < GC_CHUNK) {
            const int j = threadIdx.x;
            const float a = fmaxf(fmaxf(part[0][j], part[1][j]), fmaxf(part[2][j], part[3][j]));
            const float2 sf = fp8_scaling(a);
            col_factor[j] = sf.y;
            if (j < nc) scales[tile * k + c0 + j] = sf.x;
        }
        __syncthreads();
        for (int u = threadIdx.x; u < 128 * GC_CHUNK; u += 256) {
            const int j = u >> 7, i = u & 127;
            if (i < rows && j < nc) codes[(c0 + j) * m + row0 + i] = e4m3_of(tile_v[i][j] * col_factor[j]);
        }
        __syncthreads();  // the chunk's readers are done before the next one is staged
    }
}


// Row tiles (1 x 128, fp8_compress's codes and scales) and per-group column
// tiles (fp8_quant_group_cols's) of bf16 rows [m, k] in one read of them —
// x's own, or with row_src the rows x[row_src[r]] (-1: a zero row), so no
// permuted copy is written: a block
// of 256 threads per (tile, RC_COLS columns), in chunks of 128 columns (one
// row tile's width, k a multiple of 8). Each thread loads 8 columns of one
// row with a 16-byte load, the 16 lanes of a row reduce its amax by shuffles
// and store its codes at once, and keeps its 8 columns' amax over its
// rows; the chunk is staged in shared memory (swz_word's layout, each row at
// its place in the aligned 128-row block the tile lies in) for the columns'
// transposed codes: four rows
// of one column a thread, a warp's 128 rows in one 4-byte store each where
// all four rows are the tile's (single bytes at its ends, or if m is not a
// multiple of 4: the bytes around belong to other groups' tiles).
#define RC_COLS 512
extern "C" __global__ void fp8_quant_rows_cols_bf16(const bf16* x, const int* row_src, unsigned char* rcodes, float* rscales,
                                                   unsigned char* ccodes, float* cscales, const int* sizes,
                                                   i64 m, i64 k, i64 groups) { pdl_enter();
    __shared__ __align__(16) unsigned tile_w[128 * 64];
    __shared__ float part[16][128];
    __shared__ float col_factor[128];
    __shared__ i64 span[2];
    __shared__ int span_cols;
    const i64 tile = blockIdx.x;
    if (threadIdx.x == 0) rows_cols_span(sizes, groups, m, tile, &span[0], &span[1], &span_cols);
    __syncthreads();
    const i64 row0 = span[0], rows = span[1], kb = (k + 127) / 128;
    const bool cols = span_cols != 0;
    // The tile's rows are rows o .. o + rows - 1 of the aligned block at blk.
    const int o = (int)(row0 & 127);
    const i64 blk = row0 - o;
    const int tid = threadIdx.x, p = tid & 15;
    const i64 cend = min(k, (i64)(blockIdx.y + 1) * RC_COLS);
    for (i64 c0 = (i64)blockIdx.y * RC_COLS; c0 < cend; c0 += 128) {
        const int nc = (int)min((i64)128, k - c0);
        // This thread's columns' amax over its rows of the tile.
        float cm[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        // Two rows' loads in flight a thread: issuing all eight first (loads
        // before any store) took 168 registers, one block an SM, and made
        // the kernel 1.6x slower on the H200 (session 39, call 2).
#pragma unroll 2
        for (int q = 0; q < 8; ++q) {
            const int i = (tid >> 4) + 16 * q;
            const bool live = i < rows && 8 * p < nc;
            uint4 raw = make_uint4(0, 0, 0, 0);
            if (live) {
                const i64 src = row_src ? (i64)row_src[row0 + i] : row0 + i;
                if (src >= 0) raw = *reinterpret_cast<const uint4*>(x + src * k + c0 + 8 * p);
            }
            const bf16* h = reinterpret_cast<const bf16*>(&raw);
            float v[8], a = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                v[e] = to_f32v(h[e]);
                a = fmaxf(a, fabsf(v[e]));
            }
            // The row's 16 lanes (a half warp) hold its 128 columns.
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
            const float2 sf = fp8_scaling(a);
            if (live) {
                *reinterpret_cast<uint2*>(rcodes + (row0 + i) * k + c0 + 8 * p) = e4m3_pack8(v, sf.y);
                if (p == 0) rscales[(row0 + i) * kb + c0 / 128] = sf.x;
            }
            if (cols && i < rows) {
                const unsigned* wd = reinterpret_cast<const unsigned*>(&raw);
#pragma unroll
                for (int e = 0; e < 4; ++e) tile_w[swz_word(o + i, 4 * p + e)] = wd[e];
#pragma unroll
                for (int e = 0; e < 8; ++e) cm[e] = fmaxf(cm[e], fabsf(v[e]));
            }
        }
        if (!cols) {
            // A tile past the groups: its column scales are 1.
            if (tid < nc) cscales[tile * k + c0 + tid] = 1.f;
            continue;
        }
        // The columns' amax from the 16 row sets' (each thread's, taken
        // during its loads; a scan of the staged tile, two threads a column,
        // had held the block up for 64 dependent shared loads a chunk).
#pragma unroll
        for (int e = 0; e < 8; ++e) part[tid >> 4][8 * p + e] = cm[e];
        __syncthreads();
        if (tid < 128) {
            float a = 0.f;
#pragma unroll
            for (int r = 0; r < 16; ++r) a = fmaxf(a, part[r][tid]);
            const float2 sf = fp8_scaling(a);
            col_factor[tid] = sf.y;
            if (tid < nc) cscales[tile * k + c0 + tid] = sf.x;
        }
        __syncthreads();
        for (int u = tid; u < 128 * 32; u += 256) {
            const int j = u >> 5, l = u & 31;
            if (j >= nc) continue;
            unsigned char* dst = ccodes + (c0 + j) * m + blk + 4 * l;
            const float f = col_factor[j];
            if (m % 4 == 0 && 4 * l >= o && 4 * l + 4 <= o + rows) {
                *reinterpret_cast<unsigned*>(dst) = e4m3_pack4_down(tile_w, 4 * l, j, f);
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int rho = 4 * l + q;
                    if (rho >= o && rho < o + rows) dst[q] = e4m3_of(swz_value(tile_w, rho, j) * f);
                }
            }
        }
        __syncthreads();  // the chunk's readers are done before the next one is staged
    }
}

#define FP8_OPERANDS(sfx, T) \
    extern "C" __global__ void fp8_quant_blocks_##sfx(const T* w, unsigned char* codes, float* scales, i64 r, i64 c, int transposed) { pdl_enter(); \
        fp8_quant_blocks_impl<T>(w, codes, scales, r, c, transposed); } \
    extern "C" __global__ void fp8_quant_group_cols_##sfx(const T* x, unsigned char* codes, float* scales, const int* sizes, \
                                                         i64 m, i64 k, i64 groups, i64 tiles) { pdl_enter(); \
        fp8_quant_group_cols_impl<T>(x, codes, scales, sizes, m, k, groups, tiles); }
FOR_FLOATS(FP8_OPERANDS)

// The logical f32 values of 128x128-block codes (stored transposed or not).
extern "C" __global__ void fp8_dequant_blocks(const unsigned char* codes, const float* scales, float* out,
                                              i64 g, i64 r, i64 c, int transposed) { pdl_enter();
    const i64 n = g * r * c, gr = (r + 127) / 128, gc = (c + 127) / 128;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (i64)gridDim.x * blockDim.x) {
        const i64 e = idx / (r * c), i = (idx / c) % r, j = idx % c;
        const unsigned char q = transposed ? codes[e * r * c + j * r + i] : codes[idx];
        out[idx] = e4m3_value(q) * scales[e * gr * gc + (i / 128) * gc + j / 128];
    }
}

// The [m, k] f32 values of per-group column-tile codes ([k, m]); rows past
// the groups keep the zeros `out` starts with. Grid as the quantisation's.
extern "C" __global__ void fp8_dequant_group_cols(const unsigned char* codes, const float* scales, const int* sizes,
                                                  float* out, i64 m, i64 k, i64 groups, i64 tiles) { pdl_enter();
    const ColTile t = block_col_tile(sizes, groups, m, k);
    const i64 tile = t.tile, row0 = t.row0, rows = t.rows, c0 = t.c0, nc = t.nc;
    for (int idx = threadIdx.x; idx < 128 * 32; idx += 256) {
        const int i = idx >> 5, j = idx & 31;
        if (i < rows && j < nc)
            out[(row0 + i) * k + c0 + j] = e4m3_value(codes[(c0 + j) * m + row0 + i]) * scales[tile * k + c0 + j];
    }
}
