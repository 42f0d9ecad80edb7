// The embedded engine's native CPU kernels for x86-64 with AVX2, FMA and F16C (no
// AVX-512): the same functions, arguments and packed weight layouts as avx512.c (read
// its header first), so __init__.py loads either library and packs weights once.
//
// Without vdpbf16ps, the low-bit matmuls multiply in integers: each row's inputs become
// int16 per group of 32 (a power-of-two scale, exact to 2^-16 of the group's largest) and
// vpmaddwd multiplies 16 weight levels by 16 inputs per instruction, twice an FMA's 8,
// summing exactly in int32 until the group's scales apply (see "low-bit matmuls" below).
// Attention, norms and SwiGLU run in fp32 lanes with FMA. bfloat16 inputs widen to fp32
// exactly (a 16-bit shift); outputs are rounded to the nearest even bfloat16, as torch and
// vcvtneps2bf16 round.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16   // output columns per tile: two vectors of 8
#define GROUP 32  // inputs per scale
#define ROWS 4    // batch rows per pass over a tile's weights (8 int32 accumulators)

static inline __m256 bf16x8_to_ps(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 load_bf16x8(const uint16_t *p) {
    return bf16x8_to_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline float bf16_scalar(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline uint16_t scalar_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0;  // NaN stays NaN
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// 8 floats to bfloat16, rounded to nearest even (NaN to a quiet NaN).
static inline __m128i ps_to_bf16x8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // 32-bit lanes to 16: packus works per 128-bit half, so gather the halves after
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    return _mm256_castsi256_si128(packed);
}

static inline void store_bf16x8(uint16_t *p, __m256 v) {
    _mm_storeu_si128((__m128i *)p, ps_to_bf16x8(v));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// ---- low-bit matmuls -----------------------------------------------------------------
//
// Each row's inputs are scaled, per group of 32, by a power of two that puts the group's
// largest magnitude in [2^14, 2^15) and rounded to int16: exact for every input within 2^8
// of that largest (a bfloat16 carries 8 significant bits), the rest off by at most 2^-16
// of it. vpmaddwd then multiplies 16 int16 weight levels by 16 inputs and adds pairs into
// 8 int32 lanes, one per output column: 16 products per instruction where an FMA does 8,
// exact, with no int-to-float conversion per weight. A group's int32 sums are converted
// once and scaled by the weight scale times the input power of two:
//   sum_k x (q s + z) = s 2^e sum_k q x' + z sum_k x,   x = 2^e x' (x' the int16 input).
// 4-bit levels unpack into int16 pairs with one shift and AND per 16 (the pair of inputs
// k, k+1 of a column sits at bits 4i and 16 + 4i of its 32-bit lane); 8-bit levels
// sign-extend from their bytes. One pass over a tile's weights serves ROWS rows.
//
// An input group holding inf or NaN gets the scale NaN, so the rows' outputs are NaN.

typedef struct {
    int16_t *x;   // [M, K] int16 inputs
    float *step;  // [M, G] 2^e of each row's group (NaN where the group is not finite)
    float *sum;   // [M, G] fp32 sum of each row's group (for the 4-bit minimum)
} Inputs;

static void free_inputs(Inputs *in) {
    free(in->x);
    free(in->step);
    free(in->sum);
}

static int quantize_inputs(const uint16_t *x, int M, int K, Inputs *in) {
    const int G = K / GROUP;
    in->x = malloc(sizeof(int16_t) * (size_t)M * K);
    in->step = malloc(sizeof(float) * (size_t)M * G);
    in->sum = malloc(sizeof(float) * (size_t)M * G);
    if (!in->x || !in->step || !in->sum) {
        free_inputs(in);
        return -1;
    }
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            const size_t at = (size_t)m * K + (size_t)g * GROUP;
            __m256 v[4];
            __m256 peak = _mm256_setzero_ps(), total = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = load_bf16x8(x + at + 8 * i);
                peak = _mm256_max_ps(peak, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]));
                total = _mm256_add_ps(total, v[i]);
            }
            float top = hmax(peak);
            const float sum = hsum(total);
            uint32_t bits;
            memcpy(&bits, &top, sizeof bits);
            const int exponent = (int)(bits >> 23);  // biased: top in [2^(b-127), 2^(b-126))
            int16_t *q = in->x + at;
            float step;
            if (exponent < 15 || !isfinite(sum) || exponent >= 255) {
                // zero or below 2^-112 (nothing this sum can tell apart), or not finite
                memset(q, 0, sizeof(int16_t) * GROUP);
                step = isfinite(sum) && exponent < 255 ? 0.0f : NAN;
            } else {
                uint32_t up = (uint32_t)(268 - exponent) << 23, down = (uint32_t)(exponent - 14) << 23;
                float scale;
                memcpy(&scale, &up, sizeof scale);  // 2^(141 - b): exact
                memcpy(&step, &down, sizeof step);  // its inverse
                const __m256 sv = _mm256_set1_ps(scale);
                for (int i = 0; i < 4; i += 2) {
                    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], sv));
                    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], sv));
                    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
                    _mm256_storeu_si256((__m256i *)(q + 8 * i), packed);
                }
            }
            in->step[(size_t)m * G + g] = step;
            in->sum[(size_t)m * G + g] = sum;
        }
    return 0;
}

