// selfspec's kernels as torch ops (selfspec/native/gemv.py builds this library with
// torch.utils.cpp_extension and loads it): the schemas, declared here once, and the checks of
// every tensor's device, dtype, shape and contiguity before a kernel sees a pointer, so a wrong
// call is a RuntimeError in Python, never a crash or garbage. The kernels themselves (gemv.cpp,
// layer.cpp, feature.cpp, entry.h) trust what they are given.
//
// The namespace is the build's (SELFSPEC_NS, set by gemv.py: selfspec_<hash of sources and
// flags>), so builds with other flags (SELFSPEC_GEMV=avx2 and the like, in the tests) load side by
// side in one process; gemv.py's custom op selfspec::gemv calls the current build's.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/copy.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "entry.h"

#ifndef SELFSPEC_NS
#define SELFSPEC_NS selfspec_kernels
#endif
#define SELFSPEC_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // expands SELFSPEC_NS first

using at::Tensor;

namespace {

constexpr int64_t kMaxRows = 16;  // product.h's MAX_ROWS: the most rows a call takes

// t is a contiguous CPU tensor of `dtype` and exactly `shape` (-1: any size there).
void check(const Tensor& t, const char* name, at::ScalarType dtype, std::vector<int64_t> shape) {
    TORCH_CHECK(t.defined(), name, " is missing");
    TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
    TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
    bool fits = t.dim() == (int64_t)shape.size();
    for (size_t i = 0; fits && i < shape.size(); i++) fits = shape[i] < 0 || t.size(i) == shape[i];
    TORCH_CHECK(fits, name, " must be of shape ", at::IntArrayRef(shape), " (-1: any), got ", t.sizes());
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// An optional tensor: checked where present, and present exactly when `wanted`.
const void* optional_ptr(const std::optional<Tensor>& t, bool wanted, const char* name, at::ScalarType dtype,
                         std::vector<int64_t> shape) {
    const bool present = t.has_value() && t->defined();
    TORCH_CHECK(present == wanted, name, wanted ? " is required here" : " must be None here");
    if (!present) return nullptr;
    check(*t, name, dtype, std::move(shape));
    return t->data_ptr();
}

// A rotary table, cos or sin: [positions, head_dim] (or more leading dimensions of one row each),
// contiguous, with a row for every position up to `end`.
void check_rope(const Tensor& t, const char* name, at::ScalarType dtype, int64_t head_dim, int64_t end) {
    TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
    TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
    TORCH_CHECK(t.dim() >= 1 && t.size(-1) == head_dim, name, " must end in head_dim ", head_dim, ", got ", t.sizes());
    TORCH_CHECK(t.numel() / head_dim >= end, name, " has ", t.numel() / head_dim, " positions, ", end, " needed");
}

// A KV cache tensor [layers, 1, kv_heads, capacity, head_dim] and layer index: the layer's slice.
void* cache_layer(const Tensor& t, const char* name, at::ScalarType dtype, int64_t layer, int64_t kv_heads,
                  int64_t head_dim) {
    check(t, name, dtype, {-1, 1, kv_heads, -1, head_dim});
    TORCH_CHECK(0 <= layer && layer < t.size(0), "layer ", layer, " is outside the cache's ", t.size(0), " layers");
    return (char*)t.data_ptr() + layer * t.stride(0) * t.element_size();
}

// blocks: 4-bit blocks (uint8, quant4.h) are taken too (the fused layer; the int4 products have their own op).
at::ScalarType weight_dtype(const Tensor& x, const Tensor& w, bool blocks = false) {
    const auto xt = x.scalar_type(), wt = w.scalar_type();
    TORCH_CHECK(xt == at::kBFloat16 || xt == at::kFloat, "activations must be bfloat16 or float32, got ", xt);
    TORCH_CHECK(xt == at::kBFloat16 ? (wt == at::kBFloat16 || wt == at::kChar || (blocks && wt == at::kByte))
                                    : wt == at::kFloat,
                "weights of dtype ", wt, " with ", xt, " activations: bfloat16 takes bfloat16 or int8 weights",
                blocks ? " or 4-bit blocks (uint8)" : "", ", float32 takes float32");
    return wt;
}

// Each thread's float32 scratch for four rows of x, kept between calls.
float* scratch(int64_t n) {
    static thread_local std::vector<float> buf;
    if ((int64_t)buf.size() < n) buf.resize(std::max<int64_t>(n, 4 * 8192));
    return buf.data();
}

Tensor gemv(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, const std::optional<Tensor>& scale,
            std::optional<int64_t> rows_out) {
    TORCH_CHECK(x.dim() == 2, "x must be [rows, in], got ", x.sizes());
    TORCH_CHECK(w.dim() == 2, "w must be [out, in], got ", w.sizes());
    const int64_t R = x.size(0), K = x.size(1), N = w.size(0), R_out = rows_out.value_or(R);
    TORCH_CHECK(1 <= R && R <= kMaxRows, "the product kernel takes 1..", kMaxRows, " rows, got ", R);
    TORCH_CHECK(R <= R_out && R_out <= kMaxRows, "rows_out must be in ", R, "..", kMaxRows, ", got ", R_out);
    const auto wt = weight_dtype(x, w);
    check(x, "x", x.scalar_type(), {R, K});
    check(w, "w", wt, {N, K});
    const void* b = optional_ptr(bias, bias.has_value(), "bias", x.scalar_type(), {N});
    const void* s = optional_ptr(scale, wt == at::kChar, "scale (int8 weights' per-output scale)", at::kBFloat16, {N});
    Tensor y = at::empty({R_out, N}, x.options());
    const int threads = at::get_num_threads();
    int status;
    if (wt == at::kFloat)
        status = selfspec_gemv_f32((const float*)w.data_ptr(), (const float*)x.data_ptr(), (const float*)b,
                                   (float*)y.data_ptr(), N, K, (int)R, (int)R_out, threads);
    else if (wt == at::kChar)
        status = selfspec_gemv_int8((const int8_t*)w.data_ptr(), (const uint16_t*)s, (const uint16_t*)x.data_ptr(),
                                    (const uint16_t*)b, (uint16_t*)y.data_ptr(), N, K, (int)R, (int)R_out, threads,
                                    scratch(R * K));
    else
        status = selfspec_gemv_bf16((const uint16_t*)w.data_ptr(), (const uint16_t*)x.data_ptr(), (const uint16_t*)b,
                                    (uint16_t*)y.data_ptr(), N, K, (int)R, (int)R_out, threads, scratch(R * K));
    TORCH_CHECK(status == 0, "the product kernel refused ", R, " rows (status ", status, ")");
    return y;
}

// The scales of 4-bit blocks of an [N, K] matrix (quant4.h): [N, groups of 16 blocks, RECORD] uint8.
void check_int4_scales(const Tensor& sz, const char* name, int64_t N, int64_t K) {
    check(sz, name, at::kByte, {N, int4_groups(K), INT4_RECORD});
}

// W as 4-bit blocks of 32 (quant4.h): q [N, K / 32, 16] uint8 and its scales sz.
void check_int4(const Tensor& q, const Tensor& sz, int64_t K) {
    TORCH_CHECK(q.dim() == 3 && q.size(2) == 16, "q must be [out, in / 32, 16] (4-bit blocks of 32), got ", q.sizes());
    TORCH_CHECK(K % 32 == 0 && q.size(1) == K / 32, "q's ", q.size(1), " blocks of 32 do not cover ", K, " inputs");
    check(q, "q", at::kByte, {-1, K / 32, 16});
    check_int4_scales(sz, "sz (each group's scale and minimum codes and steps)", q.size(0), K);
}

// x [R, in] · Wᵀ (+ bias) through quant4.h's product, R_out rows out (past R: copies of row R - 1);
// the callers have checked x's rank and row counts.
static Tensor int4_product(const Tensor& x, const Tensor& q, const Tensor& sz, const std::optional<Tensor>& bias,
                           int64_t R_out) {
    const int64_t R = x.size(0), K = x.size(1);
    check(x, "x", at::kBFloat16, {R, K});
    check_int4(q, sz, K);
    const int64_t N = q.size(0);
    const void* b = optional_ptr(bias, bias.has_value(), "bias", at::kBFloat16, {N});
    Tensor y = at::empty({R_out, N}, x.options());
    const int status = selfspec_int4_gemv((const uint8_t*)q.data_ptr(), (const uint8_t*)sz.data_ptr(),
                                          (const uint16_t*)x.data_ptr(), (const uint16_t*)b, (uint16_t*)y.data_ptr(),
                                          N, K, R, R_out, at::get_num_threads());
    TORCH_CHECK(status == 0, "the 4-bit product kernel refused ", R, " rows (status ", status, ")");
    return y;
}

Tensor int4_gemv(const Tensor& x, const Tensor& q, const Tensor& sz, const std::optional<Tensor>& bias,
                 std::optional<int64_t> rows_out) {
    TORCH_CHECK(x.dim() == 2, "x must be [rows, in], got ", x.sizes());
    const int64_t R = x.size(0), R_out = rows_out.value_or(R);
    TORCH_CHECK(1 <= R && R <= kMaxRows, "the 4-bit product kernel takes 1..", kMaxRows, " rows, got ", R);
    TORCH_CHECK(R <= R_out && R_out <= kMaxRows, "rows_out must be in ", R, "..", kMaxRows, ", got ", R_out);
    return int4_product(x, q, sz, bias, R_out);
}

// x [M, in] · Wᵀ (+ bias) for any number of rows through the same kernel: each row's result is
// int4_gemv's for that row alone, bit for bit.
Tensor int4_rows(const Tensor& x, const Tensor& q, const Tensor& sz, const std::optional<Tensor>& bias) {
    TORCH_CHECK(x.dim() == 2, "x must be [rows, in], got ", x.sizes());
    TORCH_CHECK(x.size(0) >= 1, "x has no rows");
    return int4_product(x, q, sz, bias, x.size(0));
}

Tensor int4_dequantize(const Tensor& q, const Tensor& sz, bool bfloat16) {
    TORCH_CHECK(q.dim() == 3, "q must be [out, in / 32, 16] (4-bit blocks of 32), got ", q.sizes());
    const int64_t N = q.size(0), K = q.size(1) * 32;
    check_int4(q, sz, K);
    Tensor w = at::empty({N, K}, q.options().dtype(bfloat16 ? at::kBFloat16 : at::kFloat));
    const int status = selfspec_int4_dequantize((const uint8_t*)q.data_ptr(), (const uint8_t*)sz.data_ptr(),
                                                w.data_ptr(), bfloat16, N, K, at::get_num_threads());
    TORCH_CHECK(status == 0, "the 4-bit dequantizer refused a ", N, "x", K, " matrix (status ", status, ")");
    return w;
}

// x [M, in] · Wᵀ (+ bias) for W as 4-bit blocks and many rows (a prefill): W dequantized a tile of
// output rows at a time into one reused buffer (bfloat16 or float32, x's dtype; about `tile_bytes`,
// so it stays in cache and no fresh pages are touched), multiplied by PyTorch's GEMM and copied
// into the tile's columns of y [M, out]. Each weight is the dequantizer's and each output element
// one GEMM dot product over all of K (tiles split W's rows, never a sum).
Tensor int4_prefill(const Tensor& x, const Tensor& q, const Tensor& sz, const std::optional<Tensor>& bias,
                    int64_t tile_bytes) {
    TORCH_CHECK(x.dim() == 2, "x must be [rows, in], got ", x.sizes());
    const int64_t M = x.size(0), K = x.size(1);
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bfloat16 or float32, got ",
                x.scalar_type());
    check(x, "x", x.scalar_type(), {M, K});
    check_int4(q, sz, K);
    const int64_t N = q.size(0);
    if (bias.has_value()) check(*bias, "bias", x.scalar_type(), {N});
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const int64_t tile = std::max<int64_t>(16, std::min<int64_t>(N, tile_bytes / (K * x.element_size())) / 16 * 16);
    Tensor buffer = at::empty({tile, K}, x.options());
    Tensor y = at::empty({M, N}, x.options());
    for (int64_t j = 0; j < N; j += tile) {
        const int64_t rows = std::min(tile, N - j);
        Tensor w = buffer.narrow(0, 0, rows);
        const int status = selfspec_int4_dequantize((const uint8_t*)q.data_ptr() + j * (K / 32) * 16,
                                                    (const uint8_t*)sz.data_ptr() + j * int4_groups(K) * INT4_RECORD, w.data_ptr(),
                                                    bf16, rows, K, at::get_num_threads());
        TORCH_CHECK(status == 0, "the 4-bit dequantizer refused a ", rows, "x", K, " tile (status ", status, ")");
        Tensor part = bias.has_value() ? at::addmm(bias->narrow(0, j, rows), x, w.t()) : at::mm(x, w.t());
        y.narrow(1, j, rows).copy_(part);
    }
    return y;
}

// The LM head's screen (selfspec/model/head_screen.py): x [n, K] bfloat16 (the head's input),
// approx [n, V] bfloat16 (its 4-bit copy's logits of x), bounds [4, V] float32 (per vocabulary
// row: ||w8 - w4||, ||w4||, ||w8||, 15 max scale + max |minimum|). Per row r of x, in
// double: its norm, the norm of the int4 kernel's int8 error (within 0.51 of each block's step max
// |x_b| / 127), the int8 head's int16 error (0.51 of max |x| / 16383 a feature), ||x||_1 and float
// sums' (K + 64) 2^-23; with the bfloat16 results' 2^-8 of max |approx| and 2^-7 of slack, token
// j's gap g_j bounds |int8 logit - approx| (head_screen.py's docstring). Two passes over the
// vocabulary, across threads: the gaps and both maxima, then the comparison. Returns, ascending, every
// token j with approx[r, j] + g_j >= max_i (approx[r, i] - g_i) for some row r; an empty tensor of
// shape [1] holding -1 where x is not finite (the caller runs the full head).
Tensor head_screen(const Tensor& x, const Tensor& approx, const Tensor& bounds) {
    TORCH_CHECK(approx.dim() == 2 && approx.size(0) >= 1, "approx must be [rows, vocab], got ", approx.sizes());
    const int64_t n = approx.size(0), V = approx.size(1);
    TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "x must be [rows, in] with in a multiple of 32, got ", x.sizes());
    const int64_t K = x.size(1);
    check(x, "x", at::kBFloat16, {n, K});
    check(approx, "approx", at::kBFloat16, {n, V});
    check(bounds, "bounds", at::kFloat, {4, V});
    const uint16_t* a = (const uint16_t*)approx.data_ptr();
    const uint16_t* xs = (const uint16_t*)x.data_ptr();
    const float* b = bounds.data_ptr<float>();
    const auto value = [](uint16_t v) {
        uint32_t u = (uint32_t)v << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    };
    // Per row of x, the gap's coefficients on bounds' four rows; its constant part, 2^-8 (and a
    // slack) of max |approx|, is added once that maximum is known, after the first pass.
    std::vector<float> coef(n * 4);
    for (int64_t r = 0; r < n; r++) {
        double sq = 0, l1 = 0, err4 = 0, steps = 0, top = 0;
        for (int64_t blk = 0; blk < K / 32; blk++) {
            double m = 0;
            for (int i = 0; i < 32; i++) {
                const double v = value(xs[r * K + blk * 32 + i]);
                if (!std::isfinite(v)) return at::full({1}, -1, approx.options().dtype(at::kLong));
                sq += v * v, l1 += std::fabs(v), m = std::max(m, std::fabs(v));
            }
            const double step = m / 127.0;
            err4 += 32 * step * step, steps += step, top = std::max(top, m);
        }
        const double norm = std::sqrt(sq), sums = (K + 64) * std::ldexp(1.0, -23), slack = 1 + std::ldexp(1.0, -7);
        float* c = coef.data() + r * 4;
        c[0] = (float)(norm * slack);
        c[1] = (float)(0.51 * std::sqrt(err4) * slack);
        c[2] = (float)((0.51 * std::sqrt((double)K) * top / 16383.0 + sums * norm) * slack);
        c[3] = (float)(sums * (l1 + 0.51 * 32 * steps) * slack);
    }
    constexpr int64_t grain = 8192;
    const int64_t chunks = (V + grain - 1) / grain;
    static thread_local std::vector<float> gap;  // kept between calls: no fresh pages a step
    static thread_local std::vector<uint8_t> keep;
    gap.resize(std::max<size_t>(gap.size(), n * V));
    keep.resize(std::max<size_t>(keep.size(), V));
    std::vector<float> lows(chunks * n, -INFINITY), tops(chunks * n, 0.f), floors(n, -INFINITY);
    float* g_all = gap.data();
    uint8_t* kept = keep.data();
    // First pass: each token's gap without the constant, max (approx - it) and max |approx| a row.
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t ch = c0; ch < c1; ch++) {
            const int64_t j0 = ch * grain, j1 = std::min(V, j0 + grain);
            for (int64_t r = 0; r < n; r++) {
                const float* cr = coef.data() + r * 4;
                float* g = g_all + r * V;
                const uint16_t* ar = a + r * V;
                float low = -INFINITY, top = 0.f;
                for (int64_t j = j0; j < j1; j++) {
                    g[j] = cr[0] * b[j] + cr[1] * b[V + j] + cr[2] * b[2 * V + j] + cr[3] * b[3 * V + j];
                    const float aj = value(ar[j]);
                    low = std::max(low, aj - g[j]), top = std::max(top, std::fabs(aj));
                }
                lows[ch * n + r] = low, tops[ch * n + r] = top;
            }
        }
    });
    for (int64_t r = 0; r < n; r++) {
        float top = 0.f;
        for (int64_t ch = 0; ch < chunks; ch++)
            floors[r] = std::max(floors[r], lows[ch * n + r]), top = std::max(top, tops[ch * n + r]);
        const float shift = (float)(top * (std::ldexp(1.0, -8) * (1 + std::ldexp(1.0, -7)) + std::ldexp(1.0, -7)));
        floors[r] -= 2 * shift;  // a token is kept where approx + g + shift >= max(approx - g) - shift
    }
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t j = c0 * grain, j1 = std::min(V, c1 * grain); j < j1; j++) {
            bool k = false;
            for (int64_t r = 0; r < n; r++) k |= value(a[r * V + j]) + g_all[r * V + j] >= floors[r];
            kept[j] = k;
        }
    });
    int64_t count = 0;
    for (int64_t j = 0; j < V; j++) count += kept[j];
    Tensor out = at::empty({count}, approx.options().dtype(at::kLong));
    int64_t* o = out.data_ptr<int64_t>();
    for (int64_t j = 0; j < V; j++)
        if (kept[j]) *o++ = j;
    return out;
}

