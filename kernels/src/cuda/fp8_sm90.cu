// Hopper (sm_90a) blockwise fp8 grouped GEMM (issue 22): the forward and the
// data gradient of the routed experts, y = x · op(w[g]), on e4m3 operands
// with DeepSeek-V3's scales (fp8.rs picks it; Fp8Ops' emulation stays for
// other GPUs, other dtypes and shapes a tensor map cannot describe); the
// weight gradient dw[g] = x_gᵀ dy_g is the second kernel, further down.
//
// Operands, both stored with the summed dimension K contiguous (what fp8
// wgmma reads: K-major only):
//   A = x codes [M, K] (e4m3 bytes), scales sa [M, KB] (one per row and 128
//       of K; KB = ceil(K / 128));
//   B = w codes [G, N, K], scales sb: one per 128 × 128 block, at
//       sb[g · gs + kb · ks + nb · ns] (the strides of the logical matrix's
//       block grid: fp8.rs passes them for either layout).
// Design: grouped_sm90.cu's persistent, warp-specialised kernel with fp8
// tiles: 128 × 128 output tiles (group g owns ceil(size_g / 128) row tiles,
// from the same group_offsets; column tiles fastest; rows past the last
// group are one more pseudo-group storing zeros), 384 threads: warpgroup 2
// the producer (one thread issues the TMA copies, 128-byte swizzle), 0 and
// 1 the consumers (64 rows each). A 128-byte swizzled row holds exactly 128
// fp8 values, one scale block: one pipeline stage (A 128 × 128 and B
// 128 × 128 bytes, 32 KiB; 6 stages) is one 128-deep block of K. Per
// stage each consumer runs 4 wgmma m64n128k32 into a temporary accumulator
// (the first overwriting it), waits for them, releases the stage and
// promotes: acc += tmp · (sa[row, kb] · sb[g, kb, nb]) in f32. The tensor
// cores' own accumulation inside those 128 products is narrower than f32
// (DeepSeek-V3: about 14 bits kept); the promotion bounds its error to one
// block's sum. Registers: tmp + acc = 128 floats a thread (setmaxnreg 232).
// K past the array and B rows past N arrive as zeros from the copy engine;
// A rows of the next group are multiplied but not stored.
// Shared-memory descriptors: K-major, 128-byte swizzle, SBO = 1024 (8 rows
// of 128 bytes), k32 step kk starts 32 kk bytes in (as bf16's k16 steps).
// Output bf16 or f32 (OUTF), stored from registers: rows inside the tile's
// group, columns inside N.
// The whole module compiles to nothing for other architectures.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define F8_BM 128
#define F8_BN 128
#define F8_BK 128
#define F8_ST 6
#define F8_THREADS 384
#define F8_A_BYTES (F8_BM * F8_BK)
#define F8_STAGE_BYTES (F8_A_BYTES + F8_BN * F8_BK)
// Shared memory: 1024 bytes of alignment slack, the stages, 128 bytes of
// mbarriers, the 8 consumer warps' store buffers (16 rows of 128 bytes,
// rows 144 bytes apart), then the group and tile offsets (fp8.rs's
// f8_smem_bytes).
#define F8_STG (F8_ST * F8_STAGE_BYTES + 128)
#define F8_STG_WARP (16 * 144)
#define F8_OFFS (F8_STG + 8 * F8_STG_WARP)

// d[0..63] (+)= A · B for one m64n128k32 (f32 accumulators, e4m3 operands
// from shared memory through descriptors, both K-major; acc = 0 overwrites
// d). fp8 wgmma has no transpose immediates: only the two scale ones.
__device__ __forceinline__ void f8_mma(float (&d)[64], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(acc));
}

extern __shared__ __align__(1024) unsigned char f8_smem[];

// One output tile: rows row0 .. row_end - 1 (the group's rows; M for the
// zero tail) of out, columns col0 .., group grp, nk blocks of K (0: zeros).
struct F8Tile {
    int grp, nk;
    i64 row0, row_end, col0;
};

__device__ __forceinline__ F8Tile f8_tile(i64 t, const i64* so, const i64* st, i64 m, int nk, i64 n, int g) {
    F8Tile r;
    i64 ncol = (n + F8_BN - 1) / F8_BN;
    i64 rt = t / ncol;
    r.col0 = (t - rt * ncol) * F8_BN;
    i64 body = st[g];
    if (rt >= body) {
        r.grp = g;
        r.row0 = so[g] + (rt - body) * F8_BM;
        r.row_end = m;
        r.nk = 0;
    } else {
        // The last group whose first tile is at or before rt (empty groups
        // share their successor's first tile and lose the tie).
        int lo = 0, hi = g - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (st[mid] <= rt) lo = mid; else hi = mid - 1;
        }
        r.grp = lo;
        r.row0 = so[lo] + (rt - st[lo]) * F8_BM;
        r.row_end = so[lo + 1];
        r.nk = nk;
    }
    return r;
}

// Two output values at columns c, c + 1 of a row starting at out + at - c
// (c even): one 8- or 4-byte store when N is even (then c < N means
// c + 1 < N), else each value alone, inside N.
template <bool OUTF>
__device__ __forceinline__ void f8_store2(void* out, i64 at, i64 c, i64 n, float a, float b) {
    if (OUTF) {
        float* o = reinterpret_cast<float*>(out) + at;
        if ((n & 1) == 0) {
            if (c < n) *reinterpret_cast<float2*>(o) = make_float2(a, b);
        } else {
            if (c < n) o[0] = a;
            if (c + 1 < n) o[1] = b;
        }
    } else {
        bf16* o = reinterpret_cast<bf16*>(out) + at;
        if ((n & 1) == 0) {
            if (c < n) *reinterpret_cast<unsigned*>(o) = pack_bf16(a, b);
        } else {
            if (c < n) o[0] = __float2bfloat16_rn(a);
            if (c + 1 < n) o[1] = __float2bfloat16_rn(b);
        }
    }
}

