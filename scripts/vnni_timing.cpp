// The int8 product kernel's arithmetic alone: one 1024 x 576 int8 matrix (590 KB, held in cache),
// 1, 2 and 4 rows, one thread, fastest of 300 calls, built as selfspec.gemv builds the avx512 path
// with the integer products (VNNI) and without (float FMAs). See scripts/vnni_results.sh.
//
//   g++ -O3 -std=c++17 -mavx2 -mfma -ffp-contract=off -fopenmp -mavx512f -DSELFSPEC_AVX512 \
//       [-mavx512bw -mavx512vnni -DSELFSPEC_VNNI] -I selfspec/kernels -o /tmp/vnni_timing scripts/vnni_timing.cpp
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "product.h"

int main() {
    const long N = 1024, K = 576;
    std::vector<int8_t> W(N * K);
    std::vector<uint16_t> x(4 * K), y(4 * N), scale(N, 0x3c00);
    std::vector<float> X(4 * K);
    std::mt19937 g(0);
    for (auto& v : W) v = (int8_t)((int)(g() % 255) - 127);
    for (auto& v : x) v = float_to_bf16((float)((int)(g() % 2001) - 1000) / 1000.f);
#ifdef SELFSPEC_VNNI
    const char* kernel = "integer (VNNI)";
#else
    const char* kernel = "float FMAs";
#endif
    for (int R : {1, 2, 4}) {
        double best = 1e9;
        for (int t = 0; t < 300; t++) {
            auto a = std::chrono::steady_clock::now();
            product<int8_t, uint16_t>(W.data(), x.data(), scale.data(), nullptr, y.data(), N, K, R, R, 1, X.data());
            double d = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
            best = d < best ? d : best;
        }
        printf("%s, %d rows: %.1f us, %.1f G multiply-adds/s\n", kernel, R, best * 1e6, N * K * R / best / 1e9);
    }
}
