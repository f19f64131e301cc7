// selfspec's 4-bit few-row products y = x · Wᵀ (+ bias) (the op selfspec::int4_gemv, and int4
// layers of the fused layer; see selfspec/native/gemv.py and selfspec/model/quantize.py, which lays
// the blocks out).
//
// W [N, K] as blocks of 32 inputs: Q [N, K / 32, 16] uint8, byte i of a block holding element i in
// its low nibble and element i + 16 in its high one (GGUF Q4_1's order); S [N, K / 32, 2] bfloat16,
// each block's (scale, zero): w = (q - 8) · scale + zero, q in 0..15. x [R, K] bfloat16, R in
// 1..16; y [R_out, N] bfloat16 (rows past R copy row R - 1).
//
// Why: a decode step streams its weights once, so its time is their bytes over the memory's rate;
// at 5 bits a weight (4 + 32 bits of scale and zero a block) the bytes are under a third of
// bfloat16's, provided the arithmetic keeps up. It does by integer dot products, as llama.cpp's
// 4-bit products do: each row of x is quantized to int8 in blocks of 32 (xq = round(x / dx), dx =
// the block's max |x| / 127), and a block's nibbles times xq sum exactly in int32 (AVX512-VNNI's
// vpdpbusd, 64 products an instruction; AVX2's vpmaddubsw elsewhere); floats enter once per block:
//   sum over a block of w · x  ≈  scale · dx · Σ q · xq  +  (zero - 8 · scale) · dx · Σ xq.
// The nibbles are used as stored: 64 bytes hold four blocks, their low nibbles (elements 0-15 of
// each) one 64-byte vector and their high nibbles another, and x's int8 rows are laid out to match.
//
// Exactness: a row's int8 quantization depends on that row alone, its integer sums are exact, and
// its float sums run in one fixed order (per 32-bit lane, in block order; lanes added as
// product.h's hsum) whatever the number of rows in the call, the pass it falls in or the thread
// count; so row r of an n-row call equals the 1-row call's bit for bit. The AVX2 and AVX-512 paths
// round their float sums their own ways. The result is not x · W in float: x is int8 to within
// half a step of its block (this is int4 mode's own arithmetic, which speculation reproduces).
#pragma once
#include <vector>

#include "product.h"