// One decoder layer over x [n, hidden] in place (layer.h). weights: wqkv, bqkv, wo, wgu, wd, sqkv,
// so, sgu, sd, norm_in, norm_attn, norm_ff, norm_post, q_norm, k_norm (entry.h's Weights), None
// where a layer has none; keys, values: the model's cache [layers, 1, kv_heads, capacity, head_dim].
// The layer's weights checked against x [n, hidden] and the cache's kv_heads and head_dim, as
// entry.h's Weights and Dims; returns selfspec_layer's dtype code.
static int layer_weights(const Tensor& x, const std::vector<std::optional<Tensor>>& weights, int64_t nkv, int64_t hd,
                         int64_t heads, int64_t act, bool sandwich, bool qk_norm, double eps, double scale, Weights& w,
                         Dims& d) {
    TORCH_CHECK(weights.size() == 15, "fused_layer takes 15 weights (entry.h's Weights), got ", weights.size());
    auto get = [&](int i, const char* name) -> const Tensor& {
        TORCH_CHECK(weights[i].has_value() && weights[i]->defined(), name, " is missing");
        return *weights[i];
    };
    const Tensor &wqkv = get(0, "wqkv"), &wo = get(2, "wo"), &wgu = get(3, "wgu"), &wd = get(4, "wd");
    const auto E = x.scalar_type(), T = weight_dtype(x, wqkv, true);
    const bool int8 = T == at::kChar, int4 = T == at::kByte;  // int4: [out, in / 32, 16] blocks (quant4.h)
    const int64_t wdim = int4 ? 3 : 2;
    TORCH_CHECK(x.dim() == 2 && wqkv.dim() == wdim && wd.dim() == wdim, "x [n, hidden] and ", wdim, "-D weights, got ",
                x.sizes(), ", ", wqkv.sizes(), " and ", wd.sizes());
    const int64_t n = x.size(0), H = x.size(1);
    const int64_t I = int4 ? wd.size(1) * 32 : wd.size(1);
    const int64_t qdim = heads * hd, qkv_dim = (heads + 2 * nkv) * hd;
    const int64_t most = int4 ? INT4_LAYER_ROWS : kMaxRows;
    TORCH_CHECK(1 <= n && n <= most, "the fused layer takes 1..", most, " rows with these weights, got ", n);
    TORCH_CHECK(heads >= 1 && nkv >= 1 && heads % nkv == 0, heads, " heads do not group over ", nkv, " KV heads");
    TORCH_CHECK(hd % 16 == 0 && hd <= 512 && H % 8 == 0 && I % 8 == 0, "head size ", hd, " (a multiple of 16, <= 512), "
                "hidden ", H, " and MLP ", I, " sizes (multiples of 8) the fused layer does not take");
    TORCH_CHECK(act == 0 || act == 1, "act must be 0 (SiLU) or 1 (tanh GELU), got ", act);
    check(x, "x", E, {n, H});
    if (int4) {
        TORCH_CHECK(H % 32 == 0 && qdim % 32 == 0 && I % 32 == 0, "4-bit blocks of 32 need hidden ", H, ", ", qdim,
                    " and MLP ", I, " sizes that are multiples of 32");
        // (weight, its scales, output rows, inputs): the blocks [N, K / 32, 16], the scales [N, groups, RECORD]
        const Tensor* ws[] = {&wqkv, &wo, &wgu, &wd};
        const int64_t sizes[][2] = {{qkv_dim, H}, {H, qdim}, {2 * I, H}, {H, I}};
        const char* names[] = {"wqkv", "wo", "wgu", "wd"};
        const char* scale_names[] = {"sqkv", "so", "sgu", "sd"};
        const uint16_t** scales[] = {&w.sqkv, &w.so, &w.sgu, &w.sd};
        for (int i = 0; i < 4; i++) {
            check(*ws[i], names[i], T, {sizes[i][0], sizes[i][1] / 32, 16});
            TORCH_CHECK(weights[5 + i].has_value(), scale_names[i], " is missing");
            check_int4_scales(*weights[5 + i], scale_names[i], sizes[i][0], sizes[i][1]);
            *scales[i] = (const uint16_t*)weights[5 + i]->data_ptr();  // quant4.h's records, read as bytes
        }
    } else {
        check(wqkv, "wqkv", T, {qkv_dim, H});
        check(wo, "wo", T, {H, qdim});
        check(wgu, "wgu", T, {2 * I, H});
        check(wd, "wd", T, {H, I});
        w.sqkv = (const uint16_t*)optional_ptr(weights[5], int8, "sqkv", at::kBFloat16, {qkv_dim});
        w.so = (const uint16_t*)optional_ptr(weights[6], int8, "so", at::kBFloat16, {H});
        w.sgu = (const uint16_t*)optional_ptr(weights[7], int8, "sgu", at::kBFloat16, {2 * I});
        w.sd = (const uint16_t*)optional_ptr(weights[8], int8, "sd", at::kBFloat16, {H});
    }
    w.wqkv = wqkv.data_ptr(), w.wo = wo.data_ptr(), w.wgu = wgu.data_ptr(), w.wd = wd.data_ptr();
    w.bqkv = optional_ptr(weights[1], weights[1].has_value(), "bqkv", E, {qkv_dim});
    w.norm_in = optional_ptr(weights[9], true, "norm_in", E, {H});
    w.norm_attn = optional_ptr(weights[10], sandwich, "norm_attn", E, {H});
    w.norm_ff = optional_ptr(weights[11], true, "norm_ff", E, {H});
    w.norm_post = optional_ptr(weights[12], sandwich, "norm_post", E, {H});
    w.q_norm = optional_ptr(weights[13], qk_norm, "q_norm", E, {hd});
    w.k_norm = optional_ptr(weights[14], qk_norm, "k_norm", E, {hd});
    d = Dims{H, heads, nkv, hd, I, (float)eps, (float)scale, (int)act, sandwich, qk_norm, 1};
    return T == at::kBFloat16 ? 0 : int8 ? 1 : int4 ? 3 : 2;
}