// f8_mma with acc = 0: d is only written (no loop-carried values for the
// compiler to move between registers while a wgmma writes them).
__device__ __forceinline__ void f8_mma0(float (&d)[64], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1;\n"
        "}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]),
          "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]),
          "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]),
          "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]),
          "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]),
          "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]),
          "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]),
          "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63])
        : "l"(da), "l"(db), "r"(0));
}

// The 4 wgmmas of one 128-deep block of K into t (overwritten), committed
// as one group: a = this warpgroup's 64 rows of A, b = B, in the stage.
__device__ __forceinline__ void f8_issue(float (&t)[64], unsigned a, unsigned b) {
    wg_fence();
    f8_mma0(t, wgmma_desc(a, 16, 1024), wgmma_desc(b, 16, 1024));
#pragma unroll
    for (int kk = 1; kk < F8_BK / 32; ++kk)
        f8_mma(t, wgmma_desc(a + kk * 32, 16, 1024), wgmma_desc(b + kk * 32, 16, 1024), 1);
    wg_commit();
    wg_pin(t);
}

// Promotion: acc += t · scale, register 4 j + e holding row r0 (p0) or,
// for e >= 2, row r0 + 8 (p1).
__device__ __forceinline__ void f8_promote(float (&acc)[64], float (&t)[64], float p0, float p1) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        acc[4 * j] = fmaf(t[4 * j], p0, acc[4 * j]);
        acc[4 * j + 1] = fmaf(t[4 * j + 1], p0, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(t[4 * j + 2], p1, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(t[4 * j + 3], p1, acc[4 * j + 3]);
    }
}

// Eight (bf16) or four (f32) stored values of f8_store_staged's ADD: old +
// v per element in f32, rounded to the dtype.
template <bool OUTF>
__device__ __forceinline__ uint4 f8_add_piece(uint4 old, uint4 v) {
    unsigned* o = reinterpret_cast<unsigned*>(&old);
    unsigned* p = reinterpret_cast<unsigned*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (OUTF) {
            p[i] = __float_as_uint(__uint_as_float(o[i]) + __uint_as_float(p[i]));
        } else {
            float lo = __uint_as_float(o[i] << 16) + __uint_as_float(p[i] << 16);
            float hi = __uint_as_float(o[i] & 0xffff0000u) + __uint_as_float(p[i] & 0xffff0000u);
            p[i] = pack_bf16(lo, hi);
        }
    }
    return v;
}

// The staged store of V2 (and the weight gradient): a warp's 16 rows of an
// output tile, rows rw .. rw + 15 of out (those below row_end), columns
// col0 .. col0 + 127 (those below n), from acc (register 4 j + e: row
// lane / 4 (+ 8 for e >= 2), column 8 j + 2 (lane % 4) + e % 2) through
// the warp's buffer sw (16 rows, 144 bytes apart).
// With ADD each stored value is added to the one already there, in f32 and
// rounded once more (the product rounded to the output's dtype first): what
// storing the product and adding it to the tensor would give, bit for bit.
// `put(q, j)` writes register group j's values (registers 4 j .. 4 j + 3)
// at q (row lane / 4) and q + 8 · 144 (row lane / 4 + 8) of the buffer.
template <bool OUTF, bool ADD, typename Put>
__device__ __forceinline__ void f8_store_passes(void* __restrict__ out, Put&& put, unsigned char* sw, i64 rw,
                                                i64 row_end, i64 col0, i64 n, int lane) {
    // Each warp writes its 16 rows, 128 bytes of columns at a
    // time (bf16: 64 columns, f32: 32), into its buffer (rows 144
    // bytes apart: a warp's 4-byte writes hit 32 banks), then stores
    // whole 16-byte pieces of rows inside the group, columns inside
    // N (element by element where a piece crosses N or N is not a
    // multiple of the piece).
    constexpr int EB = OUTF ? 4 : 2;      // bytes per element
    constexpr int CP = 128 / EB;          // columns per pass
    constexpr int PE = 16 / EB;           // elements per piece
    constexpr int NP = F8_BN / CP;        // passes
#pragma unroll
    for (int c = 0; c < NP; ++c) {
        if (col0 + c * CP >= n) break;
        // ADD's old values: the pass's four pieces loaded before any of
        // them is stored (one global round trip a pass, not one a piece,
        // which each store before the next load would serialise).
        uint4 old[4];
        if (ADD && n % PE == 0) {
#pragma unroll
            for (int qq = 0; qq < 4; ++qq) {
                int i = lane + 32 * qq, row = i >> 3, ch = i & 7;
                i64 gr = rw + row, gc = col0 + c * CP + ch * PE;
                if (gr < row_end && gc < n)
                    old[qq] = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(out) +
                                                              (gr * n + gc) * EB);
            }
        }
#pragma unroll
        for (int jj = 0; jj < CP / 8; ++jj) {
            int j = c * (CP / 8) + jj;
            put(sw + (lane >> 2) * 144 + (jj * 8 + 2 * (lane & 3)) * EB, j);
        }
        __syncwarp();
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) {
            int i = lane + 32 * qq, row = i >> 3, ch = i & 7;
            i64 gr = rw + row, gc = col0 + c * CP + ch * PE;
            if (gr < row_end && gc < n) {
                const unsigned char* src = sw + row * 144 + ch * 16;
                unsigned char* dst = reinterpret_cast<unsigned char*>(out) + (gr * n + gc) * EB;
                if (n % PE == 0) {
                    uint4 v = *reinterpret_cast<const uint4*>(src);
                    if (ADD) v = f8_add_piece<OUTF>(old[qq], v);
                    *reinterpret_cast<uint4*>(dst) = v;
                } else {
                    for (int e = 0; e < PE && gc + e < n; ++e) {
                        if (OUTF) {
                            float v = reinterpret_cast<const float*>(src)[e];
                            if (ADD) v += reinterpret_cast<const float*>(dst)[e];
                            reinterpret_cast<float*>(dst)[e] = v;
                        } else {
                            bf16 v = reinterpret_cast<const bf16*>(src)[e];
                            if (ADD)
                                v = __float2bfloat16_rn(__bfloat162float(reinterpret_cast<const bf16*>(dst)[e]) +
                                                        __bfloat162float(v));
                            reinterpret_cast<bf16*>(dst)[e] = v;
                        }
                    }
                }
            }
        }
        __syncwarp();
    }
}

