// Top-k (optionally group-limited), column gathers, embeddings and the
// permutations of the MoE dispatcher. Shape letters: T tokens, E experts,
// K top-k, N permuted rows, D hidden, V vocabulary.
//
// Every accumulation runs in a fixed order per output element, so results
// are deterministic: a scatter first inverts its index map (count, scan,
// place, then sort each target's segment so it lists sources in increasing
// order), and each output row then sums its sources in that order.

// Reports the first entry of idx outside [lo, hi); the consumers skip such
// entries, so nothing is read or written out of bounds.
extern "C" __global__ void check_range(const int* idx, i64 n, i64 lo, i64 hi, ErrRec* err, unsigned int code) { pdl_enter();
    GRID_LOOP(i, n) {
        i64 c = idx[i];
        if (c < lo || c >= hi) report_err(err, code, i, (double)c);
    }
}

// Reports the first NaN of x.
template <typename T> __device__ void check_nan_impl(const T* x, i64 n, ErrRec* err, unsigned int code) {
    GRID_LOOP(i, n) {
        double v = to_f64(x[i]);
        if (isnan(v)) report_err(err, code, i, v);
    }
}
#define CHECK_NAN(sfx, T) \
    extern "C" __global__ void check_nan_##sfx(const T* x, i64 n, ErrRec* err, unsigned int code) { pdl_enter(); check_nan_impl<T>(x, n, err, code); }
FOR_FLOATS(CHECK_NAN)

// ---- top-k ----------------------------------------------------------------------

// The top-k order: larger value first, then lower index. `after(v, i, pv, pi)`
// says (v, i) comes strictly after (pv, pi), so the j-th pick is the best
// element after the (j−1)-th: no marks, no sorting, O(K·E) per row.
__device__ __forceinline__ bool after(double v, i64 i, double pv, i64 pi) { return v < pv || (v == pv && i > pi); }
__device__ __forceinline__ bool better(double v, i64 i, double bv, i64 bi) { return bi < 0 || v > bv || (v == bv && i < bi); }

#define MAX_GROUPS 64

