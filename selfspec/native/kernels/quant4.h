// selfspec's 4-bit few-row products y = x · Wᵀ (+ bias) (the op selfspec::int4_gemv, and int4
// layers of the fused layer; see selfspec/native/gemv.py and selfspec/model/quantize.py, which lays
// the blocks out).
//
// W [N, K] as blocks of 32 inputs, w = q · scale - minimum, q in 0..15, a row's blocks in groups of
// GROUP = 16 (the last group of a row may hold fewer, g). Q [N, K / 32, 16] uint8, the nibbles: a
// group's 16 g bytes are four slices of 4 g bytes, slice k holding 4 bytes of each block in turn,
// byte p of block l's holding its element 4k + p in the low nibble and 16 + 4k + p in the high one.
// So one 32-bit lane of a 64-byte slice belongs to one block, and a group's four slices give each
// of its blocks its own lane. S [N, groups, RECORD] uint8, a group's scales (llama.cpp's Q4_K idea,
// with 8-bit codes): 16 scale codes, 16 minimum codes (one a block; a part-filled group's padded
// with zeros), then three bfloat16s: the scale step, the minimum step and the minimum base. A
// block's scale is its code times the scale step (exact in float32: 16 significant bits at most),
// its minimum its code times the minimum step (exact) plus the base, rounded once. So a weight costs
// 4 + 38 · 8 / 512 = 4.59 bits (GGUF Q4_1's bfloat16-per-block grid cost 5). x [R, K]
// bfloat16, any R >= 1; y [R_out, N] bfloat16 (rows past R copy row R - 1).
//
// Why: a decode step streams its weights once, so its time is their bytes over the memory's rate,
// provided the arithmetic keeps up. It does by integer dot products, as llama.cpp's 4-bit products
// do: each row of x is quantized to int8 in blocks of 32 (xq = round(x / dx), dx = the block's max
// |x| / 127), and a block's nibbles times xq sum exactly in int32 (AVX512-VNNI's vpdpbusd; AVX2's
// vpmaddubsw elsewhere); the block's sum of w · x is then
//   dx · scale · Σ q · xq  -  minimum · dx · Σ xq,
// the integer sum exact. Because each block has its own lane, a row's float work is one convert,
// one multiply and two FMAs per 16 blocks (a group), shared by its eight vpdpbusd: the many-row
// products a verify runs are bound by that arithmetic.
//
// Exactness: a row's int8 quantization depends on that row alone, its integer sums are exact, and
// its float sums run in one fixed order (per lane, in group order; lanes added as product.h's
// hsum) whatever the number of rows in the call, the pass it falls in or the thread count; so row
// r of an n-row call equals the 1-row call's bit for bit. The AVX2 and AVX-512 paths round their
// float sums their own ways. The result is not x · W in float: x is int8 to within half a step of
// its block (this is int4 mode's own arithmetic, which speculation reproduces).
#pragma once
#include <vector>

#include "entry.h"
#include "product.h"

