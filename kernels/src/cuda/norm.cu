// RMSNorm (forward and backward) and rotary position embedding.
// Shape letters: R rows, D normalised dim, B batch, S sequence, H heads,
// Hd head dim.

// y = x · rstd · w per row, rstd = 1/sqrt(mean(x²) + eps); one block per row.
// The mean of squares is accumulated in f64, as on the CPU.
template <typename T>
__device__ void rmsnorm_fwd_impl(const T* x, const T* w, T* y, T* rstd, i64 r, i64 d, double eps) {
    typedef acc_t<T> A;
    __shared__ double sh[32];
    for (i64 row = blockIdx.x; row < r; row += gridDim.x) {
        const T* xr = x + row * d;
        double s = 0;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            double v = to_f64(xr[j]);
            s += v * v;
        }
        s = block_sum(s, sh);
        A k = (A)(1.0 / sqrt(s / (double)d + eps));
        for (i64 j = threadIdx.x; j < d; j += blockDim.x)
            y[row * d + j] = from_acc<T>(to_acc(xr[j]) * k * to_acc(w[j]));
        if (threadIdx.x == 0) rstd[row] = from_acc<T>(k);
    }
}
#define RMSNORM_FWD(sfx, T) \
    extern "C" __global__ void rmsnorm_fwd_##sfx(const T* x, const T* w, T* y, T* rstd, i64 r, i64 d, double eps) { pdl_enter(); \
        rmsnorm_fwd_impl<T>(x, w, y, rstd, r, d, eps); }
FOR_FLOATS(RMSNORM_FWD)

// dx = k·w⊙dy − x·k³/D·Σ(dy⊙w⊙x) per row (k = rstd); one block per row.
template <typename T>
__device__ void rmsnorm_dx_impl(const T* dy, const T* x, const T* w, const T* rstd, T* dx, i64 r, i64 d) {
    typedef acc_t<T> A;
    __shared__ A sh[32];
    for (i64 row = blockIdx.x; row < r; row += gridDim.x) {
        const T* xr = x + row * d;
        const T* dr = dy + row * d;
        A s = 0;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) s += to_acc(dr[j]) * to_acc(w[j]) * to_acc(xr[j]);
        s = block_sum(s, sh);
        A k = to_acc(rstd[row]);
        A c = s * k * k * k / (A)d;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x)
            dx[row * d + j] = from_acc<T>(k * to_acc(w[j]) * to_acc(dr[j]) - to_acc(xr[j]) * c);
    }
}
#define RMSNORM_DX(sfx, T) \
    extern "C" __global__ void rmsnorm_dx_##sfx(const T* dy, const T* x, const T* w, const T* rstd, T* dx, i64 r, i64 d) { pdl_enter(); \
        rmsnorm_dx_impl<T>(dy, x, w, rstd, dx, r, d); }
FOR_FLOATS(RMSNORM_DX)

// bf16 rows of a length D that is a multiple of 8, at 16-byte aligned
// addresses: one warp per row, each lane taking 8 consecutive values per
// 16-byte load (the block-per-row kernels above left most of a 256-thread
// block idle on the attention's per-head q / k norms, rows of 128, and read
// 2 bytes per load). The same expressions as rmsnorm_fwd_impl /
// rmsnorm_dx_impl; only the order of the row sums differs (lane-strided,
// then a butterfly).