// The best (v, c) of a warp's candidates under `better` (bi = -1: none);
// every lane gets it. `better` is a strict total order on distinct indices,
// so the butterfly gives each lane the same winner.
__device__ __forceinline__ void warp_best(double& bv, i64& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        double ov = __shfl_xor_sync(0xffffffffu, bv, o);
        i64 oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

// The best column of row[lo, hi) (lane-strided: lane l looks at lo + l,
// lo + l + 32, ...) that comes after (pv, pi) (pi < 0: any), among those
// whose group bit is set in `eligible` (group c / per_group).
template <typename T>
__device__ __forceinline__ void warp_pick(const T* row, i64 lo, i64 hi, i64 per_group, unsigned long long eligible,
                                          double pv, i64 pi, double& bv, i64& bi) {
    bv = 0;
    bi = -1;
    for (i64 c = lo + (threadIdx.x & 31); c < hi; c += 32) {
        if (eligible != ~0ull && !((eligible >> (c / per_group)) & 1ull)) continue;
        double v = to_f64(row[c]);
        if (pi >= 0 && !after(v, c, pv, pi)) continue;
        if (better(v, c, bv, bi)) {
            bv = v;
            bi = c;
        }
    }
    warp_best(bv, bi);
}

// One warp per row (the row's E values read lane-strided, so a pick costs
// E / 32 loads and five shuffles a lane instead of E steps of one thread:
// at 16384 × 128 the thread-per-row kernel left most of the GPU idle). With
// groups > 1 a group scores the sum (in f64, best first) of its best
// `score_top` values; only the best `keep_groups` groups are eligible. NaN
// rows report their first NaN and get indices 0..K-1.
template <typename T>
__device__ void topk_impl(const T* x, int* out, i64 t, i64 e, i64 k, i64 groups, i64 per_group, i64 keep_groups, i64 score_top,
                          ErrRec* err, unsigned int code_nan) {
    int lane = threadIdx.x & 31;
    i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < t; r += warps) {
        const T* row = x + r * e;
        int* o = out + r * k;
        i64 first_nan = e;
        for (i64 c = lane; c < e; c += 32)
            if (isnan(to_f64(row[c]))) {
                first_nan = c;
                break;
            }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            i64 other = __shfl_xor_sync(0xffffffffu, first_nan, off);
            first_nan = other < first_nan ? other : first_nan;
        }
        if (first_nan < e) {
            if (lane == 0) report_err(err, code_nan, r * e + first_nan, to_f64(row[first_nan]));
            for (i64 j = lane; j < k; j += 32) o[j] = (int)j;
            continue;
        }
        unsigned long long eligible = ~0ull;
        if (groups > 1) {
            // Every lane keeps all group scores (the same values in each).
            double gs[MAX_GROUPS];
            for (i64 g = 0; g < groups; ++g) {
                double pv = 0, s = 0;
                i64 pi = -1;
                for (i64 j = 0; j < score_top; ++j) {
                    double bv;
                    i64 bi;
                    warp_pick(row, g * per_group, (g + 1) * per_group, per_group, ~0ull, pv, pi, bv, bi);
                    s += bv;
                    pv = bv;
                    pi = bi;
                }
                // +inf and -inf in one group sum to NaN: rank it last.
                gs[g] = isnan(s) ? -inf64() : s;
            }
            eligible = 0;
            double pv = 0;
            i64 pi = -1;
            for (i64 j = 0; j < keep_groups; ++j) {
                double bv = 0;
                i64 bi = -1;
                for (i64 g = 0; g < groups; ++g) {
                    if (pi >= 0 && !after(gs[g], g, pv, pi)) continue;
                    if (better(gs[g], g, bv, bi)) { bv = gs[g]; bi = g; }
                }
                eligible |= 1ull << bi;
                pv = bv;
                pi = bi;
            }
        }
        double pv = 0;
        i64 pi = -1;
        for (i64 j = 0; j < k; ++j) {
            double bv;
            i64 bi;
            warp_pick(row, 0, e, per_group, eligible, pv, pi, bv, bi);
            if (lane == 0) o[j] = (int)bi;
            pv = bv;
            pi = bi;
        }
    }
}
#define TOPK(sfx, T) \
    extern "C" __global__ void topk_##sfx(const T* x, int* out, i64 t, i64 e, i64 k, i64 groups, i64 per_group, i64 keep_groups, \
                                          i64 score_top, ErrRec* err, unsigned int code_nan) { pdl_enter(); \
        topk_impl<T>(x, out, t, e, k, groups, per_group, keep_groups, score_top, err, code_nan); }
FOR_FLOATS(TOPK)

// ---- gathers -----------------------------------------------------------------------

// out[t, j] = x[t, idx[t, j]] (0 for an invalid index).
template <typename T> __device__ void gather_cols_impl(const T* x, const int* idx, T* out, i64 t, i64 e, i64 k) {
    GRID_LOOP(p, t * k) {
        i64 c = idx[p];
        out[p] = (c >= 0 && c < e) ? x[(p / k) * e + c] : from_acc<T>((acc_t<T>)0);
    }
}
#define GATHER_COLS(sfx, T) \
    extern "C" __global__ void gather_cols_##sfx(const T* x, const int* idx, T* out, i64 t, i64 e, i64 k) { pdl_enter(); gather_cols_impl<T>(x, idx, out, t, e, k); }
FOR_FLOATS(GATHER_COLS)

// out[t, idx[t, j]] += v[t, j] over a zeroed out; one thread per row adds its
// k values in order.
template <typename T> __device__ void scatter_cols_impl(const T* v, const int* idx, T* out, i64 t, i64 k, i64 cols) {
    GRID_LOOP(r, t) {
        for (i64 j = 0; j < k; ++j) {
            i64 c = idx[r * k + j];
            if (c < 0 || c >= cols) continue;
            T* o = out + r * cols + c;
            *o = from_acc<T>(to_acc(*o) + to_acc(v[r * k + j]));
        }
    }
}
#define SCATTER_COLS(sfx, T) \
    extern "C" __global__ void scatter_cols_##sfx(const T* v, const int* idx, T* out, i64 t, i64 k, i64 cols) { pdl_enter(); scatter_cols_impl<T>(v, idx, out, t, k, cols); }
FOR_FLOATS(SCATTER_COLS)

