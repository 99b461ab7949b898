/*
 * The 256-bit inner steps of decode_kernels.c: the avx2 variant (AVX2 + FMA,
 * x86-64-v3). 8 float32 lanes, 16 ymm registers.
 *
 * The packed layout is the AVX-512 one, [out/16, in/2, 16, 2]: a 64-byte line
 * (16 outputs x 2 inputs) is two 32-byte halves, outputs 0-7 and 8-15, so one
 * block's accumulator is two ymm registers (four for bf16: even and odd inputs apart).
 *   bf16: x rows stay float32; each half is widened to float32 in registers by two
 *         unpacks with zero (bf16 is the top half of a float32) and multiplied by
 *         the broadcast input pair, the even and odd inputs summed apart and added
 *         at the end (see "the bf16 product" below for why).
 *   int8: x rows int16 (quantised per row, as on VNNI); a 16-byte half of a line
 *         is sign-extended to int16 and vpmaddwd multiplies it by the broadcast
 *         input pair, adding both products into one int32 lane: exact, like vpdpwssd.
 *   Q4_1: x rows int8 per 16 inputs; vpmaddubsw multiplies the nibbles (unsigned
 *         bytes) by the broadcast quad of inputs in int16 pairs, summed in int16 over a
 *         half group and added into int32 lanes by vpmaddwd by ones once per group
 *         (exact), the float16 scales (F16C; Q4_1B: bytes) applied once per 32-input group.
 *
 * Each ISA header (this one, isa_avx512.h) defines the same types, macros and inline steps for its own
 * instruction set, the one interface decode_kernels.c is written against: their sections are alike by design.
 */
#include <immintrin.h>

#define VL 8           /* float32 lanes of a vector */
/* int8 tiles of 2 blocks x 2 rows: 8 ymm accumulators + 4 for one block's widened line
 * + 2 for a broadcast x pair, within the 16 registers (2x4, 16 accumulators, spills).
 * Chosen by measurement against 4x1, 1x4 and 2x4: docs/bench/2026-12-07-notes-from-kernels-and-model.md.
 * The bf16 tile is its own (NB_TILE_bf16 below). */
#ifndef NB_TILE
#define NB_TILE 2 /* 16-output blocks per tile */
#endif
#ifndef T_TILE
#define T_TILE 2 /* rows per tile */
#endif
/* Q4_1 tiles of 4 blocks x 1 row: 8 int32 group sums. Chosen by measurement against 1x4 and 2x2:
 * docs/bench/2026-12-07-notes-from-kernels-and-model.md */
#ifndef Q4_NB_TILE
#define Q4_NB_TILE 4
#endif
#ifndef Q4_T_TILE
#define Q4_T_TILE 1
#endif
/* A one-row tile's four chunks per group unrolled by two, not four: four keep every chunk's nibbles and
 * products live at once and GCC spills a dozen of them to the stack per group (16 ymm registers). The tiles
 * of 4 and 7 rows keep four (quicker there); avx512 holds them in its 32 registers either way. Chosen by
 * measurement: docs/bench/2026-12-07-notes-from-kernels-and-model.md */
