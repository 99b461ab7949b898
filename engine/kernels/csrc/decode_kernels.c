/*
 * Decoding kernels for x86-64 CPUs (built by engine/kernels/cpu_build.py, called from engine/kernels/cpu_calls.py
 * through ctypes):
 *
 *   skinny_gemm_bf16:  y = x W^T (+ b), W bf16   (the bf16 target)
 *   skinny_gemm_int8w: y = (x Q^T) * scale (+ b), Q int8 per output channel (the int8 drafter)
 *   skinny_gemm_q4_1:  y = x W^T (+ b), W in GGUF's Q4_1 (the q4 drafter)
 *   skinny_gemm_q4_1b: the same with Q4_1B blocks: Q4_1's nibbles, its scales in bytes (the q4 drafter)
 *   head_q4_rescored:  the q4 drafter's output projection: Q4_1 or Q4_1B, its best outputs again in int8
 *   attend_few:        attention of a pass's new tokens over the KV cache (causal or tree mask)
 *   rope_and_store:    rotary embedding + KV-cache write
 *   swiglu_rows:       silu(gate) * up
 *   decode_layers:     every decoder layer of a pass in one call (the above, in order)
 *   top_rows:          each row's best entries (the events' top alternatives)
 *   greedy_chain:      a greedy drafter's n one-token passes and their argmax in one call
 *   sampled_chain:     the same with each pass's token drawn from q = softmax(logits / T)
 *
 * One source, compiled once per instruction set into its own library; everything
 * here (the tiling, the prologues, attention) is shared, and the per-ISA inner
 * steps (vector width, loading/widening a line of weights, the multiply-add, exp,
 * reductions) come from one header, chosen by the compiler's flags:
 *
 *   avx512bf16  isa_avx512.h with -mavx512bf16 -mavx512vnni: vdpbf16ps / vpdpwssd
 *   avx512      isa_avx512.h, AVX-512F/BW/VL only: bf16 widened to float32, FMA / vpmaddwd
 *   avx2        isa_avx2.h, AVX2 + FMA: the same on 8-lane vectors
 *
 * The matrix products:
 *
 *   x:  [T, in]               float32 or bf16, row-major (T = tokens in the pass: 1 for
 *                             plain decoding, K + 1 when verifying K drafts)
 *   wp: [out/16, in/2, 16, 2] W packed once at load time: wp[ob, p, l, e] = W[16 ob + l, 2 p + e]
 *                             (the same layout for every variant)
 *   b:  [out]                 bf16 or NULL
 *   y:  [T, out]              float32 or bf16, row-major
 *   (out a multiple of 16, in a multiple of 2: the caller pads with zeros.)
 *
 * Decoding is memory bound: every weight byte is read once per pass and used
 * for only T multiply-adds. The kernels stream the packed weights once per call
 * and keep the T rows of x close (L1/L2), so a 16-token pass reads the bytes a
 * 1-token pass reads.
 *
 * One line of wp (64 bytes of bf16, 32 of int8) holds 16 outputs x 2 inputs. It
 * is multiplied by the matching input pair of x (broadcast) and both products are
 * added into a per-output accumulator lane, so the accumulators hold finished dot
 * products with no horizontal reduction (avx2 sums the even and odd inputs apart
 * and adds the two at the end: isa_avx2.h). Each output y[t][o] is accumulated over
 * the input pairs in the same order whatever T is and whichever tile (o, t) lands
 * in, then scaled, the bias added (and rounded to bf16, nearest even, for bf16 y):
 * the result for a row of x does not depend on the other rows in the call, so a
 * token verified in a K-token pass gets bit for bit the product a one-token pass
 * gives it. (Variants differ from each other in the last bits -- avx512bf16 rounds
 * x to bf16, the widening variants keep it float32 -- but each is row-invariant.)
 *
 * Threads: a pass runs in one OpenMP region (task_pool.h says why not one per product),
 * and the 16-output blocks of each product are cut into one contiguous range
 * per thread, a thread that is done taking what a late one has not begun (stealing). The team is libgomp's, torch's
 * already-loaded runtime (linked by its soname), so torch.set_num_threads applies.
 */
#include <omp.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "task_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "isa_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "isa_avx2.h"
#else
#error "compile with -mavx2 -mfma, or -mavx512f -mavx512bw -mavx512vl (+ -mavx512bf16 -mavx512vnni)"
#endif

#if defined(BF16_WIDENED) || defined(BF16_UNPACKED) /* no bf16 dot product: x rows stay float32 */
#define X_ROWS_BF16 0
typedef float xel_bf16;
static inline void store_row_bf16(const float *src, xel_bf16 *dst, int64_t n) {
    if (src != dst) memcpy(dst, src, sizeof(float) * n);
}
#endif
#ifdef BF16_WIDENED /* the bf16 weights go through the float32 steps (BF16_UNPACKED: the header's own) */
typedef xv_f32 xv_bf16;
typedef wv_f32 wv_bf16;
typedef acc_f32 acc_bf16;
#define xload_bf16 xload_f32
#define acc_zero_bf16 acc_zero_f32
#define dot_bf16 dot_f32
#define acc_to_blk_bf16 acc_to_blk_f32
#endif

/* exp(x) for x <= 0 (softmax after subtracting the max), the same arithmetic on every ISA:
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for accuracy), exp(r) by its degree-7
 * Taylor polynomial in Horner form (relative error < 2e-7, about float32 rounding), times 2^n.
 * EXP_FLOOR and vf_times_pow2 come from the ISA header. */
static inline vf vf_exp_neg(vf x) {
    x = vf_max(x, vf_set1(EXP_FLOOR));
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693145751953125f), x);
    r = vf_fnmadd(n, vf_set1(1.42860682030941723212e-6f), r);
    static const float coefficients[] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    vf p = vf_set1(1.0f / 5040.0f);
    for (int i = 0; i < 7; i++) p = vf_fmadd(p, r, vf_set1(coefficients[i]));
    return vf_times_pow2(p, n);
}

#define LANES 16 /* outputs per packed block */

/* What a kind may override in the ISA header (else one vector group per block, one
 * part per line, the header's common tile): its accumulator vectors per block, the
 * parts a line is taken in (wload_part/dot_part: one part's registers at a time),
 * and its tile. */
#ifndef ACC_VECS_bf16
#define ACC_VECS_bf16 ACC_VECS
#endif
#ifndef W_PARTS_bf16
#define W_PARTS_bf16 1
#define wload_part_bf16(line, part) wload_bf16(line)
#define dot_part_bf16(acc, x, w, part) dot_bf16(acc, x, w)
#endif
#ifndef NB_TILE_bf16
#define NB_TILE_bf16 NB_TILE
#endif
#ifndef T_TILE_bf16
#define T_TILE_bf16 T_TILE
#endif
#ifndef TAIL_NB_bf16
#define TAIL_NB_bf16 1 /* blocks per tile of the rows left over by the row tiles (see DEFINE_DRIVER) */
#endif
#define TAIL_NB_i8 1
#define TAIL_NB_q4 1
#define TAIL_NB_q4b 1
#define ACC_VECS_i8 ACC_VECS
#define W_PARTS_i8 1
#define wload_part_i8(line, part) wload_i8(line)
#define dot_part_i8(acc, x, w, part) dot_i8(acc, x, w)
#define NB_TILE_i8 NB_TILE
#define T_TILE_i8 T_TILE
#define ACC_VECS_q4 ACC_VECS
#define NB_TILE_q4 Q4_NB_TILE
#define T_TILE_q4 Q4_T_TILE
#define ACC_VECS_q4b ACC_VECS
#define NB_TILE_q4b Q4_NB_TILE
#define T_TILE_q4b Q4_T_TILE

/* The three kinds of weights share one tiled loop; the ISA header says what a line
 * of W does for each (KIND = bf16, i8 or q4):
 *   xel_KIND            element of the kernel's x rows (bf16/float32 for bf16, int16 for i8,
 *                       int8 for q4)
 *   xload_KIND(row, p)  input pair p of a row, broadcast (q4: a quad of inputs, see below)
 *   wload_part_KIND(line, part)  part `part` of a line of W (W_PARTS_KIND parts; most kinds take
 *                       the line whole, wload_KIND), loaded (and widened); q4: q4_nibbles, see below
 *   acc_KIND            a vector of accumulators; ACC_VECS_KIND of them hold a block's 16 outputs
 *   dot_part_KIND(acc, x, w, part)  acc[l] += W[l][2p] x[2p] + W[l][2p + 1] x[2p + 1] for the
 *                       part's outputs, in place (avx2 bf16 keeps the even and odd products in
 *                       lanes of their own, added by acc_to_blk)
 *   acc_to_blk_KIND     the accumulators as 16 float32 (int8: times the row's scale sx)
 * (Accumulators are plain arrays of vectors, not structs: GCC kept an array of
 * structs in memory, spilling every accumulator once per input pair.)
 *
 * Q4_1 (the GGUF's kind: blocks of 32 weights along the input, w = d q + m with q
 * in 0..15 and float16 d, m) is packed per 16-output block and 32-input group as
 * Q4_BLOCK bytes: d[16] and m[16] float16, then 4 chunks of 64 bytes, chunk c byte
 * [l][e] = q[l][4c + e] | q[l][4c + 16 + e] << 4 (the low nibbles are inputs 4c ..
 * 4c + 3 of the group, the high ones inputs 16 + 4c .. 16 + 4c + 3: four inputs of
 * one output per 32-bit lane), so wp is [out/16, in/32, 320 bytes]: 0.625 bytes per
 * weight against bf16's 2. The rows of x are quantised per 16 inputs to int8 (x ~=
 * sx xq, |xq| <= 127, one scale for each half of a group: llama.cpp's Q8 rows take one
 * per 32), the masked or shifted nibbles are unsigned bytes, and one vpdpbusd (VNNI;
 * else vpmaddubsw + vpmaddwd) adds four products into each output's int32 lane
 * exactly; per group, y += s_lo * d * sx_lo + s_hi * d * sx_hi + m * sum(sx xq)
 * (q4_fold): sum_i (d q_i + m) x_i over the quantised x, with q_i xq_i and xq_i summed
 * exactly. One scale per 16 inputs is chosen by measurement, against int16 rows and int8
 * rows per 8 or 32 inputs (docs/bench/2026-12-07-notes-from-kernels-and-model.md): every line
 * dequantised to float32 (two FMAs per line for d q + m, two conversions) makes one-row
 * passes compute bound, and the nibbles zero-extended to int16 against int16 rows
 * (vpdpwssd, two products per lane) make passes of a few rows compute bound.
 *
 * Q4_1B (the q4 drafter's blocks: PackedQ4_1BWeight) keeps Q4_1's nibbles and layout and codes
 * the block's two scales in a byte each: d = dc dstep[o] with dc in 1..255 and one float32
 * step per output (its largest d / 255), m = -d mc / 16 with mc in 0..255 (a range the
 * default model's blocks fall inside). A block of 16 outputs x 32 inputs is dc[16],
 * mc[16], then the same 4 chunks of 64 bytes: 288 bytes, 0.5625 bytes per weight, 10% fewer
 * than Q4_1's 320, for the layers and the head alike. Per group, y += dc (s_lo sx_lo + s_hi
 * sx_hi - mc sum(sx xq) / 16), the step applied once per output at the end (the tile's
 * scale). m is re-fitted to the block's mean after d is rounded, so a draft pass reads fewer bytes. How
 * little the codes move the weights and the q4 drafter's greedy drafts: docs/bench/2026-12-06-q4-byte-scales.md
 * and docs/bench/2026-12-07-notes-from-kernels-and-model.md. */