// out[n] = x[src[n]] row by row; 0 where src[n] is -1 (or invalid).
// One block per output row (a row's elements by the block's threads), so
// no thread divides by D.
template <typename T> __device__ void gather_rows_impl(const T* x, const int* src, T* out, i64 n, i64 rows, i64 d) {
    for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
        i64 s = src[row];
        bool ok = s >= 0 && s < rows;
        if constexpr (sizeof(T) == 2) {
            if (d % 8 == 0) {  // 16-byte copies (rows are 16-byte aligned)
                const uint4* from = reinterpret_cast<const uint4*>(x + (ok ? s : 0) * d);
                uint4* to = reinterpret_cast<uint4*>(out + row * d);
                for (i64 c = threadIdx.x; c < d / 8; c += blockDim.x) to[c] = ok ? from[c] : make_uint4(0, 0, 0, 0);
                continue;
            }
        }
        for (i64 c = threadIdx.x; c < d; c += blockDim.x) out[row * d + c] = ok ? x[s * d + c] : from_acc<T>((acc_t<T>)0);
    }
}
#define GATHER_ROWS(sfx, T) \
    extern "C" __global__ void gather_rows_##sfx(const T* x, const int* src, T* out, i64 n, i64 rows, i64 d) { pdl_enter(); gather_rows_impl<T>(x, src, out, n, rows, d); }
FOR_FLOATS(GATHER_ROWS)

// ---- inverting an index map --------------------------------------------------------

extern "C" __global__ void inv_count(const int* src, i64 n, i64 targets, int* counts) { pdl_enter();
    GRID_LOOP(r, n) {
        i64 s = src[r];
        if (s >= 0 && s < targets) atomicAdd(&counts[s], 1);
    }
}

// Exclusive scan of counts[targets] into offsets[targets + 1], by one block
// of 1024 threads. Warp w owns a contiguous run of `per` counts (a multiple
// of 128, so its lanes read 4 consecutive counts each with one 16-byte
// load, a warp 128 at a time): the warps sum their runs, warp 0 scans the
// 32 totals, then each warp walks its run again, scanning 128 counts a step
// with shuffles and carrying the total. The previous version gave each
// thread a contiguous chunk (lanes 149 counts apart at the vocabulary's
// 151936), every load its own sector: ~0.3 ms a call.
__device__ __forceinline__ int4 inv_load4(const int* p, i64 i, i64 hi, bool vec) {
    if (vec && i + 3 < hi) return *reinterpret_cast<const int4*>(p + i);
    int4 v = make_int4(0, 0, 0, 0);
    if (i < hi) v.x = p[i];
    if (i + 1 < hi) v.y = p[i + 1];
    if (i + 2 < hi) v.z = p[i + 2];
    if (i + 3 < hi) v.w = p[i + 3];
    return v;
}
extern "C" __global__ void __launch_bounds__(1024) inv_scan(const int* counts, i64 targets, int* offsets) { pdl_enter();
    __shared__ int warp_base[32];
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    bool vec = ((reinterpret_cast<size_t>(counts) | reinterpret_cast<size_t>(offsets)) & 15) == 0;
    i64 per = ((targets + 31) / 32 + 127) / 128 * 128;
    i64 lo = w * per, hi = lo + per < targets ? lo + per : targets;
    int s = 0;
#pragma unroll 4
    for (i64 i = lo + lane * 4; i < hi; i += 128) {
        int4 c = inv_load4(counts, i, hi, vec);
        s += c.x + c.y + c.z + c.w;
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) warp_base[w] = s;
    __syncthreads();
    if (w == 0) {
        int own = warp_base[lane], incl = own;
        for (int o = 1; o < 32; o <<= 1) {
            int up = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += up;
        }
        warp_base[lane] = incl - own;
        if (lane == 31) offsets[targets] = incl;
    }
    __syncthreads();
    int run = warp_base[w];
#pragma unroll 4
    for (i64 i0 = lo; i0 < hi; i0 += 128) {
        i64 i = i0 + lane * 4;
        int4 c = inv_load4(counts, i, hi, vec);
        int own = c.x + c.y + c.z + c.w, incl = own;
        for (int o = 1; o < 32; o <<= 1) {
            int up = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += up;
        }
        int e = run + incl - own;
        int4 out = make_int4(e, e + c.x, e + c.x + c.y, e + c.x + c.y + c.z);
        if (vec && i + 3 < hi) {
            *reinterpret_cast<int4*>(offsets + i) = out;
        } else {
            if (i < hi) offsets[i] = out.x;
            if (i + 1 < hi) offsets[i + 1] = out.y;
            if (i + 2 < hi) offsets[i + 2] = out.z;
            if (i + 3 < hi) offsets[i + 3] = out.w;
        }
        run += __shfl_sync(0xffffffffu, incl, 31);
    }
}

