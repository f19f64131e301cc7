// selfspec_layer: one decoder layer of a model for one to sixteen rows of one or several sequences
// (layer.h's layer_spans; selfspec/native/fused_layer.py). ops.cpp checks the tensors and calls it.
#include "layer.h"

int selfspec_layer(const Dims* d, const Weights* w, int dtype, void* h, int n, const Span* spans, int nspans,
                   long window, const void* cos, const void* sin, int do_attn, int do_mlp, int threads, int siblings) {
    typedef uint16_t B;
    switch (dtype) {
        case 0: return layer_spans<B, B>(*d, *w, (B*)h, n, spans, nspans, window, (const B*)cos, (const B*)sin,
                                         do_attn, do_mlp, threads, siblings);
        case 1: return layer_spans<int8_t, B>(*d, *w, (B*)h, n, spans, nspans, window, (const B*)cos, (const B*)sin,
                                              do_attn, do_mlp, threads, siblings);
        case 3: return layer_spans<uint8_t, B>(*d, *w, (B*)h, n, spans, nspans, window, (const B*)cos, (const B*)sin,
                                               do_attn, do_mlp, threads, siblings);
        case 2: return layer_spans<float, float>(*d, *w, (float*)h, n, spans, nspans, window, (const float*)cos,
                                                 (const float*)sin, do_attn, do_mlp, threads, siblings);
    }
    return 2;
}