#ifndef Q4_ONE_UNROLL
#define Q4_ONE_UNROLL _Pragma("GCC unroll 2")
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
/* 8 float32 (already clamped to the int8 range) -> int8, rounded to nearest even. */
static inline void vf_store_i8(int8_t *dst, vf v) {
    const __m256i i = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64((void *)dst, _mm_packs_epi16(w, w));
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
#define vf_load_bf16(p) widen8(p) /* (a bf16 KV cache's rows) */
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

/* ---- float32 accumulators of 16 outputs (Q4_1's group sums fold into these) ------ */
typedef __m256 acc_f32;
#define acc_zero_f32() _mm256_setzero_ps()
#define acc_to_blk_f32(acc, sx) ((void)(sx), (blk){(acc)[0], (acc)[1]})

/* ---- the bf16 product: one 64-byte line = W[16 outputs][2 inputs] -----------------
 * Taken in two parts of 32 bytes (outputs 0-7, then 8-15), each widened by two unpacks
 * with zero (bf16 is the top half of a float32):
 *   unpacklo -> [W0e W0o W1e W1o | W4e W4o W5e W5o],  unpackhi -> [W2e W2o W3e W3o | W6e ...]
 * (e, o: inputs 2p, 2p + 1; the unpacks work within 128-bit lanes) and multiplied by the
 * input pair broadcast as 64 bits, [x2p x2p+1 x2p x2p+1 ...], one FMA each. So a block
 * has four accumulators (ACC_VECS_bf16) whose lanes each hold one output's sum over the
 * even or the odd inputs, every one a chain of one FMA per pair; at the end a horizontal
 * add pairs them in output order: y[l] = sum_even[l] + sum_odd[l].
 *
 * Why not one chain per output (the pair's two FMAs in a row, as avx512 does): that chain
 * is two FMA latencies per pair, and 16 ymm registers cannot hold enough chains to cover
 * it: the accumulators wait, and a wide pass runs far below the FMA peak. Here every
 * accumulator is a chain of one FMA per pair (4 cycles of latency), so the 8 of a 1-block x
 * 2-row tile keep two FMA pipes busy, and a part needs two registers for the weights and
 * one for x. The unpacks run on the shuffle port, not the FMA ones (Intel), where the
 * shift-and-mask widening took FMA slots. The order of every sum is the same whatever
 * the tile and the pass width: row invariance holds. */
#define BF16_UNPACKED 1
#define ACC_VECS_bf16 4 /* per block: unpacklo / unpackhi sums of outputs 0-7, then of 8-15 */
#define W_PARTS_bf16 2
/* 1 block x 2 rows: 8 chains, 8 FMAs per pair; 1x3 (12 chains) spills two accumulators to the
 * stack (GCC keeps the three broadcasts across both parts). Chosen by measurement against the
 * shift-and-mask 2x2 tile and 1x3: docs/bench/2026-12-07-notes-from-kernels-and-model.md */
#ifndef NB_TILE_bf16
#define NB_TILE_bf16 1
#endif
#ifndef T_TILE_bf16
#define T_TILE_bf16 2
#endif
/* An odd row left over (a verification of K = 6 drafts: 7 rows) runs as 2 blocks x 1 row: 8
 * chains, as a 1x2 tile has, where 1 block x 1 row kept only 4 and ran at half the FMA rate
 * (decode_kernels.c, DEFINE_DRIVER). */
#ifndef TAIL_NB_bf16
#define TAIL_NB_bf16 2
#endif
typedef const float *xv_bf16; /* the row's input pair, broadcast inside dot_part_bf16 (registers are scarce) */
static inline xv_bf16 xload_bf16(const float *row, int64_t p) { return row + 2 * p; }
typedef struct {
    __m256 lo, hi; /* unpacklo, unpackhi of a part */
} wv_bf16;
typedef __m256 acc_bf16;
#define acc_zero_bf16() _mm256_setzero_ps()
static inline wv_bf16 wload_part_bf16(const uint16_t *line, int part) {
    const __m256i w = _mm256_loadu_si256((const void *)(line + 16 * part)), zero = _mm256_setzero_si256();
    return (wv_bf16){_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w)),
                     _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w))};
}
/* acc[2 part + i][lane] += W x over the lane's (output, input) of the part */
static inline void dot_part_bf16(acc_bf16 *acc, xv_bf16 x, wv_bf16 w, int part) {
    const __m256 pair = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)x));
    acc[2 * part] = _mm256_fmadd_ps(w.lo, pair, acc[2 * part]);
    acc[2 * part + 1] = _mm256_fmadd_ps(w.hi, pair, acc[2 * part + 1]);
}
#define acc_to_blk_bf16(acc, sx) ((void)(sx), (blk){_mm256_hadd_ps((acc)[0], (acc)[1]), _mm256_hadd_ps((acc)[2], (acc)[3])})

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
#define acc_add_i8(a, b) _mm256_add_epi32(a, b)
/* acc[l] += Q[l][2p] xq[2p] + Q[l][2p + 1] xq[2p + 1], exact in int32 */
static inline void dot_i8(acc_i8 *acc, xv_i8 x, wv_i8 w) {
    acc[0] = _mm256_add_epi32(acc[0], _mm256_madd_epi16(x, w.lo));
    acc[1] = _mm256_add_epi32(acc[1], _mm256_madd_epi16(x, w.hi));
}
static inline blk acc_to_blk_i8(const acc_i8 *acc, float sx) {
    const __m256 s = _mm256_set1_ps(sx);
    return (blk){_mm256_mul_ps(_mm256_cvtepi32_ps(acc[0]), s), _mm256_mul_ps(_mm256_cvtepi32_ps(acc[1]), s)};
}

