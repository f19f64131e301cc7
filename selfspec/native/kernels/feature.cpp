// The feature head's drafting step for one to sixteen rows in one call (selfspec/native/fused_feature.py;
// FeatureDims and FeatureWeights in entry.h, the op and its checks in ops.cpp):
//   s = fc · [norm(previous final state), norm(token embedding)]          per row
//   f = the head's block over s: a layer.h layer (attention over the head's own KV cache, then an
//       ungated SiLU MLP), in place
//   logits = the pruned draft head over the model's final norm of the last row's f (optional),
//       soft-capped where the model does (Gemma), in float32
// The same arithmetic per row whatever the number of rows, as for the model's layers. It only
// drafts: the verify checks every token, so its rounding never reaches the output.
#include "layer.h"

#include <cmath>
#include <vector>

template <typename E>
static int feature(const FeatureDims& d, const FeatureWeights& w, const E* previous, const E* embedded, E* h, int n,
                   long start, const E* cos, const E* sin, E* kc, E* vc, long capacity, float* logits, int threads) {
    const long H = d.block.hidden;
    if (n < 1 || n > MAX_ROWS || H % 8) return 1;
    static thread_local std::vector<E> joined, out;
    static thread_local std::vector<float> X;
    if (joined.size() < (size_t)(MAX_ROWS * 2 * H)) joined.resize(MAX_ROWS * 2 * H);
    if (X.size() < (size_t)(4 * 2 * H)) X.resize(4 * 2 * H);
    E* s = joined.data();
    for (int r = 0; r < n; r++) {
        norm(previous + r * H, (const E*)w.feature_norm, s + r * 2 * H, H, d.block.eps, false);
        norm(embedded + r * H, (const E*)w.token_norm, s + r * 2 * H + H, H, d.block.eps, false);
    }
    linear<E, E>(w.fc, s, nullptr, nullptr, h, H, 2 * H, n, threads, X.data());
    const int status = layer<E, E>(d.block, w.block, h, n, start, 0, cos, sin, kc, vc, capacity, 1, 1, threads);
    if (status || d.vocab <= 0 || !logits) return status;
    if (out.size() < (size_t)d.vocab) out.resize(d.vocab);
    norm(h + (n - 1) * H, (const E*)w.final_norm, s, H, d.final_eps, d.final_gemma);
    linear<E, E>(w.head, s, nullptr, w.head_bias, out.data(), d.vocab, H, 1, threads, X.data());
    for (long i = 0; i < d.vocab; i++) {
        float v = value(out.data(), i);
        logits[i] = d.softcap > 0 ? std::tanh(v / d.softcap) * d.softcap : v;
    }
    return 0;
}

// dtype: 0 bfloat16 throughout, 2 float32 throughout.
int selfspec_feature(const FeatureDims* d, const FeatureWeights* w, int dtype, const void* previous,
                                const void* embedded, void* h, int n, long start, const void* cos, const void* sin,
                                void* kc, void* vc, long capacity, float* logits, int threads) {
    typedef uint16_t B;
    switch (dtype) {
        case 0: return feature<B>(*d, *w, (const B*)previous, (const B*)embedded, (B*)h, n, start, (const B*)cos,
                                  (const B*)sin, (B*)kc, (B*)vc, capacity, logits, threads);
        case 2: return feature<float>(*d, *w, (const float*)previous, (const float*)embedded, (float*)h, n, start,
                                      (const float*)cos, (const float*)sin, (float*)kc, (float*)vc, capacity, logits,
                                      threads);
    }
    return 2;
}
