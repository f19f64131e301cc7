// selfspec's 4-bit few-row products y = x · Wᵀ (+ bias) (the op selfspec::int4_gemv; see
// selfspec/native/gemv.py and selfspec/model/quantize.py, which lays the blocks out).
//
// W [N, K] as blocks of 32 inputs: Q [N, K / 32, 16] uint8, byte i of a block holding element i in
// its low nibble and element i + 16 in its high one (GGUF Q4_1's order); S [N, K / 32, 2] bfloat16,
// each block's (scale, zero): w = (q - 8) · scale + zero, q in 0..15, rounded once (an FMA) to
// float32. x [R, K] bfloat16, R in 1..16; y [R_out, N] bfloat16 (rows past R copy row R - 1).
//
// Why: a decode step streams its weights once, so its time is their bytes over the memory's rate;
// at 4.5 bits a weight (plus 32 bits of scale and zero a block: 5 bits) the bytes are a quarter of
// bfloat16's, provided the arithmetic keeps up. Each block is dequantized once into registers (a
// 16-entry table lookup on AVX-512, its values the same FMAs) and used for every row of the pass.
//
// Exactness: every output element is one thread's sum in one fixed order (per block: elements
// 0-15 into one accumulator and 16-31 into another, in block order; then the two added and reduced
// as product.h's hsum), whatever the number of rows in the call, the pass it falls in or the thread
// count; so row r of an n-row call equals the 1-row call's bit for bit. The AVX2 and AVX-512 paths
// dequantize to the same values and round their sums their own ways.
#pragma once
#include "product.h"

namespace int4 {

constexpr int BLOCK = 32;
constexpr int Q_AHEAD = 2048;  // bytes of nibbles (and a quarter as many of scales) prefetched ahead

#ifdef __AVX512F__
constexpr int PASS = 8;  // rows per pass over W: two 16-lane accumulators each (16 of 32 registers)

// The 16 values a block's nibbles stand for: (q - 8) · scale + zero for q = 0..15.
static inline __m512 table(const uint16_t* sz) {
    uint32_t bits;
    memcpy(&bits, sz, 4);  // scale in the low half, zero in the high half
    const __m512i v = _mm512_set1_epi32((int)bits);
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
    const __m512 q8 = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    return _mm512_fmadd_ps(q8, scale, zero);
}

// Output rows j .. j + J - 1 for R rows of X (float32 [R, K]); J > 1 interleaves output rows so a
// pass of one or two rows has enough independent FMA chains.
template <int R, int J>
static inline void rows(const uint8_t* Q, const uint16_t* S, const float* X, const uint16_t* bias, uint16_t* Y,
                        long j, long K, long N) {
    const long nb = K / BLOCK;
    __m512 lo[J][R], hi[J][R];
    for (int t = 0; t < J; t++)
        for (int r = 0; r < R; r++) lo[t][r] = hi[t][r] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        for (int t = 0; t < J; t++) {
            const long blk = (j + t) * nb + b;
            // ahead of the hardware's prefetch, on every CPU: on a 2-core AMD EPYC (Zen 4) one row of
            // 8960x1536 went from 4.3 to 7.8 GB/s with it (results/qwen_int4/README.md)
            _mm_prefetch((const char*)(Q + blk * 16) + Q_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char*)(S + 2 * blk) + Q_AHEAD / 4, _MM_HINT_T0);
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(Q + blk * 16)));
            const __m512 T = table(S + 2 * blk);
            const __m512 wl = _mm512_permutexvar_ps(v, T);  // the index is each lane's low 4 bits
            const __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), T);
            for (int r = 0; r < R; r++) {
                const float* x = X + r * K + b * BLOCK;
                lo[t][r] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(x), lo[t][r]);
                hi[t][r] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(x + 16), hi[t][r]);
            }
        }
    }
    for (int t = 0; t < J; t++)
        for (int r = 0; r < R; r++) {
            float s = hsum16(_mm512_add_ps(lo[t][r], hi[t][r]));
            if (bias) s += bf16_to_float(bias[j + t]);
            Y[r * N + j + t] = float_to_bf16(s);
        }
}
#else
constexpr int PASS = 4;  // rows per pass: two 8-lane accumulators each (8 of 16 registers)

