// A driver for the CPU engine built for aarch64 and run under qemu-user (tests/support/arm.py):
// appended to engine.py's source, it answers requests on stdin with results on stdout,
// little-endian, until stdin ends. A request is a header of int64 words, then its data:
//   0 (info):    -> int64 dot_q8, then the tg_simd() name, NUL-terminated
//   1 (decode):  fmt, nblocks, raw bytes (nblocks * bytes)      -> nblocks * qk f32
//   2 (matmul):  fmt, N, K, M, transposed, kernel, raw bytes (N rows of K / qk blocks),
//                a (M x K f32 when transposed, else M x N)       -> int64 status, then c
//                (M x N, or M x K) f32
#include <cstdio>
#include <vector>

static bool read_all(void* p, size_t n) { return fread(p, 1, n, stdin) == n; }
static void write_all(const void* p, size_t n) { fwrite(p, 1, n, stdout); }

int main() {
    tg_set_threads(2);
    int64_t op;
    while (read_all(&op, 8)) {
        if (op == 0) {
            const int64_t q8 = tg_dot_q8();
            write_all(&q8, 8);
            write_all(tg_simd(), strlen(tg_simd()) + 1);
        } else if (op == 1) {
            int64_t h[2];
            if (!read_all(h, sizeof h)) return 2;
            const Format& f = kFormats[h[0]];
            std::vector<u8> raw((size_t)(h[1] * f.bytes));
            std::vector<float> out((size_t)(h[1] * f.qk));
            if (!read_all(raw.data(), raw.size())) return 2;
            tg_decode((int)h[0], raw.data(), out.data(), h[1]);
            write_all(out.data(), out.size() * 4);
        } else if (op == 2) {
            int64_t h[6];
            if (!read_all(h, sizeof h)) return 2;
            const int64_t fmt = h[0], N = h[1], K = h[2], M = h[3], tr = h[4], kernel = h[5];
            const Format& f = kFormats[fmt];
            const int64_t row_bytes = K / f.qk * f.bytes;
            std::vector<u8> raw((size_t)(N * row_bytes));
            std::vector<float> a((size_t)(M * (tr ? K : N))), c((size_t)(M * (tr ? N : K)));
            if (!read_all(raw.data(), raw.size()) || !read_all(a.data(), a.size() * 4)) return 2;
            const int64_t status = tg_matmul((int)fmt, raw.data(), row_bytes, N, K, a.data(),
                                             tr ? K : N, M, c.data(), tr ? N : K, (int)tr, (int)kernel);
            write_all(&status, 8);
            write_all(c.data(), c.size() * 4);
        } else {
            return 3;
        }
    }
    return 0;
}
