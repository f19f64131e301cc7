// selfspec's 4-bit few-row products behind the ops selfspec::int4_gemv and int4_dequantize
// (ops.cpp checks the tensors; see quant4.h and selfspec/native/gemv.py).
#include "entry.h"
#include "quant4.h"

int selfspec_int4_gemv(const uint8_t* Q, const uint8_t* S, const uint16_t* x, const uint16_t* bias, uint16_t* y,
                       long N, long K, long R, long R_out, int threads) {
    return int4::product(Q, S, x, bias, y, N, K, R, R_out, threads);
}

int selfspec_int4_dequantize(const uint8_t* Q, const uint8_t* S, void* W, int bfloat16, long N, long K, int threads) {
    return bfloat16 ? int4::dequantize(Q, S, (uint16_t*)W, N, K, threads) : int4::dequantize(Q, S, (float*)W, N, K, threads);
}

