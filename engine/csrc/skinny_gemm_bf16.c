/*
 * Skinny matrix products for decoding on CPUs with AVX512-BF16 and AVX512-VNNI.
 *
 *   skinny_gemm_bf16:  y = x W^T (+ b), W bf16   (the bf16 target)
 *   skinny_gemm_int8w: y = (x Q^T) * scale (+ b), Q int8 per output channel (the int8 drafter)
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
#include <string.h>

#define LANES 16 /* outputs per packed block = float32 lanes of a zmm register */

/* One 64-byte line of packed bf16 weights (16 outputs x 2 inputs). */
static inline __m512i load_w_bf16(const void *wp, int64_t line) {
    return _mm512_loadu_si512((const void *)((const uint16_t *)wp + (line << 5)));
}

/* Accumulate x rows [t0, t0 + NT) against output blocks [ob, ob + NB), then store
 * y = acc (* scale) (+ b), rounded to bf16. KIND names the weight loader. */
#define DEFINE_TILE(KIND, NB, NT)                                                                               \
    static void tile_##KIND##_##NB##x##NT(const uint16_t *x, const void *wp, const float *scale,               \
                                          const uint16_t *b, void *y, int y_f32, int64_t in, int64_t out,      \
                                          int64_t ob, int64_t t0) {                                                         \
        const int64_t pairs = in / 2;                                                                           \
        __m512 acc[NB][NT];                                                                                     \
        _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++)                                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) acc[g][j] = _mm512_setzero_ps();               \
        const int32_t *xr[NT];                                                                                  \
        _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) xr[j] = (const int32_t *)(x + (t0 + j) * in);    \
        for (int64_t p = 0; p < pairs; p++) {                                                                   \
            __m512i xb[NT];                                                                                     \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) xb[j] = _mm512_set1_epi32(xr[j][p]);         \
            _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++) {                                             \
                __m512i wv = load_w_##KIND(wp, (ob + g) * pairs + p);                                           \
                _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) acc[g][j] =                               \
                    _mm512_dpbf16_ps(acc[g][j], (__m512bh)xb[j], (__m512bh)wv);                                 \
            }                                                                                                   \
        }                                                                                                       \
        for (int g = 0; g < NB; g++) {                                                                          \
            __m512 bias = b ? _mm512_castsi512_ps(_mm512_slli_epi32(                                           \
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(b + (ob + g) * LANES))), \
                                  16))                                                                          \
                            : _mm512_setzero_ps();                                                              \
            for (int j = 0; j < NT; j++) {                                                                      \
                __m512 v = scale ? _mm512_mul_ps(acc[g][j], _mm512_loadu_ps(scale + (ob + g) * LANES))          \
                                 : acc[g][j];                                                                   \
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

/* All tiles of output blocks [ob, ob + nb) (nb == 4, or a 1-3 block tail) for every row of x. */
#define DEFINE_KIND(KIND)                                                                                      \
    DEFINE_TILE(KIND, 4, 1)                                                                                     \
    DEFINE_TILE(KIND, 4, 2)                                                                                     \
    DEFINE_TILE(KIND, 4, 3)                                                                                     \
    DEFINE_TILE(KIND, 4, 4)                                                                                     \
    DEFINE_TILE(KIND, 1, 1)                                                                                     \
    DEFINE_TILE(KIND, 1, 2)                                                                                     \
    DEFINE_TILE(KIND, 1, 3)                                                                                     \
    DEFINE_TILE(KIND, 1, 4)                                                                                     \
    static void tiles_##KIND(const uint16_t *x, const void *wp, const float *scale, const uint16_t *b, void *y, \
                             int y_f32, int64_t rows, int64_t in, int64_t out, int64_t ob, int64_t nb) {       \
        for (int64_t t0 = 0; t0 < rows; t0 += T_TILE) {                                                         \
            int64_t nt = rows - t0 < T_TILE ? rows - t0 : T_TILE;                                               \
            if (nb == 4) {                                                                                      \
                switch (nt) {                                                                                   \
                case 1: tile_##KIND##_4x1(x, wp, scale, b, y, y_f32, in, out, ob, t0); break;                          \
                case 2: tile_##KIND##_4x2(x, wp, scale, b, y, y_f32, in, out, ob, t0); break;                          \
                case 3: tile_##KIND##_4x3(x, wp, scale, b, y, y_f32, in, out, ob, t0); break;                          \
                default: tile_##KIND##_4x4(x, wp, scale, b, y, y_f32, in, out, ob, t0); break;                         \
                }                                                                                               \
            } else {                                                                                            \
                for (int64_t g = 0; g < nb; g++) {                                                              \
                    switch (nt) {                                                                               \
                    case 1: tile_##KIND##_1x1(x, wp, scale, b, y, y_f32, in, out, ob + g, t0); break;                  \
                    case 2: tile_##KIND##_1x2(x, wp, scale, b, y, y_f32, in, out, ob + g, t0); break;                  \
                    case 3: tile_##KIND##_1x3(x, wp, scale, b, y, y_f32, in, out, ob + g, t0); break;                  \
                    default: tile_##KIND##_1x4(x, wp, scale, b, y, y_f32, in, out, ob + g, t0); break;                 \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    static void run_##KIND(const uint16_t *x, const void *wp, const float *scale, const uint16_t *b, void *y,   \
                           int y_f32, int64_t rows, int64_t in, int64_t out) {                                  \
        const int64_t blocks = out / LANES;                                                                     \
        _Pragma("omp parallel") {                                                                               \
            /* An even, contiguous share of the output blocks per thread. */                                    \
            int64_t nthreads = omp_get_num_threads(), me = omp_get_thread_num();                                \
            int64_t begin = blocks * me / nthreads, end = blocks * (me + 1) / nthreads;                         \
            int64_t ob = begin;                                                                                 \
            for (; ob + 4 <= end; ob += 4) tiles_##KIND(x, wp, scale, b, y, y_f32, rows, in, out, ob, 4);             \
            if (ob < end) tiles_##KIND(x, wp, scale, b, y, y_f32, rows, in, out, ob, end - ob);                       \
        }                                                                                                       \
    }

DEFINE_KIND(bf16)

/* x as bf16: the caller's buffer, or float32 rounded (nearest even) into `tmp`. */
static const uint16_t *as_bf16(const void *x, int x_f32, int64_t n, uint16_t *tmp) {
    if (!x_f32) return (const uint16_t *)x;
    const float *xf = (const float *)x;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((void *)(tmp + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xf + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm256_mask_storeu_epi16(tmp + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, xf + i)));
    }
    return tmp;
}

/* y = x W^T (+ b), W packed bf16. x and y are float32 when x_f32 / y_f32, else bf16;
 * float32 x is rounded to bf16 for the products (the rows stay independent).
 * tmp: rows * in bf16 scratch, used when x_f32. */
void skinny_gemm_bf16(const void *x, int x_f32, const uint16_t *wp, const uint16_t *b, void *y, int y_f32,
                      int64_t rows, int64_t in, int64_t out, uint16_t *tmp) {
    run_bf16(as_bf16(x, x_f32, rows * in, tmp), wp, NULL, b, y, y_f32, rows, in, out);
}

/* ---- int8 weights: integer dot products on AVX512-VNNI -------------------------
 * The int8 drafter's rows of x are quantised per row to int16, x ~= sx * xq with
 * |xq| <= xmax, and vpdpwssd multiplies int16 pairs into int32 sums exactly; the
 * int8 weights only need sign extension (one instruction per 32 weights; widening
 * them to bf16 took five and made the kernel compute bound). xmax keeps every sum
 * inside int32: xmax * 127 * in < 2^31 (in = 576: 29356, 14.8 bits; in = 1536:
 * 11008, 13.4 bits), far finer than the 8-bit activations that made per-tensor
 * int8 drafts useless. y = sx * sum(xq * q) * scale[o] (+ b). */

#define DEFINE_TILE_I8(NB, NT)                                                                                  \
    static void tile_i8_##NB##x##NT(const int16_t *xq, const float *sx, const int8_t *qp, const float *scale,  \
                                    const uint16_t *b, void *y, int y_f32, int64_t in, int64_t out, int64_t ob, \
                                    int64_t t0) {                                                               \
        const int64_t pairs = in / 2;                                                                           \
        __m512i acc[NB][NT];                                                                                    \
        _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++)                                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) acc[g][j] = _mm512_setzero_si512();            \
        const int32_t *xr[NT];                                                                                  \
        _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) xr[j] = (const int32_t *)(xq + (t0 + j) * in);   \
        for (int64_t p = 0; p < pairs; p++) {                                                                   \
            __m512i xb[NT];                                                                                     \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) xb[j] = _mm512_set1_epi32(xr[j][p]);         \
            _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++) {                                             \
                __m512i wv = _mm512_cvtepi8_epi16(                                                              \
                    _mm256_loadu_si256((const void *)(qp + (((ob + g) * pairs + p) << 5))));                    \
                _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) acc[g][j] =                               \
                    _mm512_dpwssd_epi32(acc[g][j], xb[j], wv);                                                  \
            }                                                                                                   \
        }                                                                                                       \
        for (int g = 0; g < NB; g++) {                                                                          \
            __m512 sw = _mm512_loadu_ps(scale + (ob + g) * LANES);                                              \
            __m512 bias = b ? _mm512_castsi512_ps(_mm512_slli_epi32(                                           \
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(b + (ob + g) * LANES))), \
                                  16))                                                                          \
                            : _mm512_setzero_ps();                                                              \
            for (int j = 0; j < NT; j++) {                                                                      \
                __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[g][j]), _mm512_mul_ps(sw, _mm512_set1_ps(sx[t0 + j]))); \
                v = _mm512_add_ps(v, bias);                                                                     \
                if (y_f32)                                                                                      \
                    _mm512_storeu_ps((float *)y + (t0 + j) * out + (ob + g) * LANES, v);                        \
                else                                                                                            \
                    _mm256_storeu_si256((void *)((uint16_t *)y + (t0 + j) * out + (ob + g) * LANES),            \
                                        (__m256i)_mm512_cvtneps_pbh(v));                                        \
            }                                                                                                   \
        }                                                                                                       \
    }

