// Hopper (sm_90a) causal grouped-query attention on TMA and wgmma, in
// FlashAttention-3's design: attention.rs picks these kernels for bf16 on
// sm_90a with head dims 64, 128 and 192 (MLA's query/key width; its values
// arrive zero-padded to 192, as mla.rs builds them); attention.cu keeps the
// mma.sync flash kernels for other GPUs and the cuBLAS path for the rest.
//
// Forward (fa3_fwd_*): a persistent grid of 384-thread blocks over the tiles
// of 128 queries of one query head (longest tiles first, as the causal work
// is uneven), each over the key tiles 0 .. the diagonal:
// - warpgroup 2 produces: one thread copies each 128 × Hd query tile (once
//   the last product reading the previous one is done, so the next tile's
//   copies run under the previous tile's last products and its store) and
//   then each key tile's K and V (BN keys × Hd) with cp.async.bulk.tensor
//   into a 2-stage ring, K and V behind their own full / empty mbarriers (the
//   copy's byte count; one arrival per consumer warp), setmaxnreg 24;
// - warpgroups 0 and 1 consume, 64 queries each (setmaxnreg 240): per key
//   tile j, S_j = Q K_jᵀ (wgmma, both operands in shared memory) is issued,
//   then O += P_{j-1} V_{j-1} (wgmma with P from registers), and the online
//   softmax of S_j runs while that product is in flight (intra-warpgroup
//   overlap); P_j is rounded to bf16 into registers only once P_{j-1}'s
//   product has completed. Named barriers 2 and 3 make the two warpgroups
//   take turns issuing their products (ping-pong), so one's softmax runs
//   under the other's GEMMs;
// - scores are scaled into the log2 domain; lse = ln 2 · (m + log2 l), f32.
//
// Tensors are [B, S, H, Hd] bf16, read in place through 4-d tensor maps
// (Hd, H, S, B) with boxes (64, 1, rows, 1) and the 128-byte swizzle: a box
// lands as rows × 128 bytes, 16-byte chunk c of row r at chunk c ^ (r % 8),
// boxes of the Hd / 64 column chunks side by side; rows past S arrive as
// zeros. wgmma descriptors over these (start, LBO, SBO):
//   K-major (Q and K for S = Q Kᵀ): SBO 1024, step of 16 along Hd +32 bytes
//     inside a chunk, the next chunk rows · 128 bytes on;
//   MN-major (V for P V, Hd the N side): LBO = BN · 128 (the next 64 of Hd),
//     SBO 1024 (the next 8 keys), step of 16 keys +2048 bytes.
// Accumulator layout of m64nN (each consumer warp owns 16 rows): register
// 4 j + e holds row 16 warp + lane / 4 (+ 8 for e >= 2), column
// 8 j + 2 (lane % 4) + e % 2; 16 columns of it packed to bf16 in order are
// the register A operand of the next product.
// Backward: see fa3_bwd_body below.
// The whole module compiles to nothing for other architectures.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Named barriers between the two consumer warpgroups (256 threads).
__device__ __forceinline__ void fa3_named_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void fa3_named_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }

__device__ __forceinline__ float fa3_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// wgmma wrappers (one per shape; overloaded on the accumulator's length).
// d[0..63] (+)= A · B, m64n128k16, A and B from shared memory (descriptors);
// TA / TB: A / B stored MN-major (1) or K-major (0); acc = 0 overwrites d.
template <int TA, int TB>
__device__ __forceinline__ void fa3_ss(float (&d)[64], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %66, %67;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(acc));
}

// d[0..47] (+)= A · B, m64n96k16, A and B from shared memory (descriptors);
// TA / TB: A / B stored MN-major (1) or K-major (0); acc = 0 overwrites d.
template <int TA, int TB>
__device__ __forceinline__ void fa3_ss(float (&d)[48], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %52, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1, %50, %51;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(acc));
}

// d[0..31] (+)= A · B, m64n64k16, A from registers (a[0..3], the accumulator
// layout of 16 columns packed to bf16), B from shared memory; TB: B MN-major (1)
// or K-major (0).
template <int TB>
__device__ __forceinline__ void fa3_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(TB), "r"(acc));
}

// d[0..63] (+)= A · B, m64n128k16, A from registers (a[0..3], the accumulator
// layout of 16 columns packed to bf16), B from shared memory; TB: B MN-major (1)
// or K-major (0).
template <int TB>
__device__ __forceinline__ void fa3_rs(float (&d)[64], const unsigned (&a)[4], unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(TB), "r"(acc));
}

// d[0..95] (+)= A · B, m64n192k16, A from registers (a[0..3], the accumulator
// layout of 16 columns packed to bf16), B from shared memory; TB: B MN-major (1)
// or K-major (0).
template <int TB>
__device__ __forceinline__ void fa3_rs(float (&d)[96], const unsigned (&a)[4], unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %102, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, %101;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(TB), "r"(acc));
}


// d[0..31] (+)= A · B, m64n64k16, A and B from shared memory (descriptors);
// TA / TB: A / B stored MN-major (1) or K-major (0); acc = 0 overwrites d.
template <int TA, int TB>
__device__ __forceinline__ void fa3_ss(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %34, %35;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(acc));
}


extern __shared__ __align__(1024) unsigned char fa3_smem[];


#define FA3_THREADS 384
#define FA3_BM 128
#define FA3_LN2 0.6931471805599453f

// Bytes of the forward's dynamic shared memory for head dim HD, key tile BN
// and STAGES (attention_sm90.rs's fwd_smem): 1024 of alignment slack, the
// query tile, STAGES K and V tiles, the mbarriers.
#define FA3_FWD_SMEM(HD, BN, STAGES) (1024 + FA3_BM * (HD) * 2 + 2 * (STAGES) * (BN) * (HD) * 2 + 256)

