/*
 * The 512-bit inner steps of decode_kernels.c (16 float32 lanes, 32 zmm registers).
 * Two variants come from this header, told apart by the compiler's flags:
 *
 *   avx512bf16 (-mavx512bf16 -mavx512vnni: CPUs with AVX512-BF16 and AVX512-VNNI):
 *     x rows rounded to bf16, one vdpbf16ps per 64-byte line of W (16 outputs x 2
 *     inputs, both products added into a float32 lane); int8 on vpdpwssd.
 *   avx512 (AVX-512F/BW/VL only):
 *     x rows stay float32; a line of W is widened to float32 in registers (bf16 is
 *     the top half of a float32: the even input is the pair shifted left by 16, the
 *     odd one the pair with its low half cleared) and multiplied by two FMAs; int8
 *     on vpmaddwd + vpaddd (what vpdpwssd fuses), exact int32 sums either way.
 * All three run Q4_1 weights as integers: the nibbles (unsigned bytes) times the
 * rows quantised to int8 per 16 inputs, four products per 32-bit lane (vpdpbusd on
 * VNNI, else vpmaddubsw + vpmaddwd), the float16 scales applied once per 32-input
 * group (q4_fold).
 *
 * Each ISA header (this one, isa_avx2.h) defines the same types, macros and inline steps for its own
 * instruction set, the one interface decode_kernels.c is written against: their sections are alike by design.
 */
#include <immintrin.h>

#define VL 16          /* float32 lanes of a vector */
/* Tiles of 4 blocks x 4 rows: 16 zmm accumulators. Chosen by measurement against 4x2, 2x4
 * and 4x1: docs/bench/2026-12-07-notes-from-kernels-and-model.md */
#ifndef NB_TILE
#define NB_TILE 4 /* 16-output blocks per tile */
#endif
#ifndef T_TILE
#define T_TILE 4 /* rows per tile */
#endif
#ifndef Q4_NB_TILE
#define Q4_NB_TILE 4 /* Q4_1 tiles: 16 int32 group sums + 16 float accumulators */
#endif
/* vdpbf16ps's bf16 tiles: 3 blocks x 8 rows (24 accumulators, 3 lines of W and a broadcast x
 * within the 32 registers), so a verification of up to 8 tokens reads each line of W once and
 * multiplies it into every row in one sweep, where 4x4 tiles swept the blocks twice for 5-8 rows
 * (the second sweep from L2, after the first had waited on memory). The widening avx512 variant
 * keeps 4x4 (3x8 is slower there). Chosen by measurement: docs/bench/2026-12-07-notes-from-kernels-and-model.md */
#if defined(__AVX512BF16__) && !defined(NB_TILE_bf16)
#define NB_TILE_bf16 3
#define T_TILE_bf16 8
#endif
/* With vdpbf16ps a pass of a few rows is bound by reading its weights, as a one-row pass is: passes of up to 4
 * rows stream one block at a time and leave the reading to the hardware prefetchers (STREAM_ROWS in
 * decode_kernels.c), where 3x8 tiles and the next group's lines requested have them read 3 streams at once;
 * from 5 rows on the tiles are quicker. Chosen by measurement: docs/bench/2026-12-07-notes-from-kernels-and-model.md */
#if defined(__AVX512BF16__) && !defined(STREAM_ROWS_bf16)
#define STREAM_ROWS_bf16 4
#endif
/* The same for Q4_1 on VNNI (the q4 drafter's passes of a few rows: drafts of drafts checking a copying
 * drafter's proposals). Chosen by measurement: docs/bench/2026-12-07-notes-from-kernels-and-model.md */
#if defined(__AVX512VNNI__) && !defined(STREAM_ROWS_q4)
#define STREAM_ROWS_q4 4
#endif
#ifndef Q4_T_TILE
#define Q4_T_TILE 4
#endif
#define ATTN_CHAINS 2  /* independent output accumulators in attention (even/odd keys) */
#define ACC_VECS 1     /* vectors per 16-output accumulator */