// The layer over x [n, hidden]: its rows are len(starts) sequences', counts[s] rows of sequence s in
// turn; sequence s's rows at positions starts[s].. of its own cache keys[s], values[s] (each
// [layers, 1, kv_heads, capacity, head_dim], capacities free). siblings: one sequence only (layer.h).
static void layer_call(const Tensor& x, const std::vector<std::optional<Tensor>>& weights, const Tensor& cos,
                       const Tensor& sin, const std::vector<Tensor>& keys, const std::vector<Tensor>& values,
                       const std::vector<int64_t>& starts, const std::vector<int64_t>& counts, int64_t layer,
                       int64_t heads, int64_t act, bool sandwich, bool qk_norm, double eps, double scale,
                       int64_t window, bool attn, bool mlp, bool siblings) {
    const int64_t spans = (int64_t)starts.size();
    TORCH_CHECK(spans >= 1 && (int64_t)keys.size() == spans && (int64_t)values.size() == spans,
                "one cache (keys and values) per start, got ", keys.size(), ", ", values.size(), " and ", spans);
    TORCH_CHECK(keys[0].dim() == 5, "5-D caches, got ", keys[0].sizes());
    const auto E = x.scalar_type();
    const int64_t nkv = keys[0].size(2), hd = keys[0].size(4);
    Weights w{};
    Dims d{};
    const int dtype = layer_weights(x, weights, nkv, hd, heads, act, sandwich, qk_norm, eps, scale, w, d);
    const int64_t n = x.size(0);
    TORCH_CHECK((int64_t)counts.size() == spans, "one row count per start, got ", counts.size(), " and ", spans);
    TORCH_CHECK(window >= 0, "window must be >= 0, got ", window);
    std::vector<Span> span(spans);
    int64_t end = 0, total = 0;
    for (int64_t s = 0; s < spans; s++) {
        const int64_t per = counts[s];
        TORCH_CHECK(per >= 1, "every sequence needs a row, sequence ", s, " has ", per);
        total += per;
        TORCH_CHECK(keys[s].dim() == 5 && values[s].sizes() == keys[s].sizes(), "keys ", keys[s].sizes(),
                    " and values ", values[s].sizes(), " differ or are not 5-D");
        const int64_t capacity = keys[s].size(3);
        TORCH_CHECK(starts[s] >= 0 && starts[s] + per <= capacity, "positions ", starts[s], "..", starts[s] + per - 1,
                    " overrun the cache's ", capacity);
        span[s] = Span{cache_layer(keys[s], "keys", E, layer, nkv, hd), cache_layer(values[s], "values", E, layer, nkv, hd),
                       capacity, starts[s], per};
        end = std::max(end, starts[s] + per);
    }
    TORCH_CHECK(total == n, "the row counts add up to ", total, ", not the ", n, " rows of x");
    check_rope(cos, "cos", E, hd, end);
    check_rope(sin, "sin", E, hd, end);
    const int status = selfspec_layer(&d, &w, dtype, x.data_ptr(), (int)n, span.data(), (int)spans, window,
                                      cos.data_ptr(), sin.data_ptr(), attn, mlp, at::get_num_threads(), siblings);
    TORCH_CHECK(status == 0, "the fused layer refused ", n, " rows of ", spans, " sequences from position ", starts[0],
                " (status ", status, ")");
}

