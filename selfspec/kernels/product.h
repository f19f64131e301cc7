// selfspec's one-to-four-row matrix products y = x · Wᵀ (· scale) (+ bias): the weights streamed
// once, each output element one thread's fixed-order sum (see selfspec/gemv.py for why).
//
// W [N, K] row-major: bfloat16 (uint16 bits) or int8 with one scale per output row; x [R, K]
// bfloat16, R in 1..16 (four per pass over W); y [R_out, N] bfloat16, rounded to nearest even (rows past R copy row R - 1).
// Or all three float32.
// AVX2 + FMA (AVX512-BF16 where built for it), OpenMP threads.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <type_traits>

static inline float bf16_to_float(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 -> 8 float
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

static inline __m256 load8(const int8_t* p) {  // 8 int8 -> 8 float
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// Element t as a float, and a float stored as an element: bfloat16 (uint16 bits), int8, float32.
static inline float value(const uint16_t* p, long t) { return bf16_to_float(p[t]); }
static inline float value(const int8_t* p, long t) { return (float)p[t]; }
static inline float value(const float* p, long t) { return p[t]; }
static inline void store(uint16_t* p, long t, float v) { p[t] = float_to_bf16(v); }
static inline void store(float* p, long t, float v) { p[t] = v; }

static inline float hsum(__m256 v) {  // one fixed order
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Output rows j0..j1 for R input rows; X is x in float32 [R, K].
template <typename T, typename E, int R>
static void rows(const T* W, const float* X, const uint16_t* scale, const E* bias, E* Y, long j0, long j1, long K,
                 long N) {
    for (long j = j0; j < j1; j++) {
        const T* w = W + j * K;
        __m256 a[R][4];
        for (int r = 0; r < R; r++)
            for (int u = 0; u < 4; u++) a[r][u] = _mm256_setzero_ps();
        long k = 0;
        for (; k + 32 <= K; k += 32) {
            __m256 w0 = load8(w + k), w1 = load8(w + k + 8), w2 = load8(w + k + 16), w3 = load8(w + k + 24);
            for (int r = 0; r < R; r++) {
                const float* x = X + r * K + k;
                a[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), a[r][0]);
                a[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), a[r][1]);
                a[r][2] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), a[r][2]);
                a[r][3] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), a[r][3]);
            }
        }
        for (int r = 0; r < R; r++) {
            float s = hsum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
            for (long t = k; t < K; t++) s += value(w, t) * X[r * K + t];
            if (scale) s *= bf16_to_float(scale[j]);
            if (bias) s += value(bias, j);
            store(Y, r * N + j, s);
        }
    }
}

#ifdef __AVX512BF16__
// Built with -mavx512bf16 where the CPU has it (AVX512-BF16: Zen 4, Sapphire Rapids): weights and
// x go into dot products of bfloat16 pairs, half the FMAs and no per-row conversion, so two to
// four rows cost little more than one. int8 weights become bfloat16 on the way (exactly: every
// integer up to 256 is a bfloat16). Each row is still one fixed order of its own.
static inline __m512bh load32(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// The upper 8 lanes of v, and hsum's order over all 16: the low and high halves added, then hsum.
static inline __m256 high8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
static inline float hsum16(__m512 v) { return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), high8(v))); }

static inline __m512bh load32(const int8_t* p) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0-15 from lo, 16-31 from hi
}

