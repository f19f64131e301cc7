// selfspec's one-to-four-row matrix products y = x · Wᵀ (· scale) (+ bias): the weights streamed
// once, each output element one thread's fixed-order sum (see selfspec/native/gemv.py for why).
//
// W [N, K] row-major: bfloat16 (uint16 bits) or int8 with one scale per output row; x [R, K]
// bfloat16, R in 1..16 (four per pass over W, eight for int8 W on AVX512-BF16 pairs); y [R_out, N]
// bfloat16, rounded to nearest even (rows past R copy row R - 1).
// Or all three float32.
// AVX2 + FMA (AVX-512 or AVX512-BF16 where built for it), OpenMP threads.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <cmath>

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

// PREFETCH: how many weight elements ahead each pass asks for the next cache lines (0: none). The
// build sets it for Intel CPUs (selfspec/native/gemv.py), whose hardware prefetch alone left a 2-core
// Xeon's product kernel at ~13 GB/s against a 26 GB/s streamed read; it does not change a result.
#ifndef PREFETCH
#define PREFETCH 0
#endif

#ifdef __AVX512F__
// The upper 8 lanes of v, and hsum's order over all 16: the low and high halves added, then hsum.
static inline __m256 high8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
static inline float hsum16(__m512 v) { return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), high8(v))); }
#endif

// L float lanes and what rows() does with them: 8 (AVX2) or, built with -mavx512f
// -DSELFSPEC_AVX512 where the CPU has AVX-512 but not its bfloat16 pairs (Skylake-SP to Ice Lake
// Xeons), 16: half the widenings, FMAs and loop instructions per weight, so 3-4 rows, which are
// compute-bound at 8 lanes, get nearer the weight stream.
template <int L> struct Vec;
template <> struct Vec<8> {
    using F = __m256;
    using I = __m256i;
    static F zero() { return _mm256_setzero_ps(); }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F loadf(const float* p) { return _mm256_loadu_ps(p); }
    static I loadi(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
    static F even(I u) { return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)); }  // its lanes' low bfloat16
    static F odd(I u) { return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u))); }
    template <typename T> static F load(const T* p) { return load8(p); }  // int8 or float32 weights
    static float sum(F v) { return hsum(v); }
};
#ifdef SELFSPEC_AVX512
template <> struct Vec<16> {
    using F = __m512;
    using I = __m512i;
    static F zero() { return _mm512_setzero_ps(); }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F loadf(const float* p) { return _mm512_loadu_ps(p); }
    static I loadi(const void* p) { return _mm512_loadu_si512(p); }
    static F even(I u) { return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)); }
    static F odd(I u) { return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u))); }
    static F load(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
    static F load(const float* p) { return _mm512_loadu_ps(p); }
    static float sum(F v) { return hsum16(v); }
};
constexpr int LANES = 16;
#else
constexpr int LANES = 8;
#endif

// Output rows j0..j1 for R input rows on L lanes; X is x in float32 [R, K].
template <typename T, typename E, int R, int L>
static void rows(const T* W, const float* X, const uint16_t* scale, const E* bias, E* Y, long j0, long j1, long K,
                 long N) {
    using V = Vec<L>;
    constexpr long B = 4 * L;  // weights per pass: four vectors
    for (long j = j0; j < j1; j++) {
        const T* w = W + j * K;
        typename V::F a[R][4];
        for (int r = 0; r < R; r++)
            for (int u = 0; u < 4; u++) a[r][u] = V::zero();
        long k = 0;
        for (; k + B <= K; k += B) {
#if PREFETCH
            for (unsigned b = 0; b < B * sizeof(T); b += 64) _mm_prefetch((const char*)(w + k + PREFETCH) + b, _MM_HINT_T0);
#endif
            typename V::F wv[4];
            if constexpr (std::is_same<T, uint16_t>::value) {
                // 2L bfloat16 in one load: its even elements are its 32-bit lanes shifted up, its odd ones the
                // lanes' high halves (X holds each 2L-block as its L even then its L odd elements; see product4)
                const typename V::I u0 = V::loadi(w + k), u1 = V::loadi(w + k + 2 * L);
                wv[0] = V::even(u0), wv[1] = V::odd(u0), wv[2] = V::even(u1), wv[3] = V::odd(u1);
            } else {
                for (int u = 0; u < 4; u++) wv[u] = V::load(w + k + u * L);
            }
            for (int r = 0; r < R; r++) {
                const float* x = X + r * K + k;
                for (int u = 0; u < 4; u++) a[r][u] = V::fmadd(wv[u], V::loadf(x + u * L), a[r][u]);
            }
        }
        for (int r = 0; r < R; r++) {
            float s = V::sum(V::add(V::add(a[r][0], a[r][1]), V::add(a[r][2], a[r][3])));
            for (long t = k; t < K; t++) s += value(w, t) * X[r * K + t];
            if (scale) s *= bf16_to_float(scale[j]);
            if (bias) s += value(bias, j);
            store(Y, r * N + j, s);
        }
    }
}