namespace int4 {

constexpr int BLOCK = 32;
constexpr int CHUNK = 4;        // blocks per 64 bytes of nibbles
constexpr int Q_AHEAD = 2048;   // bytes of nibbles (and a quarter as many of scales) prefetched ahead
constexpr int Q_FAR = 8192;     // and, for one or two rows, further ahead into L2

// One row of x, prepared: per chunk c of four blocks (the last one zero-padded), xl [64] int8 holding
// block 4c + i's elements 0-15 at 16i.., xh [64] its elements 16-31; d [16] the dx of each 32-bit
// lane l of a 64-byte vector (block 4c + l / 4); t [8] (-8 T, T) for each block, T = dx · its sum
// of xq, so that the blocks' (scale, zero) pairs times t are Σ (zero - 8 · scale) · dx · Σ xq.
struct Prepared {
    long chunks;
    const int8_t *xl, *xh;
    const float *d, *t;
};

static inline long chunks_of(long K) { return (K / BLOCK + CHUNK - 1) / CHUNK; }
static constexpr long PREPARED_BYTES = 224;  // per chunk: xl, xh (64 bytes each), d (16 floats), t (8)

// Row x [K] (bfloat16 bits) into `out` (chunks_of(K) · PREPARED_BYTES bytes). A block holding a NaN or an
// infinity gets dx NaN, so the row's outputs are NaN, as the float products give.
static Prepared prepare(const uint16_t* x, long K, uint8_t* out) {
    const long C = chunks_of(K), nb = K / BLOCK;
    int8_t* xl = (int8_t*)out;
    int8_t* xh = xl + 64 * C;
    float* d = (float*)(xh + 64 * C);
    float* t = d + 16 * C;  // 8 a chunk
    memset(out, 0, C * PREPARED_BYTES);
    for (long b = 0; b < nb; b++) {
        const uint16_t* xb = x + b * BLOCK;
        float v[BLOCK], amax = 0.f, poison = 0.f;
        for (int i = 0; i < BLOCK; i++) {
            v[i] = bf16_to_float(xb[i]);
            amax = std::max(amax, std::fabs(v[i]));
            poison += v[i] * 0.f;  // NaN when any element is a NaN or an infinity
        }
        const float dx = poison == 0.f ? amax / 127.f : NAN;
        const float inv = poison == 0.f && amax > 0.f ? 127.f / amax : 0.f;
        const long c = b / CHUNK, i = b % CHUNK;
        int8_t *lo = xl + 64 * c + 16 * i, *hi = xh + 64 * c + 16 * i;
        for (int e = 0; e < 16; e++) {
            lo[e] = (int8_t)std::nearbyint(v[e] * inv);  // round half to even, as cvtps2dq
            hi[e] = (int8_t)std::nearbyint(v[e + 16] * inv);
        }
        int sum = 0;
        for (int e = 0; e < 16; e++) sum += lo[e] + hi[e];
        for (int p = 0; p < 4; p++) d[16 * c + 4 * i + p] = dx;
        t[8 * c + 2 * i] = -8.f * (dx * (float)sum);
        t[8 * c + 2 * i + 1] = dx * (float)sum;
    }
    return Prepared{C, xl, xh, d, t};
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT4_VNNI 1
constexpr int PASS = 8;  // rows per pass over W: two 16-lane accumulators each
constexpr const char* PATH = "avx512-vnni";

// Output rows j .. j + J - 1 for R prepared rows; J > 1 interleaves output rows so a pass of one
// or two rows has enough independent chains.
template <int R, int J>
static inline void rows(const uint8_t* Q, const uint16_t* S, const Prepared* X, const uint16_t* bias, uint16_t* Y,
                        long j, long K, long N) {
    const long nb = K / BLOCK, C = X[0].chunks;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i pick_scale = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    __m512 dot[J][R];
    __m256 off[J][R];  // the zeros' term: (scale, zero) pairs times t's (-8 T, T)
    for (int u = 0; u < J; u++)
        for (int r = 0; r < R; r++) dot[u][r] = _mm512_setzero_ps(), off[u][r] = _mm256_setzero_ps();
    for (long c = 0; c < C; c++) {
        const long left = nb - c * CHUNK;  // blocks in this chunk: 4, or 1-3 in the last
        const __mmask64 qmask = left >= CHUNK ? ~0ull : (1ull << (16 * left)) - 1;
        const __mmask32 smask = left >= CHUNK ? 0xff : (__mmask32)((1u << (2 * left)) - 1);
        for (int u = 0; u < J; u++) {
            const long blk = (j + u) * nb + c * CHUNK;
            const uint8_t* q = Q + blk * 16;
            _mm_prefetch((const char*)q + Q_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char*)(S + 2 * blk) + Q_AHEAD / 4, _MM_HINT_T0);
            if constexpr (R <= 2) {  // memory-bound passes: more in flight (Qwen 1.5B step ~57 -> ~43 ms)
                _mm_prefetch((const char*)q + Q_FAR, _MM_HINT_T1);
                _mm_prefetch((const char*)(S + 2 * blk) + Q_FAR / 4, _MM_HINT_T1);
            }
            const __m512i v = _mm512_maskz_loadu_epi8(qmask, q);
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            // s0 z0 s1 z1 s2 z2 s3 z3 as floats, each to its block's four lanes
            const __m512 sz = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(smask, S + 2 * blk))), 16));
            const __m512 scale = _mm512_permutexvar_ps(pick_scale, sz);
            const __m256 pairs = _mm512_castps512_ps256(sz);
            for (int r = 0; r < R; r++) {
                __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(X[r].xl + 64 * c));
                acc = _mm512_dpbusd_epi32(acc, hi, _mm512_loadu_si512(X[r].xh + 64 * c));
                const __m512 step = _mm512_mul_ps(scale, _mm512_loadu_ps(X[r].d + 16 * c));
                dot[u][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), step, dot[u][r]);
                off[u][r] = _mm256_fmadd_ps(pairs, _mm256_loadu_ps(X[r].t + 8 * c), off[u][r]);
            }
        }
    }
    for (int u = 0; u < J; u++)
        for (int r = 0; r < R; r++) {
            float s = hsum16(dot[u][r]) + hsum(off[u][r]);
            if (bias) s += bf16_to_float(bias[j + u]);
            Y[r * N + j + u] = float_to_bf16(s);
        }
}
#else
#define INT4_VNNI 0
constexpr int PASS = 4;  // rows per pass: two 8-lane accumulators each
constexpr const char* PATH = "avx2";