typedef int16_t xel_i8;
typedef int8_t xel_q4;
typedef acc_f32 acc_q4;
#define acc_zero_q4 acc_zero_f32
#define acc_to_blk_q4 acc_to_blk_f32
typedef int8_t xel_q4b;
typedef acc_f32 acc_q4b;
#define acc_zero_q4b acc_zero_f32
#define acc_to_blk_q4b acc_to_blk_f32
#define W_ELEM_bf16 uint16_t
#define W_ELEM_i8 int8_t
#define Q4_GROUP 32                               /* inputs per Q4_1 block */
#define Q4_HALF 16                                /* inputs per scale of x's int8 rows: half a group */
#define Q4_RECORD 3                               /* floats per row and group: 2 scales, the sum */
#define Q4_BLOCK (2 * LANES * 2 + LANES * Q4_GROUP / 2) /* bytes per 16 outputs x 32 inputs: 320 */
#define Q4_HEAD_q4 (2 * LANES * 2)                /* a block's bytes before its nibbles: d, m float16 */
#define Q4_BYTES_q4 Q4_BLOCK
#define Q4_HEAD_q4b (2 * LANES)                   /* Q4_1B: dc, mc bytes */
#define Q4_BYTES_q4b (2 * LANES + LANES * Q4_GROUP / 2) /* 288 */
#define q4_fold_q4 q4_fold
#define q4_fold_q4b q4b_fold
/* Chunk c's weights of a block (its bytes after the head): the low and high half group's four inputs. */
#define Q4_WEIGHTS_q4(p, c, lo, hi) q4_nibbles((p) + 64 * (c), lo, hi)
#define Q4_WEIGHTS_q4b Q4_WEIGHTS_q4

/* Passes of a few rows are compute bound on the widening variants, and the weights must still
 * come from memory: left to the hardware prefetchers the two do not overlap (a 5-token pass
 * of the default model on avx2 takes the time of reading the weights plus the time of the
 * multiply-adds). So while the row tiles of a group of output blocks multiply, they request
 * the next group's lines into L2, spread evenly over the tiles (tile k of n takes every n-th
 * line): the memory streams while the FMAs run. A prefetch never faults, so the ones past the
 * last block are harmless. One-row passes are memory bound and left to the hardware. */
#ifndef PREFETCH_NEXT
#define PREFETCH_NEXT 1
#endif
/* Passes of at most STREAM_ROWS_<kind> rows are treated as one-row passes are: each thread streams one output
 * block at a time (1-block tiles) and leaves the reading to the hardware prefetchers (no request of the next
 * group). 1 unless the variant's header says otherwise (where a few rows are memory bound: see there). */
#ifndef STREAM_ROWS_bf16
#define STREAM_ROWS_bf16 1
#endif
#ifndef STREAM_ROWS_i8
#define STREAM_ROWS_i8 1
#endif
#ifndef STREAM_ROWS_q4
#define STREAM_ROWS_q4 1
#endif
#define STREAM_ROWS_q4b STREAM_ROWS_q4 /* (the same nibbles and tiles, so the same threshold) */
/* __builtin_prefetch's locality: 2 = prefetcht1 (L2).
 * Chosen by measurement: docs/kernels.md, docs/bench/2026-12-07-notes-from-kernels-and-model.md */
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif
/* How many tile groups ahead the prefetch requests.
 * Chosen by measurement: docs/bench/2026-12-07-notes-from-kernels-and-model.md */
#ifndef PREFETCH_GROUPS
#define PREFETCH_GROUPS 1
#endif

/* The per-tile loops: accumulate x rows [t0, t0 + NT) against output blocks [ob, ob + NB). */
#define PAIR_LOOP(KIND, NB, NT)                                                                                 \
    const int64_t pairs = in / 2;                                                                               \
    const W_ELEM_##KIND *w = (const W_ELEM_##KIND *)wp;                                                         \
    /* see PREFETCH_NEXT: row tile k of n requests the next group's lines p with p % n == k */                \
    /* (stepped in chunks of fetch_every pairs, the prefetch at the chunk's start: a modulo per   \
     * pair would put a 64-bit division in the hot loop) */                                       \
    const int64_t fetch_every =                                                                                 \
        rows > STREAM_ROWS_##KIND && PREFETCH_NEXT ? (rows + T_TILE_##KIND - 1) / T_TILE_##KIND : 0;            \
    const int64_t fetch_at = t0 / T_TILE_##KIND, chunk = fetch_every ? fetch_every : pairs;                    \
    for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {                                                            \
        const int64_t p_end = p0 + chunk < pairs ? p0 + chunk : pairs;                                          \
        if (fetch_every && p0 + fetch_at < p_end)                                                               \
            _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++)                                               \
                __builtin_prefetch(w + ((ob + PREFETCH_GROUPS * NB + g) * pairs + p0 + fetch_at) * 2 * LANES, 0,   \
                                   PREFETCH_LOCALITY);                                                          \
        for (int64_t p = p0; p < p_end; p++) {                                                                  \
            xv_##KIND xv[NT];                                                                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) xv[j] = xload_##KIND(xr[j], p);               \
            _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++)                                               \
                _Pragma("GCC unroll 2") for (int part = 0; part < W_PARTS_##KIND; part++) {                    \
                    const wv_##KIND wv = wload_part_##KIND(w + ((ob + g) * pairs + p) * 2 * LANES, part);       \
                    _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++)                                       \
                        dot_part_##KIND(acc[g][j], xv[j], wv, part);                                            \
                }                                                                                               \
        }                                                                                                       \
    }
/* Chunk c of a group: its four inputs of each half, times every block's nibbles, into the sums s. */
#define Q4_CHUNK(KIND, NB, NT, c)                                                                               \
    {                                                                                                           \
        xv_q4 xlo[NT], xhi[NT];                                                                                 \
        _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) {                                                 \
            xlo[j] = xload_q4(xr[j] + gi * Q4_GROUP + 4 * (c));                                                 \
            xhi[j] = xload_q4(xr[j] + gi * Q4_GROUP + Q4_GROUP / 2 + 4 * (c));                                  \
        }                                                                                                       \
        _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++) {                                                 \
            wv_q4 lo[ACC_VECS], hi[ACC_VECS];                                                                   \
            Q4_WEIGHTS_##KIND(blocks[g] + Q4_HEAD_##KIND, c, lo, hi);                                          \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) {                                             \
                dot_q4(s[0][g][j], xlo[j], lo);                                                                 \
                dot_q4(s[1][g][j], xhi[j], hi);                                                                 \
            }                                                                                                   \
        }                                                                                                       \
    }
/* How far a one-row, one-block tile (a draft pass's: STREAM_ROWS) unrolls its four chunks: the ISA header's
 * choice, else all four. */
#ifndef Q4_ONE_UNROLL
#define Q4_ONE_UNROLL _Pragma("GCC unroll 4")
#endif
/* Q4_1 and Q4_1B (KIND q4, q4b: only a block's head and its fold differ): per 32-input group, exact int32 sums over each half of the group's inputs in order
 * (chunk c: inputs 4c .. 4c + 3, low nibbles, and 16 + 4c .. 16 + 4c + 3, high nibbles), folded
 * into the float accumulators with the block's and the row's scales. sx is per row and group
 * [scale of inputs 0-15, scale of inputs 16-31, sum of the quantised x] (Q4_RECORD floats). */
#define Q4_LOOP(KIND, NB, NT)                                                                                   \
    const int64_t groups = in / Q4_GROUP;                                                                       \
    const uint8_t *w = (const uint8_t *)wp;                                                                     \
    const float *info[NT];                                                                                      \
    _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) info[j] = sx + (t0 + j) * Q4_RECORD * groups;         \
    const int64_t fetch_every = rows > STREAM_ROWS_##KIND ? (rows + Q4_T_TILE - 1) / Q4_T_TILE : 0;                 \
    const int64_t fetch_at = t0 / Q4_T_TILE;                                                                    \
    for (int64_t gi = 0, phase = 0; gi < groups; gi++, phase = phase + 1 == fetch_every ? 0 : phase + 1) {      \
        if (PREFETCH_NEXT && fetch_every && phase == fetch_at) /* (phase = gi % fetch_every, no division) */    \
            _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++) {                                             \
                const uint8_t *next = w + ((ob + NB + g) * groups + gi) * Q4_BYTES_##KIND;                             \
                _Pragma("GCC unroll 8") for (int c = 0; c < Q4_BYTES_##KIND; c += 64) __builtin_prefetch(next + c, 0, 2); \
            }                                                                                                   \
        const uint8_t *blocks[NB];                                                                              \
        /* two exact int32 sums per (block, row), the low and the high nibbles' inputs (each half of x has \
         * its own scale): two independent chains of multiply-adds (one chain made a one-row pass wait on     \
         * each one's latency) */                                                                               \
        acc_i8 s[2][NB][NT][ACC_VECS];                                                                          \
        _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++) {                                                 \
            blocks[g] = w + ((ob + g) * groups + gi) * Q4_BYTES_##KIND;                                                \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++)                                               \
                _Pragma("GCC unroll 2") for (int h = 0; h < ACC_VECS; h++) s[0][g][j][h] = s[1][g][j][h] = acc_zero_i8(); \
        }                                                                                                       \
        if (NB * NT == 1) { /* (see Q4_ONE_UNROLL) */                                                          \
            Q4_ONE_UNROLL for (int c = 0; c < 4; c++) Q4_CHUNK(KIND, NB, NT, c)                                 \
        } else {                                                                                                \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) Q4_CHUNK(KIND, NB, NT, c)                       \
        }                                                                                                       \
        _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++)                                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++)                                               \
                q4_fold_##KIND(acc[g][j], s[0][g][j], s[1][g][j], blocks[g], info[j] + Q4_RECORD * gi);                \
    }
#define LOOP_bf16 PAIR_LOOP
#define LOOP_i8 PAIR_LOOP
#define LOOP_q4 Q4_LOOP
#define LOOP_q4b Q4_LOOP

/* One tile: the kind's loop, then y = acc (* sx[t]) (* scale) (+ b), float32 or
 * rounded to bf16. A macro stamps one function per (KIND, NB, NT) so that the loops
 * unroll and the accumulators stay in registers. */
#define DEFINE_TILE(KIND, NB, NT) DEFINE_TILE_(KIND, NB, NT)
#define TILE(KIND, NB, NT) TILE_(KIND, NB, NT)
#define TILE_(KIND, NB, NT) tile_##KIND##_##NB##x##NT
#define DEFINE_TILE_(KIND, NB, NT)                                                                              \
    static void TILE_(KIND, NB, NT)(const void *x, const float *sx, const void *wp, const float *scale,         \
                                    const uint16_t *b, void *y, int y_f32, int64_t in, int64_t out, int64_t ob, \
                                    int64_t t0, int64_t rows) {                                                 \
        acc_##KIND acc[NB][NT][ACC_VECS_##KIND];                                                                \
        _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++)                                                   \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++)                                               \
                _Pragma("GCC unroll 4") for (int h = 0; h < ACC_VECS_##KIND; h++) acc[g][j][h] = acc_zero_##KIND(); \
        const xel_##KIND *xr[NT];                                                                               \
        _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) xr[j] = (const xel_##KIND *)x + (t0 + j) * in;    \
        LOOP_##KIND(KIND, NB, NT)                                                                               \
        /* (unrolled too: an epilogue indexing acc by a variable kept it in memory, stored every pair) */      \
        _Pragma("GCC unroll 8") for (int g = 0; g < NB; g++) {                                                 \
            const blk bias = b ? blk_load_bf16(b + (ob + g) * LANES) : blk_zero();                             \
            _Pragma("GCC unroll 8") for (int j = 0; j < NT; j++) {                                             \
                blk v = acc_to_blk_##KIND(acc[g][j], sx ? sx[t0 + j] : 1.0f);                                   \
                if (scale) v = blk_mul(v, blk_load_f32(scale + (ob + g) * LANES));                              \
                v = blk_add(v, bias);                                                                           \
                const int64_t at = (t0 + j) * out + (ob + g) * LANES;                                           \
                blk_store(y_f32 ? (void *)((float *)y + at) : (void *)((uint16_t *)y + at), v, y_f32);          \
            }                                                                                                   \
        }                                                                                                       \
    }