// The forward of one 128-query tile of one query head (see the top of the
// file). o: [B, S, Hq, Hd] bf16, lse: [B, Hq, S] f32.
template <int HD, int BN, int STAGES>
__device__ __forceinline__ void fa3_fwd_body(const TmaMap* tq, const TmaMap* tk, const TmaMap* tv, bf16* __restrict__ o,
                                             float* __restrict__ lse, int S, int B, int HQ, int HKV, float scale_log2) {
    constexpr int NC = HD / 64, QB = FA3_BM * HD * 2, KVB = BN * HD * 2;
    unsigned raw = smem_u32(fa3_smem);
    unsigned sq = raw + ((1024u - (raw & 1023u)) & 1023u);
    unsigned sk = sq + QB, sv = sk + STAGES * KVB, bars = sv + STAGES * KVB;
    // q_full, q_empty, then per stage k_full, k_empty, v_full, v_empty.
    unsigned q_full = bars, q_empty = bars + 8;
#define FA3_KF(s) (bars + 8 * (2 + (s)))
#define FA3_KE(s) (bars + 8 * (2 + STAGES + (s)))
#define FA3_VF(s) (bars + 8 * (2 + 2 * STAGES + (s)))
#define FA3_VE(s) (bars + 8 * (2 + 3 * STAGES + (s)))
    // Persistent: block x takes tiles x, x + grid, ... of nqt · Hq · B, the
    // longest query tiles (nearest the end of the sequence) first.
    int nqt = (S + FA3_BM - 1) / FA3_BM, ntiles = nqt * HQ * B;
    // Tile t: query tile qt (from the last), query head h, batch b; its
    // kv head hk, first query q0, key tiles 0 .. nkt - 1.
#define FA3_TILE(t)                                                  \
    int qt = nqt - 1 - (t) / (HQ * B), h = ((t) / B) % HQ, b = (t) % B; \
    int hk = h / (HQ / HKV), q0 = qt * FA3_BM;                       \
    int nkt = (min(S, q0 + FA3_BM) + BN - 1) / BN
    int nkt_prev = 0;
    int tid = threadIdx.x;
    // Warp-uniform as far as the compiler can tell (wgmma must not sit on a
    // path it thinks divergent).
    int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    if (tid == 0) {
        mbar_init(q_full, 1);
        mbar_init(q_empty, 8);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(FA3_KF(s), 1);
            mbar_init(FA3_KE(s), 8);
            mbar_init(FA3_VF(s), 1);
            mbar_init(FA3_VE(s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 2) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (tid == 256) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)tq) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)tk) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)tv) : "memory");
            int cnt = 0, it = 0;
            for (int t = blockIdx.x; t < ntiles; t += gridDim.x, ++it) {
                FA3_TILE(t);
                mbar_wait(q_empty, (it & 1) ^ 1);
                mbar_expect_tx(q_full, QB);
#pragma unroll
                for (int c = 0; c < NC; ++c) tma_4d(sq + c * FA3_BM * 128, tq, q_full, c * 64, h, q0, b);
            for (int j = 0; j < nkt; ++j, ++cnt) {
                int s = cnt % STAGES;
                unsigned ph = (cnt / STAGES) & 1;
                mbar_wait(FA3_KE(s), ph ^ 1);
                mbar_expect_tx(FA3_KF(s), KVB);
#pragma unroll
                for (int c = 0; c < NC; ++c) tma_4d(sk + s * KVB + c * BN * 128, tk, FA3_KF(s), c * 64, hk, j * BN, b);
                mbar_wait(FA3_VE(s), ph ^ 1);
                mbar_expect_tx(FA3_VF(s), KVB);
#pragma unroll
                for (int c = 0; c < NC; ++c) tma_4d(sv + s * KVB + c * BN * 128, tv, FA3_VF(s), c * 64, hk, j * BN, b);
            }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    int warp = (tid >> 5) & 3, lane = tid & 31;
    float sacc[BN / 2], oacc[HD / 2];
    unsigned p[BN / 16][4];
    if (wg == 1) fa3_named_arrive(2);  // warpgroup 0 issues first
    unsigned qa = sq + wg * 64 * 128;
    int cnt = 0, it = 0;
    for (int t = blockIdx.x; t < ntiles; t += gridDim.x, ++it, cnt += nkt_prev) {
    FA3_TILE(t);
    (void)hk;
    nkt_prev = nkt;
    // This thread's rows: r0 and r0 + 8; the warpgroup's first row.
    int wrow = q0 + wg * 64, r0 = wrow + warp * 16 + (lane >> 2);
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) oacc[i] = 0.f;
    float m[2] = {-__int_as_float(0x7f800000), -__int_as_float(0x7f800000)}, l[2] = {0.f, 0.f}, alpha[2] = {1.f, 1.f};
    mbar_wait(q_full, it & 1);
    // One key tile (FA3_FWD_STEP); the first (no P V product yet) is its own
    // instance, so that no wgmma or wait sits under a run-time branch (ptxas
    // would then wait for every product before touching O, losing the
    // overlap).
    int j = 0;
#define FA3_FWD_STEP(FIRST)                                                                                   \
    {                                                                                                       \
        constexpr bool first = (FIRST);                                                                     \
        /* Stage and phase of key tile j (c) and of j - 1 (cp), counted over */                                \
        /* all the block's tiles. */                                                                           \
        int c = cnt + j, cp = c - 1;                                                                           \
        int s = c % STAGES, sp = (cp + STAGES) % STAGES;                                                       \
        unsigned ph = (c / STAGES) & 1, php = (cp / STAGES) & 1;                                               \
        mbar_wait(FA3_KF(s), ph);                                                                               \
        fa3_named_sync(2 + wg);                                                                                \
        wg_pin(sacc);                                                                                         \
        wg_fence();                                                                                           \
_Pragma("unroll")                                                                                              \
        for (int c = 0; c < NC; ++c)                                                                           \
_Pragma("unroll")                                                                                              \
            for (int kk = 0; kk < 4; ++kk)                                                                     \
                fa3_ss<0, 0>(sacc, wgmma_desc(qa + c * FA3_BM * 128 + kk * 32, 16, 1024),                        \
                             wgmma_desc(sk + s * KVB + c * BN * 128 + kk * 32, 16, 1024), c + kk);               \
        wg_commit();                                                                                          \
        if constexpr (!first) {                                                                                \
            /* O *= alpha_{j-1}, then O += P_{j-1} V_{j-1}. */                                                 \
_Pragma("unroll")                                                                                              \
            for (int i = 0; i < HD / 8; ++i) {                                                                 \
                oacc[4 * i] *= alpha[0];                                                                       \
                oacc[4 * i + 1] *= alpha[0];                                                                   \
                oacc[4 * i + 2] *= alpha[1];                                                                   \
                oacc[4 * i + 3] *= alpha[1];                                                                   \
            }                                                                                                  \
            mbar_wait(FA3_VF(sp), php);                                                                         \
            wg_pin(oacc);                                                                                     \
            wg_pin(p);                                                                                        \
            wg_fence();                                                                                       \
_Pragma("unroll")                                                                                              \
            for (int kk = 0; kk < BN / 16; ++kk)                                                               \
                fa3_rs<1>(oacc, p[kk], wgmma_desc(sv + sp * KVB + kk * 2048, BN * 128, 1024), 1);                \
            wg_commit();                                                                                      \
        }                                                                                                      \
        fa3_named_arrive(2 + (1 - wg));                                                                        \
        /* S_j is done (the P V product may still run): K_j can be refilled, */                                \
        /* and after the last one the query tile. */                                                           \
        if constexpr (first) wg_wait<0>(); else wg_wait<1>();                                        \
        wg_pin(sacc);                                                                                         \
        if (lane == 0) {                                                                                       \
            mbar_arrive(FA3_KE(s));                                                                             \
            if (j == nkt - 1) mbar_arrive(q_empty);                                                             \
        }                                                                                                      \
        /* Online softmax of S_j in the log2 domain, masked past the diagonal */                               \
        /* and past S (only tiles that reach either need the test). */                                         \
        int k0 = j * BN;                                                                                       \
        bool mask = k0 + BN - 1 > wrow || k0 + BN > S;                                                         \
_Pragma("unroll")                                                                                              \
        for (int hr = 0; hr < 2; ++hr) {                                                                       \
            int row = r0 + 8 * hr;                                                                             \
            float mx = m[hr];                                                                                  \
_Pragma("unroll")                                                                                              \
            for (int jj = 0; jj < BN / 8; ++jj)                                                                \
_Pragma("unroll")                                                                                              \
                for (int e = 0; e < 2; ++e) {                                                                  \
                    float x = sacc[4 * jj + 2 * hr + e] * scale_log2;                                          \
                    int key = k0 + 8 * jj + 2 * (lane & 3) + e;                                                \
                    if (mask && (key > row || key >= S)) x = -__int_as_float(0x7f800000);                      \
                    sacc[4 * jj + 2 * hr + e] = x;                                                             \
                    mx = fmaxf(mx, x);                                                                         \
                }                                                                                              \
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));                                               \
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));                                               \
            /* Key 0 is in tile 0 and never masked: mx is finite from j = 0 on. */                             \
            alpha[hr] = fa3_exp2(m[hr] - mx);                                                                  \
            m[hr] = mx;                                                                                        \
            float sum = 0.f;                                                                                   \