namespace int4 {

constexpr int BLOCK = 32;
constexpr int GROUP = INT4_GROUP;    // blocks a group: one 32-bit lane each
constexpr int RECORD = INT4_RECORD;  // bytes of a group's scales: codes, then three bfloat16s
constexpr int Q_AHEAD = 2048;   // bytes of nibbles (and an eighth as many of scales) prefetched ahead
constexpr int Q_FAR = 16384;    // and, for one or two rows, further ahead into L2 (8192: 1.2x the time)

static inline long groups_of(long K) { return int4_groups(K); }
static inline int group_size(long nb, long gi) { return (int)std::min<long>(GROUP, nb - gi * GROUP); }

// A group's record: its scale codes, minimum codes, then three bfloat16s (record_value's i).
enum { SCALE_STEP, MIN_STEP, MIN_BASE };
static inline float record_value(const uint8_t* s, int i) {
    uint16_t v;
    memcpy(&v, s + 2 * GROUP + 2 * i, 2);
    return bf16_to_float(v);
}

// One row of x, prepared: per group of 16 blocks (the last one zero-padded), PREPARED_BYTES bytes:
// xs [8][64] int8, xs[2k] lane l holding block l's xq elements 4k..4k+3 and xs[2k + 1] its 16 + 4k..,
// matching Q's slices; then d [16] float (block l's dx) and dt [16] float (dx · Σ xq).
static constexpr long PREPARED_BYTES = 8 * 64 + 2 * 64;  // xs, then d and dt (16 four-byte lanes each)

struct Prepared {
    long groups;
    const uint8_t* base;
    const uint8_t* group(long gi) const { return base + gi * PREPARED_BYTES; }
    const int8_t* xs(long gi, int s) const { return (const int8_t*)(group(gi) + 64 * s); }
    const float* d(long gi) const { return (const float*)(group(gi) + 8 * 64); }
    const float* dt(long gi) const { return (const float*)(group(gi) + 9 * 64); }
};

// Row x [K] (bfloat16 bits) into `out` (groups_of(K) · PREPARED_BYTES bytes), eight elements a
// vector: xq = x · (127 / max |x|) rounded half to even (cvtps2dq). A block holding a NaN or an
// infinity gets dx NaN and xq 0, so the row's outputs are NaN, as the float products give.
static Prepared prepare(const uint16_t* x, long K, uint8_t* out) {
    const long G = groups_of(K), nb = K / BLOCK;
    if (nb % GROUP) memset(out + (G - 1) * PREPARED_BYTES, 0, PREPARED_BYTES);  // a part-filled group's padding
    const Prepared P{G, out};
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), zero = _mm256_setzero_ps();
    const __m256i words = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs' order back to elements'
    for (long b = 0; b < nb; b++) {
        const uint16_t* xb = x + b * BLOCK;
        __m256 v[4], amax = zero, poison = zero;
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(xb + 8 * i))), 16));
            amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
            poison = _mm256_add_ps(poison, _mm256_mul_ps(v[i], zero));  // NaN when any is a NaN or an infinity
        }
        float lanes[8], sums[8];
        _mm256_storeu_ps(lanes, amax);
        _mm256_storeu_ps(sums, poison);
        float top = 0.f, nan = 0.f;
        for (int i = 0; i < 8; i++) top = std::max(top, lanes[i]), nan += sums[i];
        const bool finite = nan == 0.f;
        const float dx = finite ? top / 127.f : NAN;
        const float inv = finite && top > 0.f ? 127.f / top : 0.f;
        int32_t w[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 4-byte words of xq: elements 0-3, 4-7, ..., 28-31
        int sum = 0;
        if (finite) {
            __m256i q[4], total = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
                total = _mm256_add_epi32(total, q[i]);
            }
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i*)w, _mm256_permutevar8x32_epi32(bytes, words));
            int32_t t[8];
            _mm256_storeu_si256((__m256i*)t, total);
            for (int i = 0; i < 8; i++) sum += t[i];
        }
        const long gi = b / GROUP, l = b % GROUP;
        for (int k = 0; k < 4; k++) {
            memcpy((int8_t*)P.xs(gi, 2 * k) + 4 * l, w + k, 4);
            memcpy((int8_t*)P.xs(gi, 2 * k + 1) + 4 * l, w + 4 + k, 4);
        }
        ((float*)P.d(gi))[l] = dx;
        ((float*)P.dt(gi))[l] = dx * (float)sum;
    }
    return P;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT4_VNNI 1
constexpr int PASS = 8;  // rows per pass over W
constexpr const char* PATH = "avx512-vnni";

constexpr int STATE = 16;  // floats of a row's sums per output (16 lanes)

// A group's record as vectors: lane l holds block l's scale and minimum (a part-filled group's
// padding lanes: 0), the scale its code times the step (exact), the minimum its code times the
// minimum step plus the base in one FMA.
static inline void group_scales(const uint8_t* s, __m512& scale, __m512& minimum) {
    scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)s))),
                          _mm512_set1_ps(record_value(s, SCALE_STEP)));
    minimum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(s + GROUP)))),
                              _mm512_set1_ps(record_value(s, MIN_STEP)), _mm512_set1_ps(record_value(s, MIN_BASE)));
}