#define TILE_ARGS x, sx, wp, scale, b, y, y_f32, in, out
/* The tiles of NBT blocks x 1-8 rows (rows per tile, TT, at most 8: avx512bf16 bf16 takes 8). */
#define DEFINE_TILES(KIND, NBT)                                                                                 \
    DEFINE_TILE(KIND, NBT, 1) DEFINE_TILE(KIND, NBT, 2) DEFINE_TILE(KIND, NBT, 3) DEFINE_TILE(KIND, NBT, 4)   \
    DEFINE_TILE(KIND, NBT, 5) DEFINE_TILE(KIND, NBT, 6) DEFINE_TILE(KIND, NBT, 7) DEFINE_TILE(KIND, NBT, 8)

/* A product's operands, for the tasks of task_pool.h; each task is a range of output blocks. */
typedef struct {
    const void *x;
    const float *sx;
    const void *wp;
    const float *scale;
    const uint16_t *b;
    void *y;
    int y_f32;
    int64_t rows, in, out;
} gemm_job;
/* Ranges per thread: one, the longest contiguous stream of weights each thread can have (a late helper's
 * range is still taken by the caller). Each further range costs its claim, its completion and a new stream
 * for the prefetchers. Chosen by measurement: docs/bench/2026-12-05-kernel-threads.md,
 * docs/bench/2026-12-07-notes-from-kernels-and-model.md */
#ifndef GEMM_TASKS_PER_THREAD
#define GEMM_TASKS_PER_THREAD 1
#endif

/* Every tile of output blocks [ob, ob + nb) (nb == NBT, or a shorter tail: 1-block
 * tiles) for rows [0, t_end) of x (rows: all the call's rows, for the prefetch's share), and
 * the threaded driver over all output blocks.
 *
 * Rows left over (rows % TT, when TAIL_NB_KIND > 1): a tile of TT rows keeps 2 TT chains of
 * multiply-adds going per block, and a tile of fewer rows over one block too few to fill the
 * FMA pipes (avx2 bf16: one row, 4 chains, half the pipes' rate; 7 rows cost nearly what 8
 * did). So those rows run over TAIL_NB blocks at once (bf16 avx2: 2 blocks x 1 row, 8 chains),
 * after the full row tiles of each of those blocks. The sums' order is the tiles' (every output
 * over the input pairs in order): row invariance holds. The prefetch's share stays whole: the
 * tail tile (the last of the ceil(rows / TT) row tiles) requests its lines of the next TAIL_NB
 * blocks, whose other lines the full tiles of the blocks before them request. */
