// One decoder layer for one to sixteen rows in one call (see selfspec/native/fused_layer.py for why):
// the templates behind selfspec_layer (layer.cpp) and the feature head's step (feature.cpp).
// norm, fused QKV product, rotary, cache write, attention over the cache, O product and residual,
// norm, gate/up product, activation, down product and residual. Pre-norm (Llama, Qwen2) and
// sandwich (Gemma 3) layouts, optional per-head q/k norms and a sliding window.
//
// Every row's arithmetic is its own, in one fixed order whatever the number of rows in the call
// and the thread count: products through product.h four rows at a time, attention one (row, head)
// per task over that row's own keys. So a verify's rows are the AR step's rows bit for bit.
//
// Elementwise steps round as PyTorch's bfloat16 ops do (each op's result rounded once), so the
// layer stays within rounding of the HF modules; E is bfloat16 (uint16 bits) or float.
#pragma once
#include "entry.h"  // Dims, Weights
#include "quant4.h"

#include <algorithm>
#include <cmath>
#include <vector>

// Eight elements of E as floats, and eight floats stored as E (rounded to nearest even, as
// float_to_bf16 rounds every finite value); rnd8: v rounded to E, as floats.
static inline __m256 load8f(const uint16_t* p) { return load8(p); }
static inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256i round_bits(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
}
static inline void store8f(uint16_t* p, __m256 v) {
    __m256i u = _mm256_srli_epi32(round_bits(v), 16);
    _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}
static inline void store8f(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
template <typename E> static inline __m256 rnd8(__m256 v) {
    if constexpr (std::is_same<E, float>::value) return v;
    else return _mm256_castsi256_ps(_mm256_and_si256(round_bits(v), _mm256_set1_epi32((int)0xffff0000u)));
}

// e^x on 8 lanes (Cephes' polynomial, ~1 ulp): the same result for a value wherever it sits.
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    const float c[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
    for (float ci : c) y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(ci));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(x, x)), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// RMSNorm of one row x [dim] (dim % 8 == 0) into out: Llama's (statistics in float32, normalised