// As above on 8 lanes: each chunk in two halves of two blocks, the integer dot of a lane by
// vpmaddubsw (u8 · s8 pairs into int16: at most 2 · 15 · 127 each, then lo + hi, exact) and vpmaddwd.
template <int R, int J>
static inline void rows(const uint8_t* Q, const uint16_t* S, const Prepared* X, const uint16_t* bias, uint16_t* Y,
                        long j, long K, long N) {
    const long nb = K / BLOCK, C = X[0].chunks;
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i pick_scale = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    __m256 dot[J][R];
    __m128 off[J][R];  // the zeros' term: (scale, zero) pairs times t's (-8 T, T)
    for (int u = 0; u < J; u++)
        for (int r = 0; r < R; r++) dot[u][r] = _mm256_setzero_ps(), off[u][r] = _mm_setzero_ps();
    for (long c = 0; c < C; c++) {
        for (int half = 0; half < 2; half++) {
            const long first = c * CHUNK + 2 * half;  // the half's first block
            if (first >= nb) break;
            const bool both = first + 1 < nb;
            for (int u = 0; u < J; u++) {
                const long blk = (j + u) * nb + first;
                const uint8_t* q = Q + blk * 16;
                _mm_prefetch((const char*)q + Q_AHEAD, _MM_HINT_T0);
                _mm_prefetch((const char*)(S + 2 * blk) + Q_AHEAD / 4, _MM_HINT_T0);
                const __m256i v = both ? _mm256_loadu_si256((const __m256i*)q)
                                       : _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                                 _mm_loadu_si128((const __m128i*)q), 0);
                const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                uint16_t sz4[4] = {S[2 * blk], S[2 * blk + 1], both ? S[2 * blk + 2] : (uint16_t)0,
                                   both ? S[2 * blk + 3] : (uint16_t)0};
                const __m256 sz = _mm256_castsi256_ps(
                    _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadl_epi64((const __m128i*)sz4)), 16));
                const __m256 scale = _mm256_permutevar8x32_ps(sz, pick_scale);
                const __m128 pairs = _mm256_castps256_ps128(sz);
                for (int r = 0; r < R; r++) {
                    const long at = 64 * c + 32 * half;
                    const __m256i p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)(X[r].xl + at))),
                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(X[r].xh + at))));
                    const __m256i acc = _mm256_madd_epi16(p, ones);
                    const long lane = 16 * c + 8 * half;
                    const __m256 step = _mm256_mul_ps(scale, _mm256_loadu_ps(X[r].d + lane));
                    dot[u][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), step, dot[u][r]);
                    off[u][r] = _mm_fmadd_ps(pairs, _mm_loadu_ps(X[r].t + 8 * c + 4 * half), off[u][r]);
                }
            }
        }
    }
    for (int u = 0; u < J; u++)
        for (int r = 0; r < R; r++) {
            const __m128 o = _mm_add_ps(off[u][r], _mm_movehl_ps(off[u][r], off[u][r]));
            float s = hsum(dot[u][r]) + _mm_cvtss_f32(_mm_add_ss(o, _mm_movehdup_ps(o)));
            if (bias) s += bf16_to_float(bias[j + u]);
            Y[r * N + j + u] = float_to_bf16(s);
        }
}
#endif