DEFINE_TILE_I8(4, 1)
DEFINE_TILE_I8(4, 2)
DEFINE_TILE_I8(4, 3)
DEFINE_TILE_I8(4, 4)
DEFINE_TILE_I8(1, 1)
DEFINE_TILE_I8(1, 2)
DEFINE_TILE_I8(1, 3)
DEFINE_TILE_I8(1, 4)

static void tiles_i8(const int16_t *xq, const float *sx, const int8_t *qp, const float *scale, const uint16_t *b,
                     void *y, int y_f32, int64_t rows, int64_t in, int64_t out, int64_t ob, int64_t nb) {
    for (int64_t t0 = 0; t0 < rows; t0 += T_TILE) {
        int64_t nt = rows - t0 < T_TILE ? rows - t0 : T_TILE;
        if (nb == 4) {
            switch (nt) {
            case 1: tile_i8_4x1(xq, sx, qp, scale, b, y, y_f32, in, out, ob, t0); break;
            case 2: tile_i8_4x2(xq, sx, qp, scale, b, y, y_f32, in, out, ob, t0); break;
            case 3: tile_i8_4x3(xq, sx, qp, scale, b, y, y_f32, in, out, ob, t0); break;
            default: tile_i8_4x4(xq, sx, qp, scale, b, y, y_f32, in, out, ob, t0); break;
            }
        } else {
            for (int64_t g = 0; g < nb; g++) {
                switch (nt) {
                case 1: tile_i8_1x1(xq, sx, qp, scale, b, y, y_f32, in, out, ob + g, t0); break;
                case 2: tile_i8_1x2(xq, sx, qp, scale, b, y, y_f32, in, out, ob + g, t0); break;
                case 3: tile_i8_1x3(xq, sx, qp, scale, b, y, y_f32, in, out, ob + g, t0); break;
                default: tile_i8_1x4(xq, sx, qp, scale, b, y, y_f32, in, out, ob + g, t0); break;
                }
            }
        }
    }
}

