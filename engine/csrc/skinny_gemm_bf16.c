/*
 * Skinny bf16 matrix product for CPUs with AVX512-BF16: y = x W^T (+ b).
 *
 *   x:  [T, in]              bf16, row-major (T = tokens in the pass: 1 for plain
 *                            decoding, K + 1 when verifying K drafts)
 *   wp: [out/16, in/2, 16, 2] bf16, W [out, in] packed once at load time:
 *                            wp[ob, p, l, e] = W[16 ob + l, 2 p + e]
 *   b:  [out]                bf16 or NULL
 *   y:  [T, out]             bf16, row-major
 *   (out a multiple of 16, in a multiple of 2: the caller pads with zeros.)
 *
 * Decoding is memory bound: every weight byte is read once per pass and used
 * for only T multiply-adds. The kernel streams the packed weights once per call
 * and keeps the T rows of x in L1, so a 16-token pass reads the bytes a 1-token
 * pass reads.
 *
 * Arithmetic: one 64-byte line of wp holds 16 outputs x 2 inputs. vdpbf16ps
 * multiplies it by the matching input pair of x (broadcast) and adds both
 * products into a float32 accumulator per output lane, so a register holds 16
 * finished dot products with no horizontal reduction. Each output y[t][o] is
 * accumulated over the input pairs in the same order whatever T is and
 * whichever tile (o, t) lands in, then the bias is added and the sum rounded to
 * bf16 (nearest, ties to even): the result for a row of x does not depend on the
 * other rows in the call, so a token verified in a K-token pass gets bit for
 * bit the logits a one-token pass gives it.
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

/* Accumulate x rows [t0, t0 + NT) against output blocks [ob, ob + NB), then store. */
#define DEFINE_TILE(NB, NT)                                                                                     \
    static void tile_##NB##x##NT(const uint16_t *x, const uint16_t *wp, const uint16_t *b, uint16_t *y,        \
                                 int64_t in, int64_t out, int64_t ob, int64_t t0) {                             \
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
                __m512i wv = _mm512_loadu_si512((const void *)(wp + (((ob + g) * pairs + p) << 5)));            \
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
                __m256bh h = _mm512_cvtneps_pbh(_mm512_add_ps(acc[g][j], bias));                                \
                _mm256_storeu_si256((void *)(y + (t0 + j) * out + (ob + g) * LANES), (__m256i)h);              \
            }                                                                                                   \
        }                                                                                                       \
    }

DEFINE_TILE(4, 1)
DEFINE_TILE(4, 2)
DEFINE_TILE(4, 3)
DEFINE_TILE(4, 4)
DEFINE_TILE(1, 1)
DEFINE_TILE(1, 2)
DEFINE_TILE(1, 3)
DEFINE_TILE(1, 4)

#define T_TILE 4

static void tiles(const uint16_t *x, const uint16_t *wp, const uint16_t *b, uint16_t *y, int64_t rows, int64_t in,
                  int64_t out, int64_t ob, int64_t nb) {
    for (int64_t t0 = 0; t0 < rows; t0 += T_TILE) {
        int64_t nt = rows - t0 < T_TILE ? rows - t0 : T_TILE;
        if (nb == 4) {
            switch (nt) {
            case 1: tile_4x1(x, wp, b, y, in, out, ob, t0); break;
            case 2: tile_4x2(x, wp, b, y, in, out, ob, t0); break;
            case 3: tile_4x3(x, wp, b, y, in, out, ob, t0); break;
            default: tile_4x4(x, wp, b, y, in, out, ob, t0); break;
            }
        } else {
            for (int64_t g = 0; g < nb; g++) {
                switch (nt) {
                case 1: tile_1x1(x, wp, b, y, in, out, ob + g, t0); break;
                case 2: tile_1x2(x, wp, b, y, in, out, ob + g, t0); break;
                case 3: tile_1x3(x, wp, b, y, in, out, ob + g, t0); break;
                default: tile_1x4(x, wp, b, y, in, out, ob + g, t0); break;
                }
            }
        }
    }
}

void skinny_gemm_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *b, uint16_t *y, int64_t rows,
                      int64_t in, int64_t out) {
    const int64_t blocks = out / LANES;
#pragma omp parallel
    {
        /* An even, contiguous share of the output blocks per thread. */
        int64_t nthreads = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t begin = blocks * me / nthreads, end = blocks * (me + 1) / nthreads;
        int64_t ob = begin;
        for (; ob + 4 <= end; ob += 4) tiles(x, wp, b, y, rows, in, out, ob, 4);
        if (ob < end) tiles(x, wp, b, y, rows, in, out, ob, end - ob);
    }
}