// f8_store_passes of acc.
template <bool OUTF, bool ADD = false>
__device__ __forceinline__ void f8_store_staged(void* __restrict__ out, const float (&acc)[64], unsigned char* sw,
                                                i64 rw, i64 row_end, i64 col0, i64 n, int lane) {
    f8_store_passes<OUTF, ADD>(
        out,
        [&](unsigned char* q, int j) {
            if (OUTF) {
                *reinterpret_cast<float2*>(q) = make_float2(acc[4 * j], acc[4 * j + 1]);
                *reinterpret_cast<float2*>(q + 8 * 144) = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
            } else {
                *reinterpret_cast<unsigned*>(q) = pack_bf16(acc[4 * j], acc[4 * j + 1]);
                *reinterpret_cast<unsigned*>(q + 8 * 144) = pack_bf16(acc[4 * j + 2], acc[4 * j + 3]);
            }
        },
        sw, rw, row_end, col0, n, lane);
}

// acc rounded to bf16 pairs as f8_store_staged stores them: word 2 j + h
// holds registers 4 j + 2 h and 4 j + 2 h + 1.
__device__ __forceinline__ void f8_pack(unsigned (&pk)[32], const float (&acc)[64]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) pk[i] = pack_bf16(acc[2 * i], acc[2 * i + 1]);
}

// f8_store_staged's bf16 store of f8_pack's words.
template <bool ADD>
__device__ __forceinline__ void f8_store_packed(void* __restrict__ out, const unsigned (&pk)[32], unsigned char* sw,
                                                i64 rw, i64 row_end, i64 col0, i64 n, int lane) {
    f8_store_passes<false, ADD>(
        out,
        [&](unsigned char* q, int j) {
            *reinterpret_cast<unsigned*>(q) = pk[2 * j];
            *reinterpret_cast<unsigned*>(q + 8 * 144) = pk[2 * j + 1];
        },
        sw, rw, row_end, col0, n, lane);
}

// V2's pipeline state: the ring position, the last issued block's stage
// (ps) and scales (q0, q1: rows r0, r0 + 8), the next block's three scales
// as loaded (n0, n1: A's rows r0, r0 + 8; nw: B's block), and the
// consumers' skew.
struct F8Pipe {
    int s;
    unsigned ph;
    int ps;
    float q0, q1;
    float n0, n1, nw;
    WgSkew<3> skew;
};

// Whether each step loads the next block's scales (a step ahead of their
// use, so their L2 latency hides under a whole step) rather than its own
// (used at the end of the same step); compile.rs sets it from
// FOLDMOE_F8_PREFETCH for comparisons. Off by default until it has run on a
// GPU (ptxas: with it V3 spills nothing, without it 64 / 12 / 80 / 84 bytes).
#ifndef FOLDMOE_F8_PREFETCH
#define FOLDMOE_F8_PREFETCH 0
#endif

// Whether V3 defers a chained tile's store (f8_chain's tiles of 6 and 16
// blocks) until the next tile's first block is issued, so that the store's
// latency runs under those wgmmas instead of with the tensor cores idle;
// compile.rs sets it from FOLDMOE_F8_OVERLAP for comparisons. Off by
// default until it has been measured on a GPU.
#ifndef FOLDMOE_F8_OVERLAP
#define FOLDMOE_F8_OVERLAP 0
#endif

// Block kb's scales into pp.n0, pp.n1, pp.nw.
__device__ __forceinline__ void f8_load_scales(F8Pipe& pp, int kb, const float* sa0, const float* sa1,
                                               const float* sbt, i64 sbk) {
    pp.n0 = __ldg(sa0 + kb);
    pp.n1 = __ldg(sa1 + kb);
    pp.nw = __ldg(sbt + kb * sbk);
}

// One V2 step: block kb's wgmmas into cur, its stage and scales noted in
// pp; then (RETIRE) the previous block's, in prev, waited for (wait_group
// 1: cur's stay in flight), its stage released and prev promoted.
// With FOLDMOE_F8_PREFETCH block kb's scales were loaded by the step before
// (f8_load_scales before a tile's first) and this one loads block kb + 1's (of nk).
template <bool RETIRE>
__device__ __forceinline__ void f8_step(float (&acc)[64], float (&cur)[64], float (&prev)[64], int kb, int nk,
                                        const float* sa0, const float* sa1, const float* sbt, i64 sbk, unsigned stage0,
                                        unsigned bar0, int wg, int lane, F8Pipe& pp) {
    if (!FOLDMOE_F8_PREFETCH) f8_load_scales(pp, kb, sa0, sa1, sbt, sbk);
    float s0 = pp.n0, s1 = pp.n1, sw = pp.nw;
    if (FOLDMOE_F8_PREFETCH && kb + 1 < nk) f8_load_scales(pp, kb + 1, sa0, sa1, sbt, sbk);
    mbar_wait(bar0 + 8 * pp.s, pp.ph);
    unsigned a = stage0 + pp.s * F8_STAGE_BYTES;
    f8_issue(cur, a + wg * (64 * F8_BK), a + F8_A_BYTES);
    pp.skew.issued();
    if (RETIRE) {
        wg_wait<1>();
        wg_pin(prev);
        if (lane == 0) mbar_arrive(bar0 + 8 * (F8_ST + pp.ps));
        f8_promote(acc, prev, pp.q0, pp.q1);
    }
    pp.ps = pp.s;
    pp.q0 = s0 * sw;
    pp.q1 = s1 * sw;
    if (++pp.s == F8_ST) {
        pp.s = 0;
        pp.ph ^= 1;
    }
}

