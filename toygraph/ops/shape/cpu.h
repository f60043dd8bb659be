// The shape family's replay kernels (replay.h): copy (permute, expand, and the reshapes,
// contiguous copies and unpacks the plan did not make views), copy_flat and reduce
// (sum_to, sum). Their layouts are elementwise/cpu.h's Walk, packed by shape/cpu.py's walk().

// out = src, n contiguous floats (a value another call wrote aside, moved to its place).
// p: out, src; i: n.
TG_REPLAY_KERNEL(copy_flat) {
    memcpy(n.p[0], n.p[1], (size_t)n.i[0] * 4);
    return 0;
}

// out = the source's elements as the walk reads them, 4 bytes each (f32, or i32 ids).
// p: out, src, walk (1 operand); i: n.
TG_REPLAY_KERNEL(copy) {
    uint32_t* out = (uint32_t*)n.p[0];
    const uint32_t* src = (const uint32_t*)n.p[1];
    const Walk wk{(const int64_t*)n.p[2]};
    const int64_t L = wk.row(), step = wk.step(0);
    walk_for(wk, [&](int64_t r, int64_t j0, int64_t j1) {
        uint32_t* o = out + r * L;
        const uint32_t* s = src + wk.at(0, r);
        if (step == 1) memcpy(o + j0, s + j0, (size_t)(j1 - j0) * 4);
        else if (step == 0)
            for (int64_t j = j0; j < j1; j++) o[j] = s[0];
        else
            for (int64_t j = j0; j < j1; j++) o[j] = s[j * step];
    });
    return 0;
}

// Columns of a reduction summed side by side: a run of contiguous kept elements shares
// the walk over the summed axes, each its own f64 sum.
static const int64_t kReduceRun = 256;

// out[o] = the sum over the summed axes of the source at o, in f64 in the summed axes'
// row-major order (whatever the threads), rounded once: at least as close to the true
// sum as numpy's f32 pairwise or running sums.
// p: out, src, layout (kept walk then summed walk, 1 operand each); i: out's size.
TG_REPLAY_KERNEL(reduce) {
    float* out = (float*)n.p[0];
    const float* x = (const float*)n.p[1];
    const int64_t* layout = (const int64_t*)n.p[2];
    const Walk kept{layout}, summed{layout + 1 + 2 * kWalkDims};
    const int64_t L = kept.row(), kstep = kept.step(0);
    const int64_t S = summed.row(), sstep = summed.step(0), srows = summed.rows();
    if (kstep == 1 && L > 1) {
        // Kept columns contiguous (a bias's gradient, GQA's groups): runs of columns,
        // every summed position added to each column of the run in turn.
        const int64_t runs = (L + kReduceRun - 1) / kReduceRun;
        replay_for(kept.rows() * runs, kReduceRun * S * srows, [&](int64_t t0, int64_t t1) {
            double acc[kReduceRun];
            for (int64_t t = t0; t < t1; t++) {
                const int64_t r = t / runs, j0 = (t % runs) * kReduceRun;
                const int64_t m = L - j0 < kReduceRun ? L - j0 : kReduceRun;
                const float* base = x + kept.at(0, r) + j0;
                for (int64_t j = 0; j < m; j++) acc[j] = 0.0;
                for (int64_t q = 0; q < srows; q++) {
                    const float* row = base + summed.at(0, q);
                    for (int64_t s = 0; s < S; s++)
                        for (int64_t j = 0; j < m; j++) acc[j] += (double)row[s * sstep + j];
                }
                for (int64_t j = 0; j < m; j++) out[r * L + j0 + j] = (float)acc[j];
            }
        });
        return 0;
    }
    // Otherwise one element at a time (a sum over the last axis reads a contiguous row).
    replay_for(n.i[0], S * srows, [&](int64_t o0, int64_t o1) {
        for (int64_t o = o0; o < o1; o++) {
            const float* base = x + kept.at(0, o / L) + (o % L) * kstep;
            double acc = 0.0;
            for (int64_t q = 0; q < srows; q++) {
                const float* row = base + summed.at(0, q);
                for (int64_t s = 0; s < S; s++) acc += (double)row[s * sstep];
            }
            out[o] = (float)acc;
        }
    });
    return 0;
}
