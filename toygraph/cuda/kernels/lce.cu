// The fused output head + cross-entropy (ops.linear_cross_entropy) has no kernel of its
// own: lowering.py turns it into launches over chunks of rows with one [rows, vocab]
// scratch block. Per chunk, tg_matmul (or a block-format tg_qmm_nt_*) fills the block
// with logits; forward, tg_ce_rows writes the chunk's row losses and tg_ce_reduce sums all
// rows at the end; backward, tg_ce_back turns the block into dlogits in place, tg_matmul
// (tg_qmm_nn_*) writes the chunk's dh rows and tg_matmul_acc adds its dw = dlogits^T h
// into dw, chunk after chunk. No float atomics: every result is deterministic.

// The weight every non-ignored row's dlogits is scaled by: g (sum) or g / n (mean; 0 when
// no label counts), computed as tg_ce_back does, so each chunk can run tg_ce_back with
// mean = 0 on this weight although the chunk sees only some of the labels.
extern "C" __global__ void tg_lce_grad_scale(float* gs, const int* labels, int N,
                                             const float* g, int mean) {
    __shared__ int ish[TG_THREADS];
    int n = tg_count_labels(labels, N, ish);
    if (threadIdx.x == 0)
        gs[0] = !mean ? g[0] : (n ? __fdiv_rn(g[0], (float)n) : __fmul_rn(0.0f, g[0]));
}