#define DEFINE_DRIVER(KIND, NBT, TT) DEFINE_DRIVER_(KIND, NBT, TT)
#define DEFINE_DRIVER_(KIND, NBT, TT)                                                                           \
    /* one block, rows [t0, t0 + nt) (nt <= 8) */                                                               \
    static void block_##KIND(const void *x, const float *sx, const void *wp, const float *scale, const uint16_t *b, \
                             void *y, int y_f32, int64_t in, int64_t out, int64_t ob, int64_t t0, int64_t rows,   \
                             int64_t nt) {                                                                      \
        switch (nt) {                                                                                           \
        case 1: TILE(KIND, 1, 1)(TILE_ARGS, ob, t0, rows); break;                                               \
        case 2: TILE(KIND, 1, 2)(TILE_ARGS, ob, t0, rows); break;                                               \
        case 3: TILE(KIND, 1, 3)(TILE_ARGS, ob, t0, rows); break;                                               \
        case 4: TILE(KIND, 1, 4)(TILE_ARGS, ob, t0, rows); break;                                               \
        case 5: TILE(KIND, 1, 5)(TILE_ARGS, ob, t0, rows); break;                                               \
        case 6: TILE(KIND, 1, 6)(TILE_ARGS, ob, t0, rows); break;                                               \
        case 7: TILE(KIND, 1, 7)(TILE_ARGS, ob, t0, rows); break;                                               \
        default: TILE(KIND, 1, 8)(TILE_ARGS, ob, t0, rows); break;                                              \
        }                                                                                                       \
    }                                                                                                           \
    static void tiles_##KIND(const void *x, const float *sx, const void *wp, const float *scale, const uint16_t *b, \
                             void *y, int y_f32, int64_t in, int64_t out, int64_t rows, int64_t ob, int64_t nb,   \
                             int64_t t_end) {                                                                   \
        for (int64_t t0 = 0; t0 < t_end; t0 += TT) {                                                            \
            int64_t nt = t_end - t0 < TT ? t_end - t0 : TT;                                                     \
            if (nb == NBT) {                                                                                    \
                switch (nt) {                                                                                   \
                case 1: TILE(KIND, NBT, 1)(TILE_ARGS, ob, t0, rows); break;                                     \
                case 2: TILE(KIND, NBT, 2)(TILE_ARGS, ob, t0, rows); break;                                     \
                case 3: TILE(KIND, NBT, 3)(TILE_ARGS, ob, t0, rows); break;                                     \
                case 4: TILE(KIND, NBT, 4)(TILE_ARGS, ob, t0, rows); break;                                     \
                case 5: TILE(KIND, NBT, 5)(TILE_ARGS, ob, t0, rows); break;                                     \
                case 6: TILE(KIND, NBT, 6)(TILE_ARGS, ob, t0, rows); break;                                     \
                case 7: TILE(KIND, NBT, 7)(TILE_ARGS, ob, t0, rows); break;                                     \
                default: TILE(KIND, NBT, 8)(TILE_ARGS, ob, t0, rows); break;                                    \
                }                                                                                               \
            } else {                                                                                            \
                for (int64_t g = 0; g < nb; g++) block_##KIND(TILE_ARGS, ob + g, t0, rows, nt);                 \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    /* blocks [ob, ob + TAIL_NB) (nb of them: fewer at the end), rows [rows - tail, rows) */                    \
    static void tail_##KIND(const void *x, const float *sx, const void *wp, const float *scale, const uint16_t *b, \
                            void *y, int y_f32, int64_t in, int64_t out, int64_t rows, int64_t ob, int64_t nb,    \
                            int64_t tail) {                                                                     \
        const int64_t t0 = rows - tail;                                                                         \
        if (nb < TAIL_NB_##KIND) {                                                                              \
            for (int64_t g = 0; g < nb; g++) block_##KIND(TILE_ARGS, ob + g, t0, rows, tail);                  \
            return;                                                                                             \
        }                                                                                                       \
        switch (tail) { /* (tail < TT <= 8) */                                                                  \
        case 1: TILE(KIND, TAIL_NB_##KIND, 1)(TILE_ARGS, ob, t0, rows); break;                                  \
        case 2: TILE(KIND, TAIL_NB_##KIND, 2)(TILE_ARGS, ob, t0, rows); break;                                  \
        case 3: TILE(KIND, TAIL_NB_##KIND, 3)(TILE_ARGS, ob, t0, rows); break;                                  \
        case 4: TILE(KIND, TAIL_NB_##KIND, 4)(TILE_ARGS, ob, t0, rows); break;                                  \
        case 5: TILE(KIND, TAIL_NB_##KIND, 5)(TILE_ARGS, ob, t0, rows); break;                                  \
        case 6: TILE(KIND, TAIL_NB_##KIND, 6)(TILE_ARGS, ob, t0, rows); break;                                  \
        default: TILE(KIND, TAIL_NB_##KIND, 7)(TILE_ARGS, ob, t0, rows); break;                                 \
        }                                                                                                       \
    }                                                                                                           \
    static void blocks_##KIND(void *job, int64_t begin, int64_t end) {                                          \
        const gemm_job *j = job;                                                                                \
        const void *x = j->x, *wp = j->wp;                                                                      \
        const float *sx = j->sx, *scale = j->scale;                                                             \
        const uint16_t *b = j->b;                                                                               \
        void *y = j->y;                                                                                         \
        const int y_f32 = j->y_f32;                                                                             \
        const int64_t rows = j->rows, in = j->in, out = j->out;                                                 \
        /* One row (plain decoding, drafting) streams one block at a time, quicker than wider tiles (most       \
         * for int8: docs/bench/2026-12-07-notes-from-kernels-and-model.md); so do passes of up to             \
         * STREAM_ROWS rows. The tile shape never changes a sum's order, only which sums run together. */       \
        const int64_t nb = rows <= STREAM_ROWS_##KIND ? 1 : NBT;                                                \
        const int64_t tail = TAIL_NB_##KIND > 1 && rows > TT ? rows % TT : 0;                                   \
        if (tail) {                                                                                             \
            for (int64_t ob = begin; ob < end; ob += TAIL_NB_##KIND) {                                          \
                const int64_t group = end - ob < TAIL_NB_##KIND ? end - ob : TAIL_NB_##KIND;                    \
                for (int64_t g = 0; g < group; g += nb)                                                         \
                    tiles_##KIND(TILE_ARGS, rows, ob + g, group - g < nb ? group - g : nb, rows - tail);        \
                tail_##KIND(TILE_ARGS, rows, ob, group, tail);                                                  \
            }                                                                                                   \
            return;                                                                                             \
        }                                                                                                       \
        int64_t ob = begin;                                                                                     \
        for (; ob + nb <= end; ob += nb) tiles_##KIND(TILE_ARGS, rows, ob, nb, rows);                           \
        if (ob < end) tiles_##KIND(TILE_ARGS, rows, ob, end - ob, rows);                                        \
    }                                                                                                           \
    static void run_##KIND(const void *x, const float *sx, const void *wp, const float *scale, const uint16_t *b,\
                           void *y, int y_f32, int64_t rows, int64_t in, int64_t out) {                         \
        gemm_job job = {x, sx, wp, scale, b, y, y_f32, rows, in, out};                                          \
        pool_for(out / LANES, GEMM_TASKS_PER_THREAD, blocks_##KIND, &job);                                      \
    }

#if T_TILE_bf16 < 1 || T_TILE_bf16 > 8 || T_TILE_i8 < 1 || T_TILE_i8 > 8 || T_TILE_q4 < 1 || T_TILE_q4 > 8 || T_TILE_q4b != T_TILE_q4
#error "rows per tile must be 1-8: the tile functions go up to 8"
#endif
DEFINE_TILES(bf16, 1)
DEFINE_TILES(i8, 1)
DEFINE_TILES(q4, 1)
DEFINE_TILES(q4b, 1)
#if NB_TILE_bf16 > 1 /* the 1-block tiles double as the tails */
DEFINE_TILES(bf16, NB_TILE_bf16)
#endif
#if TAIL_NB_bf16 > 1 && TAIL_NB_bf16 != NB_TILE_bf16 /* the leftover rows' tiles (DEFINE_DRIVER) */
DEFINE_TILES(bf16, TAIL_NB_bf16)
#endif
#if NB_TILE_i8 > 1
DEFINE_TILES(i8, NB_TILE_i8)
#endif
#if NB_TILE_q4 > 1
DEFINE_TILES(q4, NB_TILE_q4)
DEFINE_TILES(q4b, NB_TILE_q4b)
#endif
DEFINE_DRIVER(bf16, NB_TILE_bf16, T_TILE_bf16)
DEFINE_DRIVER(i8, NB_TILE_i8, T_TILE_i8)
DEFINE_DRIVER(q4, NB_TILE_q4, T_TILE_q4)
DEFINE_DRIVER(q4b, NB_TILE_q4b, T_TILE_q4b)

/* RMSNorm of one float32 row into `dst` (float32, may be x): dst = x / sqrt(mean(x^2) + eps) * g.
 * The sum of squares runs in VL lanes, then a fixed reduction, then the scalar tail:
 * the same order for every row of the same width. */
static void rms_norm_row(const float *x, const float *g, float eps, int64_t n, float *dst) {
    vf ss = vf_zero();
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        const vf v = vf_load(x + i);
        ss = vf_fmadd(v, v, ss);
    }
    float sum = vf_reduce_add(ss);
    for (; i < n; i++) sum += x[i] * x[i];
    const float r = 1.0f / sqrtf(sum / (float)n + eps);
    for (i = 0; i < n; i++) dst[i] = x[i] * r * g[i];
}

static inline float bf16_bits_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
/* float32 -> bf16 bits, nearest even, a NaN a quiet NaN: torch's .to(torch.bfloat16) */
static inline uint16_t float_to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* x [rows, in] as the kernel's rows for the bf16 product (xel_bf16: bf16 on
 * avx512bf16, float32 on the widening variants): the caller's buffer where it is
 * already in that form, else converted (optionally RMS-normalised first, norm_w !=
 * NULL, float32 x only) into `tmp` [rows, in]. Row by row, so rows stay independent. */
static const xel_bf16 *kernel_rows_bf16(const void *x, int x_f32, const float *norm_w, float eps, int64_t rows,
                                        int64_t in, xel_bf16 *tmp) {
    const int as_is = X_ROWS_BF16 ? !x_f32 : x_f32 && !norm_w;
    if (as_is) return (const xel_bf16 *)x;
    float row[in];
    for (int64_t t = 0; t < rows; t++) {
        const float *xf = (const float *)x + t * in;
        if (!x_f32) {
            for (int64_t i = 0; i < in; i++) row[i] = bf16_bits_to_float(((const uint16_t *)x)[t * in + i]);
            xf = row;
        }
        if (norm_w) {
            rms_norm_row(xf, norm_w, eps, in, row);
            xf = row;
        }
        store_row_bf16(xf, tmp + t * in, in);
    }
    return tmp;
}

/* y = x W^T (+ b), W packed bf16. x and y are float32 when x_f32 / y_f32, else bf16;
 * on avx512bf16 float32 x is rounded to bf16 for the products, on the widening
 * variants bf16 x is widened to float32 (the rows stay independent either way),
 * after an RMSNorm with weight norm_w [in] when norm_w != NULL (float32 x only). */
void skinny_gemm_bf16(const void *x, int x_f32, const uint16_t *wp, const uint16_t *b, void *y, int y_f32,
                      int64_t rows, int64_t in, int64_t out, const float *norm_w, float eps) {
    xel_bf16 small[4096];
    xel_bf16 *tmp = rows * in <= 4096 ? small : malloc(sizeof(xel_bf16) * rows * in);
    if (!tmp) abort();
    run_bf16(kernel_rows_bf16(x, x_f32, norm_w, eps, rows, in, tmp), NULL, wp, NULL, b, y, y_f32, rows, in, out);
    if (tmp != small) free(tmp);
}

/* ---- int8 weights: exact integer dot products ------------------------------------
 * The int8 drafter's rows of x are quantised per row to int16, x ~= sx * xq with
 * |xq| <= xmax, and vpdpwssd (VNNI) or vpmaddwd multiplies int16 pairs into int32
 * sums exactly; the int8 weights only need sign extension (one instruction per 32
 * weights; widening them to bf16 took five and made the kernel compute bound). xmax
 * keeps every sum inside int32: xmax * 127 * in < 2^31 (in = 576: 29356, 14.8 bits;
 * in = 1536: 11008, 13.4 bits), far finer than the 8-bit activations that made
 * per-tensor int8 drafts useless. y = sx * sum(xq * q) * scale[o] (+ b). */

/* Rows of x [rows, in] (float32 when x_f32, else bf16; RMS-normalised first when
 * norm_w != NULL) quantised per row to int16: x ~= sx[t] * xq[t], |xq| <= xmax, to
 * nearest even. */
static void quantise_rows(const void *x, int x_f32, const float *norm_w, float eps, int64_t rows, int64_t in,
                          float xmax, int16_t *xq, float *sx) {
    float row[in];
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t i = 0; i < in; i++)
            row[i] = x_f32 ? ((const float *)x)[t * in + i] : bf16_bits_to_float(((const uint16_t *)x)[t * in + i]);
        if (norm_w) rms_norm_row(row, norm_w, eps, in, row);
        /* vectorised: this prologue runs single-threaded before every product */
        vf vmax = vf_zero();
        int64_t i = 0;
        for (; i + VL <= in; i += VL) vmax = vf_max(vmax, vf_abs(vf_load(row + i)));
        float amax = vf_reduce_max(vmax);
        for (; i < in; i++) amax = fabsf(row[i]) > amax ? fabsf(row[i]) : amax;
        const float s = amax > 0.0f ? amax / xmax : 1.0f;
        const float inv = 1.0f / s;
        sx[t] = s;
        const vf vinv = vf_set1(inv), vlim = vf_set1(xmax), vneg = vf_set1(-xmax);
        int16_t *dst = xq + t * in;
        for (i = 0; i + VL <= in; i += VL)
            vf_store_i16(dst + i, vf_min(vf_max(vf_mul(vf_load(row + i), vinv), vneg), vlim)); /* nearest even */
        for (; i < in; i++) {
            float r = nearbyintf(row[i] * inv);
            dst[i] = (int16_t)(r > xmax ? xmax : (r < -xmax ? -xmax : r));
        }
    }
}

/* y = (x Q^T) * scale (+ b), Q packed int8 [out/16, in/2, 16, 2], scale float32 [out].
 * x float32 (x_f32) or bf16 [rows, in], RMS-normalised first when norm_w != NULL. */
/* The int8 product's rows of x (quantise_rows with the largest xmax that keeps every sum inside int32), in the
 * caller's buffers `small` (4096 int16) and `small_sx` (64 floats) where they fit, else allocated: release them
 * with int16_rows_free. */
typedef struct {
    int16_t *xq;
    float *sx;
} int16_rows;
static int16_rows int16_rows_of(const void *x, int x_f32, const float *norm_w, float eps, int64_t rows, int64_t in,
                                int16_t *small, float *small_sx) {
    int16_rows r = {rows * in <= 4096 ? small : malloc(sizeof(int16_t) * rows * in),
                    rows <= 64 ? small_sx : malloc(sizeof(float) * rows)};
    if (!r.xq || !r.sx) abort();
    const double limit = 2147483647.0 / (127.0 * (double)in);
    const float xmax = (float)(limit < 32767.0 ? (double)(int64_t)limit : 32767.0);
    quantise_rows(x, x_f32, norm_w, eps, rows, in, xmax, r.xq, r.sx);
    return r;
}
static void int16_rows_free(int16_rows r, const int16_t *small, const float *small_sx) {
    if (r.xq != small) free(r.xq);
    if (r.sx != small_sx) free(r.sx);
}

void skinny_gemm_int8w(const void *x, int x_f32, const int8_t *qp, const float *scale, const uint16_t *b, void *y,
                       int y_f32, int64_t rows, int64_t in, int64_t out, const float *norm_w, float eps) {
    int16_t small[4096];
    float small_sx[64];
    const int16_rows r = int16_rows_of(x, x_f32, norm_w, eps, rows, in, small, small_sx);
    run_i8(r.xq, r.sx, qp, scale, b, y, y_f32, rows, in, out);
    int16_rows_free(r, small, small_sx);
}

/* Rows of x [rows, in] (float32 when x_f32, else bf16; RMS-normalised first when norm_w
 * != NULL; in a multiple of Q4_GROUP) quantised per Q4_HALF inputs to int8, x ~= sx * xq
 * with |xq| <= 127, to nearest even, and each row's record for the Q4_1 product: per
 * group g, info[t * Q4_RECORD * groups + Q4_RECORD g + h] = sx of half h (0, 1), + 2 =
 * the sum of sx * xq over the group (exact integer sums: the m term multiplies the same
 * quantised x as the d terms). The same arithmetic on every variant: max is exact, the
 * scale one division, the rounding the vector unit's nearest even. */
static void quantise_rows_q4(const void *x, int x_f32, const float *norm_w, float eps, int64_t rows, int64_t in,
                             int8_t *xq, float *info) {
    float row[in];
    const int64_t groups = in / Q4_GROUP;
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t i = 0; i < in; i++)
            row[i] = x_f32 ? ((const float *)x)[t * in + i] : bf16_bits_to_float(((const uint16_t *)x)[t * in + i]);
        if (norm_w) rms_norm_row(row, norm_w, eps, in, row);
        float *record = info + t * Q4_RECORD * groups;
        for (int64_t g = 0; g < groups; g++) {
            float xsum = 0.0f;
            for (int half = 0; half < 2; half++) {
                const float *src = row + g * Q4_GROUP + half * Q4_HALF;
                vf vmax = vf_zero();
                for (int i = 0; i < Q4_HALF; i += VL) vmax = vf_max(vmax, vf_abs(vf_load(src + i)));
                const float amax = vf_reduce_max(vmax);
                const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
                const vf vinv = vf_set1(1.0f / s), vlim = vf_set1(127.0f), vneg = vf_set1(-127.0f);
                int8_t *dst = xq + t * in + g * Q4_GROUP + half * Q4_HALF;
                vf vtotal = vf_zero(); /* the stored integers summed as floats: exact (|total| <= 127 * 16) */
                for (int i = 0; i < Q4_HALF; i += VL) {
                    const vf r = vf_round(vf_min(vf_max(vf_mul(vf_load(src + i), vinv), vneg), vlim)); /* nearest even */
                    vf_store_i8(dst + i, r);
                    vtotal = vf_add(vtotal, r);
                }
                const float total = vf_reduce_add(vtotal);
                record[Q4_RECORD * g + half] = s;
                xsum += s * total;
            }
            record[Q4_RECORD * g + 2] = xsum;
        }
    }
}

/* y = x W^T (+ b), W Q4_1 packed [out/16, in/32, 320 bytes] (see Q4_BLOCK; in a
 * multiple of 32), b bf16 [out] or NULL. x float32 (x_f32) or bf16 [rows, in], RMS-
 * normalised first when norm_w != NULL; y float32 or bf16. */
/* The 4-bit products' common part: x's rows quantised (quantise_rows_q4), then run_q4 (kind 2: Q4_1 blocks) or
 * run_q4b (3: Q4_1B blocks, their rows' steps dstep): the kinds of mat_desc. */
static void q4_product(int kind, const void *x, int x_f32, const uint8_t *wp, const float *dstep, const uint16_t *b,
                       void *y, int y_f32, int64_t rows, int64_t in, int64_t out, const float *norm_w, float eps) {
    int8_t small[8192];
    float small_info[1024];
    const int64_t record = Q4_RECORD * (in / Q4_GROUP);
    int8_t *xq = rows * in <= 8192 ? small : malloc(rows * in);
    float *info = rows * record <= 1024 ? small_info : malloc(sizeof(float) * rows * record);
    if (!xq || !info) abort();
    quantise_rows_q4(x, x_f32, norm_w, eps, rows, in, xq, info);
    if (kind == 3)
        run_q4b(xq, info, wp, dstep, b, y, y_f32, rows, in, out);
    else
        run_q4(xq, info, wp, NULL, b, y, y_f32, rows, in, out);
    if (xq != small) free(xq);
    if (info != small_info) free(info);
}

void skinny_gemm_q4_1(const void *x, int x_f32, const uint8_t *wp, const uint16_t *b, void *y, int y_f32,
                      int64_t rows, int64_t in, int64_t out, const float *norm_w, float eps) {
    q4_product(2, x, x_f32, wp, NULL, b, y, y_f32, rows, in, out, norm_w, eps);
}

/* y = x W^T (+ b), W Q4_1B packed [out/16, in/32, 288 bytes] (Q4_BYTES_q4b), dstep float32 [out]: see
 * q4b_fold in the ISA headers and PackedQ4_1BWeight (engine/kernels/cpu_packed.py). Otherwise as
 * skinny_gemm_q4_1: the same rows of x, the same nibbles, the same exact integer sums per half group. */
void skinny_gemm_q4_1b(const void *x, int x_f32, const uint8_t *wp, const float *dstep, const uint16_t *b, void *y,
                       int y_f32, int64_t rows, int64_t in, int64_t out, const float *norm_w, float eps) {
    q4_product(3, x, x_f32, wp, dstep, b, y, y_f32, rows, in, out, norm_w, eps);
}

/* ---- a drafter's output projection: Q4_1, its best candidates again in int8 -----------
 * The q4 drafter's vocabulary projection (the default model's: 49152 x 576) in Q4_1 reads
 * 18 MB per pass against int8's 28 MB, but alone it moves the drafter's choices: its
 * greedy drafts are kept less often than int8's (docs/bench/2026-12-05-q4-rescored-head.md,
 * docs/bench/2026-12-07-notes-from-kernels-and-model.md). Its ranking is still
 * good enough to find the few tokens that matter, so each row's `top` best outputs of the
 * Q4_1 product (value descending, the lower index first among equals, among the first
 * n_out) are computed again as the int8 product does -- x quantised per row to int16
 * (int16_rows_of), an exact int32 dot with the output's int8 row, ((float)dot * sx) * scale
 * -- and overwrite their Q4_1 values: those entries are bit for bit what
 * skinny_gemm_int8w gives, the rest what skinny_gemm_q4_1 gives. The re-scoring reads
 * top rows of w8 ([out, in] int8, row-major: 18 KB for 32 rows), not the packed layout.
 *
 * Finding them: a row's candidates are kept in a heap of `top` (head_candidates); once it is full, a
 * block of 64 outputs is looked at one by one only if its maximum beats the heap's lowest
 * (a vector max per block: after the first few thousand outputs almost no block does).
 * NaN is never a candidate. The rows are independent tasks, and so are the candidates' re-scorings. */
#define HEAD_BLOCK 64

typedef struct {
    float *y;
    const int16_t *xq;
    const float *sx, *scale;
    const int8_t *w8;
    int64_t in, out, n_out, top;
    int64_t *idx, *count; /* [rows, top] candidates and [rows] their counts (find_rows' output) */
} rescore_job;

/* Whether candidate (va, ia) ranks below (vb, ib): a smaller value, or an equal one at a higher index. */
static inline int cand_below(float va, int64_t ia, float vb, int64_t ib) {
    return va < vb || (va == vb && ia > ib);
}
/* The heap's entry at `at` moved down to where it belongs (its children rank above it). */
static void cand_sift_down(float *val, int64_t *idx, int64_t count, int64_t at) {
    const float v = val[at];
    const int64_t i = idx[at];
    for (;;) {
        int64_t child = 2 * at + 1;
        if (child >= count) break;
        if (child + 1 < count && cand_below(val[child + 1], idx[child + 1], val[child], idx[child])) child++;
        if (!cand_below(val[child], idx[child], v, i)) break;
        val[at] = val[child];
        idx[at] = idx[child];
        at = child;
    }
    val[at] = v;
    idx[at] = i;
}

/* The indices of the best `top` of y[0, n) (value descending, the lower index first among equals), into idx in
 * that order; returns their count. A heap keeps the best seen so far with the lowest-ranked at its root:
 * an output enters when it beats the root (scanned in index order, an equal value never does: the earlier one
 * stays ahead); once the heap is full, a block of HEAD_BLOCK outputs is looked at one by one only when its vector
 * maximum beats the root. (A sorted list did the same with an insertion that moved up to `top` entries: with the
 * best 128 or 256 kept, the search cost more than the re-scoring.) Then the heap is sorted in place: its lowest
 * swapped to the end, one at a time. */
static int64_t head_candidates(const float *y, int64_t n, int64_t top, int64_t *idx) {
    float val[top];
    int64_t count = 0;
    for (int64_t i0 = 0; i0 < n; i0 += HEAD_BLOCK) {
        const int64_t i1 = i0 + HEAD_BLOCK < n ? i0 + HEAD_BLOCK : n;
        if (count == top && i1 - i0 == HEAD_BLOCK) {
            vf m = vf_load(y + i0);
            for (int64_t j = VL; j < HEAD_BLOCK; j += VL) m = vf_max(m, vf_load(y + i0 + j));
            if (!(vf_reduce_max(m) > val[0])) continue; /* (a NaN lane is passed over too) */
        }
        for (int64_t i = i0; i < i1; i++) {
            const float v = y[i];
            if (v != v) continue;
            if (count < top) { /* sift up */
                int64_t at = count++;
                while (at > 0) {
                    const int64_t parent = (at - 1) / 2;
                    if (!cand_below(v, i, val[parent], idx[parent])) break;
                    val[at] = val[parent];
                    idx[at] = idx[parent];
                    at = parent;
                }
                val[at] = v;
                idx[at] = i;
            } else if (v > val[0]) {
                val[0] = v;
                idx[0] = i;
                cand_sift_down(val, idx, count, 0);
            }
        }
    }
    for (int64_t last = count - 1; last > 0; last--) {
        const float v = val[0];
        const int64_t i = idx[0];
        val[0] = val[last];
        idx[0] = idx[last];
        val[last] = v;
        idx[last] = i;
        cand_sift_down(val, idx, last, 0);
    }
    return count;
}

/* Each row's candidates. */
static void find_rows(void *arg, int64_t begin, int64_t end) {
    const rescore_job *j = arg;
    for (int64_t t = begin; t < end; t++)
        j->count[t] = head_candidates(j->y + t * j->out, j->n_out, j->top, j->idx + t * j->top);
}

/* Candidates [begin, end) of all rows' (row t's are items t * top .. t * top + count[t] - 1), re-scored: their
 * int8 rows requested first (one row is 9 lines at in = 576: fetched side by side rather than one row's
 * latency after another's), then each one's exact dot with the row of x. */
static void rescore_items(void *arg, int64_t begin, int64_t end) {
    const rescore_job *j = arg;
    for (int64_t k = begin; k < end; k++) {
        const int64_t t = k / j->top, c = k % j->top;
        if (c >= j->count[t]) continue;
        const int8_t *wr = j->w8 + j->idx[k] * j->in;
        for (int64_t b = 0; b < j->in; b += 64) __builtin_prefetch(wr + b, 0, 3);
    }
    for (int64_t k = begin; k < end; k++) {
        const int64_t t = k / j->top, c = k % j->top;
        if (c >= j->count[t]) continue;
        const int64_t o = j->idx[k];
        const int16_t *xr = j->xq + t * j->in;
        const int8_t *wr = j->w8 + o * j->in;
        int32_t dot = 0; /* exact: |xq| * 127 * in < 2^31 (quantise_rows' xmax) */
        for (int64_t i = 0; i < j->in; i++) dot += (int32_t)xr[i] * (int32_t)wr[i];
        j->y[t * j->out + o] = ((float)dot * j->sx[t]) * j->scale[o];
    }
}

/* y [rows, out] float32 = the product of x with the blocks wp of mat_desc's `kind` (2: Q4_1, as
 * skinny_gemm_q4_1; 3: Q4_1B, skinny_gemm_q4_1b, dstep its rows' steps) (RMS-normalised first when norm_w != NULL), then each
 * row's `top` best of its first n_out outputs overwritten with the int8 product's values (w8
 * [out, in] int8 row-major, scale8 [out] float32, no bias). */
void head_q4_rescored(const void *x, int x_f32, int kind, const uint8_t *wp, const float *dstep, const int8_t *w8,
                      const float *scale8, float *y, int64_t rows, int64_t in, int64_t out, int64_t n_out,
                      int64_t top, const float *norm_w, float eps) {
    q4_product(kind, x, x_f32, wp, dstep, NULL, y, 1, rows, in, out, norm_w, eps);
    if (top <= 0) return;
    int16_t small[4096];
    float small_sx[64];
    const int16_rows r = int16_rows_of(x, x_f32, norm_w, eps, rows, in, small, small_sx); /* as skinny_gemm_int8w */
    const int64_t kept = top < n_out ? top : n_out;
    int64_t small_idx[1024], small_count[8];
    int64_t *idx = rows * kept <= 1024 ? small_idx : malloc(sizeof(int64_t) * rows * kept);
    int64_t *count = rows <= 8 ? small_count : malloc(sizeof(int64_t) * rows);
    if (!idx || !count) abort();
    rescore_job job = {y, r.xq, r.sx, scale8, w8, in, out, n_out, kept, idx, count};
    pool_for(rows, 1, find_rows, &job);
    pool_for(rows * kept, 1, rescore_items, &job); /* (a one-row pass's candidates split across the threads) */
    if (idx != small_idx) free(idx);
    if (count != small_count) free(count);
    int16_rows_free(r, small, small_sx);
}

/* ---- attention of a pass's new tokens over the cache ------------------------------
 * q: [H, T, D] float32 (rotated), k, v: one layer of the cache, [Hkv, S, D] float32 (bf16 where kvb: kv_row);
 * out: [T, H, D]. Without a mask the cache holds A positions of which the last T
 * are the new tokens (their K/V already written) and token t attends [0, A - T + t]
 * (causal); with mask [T, A] (1 = may attend; a draft tree's ancestors) token t
 * attends the positions its row allows. Query head h reads key/value head
 * h / (H / Hkv): softmax(q k^T * scale) v with the max subtracted before exp.
 * (torch's SDPA spends longer on setup than on the attention for these: the note
 * docs/bench/2026-12-07-notes-from-kernels-and-model.md.) Every row must allow at least one position.
 *
 * The attended positions of a query, in slot order, form its key list; every sum
 * below runs over list ranks, not slots, so a tree node whose ancestors sit at
 * other slots than in a chain still sums the same numbers in the same order. Per
 * query (one head, one token) three steps, each a function of that query alone:
 *   scores   s[a] = (q . k[list[a]]) * scale: eight keys at a time, eight FMA chains
 *            sharing each chunk of q, summed lane-wise by one transpose-add (hsum4);
 *            each score's arithmetic is the same whichever block it falls in;
 *   softmax  e[a] = exp(s[a] - max), total summed VL lanes at a time over ranks, and the
 *            weights w[a] = e[a] * (1 / total);
 *   values   out = sum_a w[a] v[list[a]]: key rank a goes to output chain
 *            a % ATTN_CHAINS, in increasing a; the chains are added in order.
 *
 * Sharing key loads. A query alone streams its K and V rows once each: with one
 * query per (head, token) a 16-token pass over 600 positions reads ~44 MB per layer
 * from L2 and is bound by it (docs/bench/2026-12-07-notes-from-kernels-and-model.md). All
 * queries of one key/value head (its H / Hkv query heads x T tokens) attend the
 * committed prefix: ranks 0 .. P-1 are slots 0 .. P-1 for every query of a chunk
 * (P: the chunk's shortest list causally, its shortest leading run of allowed slots
 * under a mask; in a prefill, its earliest token's). So the chunk walks that
 * prefix together, a block of keys at a time, each query doing its own step on the
 * block while the block sits in L1, then its own tail of ranks P .. len-1 alone.
 * Nothing in a query's arithmetic depends on the blocking (score blocks are
 * independent, the value chains keep their order, a chain spilled to memory between
 * blocks is stored exactly), so a token gets the same bits with one query per task
 * or forty-eight. A one-token pass walks together too (its H / Hkv query heads), quicker
 * for a drafter's one-row passes over a long cache, with the same bits
 * (docs/bench/2026-12-07-notes-from-kernels-and-model.md).
 * Head sizes other than 64 take one query per task (attn_rows). */
#define ATTN_KEY_BLOCK 32 /* keys per shared block: 8 KB of K (or V) rows at D = 64, in L1 */
#define ATTN_CHUNK 8      /* queries sharing a walk over the prefix (one task) */
#if ATTN_KEY_BLOCK % 8 || ATTN_KEY_BLOCK % ATTN_CHAINS || ATTN_CHAINS > 2
#error "score blocks are eight keys, value chains one or two"
#endif

/* The cache's keys and values are float32, or bf16 where kvb is set (a drafter's cache: half the bytes to
 * read; the values are rounded once, when stored, and widened exactly when read, so every sum below runs
 * as it does on float32 rows). Row r of a head's [S, D] rows starts at element r * D. */
static inline const void *kv_row(const void *base, int64_t r, int64_t D, int kvb) {
    return kvb ? (const void *)((const uint16_t *)base + r * D) : (const void *)((const float *)base + r * D);
}
static inline vf kv_vload(const void *row, int64_t i, int kvb) {
    return kvb ? vf_load_bf16((const uint16_t *)row + i) : vf_load((const float *)row + i);
}
static inline float kv_get(const void *row, int64_t i, int kvb) {
    return kvb ? bf16_bits_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}
static inline void kv_put(void *row, int64_t i, float f, int kvb) {
    if (kvb)
        ((uint16_t *)row)[i] = float_to_bf16_bits(f);
    else
        ((float *)row)[i] = f;
}

/* Scores of ranks [from, to) of one query into s[from, to) (the last block may write up
 * to 7 floats past `to`; the caller leaves room). listed: the key list (NULL: rank = slot). */
static inline void attn_scores(const float *qh, const void *kh, const int32_t *listed, int64_t from, int64_t to,
                               int64_t D, float scale, float *s, int kvb) {
    const int64_t dv = D - D % VL;
    for (int64_t a0 = from; a0 < to; a0 += 8) {
        const void *kr[8];
        for (int j = 0; j < 8; j++) { /* keys past `to` read a real row; their sums are never used */
            const int64_t a = a0 + j < to ? a0 + j : from;
            kr[j] = kv_row(kh, listed ? (int64_t)listed[a] : a, D, kvb);
        }
        vf acc[8];
        for (int j = 0; j < 8; j++) acc[j] = vf_zero();
        for (int64_t i = 0; i < dv; i += VL) {
            const vf qv = vf_load(qh + i);
            for (int j = 0; j < 8; j++) acc[j] = vf_fmadd(qv, kv_vload(kr[j], i, kvb), acc[j]);
        }
        if (dv == D) { /* (each score scaled as the loop below scales it: one multiply) */
            const __m128 vscale = _mm_set1_ps(scale);
            _mm_storeu_ps(s + a0, _mm_mul_ps(hsum4(acc[0], acc[1], acc[2], acc[3]), vscale));
            _mm_storeu_ps(s + a0 + 4, _mm_mul_ps(hsum4(acc[4], acc[5], acc[6], acc[7]), vscale));
            continue;
        }
        _mm_storeu_ps(s + a0, hsum4(acc[0], acc[1], acc[2], acc[3]));
        _mm_storeu_ps(s + a0 + 4, hsum4(acc[4], acc[5], acc[6], acc[7]));
        for (int j = 0; j < 8 && a0 + j < to; j++) {
            float sdot = s[a0 + j];
            for (int64_t i = dv; i < D; i++) sdot += qh[i] * kv_get(kr[j], i, kvb);
            s[a0 + j] = sdot * scale;
        }
    }
}

/* s[0, len) -> exp(s - mx) in place (mx: their maximum); returns the sum of those. */
static inline float exp_and_sum(float *s, int64_t len, float mx) {
    const vf vmx = vf_set1(mx);
    vf vtotal = vf_zero();
    int64_t a = 0;
    for (; a + VL <= len; a += VL) {
        const vf e = vf_exp_neg(vf_sub(vf_load(s + a), vmx));
        vf_store(s + a, e);
        vtotal = vf_add(vtotal, e);
    }
    if (a < len) {
        const vf e = vf_keep_first(vf_exp_neg(vf_sub(vf_load_tail(s + a, len - a), vmx)), len - a);
        vf_store_tail(s + a, e, len - a);
        vtotal = vf_add(vtotal, e);
    }
    return vf_reduce_add(vtotal);
}

/* s[0, len) -> the weights exp(s - max) * (1 / their sum), in place. The maximum is taken VL lanes at a time
 * (the same value as a scan's for scores without NaN; with a NaN every weight is NaN either way), the
 * weights each one float multiply, vectorised here where the value sums would do them one at a time: the
 * same bits without the scalar steps (docs/bench/2026-12-07-notes-from-kernels-and-model.md). */
static inline void attn_softmax(float *s, int64_t len) {
    vf vmx = vf_set1(-INFINITY);
    int64_t a = 0;
    for (; a + VL <= len; a += VL) vmx = vf_max(vmx, vf_load(s + a));
    float mx = vf_reduce_max(vmx);
    for (; a < len; a++) mx = s[a] > mx ? s[a] : mx;
    const float inv = 1.0f / exp_and_sum(s, len, mx);
    const vf vinv = vf_set1(inv);
    for (a = 0; a + VL <= len; a += VL) vf_store(s + a, vf_mul(vf_load(s + a), vinv));
    for (; a < len; a++) s[a] = s[a] * inv;
}

/* D = 64, the common head size: o [ATTN_CHAINS, 64] (memory) += w[a] * v[list[a]] for
 * ranks [from, to), rank a into chain a % ATTN_CHAINS; the chains live in registers here. */
enum { ATTN_NV = 64 / VL };
static inline void attn_values64(float *o, const float *w, const void *vh, const int32_t *listed,
                                 int64_t from, int64_t to, int kvb) {
    vf c0[ATTN_NV], c1[ATTN_NV];
    for (int i = 0; i < ATTN_NV; i++) c0[i] = vf_load(o + i * VL);
    for (int i = 0; i < ATTN_NV; i++) c1[i] = ATTN_CHAINS == 2 ? vf_load(o + 64 + i * VL) : vf_zero();
#define ATTN_ROW(a) kv_row(vh, listed ? (int64_t)listed[a] : (a), 64, kvb)
#define ATTN_ADD(chain, a)                                                                     \
    do {                                                                                       \
        const vf wv = vf_set1(w[a]);                                                           \
        const void *va = ATTN_ROW(a);                                                          \
        for (int i = 0; i < ATTN_NV; i++) chain[i] = vf_fmadd(wv, kv_vload(va, i * VL, kvb), chain[i]); \
    } while (0)
    int64_t a = from;
    if (ATTN_CHAINS == 2) {
        if ((a & 1) && a < to) { ATTN_ADD(c1, a); a++; }
        for (; a + 2 <= to; a += 2) { ATTN_ADD(c0, a); ATTN_ADD(c1, a + 1); }
        if (a < to) { ATTN_ADD(c0, a); a++; }
    } else {
        for (; a < to; a++) ATTN_ADD(c0, a);
    }
#undef ATTN_ADD
#undef ATTN_ROW
    for (int i = 0; i < ATTN_NV; i++) vf_store(o + i * VL, c0[i]);
    if (ATTN_CHAINS == 2)
        for (int i = 0; i < ATTN_NV; i++) vf_store(o + 64 + i * VL, c1[i]);
}

static inline void attn_finish64(const float *o, float *oh) {
    for (int i = 0; i < ATTN_NV; i++) {
        vf sum = vf_load(o + i * VL);
        if (ATTN_CHAINS == 2) sum = vf_add(sum, vf_load(o + 64 + i * VL));
        vf_store(oh + i * VL, sum);
    }
}

/* Any head size: out = sum over ranks of w[a] * v[list[a]], one chain. */
static inline void attn_values_any(const float *w, const void *vh, const int32_t *listed, int64_t len,
                                   int64_t D, float *oh, int kvb) {
    for (int64_t i = 0; i < D; i++) oh[i] = 0.0f;
    for (int64_t a = 0; a < len; a++) {
        const float wa = w[a];
        const void *va = kv_row(vh, listed ? (int64_t)listed[a] : a, D, kvb);
        const vf wv = vf_set1(wa);
        int64_t i = 0;
        for (; i + VL <= D; i += VL) vf_store(oh + i, vf_fmadd(wv, kv_vload(va, i, kvb), vf_load(oh + i)));
        for (; i < D; i++) oh[i] += wa * kv_get(va, i, kvb);
    }
}

/* The key list of token t: NULL (rank = slot) and its length causally, else the allowed slots. */
static inline int64_t attn_list(const uint8_t *mask, int64_t A, int64_t T, int64_t t, int32_t *listed,
                                const int32_t **out) {
    if (!mask) {
        *out = NULL;
        return A - T + t + 1;
    }
    int64_t len = 0;
    const uint8_t *allowed = mask + t * A;
    for (int64_t a = 0; a < A; a++)
        if (allowed[a]) listed[len++] = (int32_t)a;
    *out = listed;
    return len;
}

/* Queries [qbeg, qend) of key/value head g, token-major (query qi is token qi / group of
 * query head g * group + qi % group: a chunk holds one or two neighbouring tokens, whose
 * lists are nearly as long), walking their shared prefix [0, P) together: P is the
 * shortest of their lists causally, the shortest leading run of allowed slots (lead[t])
 * under a mask. work: (qend - qbeg) * (A + 8 + 64 * ATTN_CHAINS) floats; lists: as many
 * int32 lists of A (NULL without a mask). D = 64. */
static inline __attribute__((always_inline)) void
attend_chunk(const float *q, const void *k, const void *v, const uint8_t *mask, const int64_t *lead, float *out,
             int64_t H, int64_t Hkv, int64_t S, int64_t A, int64_t T, float scale, int64_t g, int64_t qbeg,
             int64_t qend, float *work, int32_t *lists, const int kvb) {
    enum { D = 64 };
    const int64_t group = H / Hkv, C = qend - qbeg, stride = A + 8;
    const void *kh = kv_row(k, g * S, D, kvb), *vh = kv_row(v, g * S, D, kvb);
    float *scores = work, *acc = work + C * stride;
    const int32_t *listed[ATTN_CHUNK];
    int64_t len[ATTN_CHUNK], head[ATTN_CHUNK], token[ATTN_CHUNK], P = A;
    for (int64_t c = 0; c < C; c++) {
        token[c] = (qbeg + c) / group;
        head[c] = g * group + (qbeg + c) % group;
        len[c] = attn_list(mask, A, T, token[c], lists ? lists + c * A : NULL, &listed[c]);
        const int64_t shared = mask ? lead[token[c]] : len[c];
        P = shared < P ? shared : P;
    }
#define QROW(c) (q + (head[c] * T + token[c]) * D)
    for (int64_t b = 0; b < P; b += ATTN_KEY_BLOCK) {
        const int64_t e = b + ATTN_KEY_BLOCK < P ? b + ATTN_KEY_BLOCK : P;
        for (int64_t c = 0; c < C; c++)
            attn_scores(QROW(c), kh, listed[c], b, e, D, scale, scores + c * stride, kvb);
    }
    for (int64_t c = 0; c < C; c++) {
        attn_scores(QROW(c), kh, listed[c], P, len[c], D, scale, scores + c * stride, kvb);
        attn_softmax(scores + c * stride, len[c]);
    }
#undef QROW
    memset(acc, 0, sizeof(float) * C * 64 * ATTN_CHAINS);
    for (int64_t b = 0; b < P; b += ATTN_KEY_BLOCK) {
        const int64_t e = b + ATTN_KEY_BLOCK < P ? b + ATTN_KEY_BLOCK : P;
        for (int64_t c = 0; c < C; c++)
            attn_values64(acc + c * 64 * ATTN_CHAINS, scores + c * stride, vh, listed[c], b, e, kvb);
    }
    for (int64_t c = 0; c < C; c++) {
        attn_values64(acc + c * 64 * ATTN_CHAINS, scores + c * stride, vh, listed[c], P, len[c], kvb);
        attn_finish64(acc + c * 64 * ATTN_CHAINS, out + (token[c] * H + head[c]) * D);
    }
}

/* The two cache kinds' copies of attend_chunk (kvb a constant in each: no test in its loops). */
#define ATTEND_CHUNK_ARGS                                                                                       \
    const float *q, const void *k, const void *v, const uint8_t *mask, const int64_t *lead, float *out, int64_t H, \
        int64_t Hkv, int64_t S, int64_t A, int64_t T, float scale, int64_t g, int64_t qbeg, int64_t qend,         \
        float *work, int32_t *lists
static void attend_chunk_f32(ATTEND_CHUNK_ARGS) {
    attend_chunk(q, k, v, mask, lead, out, H, Hkv, S, A, T, scale, g, qbeg, qend, work, lists, 0);
}
static void attend_chunk_bf16(ATTEND_CHUNK_ARGS) {
    attend_chunk(q, k, v, mask, lead, out, H, Hkv, S, A, T, scale, g, qbeg, qend, work, lists, 1);
}

/* attend_few's operands, for the tasks of task_pool.h. */
typedef struct {
    const float *q;
    const void *k, *v;
    const uint8_t *mask;
    const int64_t *lead;
    float *out;
    int64_t H, Hkv, S, A, T, D, chunks, per_head;
    float scale;
    int kvb;
} attn_job;

/* Units [begin, end) of the chunked path: unit u = chunk u % chunks of key/value head u / chunks. */
static void attn_chunks(void *job, int64_t begin, int64_t end) {
    const attn_job *j = job;
    float *work = malloc(sizeof(float) * ATTN_CHUNK * (j->A + 8 + 64 * ATTN_CHAINS) +
                         (j->mask ? sizeof(int32_t) * ATTN_CHUNK * j->A : 0));
    if (!work) abort();
    int32_t *lists = j->mask ? (int32_t *)(work + ATTN_CHUNK * (j->A + 8 + 64 * ATTN_CHAINS)) : NULL;
    for (int64_t u = begin; u < end; u++) {
        const int64_t g = u / j->chunks, c = u % j->chunks;
        const int64_t qbeg = c * j->per_head / j->chunks, qend = (c + 1) * j->per_head / j->chunks;
        (j->kvb ? attend_chunk_bf16 : attend_chunk_f32)(j->q, j->k, j->v, j->mask, j->lead, j->out, j->H, j->Hkv,
                                                        j->S, j->A, j->T, j->scale, g, qbeg, qend, work, lists);
    }
    free(work);
}

/* Queries [begin, end) of the one-query path: query ht = token ht % T of head ht / T. */
static void attn_rows(void *job, int64_t begin, int64_t end) {
    const attn_job *j = job;
    const int64_t H = j->H, T = j->T, D = j->D, A = j->A, S = j->S, group = H / j->Hkv;
    const uint8_t *mask = j->mask;
    for (int64_t ht = begin; ht < end; ht++) {
        const int64_t h = ht / T, t = ht % T;
        int32_t store[mask ? A : 1];
        const int32_t *listed;
        const int64_t len = attn_list(mask, A, T, t, store, &listed);
        const float *qh = j->q + (h * T + t) * D;
        const void *kh = kv_row(j->k, (h / group) * S, D, j->kvb), *vh = kv_row(j->v, (h / group) * S, D, j->kvb);
        float scores[len + 8];
        attn_scores(qh, kh, listed, 0, len, D, j->scale, scores, j->kvb);
        attn_softmax(scores, len);
        float *oh = j->out + (t * H + h) * D;
        if (D == 64) {
            float acc[64 * ATTN_CHAINS];
            memset(acc, 0, sizeof(acc));
            attn_values64(acc, scores, vh, listed, 0, len, j->kvb);
            attn_finish64(acc, oh);
        } else {
            attn_values_any(scores, vh, listed, len, D, oh, j->kvb);
        }
    }
}

void attend_few(const float *q, const void *k, const void *v, const uint8_t *mask, float *out, int64_t H,
                int64_t Hkv, int64_t S, int64_t A, int64_t T, int64_t D, float scale, int64_t kvb) {
    const int64_t per_head = (H / Hkv) * T;
    attn_job job = {q, k, v, mask, NULL, out, H, Hkv, S, A, T, D, 0, per_head, scale, kvb != 0};
    if (D == 64) {
        /* Under a mask, each row's leading run of allowed slots (its ranks that are slots). */
        int64_t lead[mask ? T : 1];
        for (int64_t t = 0; mask && t < T; t++) {
            int64_t run = 0;
            while (run < A && mask[t * A + run]) run++;
            lead[t] = run;
        }
        /* Chunks of at most ATTN_CHUNK queries per key/value head, sized evenly; one
         * workspace per task. Many small tasks: a prompt's later tokens attend more keys. */
        job.lead = lead;
        job.chunks = (per_head + ATTN_CHUNK - 1) / ATTN_CHUNK;
        pool_for(Hkv * job.chunks, 8, attn_chunks, &job);
        return;
    }
    /* One query per step (D != 64): (head, token) pairs in parallel, the same three steps. */
    pool_for(H * T, 2, attn_rows, &job);
}

/* ---- rotary embedding + KV-cache write, fused ------------------------------------
 * qkv: [T, (H + 2 Hkv) D] float32, the fused projection's output (queries, keys,
 * values); cos, sin: [T, D] for the tokens' positions. Writes the rotated queries
 * to q_out [H, T, D] and the rotated keys and the values into one layer of the
 * cache, k, v: [Hkv, S, D] at slots [start, start + T), float32 or, where kvb, bf16
 * (rounded to nearest even: kv_put). Rotation in the
 * rotate-half convention of the Hugging Face checkpoints:
 * x * cos + (-x[D/2:], x[:D/2]) * sin. Replaces ~14 small torch calls per layer. */
void rope_and_store(const float *qkv, const float *cos, const float *sin, float *q_out, void *k, void *v,
                    int64_t start, int64_t T, int64_t H, int64_t Hkv, int64_t S, int64_t D, int64_t kvb) {
    const int64_t width = (H + 2 * Hkv) * D, half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * width, *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < H; h++) {
            const float *x = row + h * D;
            float *dst = q_out + (h * T + t) * D;
            for (int64_t i = 0; i < half; i++) dst[i] = x[i] * c[i] - x[i + half] * s[i];
            for (int64_t i = half; i < D; i++) dst[i] = x[i] * c[i] + x[i - half] * s[i];
        }
        for (int64_t h = 0; h < Hkv; h++) { /* the key rotated as the queries, then stored (rounded where bf16) */
            const float *x = row + (H + h) * D;
            void *dst = (void *)kv_row(k, h * S + start + t, D, kvb != 0);
            for (int64_t i = 0; i < half; i++) kv_put(dst, i, x[i] * c[i] - x[i + half] * s[i], kvb != 0);
            for (int64_t i = half; i < D; i++) kv_put(dst, i, x[i] * c[i] + x[i - half] * s[i], kvb != 0);
        }
        for (int64_t h = 0; h < Hkv; h++) {
            const float *x = row + (H + Hkv + h) * D;
            void *dst = (void *)kv_row(v, h * S + start + t, D, kvb != 0);
            if (kvb)
                for (int64_t i = 0; i < D; i++) kv_put(dst, i, x[i], 1);
            else
                memcpy(dst, x, sizeof(float) * D);
        }
    }
}