// V3's tile of NKC blocks of K as one unrolled chain: block kb's wgmmas are
// issued before block kb - 1 is waited for and promoted, so only the tile's
// last block drains the tensor cores (V2 drains every pair: with a runtime
// count, in-flight wgmmas at a loop's back edge make ptxas serialise them).
// `before` runs ahead of block 0's wgmmas, `between` once they are issued,
// before anything is promoted into acc (FOLDMOE_F8_OVERLAP: the previous
// tile's acc packed to bf16, then stored under those wgmmas).
template <int NKC, typename Before, typename Between>
__device__ __forceinline__ void f8_chain(float (&acc)[64], float (&t0)[64], float (&t1)[64], const float* sa0,
                                         const float* sa1, const float* sbt, i64 sbk, unsigned stage0, unsigned bar0,
                                         int wg, int lane, F8Pipe& pp, Before&& before, Between&& between) {
    before();
    f8_step<false>(acc, t0, t1, 0, NKC, sa0, sa1, sbt, sbk, stage0, bar0, wg, lane, pp);
    between();
#pragma unroll
    for (int kb = 1; kb < NKC; ++kb) {
        if (kb & 1)
            f8_step<true>(acc, t1, t0, kb, NKC, sa0, sa1, sbt, sbk, stage0, bar0, wg, lane, pp);
        else
            f8_step<true>(acc, t0, t1, kb, NKC, sa0, sa1, sbt, sbk, stage0, bar0, wg, lane, pp);
    }
    wg_wait<0>();
    if ((NKC - 1) & 1) {
        wg_pin(t1);
        if (lane == 0) mbar_arrive(bar0 + 8 * (F8_ST + pp.ps));
        f8_promote(acc, t1, pp.q0, pp.q1);
    } else {
        wg_pin(t0);
        if (lane == 0) mbar_arrive(bar0 + 8 * (F8_ST + pp.ps));
        f8_promote(acc, t0, pp.q0, pp.q1);
    }
}