_Pragma("unroll")                                                                                              \
            for (int jj = 0; jj < BN / 8; ++jj)                                                                \
_Pragma("unroll")                                                                                              \
                for (int e = 0; e < 2; ++e) {                                                                  \
                    float pv = fa3_exp2(sacc[4 * jj + 2 * hr + e] - mx);                                       \
                    sacc[4 * jj + 2 * hr + e] = pv;                                                            \
                    sum += pv;                                                                                 \
                }                                                                                              \
            l[hr] = l[hr] * alpha[hr] + sum;                                                                   \
        }                                                                                                      \
        if constexpr (!first) {                                                                                \
            /* P_{j-1} V_{j-1} is done: V_{j-1} can be refilled, P rewritten. */                               \
            wg_wait<0>();                                                                                 \
            wg_pin(oacc);                                                                                     \
            wg_pin(p);                                                                                        \
            if (lane == 0) mbar_arrive(FA3_VE(sp));                                                             \
        }                                                                                                      \
_Pragma("unroll")                                                                                              \
        for (int kk = 0; kk < BN / 16; ++kk)                                                                   \
_Pragma("unroll")                                                                                              \
            for (int e = 0; e < 4; ++e) p[kk][e] = pack_bf16(sacc[8 * kk + 2 * e], sacc[8 * kk + 2 * e + 1]);  \
    }
    FA3_FWD_STEP(true)
    for (j = 1; j < nkt; ++j) FA3_FWD_STEP(false)
#undef FA3_FWD_STEP
    // The last tile's product.
    {
        int sp = (cnt + nkt - 1) % STAGES;
        unsigned php = ((cnt + nkt - 1) / STAGES) & 1;
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) {
            oacc[4 * i] *= alpha[0];
            oacc[4 * i + 1] *= alpha[0];
            oacc[4 * i + 2] *= alpha[1];
            oacc[4 * i + 3] *= alpha[1];
        }
        mbar_wait(FA3_VF(sp), php);
        wg_pin(oacc);
        wg_pin(p);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            fa3_rs<1>(oacc, p[kk], wgmma_desc(sv + sp * KVB + kk * 2048, BN * 128, 1024), 1);
        wg_commit();
        wg_wait<0>();
        wg_pin(oacc);
        if (lane == 0) mbar_arrive(FA3_VE(sp));
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        float lt = l[hr];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        int row = r0 + 8 * hr;
        if (row >= S) continue;
        float inv = 1.f / lt;
        bf16* orow = o + (((i64)b * S + row) * HQ + h) * HD + 2 * (lane & 3);
#pragma unroll
        for (int i = 0; i < HD / 8; ++i)
            *reinterpret_cast<unsigned*>(orow + 8 * i) = pack_bf16(oacc[4 * i + 2 * hr] * inv, oacc[4 * i + 2 * hr + 1] * inv);
        if ((lane & 3) == 0) lse[((i64)b * HQ + h) * S + row] = FA3_LN2 * (m[hr] + __log2f(lt));
    }
    }
    // Warpgroup 1 arrived once more than warpgroup 0 waited (its first
    // arrival let warpgroup 0 start): take it, so no barrier is left half
    // complete.
    if (wg == 0) fa3_named_sync(2);
#undef FA3_TILE
#undef FA3_KF
#undef FA3_KE
#undef FA3_VF
#undef FA3_VE
}