// Inputs k and k + 1 of row m as one 32-bit lane, in all 8 lanes.
static inline __m256i input_pair(const int16_t *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return _mm256_set1_epi32(pair);
}

// acc[m][h] += w[h] . (inputs k, k + 1 of row m), for both halves h of the tile.
static inline __attribute__((always_inline)) void madd_rows(
    __m256i acc[][2], __m256i w0, __m256i w1, const int16_t *xr, int K, int k, const int rows) {
    for (int m = 0; m < rows; m++) {
        const __m256i xv = input_pair(xr + (size_t)m * K + k);
        acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(w0, xv));
        acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(w1, xv));
    }
}

static inline __attribute__((always_inline)) void store_rows(
    uint16_t *y, __m256 total[][2], int m0, const int rows, int N, int t) {
    for (int m = 0; m < rows; m++) {
        uint16_t *dst = y + (size_t)(m0 + m) * N + (size_t)t * TILE;
        store_bf16x8(dst, total[m][0]);
        store_bf16x8(dst + 8, total[m][1]);
    }
}

static inline __attribute__((always_inline)) void tile4(
    const Inputs *in, const uint16_t *q, const uint16_t *s, const uint16_t *z, uint16_t *y,
    int m0, const int rows, int K, int N, int t) {
    const int G = K / GROUP;
    const __m256i low = _mm256_set1_epi32(0x000F000F);
    const uint16_t *qt = q + (size_t)t * G * 128;
    const int16_t *xr = in->x + (size_t)m0 * K;
    __m256 total[ROWS][2];
    for (int m = 0; m < rows; m++) total[m][0] = total[m][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256i acc[ROWS][2];
        for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
        for (int r = 0; r < 4; r++) {
            // 32-bit lane j: column j's 8 levels for inputs k .. k + 7
            const uint16_t *words = qt + (size_t)g * 128 + r * 32;
            const __m256i lo = _mm256_loadu_si256((const __m256i *)words);         // j 0-7
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(words + 16));  // j 8-15
            const int k = g * GROUP + 8 * r;
            madd_rows(acc, _mm256_and_si256(lo, low), _mm256_and_si256(hi, low), xr, K, k, rows);
            madd_rows(acc, _mm256_and_si256(_mm256_srli_epi32(lo, 4), low),
                      _mm256_and_si256(_mm256_srli_epi32(hi, 4), low), xr, K, k + 2, rows);
            madd_rows(acc, _mm256_and_si256(_mm256_srli_epi32(lo, 8), low),
                      _mm256_and_si256(_mm256_srli_epi32(hi, 8), low), xr, K, k + 4, rows);
            madd_rows(acc, _mm256_and_si256(_mm256_srli_epi32(lo, 12), low),
                      _mm256_and_si256(_mm256_srli_epi32(hi, 12), low), xr, K, k + 6, rows);
        }
        const size_t at = ((size_t)t * G + g) * TILE;
        for (int h = 0; h < 2; h++) {
            const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + at + 8 * h)));
            const __m256 zv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(z + at + 8 * h)));
            for (int m = 0; m < rows; m++) {
                const size_t mg = (size_t)(m0 + m) * G + g;
                const __m256 scale = _mm256_mul_ps(sv, _mm256_set1_ps(in->step[mg]));
                total[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][h]), scale, total[m][h]);
                total[m][h] = _mm256_fmadd_ps(_mm256_set1_ps(in->sum[mg]), zv, total[m][h]);
            }
        }
    }
    store_rows(y, total, m0, rows, N, t);
}

