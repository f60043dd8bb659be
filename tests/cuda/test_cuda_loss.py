"""The fused output head + cross-entropy on CUDA (ops/loss/, loss.cu and the matmul
kernels it runs per chunk): the launch sequence over row chunks replayed in numpy against
the numpy kernels (every reduction, ignored labels, chunk sizes, which gradients), a
block-format head read through the fused kernels, tensor-core matmuls in mixed precision,
the chunk size rule, and the compiled kernels' register use."""
import numpy as np
import pytest

from support.cudaemu import needs_nvrtc, qmm_format, resolve
import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.gguf import block_encode, blocks
from toygraph.ops.lowering import dispatch
from support.kernelsrc import KERNEL_NAMES
from toygraph.ops.gemm.cuda import TC_KERNELS
from toygraph.ops.lowering.format_kernels import FORMAT_KERNELS
from toygraph.precision import TENSOR_CORE_PRECISIONS as TC_PRECISIONS
from support.kernelsrc import OP_KERNELS
from toygraph.errors import CudaError
from toygraph.core.graph import Graph
from toygraph.ops import KERNELS as CPU_KERNELS
from toygraph.ops.loss import cuda as loss_ops
from support.ptxas import ARCHS  # noqa: E402


# --- fused output head + cross-entropy: launch sequence over row chunks, replayed in numpy ------
# One function (69 lines): one branch per kernel the lowering launches, as loss.cu has them.
def _lce_emulate(launch, mem):
    """Replay one launch of the linear_cross_entropy lowering with the kernel's semantics
    (f64), on buffers found by address (pointers into the middle of a buffer included)."""
    k, a = launch.kernel, launch.args
    sc = [x[0] if x.size == 1 else x for x in a]

    def view(addr, n, dtype=np.float64):
        arr, off = resolve(mem, int(addr))
        assert off + n <= arr.size, f"{k}: reads past the buffer"
        return arr[off:off + n]

    if k in ("tg_matmul", "tg_matmul_acc"):
        M, N, K, sam, sak, sbk, sbn, nbatch = (int(v) for v in sc[3:11])
        assert nbatch == 1 and int(a[11][0]) == 0 and launch.grid == (-(-N // 64), -(-M // 64), 1)
        A, _ = resolve(mem, int(sc[1]))
        B, _ = resolve(mem, int(sc[2]))
        oa, ob = resolve(mem, int(sc[1]))[1], resolve(mem, int(sc[2]))[1]
        m, kk, n = np.arange(M)[:, None], np.arange(K)[None, :], np.arange(N)[None, :]
        prod_ = A[oa + m * sam + kk * sak] @ B[ob + kk.T * sbk + n * sbn]
        out = view(sc[0], M * N)
        out[:] = (out if k == "tg_matmul_acc" else 0) + prod_.ravel()
    elif k in {*FORMAT_KERNELS["tg_qmm_nt_<fmt>"].values(),
               *FORMAT_KERNELS["tg_qmm_nn_<fmt>"].values()}:
        fmt, kind = qmm_format(k)
        out, x, w, M, N, K, rb = (int(v) for v in sc)
        raw, off = resolve(mem, w)
        assert off == 0
        elems, size = blocks.BLOCK[fmt]
        cols = rb // size * elems
        W = blocks.dequantize(raw, fmt, (raw.size // rb, cols)).astype(np.float64)
        B = W.T if kind == "nt" else W
        assert B.shape == (K, N)
        view(out, M * N)[:] = (view(x, M * K).reshape(M, K) @ B).ravel()
    elif k == "tg_ce_rows":
        rowloss, logits, labels, N, V = (int(v) for v in sc)
        z = view(logits, N * V).reshape(N, V)
        lab = view(labels, N).astype(np.int64)
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        view(rowloss, N)[:] = np.where(lab >= 0, lse - z[np.arange(N), np.maximum(lab, 0)], 0.0)
    elif k == "tg_ce_reduce":
        out, rowloss, labels, N, mean = (int(v) for v in sc)
        total, n = view(rowloss, N).sum(), int((view(labels, N) >= 0).sum())
        view(out, 1)[:] = total if not mean else (total / n if n else 0.0)
    elif k == "tg_lce_grad_scale":
        gs, labels, N, g, mean = (int(v) for v in sc)
        n, gv = int((view(labels, N) >= 0).sum()), view(g, 1)[0]
        view(gs, 1)[:] = gv if not mean else (gv / n if n else 0.0)
    elif k == "tg_ce_back":   # the kernel counts only the labels it is given
        out, logits, labels, g, N, V, mean = (int(v) for v in sc)
        lab = view(labels, N).astype(np.int64)
        n = int((lab >= 0).sum())
        w = view(g, 1)[0] if not mean else (view(g, 1)[0] / n if n else 0.0)
        z = view(logits, N * V).reshape(N, V)
        e = np.exp(z - z.max(1, keepdims=True))
        pr = e / e.sum(1, keepdims=True)
        valid = lab >= 0
        pr[np.arange(N)[valid], lab[valid]] -= 1.0
        view(out, N * V)[:] = (pr * np.where(valid, w, 0.0)[:, None]).ravel()
    elif k == "tg_ce_back_rows":   # row i weighted by its own g[i]
        out, logits, labels, g, N, V = (int(v) for v in sc)
        lab = view(labels, N).astype(np.int64)
        z = view(logits, N * V).reshape(N, V)
        e = np.exp(z - z.max(1, keepdims=True))
        pr = e / e.sum(1, keepdims=True)
        valid = lab >= 0
        pr[np.arange(N)[valid], lab[valid]] -= 1.0
        view(out, N * V)[:] = (pr * np.where(valid, view(g, N), 0.0)[:, None]).ravel()
    elif k == "tg_fill":
        view(sc[0], int(sc[1]))[:] = float(sc[2])
    else:
        raise AssertionError(f"no emulation for {k}")


def _lce_case(rng, N, D, V, labels, fmt=None):
    g = Graph()
    hv = rng.normal(size=(N, D))
    if fmt is None:
        wv = rng.normal(size=(V, D))
        w = g.const("w", wv)
        raw = None
    else:
        raw = block_encode.quantize(rng.normal(size=(V, D)).astype(np.float32), fmt)
        w = g.const("w", raw, shape=(V, D), storage=fmt)
        wv = blocks.dequantize(raw, fmt, (V, D)).astype(np.float64)
    h = g.const("h", hv)
    lab = g.input("lab", (N,), "i32")
    labv = np.asarray(labels, np.int64)
    return g, h, w, lab, hv, wv, labv, raw


def _lce_replay(node, vals, raw, scratch_nan=True):
    """Lower ``node`` (raw_consts = its head when ``raw`` is given), replay every launch and
    return (launches, the output as computed, scratch)."""
    addr = {s.id: (i + 1) << 26 for i, s in enumerate(node.srcs)}
    addr[node.id] = 60 << 26
    mem = {}
    for s, v in zip(node.srcs, vals):
        mem[addr[s.id]] = (blocks.as_bytes(raw).copy() if (raw is not None and s is node.srcs[1])
                           else np.asarray(v, np.float64).ravel().copy())
    mem[addr[node.id]] = np.full(max(node.size, 1), np.nan)
    scratch = 70 << 26
    n_scr = dispatch.scratch_bytes(node)
    assert n_scr % 256 == 0 and n_scr > 0
    mem[scratch] = np.full(n_scr // 4, np.nan if scratch_nan else 0.0)
    raw_consts = frozenset({node.srcs[1].id}) if raw is not None else frozenset()
    launches = dispatch.lower(node, lambda t: addr[t.id], scratch, raw_consts)
    for launch in launches:
        assert all(isinstance(x, np.ndarray) and x.dtype in (np.int32, np.uint64, np.float32)
                   for x in launch.args), launch.kernel
        assert launch.kernel in KERNEL_NAMES, launch.kernel
        _lce_emulate(launch, mem)
    return launches, mem[addr[node.id]], mem[scratch]


LCE_LOWERING_LABELS = {
    "some_ignored": lambda rng, N, V: np.where(rng.random(N) < 0.3, -1, rng.integers(0, V, N)),
    "all_ignored": lambda rng, N, V: np.full(N, -1),
}


@pytest.mark.parametrize("labels", list(LCE_LOWERING_LABELS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows,N", [(7, 30), (64, 150), (None, 40)])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)])
def test_linear_cross_entropy_launches_replayed_in_numpy_match_the_cpu_kernels(
        chunk_rows, N, reduction, labels, grads, monkeypatch):
    """Forward and backward launch sequences over row chunks (ragged last chunk, one chunk,
    dh and/or dw) give the numpy kernels' values; only the [rows, V] scratch block is used."""
    rng = np.random.default_rng(5)
    D, V = 12, 70
    if chunk_rows is not None:
        monkeypatch.setattr(loss_ops, "LCE_CHUNK_BYTES", 4 * V * chunk_rows)
    rows = loss_ops.lce_chunk_rows(N, V)
    assert rows == (chunk_rows or N)
    g, h, w, lab, hv, wv, labv, _ = _lce_case(rng, N, D, V,
                                              LCE_LOWERING_LABELS[labels](rng, N, V))
    loss = ops.linear_cross_entropy(h, w, lab, reduction=reduction)
    gout = g.const("gout", np.array(1.7))
    back = g.node("linear_cross_entropy_back", [h, w, lab, gout],
                  dict(reduction=reduction, grad_h=grads[0], grad_w=grads[1]))
    # the scratch is one chunk of logits (not N x V) plus the row losses / one weight
    assert dispatch.scratch_bytes(loss) == -(-4 * rows * V // 256) * 256 + -(-4 * N // 256) * 256
    assert dispatch.scratch_bytes(back) == -(-4 * rows * V // 256) * 256 + 256
    launches, got, _ = _lce_replay(loss, [hv, wv, labv], None)
    chunks = -(-N // rows)
    assert [l.kernel for l in launches] == ["tg_matmul", "tg_ce_rows"] * chunks + ["tg_ce_reduce"]
    assert set(l.kernel for l in launches) <= set(OP_KERNELS["linear_cross_entropy"])
    want = np.zeros(())
    CPU_KERNELS["linear_cross_entropy"](want, [hv, wv, labv], loss.attrs)
    np.testing.assert_allclose(got[0], want, rtol=1e-12, atol=1e-12)
    launches, got, _ = _lce_replay(back, [hv, wv, labv, 1.7], None)
    per_chunk = ["tg_matmul", "tg_ce_back"] + ["tg_matmul"] * grads[0] + ["tg_matmul_acc"] * grads[1]
    assert [l.kernel for l in launches] == (["tg_lce_grad_scale"] + ["tg_fill"] * grads[1]
                                            + per_chunk * chunks)
    assert set(l.kernel for l in launches) <= set(OP_KERNELS["linear_cross_entropy_back"])
    want = np.zeros(back.shape)
    CPU_KERNELS["linear_cross_entropy_back"](want, [hv, wv, labv, np.array(1.7)], back.attrs)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("labels", list(LCE_LOWERING_LABELS))
@pytest.mark.parametrize("chunk_rows,N", [(7, 30), (None, 40)])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)])
def test_per_row_linear_cross_entropy_launches_replayed_in_numpy_match_the_cpu_kernels(
        chunk_rows, N, labels, grads, monkeypatch):
    """reduction="none": forward writes each chunk's row losses straight into the output (no
    reduce, no row-loss scratch); backward weighs each chunk's rows by their own slice of g
    (tg_ce_back_rows, no grad scale). Values as the numpy kernels'."""
    rng = np.random.default_rng(8)
    D, V = 12, 70
    if chunk_rows is not None:
        monkeypatch.setattr(loss_ops, "LCE_CHUNK_BYTES", 4 * V * chunk_rows)
    rows = loss_ops.lce_chunk_rows(N, V)
    g, h, w, lab, hv, wv, labv, _ = _lce_case(rng, N, D, V,
                                              LCE_LOWERING_LABELS[labels](rng, N, V))
    loss = ops.linear_cross_entropy(h, w, lab, reduction="none")
    gv = rng.normal(size=N)
    back = g.node("linear_cross_entropy_back", [h, w, lab, g.const("gout", gv)],
                  dict(reduction="none", grad_h=grads[0], grad_w=grads[1]))
    assert dispatch.scratch_bytes(loss) == dispatch.scratch_bytes(back) == \
        -(-4 * rows * V // 256) * 256
    chunks = -(-N // rows)
    launches, got, _ = _lce_replay(loss, [hv, wv, labv], None)
    assert [l.kernel for l in launches] == ["tg_matmul", "tg_ce_rows"] * chunks
    want = np.zeros(N)
    CPU_KERNELS["linear_cross_entropy"](want, [hv, wv, labv], loss.attrs)
    assert not want[labv < 0].any()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    launches, got, _ = _lce_replay(back, [hv, wv, labv, gv], None)
    per_chunk = (["tg_matmul", "tg_ce_back_rows"] + ["tg_matmul"] * grads[0]
                 + ["tg_matmul_acc"] * grads[1])
    assert [l.kernel for l in launches] == ["tg_fill"] * grads[1] + per_chunk * chunks
    assert set(l.kernel for l in launches) <= set(OP_KERNELS["linear_cross_entropy_back"])
    want = np.zeros(back.shape)
    CPU_KERNELS["linear_cross_entropy_back"](want, [hv, wv, labv, gv], back.attrs)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("labels", ["some", "all"])
def test_per_row_linear_cross_entropy_on_the_host_device_matches_numpy(labels, monkeypatch):
    """The compiled kernels (TOYGRAPH_CUDA_DEVICE=host): row losses, dh and dw under a
    weighted sum, over 24-row chunks of 70 rows, against numpy; bit-identical twice."""
    from support.hostparity import REDUCTION, compare_op
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    monkeypatch.setattr(loss_ops, "LCE_CHUNK_BYTES", 4 * 300 * 24)
    N, D, V = 70, 40, 300

    def lab(g, rng):
        v = (np.where(rng.random(N) < 0.3, -1, rng.integers(0, V, N)) if labels == "some"
             else np.full(N, -1))
        return {g.input("lab", (N,), "i32"): v.astype(np.int32)}
    got = compare_op(lambda h, w, lb: ops.linear_cross_entropy(h, w, lb, reduction="none"),
                     [(N, D), (V, D)], REDUCTION, inputs_fn=lab)
    assert got[0].shape == (N,) and (labels == "some") == bool(got[0].any())


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "f16"])
def test_linear_cross_entropy_reads_a_block_format_head_through_the_fused_kernels(fmt,
                                                                                   monkeypatch):
    """A frozen quantized head (SmolLM2's tied Q8_0 token_embd): logits through the "nt"
    and dh through the "nn" qmatmul kernels, never an f32 copy; no dw is possible."""
    rng = np.random.default_rng(6)
    N, V = 37, 70
    D = 256 if blocks.BLOCK[fmt][0] == 256 else 64
    monkeypatch.setattr(loss_ops, "LCE_CHUNK_BYTES", 4 * V * 16)
    g, h, w, lab, hv, wv, labv, raw = _lce_case(
        rng, N, D, V, np.where(rng.random(N) < 0.3, -1, rng.integers(0, V, N)), fmt)
    loss = ops.linear_cross_entropy(h, w, lab, reduction="mean")
    back = ops.OPS["linear_cross_entropy"].grad(loss, g.const("gout", np.array(0.9)),
                                                [True, False, False])[0].srcs[0]
    assert back.shape == (N * D,)
    assert dispatch.reads_block_format(loss, 1) and dispatch.reads_block_format(back, 1)
    assert not dispatch.reads_block_format(loss, 0)
    for node, vals in ((loss, [hv, wv, labv]), (back, [hv, wv, labv, 0.9])):
        launches, got, _ = _lce_replay(node, vals, raw)
        mm = [l.kernel for l in launches if "mm" in l.kernel or l.kernel == "tg_matmul"]
        assert mm and set(mm) <= {FORMAT_KERNELS["tg_qmm_nt_<fmt>"][fmt],
                                  FORMAT_KERNELS["tg_qmm_nn_<fmt>"][fmt]}
        want = np.zeros(node.shape)
        CPU_KERNELS[node.op](want, [hv, wv, labv] + ([np.array(0.9)] if node is back else []),
                             node.attrs)
        np.testing.assert_allclose(got[:max(node.size, 1)].reshape(node.shape), want,
                                   rtol=1e-10, atol=1e-12)
    gw = g.node("linear_cross_entropy_back", [h, w, lab, g.const("g2", np.array(1.0))],
                dict(reduction="sum", grad_h=True, grad_w=True))
    assert not dispatch.reads_block_format(gw, 1)
    with pytest.raises(CudaError, match="block format"):
        dispatch.lower(gw, lambda t: 1 << 20, 1 << 30, frozenset({w.id}))


def test_linear_cross_entropy_at_tf32_uses_tensor_core_matmuls():
    """tf32: logits and dh on the tensor-core kernels (same arguments, 128-row tiles), dw
    accumulation stays tg_matmul_acc (f32; it has no tensor-core twin)."""
    rng = np.random.default_rng(7)
    g, h, w, lab, *_ = _lce_case(rng, 300, 64, 100, np.zeros(300))
    back = g.node("linear_cross_entropy_back", [h, w, lab, g.const("g", np.array(1.0))],
                  dict(reduction="sum", grad_h=True, grad_w=True))
    base = dispatch.lower(back, lambda t: (t.id + 1) << 24, 1 << 30)
    tc = dispatch.lower(back, lambda t: (t.id + 1) << 24, 1 << 30, precision="tf32")
    assert [l.kernel for l in base] == ["tg_lce_grad_scale", "tg_fill", "tg_matmul", "tg_ce_back",
                                        "tg_matmul", "tg_matmul_acc"]
    assert [l.kernel for l in tc] == [TC_KERNELS["tf32"]["matmul"] if k == "tg_matmul" else k
                                      for k in (l.kernel for l in base)]
    for b, t in zip(base, tc):
        assert [x.tolist() for x in b.args] == [x.tolist() for x in t.args]
        if t.kernel != b.kernel:
            M, N = int(b.args[3][0]), int(b.args[4][0])
            assert t.grid == (-(-N // 128), -(-M // 128), 1) and t.block == (256, 1, 1)


@pytest.mark.parametrize("storage", [None, "q8_0"])
def test_linear_cross_entropy_at_bf16_copies_the_head_once(storage, monkeypatch):
    """bf16: W's bf16 copy and its transpose made once for the node (decoded from a
    block-format head), then every chunk's logits and dh on tc_gemm.cu's GEMM reading them
    as they are; dw (full fine-tuning) stays tg_matmul_acc with its f32 arguments."""
    from support.cudaemu import qweight
    monkeypatch.setattr(loss_ops, "LCE_CHUNK_BYTES", 4 * 128 * 104)   # three chunks of 300
    rng = np.random.default_rng(7)   # (V a multiple of 8: W's transposed copy has no padding)
    g, h, w, lab, *_ = _lce_case(rng, 300, 64, 104, np.zeros(300))
    raw = frozenset()
    if storage:
        w = g.const("wq", qweight(rng, storage, 104, 64)[0], shape=(104, 64), storage=storage)
        raw = frozenset({w.id})
    back = g.node("linear_cross_entropy_back", [h, w, lab, g.const("g", np.array(1.0))],
                  dict(reduction="sum", grad_h=True, grad_w=not storage))
    ptr = lambda t: (t.id + 1) << 24   # noqa: E731
    tc = dispatch.lower(back, ptr, 1 << 30, raw, precision="bf16")
    kinds = [l.kernel for l in tc]
    head = [l for l in tc if int(l.args[1][0]) == ptr(w)]
    assert [l.kernel for l in head] == ([f"tg_tcg_deq_nt_{storage}", f"tg_tcg_deq_nn_{storage}"]
                                        if storage else ["tg_tcg_to_bf16"] * 2)
    assert kinds.count("tg_tcg_gemm_bf16") == 2 * 3 and not any("tc_matmul" in k or "qmm" in k
                                                                for k in kinds)
    gemms = [l for l in tc if l.kernel == "tg_tcg_gemm_bf16"]
    copies = {int(l.args[0][0]) for l in head}
    assert all(int(l.args[2][0]) in copies for l in gemms)    # B: the head's copies as they are
    assert kinds.count("tg_matmul_acc") == (0 if storage else 3)
def test_linear_cross_entropy_chunk_rows():
    assert loss_ops.lce_chunk_rows(8192, 49152) == 1344        # 256 MiB of SmolLM2 logits
    assert loss_ops.lce_chunk_rows(512, 49152) == 512
    assert loss_ops.lce_chunk_rows(10 ** 6, 10 ** 6) == 64     # 67 fit: whole tiles
    assert loss_ops.lce_chunk_rows(10 ** 6, 2 * 10 ** 6) == 33  # under a tile: as many fit
    assert loss_ops.lce_chunk_rows(5, 10 ** 9) == 1


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
def test_linear_cross_entropy_kernels_compile_without_spills(arch):
    """tg_matmul_acc (tg_matmul's tiles adding into out), tg_lce_grad_scale and
    tg_ce_back_rows compile for sm_80 and sm_90; the accumulating matmul costs no more
    registers than tg_matmul."""
    from support.ptxas import bf16_module
    cubin, usage = bf16_module(arch)
    names = {n for op in ("linear_cross_entropy", "linear_cross_entropy_back")
             for n in OP_KERNELS[op]}
    for name in names:
        assert name.encode() in cubin, name
    for name in names:
        u = usage[name]
        assert u["stack"] == u["spill_stores"] == u["spill_loads"] == 0, (name, u)
    assert usage["tg_matmul_acc"]["registers"] <= usage["tg_matmul"]["registers"] + 8


@pytest.mark.parametrize("fmt", [None, "q8_0", "q4_k"])
def test_the_bf16_head_tracks_numpy_on_the_host_executor(fmt, monkeypatch):
    """The fused head at bf16 (W's copies made once, every chunk on tc_gemm.cu) against
    numpy f32: the loss and dh within bf16's tolerance, over several chunks, a vocabulary
    that is no multiple of 8 (its transposed copy is re-copied per chunk) and labels -1."""
    from support.cudaemu import qweight
    from support.hostparity import MIXED_TOL, rel_err, rnd, run_phase
    from toygraph.core.autodiff import backward
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")
    monkeypatch.setattr(loss_ops, "LCE_CHUNK_BYTES", 4 * 64 * 300)
    N, D = 150, 256 if fmt == "q4_k" else 64
    V = 300 if fmt else 301
    rng = np.random.default_rng(11)
    labels = rng.integers(0, V, N).astype(np.int32)
    labels[::7] = -1

    def build():
        g = Graph()
        h = g.param("h", rnd(np.random.default_rng(1), N, D))
        if fmt:
            raw, _ = qweight(np.random.default_rng(2), fmt, V, D)
            w = g.const("w", raw, shape=(V, D), storage=fmt)
        else:
            w = g.const("w", rnd(np.random.default_rng(2), V, D, s=0.2))
        lab = g.input("labels", (N,), "i32")
        loss = g.output(ops.linear_cross_entropy(h, w, lab))
        return g, lab, [loss, g.output(backward(loss, [h])[h])]

    g, lab, fetch = build()
    got = run_phase(g, "cuda", {lab: labels}, "backward", fetch, "bf16")
    g2, lab2, fetch2 = build()
    want = run_phase(g2, "cpu", {lab2: labels}, "backward", fetch2)
    for name, a, b in zip(("loss", "dh"), got, want):
        assert rel_err(a, b) <= MIXED_TOL["bf16"], (name, rel_err(a, b))