#if defined(SELFSPEC_AVX512) && defined(SELFSPEC_VNNI)
// int8 weights on CPUs with AVX512-VNNI but not the bfloat16 pairs (Cascade Lake to Ice Lake
// Xeons), built with -mavx512bw -mavx512vnni -DSELFSPEC_VNNI: each row of x becomes int16, q = round(x / s)
// with s = max|x| / QMAX (one scale a row), and each output an exact integer sum of int8 x int16
// products (vpdpwssd: 32 multiply-adds an instruction, against 16 for an FMA, and the weights
// widened once to int16 rather than twice to float), times s and the row's weight scale.
// Exactness: an integer sum is the same in any order, so every row count, thread count and CPU
// that runs this path gives the same bits; the quantization of a row depends on that row alone.
// 15 bits: a lane of the accumulators holds K / 32 products, so int32 holds any K below ~33,000.
constexpr int QMAX = 16383;

static inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> 16 float
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// q = x's row as int16 (round to nearest even), returns its scale s; NaN where x holds a NaN or
// an infinity (so the row's outputs are NaN, as the float products give), 0 for a row of zeros.
static float quantize_row(const uint16_t* x, long K, int16_t* q) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 bad = 0;
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m512 v = _mm512_abs_ps(load16(x + k));
        bad |= _mm512_cmp_ps_mask(v, _mm512_set1_ps(3.4028235e38f), _CMP_NLE_UQ);  // NaN or infinity
        m = _mm512_max_ps(m, v);
    }
    float top = _mm512_reduce_max_ps(m);
    for (; k < K; k++) {
        const float v = fabsf(bf16_to_float(x[k]));
        bad |= !(v <= 3.4028235e38f);
        top = v > top ? v : top;
    }
    if (bad) {
        memset(q, 0, K * sizeof(int16_t));
        return __builtin_nanf("");
    }
    if (top == 0) {
        memset(q, 0, K * sizeof(int16_t));
        return 0;
    }
    const float s = top / QMAX;
    const __m512 vs = _mm512_set1_ps(s);
    for (k = 0; k + 16 <= K; k += 16)  // |x / s| <= QMAX: no saturation
        _mm256_storeu_si256((__m256i*)(q + k), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_div_ps(load16(x + k), vs))));
    for (; k < K; k++) q[k] = (int16_t)nearbyintf(bf16_to_float(x[k]) / s);
    return s;
}

// acc += pairwise products of w and the 32 int16 at q. In assembly: GCC copies the intrinsic's
// accumulator in and out of a scratch register around each instruction, twice the uops.
static inline __m512i dpwssd(__m512i acc, __m512i w, __m512i q) {
    __asm__("vpdpwssd %1, %2, %0" : "+v"(acc) : "v"(q), "v"(w));
    return acc;
}