#define CASE(R) \
    case R: tile4(&in, q, s, z, y, m0, R, K, N, t); break;

int int4_matmul(const uint16_t *x, const uint16_t *q, const uint16_t *s, const uint16_t *z,
                uint16_t *y, int M, int K, int N) {
    if (M <= 0 || K <= 0 || N <= 0 || K % GROUP || N % TILE) return -1;
    Inputs in;
    if (quantize_inputs(x, M, K, &in)) return -1;
    const int tiles = N / TILE;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++)
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            switch (M - m0 < ROWS ? M - m0 : ROWS) { CASE(1) CASE(2) CASE(3) CASE(4) }
        }
    free_inputs(&in);
    return 0;
}

// 8-bit: the 16 bytes of (columns j..j+7, inputs k, k+1) sign-extend to 8 int16 pairs,
// one per column: one vpmaddwd with the row's input pair.
static inline __attribute__((always_inline)) void tile8(
    const Inputs *in, const int8_t *q, const uint16_t *s, uint16_t *y, int m0, const int rows,
    int K, int N, int t) {
    const int G = K / GROUP;
    const int8_t *qt = q + (size_t)t * G * 512;
    const int16_t *xr = in->x + (size_t)m0 * K;
    __m256 total[ROWS][2];
    for (int m = 0; m < rows; m++) total[m][0] = total[m][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256i acc[ROWS][2];
        for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
        for (int p = 0; p < 16; p++) {
            const int8_t *qp = qt + (size_t)g * 512 + p * 32;
            const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)qp));
            const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qp + 16)));
            madd_rows(acc, lo, hi, xr, K, g * GROUP + 2 * p, rows);
        }
        const size_t at = ((size_t)t * G + g) * TILE;
        for (int h = 0; h < 2; h++) {
            const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + at + 8 * h)));
            for (int m = 0; m < rows; m++) {
                const __m256 scale = _mm256_mul_ps(sv, _mm256_set1_ps(in->step[(size_t)(m0 + m) * G + g]));
                total[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][h]), scale, total[m][h]);
            }
        }
    }
    store_rows(y, total, m0, rows, N, t);
}

#define CASE8(R) \
    case R: tile8(&in, q, s, y, m0, R, K, N, t); break;

int int8_matmul(const uint16_t *x, const int8_t *q, const uint16_t *s, uint16_t *y, int M,
                int K, int N) {
    if (M <= 0 || K <= 0 || N <= 0 || K % GROUP || N % TILE) return -1;
    Inputs in;
    if (quantize_inputs(x, M, K, &in)) return -1;
    const int tiles = N / TILE;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++)
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            switch (M - m0 < ROWS ? M - m0 : ROWS) { CASE8(1) CASE8(2) CASE8(3) CASE8(4) }
        }
    free_inputs(&in);
    return 0;
}

// ---- decode attention (arguments and cache layouts: avx512.c) ---------------------