#define FA3_ENTRY extern "C" __global__ void __launch_bounds__(FA3_THREADS, 1)
#define FA3_FWD(HD, BN, STAGES)                                                                                  \
    FA3_ENTRY fa3_fwd_bf16_hd##HD(const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,          \
                                  const __grid_constant__ TmaMap tv, bf16* o, float* lse, int S, int B, int HQ, int HKV, \
                                  float scale_log2) { pdl_enter();                                               \
        fa3_fwd_body<HD, BN, STAGES>(&tq, &tk, &tv, o, lse, S, B, HQ, HKV, scale_log2);                             \
    }
// Key tiles: 128 keys (hd 64, 128); 96 at hd 192 so that two stages fit.
FA3_FWD(64, 128, 2)
FA3_FWD(128, 128, 2)
FA3_FWD(192, 96, 2)

// ---------------------------------------------------------------------------
// Backward (fa3_bwd_*), Hd 64, 128 and MLA's 192 / 128: one block of 384
// threads per 128 keys of one kv head (key tiles from the first: the most
// work first; the two consumer warpgroups take turns issuing, as in the
// forward), over the 64-query tiles from the last down to the diagonal and,
// for each, the kv head's G query heads (so that the blocks of one kv head
// running at once read the same Q / dO tiles and add to the same dQ tiles
// at about the same time, from the L2). HD is the width of q, k (and of the
// tensors v, dO, dv); HV <= HD the value columns that are read: MLA's values
// arrive zero-padded from 128 to 192 (mla.rs), so its kernel reads 128
// columns of v and dO, and writes zeros to dv's padding (fa3_pad_check has
// checked that v's and dO's padding is zero).
// - warpgroup 2 produces: one thread copies the block's K (HD) and V (HV
//   columns) once, then per query tile Q_i and dO_i (TMA, boxes of 64 rows)
//   and the tile's log2-domain lse and delta (bulk copies of 256 bytes from
//   the padded buffers fa3_bwd_prep fills) into an NS-stage ring;
// - warpgroup w consumes keys 64 w .. 64 w + 63 of the block, keeping its
//   dK (64 × HD) and dV (64 × HV, f32) in registers: Sᵀ = K_w Q_iᵀ and
//   dPᵀ = V_w dO_iᵀ (wgmma from shared memory), Pᵀ = exp2(scale · Sᵀ − lse),
//   dSᵀ = Pᵀ ∘ (dPᵀ − delta), then dV += Pᵀ dO_i and dK += dSᵀ Q_i with Pᵀ
//   and dSᵀ as register operands; dSᵀ is also written to shared memory
//   (bf16, MN-major, both warpgroups' 64 keys side by side, two buffers
//   by step parity) so that, after a barrier of both warpgroups, each one
//   computes dQ_i = dS K over all 128 keys for half of dQ's columns (one
//   n HD/2 product; at 192 an n64 and an n32 one, as a descriptor spans at
//   most one 64-column chunk when it starts inside one); that part is added
//   to the f32 dQ accumulator (the accumulator's own order, tile by tile),
//   at Hd 128 staged in shared memory and added by one thread's bulk
//   reduction (cp.reduce.async.bulk), at 64 and 192 from the registers with
//   red.global.add.v4.f32: each block adds each dQ element once per step
//   (no per-warpgroup partial sums: ncu of an earlier kernel showed L2 at
//   73 % with two 32 KiB adds per block and step); fa3_dq_convert scales,
//   reorders and rounds it into dq.
// Rows past S arrive as zeros (TMA), the padded lse and delta are 0 there:
// their P is 1 and their dS 0, and their dK, dV and dQ rows are not stored.

#define FA3_BWD_KEYS 128
#define FA3_BWD_Q 64

// Bytes of one stage: Q_i (64 × HD bf16) and dO_i (64 × HV), a multiple of
// 1024 (the 128-byte swizzle's alignment); the stage's lse and delta (64 f32
// each) sit in a ring of their own, so that no stage rounds up.
#define FA3_BWD_STAGE(HD, HV) ((HD) * 128 + (HV) * 128)
// Whether each warpgroup stages 64 columns of its dQ part in shared memory
// and adds them with one bulk reduction: at Hd 128 (its whole part; 322-327
// -> 344-347 TFLOP/s on the H200) and MLA's 192 (the 64-column half of its
// 96; the 32-column rest stays on red.global, as the shared memory holds no
// more), not at 64 (322 -> 275: its 4 adds a thread held nothing up, and the
// staging's fence and barrier sit on a step half as long).
#define FA3_BWD_STAGED_DQ(HD) ((HD) != 64)
// Dynamic shared memory (attention_sm90.rs's bwd_smem): alignment slack, K
// and V, NS stages, two buffers of dSᵀ (128 × 64 bf16), the dQ staging (64 ×
// 64 f32 a warpgroup), the lse / delta ring, the mbarriers: 232000 bytes at
// Hd 128 and 231488 at MLA's, of the 232448 a block may have.
#define FA3_BWD_SMEM(HD, HV, NS)                                                                              \
    (1024 + FA3_BWD_KEYS * ((HD) + (HV)) * 2 + (NS) * FA3_BWD_STAGE(HD, HV) + 2 * 16384 +                    \
     (FA3_BWD_STAGED_DQ(HD) ? 2 * 16384 : 0) + (NS) * 512 + 64)

__device__ __forceinline__ void fa3_bulk_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// dst[0 .. bytes / 4) += src's f32 at the L2, read from shared memory by the
// async proxy (one thread; its bulk group is waited for by wait_group.read
// before the source is written again).
__device__ __forceinline__ void fa3_bulk_add_s2g(float* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 "cp.async.bulk.commit_group;\n" ::"l"(dst),
                 "r"(src), "r"(bytes)
                 : "memory");
}
// Adds a warpgroup's 64 × 64 f32 block of dQ (d, 4 j + e of thread t being
// element (j · 128 + t) · 4 + e of the accumulator tile's 16 KiB at dst) by
// way of shared memory: conflict-free float4 stores to stg (address sa),
// then one thread's bulk reduction. The registers are free at once, where
// red.global's sources stay held until the LSU takes them (ncu at Hd 128:
// 17 % of the stall samples, at the next step's first rewrite of them). The
// caller frees stg for the next step (wait_group.read before a barrier).
__device__ __forceinline__ void fa3_dq_stage_add(float* stg, unsigned sa, float* dst, const float (&d)[32], int t,
                                                 int wg) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
        *reinterpret_cast<float4*>(stg + (j * 128 + t) * 4) = make_float4(d[4 * j], d[4 * j + 1], d[4 * j + 2], d[4 * j + 3]);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(8 + wg) : "memory");
    if (t == 0) fa3_bulk_add_s2g(dst, sa, 16384);
}
// dst[0..3] += (a, b, c, d) at the L2 (16-byte aligned, global).
__device__ __forceinline__ void fa3_red_add_v4(float* dst, float a, float b, float c, float d) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// d[0..15] (+)= A · B, m64n32k16, A and B from shared memory (descriptors);
// TA / TB: A / B stored MN-major (1) or K-major (0); acc = 0 overwrites d.
template <int TA, int TB>
__device__ __forceinline__ void fa3_ss(float (&d)[16], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %20, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %18, %19;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(acc));
}