// Output rows j0..j1 for R rows of Q (x as int16, scales sx).
template <int R>
static void rows_vnni(const int8_t* W, const int16_t* Q, const float* sx, const uint16_t* scale, const uint16_t* bias,
                      uint16_t* Y, long j0, long j1, long K, long N) {
    for (long j = j0; j < j1; j++) {
        const int8_t* w = W + j * K;
        __m512i a[R][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
        long k = 0;
        for (; k + 64 <= K; k += 64) {
#if PREFETCH
            _mm_prefetch((const char*)(w + k + PREFETCH), _MM_HINT_T0);
#endif
            const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + k)));
            const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + k + 32)));
            for (int r = 0; r < R; r++) {
                const int16_t* q = Q + r * K + k;
                a[r][0] = dpwssd(a[r][0], w0, _mm512_loadu_si512(q));
                a[r][1] = dpwssd(a[r][1], w1, _mm512_loadu_si512(q + 32));
            }
        }
        for (int r = 0; r < R; r++) {
            const __m512i lo = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(a[r][0])),
                                                _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a[r][0], 1)));
            const __m512i hi = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(a[r][1])),
                                                _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a[r][1], 1)));
            long long s = _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
            for (long t = k; t < K; t++) s += (long long)w[t] * Q[r * K + t];
            double f = (double)s * sx[r];
            if (scale) f *= bf16_to_float(scale[j]);
            float y = (float)f;
            if (bias) y += bf16_to_float(bias[j]);
            Y[r * N + j] = float_to_bf16(y);
        }
    }
}
#endif

#ifdef __AVX512BF16__
// Built with -mavx512bf16 where the CPU has it (AVX512-BF16: Zen 4, Sapphire Rapids): weights and
// x go into dot products of bfloat16 pairs, half the FMAs and no per-row conversion, so two to
// four rows cost little more than one. int8 weights become bfloat16 on the way (exactly: every
// integer up to 256 is a bfloat16). Each row is still one fixed order of its own.
static inline __m512bh load32(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

static inline __m512bh load32(const int8_t* p) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0-15 from lo, 16-31 from hi
}

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

#ifdef SELFSPEC_AMX
// Built with -mamx-tile -mamx-bf16 where the CPU has AMX (Sapphire Rapids and later Xeons): the
// bfloat16 (and int8, widened to bfloat16 on the way) products of 1-16 rows as tile dot products.
// A tile is 16 output rows of W by 32 inputs, read where W lies (its natural [N, K] layout, no
// copy); B is x, its pairs packed per call; C is 16 outputs by R rows of float32 sums. An AMX
// instruction costs the same whatever R, so 16 rows stream W as fast as one: the verify of γ + 1
// rows costs what a step does (on a 2-core Xeon, SmolLM2's 120 layer matrices: ~10 ms for 1, 4
// or 8 rows, against 10.6, 14.4 and 21.5 ms with the pair dot products).
// Exactness: each output element is one thread's sum in one fixed order (tile dot products over K
// in chunks of 32, then the K % 32 tail in order), the same for any R and thread count. Its rounding
// is AMX's own (denormals flushed), so a CPU with AMX rounds differently from one without.
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>

// Linux lends AMX's tile state to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); asked once, and the whole process takes the pair products if it is refused.
static bool amx_permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles 0-2: C of three 16-output groups (R float32 each); 3-5: their A (32 bfloat16 each); 7: B.
static void tile_config(int R) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) c.rows[t] = 16, c.colsb[t] = t < 3 ? R * 4 : 64;
    c.rows[7] = 16, c.colsb[7] = R * 4;
    _tile_loadconfig(&c);
}

// 16 rows of 32 elements from W (row stride K) at rows j0.., inputs k..k+31, as bfloat16 into buf
// [16][32]: int8 widened exactly, bfloat16 copied; rows past `rows` stay zero.
template <typename T>
static void stage(const T* W, long K, long k, int rows, uint16_t* buf) {
    for (int m = 0; m < rows; m++) {
        if constexpr (std::is_same<T, int8_t>::value)
            _mm512_storeu_si512(buf + m * 32, (__m512i)load32(W + m * K + k));
        else
            _mm512_storeu_si512(buf + m * 32, _mm512_loadu_si512(W + m * K + k));
    }
}