/* ---- SwiGLU and a whole stack of decoder layers in one call -----------------------
 * A one-token pass of the default model is ~120 matrix products, 30 rotary and 30
 * attention calls, each a few microseconds of Python and ctypes around the C, together a
 * sizeable share of the pass (docs/bench/2026-12-07-notes-from-kernels-and-model.md).
 * decode_layers runs the layers of a pass (a few tokens, or a whole prompt) in one foreign call with
 * exactly the steps, and so the numbers, of the per-layer path (Transformer.forward): the same product,
 * rotary and attention functions, float32 residual adds x + y, and the SwiGLU below, which both paths use. */

/* h[t][i] = silu(g) u = g u / (1 + exp(-g)) with g = gu[t][i], u = gu[t][I + i]:
 * gu [rows, 2 I], h [rows, I], float32. exp from vf_exp_neg on -|g| (sigmoid(g) =
 * 1 / (1 + e) for g >= 0, e / (1 + e) below, e = exp(-|g|): never overflows), VL
 * lanes at a time and the scalar tail with the same arithmetic, so every element's
 * result depends on its own g and u only. */
static inline vf vf_silu_mul(vf g, vf u) {
    const vf e = vf_exp_neg(vf_sub(vf_zero(), vf_abs(g)));
    const vf one = vf_set1(1.0f);
    const vf sig_pos = vf_div(one, vf_add(one, e)), sig_neg = vf_div(e, vf_add(one, e));
    return vf_mul(vf_mul(g, vf_select_nonneg(g, sig_pos, sig_neg)), u);
}
void swiglu_rows(const float *gu, float *h, int64_t rows, int64_t inter) {
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gu + t * 2 * inter, *u = g + inter;
        float *dst = h + t * inter;
        int64_t i = 0;
        for (; i + VL <= inter; i += VL) vf_store(dst + i, vf_silu_mul(vf_load(g + i), vf_load(u + i)));
        if (i < inter) {
            const int64_t n = inter - i;
            vf_store_tail(dst + i, vf_silu_mul(vf_load_tail(g + i, n), vf_load_tail(u + i, n)), n);
        }
    }
}