// One sequence's rows at positions start.. of its cache (layer_call).
void fused_layer(const Tensor& x, const std::vector<std::optional<Tensor>>& weights, const Tensor& cos,
                 const Tensor& sin, const Tensor& keys, const Tensor& values, int64_t layer, int64_t heads,
                 int64_t act, bool sandwich, bool qk_norm, double eps, double scale, int64_t start, int64_t window,
                 bool attn, bool mlp, bool siblings) {
    layer_call(x, weights, cos, sin, {keys}, {values}, {start}, {x.size(0)}, layer, heads, act, sandwich, qk_norm,
               eps, scale, window, attn, mlp, siblings);
}

// Several sequences' rows, counts[s] of sequence s (a batched verify, its drafts unpadded; layer_call).
void fused_rows(const Tensor& x, const std::vector<std::optional<Tensor>>& weights, const Tensor& cos,
                const Tensor& sin, const std::vector<Tensor>& keys, const std::vector<Tensor>& values,
                const std::vector<int64_t>& starts, const std::vector<int64_t>& counts, int64_t layer, int64_t heads,
                int64_t act, bool sandwich, bool qk_norm, double eps, double scale, int64_t window, bool attn,
                bool mlp) {
    layer_call(x, weights, cos, sin, keys, values, starts, counts, layer, heads, act, sandwich, qk_norm, eps, scale,
               window, attn, mlp, false);
}