typedef __m512 vf;
#define vf_zero() _mm512_setzero_ps()
#define vf_set1(f) _mm512_set1_ps(f)
#define vf_load(p) _mm512_loadu_ps(p)
#define vf_store(p, v) _mm512_storeu_ps(p, v)
#define vf_add(a, b) _mm512_add_ps(a, b)
#define vf_sub(a, b) _mm512_sub_ps(a, b)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_max(a, b) _mm512_max_ps(a, b)
#define vf_min(a, b) _mm512_min_ps(a, b)
#define vf_abs(a) _mm512_abs_ps(a)
#define vf_fmadd(a, b, c) _mm512_fmadd_ps(a, b, c) /* a * b + c, one rounding */
#define vf_div(a, b) _mm512_div_ps(a, b)
/* a where g >= 0, else b */
#define vf_select_nonneg(g, a, b) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), b, a)
#define vf_reduce_add(v) _mm512_reduce_add_ps(v)  /* a fixed tree: same order every call */
#define vf_reduce_max(v) _mm512_reduce_max_ps(v)

/* The first n (< VL) lanes of p, zeros after; and the matching store. */
static inline vf vf_load_tail(const float *p, int64_t n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
}
static inline void vf_store_tail(float *p, vf v, int64_t n) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), v);
}
static inline vf vf_keep_first(vf v, int64_t n) { return _mm512_maskz_mov_ps((__mmask16)((1u << n) - 1u), v); }

/* 16 float32 (already clamped to the int16 range) -> int16, rounded to nearest even. */
static inline void vf_store_i16(int16_t *dst, vf v) {
    _mm256_storeu_si256((void *)dst, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v)));
}