// One warpgroup's part of dQ_i = dS K over the block's 128 keys: N columns
// of K from kb (MN-major, inside one 64-column chunk), dSᵀ from ds.
template <int N> __device__ __forceinline__ void fa3_dq_part(float (&d)[N / 2], unsigned ds, unsigned kb) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
        fa3_ss<1, 1>(d, wgmma_desc(ds + kk * 2048, 8192, 1024), wgmma_desc(kb + kk * 2048, FA3_BWD_KEYS * 128, 1024), kk);
}
// Adds that part (columns col0 .. col0 + N - 1) to the accumulator's tile:
// register 4 j + e of thread t is element (j' · 128 + t) · 4 + e with
// j' = col0 / 8 + j, so a warp's 32 float4 adds cover 512 contiguous bytes.
template <int N> __device__ __forceinline__ void fa3_dq_add(float* tile, const float (&d)[N / 2], int col0, int t) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
        fa3_red_add_v4(tile + ((col0 / 8 + j) * 128 + t) * 4, d[4 * j], d[4 * j + 1], d[4 * j + 2], d[4 * j + 3]);
}

// dPᵀ = V_w dO_iᵀ (inside fa3_bwd_body).
#define FA3_BWD_DP()                                                                                   \
    do {                                                                                               \
        _Pragma("unroll") for (int c = 0; c < NCV; ++c) _Pragma("unroll") for (int kk = 0; kk < 4; ++kk) \
            fa3_ss<0, 0>(dpa, wgmma_desc(va + c * FA3_BWD_KEYS * 128 + kk * 32, 16, 1024),             \
                         wgmma_desc(sdo + c * FA3_BWD_Q * 128 + kk * 32, 16, 1024), c + kk);           \
    } while (0)

