/*
 * Decoding kernels for CPUs with AVX512-BF16 and AVX512-VNNI (called from
 * engine/cpu_kernels.py through ctypes):
 *
 *   skinny_gemm_bf16:  y = x W^T (+ b), W bf16   (the bf16 target)
 *   skinny_gemm_int8w: y = (x Q^T) * scale (+ b), Q int8 per output channel (the int8 drafter)
 *   attend_few:        attention of a few new tokens over the KV cache (causal or tree mask)
 *   rope_and_store:    rotary embedding + KV-cache write
 *
 * The matrix products:
 *
 *   x:  [T, in]               float32 or bf16, row-major (T = tokens in the pass: 1 for
 *                             plain decoding, K + 1 when verifying K drafts)
 *   wp: [out/16, in/2, 16, 2] W packed once at load time: wp[ob, p, l, e] = W[16 ob + l, 2 p + e]
 *   b:  [out]                 bf16 or NULL
 *   y:  [T, out]              float32 or bf16, row-major
 *   (out a multiple of 16, in a multiple of 2: the caller pads with zeros.)
 *
 * Decoding is memory bound: every weight byte is read once per pass and used
 * for only T multiply-adds. The kernels stream the packed weights once per call
 * and keep the T rows of x in L1, so a 16-token pass reads the bytes a 1-token
 * pass reads.
 *
 * bf16 arithmetic: one 64-byte line of wp holds 16 outputs x 2 inputs. vdpbf16ps
 * multiplies it by the matching input pair of x (rounded to bf16, broadcast) and
 * adds both products into a float32 accumulator per output lane, so a register
 * holds 16 finished dot products with no horizontal reduction. Each output
 * y[t][o] is accumulated over the input pairs in the same order whatever T is
 * and whichever tile (o, t) lands in, then the bias is added (and the sum rounded
 * to bf16, nearest even, for bf16 y): the result for a row of x does not depend
 * on the other rows in the call, so a token verified in a K-token pass gets bit
 * for bit the product a one-token pass gives it.
 *
 * Threads: the 16-output blocks are split evenly across OpenMP threads. The
 * library links libgomp by its soname, so in a process that imported torch it
 * runs on torch's already-loaded OpenMP runtime (torch.set_num_threads applies).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16 /* outputs per packed block = float32 lanes of a zmm register */

/* The two kinds of weights share one tiled loop; they differ in what a 64-byte
 * slice of the product does:
 *   bf16: x rows bf16, float32 accumulators, vdpbf16ps on a 64-byte line of W;
 *   i8:   x rows int16 (quantised per row, scale sx[t]), int32 accumulators,
 *         vpdpwssd on a 32-byte line of Q sign-extended to int16 (see below). */
#define ACC_bf16 __m512
#define ZERO_bf16() _mm512_setzero_ps()
#define DOT_bf16(acc, xb, wp, line)                                                                             \
    _mm512_dpbf16_ps(acc, (__m512bh)(xb), (__m512bh)_mm512_loadu_si512((const uint16_t *)(wp) + ((line) << 5)))
#define TO_FLOAT_bf16(acc, sx, t) (acc)
#define ACC_i8 __m512i
#define ZERO_i8() _mm512_setzero_si512()
#define DOT_i8(acc, xb, wp, line)                                                                               \
    _mm512_dpwssd_epi32(acc, xb,                                                                                \
                        _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)((const int8_t *)(wp) + ((line) << 5)))))
#define TO_FLOAT_i8(acc, sx, t) _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps((sx)[t]))

/* Accumulate x rows [t0, t0 + NT) (2-byte elements: bf16 or int16) against output
 * blocks [ob, ob + NB), then store y = acc (* sx[t]) (* scale) (+ b), float32 or
 * rounded to bf16. A macro stamps one function per (KIND, NB, NT) so that the loops
 * unroll and the accumulators stay in registers. */