// The kernel (see the top of the file). Grid: min(tiles, SMs) blocks of
// F8_THREADS; ta maps x codes [M, K] (box 128 × 128), tb w codes [G, N, K]
// (box 128 × 128 × 1); offs / tiles: group_offsets' outputs; out [M, N].
// V2: the block's wgmmas go into two temporaries in turn, block kb's
// issued before block kb - 1 is promoted (the tensor cores stay busy during
// the promotion; 192 accumulator registers), and the output is staged per
// warp in shared memory and written in whole 16-byte pieces. V1: one
// temporary, wait then promote, stores straight from registers. V3 (VER
// 3): V2 with the tiles of 6 and 16 blocks of K (the experts' K 768 and
// 2048) as one unrolled chain each (f8_chain).
template <bool OUTF, int VER, bool ADD = false>
__device__ __forceinline__ void f8_body(const TmaMap* ta, const TmaMap* tb, const float* __restrict__ sa,
                                        const float* __restrict__ sb, i64 sbg, i64 sbk, i64 sbn,
                                        const i64* __restrict__ offs, const i64* __restrict__ tiles,
                                        void* __restrict__ out, i64 m, i64 k, i64 n, int g) {
    static_assert(!ADD || VER >= 2, "V1's stores from registers do not add");
    unsigned raw = smem_u32(f8_smem);
    unsigned pad = (1024u - (raw & 1023u)) & 1023u;
    unsigned char* base = f8_smem + pad;
    unsigned stage0 = raw + pad;
    // full[s] at bar0 + 8 s, empty[s] at bar0 + 8 (F8_ST + s).
    unsigned bar0 = stage0 + F8_ST * F8_STAGE_BYTES;
    i64* so = reinterpret_cast<i64*>(base + F8_OFFS);
    i64* st = so + (g + 1);
    int tid = threadIdx.x;
    for (int i = tid; i <= g; i += F8_THREADS) {
        so[i] = offs[i];
        st[i] = tiles[i];
    }
    if (tid == 0) {
        for (int s = 0; s < F8_ST; ++s) {
            mbar_init(bar0 + 8 * s, 1);
            mbar_init(bar0 + 8 * (F8_ST + s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    int nk = (int)((k + F8_BK - 1) / F8_BK);
    i64 ncol = (n + F8_BN - 1) / F8_BN;
    i64 total = (st[g] + (m - so[g] + F8_BM - 1) / F8_BM) * ncol;
    int wg = tid >> 7;
    if (wg == 2) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 256) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)ta) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)tb) : "memory");
            int s = 0;
            unsigned ph = 0;
            for (i64 t = blockIdx.x; t < total; t += gridDim.x) {
                F8Tile tl = f8_tile(t, so, st, m, nk, n, g);
                for (int kb = 0; kb < tl.nk; ++kb) {
                    unsigned full = bar0 + 8 * s;
                    mbar_wait(bar0 + 8 * (F8_ST + s), ph ^ 1);
                    mbar_expect_tx(full, F8_STAGE_BYTES);
                    unsigned a = stage0 + s * F8_STAGE_BYTES;
                    tma_2d(a, ta, full, kb * F8_BK, (int)tl.row0);
                    tma_3d(a + F8_A_BYTES, tb, full, kb * F8_BK, (int)tl.col0, tl.grp);
                    if (++s == F8_ST) {
                        s = 0;
                        ph ^= 1;
                    }
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        int warp = (tid >> 5) & 3, lane = tid & 31;
        int s = 0;
        unsigned ph = 0;
        float acc[64], tmp[64], tmp2[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) {
            tmp[i] = 0.0f;
            tmp2[i] = 0.0f;
        }
        WgSkew<3> skew;
        skew.begin(wg, FOLDMOE_F8_SKEW, F8_ST);
        // With FOLDMOE_F8_OVERLAP (V3, bf16 out) a chained tile's acc waits
        // for its store until the next chained tile has issued its first
        // block: it is packed to bf16 before that issue and stored after
        // (64 f32 registers live beside the wgmmas' in flight make ptxas
        // spill about 1.2 KiB; 32 packed words do not).
        constexpr bool OVERLAP = FOLDMOE_F8_OVERLAP && VER == 3 && !OUTF;
        F8Tile pend{0, 0, 0, 0, 0};
        bool pending = false;
        unsigned pk[32];
        unsigned char* sw = base + F8_STG + (tid >> 5) * F8_STG_WARP;
        auto rows = [&](const F8Tile& d) { return d.row0 + wg * 64 + warp * 16; };
        for (i64 t = blockIdx.x; t < total; t += gridDim.x) {
            F8Tile tl = f8_tile(t, so, st, m, nk, n, g);
            bool chained = VER == 3 && (tl.nk == 16 || tl.nk == 6);
            if (!(OVERLAP && chained)) {
                if (pending) f8_store_staged<OUTF, ADD>(out, acc, sw, rows(pend), pend.row_end, pend.col0, n, lane);
                pending = false;
#pragma unroll
                for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
            }
            // This thread's two rows (r0, r0 + 8) and their scale rows
            // (rows past M read row 0's: never stored).
            i64 r0 = tl.row0 + wg * 64 + warp * 16 + (lane >> 2);
            const float* sa0 = sa + (r0 < m ? r0 : 0) * nk;
            const float* sa1 = sa + (r0 + 8 < m ? r0 + 8 : 0) * nk;
            const float* sbt = sb + (i64)tl.grp * sbg + (tl.col0 / F8_BN) * sbn;
            // V2 and V3's pipeline state over this tile (V1 keeps s, ph and
            // skew itself).
            F8Pipe pp{s, ph, 0, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, skew};
            if (VER >= 2 && FOLDMOE_F8_PREFETCH && tl.nk > 0) f8_load_scales(pp, 0, sa0, sa1, sbt, sbk);
            if (chained) {
                auto before = [&]() {
                    if (OVERLAP) f8_pack(pk, acc);
                };
                auto between = [&]() {
                    if (!OVERLAP) return;
                    if (pending) f8_store_packed<ADD>(out, pk, sw, rows(pend), pend.row_end, pend.col0, n, lane);
                    pending = false;
#pragma unroll
                    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
                };
                if (tl.nk == 16)
                    f8_chain<16>(acc, tmp, tmp2, sa0, sa1, sbt, sbk, stage0, bar0, wg, lane, pp, before, between);
                else
                    f8_chain<6>(acc, tmp, tmp2, sa0, sa1, sbt, sbk, stage0, bar0, wg, lane, pp, before, between);
                s = pp.s;
                ph = pp.ph;
                skew = pp.skew;
            } else if (VER >= 2) {
                // Blocks in pairs: kb's wgmmas into tmp, kb + 1's into tmp2;
                // kb is waited for (wait_group 1), released and promoted while
                // kb + 1's run; then kb + 1. Nothing stays in flight from one
                // pair to the next: ptxas serialises the wgmmas of a loop whose
                // back edge carries in-flight accumulators (it moves them).
                int kb = 0;
                for (; kb + 1 < tl.nk; kb += 2) {
                    f8_step<false>(acc, tmp, tmp2, kb, tl.nk, sa0, sa1, sbt, sbk, stage0, bar0, wg, lane, pp);
                    float p0 = pp.q0, p1 = pp.q1;
                    int s0 = pp.ps;
                    f8_step<false>(acc, tmp2, tmp, kb + 1, tl.nk, sa0, sa1, sbt, sbk, stage0, bar0, wg, lane, pp);
                    wg_wait<1>();
                    wg_pin(tmp);
                    if (lane == 0) mbar_arrive(bar0 + 8 * (F8_ST + s0));
                    f8_promote(acc, tmp, p0, p1);
                    wg_wait<0>();
                    wg_pin(tmp2);
                    if (lane == 0) mbar_arrive(bar0 + 8 * (F8_ST + pp.ps));
                    f8_promote(acc, tmp2, pp.q0, pp.q1);
                }
                if (kb < tl.nk) {
                    f8_step<false>(acc, tmp, tmp2, kb, tl.nk, sa0, sa1, sbt, sbk, stage0, bar0, wg, lane, pp);
                    wg_wait<0>();
                    wg_pin(tmp);
                    if (lane == 0) mbar_arrive(bar0 + 8 * (F8_ST + pp.ps));
                    f8_promote(acc, tmp, pp.q0, pp.q1);
                }
                s = pp.s;
                ph = pp.ph;
                skew = pp.skew;
            } else {
                for (int kb = 0; kb < tl.nk; ++kb) {
                    // The scales' loads are in flight during the wait and the wgmmas.
                    float s0 = __ldg(sa0 + kb), s1 = __ldg(sa1 + kb), sw = __ldg(sbt + kb * sbk);
                    mbar_wait(bar0 + 8 * s, ph);
                    unsigned a = stage0 + s * F8_STAGE_BYTES;
                    f8_issue(tmp, a + wg * (64 * F8_BK), a + F8_A_BYTES);
                    skew.issued();
                    wg_wait<0>();
                    wg_pin(tmp);
                    // The stage is read: the producer may refill it.
                    if (lane == 0) mbar_arrive(bar0 + 8 * (F8_ST + s));
                    f8_promote(acc, tmp, s0 * sw, s1 * sw);
                    if (++s == F8_ST) {
                        s = 0;
                        ph ^= 1;
                    }
                }
            }
            bool in0 = r0 < tl.row_end, in1 = r0 + 8 < tl.row_end;
            if (VER == 1) {
                // Register 4 j + e is column col0 + 8 j + 2 (lane % 4) + e % 2.
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    i64 c = tl.col0 + 8 * j + 2 * (lane & 3);
                    if (in0) f8_store2<OUTF>(out, r0 * n + c, c, n, acc[4 * j], acc[4 * j + 1]);
                    if (in1) f8_store2<OUTF>(out, (r0 + 8) * n + c, c, n, acc[4 * j + 2], acc[4 * j + 3]);
                }
                continue;
            }
            if (OVERLAP && chained) {
                pend = tl;
                pending = true;
            } else {
                f8_store_staged<OUTF, ADD>(out, acc, sw, rows(tl), tl.row_end, tl.col0, n, lane);
            }
            (void)in0;
            (void)in1;
        }
        // The last chained tile's store.
        if (pending) f8_store_staged<OUTF, ADD>(out, acc, sw, rows(pend), pend.row_end, pend.col0, n, lane);
        skew.end();
    }
}