template <int HD, int HV, int NS>
__device__ __forceinline__ void fa3_bwd_body(const TmaMap* tq, const TmaMap* tk, const TmaMap* tv, const TmaMap* tdo,
                                             const float* __restrict__ lse2, const float* __restrict__ delta,
                                             float* __restrict__ dq_acc, bf16* __restrict__ dk, bf16* __restrict__ dv,
                                             int S, int B, int HQ, int HKV, float scale, float scale_log2) {
    constexpr int NC = HD / 64, NCV = HV / 64, KB = FA3_BWD_KEYS * HD * 2, VB = FA3_BWD_KEYS * HV * 2;
    constexpr int QB = FA3_BWD_Q * HD * 2, OB = FA3_BWD_Q * HV * 2, ST = FA3_BWD_STAGE(HD, HV);
    unsigned raw = smem_u32(fa3_smem);
    unsigned pad = (1024u - (raw & 1023u)) & 1023u;
    unsigned char* base = fa3_smem + pad;
    constexpr bool STAGED = FA3_BWD_STAGED_DQ(HD);
    unsigned sk = raw + pad, sv = sk + KB, st0 = sv + VB, sds = st0 + NS * ST;
    unsigned sdq = sds + 2 * 16384, sld = sdq + (STAGED ? 2 * 16384 : 0);
    unsigned bars = sld + NS * 512;
    // kv_full, then full[NS], empty[NS].
    unsigned kv_full = bars;
#define FA3_BF(s) (bars + 8 * (1 + (s)))
#define FA3_BE(s) (bars + 8 * (1 + NS + (s)))
    // Blocks longest first: all the first key tiles (of every kv head and
    // batch), then all the second ones, ...
    int G = HQ / HKV, kt = blockIdx.x / (HKV * B), hk = (blockIdx.x / B) % HKV, b = blockIdx.x % B;
    int k0 = kt * FA3_BWD_KEYS;
    int Sp = (S + FA3_BWD_Q - 1) / FA3_BWD_Q * FA3_BWD_Q, nqt = Sp / FA3_BWD_Q;
    int i0 = k0 / FA3_BWD_Q, per = nqt - i0;
    int tid = threadIdx.x;
    int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    if (tid == 0) {
        mbar_init(kv_full, 1);
        for (int s = 0; s < NS; ++s) {
            mbar_init(FA3_BF(s), 1);
            // Every consumer thread arrives: each one read the stage's lse
            // and delta with plain loads, which its own arrival releases.
            mbar_init(FA3_BE(s), 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 2) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (tid == 256) {
            mbar_expect_tx(kv_full, KB + VB);
#pragma unroll
            for (int c = 0; c < NC; ++c) tma_4d(sk + c * FA3_BWD_KEYS * 128, tk, kv_full, c * 64, hk, k0, b);
#pragma unroll
            for (int c = 0; c < NCV; ++c) tma_4d(sv + c * FA3_BWD_KEYS * 128, tv, kv_full, c * 64, hk, k0, b);
            for (int n = 0; n < G * per; ++n) {
                int s = n % NS, h = hk * G + n % G, q0 = (nqt - 1 - n / G) * FA3_BWD_Q;
                mbar_wait(FA3_BE(s), ((n / NS) & 1) ^ 1);
                unsigned full = FA3_BF(s), sq = st0 + s * ST, sdo = sq + QB;
                mbar_expect_tx(full, QB + OB + 512);
#pragma unroll
                for (int c = 0; c < NC; ++c) tma_4d(sq + c * FA3_BWD_Q * 128, tq, full, c * 64, h, q0, b);
#pragma unroll
                for (int c = 0; c < NCV; ++c) tma_4d(sdo + c * FA3_BWD_Q * 128, tdo, full, c * 64, h, q0, b);
                i64 r = ((i64)b * HQ + h) * Sp + q0;
                fa3_bulk_g2s(sld + s * 512, lse2 + r, 256, full);
                fa3_bulk_g2s(sld + s * 512 + 256, delta + r, 256, full);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    int t = tid & 127, warp = t >> 5, lane = t & 31;
    int kw0 = k0 + wg * 64, key0 = kw0 + warp * 16 + (lane >> 2);
    float dka[HD / 2], dva[HV / 2];
#pragma unroll
    for (int x = 0; x < HD / 2; ++x) dka[x] = 0.f;
#pragma unroll
    for (int x = 0; x < HV / 2; ++x) dva[x] = 0.f;
    unsigned ka = sk + wg * 64 * 128, va = sv + wg * 64 * 128;
    // This warpgroup's 64 × 64 f32 dQ staging (STAGED).
    unsigned sdqw = sdq + wg * 16384;
    float* stg = reinterpret_cast<float*>(base + (sdqw - (raw + pad)));
    if (wg == 1) fa3_named_arrive(4);  // warpgroup 0 issues first
    mbar_wait(kv_full, 0);
    for (int n = 0; n < G * per; ++n) {
        int s = n % NS, h = hk * G + n % G, i = nqt - 1 - n / G, q0 = i * FA3_BWD_Q;
        unsigned sq = st0 + s * ST, sdo = sq + QB;
        const float* sl = reinterpret_cast<const float*>(base + (sld + s * 512 - (raw + pad)));
        // This step's dSᵀ buffer (both warpgroups' keys) and this
        // warpgroup's rows of it.
        unsigned dsb = sds + (n & 1) * 16384;
        unsigned char* dsp = base + (dsb + wg * 8192 - (raw + pad));
        mbar_wait(FA3_BF(s), (n / NS) & 1);
        float sacc[32], dpa[32];
        unsigned pp[4][4], pds[4][4];
        bool mask = q0 < kw0 + 63;
        // Ping-pong: the warpgroups take turns issuing Sᵀ (and dPᵀ), so one's
        // softmax runs under the other's products.
        fa3_named_sync(4 + wg);
        wg_fence();
#pragma unroll
        for (int c = 0; c < NC; ++c)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                fa3_ss<0, 0>(sacc, wgmma_desc(ka + c * FA3_BWD_KEYS * 128 + kk * 32, 16, 1024),
                             wgmma_desc(sq + c * FA3_BWD_Q * 128 + kk * 32, 16, 1024), c + kk);
        if constexpr (HD != 192) FA3_BWD_DP();
        wg_commit();
        fa3_named_arrive(4 + (1 - wg));
        wg_wait<0>();
        wg_pin(sacc);
        // Pᵀ: rows are keys, columns queries.
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int qc = 8 * jj + 2 * (lane & 3) + e;
                float l2 = sl[qc];
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    int x = 4 * jj + 2 * hr + e;
                    float p = fa3_exp2(sacc[x] * scale_log2 - l2);
                    if (mask && key0 + 8 * hr > q0 + qc) p = 0.f;
                    sacc[x] = p;
                }
            }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) pp[kk][e] = pack_bf16(sacc[8 * kk + 2 * e], sacc[8 * kk + 2 * e + 1]);
        if constexpr (HD == 192) {
            // dK's 96 and dV's 64 registers leave no room for Sᵀ and dPᵀ in
            // flight together (ptxas serialised every product, C7512): dPᵀ
            // is issued once Pᵀ is packed, and dSᵀ takes the rounded Pᵀ (it
            // is rounded to bf16 itself right after).
            wg_fence();
            FA3_BWD_DP();
            wg_commit();
            wg_wait<0>();
            wg_pin(dpa);
            wg_pin(pp);
        } else {
            wg_pin(dpa);
        }
        // dSᵀ = Pᵀ ∘ (dPᵀ − delta).
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float dl = sl[64 + 8 * jj + 2 * (lane & 3) + e];
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    int x = 4 * jj + 2 * hr + e;
                    unsigned w = pp[x / 8][(x % 8) / 2];
                    float p = HD == 192 ? __uint_as_float(x % 2 ? w & 0xffff0000u : w << 16) : sacc[x];
                    dpa[x] = p * (dpa[x] - dl);
                }
            }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) pds[kk][e] = pack_bf16(dpa[8 * kk + 2 * e], dpa[8 * kk + 2 * e + 1]);
        wg_pin(dva);
        wg_pin(dka);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) fa3_rs<1>(dva, pp[kk], wgmma_desc(sdo + kk * 2048, FA3_BWD_Q * 128, 1024), 1);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) fa3_rs<1>(dka, pds[kk], wgmma_desc(sq + kk * 2048, FA3_BWD_Q * 128, 1024), 1);
        wg_commit();
        // dSᵀ to shared memory, MN-major for dQ = dS K: row = key (the
        // product's inner dimension), 64 queries per 128-byte row, swizzled.
        // The other warpgroup's dQ product of step n - 2, the last reader of
        // this buffer, completed before it reached step n - 1's barrier.
        // These stores run under dV's and dK's products.
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                int kr = warp * 16 + (lane >> 2) + 8 * hr, qc = 8 * jj + 2 * (lane & 3);
                *reinterpret_cast<unsigned*>(dsp + kr * 128 + ((jj ^ (kr & 7)) << 4) + (qc & 7) * 2) =
                    pds[jj >> 1][(jj & 1) * 2 + hr];
            }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        // The dQ staging's last bulk add has read it (thread 0 of each
        // warpgroup issued it; the barrier passes that on).
        if constexpr (STAGED)
            if (t == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        // Both warpgroups' dSᵀ of this step are in place.
        fa3_named_sync(6);
        float* dqt = dq_acc + (((i64)b * HQ + h) * nqt + i) * (FA3_BWD_Q * HD);
        if constexpr (HD == 192) {
            // dK's 96 and dV's 64 registers leave no room for dQ's beside the
            // packed Pᵀ and dSᵀ: let dV and dK complete first.
            wg_wait<0>();
            wg_pin(dva);
            wg_pin(dka);
            wg_pin(pp);
            wg_pin(pds);
            mbar_arrive(FA3_BE(s));
            // Warpgroup 0: columns 0..63 (chunk 0) and 64..95 (chunk 1's
            // first half); warpgroup 1: 96..127 and 128..191.
            float d64[32], d32[16];
            unsigned c64 = sk + (wg ? 2 : 0) * FA3_BWD_KEYS * 128, c32 = sk + FA3_BWD_KEYS * 128 + wg * 64;
            wg_fence();
            fa3_dq_part<64>(d64, dsb, c64);
            fa3_dq_part<32>(d32, dsb, c32);
            wg_commit();
            wg_wait<0>();
            wg_pin(d64);
            wg_pin(d32);
            wg_pin(dva);
            wg_pin(dka);
            fa3_dq_stage_add(stg, sdqw, dqt + (wg ? 128 : 0) * 64, d64, t, wg);
            fa3_dq_add<32>(dqt, d32, wg ? 96 : 64, t);
        } else {
            // Warpgroup w: columns HD/2 · w .. (one chunk at 128, half of
            // the one at 64), issued while dV and dK may still run.
            float dqa[HD / 4];
            wg_fence();
            fa3_dq_part<HD / 2>(dqa, dsb, sk + wg * (HD == 128 ? FA3_BWD_KEYS * 128 : 64));
            wg_commit();
            wg_wait<0>();
            wg_pin(dqa);
            wg_pin(dva);
            wg_pin(dka);
            wg_pin(pp);
            wg_pin(pds);
            // Q_i, dO_i, lse and delta are no longer read.
            mbar_arrive(FA3_BE(s));
            if constexpr (STAGED) {
                fa3_dq_stage_add(stg, sdqw, dqt + wg * 64 * 64, dqa, t, wg);
            } else {
                fa3_dq_add<HD / 2>(dqt, dqa, wg * (HD / 2), t);
            }
        }
    }
    // The bulk adds are complete before the block ends.
    if constexpr (STAGED)
        if (t == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    // dK (scaled) and dV rows of this warpgroup's keys (dV's columns past HV:
    // zeros, as v's are).
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        int key = key0 + 8 * hr;
        if (key >= S) continue;
        i64 at = (((i64)b * S + key) * HKV + hk) * HD + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
            *reinterpret_cast<unsigned*>(dk + at + 8 * j) = pack_bf16(dka[4 * j + 2 * hr] * scale, dka[4 * j + 2 * hr + 1] * scale);
            *reinterpret_cast<unsigned*>(dv + at + 8 * j) =
                j < HV / 8 ? pack_bf16(dva[4 * j + 2 * hr], dva[4 * j + 2 * hr + 1]) : 0u;
        }
    }
    // Warpgroup 1 arrived once more than warpgroup 0 waited.
    if (wg == 0) fa3_named_sync(4);
