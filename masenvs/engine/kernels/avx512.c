// The embedded engine's native CPU kernels (x86-64 with AVX-512 BF16), called through
// ctypes by __init__.py: weight-only 4- and 8-bit matmuls, then decode attention, LoRA,
// RMSNorm and SwiGLU further down.
//
//   int4_matmul: y[M, N] = x[M, K] @ W^T,  W[n, k] = q[n, k] * s[n, g] + z[n, g],  g = k / 32,
//                q in 0..15 (a GGUF Q4_1 block stores exactly this)
//   int8_matmul: the same with q in -127..127 and z = 0 (a GGUF Q8_0 block)
//
// x and y bfloat16, s and z float16. Built and loaded at run time by __init__.py,
// which also packs the weights:
//
//   int4 q: uint16 [N/16, G, 4, 16, 2]; word (t, g, r, j, e) holds in its nibble c the
//           level q[16t + j, 32g + 2(4r + c) + e]
//   int8 q: int8 [N/16, G, 16, 16, 2]; byte (t, g, p, j, e) is q[16t + j, 32g + 2p + e]
//   s, z: float16 [N/16, G, 16]
//
// Each fp32 lane of a vector is one output column n. A 4-bit level v becomes the bfloat16
// 128 + v by OR-ing its bits into 0x4300 (bfloat16 128.0), so one vdpbf16ps multiplies 16
// columns by two inputs k, k+1 at once; the 128 offset is taken back per group with the
// group's input sum: sum_k x (q s + z) = s * sum_k x (128 + q) + (z - 128 s) * sum_k x.
// Products of bfloat16 values are exact in fp32, and the sums are fp32. 8-bit levels go
// through fp32 into bfloat16, where integers up to 256 are exact.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16   // output columns per vector
#define GROUP 32  // inputs per scale
#define ROWS 8    // batch rows per pass over a tile's weights

// acc[m] += w . (x[m, k], x[m, k + 1]) for each of the rows: one vdpbf16ps per row, 16
// output columns (the fp32 lanes) at once.
static inline __attribute__((always_inline)) void dot_pairs(
    __m512 *acc, __m512bh w, const uint16_t *xr, int K, int k, const int rows) {
    for (int m = 0; m < rows; m++) {
        int32_t pair;
        memcpy(&pair, xr + (size_t)m * K + k, sizeof pair);
        acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32(pair));
    }
}

static inline __attribute__((always_inline)) void store_rows(
    uint16_t *y, const __m512 *total, int m0, const int rows, int N, int t) {
    for (int m = 0; m < rows; m++)
        _mm256_storeu_si256((__m256i *)(y + (size_t)(m0 + m) * N + (size_t)t * TILE),
                            (__m256i)_mm512_cvtneps_pbh(total[m]));
}

static inline __attribute__((always_inline)) void tile(
    const uint16_t *x, const float *xsum, const uint16_t *q, const uint16_t *s,
    const uint16_t *z, uint16_t *y, int m0, const int rows, int K, int N, int t) {
    const int G = K / GROUP;
    const __m512i low_nibble = _mm512_set1_epi32(0x000F000F);
    const __m512i bf16_128 = _mm512_set1_epi32(0x43004300);
    const __m512 c128 = _mm512_set1_ps(128.0f);
    const uint16_t *qt = q + (size_t)t * G * 128;
    const uint16_t *xr = x + (size_t)m0 * K;
    __m512 total[ROWS];
    for (int m = 0; m < rows; m++) total[m] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512 acc[ROWS];
        for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
        for (int r = 0; r < 4; r++) {
            const __m512i packed = _mm512_loadu_si512(qt + (size_t)g * 128 + r * 32);
            for (int c = 0; c < 4; c++) {
                const __m512i shifted = c ? _mm512_srli_epi16(packed, 4 * c) : packed;
                // (shifted & 0x000F) | 0x4300 in each 16-bit word: bfloat16 128 + level
                const __m512bh w =
                    (__m512bh)_mm512_ternarylogic_epi32(shifted, low_nibble, bf16_128, 0xEA);
                dot_pairs(acc, w, xr, K, g * GROUP + 2 * (4 * r + c), rows);
            }
        }
        const size_t at = ((size_t)t * G + g) * TILE;
        const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + at)));
        const __m512 zv = _mm512_fnmadd_ps(
            sv, c128, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(z + at))));
        for (int m = 0; m < rows; m++) {
            total[m] = _mm512_fmadd_ps(acc[m], sv, total[m]);
            total[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[(m0 + m) * G + g]), zv, total[m]);
        }
    }
    store_rows(y, total, m0, rows, N, t);
}

static float group_sum(const uint16_t *x) {
    const __m256i *p = (const __m256i *)x;
    __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
    __m512 b =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p + 1)), 16));
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}

