// One (row, head) of the fused layer's attention over 1,000 keys (head size 64, bfloat16), one
// thread, 10,000 calls, three times: the 16-lane path (attend16: AVX512-BF16 pairs, or with
// -DSELFSPEC_AVX512 and no -mavx512bf16, AVX-512 FMAs) and the AVX2 one. Each
// prints the mean and the fastest call (the fastest is what a busy, shared machine leaves readable).
// Build from the repository root (-I picks which layer.h; for an earlier version, `git show
// REV:selfspec/kernels/layer.h` and product.h into a folder and point -I there):
//
//   g++ -O3 -std=c++17 -mavx2 -mfma -ffp-contract=off -fopenmp -mavx512f -mavx512bf16 \
//       -Iselfspec/kernels scripts/attention_timing.cpp -o /tmp/attention_timing && /tmp/attention_timing
//
// (on a CPU with AVX-512 but no AVX512-BF16, -mavx512f -DSELFSPEC_AVX512 in place of -mavx512f -mavx512bf16)
#include "layer.h"
#include <chrono>
#include <cstdio>
int main() {
    const long cap = 1008, hd = 64, len = 1000;
    std::vector<uint16_t> k(cap * hd), v(cap * hd), q(hd), o(hd);
    for (long i = 0; i < cap * hd; i++) { k[i] = float_to_bf16((i % 17) * 0.01f); v[i] = float_to_bf16((i % 13) * 0.02f); }
    for (long i = 0; i < hd; i++) q[i] = float_to_bf16(0.1f * (i % 5));
    auto time = [&](const char* name, auto call) {
        double total = 0, best = 1e30;
        for (int it = 0; it < 10000; it++) {
            auto t = std::chrono::steady_clock::now();
            call();
            double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count();
            total += ns, best = ns < best ? ns : best;
        }
        printf("%s %ld keys: mean %.0f ns = %.2f ns/key, fastest %.0f ns = %.2f ns/key\n", name, len, total / 10000,
               total / 10000 / len, best, best / len);
    };
    for (int rep = 0; rep < 3; rep++) {
        time("attend16", [&] { attend16<64>(q.data(), k.data(), v.data(), 0, len - 1, len - 1, 0.125f, o.data()); });
        time("attend avx2", [&] { attend<uint16_t, 64>(q.data(), k.data(), v.data(), 0, len - 1, len - 1, 64, 0.125f, o.data()); });
    }
}