#undef FA3_BF
#undef FA3_BE
}
#undef FA3_BWD_DP

#define FA3_BWD(NAME, HD, HV, NS)                                                                                \
    FA3_ENTRY fa3_bwd_bf16_##NAME(const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,          \
                                  const __grid_constant__ TmaMap tv, const __grid_constant__ TmaMap tdo,         \
                                  const float* lse2, const float* delta, float* dq_acc, bf16* dk, bf16* dv,     \
                                  int S, int B, int HQ, int HKV, float scale, float scale_log2) { pdl_enter();   \
        fa3_bwd_body<HD, HV, NS>(&tq, &tk, &tv, &tdo, lse2, delta, dq_acc, dk, dv, S, B, HQ, HKV, scale,         \
                                 scale_log2);                                                                    \
    }
// Three stages of Q / dO at 64 and 128; two fit at MLA's 192 / 128.
FA3_BWD(hd64, 64, 64, 3)
FA3_BWD(hd128, 128, 128, 3)
FA3_BWD(mla, 192, 128, 2)

// MLA's backward reads 128 of v's and dO's 192 columns: records an error
// (code) at the first nonzero padding element of v ([B, S, Hkv, 192]) or dO
// ([B, S, Hq, 192]), whose value the kernel would otherwise drop.
extern "C" __global__ void fa3_pad_check(const bf16* __restrict__ v, const bf16* __restrict__ d_o, i64 nv, i64 ndo,
                                         ErrRec* err, unsigned code_v, unsigned code_do) { pdl_enter();
    for (i64 x = (i64)blockIdx.x * blockDim.x + threadIdx.x; x < (nv + ndo) * 8; x += (i64)gridDim.x * blockDim.x) {
        // 8 bf16 (16 bytes) per thread: columns 128..191 of row x / 8.
        i64 row = x >> 3;
        bool isv = row < nv;
        const bf16* p = (isv ? v + row * 192 : d_o + (row - nv) * 192) + 128 + (x & 7) * 8;
        uint4 raw = *reinterpret_cast<const uint4*>(p);
        if ((raw.x | raw.y | raw.z | raw.w) & 0x7fff7fffu) {
            const bf16* h = reinterpret_cast<const bf16*>(&raw);
            int e = 0;
            while (e < 7 && (__bfloat16_as_ushort(h[e]) & 0x7fffu) == 0) ++e;
            report_err(err, isv ? code_v : code_do, (isv ? row : row - nv) * 192 + 128 + (x & 7) * 8 + e,
                       (double)__bfloat162float(h[e]));
        }
    }
}

