// Hopper (sm_90a) grouped GEMMs of the MoE experts on wgmma: the bf16 path of
// grouped_matmul (both layouts) and grouped_matmul_weight_grad on sm_90a
// (linalg.rs picks them; linalg.cu keeps the mma.sync kernels for other GPUs
// and for shapes the tensor maps cannot describe).
//
// Design (one kernel body, three products):
// - a persistent grid (one block per SM) walks the output tiles of all groups
//   in order, block b taking tiles b, b + grid, ...; the group sizes are read
//   on the device (offsets and tile offsets copied into shared memory at the
//   start), so the launch needs nothing from the host but the shapes;
// - 384 threads: warpgroups 0 and 1 are consumers (each computes 64 rows of a
//   128 × 256 tile with wgmma.m64n256k16, f32 accumulators in registers),
//   warpgroup 2 is the producer: one thread issues the TMA copies
//   (cp.async.bulk.tensor, tensor maps built on the host, 128-byte swizzle)
//   of each 64-deep step of the inner dimension into a 4-stage ring of
//   shared memory (4 × 48 KiB), each stage guarded by a `full` mbarrier (the
//   copy's byte count) and an `empty` one (one arrival per consumer warp once
//   its wgmmas on the stage are done). The producer gives registers back
//   (setmaxnreg 40), the consumers take them (232);
// - the consumers keep one wgmma group in flight (wait_group 1) and release a
//   stage as soon as the group that read it completes; the result is stored
//   from registers straight to global memory, bf16, only rows inside the
//   tile's group and columns inside N, through a small per-warp buffer so
//   that the global stores are whole 128-byte row pieces.
//
// Operands (row-major in global memory; tensor maps in linalg.rs):
//   KIND 0, nn:    A = x [M, K] (K-major box 64 × 128), B = w [G, K, N]
//                  (N-major, four 64 × 64 boxes per step: 64 columns each);
//   KIND 1, nt:    A as above, B = w [G, N, K] (K-major box 64 × 256);
//   KIND 2, wgrad: dw[g] = x_gᵀ dy_g, A = x [rows, K] (M-major: two boxes of
//                  64 rows × 64 of K), B = dy [rows, N] (N-major, four boxes);
//                  the inner dimension is the group's rows. The copies of a
//                  group's last, partial step also bring rows of the next
//                  group: the consumers zero them in shared memory before
//                  their wgmmas (every other row past the matrices arrives
//                  as zeros from the copy engine).
// Tiles of nn / nt: group g owns ceil(size_g / 128) row tiles (tile offsets
// from group_offsets in linalg.cu), each split into ceil(N / 256) column
// tiles, column tiles fastest; rows past the last group (sizes summing to
// less than M) are one more pseudo-group whose tiles store zeros. Tiles of
// wgrad: G × ceil(K / 128) × ceil(N / 256), an empty group storing zeros.
//
// Shared-memory layouts (the copy engine's 128-byte swizzle: 16-byte chunk c
// of 128-byte row r at chunk c ^ (r % 8), every box 1024-byte aligned), as
// wgmma descriptors (start, leading byte offset LBO, stride byte offset SBO):
//   K-major tile [rows][64]: SBO = 1024 (8 rows of 128 bytes), LBO unused;
//     step kk (16 deep) starts 32·kk bytes in;
//   MN-major tile [64 deep][64 wide] boxes side by side (8 KiB each):
//     LBO = 8192 (the next 64 of M / N), SBO = 1024 (the next 8 deep);
//     step kk starts 2048·kk bytes in.
// Deferred epilogue (DEFER, issue 18): the consumers only round their
// accumulators into a shared 128 × 256 tile (an `out_full` mbarrier, 256
// arrivals) and go on to the next tile's wgmmas, while warps 9-11 of the
// producer warpgroup (96 threads, setmaxnreg 72; the consumers take 216:
// setmaxnreg.inc only draws on what the block's .dec released, so
// 256 (216 - 168) <= 128 (168 - 72), else the consumers wait forever)
// store that tile, then release it (`out_empty`, 96 arrivals). The stores
// thus run under the next tile's main loop instead of between two tiles;
// the price is a 3-stage ring (the tile takes the fourth stage's memory).
// (Stores that also applied SwiGLU or its backward were slower than the
// GEMM and the separate elementwise op, and were removed once the experts
// applied the routing weights in their SwiGLU: BENCHMARKS.md 2026-12-02.)
// Fused variant (issue 18, second part):
// - PAIR (nn / nt): out = x1 · op(w1[g]) + x2 · op(w2[g]), the steps of K1
//   from (ta, tb) and then those of K2 from (ta2, tb2) into one accumulator
//   (one rounding): the experts' dx over the gate and up projections;
// Gathered A (GATHER, issue 18's fused dispatch; nn, nt and wgrad):
// the rows of A are rows xs[rsrc[r]] of a source matrix (zeros where
// rsrc[r] = -1 or r >= M), the permutation into expert order read by the
// loads instead of a separate copy (Megatron-Core's fused permute). The
// copy engine's tiled mode cannot gather rows, so the whole producer
// warpgroup loads A with cp.async, eight lanes to a 128-byte row piece,
// into the 128-byte swizzle the descriptors expect (16-byte chunk c
// of row r at c ^ (r % 8)); each thread's copies arrive on the stage's full
// barrier (cp.async.mbarrier.arrive.noinc: 128 arrivals and the B copy's
// expect_tx), and the consumers fence the generic-proxy writes before
// their wgmmas read them. B still comes by TMA. Registers: consumers 224,
// producer 56 (256 (224 - 168) <= 128 (168 - 56)). Gathered B (GB, wgrad
// with GATHER: the down projection's weight gradient over the rows' output
// gradients, gathered from the combined output's): the same copies fill
// B's four boxes from dy's rows, and A comes by TMA.
// Two B operands (DUAL, wgrad with GATHER: the experts' gate and up weight
// gradients, dw1 = xᵀ dgate and dw3 = xᵀ dup over the same gathered x):
// B boxes 0-1 come from tb and 2-3 from tb2, each at the tile's 128 output
// columns, so one tile computes 128 columns of both gradients from one
// gather of its x rows; the store writes accumulator columns 0-127 to out
// and 128-255 to out2. (An nn version for the gate and up projections,
// with SwiGLU in its store, was slower than the two products and the
// separate SwiGLU: its tiles gather A as often as theirs, and the
// activation's math in the store runs with the tensor cores idle.)
// The whole module compiles to nothing for other architectures.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define GW_BM 128
#define GW_BN 256
#define GW_BK 64
#define GW_THREADS 384
#define GW_A_BYTES (GW_BM * GW_BK * 2)
#define GW_STAGE_BYTES (GW_A_BYTES + GW_BK * GW_BN * 2)
// Shared memory, after the stages: the mbarriers (128 bytes kept), then the
// epilogue's buffers, then the group and tile offsets. Inline epilogue: 4
// stages, each consumer warp's buffer of 16 rows of 64 bf16 (rows 144 bytes
// apart). Deferred epilogue (DEFER): 3 stages and the whole 128 × 256 tile
// (rows 528 bytes apart), 216192 bytes before the offsets either way
// (linalg.rs's gw_smem_bytes).
#define GW_STG_WARP (16 * 144)
#define GW_OUT_ROW 528
template <bool DEFER> struct GwLayout {
    static constexpr int ST = DEFER ? 3 : 4;
    static constexpr unsigned STG = ST * GW_STAGE_BYTES + 128;
    static constexpr unsigned OFFS = STG + (DEFER ? GW_BM * GW_OUT_ROW : 8 * GW_STG_WARP);
};
static_assert(GwLayout<true>::OFFS == GwLayout<false>::OFFS, "both epilogues fit the same shared memory");