static inline float bf16_bits_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* y = (x Q^T) * scale (+ b), Q packed int8 [out/16, in/2, 16, 2], scale float32 [out].
 * x float32 (x_f32) or bf16 [rows, in]; xq: rows * in int16 scratch; sx: rows floats scratch. */
void skinny_gemm_int8w(const void *x, int x_f32, const int8_t *qp, const float *scale, const uint16_t *b, void *y,
                       int y_f32, int64_t rows, int64_t in, int64_t out, int16_t *xq, float *sx) {
    double limit = 2147483647.0 / (127.0 * (double)in);
    const float xmax = (float)(limit < 32767.0 ? (double)(int64_t)limit : 32767.0);
    for (int64_t t = 0; t < rows; t++) {
        float amax = 0.0f;
        for (int64_t i = 0; i < in; i++) {
            float v = x_f32 ? ((const float *)x)[t * in + i] : bf16_bits_to_float(((const uint16_t *)x)[t * in + i]);
            float a = v < 0 ? -v : v;
            amax = a > amax ? a : amax;
        }
        float s = amax > 0.0f ? amax / xmax : 1.0f;
        float inv = 1.0f / s;
        sx[t] = s;
        for (int64_t i = 0; i < in; i++) {
            float v = x_f32 ? ((const float *)x)[t * in + i] : bf16_bits_to_float(((const uint16_t *)x)[t * in + i]);
            float r = __builtin_roundf(v * inv);
            r = r > xmax ? xmax : (r < -xmax ? -xmax : r);
            xq[t * in + i] = (int16_t)r;
        }
    }
    const int64_t blocks = out / LANES;
#pragma omp parallel
    {
        int64_t nthreads = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t begin = blocks * me / nthreads, end = blocks * (me + 1) / nthreads;
        int64_t ob = begin;
        for (; ob + 4 <= end; ob += 4) tiles_i8(xq, sx, qp, scale, b, y, y_f32, rows, in, out, ob, 4);
        if (ob < end) tiles_i8(xq, sx, qp, scale, b, y, y_f32, rows, in, out, ob, end - ob);
    }
}