#define DEFINE_TILE(KIND, NB, NT)                                                                               \
    static void tile_##KIND##_##NB##x##NT(const void *x, const float *sx, const void *wp, const float *scale,  \
                                          const uint16_t *b, void *y, int y_f32, int64_t in, int64_t out,      \
                                          int64_t ob, int64_t t0) {                                             \
        const int64_t pairs = in / 2;                                                                           \
        ACC_##KIND acc[NB][NT];                                                                                 \
        _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++)                                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) acc[g][j] = ZERO_##KIND();                     \
        const int32_t *xr[NT]; /* one 32-bit load = one input pair */                                          \
        _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) xr[j] =                                           \
            (const int32_t *)((const uint16_t *)x + (t0 + j) * in);                                             \
        for (int64_t p = 0; p < pairs; p++) {                                                                   \
            __m512i xb[NT];                                                                                     \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) xb[j] = _mm512_set1_epi32(xr[j][p]);         \
            _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++)                                               \
                _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) acc[g][j] =                               \
                    DOT_##KIND(acc[g][j], xb[j], wp, (ob + g) * pairs + p);                                     \
        }                                                                                                       \
        for (int g = 0; g < NB; g++) {                                                                          \
            __m512 bias = b ? _mm512_castsi512_ps(_mm512_slli_epi32(                                           \
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(b + (ob + g) * LANES))), \
                                  16))                                                                          \
                            : _mm512_setzero_ps();                                                              \
            for (int j = 0; j < NT; j++) {                                                                      \
                __m512 v = TO_FLOAT_##KIND(acc[g][j], sx, t0 + j);                                              \
                if (scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + (ob + g) * LANES));                     \
                v = _mm512_add_ps(v, bias);                                                                     \
                if (y_f32)                                                                                      \
                    _mm512_storeu_ps((float *)y + (t0 + j) * out + (ob + g) * LANES, v);                        \
                else                                                                                            \
                    _mm256_storeu_si256((void *)((uint16_t *)y + (t0 + j) * out + (ob + g) * LANES),            \
                                        (__m256i)_mm512_cvtneps_pbh(v));                                        \
            }                                                                                                   \
        }                                                                                                       \
    }

#define T_TILE 4
#define TILE_ARGS x, sx, wp, scale, b, y, y_f32, in, out

/* Every tile of output blocks [ob, ob + nb) (nb == 4, or a 1-3 block tail) for every
 * row of x, and the threaded driver over all output blocks. */