// Groups ga..gb-1 of output row j for R prepared rows, added to their sums in `state` (row r at
// r · STATE). One output row at a time: interleaving two or four (each row's x loaded once for
// them) measured slower, 1.2x the time for one row on a 2-core AMD EPYC (Qwen2.5-Coder 1.5B's
// layer shapes, 750 MB of blocks), the prefetches of one stream doing better than four. A row
// keeps one float accumulator per lane (the minimum's term subtracted by FMA as it comes): two, at
// eight rows, were spilled to the stack each group (a many-row call 0.7x the time with one).
template <int R>
static inline void rows(const uint8_t* Q, const uint8_t* S, const Prepared* X, float* state, long j, long K,
                        long ga, long gb, const uint16_t* bias, uint16_t* Y, long N) {
    const long nb = K / BLOCK, G = groups_of(K);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 dot[R];  // per lane: Σ dx · scale · Σ q · xq - minimum · dx · Σ xq, one accumulator a row
    for (int r = 0; r < R; r++) dot[r] = ga ? _mm512_loadu_ps(state + r * STATE) : _mm512_setzero_ps();
    for (long gi = ga; gi < gb; gi++) {
        const int g = group_size(nb, gi);
        const __mmask16 mask = g == GROUP ? (__mmask16)0xffff : (__mmask16)((1u << g) - 1);
        const uint8_t* q = Q + (j * nb + gi * GROUP) * 16;
        const uint8_t* s = S + (j * G + gi) * RECORD;
        for (int line = 0; line < 256; line += 64) _mm_prefetch((const char*)q + Q_AHEAD + line, _MM_HINT_T0);
        _mm_prefetch((const char*)s + Q_AHEAD / 8, _MM_HINT_T0);
        if constexpr (R <= 2) {  // memory-bound passes: more in flight
            for (int line = 0; line < 256; line += 64) _mm_prefetch((const char*)q + Q_FAR + line, _MM_HINT_T1);
            _mm_prefetch((const char*)s + Q_FAR / 8, _MM_HINT_T1);
        }
        __m512i acc[R];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
        for (int k = 0; k < 4; k++) {
            const __m512i v = _mm512_maskz_loadu_epi32(mask, q + 4 * g * k);
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            for (int r = 0; r < R; r++) {
                const __m512i xl = _mm512_loadu_si512(X[r].xs(gi, 2 * k));
                const __m512i xh = _mm512_loadu_si512(X[r].xs(gi, 2 * k + 1));
                acc[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r], lo, xl), hi, xh);
            }
        }
        __m512 scale, minimum;
        group_scales(s, scale, minimum);
        for (int r = 0; r < R; r++) {
            const __m512 step = _mm512_mul_ps(scale, _mm512_loadu_ps(X[r].d(gi)));
            dot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), step, dot[r]);
            dot[r] = _mm512_fnmadd_ps(minimum, _mm512_loadu_ps(X[r].dt(gi)), dot[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (gb < X[0].groups) {  // more tiles to come
            _mm512_storeu_ps(state + r * STATE, dot[r]);
            continue;
        }
        float sum = hsum16(dot[r]);
        if (bias) sum += bf16_to_float(bias[j]);
        Y[r * N + j] = float_to_bf16(sum);
    }
}
#else
#define INT4_VNNI 0
constexpr int PASS = 4;  // rows per pass
constexpr const char* PATH = "avx2";

// As above on 8 lanes, a group in two halves (blocks 0-7, 8-15); a lane's integer sum by vpmaddubsw
// (u8 · s8 pairs into int16, at most 2 · 15 · 127) summed over the four slices in int16 (at most
// 16 · 15 · 127 = 30,480: exact), then vpmaddwd into int32.
constexpr int STATE = 8;  // floats of a row's sums per output (8 lanes)