/* One matrix of a layer: kind 0 = bf16 (wp, b), 1 = int8 (wp, scale, b), 2 = Q4_1 (wp, b), 3 = Q4_1B
 * (wp, scale = dstep, b),
 * packed as for the products above (in, out already padded). */
typedef struct {
    int32_t kind, unused;
    const void *wp;
    const float *scale;
    const uint16_t *b;
    int64_t in, out;
} mat_desc;
typedef struct {
    mat_desc qkv, o, gate_up, down; /* qkv [(H + 2 Hkv) D, E], o [E, H D], gate_up [2 I, E], down [E, I] */
    const float *attn_norm, *mlp_norm; /* [E] float32 */
} layer_desc;

static void mat_rows(const mat_desc *m, const float *x, const float *norm_w, float eps, float *y, int64_t rows) {
    if (m->kind == 1)
        skinny_gemm_int8w(x, 1, m->wp, m->scale, m->b, y, 1, rows, m->in, m->out, norm_w, eps);
    else if (m->kind == 2)
        skinny_gemm_q4_1(x, 1, m->wp, m->b, y, 1, rows, m->in, m->out, norm_w, eps);
    else if (m->kind == 3)
        skinny_gemm_q4_1b(x, 1, m->wp, m->scale, m->b, y, 1, rows, m->in, m->out, norm_w, eps);
    else
        skinny_gemm_bf16(x, 1, m->wp, m->b, y, 1, rows, m->in, m->out, norm_w, eps);
}