// The backward's per-query inputs over rows padded to Sp (a multiple of 64):
// delta = Σ dO ∘ O over the first HV columns (MLA's O is zero past its
// values' 128 of Hd = 192, so those suffice) and lse2 = lse · log2 e, 0 past
// S. The rows are taken in dO's and O's memory order ((b, s, h), h
// fastest), HV / 8 lanes a row with 16-byte loads, 32 / (HV / 8) rows a
// warp where that divides (64, 128), else one (192), two such row groups
// loaded before either is reduced; the rows past S are zeroed after. A grid
// of a few blocks per SM strides over the rows (attention_sm90.rs). It also
// zeroes the dQ accumulator (dq_acc, n4 float4s), which the main kernel
// adds into: its stores leave while the rows' loads are in flight, and no
// memset runs before this kernel.
extern "C" __global__ void fa3_bwd_prep(const bf16* __restrict__ d_o, const bf16* __restrict__ o,
                                        const float* __restrict__ lse, float* __restrict__ lse2,
                                        float* __restrict__ delta, float4* __restrict__ dq_acc, i64 n4, int B,
                                        int S, int Sp, int HQ, int HD, int HV) { pdl_enter();
    for (i64 x = (i64)blockIdx.x * blockDim.x + threadIdx.x; x < n4; x += (i64)gridDim.x * blockDim.x)
        dq_acc[x] = make_float4(0.f, 0.f, 0.f, 0.f);
    int lane = threadIdx.x & 31, lpr = HV / 8, rpw = 32 % lpr == 0 ? 32 / lpr : 1;
    int seg = lane / lpr, sl = lane % lpr;
    bool on = seg < rpw;
    i64 rows = (i64)B * S * HQ, warps = ((i64)gridDim.x * blockDim.x) >> 5, stride = warps * rpw;
    for (i64 r0 = (((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * rpw; r0 < rows; r0 += 2 * stride) {
        uint4 x[2], y[2];
        bool mine[2];
        i64 at[2] = {0, 0};
        float l[2] = {0.f, 0.f};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const i64 r = r0 + u * stride + seg;
            mine[u] = on && r < rows;
            x[u] = make_uint4(0, 0, 0, 0);
            y[u] = x[u];
            if (mine[u]) {
                x[u] = *reinterpret_cast<const uint4*>(d_o + r * HD + sl * 8);
                y[u] = *reinterpret_cast<const uint4*>(o + r * HD + sl * 8);
            }
        }
        // Each row's lane 0 finds (b, h, s) and loads lse while the loads
        // are in flight.
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const i64 r = r0 + u * stride + seg;
            if (mine[u] && sl == 0) {
                i64 h, b, s;
                if (rows <= 0x7fffffffLL) {
                    const unsigned q = (unsigned)r / (unsigned)HQ, qb = q / (unsigned)S;
                    h = (unsigned)r - q * (unsigned)HQ;
                    b = qb;
                    s = q - qb * (unsigned)S;
                } else {
                    const i64 bs = r / HQ;
                    h = r - bs * HQ;
                    b = bs / S;
                    s = bs - b * S;
                }
                at[u] = (b * HQ + h) * Sp + s;
                l[u] = lse[(b * HQ + h) * S + s];
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            float acc = 0.f;
            const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&x[u]);
            const __nv_bfloat162* yp = reinterpret_cast<const __nv_bfloat162*>(&y[u]);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 xf = __bfloat1622float2(xp[k]), yf = __bfloat1622float2(yp[k]);
                acc += xf.x * yf.x + xf.y * yf.y;
            }
            // Sum over the row's lanes: within segments of lpr lanes where
            // lpr is a power of two, else over the warp (one row, idle
            // lanes 0).
            if (rpw > 1) {
                for (int m = lpr / 2; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
            } else {
                for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
            }
            if (mine[u] && sl == 0) {
                delta[at[u]] = acc;
                lse2[at[u]] = l[u] * 1.4426950408889634f;
            }
        }
    }
    // The padding rows s in [S, Sp) of every (b, h).
    i64 pad = Sp - S, npad = (i64)B * HQ * pad;
    for (i64 x = (i64)blockIdx.x * blockDim.x + threadIdx.x; x < npad; x += (i64)gridDim.x * blockDim.x) {
        i64 bh = x / pad, at = bh * Sp + S + (x - bh * pad);
        delta[at] = 0.f;
        lse2[at] = 0.f;
    }
}

// dq [B, S, Hq, Hd] = scale · the accumulator, whose 64-query tiles
// ([B, Hq, Sp / 64]) each hold 64 × Hd f32 in fa3_bwd_body's staging order:
// element (j, t, e) at (j · 128 + t) · 4 + e is register 4 j + e of consumer
// thread t, i.e. row 16 (t / 32) + (t % 32) / 4 + 8 (e / 2), column
// 8 j + 2 (t % 4) + e % 2. One thread per 8 columns (j) of a row pair
// (r, r + 8): its four float4 are 64 contiguous bytes (threads t .. t + 3),
// and it writes 16 bytes to each row. (One thread per output element, with
// 64-bit divisions and half-used sectors, took ~3× the memory time.)
extern "C" __global__ void fa3_dq_convert(const float* __restrict__ acc, bf16* __restrict__ dq, int B, int S, int HQ,
                                          int HD, float scale) { pdl_enter();
    unsigned nqt = (S + FA3_BWD_Q - 1) / FA3_BWD_Q, nj = HD / 8, tiles = (unsigned)B * HQ * nqt;
    for (unsigned tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        unsigned i = tile % nqt, bh = tile / nqt, h = bh % HQ, b = bh / HQ;
        for (unsigned y = threadIdx.x; y < 32 * nj; y += blockDim.x) {
            unsigned j = y % nj, p = y / nj;
            int s = (int)(i * FA3_BWD_Q + (p >> 3) * 16 + (p & 7));
            if (s >= S) continue;
            const float4* src =
                reinterpret_cast<const float4*>(acc + (i64)tile * (FA3_BWD_Q * HD)) + j * 128 + (p >> 3) * 32 + (p & 7) * 4;
            float4 v[4];
#pragma unroll
            for (int c = 0; c < 4; ++c) v[c] = src[c];
            i64 at = (((i64)b * S + s) * HQ + h) * HD + 8 * j;
            *reinterpret_cast<uint4*>(dq + at) =
                make_uint4(pack_bf16(scale * v[0].x, scale * v[0].y), pack_bf16(scale * v[1].x, scale * v[1].y),
                           pack_bf16(scale * v[2].x, scale * v[2].y), pack_bf16(scale * v[3].x, scale * v[3].y));
            if (s + 8 < S)
                *reinterpret_cast<uint4*>(dq + at + (i64)8 * HQ * HD) =
                    make_uint4(pack_bf16(scale * v[0].z, scale * v[0].w), pack_bf16(scale * v[1].z, scale * v[1].w),
                               pack_bf16(scale * v[2].z, scale * v[2].w), pack_bf16(scale * v[3].z, scale * v[3].w));
        }
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