// The feature head's drafting step (feature.cpp) over previous, embedded [1, n, hidden]: returns the
// predicted final states [1, n, hidden]; writes keys and values (the head's cache [1, 1, heads,
// capacity, head_dim]) and, with a draft head, the last row's float32 logits into logits [.., >= vocab].
// weights: qkv, o, up, down, attn_norm, mlp_norm, feature_norm, token_norm, fc, then final_norm,
// head and head_bias (None without a draft head; head_bias may be None).
Tensor feature_step(const Tensor& previous, const Tensor& embedded, const std::vector<std::optional<Tensor>>& weights,
                    const Tensor& cos, const Tensor& sin, const Tensor& keys, const Tensor& values,
                    const std::optional<Tensor>& logits, int64_t heads, double eps, double scale, double final_eps,
                    double softcap, bool final_gemma, int64_t start) {
    TORCH_CHECK(weights.size() == 12, "feature_step takes 12 weights, got ", weights.size());
    TORCH_CHECK(previous.dim() == 3 && previous.size(0) == 1 && keys.dim() == 5,
                "previous [1, n, hidden] and a 5-D cache, got ", previous.sizes(), " and ", keys.sizes());
    const auto E = previous.scalar_type();
    TORCH_CHECK(E == at::kBFloat16 || E == at::kFloat, "the feature step runs in bfloat16 or float32, got ", E);
    auto get = [&](int i, const char* name) -> const Tensor& {
        TORCH_CHECK(weights[i].has_value() && weights[i]->defined(), name, " is missing");
        return *weights[i];
    };
    const Tensor &up = get(2, "up");
    TORCH_CHECK(up.dim() == 2, "up must be [width, hidden], got ", up.sizes());
    const int64_t n = previous.size(1), H = previous.size(2), hd = keys.size(4), I = up.size(0), qdim = heads * hd;
    TORCH_CHECK(1 <= n && n <= kMaxRows, "the feature step takes 1..", kMaxRows, " rows, got ", n);
    TORCH_CHECK(heads >= 1 && hd % 16 == 0 && hd <= 512 && H % 8 == 0 && I % 8 == 0, "head size ", hd,
                " (a multiple of 16, <= 512), hidden ", H, " and width ", I, " (multiples of 8) the step does not take");
    TORCH_CHECK(start >= 0, "start must be >= 0, got ", start);
    check(previous, "previous", E, {1, n, H});
    check(embedded, "embedded", E, {1, n, H});
    void* kc = cache_layer(keys, "keys", E, 0, heads, hd);
    void* vc = cache_layer(values, "values", E, 0, heads, hd);
    TORCH_CHECK(values.size(3) == keys.size(3), "keys ", keys.sizes(), " and values ", values.sizes(), " differ");
    const int64_t capacity = keys.size(3);
    TORCH_CHECK(start + n <= capacity, "positions ", start, "..", start + n - 1, " overrun the cache's ", capacity);
    check_rope(cos, "cos", E, hd, start + n);
    check_rope(sin, "sin", E, hd, start + n);
    const char* names[] = {"qkv", "o", "up", "down", "attn_norm", "mlp_norm", "feature_norm", "token_norm", "fc"};
    const std::vector<int64_t> shapes[] = {{3 * qdim, H}, {H, qdim}, {I, H}, {H, I}, {H}, {H}, {H}, {H}, {H, 2 * H}};
    for (int i = 0; i < 9; i++) check(get(i, names[i]), names[i], E, shapes[i]);
    const bool head = weights[10].has_value() && weights[10]->defined();
    const int64_t vocab = head ? weights[10]->size(0) : 0;
    const void* final_norm = optional_ptr(weights[9], head, "final_norm", E, {H});
    const void* head_w = optional_ptr(weights[10], head, "head", E, {vocab, H});
    const void* head_bias = optional_ptr(weights[11], head && weights[11].has_value(), "head_bias", E, {vocab});
    float* out = nullptr;
    if (head) {
        TORCH_CHECK(logits.has_value() && logits->defined(), "logits is required with a draft head");
        check(*logits, "logits", at::kFloat, {-1, -1});
        TORCH_CHECK(logits->numel() >= vocab, "logits holds ", logits->numel(), " values, ", vocab, " needed");
        out = (float*)logits->data_ptr();
    }
    FeatureDims d{};
    d.block = Dims{H, heads, heads, hd, I, (float)eps, (float)scale, 0, 0, 0, 0};
    d.vocab = vocab, d.final_eps = (float)final_eps, d.softcap = (float)softcap, d.final_gemma = final_gemma;
    FeatureWeights w{};
    w.block.wqkv = weights[0]->data_ptr(), w.block.wo = weights[1]->data_ptr(), w.block.wgu = up.data_ptr();
    w.block.wd = weights[3]->data_ptr(), w.block.norm_in = weights[4]->data_ptr();
    w.block.norm_ff = weights[5]->data_ptr();
    w.feature_norm = weights[6]->data_ptr(), w.token_norm = weights[7]->data_ptr(), w.fc = weights[8]->data_ptr();
    w.final_norm = final_norm, w.head = head_w, w.head_bias = head_bias;
    Tensor h = at::empty({1, n, H}, previous.options());
    const int status = selfspec_feature(&d, &w, E == at::kBFloat16 ? 0 : 2, previous.data_ptr(), embedded.data_ptr(),
                                        h.data_ptr(), (int)n, start, cos.data_ptr(), sin.data_ptr(), kc, vc, capacity,
                                        out, at::get_num_threads());
    TORCH_CHECK(status == 0, "the feature step refused ", n, " rows at position ", start, " (status ", status, ")");
    return h;
}

}  // namespace