/* 16 float32 (already clamped to the int8 range) -> int8, rounded to nearest even. */
static inline void vf_store_i8(int8_t *dst, vf v) {
    _mm_storeu_si128((void *)dst, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
}

/* What exp's range reduction needs (the polynomial itself is shared, in decode_kernels.c):
 * 2^n by scalef, which also handles subnormal results; below ~-87 the weight underflows to 0. */
#define EXP_FLOOR (-104.0f)
#define vf_fnmadd(a, b, c) _mm512_fnmadd_ps(a, b, c) /* c - a * b, one rounding */
#define vf_round(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vf_times_pow2(p, n) _mm512_scalef_ps(p, n) /* p * 2^n */

/* Lane sums of four vectors, (sum a, sum b, sum c, sum d), each summed in the same
 * order whichever slot it occupies: ((x0 + x2) + (x1 + x3)) within each 128-bit lane,
 * then (L0 + L2) + (L1 + L3) across lanes. */
static inline __m128 hsum4(vf a, vf b, vf c, vf d) {
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

/* ---- one 16-output block of finished float32 results ---------------------------- */
typedef __m512 blk;
#define blk_zero() _mm512_setzero_ps()
#define blk_add(a, b) _mm512_add_ps(a, b)
#define blk_mul(a, b) _mm512_mul_ps(a, b)
#define blk_load_f32(p) _mm512_loadu_ps(p)
/* 16 bf16 -> float32 (exact: bf16 is the top half of a float32) */
static inline blk blk_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
}
#define vf_load_bf16(p) blk_load_bf16(p) /* (a bf16 KV cache's rows) */
/* float32 -> bf16, nearest even (NaN stays NaN) */
static inline __m256i to_bf16(blk v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
#endif
}
static inline void blk_store(void *y, blk v, int y_f32) {
    if (y_f32)
        _mm512_storeu_ps((float *)y, v);
    else
        _mm256_storeu_si256((void *)y, to_bf16(v));
}

/* ---- float32 weights x float32 rows: the widened bf16 pairs and the dequantised
 * Q4_1 pairs both end here. One line = W[16 outputs][2 inputs] as two vectors. */
typedef struct {
    __m512 even, odd; /* x[2p], x[2p + 1] broadcast */
} xv_f32;
typedef struct {
    __m512 even, odd; /* W[l][2p], W[l][2p + 1] for l in 0-15 */
} wv_f32;
typedef __m512 acc_f32;
static inline xv_f32 xload_f32(const float *row, int64_t p) {
    return (xv_f32){_mm512_set1_ps(row[2 * p]), _mm512_set1_ps(row[2 * p + 1])};
}
#define acc_zero_f32() _mm512_setzero_ps()
/* acc[l] += W[l][2p + 1] x[2p + 1], then += W[l][2p] x[2p] (vdpbf16ps's order) */
static inline void dot_f32(acc_f32 *acc, xv_f32 x, wv_f32 w) {
    acc[0] = _mm512_fmadd_ps(w.even, x.even, _mm512_fmadd_ps(w.odd, x.odd, acc[0]));
}
#define acc_to_blk_f32(acc, sx) ((void)(sx), (acc)[0])

/* ---- the bf16 product: one 64-byte line = W[16 outputs][2 inputs] ----------------- */
#ifdef __AVX512BF16__
#define X_ROWS_BF16 1 /* x rows are rounded to bf16 for vdpbf16ps */
typedef uint16_t xel_bf16;
typedef __m512i xv_bf16; /* the input pair (bf16, bf16) in every 32-bit lane */
typedef __m512i wv_bf16;
typedef __m512 acc_bf16;
static inline xv_bf16 xload_bf16(const xel_bf16 *row, int64_t p) {
    return _mm512_set1_epi32(((const int32_t *)row)[p]);
}
static inline wv_bf16 wload_bf16(const uint16_t *line) { return _mm512_loadu_si512(line); }
#define acc_zero_bf16() _mm512_setzero_ps()
/* acc[l] += W[l][2p + 1] x[2p + 1] + W[l][2p] x[2p] (each product exact in float32) */
static inline void dot_bf16(acc_bf16 *acc, xv_bf16 x, wv_bf16 w) {
    acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)x, (__m512bh)w);
}
/* float32 row -> the kernel's bf16 row (nearest even) */
static inline void store_row_bf16(const float *src, xel_bf16 *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((void *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm256_mask_storeu_epi16(dst + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i)));
    }
}
#define acc_to_blk_bf16(acc, sx) ((void)(sx), (acc)[0])
#else
#define BF16_WIDENED 1 /* bf16 weights widened to float32: the float32 product's steps (decode_kernels.c) */
static inline wv_f32 wload_bf16(const uint16_t *line) {
    const __m512i w = _mm512_loadu_si512(line);
    return (wv_f32){_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
                     _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)))};
}
#endif

/* ---- the int8 product: x rows int16, one 32-byte line = Q[16 outputs][2 inputs] --- */
typedef __m512i xv_i8; /* the int16 input pair in every 32-bit lane */
typedef __m512i wv_i8; /* the line sign-extended to int16 */
typedef __m512i acc_i8;
static inline xv_i8 xload_i8(const int16_t *row, int64_t p) { return _mm512_set1_epi32(((const int32_t *)row)[p]); }
static inline wv_i8 wload_i8(const int8_t *line) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)line)); }
#define acc_zero_i8() _mm512_setzero_si512()
#define acc_add_i8(a, b) _mm512_add_epi32(a, b)
/* acc[l] += Q[l][2p] xq[2p] + Q[l][2p + 1] xq[2p + 1], exact in int32 */
static inline void dot_i8(acc_i8 *acc, xv_i8 x, wv_i8 w) {
#ifdef __AVX512VNNI__
    acc[0] = _mm512_dpwssd_epi32(acc[0], x, w);
#else
    acc[0] = _mm512_add_epi32(acc[0], _mm512_madd_epi16(x, w));
#endif
}
static inline blk acc_to_blk_i8(const acc_i8 *acc, float sx) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(acc[0]), _mm512_set1_ps(sx));
}