template <typename T>
static void product_amx(const T* W, const uint16_t* x, const uint16_t* scale, const uint16_t* bias, uint16_t* Y,
                        long N, long K, int R, int threads) {
    const long K32 = K / 32 * 32, chunks = K / 32;
    static thread_local std::vector<uint32_t> packed;  // x's pairs: packed[q * R + r] = x[r][2q], x[r][2q + 1]
    packed.resize((size_t)(K32 / 2) * R);
    for (int r = 0; r < R; r++) {
        const uint32_t* xr = (const uint32_t*)(x + r * K);  // bf16 pairs
        for (long q = 0; q < K32 / 2; q++) packed[q * R + r] = xr[q];
    }
    const uint32_t* B = packed.data();
    const long tasks = (N + 47) / 48;  // three 16-output groups each
#pragma omp parallel num_threads(threads)
    {
        tile_config(R);
        alignas(64) float C[3][16 * 16];
        alignas(64) uint16_t buf[3][16 * 32];
#pragma omp for schedule(static)
        for (long b = 0; b < tasks; b++) {
            const long j0 = b * 48;
            const int count = (int)(N - j0 < 48 ? N - j0 : 48);
            const int groups = (count + 15) / 16;
            int rows[3];
            bool staged[3];
            for (int g = 0; g < 3; g++) {
                rows[g] = g < groups ? (count - 16 * g < 16 ? count - 16 * g : 16) : 0;
                // bfloat16 tiles load from W itself; int8 and a last group short of 16 go through buf
                staged[g] = rows[g] && (!std::is_same<T, uint16_t>::value || rows[g] < 16);
                if (staged[g]) memset(buf[g], 0, sizeof buf[g]);
            }
            const T* w0 = W + j0 * K;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            for (long c = 0; c < chunks; c++) {  // (tile numbers must be literals: one block per group)
                const long k = c * 32;
                _tile_loadd(7, B + c * 16 * R, R * 4);
                if (staged[0]) {
                    stage(w0, K, k, rows[0], buf[0]);
                    _tile_loadd(3, buf[0], 64);
                } else {
                    _tile_loadd(3, w0 + k, K * 2);
                }
                _tile_dpbf16ps(0, 3, 7);
                if (rows[1]) {
                    if (staged[1]) {
                        stage(w0 + 16 * K, K, k, rows[1], buf[1]);
                        _tile_loadd(4, buf[1], 64);
                    } else {
                        _tile_loadd(4, w0 + 16 * K + k, K * 2);
                    }
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (rows[2]) {
                    if (staged[2]) {
                        stage(w0 + 32 * K, K, k, rows[2], buf[2]);
                        _tile_loadd(5, buf[2], 64);
                    } else {
                        _tile_loadd(5, w0 + 32 * K + k, K * 2);
                    }
                    _tile_dpbf16ps(2, 5, 7);
                }
            }
            _tile_stored(0, C[0], R * 4);
            _tile_stored(1, C[1], R * 4);
            _tile_stored(2, C[2], R * 4);
            for (int g = 0; g < groups; g++)
                for (int m = 0; m < rows[g]; m++) {
                    const long j = j0 + 16 * g + m;
                    const T* w = W + j * K;
                    for (int r = 0; r < R; r++) {
                        float s = C[g][m * R + r];
                        for (long t = K32; t < K; t++) s += value(w, t) * bf16_to_float(x[r * K + t]);
                        if (scale) s *= bf16_to_float(scale[j]);
                        if (bias) s += bf16_to_float(bias[j]);
                        Y[r * N + j] = float_to_bf16(s);
                    }
                }
        }
        _tile_release();
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
#ifdef SELFSPEC_VNNI
    if constexpr (std::is_same<T, int8_t>::value && std::is_same<E, uint16_t>::value) {
        int16_t* Q = (int16_t*)X;  // x as int16: half the float32 scratch
        float sx[4];
        for (int r = 0; r < R; r++) sx[r] = quantize_row(x + r * K, K, Q + r * K);
        const long tasks = (N + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long b = 0; b < tasks; b++) {
            long j0 = b * 16, j1 = j0 + 16 < N ? j0 + 16 : N;
            switch (R) {
                case 1: rows_vnni<1>(W, Q, sx, scale, bias, Y, j0, j1, K, N); break;
                case 2: rows_vnni<2>(W, Q, sx, scale, bias, Y, j0, j1, K, N); break;
                case 3: rows_vnni<3>(W, Q, sx, scale, bias, Y, j0, j1, K, N); break;
                default: rows_vnni<4>(W, Q, sx, scale, bias, Y, j0, j1, K, N); break;
            }
        }
        return;
    }
#endif
    if constexpr (std::is_same<E, float>::value) {
        X = (float*)x;  // already float32
    } else if constexpr (!pairs) {
        // bfloat16 weights: each 2h-block of x's 4h-blocks as its h even then its h odd elements (the order
        // rows() widens the weights in; h = LANES); the tail and int8 weights' x in order
        constexpr long h = LANES;
        const long K4 = std::is_same<T, uint16_t>::value ? K / (4 * h) * (4 * h) : 0;
        for (long r = 0; r < R; r++) {
            const E* xr = x + r * K;
            float* Xr = X + r * K;
            for (long b = 0; b < K4; b += 2 * h)
                for (int i = 0; i < h; i++) Xr[b + i] = bf16_to_float(xr[b + 2 * i]), Xr[b + h + i] = bf16_to_float(xr[b + 2 * i + 1]);
            for (long i = K4; i < K; i++) Xr[i] = bf16_to_float(xr[i]);
        }
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
                case 4: rows_pairs<T, 4>(W, x, scale, bias, Y, j0, j1, K, N); break;
                case 5: rows_pairs<T, 5>(W, x, scale, bias, Y, j0, j1, K, N); break;
                case 6: rows_pairs<T, 6>(W, x, scale, bias, Y, j0, j1, K, N); break;
                case 7: rows_pairs<T, 7>(W, x, scale, bias, Y, j0, j1, K, N); break;
                default: rows_pairs<T, 8>(W, x, scale, bias, Y, j0, j1, K, N); break;
            }
#endif
        } else {
            switch (R) {
                case 1: rows<T, E, 1, LANES>(W, X, scale, bias, Y, j0, j1, K, N); break;
                case 2: rows<T, E, 2, LANES>(W, X, scale, bias, Y, j0, j1, K, N); break;
                case 3: rows<T, E, 3, LANES>(W, X, scale, bias, Y, j0, j1, K, N); break;
                default: rows<T, E, 4, LANES>(W, X, scale, bias, Y, j0, j1, K, N); break;
            }
        }
    }
}