template <int R>
static inline void rows(const uint8_t* Q, const uint8_t* S, const Prepared* X, float* state, long j, long K,
                        long ga, long gb, const uint16_t* bias, uint16_t* Y, long N) {
    const long nb = K / BLOCK, G = groups_of(K);
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 dot[R];
    for (int r = 0; r < R; r++) dot[r] = ga ? _mm256_loadu_ps(state + r * STATE) : _mm256_setzero_ps();
    for (long gi = ga; gi < gb; gi++) {
        const int g = group_size(nb, gi);
        const uint8_t* s = S + (j * G + gi) * RECORD;
        for (int half = 0; half < 2; half++) {
            const int lanes = g - 8 * half;
            if (lanes <= 0) break;
            const bool full = lanes >= 8;
            const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), lane);
            const uint8_t* q = Q + (j * nb + gi * GROUP) * 16 + 32 * half;
            _mm_prefetch((const char*)q + Q_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char*)q + Q_AHEAD + 64, _MM_HINT_T0);
            _mm_prefetch((const char*)s + Q_AHEAD / 8, _MM_HINT_T0);
            __m256i p[R];
            for (int r = 0; r < R; r++) p[r] = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) {
                const int* at = (const int*)(q + 4 * g * k);
                const __m256i v = full ? _mm256_loadu_si256((const __m256i*)at) : _mm256_maskload_epi32(at, mask);
                const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                for (int r = 0; r < R; r++) {
                    const __m256i xl = _mm256_loadu_si256((const __m256i*)(X[r].xs(gi, 2 * k) + 32 * half));
                    const __m256i xh = _mm256_loadu_si256((const __m256i*)(X[r].xs(gi, 2 * k + 1) + 32 * half));
                    p[r] = _mm256_add_epi16(p[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl),
                                                                   _mm256_maddubs_epi16(hi, xh)));
                }
            }
            const __m256 scale = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(s + 8 * half)))),
                _mm256_set1_ps(record_value(s, SCALE_STEP)));
            const __m256 minimum = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(s + GROUP + 8 * half)))),
                _mm256_set1_ps(record_value(s, MIN_STEP)), _mm256_set1_ps(record_value(s, MIN_BASE)));
            for (int r = 0; r < R; r++) {
                const __m256i acc = _mm256_madd_epi16(p[r], ones);
                const __m256 step = _mm256_mul_ps(scale, _mm256_loadu_ps(X[r].d(gi) + 8 * half));
                dot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), step, dot[r]);
                dot[r] = _mm256_fnmadd_ps(minimum, _mm256_loadu_ps(X[r].dt(gi) + 8 * half), dot[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        if (gb < X[0].groups) {  // more tiles to come
            _mm256_storeu_ps(state + r * STATE, dot[r]);
            continue;
        }
        float sum = hsum(dot[r]);
        if (bias) sum += bf16_to_float(bias[j]);
        Y[r * N + j] = float_to_bf16(sum);
    }
}
#endif

#if INT4_VNNI
// Many rows (a prefill): J output rows times T rows of x at a time, over every group, so a weight
// vector feeds T rows and a prepared vector of x feeds J output rows (`rows` loads an x vector per
// two vpdpbusd). Each (output, row) pair's float work is `rows`' own, in the same order (per lane,
// in group order, then hsum16), so its result is the one-row call's bit for bit; only the exact
// integer sums are formed in another order. Its floor is the float work: vpdpbusd shares its two
// ports with the multiplies and FMAs (on a Zen 4 core, 12 vpdpbusd took 12 cycles, with 4 FMAs 16,
// with 4 converts, ands or shifts still 12), and a pair has 8 vpdpbusd and 3 of those a group, so
// about 11 cycles; tiles of 4 x 3 ran 14-16 (rows<R>, 17-19) with their data in cache.
template <int J, int T>
static inline void tile(const uint8_t* Q, const uint8_t* S, const Prepared* X, long j, long K, const uint16_t* bias,
                        uint16_t* Y, long N) {
    const long nb = K / BLOCK, G = groups_of(K);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 dot[J][T];
    for (int a = 0; a < J; a++)
        for (int t = 0; t < T; t++) dot[a][t] = _mm512_setzero_ps();
    for (long gi = 0; gi < G; gi++) {
        const int g = group_size(nb, gi);
        const __mmask16 mask = g == GROUP ? (__mmask16)0xffff : (__mmask16)((1u << g) - 1);
        __m512i acc[J][T];
        for (int a = 0; a < J; a++)
            for (int t = 0; t < T; t++) acc[a][t] = _mm512_setzero_si512();
        const uint8_t* q = Q + (j * nb + gi * GROUP) * 16;
        for (int k = 0; k < 4; k++)
            for (int half = 0; half < 2; half++) {  // the slice's low nibbles, then its high ones
                __m512i xv[T];
                for (int t = 0; t < T; t++) xv[t] = _mm512_loadu_si512(X[t].xs(gi, 2 * k + half));
                for (int a = 0; a < J; a++) {
                    __m512i w = _mm512_maskz_loadu_epi32(mask, q + a * nb * 16 + 4 * g * k);
                    if (half) w = _mm512_srli_epi16(w, 4);
                    w = _mm512_and_si512(w, low4);
                    for (int t = 0; t < T; t++) acc[a][t] = _mm512_dpbusd_epi32(acc[a][t], w, xv[t]);
                }
            }
        for (int a = 0; a < J; a++) {
            __m512 scale, minimum;
            group_scales(S + ((j + a) * G + gi) * RECORD, scale, minimum);
            for (int t = 0; t < T; t++) {
                const __m512 step = _mm512_mul_ps(scale, _mm512_loadu_ps(X[t].d(gi)));
                dot[a][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[a][t]), step, dot[a][t]);
                dot[a][t] = _mm512_fnmadd_ps(minimum, _mm512_loadu_ps(X[t].dt(gi)), dot[a][t]);
            }
        }
    }
    for (int a = 0; a < J; a++)
        for (int t = 0; t < T; t++) {
            float sum = hsum16(dot[a][t]);
            if (bias) sum += bf16_to_float(bias[j + a]);
            Y[t * N + j + a] = float_to_bf16(sum);
        }
}