// Places each source r in its target's segment, in row order (a stable
// counting sort; the old fill by atomics plus a sort per segment was
// quadratic in a segment's length, and an expert taking most of the tokens,
// as an untrained router does, made it milliseconds). The sources are cut
// into chunks of `ch` rows: cc[c * targets + t] first counts chunk c's
// sources of target t (inv_chunk_count), then becomes where they start, the
// target's offset plus the earlier chunks' counts (inv_chunk_base), and one
// warp per chunk places its sources 32 rows at a time (inv_chunk_place): the
// lanes of a group that share a target rank themselves by lane, then the
// lowest of them advances the target's start.
extern "C" __global__ void inv_chunk_count(const int* src, i64 n, i64 targets, i64 ch, int* cc) { pdl_enter();
    GRID_LOOP(r, n) {
        i64 s = src[r];
        if (s >= 0 && s < targets) atomicAdd(&cc[(r / ch) * targets + s], 1);
    }
}

// A target's counts are read INV_BASE_BATCH chunks at a time before any of
// them is overwritten: one dependent load after another (the store before
// the next load keeps the compiler from hoisting it) took ~1 µs a chunk.
#define INV_BASE_BATCH 16
extern "C" __global__ void inv_chunk_base(const int* offsets, i64 targets, i64 chunks, int* cc) { pdl_enter();
    GRID_LOOP(t, targets) {
        int run = offsets[t];
        for (i64 c0 = 0; c0 < chunks; c0 += INV_BASE_BATCH) {
            int k[INV_BASE_BATCH];
#pragma unroll
            for (int u = 0; u < INV_BASE_BATCH; ++u) k[u] = c0 + u < chunks ? cc[(c0 + u) * targets + t] : 0;
#pragma unroll
            for (int u = 0; u < INV_BASE_BATCH; ++u) {
                if (c0 + u < chunks) cc[(c0 + u) * targets + t] = run;
                run += k[u];
            }
        }
    }
}

extern "C" __global__ void inv_chunk_place(const int* src, i64 n, i64 targets, i64 ch, i64 chunks, int* cc,
                                           int* items) { pdl_enter();
    unsigned lane = threadIdx.x & 31, below = (1u << lane) - 1;
    for (i64 c = warp_row0(); c < chunks; c += warp_count()) {
        i64 lo = c * ch, hi = lo + ch < n ? lo + ch : n;
        int* start = cc + c * targets;
        for (i64 r0 = lo; r0 < hi; r0 += 32) {
            i64 r = r0 + lane;
            int s = -1;
            if (r < hi) {
                int v = src[r];
                if (v >= 0 && v < targets) s = v;
            }
            unsigned same = __match_any_sync(0xffffffffu, s);
            if (s >= 0) items[start[s] + __popc(same & below)] = (int)r;
            __syncwarp();  // every lane has read its target's start
            if (s >= 0 && (same & below) == 0) start[s] += __popc(same);
            __syncwarp();
        }
    }
}