// row rounded to E, times w in E), or with gemma, (1 + w) applied in float32 and rounded once.
template <typename E>
static void norm(const E* x, const E* w, E* out, long dim, float eps, bool gemma) {
    __m256 acc = _mm256_setzero_ps();
    for (long i = 0; i < dim; i += 8) {
        __m256 v = load8f(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(hsum(acc) / (float)dim + eps)), one = _mm256_set1_ps(1.0f);
    for (long i = 0; i < dim; i += 8) {
        __m256 v = _mm256_mul_ps(load8f(x + i), r), wi = load8f(w + i);
        if (gemma) v = _mm256_mul_ps(v, _mm256_add_ps(one, wi));
        else if constexpr (std::is_same<E, float>::value) v = _mm256_mul_ps(v, wi);
        else v = _mm256_mul_ps(wi, rnd8<E>(v));
        store8f(out + i, v);
    }
}

// h [dim] += a [dim], rounded to E.
template <typename E>
static void residual(E* h, const E* a, long dim) {
    for (long i = 0; i < dim; i += 8) store8f(h + i, _mm256_add_ps(load8f(h + i), load8f(a + i)));
}

// y [n, N] = x [n, K] · Wᵀ (product.h; 4-bit blocks, T = uint8_t: quant4.h, `scale` pointing at their scales).
template <typename T, typename E>
static void linear(const void* W, const E* x, const uint16_t* scale, const void* bias, E* y, long N, long K, int n,
                   int threads, float* X) {
    if constexpr (std::is_same_v<T, uint8_t>)
        int4::product((const uint8_t*)W, (const uint8_t*)scale, x, (const uint16_t*)bias, y, N, K, n, n, threads);
    else
        product<T, E>((const T*)W, x, scale, (const E*)bias, y, N, K, n, n, threads, X);
}

// Rotary embedding of one head's row in place (head_dim % 16 == 0), as HF's
// q·cos + rotate_half(q)·sin in dtype E: each product and the sum rounded to E.
template <typename E>
static void rotate(E* x, const E* cos, const E* sin, long hd) {
    const long half = hd / 2;
    const __m256 minus = _mm256_set1_ps(-1.0f);
    for (long i = 0; i < half; i += 8) {
        __m256 lo = load8f(x + i), hi = load8f(x + half + i);
        __m256 new_lo = rnd8<E>(_mm256_add_ps(rnd8<E>(_mm256_mul_ps(lo, load8f(cos + i))),
                                              rnd8<E>(_mm256_mul_ps(_mm256_mul_ps(hi, minus), load8f(sin + i)))));
        __m256 new_hi = rnd8<E>(_mm256_add_ps(rnd8<E>(_mm256_mul_ps(hi, load8f(cos + half + i))),
                                              rnd8<E>(_mm256_mul_ps(lo, load8f(sin + half + i)))));
        store8f(x + i, new_lo);
        store8f(x + half + i, new_hi);
    }
}

// This thread's buffer for one (row, head)'s len attention scores.
static float* scores(long len) {
    static thread_local std::vector<float> buf;
    if ((long)buf.size() < len) buf.resize(len);
    return buf.data();
}

// Scores s [len] with maximum m -> e^(s - m) in place; returns their sum, in one order fixed by len
// alone: lane l of 8 adds keys l, l + 8, l + 16, ... (a tail's missing keys add 0), then hsum.
// (A scalar running sum is a chain of len dependent adds.) A tail goes through a zero-padded vector,
// the same per element as a full one.
static float softmax_weights(float* s, long len, float m) {
    const __m256 m8 = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= len; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m8));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (j < len) {
        float t[8] = {0};
        const long rest = len - j;
        memcpy(t, s + j, rest * sizeof(float));
        _mm256_storeu_ps(t, exp8(_mm256_sub_ps(_mm256_loadu_ps(t), m8)));
        memcpy(s + j, t, rest * sizeof(float));
        for (long i = rest; i < 8; i++) t[i] = 0.0f;  // missing keys add 0
        sum = _mm256_add_ps(sum, _mm256_loadu_ps(t));
    }
    return hsum(sum);
}

// One query row of one head against keys lo..p of its KV head, the last of them read from slot
// `own` (p for a row of a chain; a sibling's own slot, see `layer`), in that order; o [head_dim]
// in E. HD: the head size when it is one of the common ones (q and the output accumulator then
// live in registers), else 0 and hd at run time. The arithmetic per element is the same either way.
static inline long key_slot(long lo, long j, long len, long own) { return j + 1 < len ? lo + j : own; }

template <typename E, int HD>
static void attend(const E* q, const E* kc, const E* vc, long lo, long p, long own, long hd_runtime, float scale,
                   E* o) {
    const long hd = HD ? HD : hd_runtime;
    constexpr int V = HD ? HD / 8 : 64;  // 8-lane vectors per head row (64: room for head_dim 512)
    const long len = p - lo + 1;
    float* s = scores(len);
    __m256 qv[V], acc[V];
    for (long i = 0; i < hd / 8; i++) qv[i] = load8f(q + 8 * i), acc[i] = _mm256_setzero_ps();
    float m = -INFINITY;
    for (long j = 0; j < len; j++) {
        const E* k = kc + key_slot(lo, j, len, own) * hd;
        __m256 a = _mm256_setzero_ps();
        for (long i = 0; i < hd / 8; i++) a = _mm256_fmadd_ps(qv[i], load8f(k + 8 * i), a);
        s[j] = hsum(a) * scale;
        m = s[j] > m ? s[j] : m;
    }
    const float sum = softmax_weights(s, len, m);
    for (long j = 0; j < len; j++) {
        const E* v = vc + key_slot(lo, j, len, own) * hd;
        __m256 pj = _mm256_set1_ps(s[j]);
        for (long i = 0; i < hd / 8; i++) acc[i] = _mm256_fmadd_ps(pj, load8f(v + 8 * i), acc[i]);
    }
    const __m256 inv = _mm256_set1_ps(sum);
    for (long i = 0; i < hd / 8; i++) store8f(o + 8 * i, _mm256_div_ps(acc[i], inv));
}