// Output rows and rows of x a tile: 4 x 3 keeps 12 integer sums and a few vectors in registers (its
// 12 float sums go to the stack once a group); 2 x 4, 4 x 2, 2 x 6, 4 x 4 and 8 x 2 ran 1.03-1.8x
// its time (one thread, the 1.5B's K of 1536 and 8960, data in cache).
constexpr int TILE_J = 4, TILE_T = 3;
constexpr long TILE_X_BYTES = 256 << 10;   // prepared rows of x a pass over W keeps (in L2)

// tile<TILE_J, n> for n = 1..T rows of x
template <int T>
static inline void tiles(long n, const uint8_t* Q, const uint8_t* S, const Prepared* X, long j, long K,
                         const uint16_t* bias, uint16_t* Y, long N) {
    if constexpr (T > 1)
        if (n < T) return tiles<T - 1>(n, Q, S, X, j, K, bias, Y, N);
    tile<TILE_J, T>(Q, S, X, j, K, bias, Y, N);
}

// Every row through `tile`: x in spans of rows whose prepared bytes stay in L2, each span one
// parallel pass over W, each thread its own output rows, whose weights stay in L1 while the
// span's rows go by, TILE_T at a time.
static void many(const uint8_t* Q, const uint8_t* S, const Prepared* X, const uint16_t* bias, uint16_t* Y, long N,
                 long K, long R, int threads) {
    const long span = std::max<long>(TILE_T, TILE_X_BYTES / (groups_of(K) * PREPARED_BYTES) / TILE_T * TILE_T);
    for (long r0 = 0; r0 < R; r0 += span) {
        const long r1 = std::min(R, r0 + span);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long j = 0; j < N; j += TILE_J)
            for (long r = r0; r < r1; r += TILE_T) {
                const Prepared* Xr = X + r;
                uint16_t* Yr = Y + r * N;
                tiles<TILE_T>(std::min<long>(TILE_T, r1 - r), Q, S, Xr, j, K, bias, Yr, N);
            }
    }
}
#endif

constexpr long TASK = 16;              // output rows per task
constexpr long SWEEP = 16;             // rows per sweep over W (product)
constexpr long L1_PREPARED = 20 << 10;  // bytes of prepared rows a tile of groups keeps in L1
constexpr long MANY_ROWS = 16;         // more rows than this run through `many` (AVX512-VNNI)