// d[0..127] += A · B for one m64n256k16 (f32 accumulators, bf16 operands from shared
// memory through descriptors; acc = 0 overwrites d); TA / TB: A / B stored MN-major (1) or K-major (0).
template <int TA, int TB>
__device__ __forceinline__ void gw_mma(float (&d)[128], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %132, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, %130, %131;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(acc));
}

// One tile of the schedule. nn / nt: rows row0.. of x and out (row_end: the
// group's end, or M for the zero tail), columns col0.. of out, nk steps of K.
// wgrad: rows row0.. of dw[grp] (a K range; row_end = K), columns col0..,
// nk steps over the group's rows from red0.
struct GwTile {
    int grp, nk;
    i64 row0, row_end, col0, red0;
};

// nk1: the steps of K (the first product's, with PAIR); nk: all the steps.
// TN: the tile's columns of the output (GW_BN; 128 for DUAL, whose 256
// accumulator columns are 128 of each of two outputs).
template <int KIND, int TN = GW_BN>
__device__ __forceinline__ GwTile gw_tile(i64 t, const i64* so, const i64* st, i64 m, int nk, i64 n, int g) {
    GwTile r;
    if (KIND == 2) {
        // Here nk carries K, the row count of dw[g].
        i64 k = nk;
        i64 ntn = (n + TN - 1) / TN, per = ntn * ((k + GW_BM - 1) / GW_BM);
        r.grp = (int)(t / per);
        i64 rem = t - (i64)r.grp * per;
        r.row0 = (rem / ntn) * GW_BM;
        r.col0 = (rem % ntn) * TN;
        r.row_end = k;
        r.red0 = so[r.grp];
        r.nk = (int)((so[r.grp + 1] - r.red0 + GW_BK - 1) / GW_BK);
    } else {
        i64 ncol = (n + TN - 1) / TN;
        i64 rt = t / ncol;
        r.col0 = (t - rt * ncol) * TN;
        r.red0 = 0;
        i64 body = st[g];
        if (rt >= body) {
            r.grp = g;
            r.row0 = so[g] + (rt - body) * GW_BM;
            r.row_end = m;
            r.nk = 0;
        } else {
            // The last group whose first tile is at or before rt (empty
            // groups share their successor's first tile and lose the tie).
            int lo = 0, hi = g - 1;
            while (lo < hi) {
                int mid = (lo + hi + 1) >> 1;
                if (st[mid] <= rt) lo = mid; else hi = mid - 1;
            }
            r.grp = lo;
            r.row0 = so[lo] + (rt - st[lo]) * GW_BM;
            r.row_end = so[lo + 1];
            r.nk = nk;
        }
    }
    return r;
}