extern "C" __global__ void rmsnorm_fwd_rows8_bf16(const bf16* x, const bf16* w, bf16* y, bf16* rstd, i64 r, i64 d,
                                                   double eps) { pdl_enter();
    int lane = threadIdx.x & 31;
    i64 chunks = d >> 3;
    for (i64 row = warp_row0(); row < r; row += warp_count()) {
        const bf16* xr = x + row * d;
        double s = 0;
        for (i64 c = lane; c < chunks; c += 32) {
            float v[8];
            load8f(xr + 8 * c, v);
#pragma unroll
            for (int u = 0; u < 8; ++u) s += (double)v[u] * (double)v[u];
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        float k = (float)(1.0 / sqrt(s / (double)d + eps));
        for (i64 c = lane; c < chunks; c += 32) {
            float v[8], wv[8], out[8];
            load8f(xr + 8 * c, v);
            load8f(w + 8 * c, wv);
#pragma unroll
            for (int u = 0; u < 8; ++u) out[u] = v[u] * k * wv[u];
            store8f(y + row * d + 8 * c, out);
        }
        if (lane == 0) rstd[row] = __float2bfloat16_rn(k);
    }
}

extern "C" __global__ void rmsnorm_dx_rows8_bf16(const bf16* dy, const bf16* x, const bf16* w, const bf16* rstd,
                                                  bf16* dx, i64 r, i64 d) { pdl_enter();
    int lane = threadIdx.x & 31;
    i64 chunks = d >> 3;
    for (i64 row = warp_row0(); row < r; row += warp_count()) {
        const bf16* xr = x + row * d;
        const bf16* dr = dy + row * d;
        float s = 0;
        for (i64 c = lane; c < chunks; c += 32) {
            float xv[8], dv[8], wv[8];
            load8f(xr + 8 * c, xv);
            load8f(dr + 8 * c, dv);
            load8f(w + 8 * c, wv);
#pragma unroll
            for (int u = 0; u < 8; ++u) s += dv[u] * wv[u] * xv[u];
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        float k = __bfloat162float(rstd[row]);
        float cc = s * k * k * k / (float)d;
        for (i64 c = lane; c < chunks; c += 32) {
            float xv[8], dv[8], wv[8], out[8];
            load8f(xr + 8 * c, xv);
            load8f(dr + 8 * c, dv);
            load8f(w + 8 * c, wv);
#pragma unroll
            for (int u = 0; u < 8; ++u) out[u] = k * wv[u] * dv[u] - xv[u] * cc;
            store8f(dx + row * d + 8 * c, out);
        }
    }
}

// dw[c] = Σ_rows dy·x·rstd, in two deterministic passes so the rows spread
// over many blocks: block (column tile, chunk) writes the partial sum of its
// chunk of `per` rows, then the finish adds the chunks in order.
template <typename T>
__device__ void rmsnorm_dw_part_impl(const T* dy, const T* x, const T* rstd, acc_t<T>* part, i64 r, i64 d, i64 per) {
    typedef acc_t<T> A;
    __shared__ A sh[8][33];
    i64 col = (i64)blockIdx.x * 32 + threadIdx.x;
    i64 lo = (i64)blockIdx.y * per, hi = lo + per < r ? lo + per : r;
    A s = 0;
    if (col < d)
        for (i64 row = lo + threadIdx.y; row < hi; row += 8)
            s += to_acc(dy[row * d + col]) * to_acc(x[row * d + col]) * to_acc(rstd[row]);
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < d) {
        A t = 0;
        for (int k = 0; k < 8; ++k) t += sh[k][threadIdx.x];
        part[(i64)blockIdx.y * d + col] = t;
    }
}
#define RMSNORM_DW_PART(sfx, T) \
    extern "C" __global__ void rmsnorm_dw_part_##sfx(const T* dy, const T* x, const T* rstd, acc_t<T>* part, i64 r, i64 d, i64 per) { pdl_enter(); \
        rmsnorm_dw_part_impl<T>(dy, x, rstd, part, r, d, per); }
FOR_FLOATS(RMSNORM_DW_PART)

// The finish: a block of 32 columns × 16 lanes of chunks, lane y adding the
// chunks y, y + 16, ... in order, then the 16 lane sums in order (a thread
// per column adding thousands of chunks, the q/k norms' 2048 for 128
// columns, left all but a few warps of the GPU idle).
template <typename T> __device__ void rmsnorm_dw_finish_impl(const acc_t<T>* part, T* dw, i64 chunks, i64 d) {
    typedef acc_t<T> A;
    __shared__ A sh[16][33];
    i64 col = (i64)blockIdx.x * 32 + threadIdx.x;
    A t = 0;
    if (col < d)
#pragma unroll 4
        for (i64 c = threadIdx.y; c < chunks; c += 16) t += part[c * d + col];
    sh[threadIdx.y][threadIdx.x] = t;
    __syncthreads();
    if (threadIdx.y == 0 && col < d) {
        A u = 0;
        for (int k = 0; k < 16; ++k) u += sh[k][threadIdx.x];
        dw[col] = from_acc<T>(u);
    }
}
#define RMSNORM_DW_FINISH(sfx, T) \
    extern "C" __global__ void rmsnorm_dw_finish_##sfx(const acc_t<T>* part, T* dw, i64 chunks, i64 d) { pdl_enter(); \
        rmsnorm_dw_finish_impl<T>(part, dw, chunks, d); }