#define CASE(R) \
    case R: tile(x, xsum, q, s, z, y, m0, R, K, N, t); break;

// Returns 0, or -1 if the shapes are not supported (N % 16, K % 32) or memory ran out.
int int4_matmul(const uint16_t *x, const uint16_t *q, const uint16_t *s, const uint16_t *z,
                uint16_t *y, int M, int K, int N) {
    if (M <= 0 || K <= 0 || N <= 0 || K % GROUP || N % TILE) return -1;
    const int G = K / GROUP;
    float *xsum = malloc(sizeof(float) * (size_t)M * G);
    if (!xsum) return -1;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) xsum[m * G + g] = group_sum(x + (size_t)m * K + g * GROUP);
    const int tiles = N / TILE;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++)
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            switch (M - m0 < ROWS ? M - m0 : ROWS) {
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
            }
        }
    free(xsum);
    return 0;
}

static inline __attribute__((always_inline)) void tile8(
    const uint16_t *x, const int8_t *q, const uint16_t *s, uint16_t *y, int m0,
    const int rows, int K, int N, int t) {
    const int G = K / GROUP;
    const int8_t *qt = q + (size_t)t * G * 512;
    const uint16_t *xr = x + (size_t)m0 * K;
    __m512 total[ROWS];
    for (int m = 0; m < rows; m++) total[m] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512 acc[ROWS];
        for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
        for (int p = 0; p < 16; p++) {
            const int8_t *qp = qt + (size_t)g * 512 + p * 32;
            // columns 0-7 (inputs k, k+1 each) from the first 16 bytes, 8-15 from the next
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qp)));
            const __m512 hi =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qp + 16))));
            const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
            dot_pairs(acc, w, xr, K, g * GROUP + 2 * p, rows);
        }
        const __m512 sv = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(s + ((size_t)t * G + g) * TILE)));
        for (int m = 0; m < rows; m++) total[m] = _mm512_fmadd_ps(acc[m], sv, total[m]);
    }
    store_rows(y, total, m0, rows, N, t);
}

#define CASE8(R) \
    case R: tile8(x, q, s, y, m0, R, K, N, t); break;

int int8_matmul(const uint16_t *x, const int8_t *q, const uint16_t *s, uint16_t *y, int M,
                int K, int N) {
    if (M <= 0 || K <= 0 || N <= 0 || K % GROUP || N % TILE) return -1;
    const int tiles = N / TILE;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++)
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            switch (M - m0 < ROWS ? M - m0 : ROWS) {
                CASE8(1) CASE8(2) CASE8(3) CASE8(4) CASE8(5) CASE8(6) CASE8(7) CASE8(8)
            }
        }
    return 0;
}

// ---- decode attention ------------------------------------------------------------------
//
// One new token per row b, in cache slot slots[b] (slot b when slots is NULL): write its
// key and value at position positions[b] (unless `write` is 0: a prefill stored them
// already), then attend over positions 0..positions[b] of the slot. Grouped-query
// attention: query head h * groups + i reads KV head h. bfloat16 in and out, fp32 inside.
// A row's result depends on its own query and cached keys only, never on the other rows
// or the thread count: the batch-invariant prefill runs every prompt token through here.
//
//   qk:  [B, (n_kv * groups + n_kv) * D] rows of qk_stride elements: the B rows' queries
//        (after rotary embedding), then their new keys
//   v:   [B, n_kv * D] rows of v_stride elements: the new values
//   k_cache: [slots, n_kv, D, capacity] (keys transposed); v_cache: [slots, n_kv, capacity, D]
//   out: [B, n_kv * groups * D]

