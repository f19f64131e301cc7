// The kernels' entry points (gemv.cpp, layer.cpp, feature.cpp), called only by ops.cpp, which
// checks every tensor first: these trust their pointers and sizes. Status 0: done; 1: sizes the
// kernel does not take; 2: an unknown dtype code.
#pragma once
#include <cstdint>

struct Dims {
    long hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    int act;       // 0: SiLU, 1: GELU (tanh approximation)
    int sandwich;  // Gemma 3: (1 + w) norms in float32, and norms after attention and the MLP
    int qk_norm;   // per-head norms on q and k before rotary
    int gated;     // 1: act(gate) · up from a [gate | up] product (the models); 0: act(up) (the feature head)
};

struct Weights {
    const void *wqkv, *bqkv, *wo, *wgu, *wd;         // [out, in]; bqkv may be null
    const uint16_t *sqkv, *so, *sgu, *sd;            // int8's per-output-row scales, else null
    const void *norm_in, *norm_attn, *norm_ff, *norm_post;  // pre-norm: norm_in and norm_ff only
    const void *q_norm, *k_norm;                     // [head_dim], or null
};

struct FeatureDims {
    Dims block;        // the head's block; eps is also the two input norms'
    long vocab;        // rows of the draft head; 0: no logits
    float final_eps;   // the model's final norm
    float softcap;     // the model's final soft-cap; 0: none
    int final_gemma;   // the model's final norm is Gemma's (1 + w), in float32
};

struct FeatureWeights {
    Weights block;     // wgu: the MLP's up [width, hidden]; wd: its down [hidden, width]
    const void *feature_norm, *token_norm, *fc;  // fc [hidden, 2 · hidden]
    const void *final_norm, *head, *head_bias;   // head [vocab, hidden]; head_bias may be null
};

// y [R_out, N] = x [R, K] · Wᵀ (W [N, K]) (+ bias [N]); int8: times scale [N]. Rows R..R_out-1: copies of row R-1.
// bfloat16 as uint16_t bits; scratch: float32 for four rows of x.
int selfspec_gemv_f32(const float* W, const float* x, const float* bias, float* y, long N, long K, int R, int R_out,
                      int threads);
int selfspec_gemv_bf16(const uint16_t* W, const uint16_t* x, const uint16_t* bias, uint16_t* y, long N, long K, int R,
                       int R_out, int threads, float* scratch);
int selfspec_gemv_int8(const int8_t* W, const uint16_t* scale, const uint16_t* x, const uint16_t* bias, uint16_t* y,
                       long N, long K, int R, int R_out, int threads, float* scratch);

// 4-bit blocks (quant4.h): blocks of 32 inputs in groups of 16, each group's scales a record of 38 bytes.
constexpr long INT4_GROUP = 16, INT4_RECORD = 2 * INT4_GROUP + 6;
// The most rows a fused-layer call takes with 4-bit weights (a prefill's chunk); other weights take product.h's MAX_ROWS.
constexpr int INT4_LAYER_ROWS = 256;
static inline long int4_groups(long K) { return (K / 32 + INT4_GROUP - 1) / INT4_GROUP; }

// y [R_out, N] = x [R, K] · Wᵀ (+ bias [N]) for W as 4-bit blocks of 32 (quant4.h: Q [N, K / 32, 16] nibbles,
// S [N, int4_groups(K), INT4_RECORD] scale and minimum codes and steps); bfloat16 x, bias and y; any
// R >= 1 (a decode step's few, a short prefill's many), each row's result the one-row call's.
int selfspec_int4_gemv(const uint8_t* Q, const uint8_t* S, const uint16_t* x, const uint16_t* bias, uint16_t* y,
                       long N, long K, long R, long R_out, int threads);
// The same blocks as W [N, K], float32 (or bfloat16 bits where bfloat16 != 0), each weight q · scale - minimum.
int selfspec_int4_dequantize(const uint8_t* Q, const uint8_t* S, void* W, int bfloat16, long N, long K, int threads);

// One sequence's cache of one layer ([kv_heads, capacity, head_dim] keys and values) and the position
// of its first row in a call.
struct Span {
    void *kc, *vc;
    long capacity, start;
    long rows;  // this sequence's rows in the call (sequences may differ: a ragged batched verify)
};
// One decoder layer over h [n, hidden] in place (layer.h, `layer_spans`): the rows of nspans
// sequences, spans[s].rows each in turn (summing to n), each with its own Span (one sequence, or a
// batched verify's several, of any row counts); siblings: one span only. dtype: 0 bfloat16 weights, 1 int8 weights (bfloat16
// activations), 2 float32 throughout, 3 4-bit blocks (quant4.h; bfloat16 activations, the scales'
// pointers then point at each matrix's quant4.h scales, [N, groups, 38] bytes).
int selfspec_layer(const Dims* d, const Weights* w, int dtype, void* h, int n, const Span* spans, int nspans,
                   long window, const void* cos, const void* sin, int do_attn, int do_mlp, int threads, int siblings);

// The feature head's drafting step (feature.cpp). dtype: 0 bfloat16 throughout, 2 float32 throughout.
int selfspec_feature(const FeatureDims* d, const FeatureWeights* w, int dtype, const void* previous,
                     const void* embedded, void* h, int n, long start, const void* cos, const void* sin, void* kc,
                     void* vc, long capacity, float* logits, int threads);