// ---- The weight gradient dw[g] = x_gᵀ · dy_g, [K, N] per group, of
// GroupColumns operands (kernels/src/fp8.rs): A = x codes stored [K, M],
// B = dy codes [N, M], both with the summed dimension (the rows M)
// contiguous, as fp8 wgmma wants; scales sa [T, K], sb [T, N], tile-major
// (T = column_tiles(M, G)). A group's tiles are its rows in each aligned
// 128-row block of M (group_column_tiles), so the copies always start at a
// multiple of 128 rows (the copy engine needs 16-byte aligned starts along
// the contiguous dimension, and routed groups start anywhere): step b of a
// group whose rows are [s, e) copies rows 128 b .. 128 b + 127 of A and B,
// and where the block holds other groups' rows (the group's first and last
// steps) each consumer warpgroup zeroes those bytes of its 64 rows of A in
// shared memory (fence.proxy.async, then a warpgroup barrier, before its
// wgmmas): products over them are exact zeros, so the whole K range of the
// group stays exact. Tile t of the step is the group's first tile (a prefix
// over the groups, computed per block from the offsets) plus b - s / 128.
// The stage also holds the tile's 128 row scales of A (sa[t, row0 ..]) and
// 128 column scales of B (sb[t, col0 ..]), brought by two bulk copies on
// the same mbarrier (K and N multiples of 4: 16-byte aligned, whole
// 16-byte pieces; scales past K or N are stale and never stored). The
// promotion scales register (row r, column c) by sa[r] · sb[c]. Output
// tiles 128 (of K) × 128 (of N), G · ceil(K / 128) · ceil(N / 128) of them,
// a group's adjacent (its codes stay in L2); an empty group has no steps
// and stores zeros. V2's loop (blocks in pairs, nothing in flight at the
// back edge) and staged stores.
#define F8W_ST 6
#define F8W_STAGE (F8_STAGE_BYTES + 2 * 512)
#define F8W_STG (F8W_ST * F8W_STAGE + 128)
#define F8W_OFFS (F8W_STG + 8 * F8_STG_WARP)

__device__ __forceinline__ void f8_bulk(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// Zeroes the bytes outside [lo, hi) of each of the 64 rows (128 bytes,
// 128-byte swizzle: logical 16-byte piece q of row r at piece q ^ (r % 8))
// at shared address p; i: this thread's index in its warpgroup. Whole
// pieces outside are stored as zeros; the (at most two) pieces holding lo
// or hi are read, masked byte by byte and written back.
__device__ __forceinline__ void f8w_mask(unsigned p, int lo, int hi, int i) {
#pragma unroll 1
    for (int e = i; e < 64 * 8; e += 128) {
        int row = e >> 3, q = e & 7, b = q * 16;
        if (b >= lo && b + 16 <= hi) continue;
        unsigned c = p + row * 128 + ((q ^ (row & 7)) << 4);
        unsigned w0 = 0, w1 = 0, w2 = 0, w3 = 0;
        if (b + 16 > lo && b < hi) {
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(w0), "=r"(w1), "=r"(w2), "=r"(w3)
                         : "r"(c)
                         : "memory");
            // Byte y of word x is kept when b + 4 x + y is in [lo, hi).
            unsigned keep[4];
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                keep[x] = 0;
#pragma unroll
                for (int y = 0; y < 4; ++y) {
                    int at = b + 4 * x + y;
                    if (at >= lo && at < hi) keep[x] |= 0xffu << (8 * y);
                }
            }
            w0 &= keep[0];
            w1 &= keep[1];
            w2 &= keep[2];
            w3 &= keep[3];
        }
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(c), "r"(w0), "r"(w1), "r"(w2), "r"(w3)
                     : "memory");
    }
}

// One step of the weight gradient: wait for stage s, zero the other
// groups' rows of this warpgroup's A where block b holds any (rows [gs,
// ge) are the group's), issue the 4 wgmmas into cur; returns the stage.
__device__ __forceinline__ int f8w_issue(float (&cur)[64], int b, int gs, int ge, unsigned stage0, unsigned bar0,
                                         int wg, int& s, unsigned& ph) {
    mbar_wait(bar0 + 8 * s, ph);
    int lo = gs - 128 * b, hi = ge - 128 * b;
    if (lo > 0 || hi < 128) {
        f8w_mask(stage0 + s * F8W_STAGE + wg * (64 * F8_BK), lo > 0 ? lo : 0, hi < 128 ? hi : 128, threadIdx.x & 127);
        // The zeros before this warpgroup's wgmmas (async proxy) read them.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        if (wg == 0)
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
        else
            asm volatile("bar.sync 2, 128;\n" ::: "memory");
    }
    unsigned a = stage0 + s * F8W_STAGE;
    f8_issue(cur, a + wg * (64 * F8_BK), a + F8_A_BYTES);
    int used = s;
    if (++s == F8W_ST) {
        s = 0;
        ph ^= 1;
    }
    return used;
}