#if defined(__AVX512BF16__) || defined(SELFSPEC_AVX512)
// The lane sums of 16 vectors in one: lane t of the result is the sum of a[t]'s 16 lanes, every
// one in the same tree ((x_l + x_l+8) + (x_l+4 + x_l+12), then (z0 + z2) + (z1 + z3)), as four
// rounds of shuffles and adds shared by all 16 (hsum16 per vector costs twice the instructions).
static inline __m512 reduce16(const __m512* a) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)  // lanes 0-7: vector 2i's x_l + x_l+8; 8-15: vector 2i + 1's
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  // 128-bit quarter m: vector 4i + m's y_l + y_l+4
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  // quarter m: z0 + z2, z1 + z3 of vectors 8i + m, then 8i + 4 + m
        e[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    // quarter m: the sums of vectors m, 4 + m, 8 + m, 12 + m; lane 4m + j holds vector 4j + m's
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, f);
}

// Q queries of one KV head that share the keys' first slots (the same lo: the heads of its group,
// the rows of one verify), every key of their common prefix loaded and widened once for all Q.
// Each query's arithmetic is the same whatever Q, op for op (its own dot per key, its own softmax
// over its own keys, its own weighted sum in key order), so its result is the one-query call's
// (attend16, Q = 1) bit for bit. HD·Q <= 256 keeps most of the accumulators in registers.
// q·k for 16 keys at a time, their sums reduced together (reduce16): with AVX512-BF16 as pair dot
// products of the bfloat16 rows themselves (no conversion); with AVX-512 alone each 32 elements of
// k widened as its even and odd ones (a shift and a mask) against q's, widened once. The weighted
// sum of v on 16 lanes, loaded and widened the same way. Its own fixed order per query and per
// key, wherever the key sits in a block of 16.
template <int HD, int Q>
static void attend16_rows(const uint16_t* const* q, const uint16_t* kc, const uint16_t* vc, long lo, const long* p,
                          const long* own, float scale, uint16_t* const* o) {
    static_assert(HD % 32 == 0 && HD * Q <= 256, "head size and rows");
    constexpr int B = HD / 32;
    long len[Q], shared = 1L << 62, most = 0;
    for (int r = 0; r < Q; r++) {
        len[r] = p[r] - lo + 1;
        shared = len[r] - 1 < shared ? len[r] - 1 : shared;  // keys lo .. lo + shared - 1 are every row's
        most = len[r] > most ? len[r] : most;
    }
    float* s[Q] = {scores(Q * (most + 16))};
    for (int r = 1; r < Q; r++) s[r] = s[0] + r * (most + 16);
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
#ifdef __AVX512BF16__
    __m512bh qz[Q][B];
#else
    __m512 qe[Q][B], qo[Q][B];
#endif
    __m512 even[Q][B], odd[Q][B], m16[Q];
    for (int r = 0; r < Q; r++) {
        m16[r] = _mm512_set1_ps(-INFINITY);
        for (int i = 0; i < B; i++) {
#ifdef __AVX512BF16__
            qz[r][i] = (__m512bh)_mm512_loadu_si512(q[r] + 32 * i);
#else
            const __m512i raw = _mm512_loadu_si512(q[r] + 32 * i);
            qe[r][i] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), qo[r][i] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
#endif
            even[r][i] = odd[r][i] = _mm512_setzero_ps();
        }
    }
    const __m512 scale16 = _mm512_set1_ps(scale);
    // One key's dot with row r's q, in attend16's order.
    auto dot = [&](int r, const uint16_t* k) {
        __m512 a = _mm512_setzero_ps();
        for (int i = 0; i < B; i++) {
#ifdef __AVX512BF16__
            a = _mm512_dpbf16_ps(a, qz[r][i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
#else
            const __m512i raw = _mm512_loadu_si512(k + 32 * i);
            a = _mm512_fmadd_ps(qe[r][i], _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), a);
            a = _mm512_fmadd_ps(qo[r][i], _mm512_castsi512_ps(_mm512_and_si512(raw, high)), a);
#endif
        }
        return a;
    };
    __m512 a[Q][16];
    auto keep = [&](int r, long j0, long count) {  // a block's scores into s[r], and its maximum
        for (long t = count; t < 16; t++) a[r][t] = _mm512_setzero_ps();
        const __m512 block = _mm512_mul_ps(reduce16(a[r]), scale16);
        _mm512_storeu_ps(s[r] + j0, block);
        m16[r] = _mm512_mask_max_ps(m16[r], (__mmask16)((1u << count) - 1), m16[r], block);
    };
    long j0 = 0;
    for (; j0 + 16 <= shared; j0 += 16) {  // whole blocks of shared keys: each key read once for all rows
        for (long t = 0; t < 16; t++) {
            const uint16_t* k = kc + (lo + j0 + t) * HD;
            for (int r = 0; r < Q; r++) a[r][t] = dot(r, k);
        }
        for (int r = 0; r < Q; r++) keep(r, j0, 16);
    }
    for (int r = 0; r < Q; r++)  // each row's remaining keys, in blocks of 16 from j0
        for (long b = j0; b < len[r]; b += 16) {
            const long count = len[r] - b < 16 ? len[r] - b : 16;
            for (long t = 0; t < count; t++) a[r][t] = dot(r, kc + key_slot(lo, b + t, len[r], own[r]) * HD);
            keep(r, b, count);
        }
    float sum[Q];
    for (int r = 0; r < Q; r++) sum[r] = softmax_weights(s[r], len[r], _mm512_reduce_max_ps(m16[r]));
    auto weigh = [&](int r, long j, const __m512* ve, const __m512* vo) {
        const __m512 pj = _mm512_set1_ps(s[r][j]);
        for (int i = 0; i < B; i++) {
            even[r][i] = _mm512_fmadd_ps(pj, ve[i], even[r][i]);
            odd[r][i] = _mm512_fmadd_ps(pj, vo[i], odd[r][i]);
        }
    };
    auto widen = [&](const uint16_t* v, __m512* ve, __m512* vo) {
        for (int i = 0; i < B; i++) {
            const __m512i raw = _mm512_loadu_si512(v + 32 * i);
            ve[i] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), vo[i] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
        }
    };
    __m512 ve[B], vo[B];
    for (long j = 0; j < shared; j++) {  // shared values: read once, weighed into every row
        widen(vc + (lo + j) * HD, ve, vo);
        for (int r = 0; r < Q; r++) weigh(r, j, ve, vo);
    }
    for (int r = 0; r < Q; r++)
        for (long j = shared; j < len[r]; j++) {
            widen(vc + key_slot(lo, j, len[r], own[r]) * HD, ve, vo);
            weigh(r, j, ve, vo);
        }
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int r = 0; r < Q; r++) {
        const __m256 inv = _mm256_set1_ps(sum[r]);
        for (int i = 0; i < B; i++) {
            const __m512 lo16 = _mm512_permutex2var_ps(even[r][i], first, odd[r][i]);
            const __m512 hi16 = _mm512_permutex2var_ps(even[r][i], second, odd[r][i]);
            store8f(o[r] + 32 * i, _mm256_div_ps(_mm512_castps512_ps256(lo16), inv));
            store8f(o[r] + 32 * i + 8, _mm256_div_ps(high8(lo16), inv));
            store8f(o[r] + 32 * i + 16, _mm256_div_ps(_mm512_castps512_ps256(hi16), inv));
            store8f(o[r] + 32 * i + 24, _mm256_div_ps(high8(hi16), inv));
        }
    }
}