SELFSPEC_LIBRARY(SELFSPEC_NS, m) {
    m.def("gemv(Tensor x, Tensor w, Tensor? bias=None, Tensor? scale=None, int? rows_out=None) -> Tensor");
    m.def("fused_layer(Tensor(a!) x, Tensor?[] weights, Tensor cos, Tensor sin, Tensor(b!) keys, Tensor(c!) values, "
          "int layer, int heads, int act, bool sandwich, bool qk_norm, float eps, float scale, int start, int window, "
          "bool attn, bool mlp, bool siblings) -> ()");
    m.def("fused_rows(Tensor(a!) x, Tensor?[] weights, Tensor cos, Tensor sin, Tensor(b!)[] keys, Tensor(c!)[] values, "
          "int[] starts, int[] counts, int layer, int heads, int act, bool sandwich, bool qk_norm, float eps, "
          "float scale, int window, bool attn, bool mlp) -> ()");
    m.def("feature_step(Tensor previous, Tensor embedded, Tensor?[] weights, Tensor cos, Tensor sin, Tensor(a!) keys, "
          "Tensor(b!) values, Tensor(c!)? logits, int heads, float eps, float scale, float final_eps, float softcap, "
          "bool final_gemma, int start) -> Tensor");
    m.def("int4_gemv(Tensor x, Tensor q, Tensor sz, Tensor? bias=None, int? rows_out=None) -> Tensor");
    m.def("int4_rows(Tensor x, Tensor q, Tensor sz, Tensor? bias=None) -> Tensor");
    m.def("int4_dequantize(Tensor q, Tensor sz, bool bfloat16=False) -> Tensor");
    m.def("int4_prefill(Tensor x, Tensor q, Tensor sz, Tensor? bias=None, int tile_bytes=4194304) -> Tensor");
    m.def("head_screen(Tensor x, Tensor approx, Tensor bounds) -> Tensor");
    m.impl("gemv", c10::DispatchKey::CPU, TORCH_FN(gemv));
    m.impl("head_screen", c10::DispatchKey::CPU, TORCH_FN(head_screen));
    m.impl("int4_gemv", c10::DispatchKey::CPU, TORCH_FN(int4_gemv));
    m.impl("int4_rows", c10::DispatchKey::CPU, TORCH_FN(int4_rows));
    m.impl("int4_dequantize", c10::DispatchKey::CPU, TORCH_FN(int4_dequantize));
    m.impl("int4_prefill", c10::DispatchKey::CPU, TORCH_FN(int4_prefill));
    m.impl("fused_layer", c10::DispatchKey::CPU, TORCH_FN(fused_layer));
    m.impl("fused_rows", c10::DispatchKey::CPU, TORCH_FN(fused_rows));
    m.impl("feature_step", c10::DispatchKey::CPU, TORCH_FN(feature_step));
}