template <int R, int J>
static inline void rows(const uint8_t* Q, const uint16_t* S, const float* X, const uint16_t* bias, uint16_t* Y,
                        long j, long K, long N) {
    const long nb = K / BLOCK;
    const __m256i low4 = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    __m256 lo[J][R], hi[J][R];
    for (int t = 0; t < J; t++)
        for (int r = 0; r < R; r++) lo[t][r] = hi[t][r] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        for (int t = 0; t < J; t++) {
            const long blk = (j + t) * nb + b;
            const __m256 scale = _mm256_set1_ps(bf16_to_float(S[2 * blk]));
            const __m256 zero = _mm256_set1_ps(bf16_to_float(S[2 * blk + 1]));
            const uint8_t* q = Q + blk * 16;
            _mm_prefetch((const char*)q + Q_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char*)(S + 2 * blk) + Q_AHEAD / 4, _MM_HINT_T0);
            const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));
            const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8)));
            // elements 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles): (q - 8) · scale + zero
            __m256 w[4];
            const __m256i n[4] = {_mm256_and_si256(b0, low4), _mm256_and_si256(b1, low4), _mm256_srli_epi32(b0, 4),
                                  _mm256_srli_epi32(b1, 4)};
            for (int u = 0; u < 4; u++) w[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(n[u], eight)), scale, zero);
            for (int r = 0; r < R; r++) {
                const float* x = X + r * K + b * BLOCK;
                lo[t][r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), lo[t][r]);
                lo[t][r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), lo[t][r]);
                hi[t][r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), hi[t][r]);
                hi[t][r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), hi[t][r]);
            }
        }
    }
    for (int t = 0; t < J; t++)
        for (int r = 0; r < R; r++) {
            float s = hsum(_mm256_add_ps(lo[t][r], hi[t][r]));
            if (bias) s += bf16_to_float(bias[j + t]);
            Y[r * N + j + t] = float_to_bf16(s);
        }
}
#endif

// Output rows j0..j1 for R rows: J output rows at a time where one or two rows leave the FMAs idle.
template <int R>
static void span(const uint8_t* Q, const uint16_t* S, const float* X, const uint16_t* bias, uint16_t* Y, long j0,
                 long j1, long K, long N) {
    constexpr int J = R == 1 ? 4 : R == 2 ? 2 : 1;
    long j = j0;
    for (; j + J <= j1; j += J) rows<R, J>(Q, S, X, bias, Y, j, K, N);
    for (; j < j1; j++) rows<R, 1>(Q, S, X, bias, Y, j, K, N);
}

static int product(const uint8_t* Q, const uint16_t* S, const uint16_t* x, const uint16_t* bias, uint16_t* Y, long N,
                   long K, int R, int R_out, int threads, float* X) {
    if (R < 1 || R > MAX_ROWS || R_out < R || R_out > MAX_ROWS || K % BLOCK) return 1;
    for (long i = 0; i < R * K; i++) X[i] = bf16_to_float(x[i]);
    const long chunk = 16;  // output rows per task
    const long tasks = (N + chunk - 1) / chunk;
    for (int c = 0; c < R; c += PASS) {
        const int n = R - c < PASS ? R - c : PASS;
        const float* Xc = X + c * K;
        uint16_t* Yc = Y + c * N;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long t = 0; t < tasks; t++) {
            const long j0 = t * chunk, j1 = j0 + chunk < N ? j0 + chunk : N;
            switch (n) {
                case 1: span<1>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
                case 2: span<2>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
                case 3: span<3>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
#ifdef __AVX512F__
                case 4: span<4>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
                case 5: span<5>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
                case 6: span<6>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
                case 7: span<7>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
                default: span<8>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
#else
                default: span<4>(Q, S, Xc, bias, Yc, j0, j1, K, N); break;
#endif
            }
        }
    }
    for (int r = R; r < R_out; r++) memcpy(Y + (long)r * N, Y + (long)(R - 1) * N, N * sizeof(uint16_t));
    return 0;
}

// W as float32 [N, K], each weight the value the products use (for prefills, which run a GEMM).
static int dequantize(const uint8_t* Q, const uint16_t* S, float* W, long N, long K, int threads) {
    if (K % BLOCK) return 1;
    const long nb = K / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long j = 0; j < N; j++)
        for (long b = 0; b < nb; b++) {
            const long blk = j * nb + b;
            const float scale = bf16_to_float(S[2 * blk]), zero = bf16_to_float(S[2 * blk + 1]);
            float* w = W + j * K + b * BLOCK;
            for (int i = 0; i < 16; i++) {
                const uint8_t byte = Q[blk * 16 + i];
                w[i] = fmaf((float)((byte & 15) - 8), scale, zero);
                w[i + 16] = fmaf((float)((byte >> 4) - 8), scale, zero);
            }
        }
    return 0;
}

}  // namespace int4