// One query (an AR step's row of one head): the same code, Q = 1.
template <int HD>
static void attend16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, long lo, long p, long own, float scale,
                     uint16_t* o) {
    attend16_rows<HD, 1>(&q, kc, vc, lo, &p, &own, scale, &o);
}
#endif

template <typename E>
static void attend_any(const E* q, const E* kc, const E* vc, long lo, long p, long own, long hd, float scale, E* o) {
#if defined(__AVX512BF16__) || defined(SELFSPEC_AVX512)
    if constexpr (std::is_same<E, uint16_t>::value) {
        switch (hd) {
            case 64: return attend16<64>(q, kc, vc, lo, p, own, scale, o);
            case 128: return attend16<128>(q, kc, vc, lo, p, own, scale, o);
            case 256: return attend16<256>(q, kc, vc, lo, p, own, scale, o);
        }
    }
#endif
    switch (hd) {
        case 64: return attend<E, 64>(q, kc, vc, lo, p, own, hd, scale, o);
        case 128: return attend<E, 128>(q, kc, vc, lo, p, own, hd, scale, o);
        case 256: return attend<E, 256>(q, kc, vc, lo, p, own, hd, scale, o);
        default: return attend<E, 0>(q, kc, vc, lo, p, own, hd, scale, o);
    }
}