// out[i, c] = Σ over the sources r of target i (in order) of
// scale(r) · src[r / kdiv, c], scale(r) = w[r] when w is given, else 1.
// One block per target row. A row's sources (up to SEG_CACHE, the common
// case: top-k copies or one) have their row offsets and scales staged in
// shared memory once, so the column loop does no index arithmetic.
#define SEG_CACHE 64
template <typename T>
__device__ void seg_sum_impl(const T* src, const T* w, const int* offsets, const int* items, T* out, i64 targets, i64 d, i64 kdiv) {
    typedef acc_t<T> A;
    __shared__ i64 base[SEG_CACHE];
    __shared__ A scl[SEG_CACHE];
    for (i64 i = blockIdx.x; i < targets; i += gridDim.x) {
        int lo = offsets[i], len = offsets[i + 1] - lo;
        if (len <= SEG_CACHE) {
            __syncthreads();  // the previous row's readers are done
            for (int q = threadIdx.x; q < len; q += blockDim.x) {
                i64 r = items[lo + q];
                base[q] = (r / kdiv) * d;
                scl[q] = w ? to_acc(w[r]) : (A)1;
            }
            __syncthreads();
            if constexpr (sizeof(T) == 2) {
                if (d % 8 == 0) {  // eight columns per thread, 16-byte accesses
                    for (i64 c = threadIdx.x * 8; c < d; c += blockDim.x * 8) {
                        float s[8] = {0, 0, 0, 0, 0, 0, 0, 0}, v[8];
                        for (int q = 0; q < len; ++q) {
                            load8f(src + base[q] + c, v);
                            for (int u = 0; u < 8; ++u) s[u] += scl[q] * v[u];
                        }
                        store8f(out + i * d + c, s);
                    }
                    continue;
                }
            }
            for (i64 c = threadIdx.x; c < d; c += blockDim.x) {
                A s = 0;
                for (int q = 0; q < len; ++q) s += scl[q] * to_acc(src[base[q] + c]);
                out[i * d + c] = from_acc<T>(s);
            }
        } else {
            for (i64 c = threadIdx.x; c < d; c += blockDim.x) {
                A s = 0;
                for (int q = lo; q < lo + len; ++q) {
                    i64 r = items[q];
                    A sc = w ? to_acc(w[r]) : (A)1;
                    s += sc * to_acc(src[(r / kdiv) * d + c]);
                }
                out[i * d + c] = from_acc<T>(s);
            }
        }
    }
}
#define SEG_SUM(sfx, T) \
    extern "C" __global__ void seg_sum_##sfx(const T* src, const T* w, const int* offsets, const int* items, T* out, i64 targets, i64 d, i64 kdiv) { pdl_enter(); \
        seg_sum_impl<T>(src, w, offsets, items, out, targets, d, kdiv); }
FOR_FLOATS(SEG_SUM)

// ---- routing plans -------------------------------------------------------------------

// Dropless: row `row` of the expert-major order takes copy items[row]; rows
// past the placed total (only if idx held invalid experts, reported) get -1,
// as do those copies' slots (slot arrives filled with -1).
extern "C" __global__ void plan_fill(const int* offsets, const int* items, i64 n, i64 k, i64 experts, int* row_src, int* slot, int* counts) { pdl_enter();
    i64 total = offsets[experts];
    GRID_LOOP(p, n > experts ? n : experts) {
        if (p < n) {
            if (p < total) {
                int copy = items[p];
                row_src[p] = (int)(copy / k);
                slot[copy] = (int)p;
            } else {
                row_src[p] = -1;
            }
        }
        if (p < experts) counts[p] = offsets[p + 1] - offsets[p];
    }
}

// Capacity (row_src and slot arrive filled with -1): one thread per expert keeps min(count, capacity) of its copies
// (the earliest, or the most probable with the earlier copy on ties), in
// (token, choice) order, at rows from e·capacity (pad) or after the kept
// rows of the experts before it.
template <typename T>
__device__ void cap_place_impl(const T* probs, const int* offsets, const int* items, i64 experts, i64 k, i64 capacity,
                               int by_probs, int pad, int* row_src, int* slot, int* counts) {
    GRID_LOOP(e, experts) {
        i64 lo = offsets[e], hi = offsets[e + 1], len = hi - lo;
        i64 kept = len < capacity ? len : capacity;
        i64 base = e * capacity;
        if (!pad) {
            base = 0;
            for (i64 f = 0; f < e; ++f) {
                i64 l = offsets[f + 1] - offsets[f];
                base += l < capacity ? l : capacity;
            }
        }
        counts[e] = (int)(pad ? capacity : kept);
        // The last kept copy in the (prob desc, copy asc) order: a copy is
        // kept iff it is not after it.
        double tv = inf64();
        i64 ti = -1;
        bool all = !by_probs || len <= capacity;
        if (!all) {
            double pv = 0;
            i64 pi = -1;
            for (i64 j = 0; j < kept; ++j) {
                double bv = 0;
                i64 bi = -1;
                for (i64 q = lo; q < hi; ++q) {
                    i64 c = items[q];
                    double v = to_f64(probs[c]);
                    if (pi >= 0 && !after(v, c, pv, pi)) continue;
                    if (better(v, c, bv, bi)) { bv = v; bi = c; }
                }
                pv = bv;
                pi = bi;
            }
            tv = pv;
            ti = pi;
        }
        i64 row = base, taken = 0;
        for (i64 q = lo; q < hi && taken < kept; ++q) {
            i64 c = items[q];
            if (!all && after(to_f64(probs[c]), c, tv, ti)) continue;
            row_src[row] = (int)(c / k);
            slot[c] = (int)row;
            ++row;
            ++taken;
        }
    }
}
#define CAP_PLACE(sfx, T) \
    extern "C" __global__ void cap_place_##sfx(const T* probs, const int* offsets, const int* items, i64 experts, i64 k, i64 capacity, \
                                               int by_probs, int pad, int* row_src, int* slot, int* counts) { pdl_enter(); \
        cap_place_impl<T>(probs, offsets, items, experts, k, capacity, by_probs, pad, row_src, slot, counts); }