static inline __m512 bf16_to_ps(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load_bf16(const uint16_t *p, __mmask16 mask) {
    return bf16_to_ps(_mm256_maskz_loadu_epi16(mask, p));
}

static inline float bf16_scalar(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

// e^x for x <= 0 (Cephes' expf polynomial on x - n ln2, scaled by 2^n): ~1 ulp.
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

int decode_attention(const uint16_t *qk, int qk_stride, const uint16_t *v, int v_stride,
                     uint16_t *k_cache, uint16_t *v_cache, const int64_t *positions,
                     const int64_t *slots, int write, uint16_t *out, int B, int n_kv,
                     int groups, int D, int capacity, float scale) {
    if (B <= 0 || n_kv <= 0 || groups <= 0 || D <= 0 || D % 16) return -1;
    for (int b = 0; b < B; b++)
        if (positions[b] < 0 || positions[b] >= capacity || (slots && slots[b] < 0)) return -1;
    const int heads = n_kv * groups;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(capacity + 16));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int task = 0; task < B * n_kv; task++) {
            if (!scores) continue;
            const int b = task / n_kv, h = task % n_kv;
            const int64_t pos = positions[b];
            const int len = (int)pos + 1;
            const size_t slot = slots ? (size_t)slots[b] : (size_t)b;
            uint16_t *keys = k_cache + (slot * n_kv + h) * D * capacity;
            uint16_t *values = v_cache + (slot * n_kv + h) * capacity * D;
            const uint16_t *row = qk + (size_t)b * qk_stride;
            if (write) {
                const uint16_t *new_key = row + (size_t)(heads + h) * D;
                for (int d = 0; d < D; d++) keys[(size_t)d * capacity + pos] = new_key[d];
                memcpy(values + (size_t)pos * D, v + (size_t)b * v_stride + (size_t)h * D,
                       2 * (size_t)D);
            }
            for (int i = 0; i < groups; i++) {
                const uint16_t *query = row + (size_t)(h * groups + i) * D;
                // scores[p] = scale * q . k_p, 16 positions at a time
                __m512 peak = _mm512_set1_ps(-INFINITY);
                for (int p0 = 0; p0 < len; p0 += 16) {
                    const __mmask16 mask = len - p0 >= 16 ? 0xFFFF : (__mmask16)((1u << (len - p0)) - 1);
                    __m512 acc = _mm512_setzero_ps();
                    for (int d = 0; d < D; d++)
                        acc = _mm512_fmadd_ps(_mm512_set1_ps(bf16_scalar(query[d])),
                                              load_bf16(keys + (size_t)d * capacity + p0, mask), acc);
                    acc = _mm512_mul_ps(acc, _mm512_set1_ps(scale));
                    _mm512_mask_storeu_ps(scores + p0, mask, acc);
                    peak = _mm512_mask_max_ps(peak, mask, peak, acc);
                }
                const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
                __m512 sums = _mm512_setzero_ps();
                for (int p0 = 0; p0 < len; p0 += 16) {
                    const __mmask16 mask = len - p0 >= 16 ? 0xFFFF : (__mmask16)((1u << (len - p0)) - 1);
                    __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + p0), top));
                    e = _mm512_maskz_mov_ps(mask, e);
                    _mm512_mask_storeu_ps(scores + p0, mask, e);
                    sums = _mm512_add_ps(sums, e);
                }
                const float norm = 1.0f / _mm512_reduce_add_ps(sums);
                uint16_t *dst = out + (size_t)b * heads * D + (size_t)(h * groups + i) * D;
                for (int d0 = 0; d0 < D; d0 += 16) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int p = 0; p < len; p++)
                        acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[p]),
                                              load_bf16(values + (size_t)p * D + d0, 0xFFFF), acc);
                    acc = _mm512_mul_ps(acc, _mm512_set1_ps(norm));
                    _mm256_storeu_si256((__m256i *)(dst + d0), (__m256i)_mm512_cvtneps_pbh(acc));
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

// ---- LoRA ------------------------------------------------------------------------------
//
// y[m] += (x[m] A^T) B for the selected rows m, in place: x [M, K] and y [M, N] bfloat16,
// A [R, K] and B [R, N] float32 (B is the adapter's scaled B, transposed). Rows: `count`
// rows from `start`, or rows[0..count) when `rows` is not NULL. Each y value is rounded
// to bfloat16 once, after the fp32 delta is added.