// Whether the AMX tile products ran these R rows (bfloat16 activations, a build with AMX, the
// process granted the tile state); false: the caller runs the other paths.
template <typename T, typename E>
static bool ran_amx(const T* W, const E* x, const uint16_t* scale, const E* bias, E* Y, long N, long K, int R,
                    int threads) {
#ifdef SELFSPEC_AMX
    if constexpr (std::is_same<E, uint16_t>::value) {
        if (amx_permitted()) {
            product_amx<T>(W, x, scale, bias, Y, N, K, R, threads);
            return true;
        }
    }
#endif
    return false;
}

// Any number of rows up to MAX_ROWS, four per pass over W (int8 weights on the bfloat16 pairs:
// eight, whose widening to bfloat16 is then shared by eight rows; on a 2-core AMD EPYC it took
// Qwen2.5-Coder 0.5B's int8 head from 12-15 to 9-10 ms at 5-8 rows and 30 to 18 ms at 16;
// bfloat16 weights ran 8 rows a pass 1.4x slower than two passes of 4, so they keep four), all in
// one with AMX (each row's result is the same in any pass). X: float32 scratch for four rows of x.
// Rows R..R_out-1 pad a fixed row bucket (exact mode): copies of the last computed row, as
// selfspec.model.step pads its inputs.
static const int MAX_ROWS = 16;

template <typename T, typename E>
static constexpr int rows_per_pass() {
#ifdef __AVX512BF16__
    return std::is_same<T, int8_t>::value && std::is_same<E, uint16_t>::value ? 8 : 4;
#else
    return 4;
#endif
}

template <typename T, typename E>
static int product(const T* W, const E* x, const uint16_t* scale, const E* bias, E* Y, long N, long K, int R, int R_out,
                   int threads, float* X) {
    if (R < 1 || R > MAX_ROWS || R_out < R || R_out > MAX_ROWS) return 1;
    if (!ran_amx<T, E>(W, x, scale, bias, Y, N, K, R, threads))
        for (int c = 0, pass = rows_per_pass<T, E>(); c < R; c += pass)
            product4<T, E>(W, x + c * K, scale, bias, Y + c * N, N, K, R - c < pass ? R - c : pass, threads, X);
    for (int r = R; r < R_out; r++) memcpy(Y + (long)r * N, Y + (long)(R - 1) * N, N * sizeof(E));
    return 0;
}