extern __shared__ __align__(1024) unsigned char gw_smem[];

// The producer of a GATHER kernel (all 128 threads of warpgroup 2): warp w
// of it copies, in instruction i = 0..7 of a step, 16 bytes (chunk l % 8)
// of row 16 i + 4 w + l / 8 of A (l the lane): eight lanes read one
// 128-byte row piece, so every warp instruction reads four whole pieces
// (one thread a row would use half of each 32-byte sector it touched).
// nn: A row r of the tile is xs[rsrc[row0 + r]], columns k0 .. k0 + 63;
// wgrad: box i / 4 (dw rows row0 + 64 (i / 4) ..), row 16 (i % 4) + 4 w +
// l / 8 of the step (reduction row red0 + k0 + that). Chunks past K (nn) or
// past dw's rows (wgrad) and missing rows (rsrc -1, past M) are zeros.
// Thread 256 also issues B's TMA copies with the stage's expect_tx (DUAL:
// boxes 0-1 from tb, 2-3 from tb2, each at the tile's 128 columns).
template <int KIND, bool DUAL = false, bool GB = false>
__device__ __forceinline__ void gw_gather_producer(const TmaMap* ta, const TmaMap* tb, const TmaMap* tb2,
                                                   const bf16* __restrict__ xs, const int* __restrict__ rsrc,
                                                   const i64* so, const i64* st, unsigned stage0, unsigned bar0, int ST,
                                                   i64 m, i64 k, int nkt, i64 n, int g, i64 total) {
    int p = threadIdx.x - 256;
    bool lead = p == 0;
    if (lead) asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)(GB ? ta : tb)) : "memory");
    if (DUAL && lead) asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)tb2) : "memory");
    int s = 0;
    unsigned ph = 0;
    int chunk = p & 7, r0 = 4 * (p >> 5) + ((p & 31) >> 3);
    constexpr int NR = KIND == 2 ? 4 : 8;  // distinct rows a thread copies per step
    // The source rows of the step (wgrad: of the next step, loaded one step
    // ahead so that their latency hides under the wait for a free stage).
    int nxt[NR];
    auto load_rows = [&](i64 first) {
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            i64 r = first + 16 * i + r0;
            nxt[i] = r < m ? rsrc[r] : -1;
        }
    };
    for (i64 t = blockIdx.x; t < total; t += gridDim.x) {
        GwTile tl = gw_tile<KIND, DUAL ? 128 : GW_BN>(t, so, st, m, nkt, n, g);
        // nn: a thread's rows are fixed for the tile.
        load_rows(KIND == 2 ? tl.red0 : tl.row0);
        const bf16* srow[NR];
        for (int ks = 0; ks < tl.nk; ++ks) {
            unsigned full = bar0 + 8 * s;
            i64 k0 = (i64)ks * GW_BK;
            if (KIND == 2 || ks == 0) {
#pragma unroll
                for (int i = 0; i < NR; ++i) srow[i] = nxt[i] >= 0 ? xs + (i64)nxt[i] * (GB ? n : k) : nullptr;
            }
            if (KIND == 2 && ks + 1 < tl.nk) load_rows(tl.red0 + k0 + GW_BK);
            mbar_wait(bar0 + 8 * (ST + s), ph ^ 1);
            unsigned a = stage0 + s * GW_STAGE_BYTES;
            if (lead) {
                if (GB) {
                    // A (the dense operand) by TMA: two boxes of 64 of K.
                    mbar_expect_tx(full, GW_A_BYTES);
#pragma unroll
                    for (int i = 0; i < 2; ++i) tma_2d(a + i * 8192, ta, full, (int)tl.row0 + 64 * i, (int)(tl.red0 + k0));
                } else {
                    mbar_expect_tx(full, GW_BK * GW_BN * 2);
                    unsigned b = a + GW_A_BYTES;
                    if (KIND == 1) {
                        tma_3d(b, tb, full, (int)k0, (int)tl.col0, tl.grp);
                    } else {
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const TmaMap* mb = DUAL && i >= 2 ? tb2 : tb;
                            int c = (int)tl.col0 + 64 * (DUAL ? (i & 1) : i);
                            if (KIND == 0)
                                tma_3d(b + i * 8192, mb, full, c, (int)k0, tl.grp);
                            else
                                tma_2d(b + i * 8192, mb, full, c, (int)(tl.red0 + k0));
                        }
                    }
                }
            }
            // GB: B's four boxes of 64 columns, the same 64 rows each.
            constexpr int NI = GB ? 16 : 8;
#pragma unroll
            for (int i = 0; i < NI; ++i) {
                int row = 16 * (i % NR) + r0, box = i / NR;
                i64 col = (GB ? tl.col0 + 64 * box : KIND == 2 ? tl.row0 + 64 * box : k0) + 8 * chunk;
                const bf16* srcp = srow[i % NR];
                int bytes = srcp != nullptr && col < (GB ? n : k) ? 16 : 0;
                unsigned dst = (GB ? a + GW_A_BYTES : a) + box * 8192 + row * 128 + ((chunk ^ (row & 7)) << 4);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(bytes ? srcp + col : xs),
                             "r"(bytes)
                             : "memory");
            }
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full) : "memory");
            if (++s == ST) {
                s = 0;
                ph ^= 1;
            }
        }
    }
}