static void add_rows(float *x, const float *y, int64_t n) {
    int64_t i = 0;
    for (; i + VL <= n; i += VL) vf_store(x + i, vf_add(vf_load(x + i), vf_load(y + i)));
    for (; i < n; i++) x[i] = x[i] + y[i];
}

/* The decoder layers over T new tokens (attention on attend_few):
 *   x      [T, E] float32, the residual stream, updated in place
 *   cos, sin [T, D] the tokens' rotary factors
 *   k, v   the cache, [L, Hkv, S, D] float32, or bf16 where kvb (kv_row); the new keys/values go to slots
 *          [start, start + T)
 *   A, mask as attend_few (mask [T, A] or NULL for causal), scale = 1 / sqrt(D)
 * Per layer: x += o(attn(rope(qkv(rms(x))))); x += down(swiglu(gate_up(rms(x)))). */
typedef struct {
    float *x;
    int64_t T;
    const layer_desc *layers;
    int64_t n_layers;
    float eps;
    const float *cos, *sin;
    void *k, *v;
    int64_t start, H, Hkv, S, D, kvb, A;
    const uint8_t *mask;
    float scale;
} layers_job;

static void layers_body(void *arg) {
    const layers_job *j = arg;
    float *x = j->x;
    char *k = j->k, *v = j->v;
    const layer_desc *layers = j->layers;
    const float *cos = j->cos, *sin = j->sin;
    const uint8_t *mask = j->mask;
    const float eps = j->eps, scale = j->scale;
    const int64_t T = j->T, n_layers = j->n_layers, start = j->start, H = j->H, Hkv = j->Hkv, S = j->S, D = j->D,
                  A = j->A, kvb = j->kvb;
    const int64_t E = layers[0].qkv.in, QKV = layers[0].qkv.out, I = layers[0].down.in, HD = H * D;
    float *buf = malloc(sizeof(float) * T * (QKV + 2 * HD + E + 2 * I + I));
    if (!buf) abort();
    float *qkv = buf, *q = qkv + T * QKV, *attn = q + T * HD, *tmp = attn + T * HD, *gu = tmp + T * E,
          *h = gu + T * 2 * I;
    const int64_t layer_bytes = Hkv * S * D * (kvb ? sizeof(uint16_t) : sizeof(float));
    for (int64_t li = 0; li < n_layers; li++) {
        const layer_desc *L = layers + li;
        char *kl = k + li * layer_bytes, *vl = v + li * layer_bytes;
        mat_rows(&L->qkv, x, L->attn_norm, eps, qkv, T);
        rope_and_store(qkv, cos, sin, q, kl, vl, start, T, H, Hkv, S, D, kvb);
        attend_few(q, kl, vl, mask, attn, H, Hkv, S, A, T, D, scale, kvb);
        mat_rows(&L->o, attn, NULL, 0.0f, tmp, T);
        add_rows(x, tmp, T * E);
        mat_rows(&L->gate_up, x, L->mlp_norm, eps, gu, T);
        swiglu_rows(gu, h, T, I);
        mat_rows(&L->down, h, NULL, 0.0f, tmp, T);
        add_rows(x, tmp, T * E);
    }
    free(buf);
}