#define DEFINE_KIND(KIND)                                                                                       \
    DEFINE_TILE(KIND, 4, 1)                                                                                     \
    DEFINE_TILE(KIND, 4, 2)                                                                                     \
    DEFINE_TILE(KIND, 4, 3)                                                                                     \
    DEFINE_TILE(KIND, 4, 4)                                                                                     \
    DEFINE_TILE(KIND, 1, 1)                                                                                     \
    DEFINE_TILE(KIND, 1, 2)                                                                                     \
    DEFINE_TILE(KIND, 1, 3)                                                                                     \
    DEFINE_TILE(KIND, 1, 4)                                                                                     \
    static void tiles_##KIND(const void *x, const float *sx, const void *wp, const float *scale, const uint16_t *b, \
                             void *y, int y_f32, int64_t in, int64_t out, int64_t rows, int64_t ob, int64_t nb) { \
        for (int64_t t0 = 0; t0 < rows; t0 += T_TILE) {                                                         \
            int64_t nt = rows - t0 < T_TILE ? rows - t0 : T_TILE;                                               \
            if (nb == 4) {                                                                                      \
                switch (nt) {                                                                                   \
                case 1: tile_##KIND##_4x1(TILE_ARGS, ob, t0); break;                                            \
                case 2: tile_##KIND##_4x2(TILE_ARGS, ob, t0); break;                                            \
                case 3: tile_##KIND##_4x3(TILE_ARGS, ob, t0); break;                                            \
                default: tile_##KIND##_4x4(TILE_ARGS, ob, t0); break;                                           \
                }                                                                                               \
            } else {                                                                                            \
                for (int64_t g = 0; g < nb; g++) {                                                              \
                    switch (nt) {                                                                               \
                    case 1: tile_##KIND##_1x1(TILE_ARGS, ob + g, t0); break;                                    \
                    case 2: tile_##KIND##_1x2(TILE_ARGS, ob + g, t0); break;                                    \
                    case 3: tile_##KIND##_1x3(TILE_ARGS, ob + g, t0); break;                                    \
                    default: tile_##KIND##_1x4(TILE_ARGS, ob + g, t0); break;                                   \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    static void run_##KIND(const void *x, const float *sx, const void *wp, const float *scale, const uint16_t *b, \
                           void *y, int y_f32, int64_t rows, int64_t in, int64_t out) {                         \
        const int64_t blocks = out / LANES;                                                                     \
        _Pragma("omp parallel") {                                                                               \
            /* An even, contiguous share of the output blocks per thread. */                                    \
            int64_t nthreads = omp_get_num_threads(), me = omp_get_thread_num();                                \
            int64_t begin = blocks * me / nthreads, end = blocks * (me + 1) / nthreads;                         \
            int64_t ob = begin;                                                                                 \
            for (; ob + 4 <= end; ob += 4) tiles_##KIND(TILE_ARGS, rows, ob, 4);                               \
            if (ob < end) tiles_##KIND(TILE_ARGS, rows, ob, end - ob);                                          \
        }                                                                                                       \
    }

DEFINE_KIND(bf16)
DEFINE_KIND(i8)

/* RMSNorm of one float32 row into `dst` (float32): dst = x / sqrt(mean(x^2) + eps) * g. */
static void rms_norm_row(const float *x, const float *g, float eps, int64_t n, float *dst) {
    __m512 ss = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    float sum = _mm512_reduce_add_ps(ss);
    for (; i < n; i++) sum += x[i] * x[i];
    float r = 1.0f / sqrtf(sum / (float)n + eps);
    for (i = 0; i < n; i++) dst[i] = x[i] * r * g[i];
}

/* x as bf16 rows for the products: the caller's bf16 buffer, or float32 (optionally
 * RMS-normalised first, norm_w != NULL) rounded to nearest even into `tmp`. */
static const uint16_t *as_bf16(const void *x, int x_f32, const float *norm_w, float eps, int64_t rows, int64_t in,
                               uint16_t *tmp) {
    if (!x_f32) return (const uint16_t *)x;
    float row[in];
    for (int64_t t = 0; t < rows; t++) {
        const float *xf = (const float *)x + t * in;
        if (norm_w) {
            rms_norm_row(xf, norm_w, eps, in, row);
            xf = row;
        }
        uint16_t *dst = tmp + t * in;
        int64_t i = 0;
        for (; i + 16 <= in; i += 16)
            _mm256_storeu_si256((void *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xf + i)));
        if (i < in) {
            __mmask16 m = (__mmask16)((1u << (in - i)) - 1u);
            _mm256_mask_storeu_epi16(dst + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, xf + i)));
        }
    }
    return tmp;
}

/* y = x W^T (+ b), W packed bf16. x and y are float32 when x_f32 / y_f32, else bf16;
 * float32 x is rounded to bf16 for the products (the rows stay independent), after
 * an RMSNorm with weight norm_w [in] when norm_w != NULL (float32 x only).
 */
void skinny_gemm_bf16(const void *x, int x_f32, const uint16_t *wp, const uint16_t *b, void *y, int y_f32,
                      int64_t rows, int64_t in, int64_t out, const float *norm_w, float eps) {
    uint16_t small[4096];
    uint16_t *tmp = !x_f32 || rows * in <= 4096 ? small : malloc(sizeof(uint16_t) * rows * in);
    if (!tmp) abort();
    run_bf16(as_bf16(x, x_f32, norm_w, eps, rows, in, tmp), NULL, wp, NULL, b, y, y_f32, rows, in, out);
    if (tmp != small) free(tmp);
}

/* ---- int8 weights: integer dot products on AVX512-VNNI -------------------------
 * The int8 drafter's rows of x are quantised per row to int16, x ~= sx * xq with
 * |xq| <= xmax, and vpdpwssd multiplies int16 pairs into int32 sums exactly; the
 * int8 weights only need sign extension (one instruction per 32 weights; widening
 * them to bf16 took five and made the kernel compute bound). xmax keeps every sum
 * inside int32: xmax * 127 * in < 2^31 (in = 576: 29356, 14.8 bits; in = 1536:
 * 11008, 13.4 bits), far finer than the 8-bit activations that made per-tensor
 * int8 drafts useless. y = sx * sum(xq * q) * scale[o] (+ b). */

static inline float bf16_bits_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* y = (x Q^T) * scale (+ b), Q packed int8 [out/16, in/2, 16, 2], scale float32 [out].
 * x float32 (x_f32) or bf16 [rows, in], RMS-normalised first when norm_w != NULL. */
void skinny_gemm_int8w(const void *x, int x_f32, const int8_t *qp, const float *scale, const uint16_t *b, void *y,
                       int y_f32, int64_t rows, int64_t in, int64_t out, const float *norm_w, float eps) {
    int16_t small[4096];
    float small_sx[64];
    int16_t *xq = rows * in <= 4096 ? small : malloc(sizeof(int16_t) * rows * in);
    float *sx = rows <= 64 ? small_sx : malloc(sizeof(float) * rows);
    if (!xq || !sx) abort();
    double limit = 2147483647.0 / (127.0 * (double)in);
    const float xmax = (float)(limit < 32767.0 ? (double)(int64_t)limit : 32767.0);
    float row[in];
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t i = 0; i < in; i++)
            row[i] = x_f32 ? ((const float *)x)[t * in + i] : bf16_bits_to_float(((const uint16_t *)x)[t * in + i]);
        if (norm_w) rms_norm_row(row, norm_w, eps, in, row);
        /* vectorised: this prologue runs single-threaded before every product */
        __m512 vmax = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= in; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
        float amax = _mm512_reduce_max_ps(vmax);
        for (; i < in; i++) amax = fabsf(row[i]) > amax ? fabsf(row[i]) : amax;
        const float s = amax > 0.0f ? amax / xmax : 1.0f;
        const float inv = 1.0f / s;
        sx[t] = s;
        const __m512 vinv = _mm512_set1_ps(inv), vlim = _mm512_set1_ps(xmax);
        int16_t *dst = xq + t * in;
        for (i = 0; i + 16 <= in; i += 16) {
            __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(row + i), vinv), -vlim), vlim);
            _mm256_storeu_si256((void *)(dst + i), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v))); /* nearest even */
        }
        for (; i < in; i++) {
            float r = nearbyintf(row[i] * inv);
            dst[i] = (int16_t)(r > xmax ? xmax : (r < -xmax ? -xmax : r));
        }
    }
    run_i8(xq, sx, qp, scale, b, y, y_f32, rows, in, out);
    if (xq != small) free(xq);
    if (sx != small_sx) free(sx);
}