// count <= 4 queries of one KV head (heads of its group, rows of a verify) against their keys,
// lo[i] the first: together (attend16_rows) where they share their first key and there are two or
// more, else one by one (attend_any). Every query's result is its one-row call's either way.
// ATTN_ROWS: the most rows per task, set by the build (selfspec/native/gemv.py: 4 on the AVX-512 path,
// where it was measured, 1 elsewhere; $SELFSPEC_ATTN_ROWS for an A/B). It changes no result.
#ifndef ATTN_ROWS
#define ATTN_ROWS 1
#endif
static const int MAX_ATTEND = 4;  // queries per task at most
static int rows_per_attend(long hd) {
#if defined(__AVX512BF16__) || defined(SELFSPEC_AVX512)
    return hd == 64 ? std::min(ATTN_ROWS, MAX_ATTEND) : hd == 128 ? std::min(ATTN_ROWS, 2) : 1;
#else
    return 1;
#endif
}

template <typename E>
static void attend_rows(E* const* q, const E* kc, const E* vc, const long* lo, const long* p, const long* own,
                        int count, long hd, float scale, E* const* o) {
    bool together = count > 1;
    for (int r = 1; r < count; r++) together = together && lo[r] == lo[0];
#if defined(__AVX512BF16__) || defined(SELFSPEC_AVX512)
    if constexpr (std::is_same<E, uint16_t>::value) {
        if (together) {
            if (hd == 64) switch (count) {
                case 2: return attend16_rows<64, 2>(q, kc, vc, lo[0], p, own, scale, o);
                case 3: return attend16_rows<64, 3>(q, kc, vc, lo[0], p, own, scale, o);
                case 4: return attend16_rows<64, 4>(q, kc, vc, lo[0], p, own, scale, o);
            }
            if (hd == 128 && count == 2) return attend16_rows<128, 2>(q, kc, vc, lo[0], p, own, scale, o);
        }
    }
#endif
    (void)together;
    for (int r = 0; r < count; r++) attend_any(q[r], kc, vc, lo[r], p[r], own[r], hd, scale, o[r]);
}

// act [I] = act(gate) · up for one row of gu = [gate | up] [2·I] (I % 8 == 0), each op rounded
// to E: SiLU g / (1 + e^-g), or GELU's tanh form with tanh(u) = 1 - 2 / (e^2u + 1). Not gated:
// act [I] = act(gu [I]).
template <typename E>
static void activation(const E* gu, E* act, long I, int kind, bool gated) {
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
    const __m256 c0 = _mm256_set1_ps(2.0f * 0.7978845608028654f), c1 = _mm256_set1_ps(0.044715f);
    for (long i = 0; i < I; i += 8) {
        __m256 g = load8f(gu + i), a;
        if (kind == 0) {
            a = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        } else {
            __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
            __m256 e = exp8(_mm256_mul_ps(c0, _mm256_add_ps(g, _mm256_mul_ps(c1, g3))));
            a = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_sub_ps(two, _mm256_div_ps(two, _mm256_add_ps(e, one))));
        }
        store8f(act + i, gated ? _mm256_mul_ps(rnd8<E>(a), load8f(gu + I + i)) : a);
    }
}