// e^x for x <= 0 (Cephes' expf polynomial on x - n ln2, scaled by 2^n): ~1 ulp.
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^n for n >= -126 (x >= -87): n + 127 in the exponent bits
    const __m256i scale = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
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
        // scores, padded to a whole vector, then the scaled query in fp32
        float *scores = malloc(sizeof(float) * ((size_t)capacity + 8 + (size_t)D));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int task = 0; task < B * n_kv; task++) {
            if (!scores) continue;
            float *query = scores + capacity + 8;
            const int b = task / n_kv, h = task % n_kv;
            const int64_t pos = positions[b];
            const int len = (int)pos + 1, whole = len / 8 * 8;
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
                const uint16_t *q = row + (size_t)(h * groups + i) * D;
                for (int d = 0; d < D; d++) query[d] = bf16_scalar(q[d]) * scale;
                // scores[p] = (scale q) . k_p, 32 positions at a time (4 independent FMA
                // chains), then 8, then the rest one by one
                __m256 peak = _mm256_set1_ps(-INFINITY);
                int p0 = 0;
                for (; p0 + 32 <= whole; p0 += 32) {
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    for (int d = 0; d < D; d++) {
                        const __m256 qd = _mm256_broadcast_ss(query + d);
                        const uint16_t *kp = keys + (size_t)d * capacity + p0;
                        a0 = _mm256_fmadd_ps(qd, load_bf16x8(kp), a0);
                        a1 = _mm256_fmadd_ps(qd, load_bf16x8(kp + 8), a1);
                        a2 = _mm256_fmadd_ps(qd, load_bf16x8(kp + 16), a2);
                        a3 = _mm256_fmadd_ps(qd, load_bf16x8(kp + 24), a3);
                    }
                    _mm256_storeu_ps(scores + p0, a0);
                    _mm256_storeu_ps(scores + p0 + 8, a1);
                    _mm256_storeu_ps(scores + p0 + 16, a2);
                    _mm256_storeu_ps(scores + p0 + 24, a3);
                    peak = _mm256_max_ps(peak, _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3)));
                }
                for (; p0 < whole; p0 += 8) {
                    __m256 acc = _mm256_setzero_ps();
                    for (int d = 0; d < D; d++)
                        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(query + d),
                                              load_bf16x8(keys + (size_t)d * capacity + p0), acc);
                    _mm256_storeu_ps(scores + p0, acc);
                    peak = _mm256_max_ps(peak, acc);
                }
                float top = hmax(peak);
                for (int p = whole; p < len; p++) {
                    float dot = 0.0f;
                    for (int d = 0; d < D; d++)
                        dot += query[d] * bf16_scalar(keys[(size_t)d * capacity + p]);
                    scores[p] = dot;
                    top = dot > top ? dot : top;
                }
                // e^(score - top), zero past len up to the vector's end
                for (int p = len; p < whole + 8; p++) scores[p] = -INFINITY;
                const __m256 topv = _mm256_set1_ps(top);
                __m256 sums = _mm256_setzero_ps();
                for (int p0 = 0; p0 < len; p0 += 8) {
                    const __m256 s = _mm256_sub_ps(_mm256_loadu_ps(scores + p0), topv);
                    // exp_ps clamps -inf to e^-87; the mask makes the padding exactly 0
                    const __m256 e = _mm256_and_ps(
                        exp_ps(s), _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
                    _mm256_storeu_ps(scores + p0, e);
                    sums = _mm256_add_ps(sums, e);
                }
                const __m256 norm = _mm256_set1_ps(1.0f / hsum(sums));
                // out = sum_p e_p v_p / sum_p e_p, 16 dimensions at a time, 4 positions
                // per step in separate sums (8 independent FMA chains)
                for (int d0 = 0; d0 < D; d0 += 16) {
                    __m256 a[4][2];
                    for (int u = 0; u < 4; u++) a[u][0] = a[u][1] = _mm256_setzero_ps();
                    int p = 0;
                    for (; p + 4 <= len; p += 4)
                        for (int u = 0; u < 4; u++) {
                            const __m256 e = _mm256_broadcast_ss(scores + p + u);
                            const uint16_t *vp = values + (size_t)(p + u) * D + d0;
                            a[u][0] = _mm256_fmadd_ps(e, load_bf16x8(vp), a[u][0]);
                            a[u][1] = _mm256_fmadd_ps(e, load_bf16x8(vp + 8), a[u][1]);
                        }
                    for (; p < len; p++) {
                        const __m256 e = _mm256_broadcast_ss(scores + p);
                        const uint16_t *vp = values + (size_t)p * D + d0;
                        a[0][0] = _mm256_fmadd_ps(e, load_bf16x8(vp), a[0][0]);
                        a[0][1] = _mm256_fmadd_ps(e, load_bf16x8(vp + 8), a[0][1]);
                    }
                    const __m256 a0 = _mm256_add_ps(_mm256_add_ps(a[0][0], a[1][0]),
                                                    _mm256_add_ps(a[2][0], a[3][0]));
                    const __m256 a1 = _mm256_add_ps(_mm256_add_ps(a[0][1], a[1][1]),
                                                    _mm256_add_ps(a[2][1], a[3][1]));
                    uint16_t *dst = out + (size_t)b * heads * D + (size_t)(h * groups + i) * D + d0;
                    store_bf16x8(dst, _mm256_mul_ps(a0, norm));
                    store_bf16x8(dst + 8, _mm256_mul_ps(a1, norm));
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

// ---- LoRA (arguments: avx512.c) ---------------------------------------------------

static inline float dot_bf16_f32(const uint16_t *x, const float *a, int K) {
    __m256 acc = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(load_bf16x8(x + k), _mm256_loadu_ps(a + k), acc);
    float total = hsum(acc);
    for (; k < K; k++) total += bf16_scalar(x[k]) * a[k];
    return total;
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
        int n0 = 0;
        for (; n0 + 8 <= N; n0 += 8) {
            __m256 acc = load_bf16x8(ym + n0);
            for (int r = 0; r < R; r++)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(t[r]), _mm256_loadu_ps(b + (size_t)r * N + n0), acc);
            store_bf16x8(ym + n0, acc);
        }
        for (; n0 < N; n0++) {
            float acc = bf16_scalar(ym[n0]);
            for (int r = 0; r < R; r++) acc += t[r] * b[(size_t)r * N + n0];
            ym[n0] = scalar_bf16(acc);
        }
    }
    return 0;
}