// The kernel of the three products (see the top of the file). `out`: [M, N]
// for nn / nt, [G, K, N] for wgrad. Dynamic shared memory: 1024 bytes of
// alignment slack and GwLayout::OFFS + 16 (G + 1) bytes (linalg.rs's
// gw_smem_bytes).
// PAIR / DEFER / GATHER / DUAL / GB: the fused variants and the deferred
// epilogue (top of the file); ta2 / tb2 and k2 are read with PAIR only; tb2
// and out2 with DUAL.
template <int KIND, bool PAIR = false, bool DEFER = false, bool GATHER = false, bool DUAL = false, bool GB = false>
__device__ __forceinline__ void gw_body(const TmaMap* ta, const TmaMap* tb, const TmaMap* ta2, const TmaMap* tb2,
                                        const i64* __restrict__ offs, const i64* __restrict__ tiles,
                                        bf16* __restrict__ out, bf16* __restrict__ out2, i64 m, i64 k, i64 k2, i64 n,
                                        int g,
                                        const bf16* __restrict__ xs = nullptr, const int* __restrict__ rsrc = nullptr) {
    static_assert(!GATHER || (!PAIR && !DEFER), "gathered rows: the plain products");
    static_assert(!DUAL || (KIND == 2 && GATHER && !GB), "two B operands: the gathered weight gradient");
    static_assert(!GB || (KIND == 2 && GATHER), "gathered B: the weight gradient");
    constexpr int TN = DUAL ? 128 : GW_BN;
    typedef GwLayout<DEFER> L;
    constexpr int ST = L::ST;
    unsigned raw = smem_u32(gw_smem);
    unsigned pad = (1024u - (raw & 1023u)) & 1023u;
    unsigned char* base = gw_smem + pad;
    unsigned stage0 = raw + pad;
    // full[s] at bar0 + 8 s, empty[s] at bar0 + 8 (ST + s); with DEFER the
    // output tile's out_full at bar0 + 16 ST and out_empty 8 bytes on.
    unsigned bar0 = stage0 + ST * GW_STAGE_BYTES;
    unsigned bar_of = bar0 + 16 * ST, bar_oe = bar_of + 8;
    i64* so = reinterpret_cast<i64*>(base + L::OFFS);
    i64* st = so + (g + 1);
    int tid = threadIdx.x;
    for (int i = tid; i <= g; i += GW_THREADS) {
        so[i] = offs[i];
        if (KIND != 2) st[i] = tiles[i];
    }
    if (tid == 0) {
        for (int s = 0; s < ST; ++s) {
            // With GATHER each producer thread's cp.async copies arrive too.
            mbar_init(bar0 + 8 * s, GATHER ? 129 : 1);
            mbar_init(bar0 + 8 * (ST + s), 8);
        }
        if (DEFER) {
            mbar_init(bar_of, 256);
            mbar_init(bar_oe, 96);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    int nk1 = (int)((k + GW_BK - 1) / GW_BK);
    int nkt = KIND == 2 ? (int)k : nk1 + (PAIR ? (int)((k2 + GW_BK - 1) / GW_BK) : 0);
    i64 ncol = (n + TN - 1) / TN;
    i64 total = KIND == 2 ? (i64)g * ((k + GW_BM - 1) / GW_BM) * ncol
                          : (st[g] + (m - so[g] + GW_BM - 1) / GW_BM) * ncol;
    int wg = tid >> 7;
    if (wg == 2) {
        // Producer warpgroup: one thread issues every copy; with DEFER,
        // warps 9-11 store the output tiles.
        if (DEFER)
            asm volatile("setmaxnreg.dec.sync.aligned.u32 72;\n");
        else if (GATHER)
            asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
        else
            asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (GATHER) {
            gw_gather_producer<KIND, DUAL, GB>(ta, tb, tb2, xs, rsrc, so, st, stage0, bar0, ST, m, k, nkt, n, g, total);
        } else if (tid == 256) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)ta) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)tb) : "memory");
            if (PAIR) asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)ta2) : "memory");
            if (PAIR) asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)tb2) : "memory");
            int s = 0;
            unsigned ph = 0;
            for (i64 t = blockIdx.x; t < total; t += gridDim.x) {
                GwTile tl = gw_tile<KIND, TN>(t, so, st, m, nkt, n, g);
                for (int ks = 0; ks < tl.nk; ++ks) {
                    unsigned full = bar0 + 8 * s;
                    mbar_wait(bar0 + 8 * (ST + s), ph ^ 1);
                    mbar_expect_tx(full, GW_STAGE_BYTES);
                    unsigned a = stage0 + s * GW_STAGE_BYTES, b = a + GW_A_BYTES;
                    int k0 = ks * GW_BK;
                    const TmaMap *ma = ta, *mb = tb;
                    if (PAIR && ks >= nk1) {
                        // The second product's steps (K2 from 0).
                        ma = ta2;
                        mb = tb2;
                        k0 = (ks - nk1) * GW_BK;
                    }
                    if (KIND == 0) {
                        tma_2d(a, ma, full, k0, (int)tl.row0);
#pragma unroll
                        for (int i = 0; i < 4; ++i) tma_3d(b + i * 8192, mb, full, (int)tl.col0 + 64 * i, k0, tl.grp);
                    } else if (KIND == 1) {
                        tma_2d(a, ma, full, k0, (int)tl.row0);
                        tma_3d(b, mb, full, k0, (int)tl.col0, tl.grp);
                    } else {
                        int r = (int)(tl.red0 + k0);
#pragma unroll
                        for (int i = 0; i < 2; ++i) tma_2d(a + i * 8192, ta, full, (int)tl.row0 + 64 * i, r);
#pragma unroll
                        for (int i = 0; i < 4; ++i) tma_2d(b + i * 8192, tb, full, (int)tl.col0 + 64 * i, r);
                    }
                    if (++s == ST) {
                        s = 0;
                        ph ^= 1;
                    }
                }
            }
        } else if (DEFER && tid >= 288) {
            // Epilogue warps: unit u of a tile is row u / 32, columns 8 (u %
            // 32) .. + 7 (a warp covers one 512-byte row: whole 128-byte
            // pieces). EB units a thread at once: their loads are all in
            // flight before the first store.
            constexpr int EB = 4;
            const unsigned char* ot = base + L::STG;
            int e = tid - 288;
            unsigned oph = 0;
            for (i64 t = blockIdx.x; t < total; t += gridDim.x) {
                GwTile tl = gw_tile<KIND, TN>(t, so, st, m, nkt, n, g);
                bf16* o = KIND == 2 ? out + (i64)tl.grp * k * n : out;
                mbar_wait(bar_of, oph);
                for (int u0 = e; u0 < GW_BM * 32; u0 += 96 * EB) {
                    uint4 v[EB];
                    i64 at[EB];
                    bool ok[EB];
#pragma unroll
                    for (int b = 0; b < EB; ++b) {
                        int u = u0 + 96 * b, row = u >> 5, ch = u & 31;
                        i64 gr = tl.row0 + row, gc = tl.col0 + ch * 8;
                        ok[b] = u < GW_BM * 32 && gr < tl.row_end && gc < n;
                        at[b] = gr * n + gc;
                        if (ok[b]) v[b] = *reinterpret_cast<const uint4*>(ot + row * GW_OUT_ROW + ch * 16);
                    }
#pragma unroll
                    for (int b = 0; b < EB; ++b)
                        if (ok[b]) *reinterpret_cast<uint4*>(o + at[b]) = v[b];
                }
                mbar_arrive(bar_oe);
                oph ^= 1;
            }
        }
    } else {
        // Consumers: warpgroup wg computes rows 64 wg .. 64 wg + 63 of the tile.
        if (DEFER)
            asm volatile("setmaxnreg.inc.sync.aligned.u32 216;\n");
        else if (GATHER)
            asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");
        else
            asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        int warp = (tid >> 5) & 3, lane = tid & 31;
        int s = 0;
        unsigned ph = 0, oph = 0;
        float d[128];
        WgSkew<2> skew;
        skew.begin(wg, FOLDMOE_GW_SKEW, ST);
        for (i64 t = blockIdx.x; t < total; t += gridDim.x) {
            GwTile tl = gw_tile<KIND, TN>(t, so, st, m, nkt, n, g);
#pragma unroll
            for (int i = 0; i < 128; ++i) d[i] = 0.0f;
            int prev = 0;
            for (int ks = 0; ks < tl.nk; ++ks) {
                mbar_wait(bar0 + 8 * s, ph);
                // The gathered A arrived through the generic proxy.
                if (GATHER) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                unsigned a = stage0 + s * GW_STAGE_BYTES, b = a + GW_A_BYTES;
                if (KIND == 2 && ks == tl.nk - 1) {
                    int v = (int)(so[tl.grp + 1] - (tl.red0 + (i64)ks * GW_BK));
                    if (v < GW_BK) {
                        // Rows v..63 of this step belong to the next group:
                        // zero them in this warpgroup's A box and in B boxes
                        // 2 wg, 2 wg + 1 (each row 128 bytes; the swizzle
                        // only permutes chunks within a row).
                        int per = (GW_BK - v) * 8;
                        unsigned char* sb = base + s * GW_STAGE_BYTES;
                        for (int e = tid & 127; e < 3 * per; e += 128) {
                            int box = e / per, rem = e - box * per;
                            unsigned char* p = box == 0 ? sb + wg * 8192 : sb + GW_A_BYTES + (2 * wg + box - 1) * 8192;
                            *reinterpret_cast<uint4*>(p + (v + (rem >> 3)) * 128 + (rem & 7) * 16) = make_uint4(0, 0, 0, 0);
                        }
                        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                        // Warpgroup 1 may still wait for warpgroup 0's skew.
                        skew.end();
                        asm volatile("bar.sync 1, 256;\n" ::: "memory");
                    }
                }
                wg_pin(d);
                wg_fence();
#pragma unroll
                for (int kk = 0; kk < GW_BK / 16; ++kk) {
                    if (KIND == 0)
                        gw_mma<0, 1>(d, wgmma_desc(a + wg * 8192 + kk * 32, 16, 1024), wgmma_desc(b + kk * 2048, 8192, 1024), 1);
                    else if (KIND == 1)
                        gw_mma<0, 0>(d, wgmma_desc(a + wg * 8192 + kk * 32, 16, 1024), wgmma_desc(b + kk * 32, 16, 1024), 1);
                    else
                        gw_mma<1, 1>(d, wgmma_desc(a + wg * 8192 + kk * 2048, 8192, 1024), wgmma_desc(b + kk * 2048, 8192, 1024),
                                     1);
                }
                wg_commit();
                skew.issued();
                wg_pin(d);
                // The group of step ks - 1 is done: its stage can be refilled.
                wg_wait<1>();
                wg_pin(d);
                if (ks > 0 && lane == 0) mbar_arrive(bar0 + 8 * (ST + prev));
                prev = s;
                if (++s == ST) {
                    s = 0;
                    ph ^= 1;
                }
            }
            wg_wait<0>();
            wg_pin(d);
            if (tl.nk > 0 && lane == 0) mbar_arrive(bar0 + 8 * (ST + prev));
            // The skew is set within the first tile: the epilogue's waits
            // (DEFER) may depend on warpgroup 1.
            skew.end();
            // Accumulator layout: register 4 j + e holds row 16 warp + lane / 4
            // (+ 8 for e >= 2), column 8 j + 2 (lane % 4) + e % 2.
            if (DEFER) {
                // Round into the shared tile (rows 528 bytes apart: the
                // 4-byte writes of a warp hit 32 different banks) once the
                // epilogue warps are done with the previous one.
                mbar_wait(bar_oe, oph ^ 1);
                unsigned char* q0 = base + L::STG + (wg * 64 + warp * 16 + (lane >> 2)) * GW_OUT_ROW + 4 * (lane & 3);
#pragma unroll
                for (int j = 0; j < 32; ++j) {
                    *reinterpret_cast<unsigned*>(q0 + 16 * j) = pack_bf16(d[4 * j], d[4 * j + 1]);
                    *reinterpret_cast<unsigned*>(q0 + 16 * j + 8 * GW_OUT_ROW) = pack_bf16(d[4 * j + 2], d[4 * j + 3]);
                }
                mbar_arrive(bar_of);
                oph ^= 1;
                continue;
            }
            // Inline: each warp stages its 16 rows 64 columns at a time in
            // its own padded buffer (rows 144 bytes apart: the 4-byte writes
            // of a warp hit 32 different banks), then writes whole 128-byte
            // row pieces with 16-byte stores, only rows inside the tile's
            // group (and inside K for wgrad) and columns inside N (a
            // multiple of 8).
            bf16* o = KIND == 2 ? out + (i64)tl.grp * k * n : out;
            bf16* o2 = DUAL ? out2 + (i64)tl.grp * k * n : nullptr;
            unsigned char* sw = base + L::STG + (tid >> 5) * GW_STG_WARP;
            i64 rw = tl.row0 + wg * 64 + warp * 16;
            // Chunks of 64 columns, each to its output (DUAL: 0-1 the first
            // gradient's tile columns, 2-3 the second's).
#pragma unroll
            for (int c = 0; c < GW_BN / 64; ++c) {
                bf16* dst = DUAL && c >= 2 ? o2 : o;
                i64 cb = tl.col0 + 64 * (DUAL ? c & 1 : c);
                if (cb >= n) continue;
#pragma unroll
                for (int jj = 0; jj < 8; ++jj) {
                    int j = c * 8 + jj;
                    unsigned char* q = sw + (lane >> 2) * 144 + (jj * 8 + 2 * (lane & 3)) * 2;
                    *reinterpret_cast<unsigned*>(q) = pack_bf16(d[4 * j], d[4 * j + 1]);
                    *reinterpret_cast<unsigned*>(q + 8 * 144) = pack_bf16(d[4 * j + 2], d[4 * j + 3]);
                }
                __syncwarp();
#pragma unroll
                for (int qq = 0; qq < 4; ++qq) {
                    int i = lane + 32 * qq, row = i >> 3, ch = i & 7;
                    i64 gr = rw + row, gc = cb + ch * 8;
                    if (gr < tl.row_end && gc < n) {
                        uint4 v = *reinterpret_cast<const uint4*>(sw + row * 144 + ch * 16);
                        *reinterpret_cast<uint4*>(dst + gr * n + gc) = v;
                    }
                }
                __syncwarp();
            }
        }
        skew.end();
    }
}