FOR_FLOATS(CAP_PLACE)

// ---- combine -----------------------------------------------------------------------

// out[t, c] = Σ_j y[slot[t, j], c] over kept copies, j in order (the routing
// weights are already in y: the experts' weighted SwiGLU applied them).
template <typename T> __device__ void unpermute_impl(const T* y, const int* slot, T* out, i64 t, i64 k, i64 n, i64 d) {
    typedef acc_t<T> A;
    for (i64 tok = blockIdx.x; tok < t; tok += gridDim.x) {
        if constexpr (sizeof(T) == 2) {
            if (d % 8 == 0) {  // eight columns per thread, 16-byte accesses
                for (i64 c = threadIdx.x * 8; c < d; c += blockDim.x * 8) {
                    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0}, v[8];
                    for (i64 j = 0; j < k; ++j) {
                        i64 r = slot[tok * k + j];
                        if (r < 0 || r >= n) continue;
                        load8f(y + r * d + c, v);
                        for (int u = 0; u < 8; ++u) s[u] += v[u];
                    }
                    store8f(out + tok * d + c, s);
                }
                continue;
            }
        }
        for (i64 c = threadIdx.x; c < d; c += blockDim.x) {
            A s = 0;
            for (i64 j = 0; j < k; ++j) {
                i64 r = slot[tok * k + j];
                if (r < 0 || r >= n) continue;
                s += to_acc(y[r * d + c]);
            }
            out[tok * d + c] = from_acc<T>(s);
        }
    }
}
#define UNPERMUTE(sfx, T) \
    extern "C" __global__ void unpermute_##sfx(const T* y, const int* slot, T* out, i64 t, i64 k, i64 n, i64 d) { pdl_enter(); \
        unpermute_impl<T>(y, slot, out, t, k, n, d); }
FOR_FLOATS(UNPERMUTE)

// The routing weights in permuted order: p[slot[c]] = w[c] for every kept copy
// c (p arrives zeroed: rows without a copy keep 0; a plan places at most one
// copy at a row).
template <typename T> __device__ void permute_w_impl(const T* w, const int* slot, i64 copies, i64 n, T* p) {
    GRID_LOOP(c, copies) {
        i64 r = slot[c];
        if (r >= 0 && r < n) p[r] = w[c];
    }
}
// Its backward: dw[c] = dp[slot[c]], 0 for a dropped copy.
template <typename T> __device__ void permute_w_bwd_impl(const T* dp, const int* slot, i64 copies, i64 n, T* dw) {
    GRID_LOOP(c, copies) {
        i64 r = slot[c];
        dw[c] = r >= 0 && r < n ? dp[r] : from_acc<T>((acc_t<T>)0);
    }
}
#define PERMUTE_W(sfx, T) \
    extern "C" __global__ void permute_w_##sfx(const T* w, const int* slot, i64 copies, i64 n, T* p) { pdl_enter(); \
        permute_w_impl<T>(w, slot, copies, n, p); } \
    extern "C" __global__ void permute_w_bwd_##sfx(const T* dp, const int* slot, i64 copies, i64 n, T* dw) { pdl_enter(); \
        permute_w_bwd_impl<T>(dp, slot, copies, n, dw); }
FOR_FLOATS(PERMUTE_W)