// PREFETCH: how many weight elements ahead each pass asks for the next cache lines (0: none). The
// build sets it for Intel CPUs (selfspec/gemv.py), whose hardware prefetch alone left a 2-core
// Xeon's product kernel at ~13 GB/s against a 26 GB/s streamed read; it does not change a result.
#ifndef PREFETCH
#define PREFETCH 0
#endif
template <typename T, int R>
static void rows_pairs(const T* W, const uint16_t* x, const uint16_t* scale, const uint16_t* bias, uint16_t* Y,
                       long j0, long j1, long K, long N) {
    for (long j = j0; j < j1; j++) {
        const T* w = W + j * K;
        __m512 a[R][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
        long k = 0;
        for (; k + 64 <= K; k += 64) {
#if PREFETCH
            _mm_prefetch((const char*)(w + k + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char*)(w + k + PREFETCH + 32), _MM_HINT_T0);
#endif
            __m512bh w0 = load32(w + k), w1 = load32(w + k + 32);
            for (int r = 0; r < R; r++) {
                const uint16_t* xr = x + r * K + k;
                a[r][0] = _mm512_dpbf16_ps(a[r][0], w0, (__m512bh)_mm512_loadu_si512(xr));
                a[r][1] = _mm512_dpbf16_ps(a[r][1], w1, (__m512bh)_mm512_loadu_si512(xr + 32));
            }
        }
        for (int r = 0; r < R; r++) {
            float s = hsum16(_mm512_add_ps(a[r][0], a[r][1]));
            for (long t = k; t < K; t++) s += value(w, t) * bf16_to_float(x[r * K + t]);
            if (scale) s *= bf16_to_float(scale[j]);
            if (bias) s += bf16_to_float(bias[j]);
            Y[r * N + j] = float_to_bf16(s);
        }
    }
}
#endif

// x, bias and y of element type E: bfloat16 with bfloat16 or int8 weights, float32 with float32.
template <typename T, typename E>
static void product4(const T* W, const E* x, const uint16_t* scale, const E* bias, E* Y, long N, long K, int R,
                     int threads, float* X) {
    constexpr bool pairs =
#ifdef __AVX512BF16__
        std::is_same<E, uint16_t>::value;
#else
        false;
#endif
    if constexpr (std::is_same<E, float>::value) {
        X = (float*)x;  // already float32
    } else if constexpr (!pairs) {
        for (long i = 0; i < R * K; i++) X[i] = bf16_to_float(x[i]);
    }
    const long chunk = 16;  // output rows per task
    const long tasks = (N + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < tasks; b++) {
        long j0 = b * chunk, j1 = j0 + chunk < N ? j0 + chunk : N;
        if constexpr (pairs) {
#ifdef __AVX512BF16__
            switch (R) {
                case 1: rows_pairs<T, 1>(W, x, scale, bias, Y, j0, j1, K, N); break;
                case 2: rows_pairs<T, 2>(W, x, scale, bias, Y, j0, j1, K, N); break;
                case 3: rows_pairs<T, 3>(W, x, scale, bias, Y, j0, j1, K, N); break;
                default: rows_pairs<T, 4>(W, x, scale, bias, Y, j0, j1, K, N); break;
            }
#endif
        } else {
            switch (R) {
                case 1: rows<T, E, 1>(W, X, scale, bias, Y, j0, j1, K, N); break;
                case 2: rows<T, E, 2>(W, X, scale, bias, Y, j0, j1, K, N); break;
                case 3: rows<T, E, 3>(W, X, scale, bias, Y, j0, j1, K, N); break;
                default: rows<T, E, 4>(W, X, scale, bias, Y, j0, j1, K, N); break;
            }
        }
    }
}

// Any number of rows up to MAX_ROWS, four per pass over W (each row's result is the same in any
// pass). X: float32 scratch for four rows of x. Rows R..R_out-1 pad a fixed row bucket (exact
// mode): copies of the last computed row, as selfspec.step pads its inputs.
static const int MAX_ROWS = 16;

template <typename T, typename E>
static int product(const T* W, const E* x, const uint16_t* scale, const E* bias, E* Y, long N, long K, int R, int R_out,
                   int threads, float* X) {
    if (R < 1 || R > MAX_ROWS || R_out < R || R_out > MAX_ROWS) return 1;
    for (int c = 0; c < R; c += 4)
        product4<T, E>(W, x + c * K, scale, bias, Y + c * N, N, K, R - c < 4 ? R - c : 4, threads, X);
    for (int r = R; r < R_out; r++) memcpy(Y + (long)r * N, Y + (long)(R - 1) * N, N * sizeof(E));
    return 0;
}