// Rows at positions start .. start+n-1, each written to its position's slot and attending to
// the positions before it and itself. siblings = 1: row 0 at position `start` as before, and rows
// 1..n-1 alternatives for position start+1, each written to slot start+r and attending to
// positions <= start and then its own slot: every row computes exactly what a one-row step of its
// token at its position would (the same keys in the same order), and the caller keeps the slot
// of the alternative it accepts.
//
// Spans: the rows of several sequences in one call (a batched verify), each sequence's rows in
// turn with its own cache (entry.h's Span: the layer's keys and values, capacity, first row's
// position, row count; the counts may differ: drafts of different lengths share the call unpadded);
// one span is one sequence. The products take all rows together; each row's rotary, cache write and
// attention are its own sequence's, its attention chunked as its one-sequence call chunks it, so
// every row is its one-sequence call's bit for bit.
template <typename T, typename E>
static int layer_spans(const Dims& d, const Weights& w, E* h, int n, const Span* spans, int nspans, long window,
                       const E* cos, const E* sin, int do_attn, int do_mlp, int threads, int siblings = 0) {
    const long H = d.hidden, hd = d.head_dim, nh = d.heads, nkv = d.kv_heads, I = d.inter;
    const long qdim = nh * hd, qkv_dim = (nh + 2 * nkv) * hd;
    const int most = std::is_same_v<T, uint8_t> ? INT4_LAYER_ROWS : MAX_ROWS;  // 4-bit products take any rows
    if (n < 1 || n > most || hd % 16 || hd > 512 || H % 8 || I % 8 || nspans < 1 || nspans > n) return 1;
    if (siblings && nspans > 1) return 1;
    // first[s]: span s's first row. The attention's tasks: tasks[s] .. tasks[s + 1] - 1 are span s's
    // (kv heads × chunks of its queries).
    static thread_local std::vector<long> first, chunks, tasks;
    first.resize(nspans), chunks.resize(nspans), tasks.resize(nspans + 1);
    const long group = nh / nkv, most_q = rows_per_attend(hd);
    long rows = 0;
    tasks[0] = 0;
    for (int s = 0; s < nspans; s++) {
        const long per = spans[s].rows;
        if (per < 1 || rows + per > n || spans[s].start < 0 || spans[s].start + per > spans[s].capacity) return 1;
        first[s] = rows, rows += per;
        chunks[s] = (per * group + most_q - 1) / most_q;
        tasks[s + 1] = tasks[s] + nkv * chunks[s];
    }
    if (rows != n) return 1;
    // Plain pointers for the parallel loop (other threads' thread_local vectors are their own).
    const long *span_first = first.data(), *span_chunks = chunks.data(), *span_tasks = tasks.data();
    const long widest = std::max(std::max(H, I), qdim);
    static thread_local std::vector<E> work;
    static thread_local std::vector<float> X;
    // Sized for MAX_ROWS once (or a longer prefill chunk's rows), so calls alternating between 1 and
    // n rows (draft, verify) neither reallocate nor zero-fill the buffers.
    const size_t per_row = H + qkv_dim + qdim + H + 3 * I;
    if (work.size() < std::max(n, MAX_ROWS) * per_row) work.resize(std::max(n, MAX_ROWS) * per_row);
    if (X.size() < (size_t)(4 * widest)) X.resize(4 * widest);
    E *x = work.data(), *qkv = x + n * H, *o = qkv + n * qkv_dim, *a = o + n * qdim, *gu = a + n * H, *act = gu + 2 * n * I;
    const bool gemma = d.sandwich;
    if (do_attn) {
        for (int r = 0; r < n; r++) norm(h + r * H, (const E*)w.norm_in, x + r * H, H, d.eps, gemma);
        linear<T, E>(w.wqkv, x, w.sqkv, w.bqkv, qkv, qkv_dim, H, n, threads, X.data());
        for (int s = 0; s < nspans; s++) {
            const Span& sp = spans[s];
            const long capacity = sp.capacity;
            for (long i = 0; i < sp.rows; i++) {
                const long p = siblings && i ? sp.start + 1 : sp.start + i, slot = sp.start + i;
                E* row = qkv + (span_first[s] + i) * qkv_dim;
                for (long head = 0; head < nh + nkv; head++) {
                    E* v = row + head * hd;
                    if (d.qk_norm) norm(v, (const E*)(head < nh ? w.q_norm : w.k_norm), v, hd, d.eps, gemma);
                    rotate(v, cos + p * hd, sin + p * hd, hd);
                }
                for (long g = 0; g < nkv; g++) {
                    memcpy((E*)sp.kc + (g * capacity + slot) * hd, row + (nh + g) * hd, hd * sizeof(E));
                    memcpy((E*)sp.vc + (g * capacity + slot) * hd, row + (nh + nkv + g) * hd, hd * sizeof(E));
                }
            }
        }
        // The queries of a span's KV head g are the (row, head) pairs of its heads, rows · group of
        // them; a task takes a chunk of up to rows_per_attend of them, which read the keys together
        // (attend_rows).
        const long all = span_tasks[nspans];
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long t = 0; t < all; t++) {
            int s = 0;
            while (span_tasks[s + 1] <= t) s++;
            const Span& sp = spans[s];
            const long queries = sp.rows * group, cs = span_chunks[s], u = t - span_tasks[s];
            const long g = u / cs, c = u % cs, i0 = c * queries / cs, row0 = span_first[s];
            const int count = (int)((c + 1) * queries / cs - i0);  // balanced chunks
            E *qs[MAX_ATTEND], *os[MAX_ATTEND];
            long los[MAX_ATTEND], ps[MAX_ATTEND], owns[MAX_ATTEND];
            for (int q = 0; q < count; q++) {
                const long i = (i0 + q) / group, r = row0 + i, head = g * group + (i0 + q) % group;
                const long p = siblings && i ? sp.start + 1 : sp.start + i;
                qs[q] = qkv + r * qkv_dim + head * hd, os[q] = o + r * qdim + head * hd;
                los[q] = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0, ps[q] = p, owns[q] = sp.start + i;
            }
            attend_rows(qs, (const E*)sp.kc + g * sp.capacity * hd, (const E*)sp.vc + g * sp.capacity * hd, los, ps,
                        owns, count, hd, d.scale, os);
        }
        linear<T, E>(w.wo, o, w.so, nullptr, a, H, qdim, n, threads, X.data());
        for (int r = 0; r < n; r++) {
            if (gemma) norm(a + r * H, (const E*)w.norm_attn, a + r * H, H, d.eps, true);
            residual(h + r * H, a + r * H, H);
        }
    }
    if (do_mlp) {
        for (int r = 0; r < n; r++) norm(h + r * H, (const E*)w.norm_ff, x + r * H, H, d.eps, gemma);
        const long width = d.gated ? 2 * I : I;
        linear<T, E>(w.wgu, x, w.sgu, nullptr, gu, width, H, n, threads, X.data());
        for (int r = 0; r < n; r++) activation(gu + r * width, act + r * I, I, d.act, d.gated);
        linear<T, E>(w.wd, act, w.sd, nullptr, a, H, I, n, threads, X.data());
        for (int r = 0; r < n; r++) {
            if (gemma) norm(a + r * H, (const E*)w.norm_post, a + r * H, H, d.eps, true);
            residual(h + r * H, a + r * H, H);
        }
    }
    return 0;
}

// One sequence's rows at positions start .. start+n-1 (see layer_spans).
template <typename T, typename E>
static int layer(const Dims& d, const Weights& w, E* h, int n, long start, long window, const E* cos, const E* sin,
                 E* kc, E* vc, long capacity, int do_attn, int do_mlp, int threads, int siblings = 0) {
    const Span span{kc, vc, capacity, start, n};
    return layer_spans<T, E>(d, w, h, n, &span, 1, window, cos, sin, do_attn, do_mlp, threads, siblings);
}