// Grid: min(tiles, SMs) blocks of GW_THREADS; ta / tb: the tensor maps of
// A and B (linalg.rs); offs / tiles: group_offsets' outputs.
#define GW_ARGS const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tb
#define GW_ENTRY extern "C" __global__ void __launch_bounds__(GW_THREADS, 1)
GW_ENTRY grouped_mm_wgmma_bf16_nn(GW_ARGS, const i64* offs, const i64* tiles, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    gw_body<0>(&ta, &tb, nullptr, nullptr, offs, tiles, out, nullptr, m, k, 0, n, g);
}
GW_ENTRY grouped_mm_wgmma_bf16_nt(GW_ARGS, const i64* offs, const i64* tiles, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    gw_body<1>(&ta, &tb, nullptr, nullptr, offs, tiles, out, nullptr, m, k, 0, n, g);
}
GW_ENTRY grouped_wgrad_wgmma_bf16(GW_ARGS, const i64* offs, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    gw_body<2>(&ta, &tb, nullptr, nullptr, offs, nullptr, out, nullptr, m, k, 0, n, g);
}
// out = x1 · op(w1[g]) + x2 · op(w2[g]); (ta2, tb2) map x2 [M, K2] and w2.
GW_ENTRY grouped_mm2_wgmma_bf16_nn(GW_ARGS, const __grid_constant__ TmaMap ta2, const __grid_constant__ TmaMap tb2,
                                   const i64* offs, const i64* tiles, bf16* out, i64 m, i64 k, i64 k2, i64 n, int g) { pdl_enter();
    gw_body<0, true>(&ta, &tb, &ta2, &tb2, offs, tiles, out, nullptr, m, k, k2, n, g);
}
GW_ENTRY grouped_mm2_wgmma_bf16_nt(GW_ARGS, const __grid_constant__ TmaMap ta2, const __grid_constant__ TmaMap tb2,
                                   const i64* offs, const i64* tiles, bf16* out, i64 m, i64 k, i64 k2, i64 n, int g) { pdl_enter();
    gw_body<1, true>(&ta, &tb, &ta2, &tb2, offs, tiles, out, nullptr, m, k, k2, n, g);
}
// The plain products with the deferred epilogue (FOLDMOE_GEMM_EPILOGUE=deferred):
// the consumers hand each tile to warps 9-11 and go on to the next tile.
GW_ENTRY grouped_mm_wgmma_bf16_nn_defer(GW_ARGS, const i64* offs, const i64* tiles, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    gw_body<0, false, true>(&ta, &tb, nullptr, nullptr, offs, tiles, out, nullptr, m, k, 0, n, g);
}
GW_ENTRY grouped_mm_wgmma_bf16_nt_defer(GW_ARGS, const i64* offs, const i64* tiles, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    gw_body<1, false, true>(&ta, &tb, nullptr, nullptr, offs, tiles, out, nullptr, m, k, 0, n, g);
}
GW_ENTRY grouped_wgrad_wgmma_bf16_defer(GW_ARGS, const i64* offs, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    gw_body<2, false, true>(&ta, &tb, nullptr, nullptr, offs, nullptr, out, nullptr, m, k, 0, n, g);
}
GW_ENTRY grouped_mm2_wgmma_bf16_nn_defer(GW_ARGS, const __grid_constant__ TmaMap ta2, const __grid_constant__ TmaMap tb2,
                                         const i64* offs, const i64* tiles, bf16* out, i64 m, i64 k, i64 k2, i64 n, int g) { pdl_enter();
    gw_body<0, true, true>(&ta, &tb, &ta2, &tb2, offs, tiles, out, nullptr, m, k, k2, n, g);
}
GW_ENTRY grouped_mm2_wgmma_bf16_nt_defer(GW_ARGS, const __grid_constant__ TmaMap ta2, const __grid_constant__ TmaMap tb2,
                                         const i64* offs, const i64* tiles, bf16* out, i64 m, i64 k, i64 k2, i64 n, int g) { pdl_enter();
    gw_body<1, true, true>(&ta, &tb, &ta2, &tb2, offs, tiles, out, nullptr, m, k, k2, n, g);
}
// grouped_mm_wgmma_bf16_nn over the rows xs[rsrc[r]] (zeros where
// rsrc[r] = -1): xs [T, K], rsrc [M]; tb maps w as in the plain kernel.
GW_ENTRY grouped_mm_gather_wgmma_bf16_nn(const __grid_constant__ TmaMap tb, const bf16* xs, const int* rsrc,
                                         const i64* offs, const i64* tiles, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    gw_body<0, false, false, true>(&tb, &tb, nullptr, nullptr, offs, tiles, out, nullptr, m, k, 0, n, g, xs, rsrc);
}
// grouped_mm_wgmma_bf16_nt over the rows xs[rsrc[r]] (the experts' down
// projection's data gradient over the gathered output gradient).
GW_ENTRY grouped_mm_gather_wgmma_bf16_nt(const __grid_constant__ TmaMap tb, const bf16* xs, const int* rsrc,
                                         const i64* offs, const i64* tiles, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    gw_body<1, false, false, true>(&tb, &tb, nullptr, nullptr, offs, tiles, out, nullptr, m, k, 0, n, g, xs, rsrc);
}
// grouped_wgrad_wgmma_bf16 with dy's rows dys[rsrc[r]]: ta maps x [M, K],
// dys [T, N], rsrc [M] (the down projection's weight gradient over the
// gathered output gradient).
GW_ENTRY grouped_wgrad_gatherb_wgmma_bf16(const __grid_constant__ TmaMap ta, const bf16* dys, const int* rsrc,
                                          const i64* offs, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    gw_body<2, false, false, true, false, true>(&ta, &ta, nullptr, nullptr, offs, nullptr, out, nullptr, m, k, 0, n, g, dys, rsrc);
}
// grouped_wgrad_wgmma_bf16 with x's rows xs[rsrc[r]]: xs [T, K], rsrc [M]
// (M permuted rows), tb maps dy [M, N].
GW_ENTRY grouped_wgrad_gather_wgmma_bf16(const __grid_constant__ TmaMap tb, const bf16* xs, const int* rsrc,
                                         const i64* offs, bf16* out, i64 m, i64 k, i64 n, int g) { pdl_enter();
    gw_body<2, false, false, true>(&tb, &tb, nullptr, nullptr, offs, nullptr, out, nullptr, m, k, 0, n, g, xs, rsrc);
}

// dw1[g] = x_gᵀ dy1_g (out, tb maps dy1), dw2[g] = x_gᵀ dy2_g (out2, tb2) with
// x's rows xs[rsrc[r]].
GW_ENTRY grouped_wgrad_pair_gather_wgmma_bf16(const __grid_constant__ TmaMap tb, const __grid_constant__ TmaMap tb2,
                                              const bf16* xs, const int* rsrc, const i64* offs, bf16* out, bf16* out2,
                                              i64 m, i64 k, i64 n, int g) { pdl_enter();
    gw_body<2, false, false, true, true>(&tb, &tb, nullptr, &tb2, offs, nullptr, out, out2, m, k, 0, n, g, xs, rsrc);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