// Output rows j0..j1 (at most TASK) for R rows, one at a time, and groups in tiles whose prepared
// rows stay in L1 while every output row reads them (a long K, as the MLP's down projection's,
// would otherwise stream R prepared rows from L2 for each output). Sums are kept per lane across
// tiles, so a row's arithmetic is the same for any tiling.
template <int R>
static void span(const uint8_t* Q, const uint8_t* S, const Prepared* X, const uint16_t* bias, uint16_t* Y, long j0,
                 long j1, long K, long N) {
    const long G = X[0].groups, tile = std::max<long>(1, L1_PREPARED / (R * PREPARED_BYTES));
    alignas(64) float state[TASK * R * STATE];  // sums between tiles (the first tile starts at zero, the last writes y)
    for (long ga = 0; ga < G; ga += tile) {
        const long gb = std::min(G, ga + tile);
        for (long j = j0; j < j1; j++) rows<R>(Q, S, X, state + (j - j0) * R * STATE, j, K, ga, gb, bias, Y, N);
    }
}

// Prepared rows in sweeps of SWEEP over W; in a sweep each thread takes whole tasks of TASK output
// rows and runs every pass of up to PASS rows over them, so a task's weights come from memory once
// a sweep and from cache for its later passes (16 rows: 0.64x the time of two passes each streaming
// W, and a 128-row prefill 0.78x the time of whole-R sweeps, whose prepared rows leave L2;
// Qwen2.5-Coder 1.5B's shapes on a 2-core AMD EPYC).
static void sweeps(const uint8_t* Q, const uint8_t* S, const Prepared* Xs, const uint16_t* bias, uint16_t* Y,
                   long N, long K, long R, int threads) {
    const long tasks = (N + TASK - 1) / TASK;
    for (long c0 = 0; c0 < R; c0 += SWEEP) {
        const long c1 = std::min(R, c0 + SWEEP);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long t = 0; t < tasks; t++) {
            const long j0 = t * TASK, j1 = j0 + TASK < N ? j0 + TASK : N;
            for (long c = c0; c < c1; c += PASS) {
                const Prepared* Xc = Xs + c;
                uint16_t* Yc = Y + c * N;
                switch (c1 - c < PASS ? c1 - c : PASS) {
                    case 1: span<1>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
                    case 2: span<2>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
                    case 3: span<3>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
#if INT4_VNNI
                    case 4: span<4>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
                    case 5: span<5>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
                    case 6: span<6>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
                    case 7: span<7>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
#endif
                    default: span<PASS>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
                }
            }
        }
    }
}

// y [R_out, N] for R rows of x, any number (rows past R copy row R - 1: exact mode's padding):
// the rows prepared, then `sweeps` (a decode forward's few) or, on AVX512-VNNI, `many` (more). A
// row's arithmetic is the same in every pass, sweep, tile and call (`rows` and `tile`, sums in
// group order), so row r of any call equals the one-row call's bit for bit.
static int product(const uint8_t* Q, const uint8_t* S, const uint16_t* x, const uint16_t* bias, uint16_t* Y, long N,
                   long K, long R, long R_out, int threads) {
    if (R < 1 || R_out < R || K % BLOCK) return 1;
    static thread_local std::vector<uint8_t> work;  // the prepared rows, kept between calls
    static thread_local std::vector<Prepared> X;
    const size_t per_row = groups_of(K) * PREPARED_BYTES;
    if (work.size() < R * per_row) work.resize(R * per_row);
    if ((long)X.size() < R) X.resize(R);
    Prepared* Xs = X.data();
    uint8_t* base = work.data();
    if (R <= PASS)  // a decode step's rows: not worth a parallel region
        for (long r = 0; r < R; r++) Xs[r] = prepare(x + r * K, K, base + r * per_row);
    else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long r = 0; r < R; r++) Xs[r] = prepare(x + r * K, K, base + r * per_row);
    }
#if INT4_VNNI
    // More rows than a verify's (a prefill): the tiles (Qwen2.5-Coder 1.5B's layer shapes, 2 threads
    // of an AMD EPYC: 0.7-0.8x the sweeps' time at 64-256 rows; at 6-16 rows the sweeps, which
    // stream W once, matched or beat them).
    if (R > MANY_ROWS && N % TILE_J == 0)
        many(Q, S, Xs, bias, Y, N, K, R, threads);
    else
