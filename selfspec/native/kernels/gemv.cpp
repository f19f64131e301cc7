// selfspec's few-row matrix products behind the op selfspec::gemv (ops.cpp checks the tensors; see
// selfspec/native/gemv.py).
#include "entry.h"
#include "product.h"

int selfspec_gemv_f32(const float* W, const float* x, const float* bias, float* y, long N, long K, int R,
                      int R_out, int threads) {
    return product<float, float>(W, x, nullptr, bias, y, N, K, R, R_out, threads, nullptr);
}

int selfspec_gemv_bf16(const uint16_t* W, const uint16_t* x, const uint16_t* bias, uint16_t* y,
                       long N, long K, int R, int R_out, int threads, float* scratch) {
    return product<uint16_t, uint16_t>(W, x, nullptr, bias, y, N, K, R, R_out, threads, scratch);
}

int selfspec_gemv_int8(const int8_t* W, const uint16_t* scale, const uint16_t* x, const uint16_t* bias,
                       uint16_t* y, long N, long K, int R, int R_out, int threads, float* scratch) {
    return product<int8_t, uint16_t>(W, x, scale, bias, y, N, K, R, R_out, threads, scratch);
}