// Promotion of a weight-gradient step from stage `st`'s scales: acc += t ·
// sa[ra (+ 8)] · sb[column]; register 4 j + e is row ra (+ 8 for e >= 2),
// column 8 j + 2 (lane % 4) + e % 2 of the tile.
__device__ __forceinline__ void f8w_promote(float (&acc)[64], float (&t)[64], const unsigned char* st, int ra,
                                            int lane) {
    const float* sas = reinterpret_cast<const float*>(st + F8_STAGE_BYTES);
    const float2* sbs = reinterpret_cast<const float2*>(st + F8_STAGE_BYTES + 512) + (lane & 3);
    float p0 = sas[ra], p1 = sas[ra + 8];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        float2 c = sbs[4 * j];
        acc[4 * j] = fmaf(t[4 * j], p0 * c.x, acc[4 * j]);
        acc[4 * j + 1] = fmaf(t[4 * j + 1], p0 * c.y, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(t[4 * j + 2], p1 * c.x, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(t[4 * j + 3], p1 * c.y, acc[4 * j + 3]);
    }
}

// Output tile t of the weight gradient: group, first row (of K), first
// column (of N).
__device__ __forceinline__ void f8w_tile(i64 t, i64 k, i64 n, int* grp, i64* row0, i64* col0) {
    i64 ncol = (n + F8_BN - 1) / F8_BN, per = ncol * ((k + F8_BM - 1) / F8_BM);
    *grp = (int)(t / per);
    i64 rem = t - (i64)*grp * per;
    *row0 = (rem / ncol) * F8_BM;
    *col0 = (rem - (rem / ncol) * ncol) * F8_BN;
}

// The kernel: grid min(tiles, SMs) blocks of F8_THREADS; ta maps x codes
// [K, M] (dims M, K; box 128 × 128), tb dy codes [N, M]; offs: the groups'
// first rows (group_offsets, clamped to M); out [G, K, N].
template <bool OUTF>
__device__ __forceinline__ void f8w_body(const TmaMap* ta, const TmaMap* tb, const float* __restrict__ sa,
                                         const float* __restrict__ sb, const i64* __restrict__ offs,
                                         void* __restrict__ out, i64 m, i64 k, i64 n, int g) {
    unsigned raw = smem_u32(f8_smem);
    unsigned pad = (1024u - (raw & 1023u)) & 1023u;
    unsigned char* base = f8_smem + pad;
    unsigned stage0 = raw + pad;
    // full[s] at bar0 + 8 s, empty[s] at bar0 + 8 (F8W_ST + s).
    unsigned bar0 = stage0 + F8W_ST * F8W_STAGE;
    i64* so = reinterpret_cast<i64*>(base + F8W_OFFS);
    i64* ft = so + (g + 1);
    int tid = threadIdx.x;
    for (int i = tid; i <= g; i += F8_THREADS) so[i] = offs[i];
    __syncthreads();
    if (tid == 0) {
        // Each group's first tile: the tiles of the groups before it, one
        // per aligned 128-row block each meets (fp8.cu's group_tile).
        i64 t = 0;
        for (int i = 0; i < g; ++i) {
            ft[i] = t;
            i64 gs = so[i], ge = so[i + 1];
            t += ge > gs ? (ge - 1) / 128 - gs / 128 + 1 : 0;
        }
        ft[g] = t;
        for (int s = 0; s < F8W_ST; ++s) {
            mbar_init(bar0 + 8 * s, 1);
            mbar_init(bar0 + 8 * (F8W_ST + s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    i64 total = (i64)g * ((n + F8_BN - 1) / F8_BN) * ((k + F8_BM - 1) / F8_BM);
    int wg = tid >> 7;
    if (wg == 2) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 256) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)ta) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)tb) : "memory");
            int s = 0;
            unsigned ph = 0;
            for (i64 t = blockIdx.x; t < total; t += gridDim.x) {
                int grp;
                i64 row0, col0;
                f8w_tile(t, k, n, &grp, &row0, &col0);
                i64 gs = so[grp], ge = so[grp + 1];
                i64 b0 = gs / 128, nk = ge > gs ? (ge - 1) / 128 - b0 + 1 : 0;
                unsigned ba = (unsigned)(min((i64)128, k - row0) * 4), bb = (unsigned)(min((i64)128, n - col0) * 4);
                const float* sat = sa + ft[grp] * k + row0;
                const float* sbt = sb + ft[grp] * n + col0;
                for (i64 kb = 0; kb < nk; ++kb) {
                    unsigned full = bar0 + 8 * s;
                    mbar_wait(bar0 + 8 * (F8W_ST + s), ph ^ 1);
                    mbar_expect_tx(full, F8_STAGE_BYTES + ba + bb);
                    unsigned a = stage0 + s * F8W_STAGE;
                    int r = (int)((b0 + kb) * 128);
                    tma_2d(a, ta, full, r, (int)row0);
                    tma_2d(a + F8_A_BYTES, tb, full, r, (int)col0);
                    f8_bulk(a + F8_STAGE_BYTES, sat + kb * k, ba, full);
                    f8_bulk(a + F8_STAGE_BYTES + 512, sbt + kb * n, bb, full);
                    if (++s == F8W_ST) {
                        s = 0;
                        ph ^= 1;
                    }
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        int warp = (tid >> 5) & 3, lane = tid & 31;
        int ra = wg * 64 + warp * 16 + (lane >> 2);
        int s = 0;
        unsigned ph = 0;
        float acc[64], tmp[64], tmp2[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) {
            tmp[i] = 0.0f;
            tmp2[i] = 0.0f;
        }
        WgSkew<3> skew;
        skew.begin(wg, FOLDMOE_F8W_SKEW, F8W_ST);
        for (i64 t = blockIdx.x; t < total; t += gridDim.x) {
            int grp;
            i64 row0, col0;
            f8w_tile(t, k, n, &grp, &row0, &col0);
            // Rows and blocks of M fit in 32 bits (fp8.rs checks M).
            int gs = (int)so[grp], ge = (int)so[grp + 1];
            int b0 = gs / 128, nk = ge > gs ? (ge - 1) / 128 - b0 + 1 : 0;
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
            // An odd step first, alone; then pairs (nothing in flight at the back edge).
            int kb = 0;
            if (nk & 1) {
                int s0 = f8w_issue(tmp, b0, gs, ge, stage0, bar0, wg, s, ph);
                skew.issued();
                wg_wait<0>();
                wg_pin(tmp);
                f8w_promote(acc, tmp, base + s0 * F8W_STAGE, ra, lane);
                __syncwarp();
                if (lane == 0) mbar_arrive(bar0 + 8 * (F8W_ST + s0));
                kb = 1;
            }
            for (; kb < nk; kb += 2) {
                int s0 = f8w_issue(tmp, b0 + kb, gs, ge, stage0, bar0, wg, s, ph);
                skew.issued();
                int s1 = f8w_issue(tmp2, b0 + kb + 1, gs, ge, stage0, bar0, wg, s, ph);
                skew.issued();
                wg_wait<1>();
                wg_pin(tmp);
                f8w_promote(acc, tmp, base + s0 * F8W_STAGE, ra, lane);
                // The stage's codes and scales are read: the producer may refill it.
                __syncwarp();
                if (lane == 0) mbar_arrive(bar0 + 8 * (F8W_ST + s0));
                wg_wait<0>();
                wg_pin(tmp2);
                f8w_promote(acc, tmp2, base + s1 * F8W_STAGE, ra, lane);
                __syncwarp();
                if (lane == 0) mbar_arrive(bar0 + 8 * (F8W_ST + s1));
            }
            unsigned char* o = reinterpret_cast<unsigned char*>(out) + (i64)grp * k * n * (OUTF ? 4 : 2);
            f8_store_staged<OUTF>(o, acc, base + F8W_STG + (tid >> 5) * F8_STG_WARP, row0 + wg * 64 + warp * 16, k,
                                  col0, n, lane);
        }
        skew.end();
    }
}