#endif
        sweeps(Q, S, Xs, bias, Y, N, K, R, threads);
    for (long r = R; r < R_out; r++) memcpy(Y + r * N, Y + (R - 1) * N, N * sizeof(uint16_t));
    return 0;
}

// Eight weights q · scale - minimum, one FMA each (q · scale is exact), from eight nibbles as int32.
static inline __m256 weights8(__m256i q, __m256 scale, __m256 minimum) {
    return _mm256_fmsub_ps(_mm256_cvtepi32_ps(q), scale, minimum);
}

// Sixteen floats as bfloat16, in order, each rounded to nearest even (float_to_bf16, NaN kept a NaN).
static inline __m256i bf16x16(__m256 a, __m256 b) {
    const auto round = [](__m256 v) {
        const __m256i u = _mm256_castps_si256(v);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
        const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        return _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    };
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(round(a), round(b)), 0xd8);
}

static inline void store16(uint16_t* w, __m256 a, __m256 b) { _mm256_storeu_si256((__m256i*)w, bf16x16(a, b)); }

static inline void store16(float* w, __m256 a, __m256 b) {
    _mm256_storeu_ps(w, a);
    _mm256_storeu_ps(w + 8, b);
}

// One block's 32 weights from its 16 bytes of nibbles (byte i: element i low, i + 16 high): eight
// weights an FMA (the scalar fmaf's rounding), stored as float32 or bfloat16.
template <typename E>
static inline void unpack_block(__m128i bytes, __m256 scale, __m256 minimum, E* w) {
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256i b0 = _mm256_cvtepu8_epi32(bytes);                      // bytes 0-7
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));  // bytes 8-15
    store16(w, weights8(_mm256_and_si256(b0, low4), scale, minimum), weights8(_mm256_and_si256(b1, low4), scale, minimum));
    store16(w + 16, weights8(_mm256_srli_epi32(b0, 4), scale, minimum), weights8(_mm256_srli_epi32(b1, 4), scale, minimum));
}

#if defined(__AVX512BW__)
// bfloat16 on AVX-512BW: the block's sixteen possible values (q = 0..15, the same FMA and rounding
// as above) computed once, then its 32 nibbles looked up (vpermw).
static inline void unpack_block(__m128i bytes, __m256 scale, __m256 minimum, uint16_t* w) {
    const __m256i values = bf16x16(weights8(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), scale, minimum),
                                   weights8(_mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15), scale, minimum));
    const __m256i wide = _mm256_cvtepu8_epi16(bytes);
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(wide, _mm256_set1_epi16(15))),
                                           _mm256_srli_epi16(wide, 4), 1);
    _mm512_storeu_si512(w, _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(values)));
}
#endif

// Block l of a group of g blocks starting at q: its four bytes of each slice, as one block's 16 bytes.
static inline __m128i block_bytes(const uint8_t* q, int g, int l) {
    int part[4];
    for (int k = 0; k < 4; k++) memcpy(part + k, q + 4 * g * k + 4 * l, 4);
    return _mm_setr_epi32(part[0], part[1], part[2], part[3]);
}

// W [N, K] as float32 (or bfloat16, each value rounded once), each weight q · scale - minimum
// (for prefills, which run a GEMM), so the prefill's unpacking streams near the memory's rate.
template <typename E>
static int dequantize(const uint8_t* Q, const uint8_t* S, E* W, long N, long K, int threads) {
    if (K % BLOCK) return 1;
    const long nb = K / BLOCK, G = groups_of(K);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long j = 0; j < N; j++)
        for (long gi = 0; gi < G; gi++) {
            const int g = group_size(nb, gi);
            const uint8_t* q = Q + (j * nb + gi * GROUP) * 16;
            const uint8_t* s = S + (j * G + gi) * RECORD;
            const float ds = record_value(s, SCALE_STEP), dm = record_value(s, MIN_STEP), mb = record_value(s, MIN_BASE);
            for (int l = 0; l < g; l++)
                unpack_block(block_bytes(q, g, l), _mm256_set1_ps(ds * (float)s[l]),
                             _mm256_set1_ps(dm * (float)s[GROUP + l] + mb), W + j * K + (gi * GROUP + l) * BLOCK);
        }
    return 0;
}

}  // namespace int4
