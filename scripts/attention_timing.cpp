#include "/work/main/selfspec/kernels/layer.h"
#include <chrono>
#include <cstdio>
int main() {
    const long cap = 1008, hd = 64, len = 1000;
    std::vector<uint16_t> k(cap * hd), v(cap * hd), q(hd), o(hd);
    for (long i = 0; i < cap * hd; i++) { k[i] = float_to_bf16((i % 17) * 0.01f); v[i] = float_to_bf16((i % 13) * 0.02f); }
    for (long i = 0; i < hd; i++) q[i] = float_to_bf16(0.1f * (i % 5));
    for (int rep = 0; rep < 3; rep++) {
        auto t = std::chrono::steady_clock::now();
        for (int it = 0; it < 10000; it++) attend_pairs<64>(q.data(), k.data(), v.data(), 0, len - 1, len - 1, 0.125f, o.data());
        double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count() / 10000;
        printf("attend_pairs 1000 keys: %.0f ns = %.2f ns/key\n", ns, ns / len);
        t = std::chrono::steady_clock::now();
        for (int it = 0; it < 10000; it++) attend<uint16_t, 64>(q.data(), k.data(), v.data(), 0, len - 1, len - 1, 64, 0.125f, o.data());
        ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count() / 10000;
        printf("attend avx2 1000 keys: %.0f ns = %.2f ns/key\n", ns, ns / len);
    }
}