/* exp(x) for x <= 0 (softmax after subtracting the max), 16 lanes: x = n ln2 + r with
 * |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial (relative error < 2e-7, about
 * float32 rounding), times 2^n by scalef. Underflows to 0 below ~-87; -inf gives 0. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x); /* ln2 split in two for accuracy */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Lane sums of four vectors, (sum a, sum b, sum c, sum d), each summed in the same
 * order whichever slot it occupies: ((x0 + x2) + (x1 + x3)) within each 128-bit lane,
 * then (L0 + L2) + (L1 + L3) across lanes. */
static inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* a0+a2 b0+b2 a1+a3 b1+b3 */
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd))); /* a b c d per 128-bit lane */
    __m256 lo = _mm512_castps512_ps256(abcd);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1));
    __m256 s8 = _mm256_add_ps(lo, hi); /* (L0 + L2), (L1 + L3) */
    return _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
}

/* ---- attention of a few new tokens over the cache --------------------------------
 * q: [H, T, D] float32 (rotated), k, v: one layer of the cache, [Hkv, S, D] float32;
 * out: [T, H, D]. Without a mask the cache holds A positions of which the last T
 * are the new tokens (their K/V already written) and token t attends [0, A - T + t]
 * (causal); with mask [T, A] (1 = may attend; a draft tree's ancestors) token t
 * attends the positions its row allows. Query head h reads key/value head
 * h / (H / Hkv): softmax(q k^T * scale) v with the max subtracted before exp.
 * (head, token) pairs run in parallel. torch's SDPA spent 40-55 us per layer on
 * setup for these. Every row must allow at least one position. */