/* ---- Q4_1 weights: unsigned x signed byte dot products per 32-input group ---------
 * A 16-output x 32-input block (320 bytes, see decode_kernels.c): d[16], m[16]
 * float16, then 4 chunks of 64 bytes, chunk c byte [l][e] = q[l][4c + e] |
 * q[l][4c + 16 + e] << 4: masked, the low nibbles are the 16 outputs' weights of
 * inputs 4c .. 4c + 3, shifted, the high ones those of inputs 16 + 4c .. 16 + 4c + 3,
 * as bytes [l][e] -- one 32-bit lane per output, four inputs each, what vpdpbusd
 * takes. The row's four int8 inputs of that quad are broadcast to every lane. */
typedef __m512i xv_q4;
typedef __m512i wv_q4;
static inline xv_q4 xload_q4(const int8_t *quad) {
    int32_t four;
    memcpy(&four, quad, sizeof four);
    return _mm512_set1_epi32(four);
}
static inline void q4_nibbles(const uint8_t *chunk, wv_q4 *lo, wv_q4 *hi) {
    const __m512i z = _mm512_loadu_si512((const void *)chunk), low4 = _mm512_set1_epi8(0x0f);
    lo[0] = _mm512_and_si512(z, low4);
    hi[0] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low4);
}
/* acc[l] += sum_e w[l][e] x[e], w in 0..15 and x in -127..127: exact in int32 on VNNI; without it as int16
 * pair sums (vpmaddubsw's are at most 2 * 15 * 127 = 3810 in size, a half group's 4 chunks at most 15240:
 * inside int16), widened to int32 once per group by q4_sum_ps (isa_avx2.h says why). */
static inline void dot_q4(acc_i8 *acc, xv_q4 x, const wv_q4 *w) {
#ifdef __AVX512VNNI__
    acc[0] = _mm512_dpbusd_epi32(acc[0], w[0], x);
#else
    acc[0] = _mm512_add_epi16(acc[0], _mm512_maddubs_epi16(w[0], x));
#endif
}
/* A half group's sums (dot_q4) as float32, one per output: exact. */
static inline __m512 q4_sum_ps(__m512i sums) {
#ifdef __AVX512VNNI__
    return _mm512_cvtepi32_ps(sums);
#else
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(sums, _mm512_set1_epi16(1)));
#endif
}
/* acc += float(lo) * (d * sx_lo) + float(hi) * (d * sx_hi) + m * xsum, lo and hi the exact int32 sums of q * xq
 * over each half of the group (|sum| <= 15 * 127 * 16 < 2^24: exact in float32), rec = [sx_lo, sx_hi, xsum], xsum
 * the group's sum of sx * xq. */
static inline void q4_fold(acc_f32 *acc, const acc_i8 *lo, const acc_i8 *hi, const uint8_t *block, const float *rec) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)block));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(block + 32)));
    acc[0] = _mm512_fmadd_ps(q4_sum_ps(lo[0]), _mm512_mul_ps(d, _mm512_set1_ps(rec[0])), acc[0]);
    acc[0] = _mm512_fmadd_ps(q4_sum_ps(hi[0]), _mm512_mul_ps(d, _mm512_set1_ps(rec[1])), acc[0]);
    acc[0] = _mm512_fmadd_ps(m, _mm512_set1_ps(rec[2]), acc[0]);
}
/* Q4_1B's fold (decode_kernels.c): the block's head is dc[16], mc[16] bytes, d = dc * dstep (per output: the
 * tile's scale applies dstep once at the end) and m = -d mc / 16, so acc += float(dc) * (float(lo) * sx_lo +
 * float(hi) * sx_hi - float(mc) * xsum / 16). */
static inline void q4b_fold(acc_f32 *acc, const acc_i8 *lo, const acc_i8 *hi, const uint8_t *block, const float *rec) {
    const __m512 dc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)block)));
    const __m512 mc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(block + 16))));
    __m512 t = _mm512_mul_ps(q4_sum_ps(lo[0]), _mm512_set1_ps(rec[0]));
    t = _mm512_fmadd_ps(q4_sum_ps(hi[0]), _mm512_set1_ps(rec[1]), t);
    t = _mm512_fnmadd_ps(mc, _mm512_set1_ps(rec[2] * 0.0625f), t);
    acc[0] = _mm512_fmadd_ps(dc, t, acc[0]);
}
