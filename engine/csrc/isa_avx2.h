/*
 * The 256-bit inner steps of decode_kernels.c: the avx2 variant (AVX2 + FMA,
 * x86-64-v3: Haswell+, Zen 1+). 8 float32 lanes, 16 ymm registers.
 *
 * The packed layout is the AVX-512 one, [out/16, in/2, 16, 2]: a 64-byte line
 * (16 outputs x 2 inputs) is two 32-byte halves, outputs 0-7 and 8-15, so one
 * block's accumulator is two ymm registers.
 *   bf16: x rows stay float32; each half is widened to float32 in registers (bf16
 *         is the top half of a float32: the even input is the pair shifted left by
 *         16, the odd one the pair with its low half cleared) and multiplied by
 *         two FMAs (odd input first, then even: vdpbf16ps's order).
 *   int8: x rows int16 (quantised per row, as on VNNI); a 16-byte half of a line
 *         is sign-extended to int16 and vpmaddwd multiplies it by the broadcast
 *         input pair, adding both products into one int32 lane: exact, like vpdpwssd.
 *   Q4_1: the nibbles zero-extended to int16 and multiplied like int8 weights,
 *         the float16 scales (F16C) applied once per 32-input group.
 */
#include <immintrin.h>

#define VL 8           /* float32 lanes of a vector */
/* Tiles of 2 blocks x 2 rows: 8 ymm accumulators + 4 for one block's widened line
 * + 2 for a broadcast x pair, within the 16 registers. Measured over the default
 * model's matrices (one thread, CPU time; bf16 16 rows / int8 16 rows): 2x2 56 / 38
 * ms, 4x1 62-72 / 43 ms, 1x4 60 / 61 ms, 2x4 (16 accumulators, spilled) 71-82 / 50 ms. */
#ifndef NB_TILE
#define NB_TILE 2 /* 16-output blocks per tile */
#endif
#ifndef T_TILE
#define T_TILE 2 /* rows per tile */
#endif
#ifndef Q4_NB_TILE
#define Q4_NB_TILE 4 /* Q4_1 tiles: 8 int32 group sums; measured 45 ms at 16 rows (one thread) against 48 for 1x4, 52 for 2x2 */
#endif
#ifndef Q4_T_TILE
#define Q4_T_TILE 1
#endif
#define ATTN_CHAINS 1  /* the 64-wide output row takes 8 ymm already */
#define ACC_VECS 2     /* vectors per 16-output accumulator: outputs 0-7, 8-15 */

typedef __m256 vf;
#define vf_zero() _mm256_setzero_ps()
#define vf_set1(f) _mm256_set1_ps(f)
#define vf_load(p) _mm256_loadu_ps(p)
#define vf_store(p, v) _mm256_storeu_ps(p, v)
#define vf_add(a, b) _mm256_add_ps(a, b)
#define vf_sub(a, b) _mm256_sub_ps(a, b)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_max(a, b) _mm256_max_ps(a, b)
#define vf_min(a, b) _mm256_min_ps(a, b)
#define vf_abs(a) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a)
#define vf_fmadd(a, b, c) _mm256_fmadd_ps(a, b, c) /* a * b + c, one rounding */
#define vf_div(a, b) _mm256_div_ps(a, b)
/* a where g >= 0, else b */
#define vf_select_nonneg(g, a, b) _mm256_blendv_ps(b, a, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ))

/* Lane sum in a fixed order: (L0 + L1) per 128-bit half, then pairs, then the two. */
static inline float vf_reduce_add(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float vf_reduce_max(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* lanes [0, n) set, n < 8 */
static inline __m256i tail_mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/* The first n (< VL) lanes of p, zeros after; and the matching store. */
static inline vf vf_load_tail(const float *p, int64_t n) { return _mm256_maskload_ps(p, tail_mask(n)); }
static inline void vf_store_tail(float *p, vf v, int64_t n) { _mm256_maskstore_ps(p, tail_mask(n), v); }
static inline vf vf_keep_first(vf v, int64_t n) { return _mm256_and_ps(v, _mm256_castsi256_ps(tail_mask(n))); }

/* 8 float32 (already clamped to the int16 range) -> int16, rounded to nearest even. */
static inline void vf_store_i16(int16_t *dst, vf v) {
    const __m256i i32 = _mm256_cvtps_epi32(v);
    _mm_storeu_si128((void *)dst, _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1)));
}