/* Every layer of a pass in one parallel region (task_pool.h): its products and attention are jobs of that team. */
void decode_layers(float *x, int64_t T, const layer_desc *layers, int64_t n_layers, float eps, const float *cos,
                   const float *sin, void *k, void *v, int64_t start, int64_t H, int64_t Hkv, int64_t S, int64_t D,
                   int64_t kvb, int64_t A, const uint8_t *mask, float scale) {
    layers_job job = {x, T, layers, n_layers, eps, cos, sin, k, v, start, H, Hkv, S, D, kvb, A, mask, scale};
    team_run(layers_body, &job);
}

/* ---- picking tokens from rows of scores ------------------------------------------------
 * argmax_row: the index of a row's maximum, the first one among equals, and a NaN's index
 * if the row has one (the first NaN): numpy's and torch's argmax rule, the greedy choice
 * everywhere (engine.acceptance.argmax_index). A block of 64 is looked at one by one only
 * where it may hold a larger value or a NaN: its vector max beats the best so far, or its
 * sum of x * 0 is not 0 (NaN, and inf, which is then compared one by one as any value).
 *
 * top_rows: each row's `top` best entries (value descending, the lower index first among
 * equals, NaN never one: head_candidates), the rows given as pointers (a pass's p and q
 * rows live in different tensors), one task per row. The events' top entries
 * (engine/verification.py), in a fraction of torch.topk's time
 * (docs/bench/2026-12-07-notes-from-kernels-and-model.md). */
static int64_t argmax_row(const float *y, int64_t n) {
    int64_t best = 0;
    float bv = y[0];
    if (bv != bv) return 0;
    int64_t i0 = 1;
    for (; i0 < n; i0 += HEAD_BLOCK) {
        const int64_t i1 = i0 + HEAD_BLOCK < n ? i0 + HEAD_BLOCK : n;
        if (i1 - i0 == HEAD_BLOCK) {
            vf m = vf_load(y + i0), odd = vf_mul(m, vf_zero());
            for (int64_t j = VL; j < HEAD_BLOCK; j += VL) {
                const vf v = vf_load(y + i0 + j);
                m = vf_max(m, v);
                odd = vf_add(odd, vf_mul(v, vf_zero()));
            }
            if (!(vf_reduce_max(m) > bv) && vf_reduce_add(odd) == 0.0f) continue;
        }
        for (int64_t i = i0; i < i1; i++) {
            const float v = y[i];
            if (v != v) return i;
            if (v > bv) {
                bv = v;
                best = i;
            }
        }
    }
    return best;
}

typedef struct {
    const float *const *rows;
    int64_t n, top;
    int64_t *idx, *count;
} top_job;

static void top_tasks(void *arg, int64_t begin, int64_t end) {
    const top_job *j = arg;
    for (int64_t r = begin; r < end; r++) j->count[r] = head_candidates(j->rows[r], j->n, j->top, j->idx + r * j->top);
}

/* idx [R, top]: row r's best entries (count[r] of them: fewer where the row has NaNs), rows[r] float32 [n]. */
void top_rows(const float *const *rows, int64_t R, int64_t n, int64_t top, int64_t *idx, int64_t *count) {
    top_job job = {rows, n, top, idx, count};
    pool_for(R, 1, top_tasks, &job);
}

/* Pass i of a chain: token at slot and position start + i, its logits into y. */
static void chain_pass(int64_t token, int64_t i, const void *embed, int embed_f32, const layer_desc *layers,
                       int64_t n_layers, float eps, const float *cos, const float *sin, void *k, void *v,
                       int64_t start, int64_t H, int64_t Hkv, int64_t S, int64_t D, int64_t kvb, float scale,
                       const mat_desc *head,
                       const float *norm_w, const int8_t *w8, const float *scale8, int64_t top, float *y) {
    const int64_t E = head->in, V = head->out;
    float x[E];
    if (embed_f32)
        memcpy(x, (const float *)embed + token * E, sizeof(float) * E);
    else
        for (int64_t e = 0; e < E; e++) x[e] = bf16_bits_to_float(((const uint16_t *)embed)[token * E + e]);
    decode_layers(x, 1, layers, n_layers, eps, cos + i * D, sin + i * D, k, v, start + i, H, Hkv, S, D, kvb,
                  start + i + 1, NULL, scale);
    if (top > 0)
        head_q4_rescored(x, 1, head->kind, head->wp, head->scale, w8, scale8, y, 1, E, V, V, top, norm_w, eps);
    else
        mat_rows(head, x, norm_w, eps, y, 1);
}

/* ---- a greedy draft chain: n one-token passes in one call ----------------------------
 * What a model drafter's loop does for a greedy chain (engine/drafters/model.py), without
 * going back to Python between its passes (where each pass pays for its tensors, its plan
 * and the call). Pass i feeds token t_i (t_0 = token) at slot and position start + i: its row of
 * the embedding (bf16 or float32 [V, E], widened exactly to float32), decode_layers over it
 * (causal: A = start + i + 1, rotary factors cos[i], sin[i], attention scale as given),
 * the final-normed row projected to logits[i] (the head: a mat_desc product with float32
 * out, or head_q4_rescored when top > 0), then t_{i+1} = argmax_row(logits[i]) into
 * tokens[i]. Every step is the call a one-token pass makes, in the same order: logits[i] is
 * bit for bit that pass's row. The head's out is the vocabulary V (no padding: the caller
 * checks). What it saves per draft pass: docs/bench/2026-12-05-greedy-chain.md and
 * docs/bench/2026-12-07-notes-from-kernels-and-model.md. */
void greedy_chain(int64_t token, int64_t n, const void *embed, int embed_f32, const layer_desc *layers,
                  int64_t n_layers, float eps, const float *cos, const float *sin, void *k, void *v, int64_t start,
                  int64_t H, int64_t Hkv, int64_t S, int64_t D, int64_t kvb, float scale, const mat_desc *head,
                  const float *norm_w, const int8_t *w8, const float *scale8, int64_t top, float *logits,
                  int64_t *tokens) {
    const int64_t V = head->out;
    for (int64_t i = 0; i < n; i++) {
        float *y = logits + i * V;
        chain_pass(token, i, embed, embed_f32, layers, n_layers, eps, cos, sin, k, v, start, H, Hkv, S, D, kvb,
                   scale, head, norm_w, w8, scale8, top, y);
        token = argmax_row(y, V);
        tokens[i] = token;
    }
}

/* ---- a sampled draft chain -------------------------------------------------------------
 * greedy_chain's passes with each pass's token drawn instead of taken as the argmax: what a
 * model drafter's loop does for a sampled chain (temperature T > 0, no top-k or top-p), where
 * Python's loop costs a share of every pass (docs/bench/2026-12-05-sampled-chains.md and
 * docs/bench/2026-12-07-notes-from-kernels-and-model.md).
 *
 *   q[i] = softmax(logits[i] / T): z = y / T (float32, as torch divides), e = exp(z - max z)
 *          (vf_exp_neg, relative error < 2e-7; its floor, e^-87 on avx2 and e^-104 on avx512, stands for
 *          anything smaller), q = e * (1 / sum e), float32 [V]: this q is the drafter's, returned
 *          and recorded as it is (the verifier's q: nothing recomputes it)
 *   t_{i+1} = the inverse CDF of q[i] at u[i] (u uniform in [0, 1), drawn by the caller from the
 *          run's generator): the first index whose running sum of q (float64) reaches u times
 *          the total, among entries with q > 0. The running sums are taken in blocks of 64 (four
 *          float64 chains per block, then the blocks in order), and the one block the draw lands
 *          in is walked entry by entry: a nondecreasing CDF whose steps are q's entries to
 *          float64 rounding (~1e-16 relative, as engine.sampling's float64 cumsum); a walk that
 *          ends a rounding short of the block's sum takes the block's last entry with q > 0.
 * Every pass is the one-token pass's, bit for bit (logits[i]); tokens[i] = t_{i+1}. A row with a NaN or
 * infinite logit (or one that y / T overflows) has no q to draw from: tokens[i] = -1 and the chain stops
 * there (the caller raises). */
#define SAMPLE_BLOCK 64
static int64_t sample_row(const float *y, int64_t V, float temperature, double u, float *q) {
    const vf vt = vf_set1(temperature);
    vf vmax = vf_set1(-INFINITY), vbad = vf_zero(); /* vbad: the sum of z * 0, not 0 where a z is NaN or infinite */
    int64_t j = 0;
    for (; j + VL <= V; j += VL) {
        const vf z = vf_div(vf_load(y + j), vt);
        vf_store(q + j, z);
        vmax = vf_max(vmax, z);
        vbad = vf_add(vbad, vf_mul(z, vf_zero()));
    }
    float mx = vf_reduce_max(vmax), bad = vf_reduce_add(vbad);
    for (; j < V; j++) { /* (the vocabulary's tail past the last full vector) */
        q[j] = y[j] / temperature;
        mx = q[j] > mx ? q[j] : mx;
        bad += q[j] * 0.0f;
    }
    if (bad != 0.0f || !isfinite(mx)) return -1; /* a NaN or infinite logit (or y / T overflowing): no q to draw from */
    const float sum = exp_and_sum(q, V, mx); /* q = exp(z - max z) */
    if (!(sum > 0.0f) || !isfinite(sum)) return -1;
    const vf vinv = vf_set1(1.0f / sum);
    for (j = 0; j + VL <= V; j += VL) vf_store(q + j, vf_mul(vf_load(q + j), vinv));
    if (j < V) vf_store_tail(q + j, vf_mul(vf_load_tail(q + j, V - j), vinv), V - j);
    /* the blocks' sums in float64, then the draw */
    const int64_t blocks = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double sums[blocks];
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t lo = b * SAMPLE_BLOCK, hi = lo + SAMPLE_BLOCK < V ? lo + SAMPLE_BLOCK : V;
        double c[4] = {0.0, 0.0, 0.0, 0.0};
        for (j = lo; j < hi; j++) c[(j - lo) & 3] += (double)q[j];
        sums[b] = (c[0] + c[1]) + (c[2] + c[3]);
        total += sums[b];
    }
    const double value = u * total;
    double before = 0.0;
    int64_t b = 0;
    for (; b < blocks - 1 && !(before + sums[b] >= value && sums[b] > 0.0); b++) before += sums[b];
    const int64_t lo = b * SAMPLE_BLOCK, hi = lo + SAMPLE_BLOCK < V ? lo + SAMPLE_BLOCK : V;
    int64_t last = -1;
    double run = before;
    for (j = lo; j < hi; j++) {
        if (!(q[j] > 0.0f)) continue;
        run += (double)q[j];
        last = j;
        if (run >= value) return j;
    }
    if (last >= 0) return last;
    for (j = V - 1; j > 0 && !(q[j] > 0.0f); j--) { /* (a block of zeros: only where q has no mass left) */
    }
    return j;
}

void sampled_chain(int64_t token, int64_t n, const void *embed, int embed_f32, const layer_desc *layers,
                   int64_t n_layers, float eps, const float *cos, const float *sin, void *k, void *v, int64_t start,
                   int64_t H, int64_t Hkv, int64_t S, int64_t D, int64_t kvb, float scale, const mat_desc *head,
                   const float *norm_w, const int8_t *w8, const float *scale8, int64_t top, float *logits,
                   int64_t *tokens, float temperature, const double *uniforms, float *q) {
    const int64_t V = head->out;
    for (int64_t i = 0; i < n; i++) {
        float *y = logits + i * V;
        chain_pass(token, i, embed, embed_f32, layers, n_layers, eps, cos, sin, k, v, start, H, Hkv, S, D, kvb,
                   scale, head, norm_w, w8, scale8, top, y);
        token = sample_row(y, V, temperature, uniforms[i], q + i * V);
        tokens[i] = token;
        if (token < 0) return;
    }
}