// ---- RMSNorm and SwiGLU (arguments: avx512.c) -------------------------------------

int add_rms_norm(uint16_t *x, const uint16_t *delta, const uint16_t *weight, uint16_t *out,
                 int M, int H, float eps) {
    if (M <= 0 || H <= 0 || H % 16) return -1;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int m = 0; m < M; m++) {
        uint16_t *row = x + (size_t)m * H;
        __m256 squares = _mm256_setzero_ps();
        for (int i = 0; i < H; i += 8) {
            __m256 v = load_bf16x8(row + i);
            if (delta) {
                v = _mm256_add_ps(v, load_bf16x8(delta + (size_t)m * H + i));
                const __m128i rounded = ps_to_bf16x8(v);
                _mm_storeu_si128((__m128i *)(row + i), rounded);
                v = bf16x8_to_ps(rounded);
            }
            squares = _mm256_fmadd_ps(v, v, squares);
        }
        const __m256 inverse = _mm256_set1_ps(1.0f / sqrtf(hsum(squares) / (float)H + eps));
        for (int i = 0; i < H; i += 8) {
            const __m256 v = _mm256_mul_ps(load_bf16x8(row + i), inverse);
            store_bf16x8(out + (size_t)m * H + i, _mm256_mul_ps(v, load_bf16x8(weight + i)));
        }
    }
    return 0;
}

int silu_mul(const uint16_t *gate_up, uint16_t *out, int M, int I) {
    if (M <= 0 || I <= 0 || I % 16) return -1;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int m = 0; m < M; m++) {
        const uint16_t *gate = gate_up + (size_t)m * 2 * I, *up = gate + I;
        for (int i = 0; i < I; i += 8) {
            const __m256 g = load_bf16x8(gate + i);
            const __m256 one = _mm256_set1_ps(1.0f);
            // e^-|g| keeps exp_ps in its x <= 0 range; sigmoid(g) = 1 / (1 + e^-g) for
            // g >= 0, e^g / (1 + e^g) for g < 0
            const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g);
            const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), abs));
            const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
            const __m256 sigmoid =
                _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
            const __m256 y = _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), load_bf16x8(up + i));
            store_bf16x8(out + (size_t)m * I + i, y);
        }
    }
    return 0;
}

// ---- log-sum-exp (see avx512.c) ---------------------------------------------------

int logsumexp_rows(const float *x, float *out, int B, int V) {
    if (B <= 0 || V <= 0) return -1;
#pragma omp parallel for schedule(static) if (B > 1)
    for (int b = 0; b < B; b++) {
        const float *row = x + (size_t)b * V;
        const int whole = V / 8 * 8;
        float padded[8];  // the last V % 8 values, then -inf
        for (int i = 0; i < 8; i++) padded[i] = whole + i < V ? row[whole + i] : -INFINITY;
        __m256 peak = _mm256_loadu_ps(padded);
        for (int v = 0; v < whole; v += 8) peak = _mm256_max_ps(peak, _mm256_loadu_ps(row + v));
        const float top = hmax(peak);
        if (!isfinite(top)) {  // all -inf, or an inf or NaN logit
            out[b] = top;
            continue;
        }
        const __m256 t = _mm256_set1_ps(top);
        __m256 sums = _mm256_setzero_ps();
        for (int v = 0; v < whole; v += 8)
            sums = _mm256_add_ps(sums, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(row + v), t)));
        const __m256 rest = _mm256_sub_ps(_mm256_loadu_ps(padded), t);  // -inf past V
        const __m256 valid = _mm256_cmp_ps(rest, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        sums = _mm256_add_ps(sums, _mm256_and_ps(valid, exp_ps(rest)));
        out[b] = top + logf(hsum(sums));
    }
    return 0;
}