static inline float dot_bf16_f32(const uint16_t *x, const float *a, int K) {
    __m512 acc = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16)
        acc = _mm512_fmadd_ps(load_bf16(x + k, 0xFFFF), _mm512_loadu_ps(a + k), acc);
    if (k < K) {
        const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
        acc = _mm512_fmadd_ps(load_bf16(x + k, mask), _mm512_maskz_loadu_ps(mask, a + k), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

int lora_add(uint16_t *y, const uint16_t *x, const int64_t *rows, int start, int count,
             const float *a, const float *b, int M, int K, int N, int R) {
    if (count < 0 || K <= 0 || N <= 0 || R <= 0 || R > 1024) return -1;
    for (int i = 0; i < count; i++) {
        const int64_t m = rows ? rows[i] : (int64_t)start + i;
        if (m < 0 || m >= M) return -1;
    }
#pragma omp parallel for schedule(static) if (count > 1)
    for (int i = 0; i < count; i++) {
        const int64_t m = rows ? rows[i] : (int64_t)start + i;
        const uint16_t *xm = x + (size_t)m * K;
        uint16_t *ym = y + (size_t)m * N;
        float t[1024];
        for (int r = 0; r < R; r++) t[r] = dot_bf16_f32(xm, a + (size_t)r * K, K);
        for (int n0 = 0; n0 < N; n0 += 16) {
            const __mmask16 mask = N - n0 >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
            __m512 acc = load_bf16(ym + n0, mask);
            for (int r = 0; r < R; r++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(t[r]), _mm512_maskz_loadu_ps(mask, b + (size_t)r * N + n0), acc);
            _mm256_mask_storeu_epi16(ym + n0, mask, (__m256i)_mm512_cvtneps_pbh(acc));
        }
    }
    return 0;
}

// ---- RMSNorm and SwiGLU ----------------------------------------------------------------

// out[m] = weight * x[m] / sqrt(mean(x[m]^2) + eps), after x[m] += delta[m] when delta is
// not NULL (x updated in place, rounded to bfloat16 as torch's add would). All bfloat16,
// x, delta and out [M, H] contiguous; fp32 inside, out rounded once.
int add_rms_norm(uint16_t *x, const uint16_t *delta, const uint16_t *weight, uint16_t *out,
                 int M, int H, float eps) {
    if (M <= 0 || H <= 0 || H % 16) return -1;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int m = 0; m < M; m++) {
        uint16_t *row = x + (size_t)m * H;
        __m512 squares = _mm512_setzero_ps();
        for (int i = 0; i < H; i += 16) {
            __m512 v = load_bf16(row + i, 0xFFFF);
            if (delta) {
                v = _mm512_add_ps(v, load_bf16(delta + (size_t)m * H + i, 0xFFFF));
                const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v);
                _mm256_storeu_si256((__m256i *)(row + i), rounded);
                v = bf16_to_ps(rounded);
            }
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 inverse =
            _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)H + eps));
        for (int i = 0; i < H; i += 16) {
            const __m512 v = _mm512_mul_ps(load_bf16(row + i, 0xFFFF), inverse);
            const __m512 y = _mm512_mul_ps(v, load_bf16(weight + i, 0xFFFF));
            _mm256_storeu_si256((__m256i *)(out + (size_t)m * H + i), (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
    return 0;
}

// out[m, i] = silu(gate_up[m, i]) * gate_up[m, I + i]: gate_up [M, 2I], out [M, I], bfloat16.
int silu_mul(const uint16_t *gate_up, uint16_t *out, int M, int I) {
    if (M <= 0 || I <= 0 || I % 16) return -1;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int m = 0; m < M; m++) {
        const uint16_t *gate = gate_up + (size_t)m * 2 * I, *up = gate + I;
        for (int i = 0; i < I; i += 16) {
            const __m512 g = load_bf16(gate + i, 0xFFFF);
            // silu(g) = g / (1 + e^-g); e^-|g| keeps exp_ps in its x <= 0 range
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
            const __m512 one = _mm512_set1_ps(1.0f);
            // sigmoid(g) = 1 / (1 + e^-g) for g >= 0, e^g / (1 + e^g) for g < 0
            const __m512 sigmoid = _mm512_mask_div_ps(
                _mm512_div_ps(one, _mm512_add_ps(one, e)),
                _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), e, _mm512_add_ps(one, e));
            const __m512 y = _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), load_bf16(up + i, 0xFFFF));
            _mm256_storeu_si256((__m256i *)(out + (size_t)m * I + i), (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
    return 0;
}

// ---- log-sum-exp -----------------------------------------------------------------------
//
// out[b] = log(sum_v e^x[b, v]) for float32 rows x [B, V], each row in one fixed order (16
// lanes, then their sum), so that its value never depends on B or the thread count as
// torch's reductions do: the log-probabilities of the batch-invariant engine.
int logsumexp_rows(const float *x, float *out, int B, int V) {
    if (B <= 0 || V <= 0) return -1;
#pragma omp parallel for schedule(static) if (B > 1)
    for (int b = 0; b < B; b++) {
        const float *row = x + (size_t)b * V;
        const int whole = V / 16 * 16;
        const __mmask16 tail = (__mmask16)((1u << (V - whole)) - 1);
        __m512 peak = _mm512_set1_ps(-INFINITY);
        for (int v = 0; v < whole; v += 16) peak = _mm512_max_ps(peak, _mm512_loadu_ps(row + v));
        peak = _mm512_mask_max_ps(peak, tail, peak, _mm512_maskz_loadu_ps(tail, row + whole));
        const float top = _mm512_reduce_max_ps(peak);
        if (!isfinite(top)) {  // all -inf, or an inf or NaN logit
            out[b] = top;
            continue;
        }
        const __m512 t = _mm512_set1_ps(top);
        __m512 sums = _mm512_setzero_ps();
        for (int v = 0; v < whole; v += 16)
            sums = _mm512_add_ps(sums, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + v), t)));
        const __m512 rest = _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + whole), t);
        sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(tail, exp_ps(_mm512_min_ps(rest, _mm512_setzero_ps()))));
        out[b] = top + logf(_mm512_reduce_add_ps(sums));
    }
    return 0;
}