void attend_few(const float *q, const float *k, const float *v, const uint8_t *mask, float *out, int64_t H,
                int64_t Hkv, int64_t S, int64_t A, int64_t T, int64_t D, float scale) {
    const int64_t group = H / Hkv;
#pragma omp parallel for schedule(static)
    for (int64_t ht = 0; ht < H * T; ht++) {
        const int64_t h = ht / T, t = ht % T;
        /* The attended positions, in slot order: [0, A - T + t] causally, the allowed
         * ones under a mask. Everything below runs over this compact list, so the sums
         * are grouped by rank, not by slot: a tree node whose ancestors sit at other
         * slots than in a chain still sums the same numbers in the same order. */
        int64_t len = 0;
        int32_t listed[A];
        if (mask) {
            const uint8_t *allowed = mask + t * A;
            for (int64_t a = 0; a < A; a++)
                if (allowed[a]) listed[len++] = (int32_t)a;
        } else {
            for (; len < A - T + t + 1; len++) listed[len] = (int32_t)len;
        }
#define KEY(a) ((int64_t)listed[a])
        const float *qh = q + (h * T + t) * D;
        const float *kh = k + (h / group) * S * D;
        const float *vh = v + (h / group) * S * D;
        float scores[len + 8];
        float mx = -INFINITY;
        const int64_t d16 = D - D % 16;
        /* Four keys at a time: four dot-product vectors summed lane-wise by one
         * transpose-add (hsum4) instead of four full horizontal reductions. */
        for (int64_t a0 = 0; a0 < len; a0 += 8) {
            __m512 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
            for (int64_t i = 0; i < d16; i += 16) { /* 8 independent chains, q chunk loaded once */
                const __m512 qv = _mm512_loadu_ps(qh + i);
                for (int j = 0; j < 8; j++)
                    if (a0 + j < len) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kh + KEY(a0 + j) * D + i), acc[j]);
            }
            _mm_storeu_ps(scores + a0, hsum4(acc[0], acc[1], acc[2], acc[3]));
            _mm_storeu_ps(scores + a0 + 4, hsum4(acc[4], acc[5], acc[6], acc[7]));
            for (int j = 0; j < 8 && a0 + j < len; j++) {
                const int64_t a = a0 + j;
                float sdot = scores[a];
                for (int64_t i = d16; i < D; i++) sdot += qh[i] * kh[KEY(a) * D + i];
                scores[a] = sdot * scale;
                mx = scores[a] > mx ? scores[a] : mx;
            }
        }
        /* exp(s - max), 16 at a time */
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512 vtotal = _mm512_setzero_ps();
        int64_t a = 0;
        for (; a + 16 <= len; a += 16) {
            __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + a), vmx));
            _mm512_storeu_ps(scores + a, e);
            vtotal = _mm512_add_ps(vtotal, e);
        }
        if (a < len) {
            __mmask16 m = (__mmask16)((1u << (len - a)) - 1u);
            __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + a), vmx)));
            _mm512_mask_storeu_ps(scores + a, m, e);
            vtotal = _mm512_add_ps(vtotal, e);
        }
        const float inv = 1.0f / _mm512_reduce_add_ps(vtotal);
        float *oh = out + (t * H + h) * D;
        if (D == 64) { /* the common head size: the output row stays in registers, */
            /* even and odd keys in separate accumulators (two independent FMA chains) */
            __m512 o0 = _mm512_setzero_ps(), o1 = o0, o2 = o0, o3 = o0, e0 = o0, e1 = o0, e2 = o0, e3 = o0;
            for (a = 0; a + 2 <= len; a += 2) {
                const __m512 wv = _mm512_set1_ps(scores[a] * inv), wn = _mm512_set1_ps(scores[a + 1] * inv);
                const float *va = vh + KEY(a) * D, *vn = vh + KEY(a + 1) * D;
                o0 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(va), o0);
                o1 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(va + 16), o1);
                o2 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(va + 32), o2);
                o3 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(va + 48), o3);
                e0 = _mm512_fmadd_ps(wn, _mm512_loadu_ps(vn), e0);
                e1 = _mm512_fmadd_ps(wn, _mm512_loadu_ps(vn + 16), e1);
                e2 = _mm512_fmadd_ps(wn, _mm512_loadu_ps(vn + 32), e2);
                e3 = _mm512_fmadd_ps(wn, _mm512_loadu_ps(vn + 48), e3);
            }
            if (a < len) {
                const __m512 wv = _mm512_set1_ps(scores[a] * inv);
                const float *va = vh + KEY(a) * D;
                o0 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(va), o0);
                o1 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(va + 16), o1);
                o2 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(va + 32), o2);
                o3 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(va + 48), o3);
            }
            _mm512_storeu_ps(oh, _mm512_add_ps(o0, e0));
            _mm512_storeu_ps(oh + 16, _mm512_add_ps(o1, e1));
            _mm512_storeu_ps(oh + 32, _mm512_add_ps(o2, e2));
            _mm512_storeu_ps(oh + 48, _mm512_add_ps(o3, e3));
        } else {
            for (int64_t i = 0; i < D; i++) oh[i] = 0.0f;
            for (a = 0; a < len; a++) {
                const float w = scores[a] * inv;
                const __m512 wv = _mm512_set1_ps(w);
                int64_t i = 0;
                for (; i + 16 <= D; i += 16)
                    _mm512_storeu_ps(oh + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(vh + KEY(a) * D + i), _mm512_loadu_ps(oh + i)));
                for (; i < D; i++) oh[i] += w * vh[KEY(a) * D + i];
            }
        }