FOR_FLOATS(RMSNORM_DW_FINISH)

// Rotate-half RoPE over x [B, S, H, Hd]: channel i < Hd/2 pairs with
// i + Hd/2 and both turn by pos·f_i, the angle formed in f64; pos is s, or
// positions[b, s] when given (non-null). f_i = θ^(−2i/Hd), blended by
// YaRN's ramp r_i = clamp((i − low)/(high − low), 0, 1) as f_i/factor·r_i +
// f_i·(1 − r_i) (factor 1, low 0, high 1 leave it f_i); cos and sin are
// multiplied by amp.
// A block per token (grid-stride): each thread takes one i and turns it
// in every head h ≡ g (mod blockDim / (Hd/2)), so the angle and its cos and
// sin are formed once per (token, i) rather than once per head (a thread
// per pair recomputed them H times: the op was instruction-bound at ~4×
// its memory time with Qwen3's 32 query heads).
// The inverse frequencies θ^(−2i/Hd) are formed once per block in shared
// memory (ROPE_FREQS of them; per pair past that). For f32 and bf16 the
// angle is reduced to [−π, π] in f64 and turned by the f32 sincos (error
// ~1e-7, below f32 resolution of the result); f64 keeps f64 sin and cos.
#define ROPE_FREQS 512
__device__ __forceinline__ double rope_freq(i64 i, i64 hd, double theta, double factor, double low, double high) {
    double f = pow(theta, -2.0 * (double)i / (double)hd);
    double r = fmin(fmax(((double)i - low) / (high - low), 0.0), 1.0);
    return f / factor * r + f * (1.0 - r);
}
template <typename T>
__device__ void rope_impl(const T* x, T* out, const int* positions, i64 s, i64 h, i64 hd, double theta, double sign,
                          double factor, double low, double high, double amp, i64 pairs) {
    typedef acc_t<T> A;
    __shared__ double freqs[ROPE_FREQS];
    i64 half = hd / 2;
    for (i64 i = threadIdx.x; i < half && i < ROPE_FREQS; i += blockDim.x)
        freqs[i] = rope_freq(i, hd, theta, factor, low, high);
    __syncthreads();
    i64 tokens = pairs / (h * half), groups = (i64)blockDim.x >= half ? (i64)blockDim.x / half : 1;
    for (i64 tok = blockIdx.x; tok < tokens; tok += gridDim.x) {
        i64 pos = positions ? (i64)positions[tok] : tok % s;
        for (i64 u = threadIdx.x; u < half * groups; u += blockDim.x) {
            i64 i = u % half, g = u / half;
            double f = i < ROPE_FREQS ? freqs[i] : rope_freq(i, hd, theta, factor, low, high);
            double a = (double)pos * f;
            A c, sn;
            if constexpr (sizeof(A) == 8) {
                c = amp * cos(a);
                sn = amp * sign * sin(a);
            } else {
                const double two_pi = 6.283185307179586;
                float r = (float)(a - two_pi * rint(a / two_pi)), sf, cf;
                sincosf(r, &sf, &cf);
                c = (float)amp * cf;
                sn = (float)(amp * sign) * sf;
            }
            for (i64 hh = g; hh < h; hh += groups) {
                i64 at = (tok * h + hh) * hd;
                A x1 = to_acc(x[at + i]), x2 = to_acc(x[at + i + half]);
                out[at + i] = from_acc<T>(x1 * c - x2 * sn);
                out[at + i + half] = from_acc<T>(x2 * c + x1 * sn);
            }
        }
    }
}
#define ROPE(sfx, T) \
    extern "C" __global__ void rope_##sfx(const T* x, T* out, const int* positions, i64 s, i64 h, i64 hd, double theta, \
                                          double sign, double factor, double low, double high, double amp, i64 pairs) { pdl_enter(); \
        rope_impl<T>(x, out, positions, s, h, hd, theta, sign, factor, low, high, amp, pairs); }
FOR_FLOATS(ROPE)