#define F8_ARGS                                                                                                       \
    const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tb, const float *sa, const float *sb, i64 sbg, \
        i64 sbk, i64 sbn, const i64 *offs, const i64 *tiles
#define F8_ENTRY extern "C" __global__ void __launch_bounds__(F8_THREADS, 1)
// The default, V3: V2 with the unrolled chains.
F8_ENTRY grouped_mm_fp8_wgmma_bf16_v3(F8_ARGS, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    f8_body<false, 3>(&ta, &tb, sa, sb, sbg, sbk, sbn, offs, tiles, out, m, k, n, g);
}
F8_ENTRY grouped_mm_fp8_wgmma_f32_v3(F8_ARGS, float* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    f8_body<true, 3>(&ta, &tb, sa, sb, sbg, sbk, sbn, offs, tiles, out, m, k, n, g);
}
// V3 adding its product to out (grouped_matmul_fp8_accumulate: the fc1 data
// gradient's up half onto its gate half, with no product written and read
// back by an add).
F8_ENTRY grouped_mm_fp8_wgmma_bf16_v3_add(F8_ARGS, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    f8_body<false, 3, true>(&ta, &tb, sa, sb, sbg, sbk, sbn, offs, tiles, out, m, k, n, g);
}
F8_ENTRY grouped_mm_fp8_wgmma_f32_v3_add(F8_ARGS, float* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    f8_body<true, 3, true>(&ta, &tb, sa, sb, sbg, sbk, sbn, offs, tiles, out, m, k, n, g);
}
// V2 (FOLDMOE_FP8_GEMM=v2), kept for comparisons.
F8_ENTRY grouped_mm_fp8_wgmma_bf16(F8_ARGS, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    f8_body<false, 2>(&ta, &tb, sa, sb, sbg, sbk, sbn, offs, tiles, out, m, k, n, g);
}
F8_ENTRY grouped_mm_fp8_wgmma_f32(F8_ARGS, float* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    f8_body<true, 2>(&ta, &tb, sa, sb, sbg, sbk, sbn, offs, tiles, out, m, k, n, g);
}
// The first version (V1; FOLDMOE_FP8_GEMM=v1), kept for comparisons.
F8_ENTRY grouped_mm_fp8_wgmma_bf16_v1(F8_ARGS, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    f8_body<false, 1>(&ta, &tb, sa, sb, sbg, sbk, sbn, offs, tiles, out, m, k, n, g);
}
F8_ENTRY grouped_mm_fp8_wgmma_f32_v1(F8_ARGS, float* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    f8_body<true, 1>(&ta, &tb, sa, sb, sbg, sbk, sbn, offs, tiles, out, m, k, n, g);
}

// dw [G, K, N] = x_gᵀ dy_g of GroupColumns codes: ta maps x's [K, M], tb
// dy's [N, M] (boxes 128 × 128); sa [T, K], sb [T, N]; offs [G + 1].
#define F8W_ARGS \
    const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tb, const float *sa, const float *sb, const i64 *offs
F8_ENTRY grouped_wgrad_fp8_wgmma_bf16(F8W_ARGS, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    f8w_body<false>(&ta, &tb, sa, sb, offs, out, m, k, n, g);
}
F8_ENTRY grouped_wgrad_fp8_wgmma_f32(F8W_ARGS, float* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    f8w_body<true>(&ta, &tb, sa, sb, offs, out, m, k, n, g);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