/* ---- Q4_1 weights: unsigned x signed byte dot products per 32-input group ---------
 * (layout: see isa_avx512.h and decode_kernels.c). A 64-byte chunk's first half holds
 * outputs 0-7, its second outputs 8-15, four inputs per 32-bit lane. */
typedef __m256i xv_q4;
typedef __m256i wv_q4;
static inline xv_q4 xload_q4(const int8_t *quad) {
    int32_t four;
    memcpy(&four, quad, sizeof four);
    return _mm256_set1_epi32(four);
}
static inline void q4_nibbles(const uint8_t *chunk, wv_q4 *lo, wv_q4 *hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < 2; h++) {
        const __m256i z = _mm256_loadu_si256((const void *)(chunk + 32 * h));
        lo[h] = _mm256_and_si256(z, low4);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low4);
    }
}
/* acc[l] += sum_e w[l][e] x[e] (w in 0..15, x in -127..127) as int16 pair sums: vpmaddubsw's are at most
 * 2 * 15 * 127 = 3810 in size, and the 4 chunks of a half group add up to at most 15240, inside int16: exact.
 * The folds widen them to int32 once per group (vpmaddwd by ones), where widening every chunk's products takes
 * a vpmaddwd and a vpaddd more per 32 bytes. Chosen by measurement: docs/kernels.md,
 * docs/bench/2026-12-07-notes-from-kernels-and-model.md */
static inline void dot_q4(acc_i8 *acc, xv_q4 x, const wv_q4 *w) {
    acc[0] = _mm256_add_epi16(acc[0], _mm256_maddubs_epi16(w[0], x));
    acc[1] = _mm256_add_epi16(acc[1], _mm256_maddubs_epi16(w[1], x));
}
/* A half group's int16 pair sums (dot_q4) as float32, one per output: exact (|sum| <= 15240). */
static inline __m256 q4_sum_ps(__m256i pairs) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
/* acc += float(lo) * (d * sx_lo) + float(hi) * (d * sx_hi) + m * xsum, rec = [sx_lo, sx_hi, xsum] (see isa_avx512.h) */
static inline void q4_fold(acc_f32 *acc, const acc_i8 *lo, const acc_i8 *hi, const uint8_t *block, const float *rec) {
    const __m256 slo = _mm256_set1_ps(rec[0]), shi = _mm256_set1_ps(rec[1]), vsum = _mm256_set1_ps(rec[2]);
    for (int h = 0; h < 2; h++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(block + 16 * h)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(block + 32 + 16 * h)));
        acc[h] = _mm256_fmadd_ps(q4_sum_ps(lo[h]), _mm256_mul_ps(d, slo), acc[h]);
        acc[h] = _mm256_fmadd_ps(q4_sum_ps(hi[h]), _mm256_mul_ps(d, shi), acc[h]);
        acc[h] = _mm256_fmadd_ps(m, vsum, acc[h]);
    }
}
/* Q4_1B's fold (decode_kernels.c; isa_avx512.h's q4b_fold): acc += float(dc) * (float(lo) * sx_lo + float(hi) *
 * sx_hi - float(mc) * xsum / 16), dc and mc the block's head bytes. */
static inline void q4b_fold(acc_f32 *acc, const acc_i8 *lo, const acc_i8 *hi, const uint8_t *block, const float *rec) {
    const __m256 slo = _mm256_set1_ps(rec[0]), shi = _mm256_set1_ps(rec[1]), vsum = _mm256_set1_ps(rec[2] * 0.0625f);
    for (int h = 0; h < 2; h++) {
        const __m256 dc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(block + 8 * h))));
        const __m256 mc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(block + 16 + 8 * h))));
        __m256 t = _mm256_mul_ps(q4_sum_ps(lo[h]), slo);
        t = _mm256_fmadd_ps(q4_sum_ps(hi[h]), shi, t);
        t = _mm256_fnmadd_ps(mc, vsum, t);
        acc[h] = _mm256_fmadd_ps(dc, t, acc[h]);
    }
}