#undef KEY
    }
}

/* ---- rotary embedding + KV-cache write, fused ------------------------------------
 * qkv: [T, (H + 2 Hkv) D] float32, the fused projection's output (queries, keys,
 * values); cos, sin: [T, D] for the tokens' positions. Writes the rotated queries
 * to q_out [H, T, D] and the rotated keys and the values into one layer of the
 * cache, k, v: [Hkv, S, D] at slots [start, start + T). Rotation in the
 * rotate-half convention of the Hugging Face checkpoints:
 * x * cos + (-x[D/2:], x[:D/2]) * sin. Replaces ~14 small torch calls per layer. */
void rope_and_store(const float *qkv, const float *cos, const float *sin, float *q_out, float *k, float *v,
                    int64_t start, int64_t T, int64_t H, int64_t Hkv, int64_t S, int64_t D) {
    const int64_t width = (H + 2 * Hkv) * D, half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * width, *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < H + Hkv; h++) {
            const float *x = row + h * D;
            float *dst = h < H ? q_out + (h * T + t) * D : k + ((h - H) * S + start + t) * D;
            for (int64_t i = 0; i < half; i++) dst[i] = x[i] * c[i] - x[i + half] * s[i];
            for (int64_t i = half; i < D; i++) dst[i] = x[i] * c[i] + x[i - half] * s[i];
        }
        for (int64_t h = 0; h < Hkv; h++)
            memcpy(v + (h * S + start + t) * D, row + (H + Hkv + h) * D, sizeof(float) * D);
    }
}