/* What exp's range reduction needs (the polynomial itself is shared, in decode_kernels.c):
 * x is clamped at -87 so that 2^n, built in the exponent field, stays a normal number: the
 * smallest weight is then ~1.6e-38 instead of 0, below what a float32 sum that contains
 * the maximum's weight 1 can register. */
#define EXP_FLOOR (-87.0f)
#define vf_fnmadd(a, b, c) _mm256_fnmadd_ps(a, b, c) /* c - a * b, one rounding */
#define vf_round(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vf vf_times_pow2(vf p, vf n) { /* p * 2^n for integral n in the normal range */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Lane sums of four vectors, (sum a, sum b, sum c, sum d), each summed in the same
 * order whichever slot it occupies: ((x0 + x2) + (x1 + x3)) within each 128-bit lane,
 * then L0 + L1. */
static inline __m128 hsum4(vf a, vf b, vf c, vf d) {
    __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b)); /* a0+a2 b0+b2 a1+a3 b1+b3 */
    __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    __m256d abd = _mm256_castps_pd(ab), cdd = _mm256_castps_pd(cd);
    __m256 abcd = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(abd, cdd)),
                                _mm256_castpd_ps(_mm256_unpackhi_pd(abd, cdd))); /* a b c d per 128-bit lane */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* ---- one 16-output block of finished float32 results: two ymm ------------------- */
