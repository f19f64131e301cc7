// selfspec_layer: one decoder layer of a model for one to sixteen rows (layer.h; selfspec/native/fused_layer.py);
// siblings: rows 1.. are alternatives for the position after row 0's (layer.h, `layer`). ops.cpp checks
// the tensors and calls it.
#include "layer.h"

// dtype: 0 bfloat16 weights, 1 int8 weights (bfloat16 activations), 2 float32 throughout, 3 4-bit blocks.
int selfspec_layer(const Dims* d, const Weights* w, int dtype, void* h, int n, long start, long window,
                              const void* cos, const void* sin, void* kc, void* vc, long capacity, int do_attn,
                              int do_mlp, int threads, int siblings) {
    typedef uint16_t B;
    switch (dtype) {
        case 0: return layer<B, B>(*d, *w, (B*)h, n, start, window, (const B*)cos, (const B*)sin, (B*)kc, (B*)vc,
                                   capacity, do_attn, do_mlp, threads, siblings);
        case 1: return layer<int8_t, B>(*d, *w, (B*)h, n, start, window, (const B*)cos, (const B*)sin, (B*)kc,
                                        (B*)vc, capacity, do_attn, do_mlp, threads, siblings);
        case 3: return layer<uint8_t, B>(*d, *w, (B*)h, n, start, window, (const B*)cos, (const B*)sin, (B*)kc,
                                         (B*)vc, capacity, do_attn, do_mlp, threads, siblings);
        case 2: return layer<float, float>(*d, *w, (float*)h, n, start, window, (const float*)cos, (const float*)sin,
                                           (float*)kc, (float*)vc, capacity, do_attn, do_mlp, threads, siblings);
    }
    return 2;
}

int selfspec_layer_spans(const Dims* d, const Weights* w, int dtype, void* h, int n, const Span* spans, int nspans,
                         long window, const void* cos, const void* sin, int do_attn, int do_mlp, int threads) {
    typedef uint16_t B;
    switch (dtype) {
        case 0: return layer_spans<B, B>(*d, *w, (B*)h, n, spans, nspans, window, (const B*)cos, (const B*)sin,
                                         do_attn, do_mlp, threads);
        case 1: return layer_spans<int8_t, B>(*d, *w, (B*)h, n, spans, nspans, window, (const B*)cos, (const B*)sin,
                                              do_attn, do_mlp, threads);
        case 3: return layer_spans<uint8_t, B>(*d, *w, (B*)h, n, spans, nspans, window, (const B*)cos, (const B*)sin,
                                               do_attn, do_mlp, threads);
        case 2: return layer_spans<float, float>(*d, *w, (float*)h, n, spans, nspans, window, (const float*)cos,
                                                 (const float*)sin, do_attn, do_mlp, threads);
    }
    return 2;
}