// Output rows j0..j1 for R rows: J output rows at a time where one or two rows leave units idle.
template <int R>
static void span(const uint8_t* Q, const uint16_t* S, const Prepared* X, const uint16_t* bias, uint16_t* Y, long j0,
                 long j1, long K, long N) {
    constexpr int J = R == 1 ? 4 : R == 2 ? 2 : 1;
    long j = j0;
    for (; j + J <= j1; j += J) rows<R, J>(Q, S, X, bias, Y, j, K, N);
    for (; j < j1; j++) rows<R, 1>(Q, S, X, bias, Y, j, K, N);
}

static int product(const uint8_t* Q, const uint16_t* S, const uint16_t* x, const uint16_t* bias, uint16_t* Y, long N,
                   long K, int R, int R_out, int threads) {
    if (R < 1 || R > MAX_ROWS || R_out < R || R_out > MAX_ROWS || K % BLOCK) return 1;
    static thread_local std::vector<uint8_t> work;  // the prepared rows, kept between calls
    const size_t per_row = chunks_of(K) * PREPARED_BYTES;
    if (work.size() < R * per_row) work.resize(R * per_row);
    Prepared X[MAX_ROWS];
    for (int r = 0; r < R; r++) X[r] = prepare(x + (long)r * K, K, work.data() + r * per_row);
    const long chunk = 16;  // output rows per task
    const long tasks = (N + chunk - 1) / chunk;
    for (int c = 0; c < R; c += PASS) {
        const int n = R - c < PASS ? R - c : PASS;
        const Prepared* Xc = X + c;
        uint16_t* Yc = Y + c * N;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long t = 0; t < tasks; t++) {
            const long j0 = t * chunk, j1 = j0 + chunk < N ? j0 + chunk : N;
            switch (n) {
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
    for (int r = R; r < R_out; r++) memcpy(Y + (long)r * N, Y + (long)(R - 1) * N, N * sizeof(uint16_t));
    return 0;
}

// Eight weights (q - 8) · scale + zero, one FMA each, from eight nibbles as int32.
static inline __m256 weights8(__m256i q, __m256 scale, __m256 zero) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))), scale, zero);
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

// One block's 32 weights from its 16 bytes of nibbles: eight weights an FMA (the scalar fmaf's
// rounding), stored as float32 or bfloat16.
template <typename E>
static inline void unpack_block(const uint8_t* q, __m256 scale, __m256 zero, E* w) {
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));      // bytes 0-7
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8)));  // bytes 8-15
    store16(w, weights8(_mm256_and_si256(b0, low4), scale, zero), weights8(_mm256_and_si256(b1, low4), scale, zero));
    store16(w + 16, weights8(_mm256_srli_epi32(b0, 4), scale, zero), weights8(_mm256_srli_epi32(b1, 4), scale, zero));
}

#if defined(__AVX512BW__)
// bfloat16 on AVX-512BW: the block's sixteen possible values (q = 0..15, the same FMA and rounding
// as above) computed once, then its 32 nibbles looked up (vpermw).
static inline void unpack_block(const uint8_t* q, __m256 scale, __m256 zero, uint16_t* w) {
    const __m256i values = bf16x16(weights8(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), scale, zero),
                                   weights8(_mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15), scale, zero));
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)q));
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(15))),
                                           _mm256_srli_epi16(bytes, 4), 1);
    _mm512_storeu_si512(w, _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(values)));
}
#endif

// W [N, K] as float32 (or bfloat16, each value rounded once), each weight (q - 8) · scale + zero
// (for prefills, which run a GEMM), so the prefill's unpacking streams near the memory's rate.
template <typename E>
static int dequantize(const uint8_t* Q, const uint16_t* S, E* W, long N, long K, int threads) {
    if (K % BLOCK) return 1;
    const long nb = K / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long j = 0; j < N; j++)
        for (long b = 0; b < nb; b++) {
            const long blk = j * nb + b;
            unpack_block(Q + blk * 16, _mm256_set1_ps(bf16_to_float(S[2 * blk])),
                         _mm256_set1_ps(bf16_to_float(S[2 * blk + 1])), W + j * K + b * BLOCK);
        }
    return 0;
}

}  // namespace int4