typedef struct {
    __m256 lo, hi; /* outputs 0-7, 8-15 */
} blk;
static inline blk blk_zero(void) { return (blk){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline blk blk_add(blk a, blk b) { return (blk){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline blk blk_mul(blk a, blk b) { return (blk){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline blk blk_load_f32(const float *p) { return (blk){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
/* 8 bf16 -> float32 (exact: bf16 is the top half of a float32) */
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16));
}
static inline blk blk_load_bf16(const uint16_t *p) { return (blk){widen8(p), widen8(p + 8)}; }
/* float32 -> bf16 bits in the low half of each 32-bit lane, nearest even (NaN stays NaN) */
static inline __m256i to_bf16_lanes(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
static inline void blk_store(void *y, blk v, int y_f32) {
    if (y_f32) {
        _mm256_storeu_ps((float *)y, v.lo);
        _mm256_storeu_ps((float *)y + 8, v.hi);
    } else { /* packus interleaves 128-bit lanes (lo 0-3, hi 0-3, lo 4-7, hi 4-7); the permute restores order */
        const __m256i packed = _mm256_packus_epi32(to_bf16_lanes(v.lo), to_bf16_lanes(v.hi));
        _mm256_storeu_si256((void *)y, _mm256_permute4x64_epi64(packed, 0xD8));
    }
}

/* ---- float32 weights x float32 rows: the widened bf16 pairs and the dequantised
 * Q4_1 pairs both end here. One line = W[16 outputs][2 inputs] as four vectors. */
typedef const float *xv_f32; /* the input pair x[2p], x[2p + 1]: broadcast inside dot_f32, so that the
                                compiler does not hold every row's pair in registers at once */
static inline xv_f32 xload_f32(const float *row, int64_t p) { return row + 2 * p; }
typedef struct {
    __m256 even_lo, odd_lo, even_hi, odd_hi; /* W[l][2p], W[l][2p + 1] for l in 0-7, 8-15 */
} wv_f32;
typedef __m256 acc_f32;
#define acc_zero_f32() _mm256_setzero_ps()
/* acc[l] += W[l][2p + 1] x[2p + 1], then += W[l][2p] x[2p] (vdpbf16ps's order) */
static inline void dot_f32(acc_f32 *acc, xv_f32 x, wv_f32 w) {
    const __m256 even = _mm256_broadcast_ss(x), odd = _mm256_broadcast_ss(x + 1);
    acc[0] = _mm256_fmadd_ps(w.even_lo, even, _mm256_fmadd_ps(w.odd_lo, odd, acc[0]));
    acc[1] = _mm256_fmadd_ps(w.even_hi, even, _mm256_fmadd_ps(w.odd_hi, odd, acc[1]));
}
#define acc_to_blk_f32(acc, sx) ((void)(sx), (blk){(acc)[0], (acc)[1]})

/* ---- the bf16 product: one 64-byte line = W[16 outputs][2 inputs] ----------------- */
#define BF16_WIDENED 1 /* bf16 weights widened to float32: the float32 product's steps (decode_kernels.c) */
static inline wv_f32 wload_bf16(const uint16_t *line) {
    const __m256i lo = _mm256_loadu_si256((const void *)line), hi = _mm256_loadu_si256((const void *)(line + 16));
    const __m256i top = _mm256_set1_epi32((int)0xffff0000u);
    return (wv_f32){_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_and_si256(lo, top)),
                     _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)), _mm256_castsi256_ps(_mm256_and_si256(hi, top))};
}

/* ---- the int8 product: x rows int16, one 32-byte line = Q[16 outputs][2 inputs] --- */
typedef __m256i xv_i8; /* the int16 input pair in every 32-bit lane */
typedef struct {
    __m256i lo, hi; /* the line's halves sign-extended to int16 */
} wv_i8;
typedef __m256i acc_i8;
static inline xv_i8 xload_i8(const int16_t *row, int64_t p) { return _mm256_set1_epi32(((const int32_t *)row)[p]); }
static inline wv_i8 wload_i8(const int8_t *line) {
    return (wv_i8){_mm256_cvtepi8_epi16(_mm_loadu_si128((const void *)line)),
                   _mm256_cvtepi8_epi16(_mm_loadu_si128((const void *)(line + 16)))};
}
#define acc_zero_i8() _mm256_setzero_si256()
/* acc[l] += Q[l][2p] xq[2p] + Q[l][2p + 1] xq[2p + 1], exact in int32 */
static inline void dot_i8(acc_i8 *acc, xv_i8 x, wv_i8 w) {
    acc[0] = _mm256_add_epi32(acc[0], _mm256_madd_epi16(x, w.lo));
    acc[1] = _mm256_add_epi32(acc[1], _mm256_madd_epi16(x, w.hi));
}
static inline blk acc_to_blk_i8(const acc_i8 *acc, float sx) {
    const __m256 s = _mm256_set1_ps(sx);
    return (blk){_mm256_mul_ps(_mm256_cvtepi32_ps(acc[0]), s), _mm256_mul_ps(_mm256_cvtepi32_ps(acc[1]), s)};
}

/* ---- Q4_1 weights: integer dot products per 32-input group -----------------------
 * (layout: see isa_avx512.h and decode_kernels.c). The line of input pair c
 * (high = 0) or c + 8 (high = 1) as int16 [l][e], outputs 0-7 and 8-15. */
static inline wv_i8 q4_pair(const uint8_t *chunk, int high) {
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const void *)chunk));
    const __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const void *)(chunk + 16)));
    if (high) return (wv_i8){_mm256_srli_epi16(lo, 4), _mm256_srli_epi16(hi, 4)};
    const __m256i low4 = _mm256_set1_epi16(0x0f);
    return (wv_i8){_mm256_and_si256(lo, low4), _mm256_and_si256(hi, low4)};
}
/* acc += float(s) * (d * sx) + m * xsum (see isa_avx512.h) */
static inline void q4_fold(acc_f32 *acc, const acc_i8 *s, const uint8_t *block, float sx, float xsum) {
    const __m256 vsx = _mm256_set1_ps(sx), vsum = _mm256_set1_ps(xsum);
    for (int h = 0; h < 2; h++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(block + 16 * h)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(block + 32 + 16 * h)));
        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[h]), _mm256_mul_ps(d, vsx), acc[h]);
        acc[h] = _mm256_fmadd_ps(m, vsum, acc[h]);
    }
}
