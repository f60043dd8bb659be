"""Helpers of the CUDA tests that need no GPU (tests/cuda/test_cuda_*.py): the
NVRTC skip marker and cache fixture, a numpy replay of the launches' index arithmetic
(``emulate``: the Strided walks, copies, gathers, reductions, tg_matmul; ``emulate_quant``:
the block-format kernels), a check of one node's launches against its numpy kernel, and the
tiny-model graphs and buffer plans the lowering tests share."""
import ctypes
import importlib
import shutil
import subprocess

import numpy as np
import pytest

import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
from toygraph import ops
from toygraph.gguf import block_encode, blocks
from toygraph.ops.lowering import dispatch
from toygraph.ops.lowering.format_kernels import FORMAT_KERNELS
from toygraph.core.graph import PHASES, Graph, topo_order
from toygraph.core.buffer_plan import plan_buffers
from toygraph.ops import KERNELS as CPU_KERNELS


def has_nvrtc() -> bool:
    try:
        importlib.import_module("cuda.bindings.nvrtc")
        return True
    except Exception:
        return False


needs_nvrtc = pytest.mark.skipif(not has_nvrtc(), reason="cuda.bindings.nvrtc not importable")


# --- lowering replayed in numpy ------------------------------------------------------------------
def walk(packed, n):
    nd = int(packed[0])
    dims, sa, sb = packed[1:1 + nd], packed[9:9 + nd], packed[17:17 + nd]
    i = np.arange(n)
    oa, ob = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for d in reversed(range(nd)):
        q = i % dims[d]
        i = i // dims[d]
        oa += q * sa[d]
        ob += q * sb[d]
    return oa, ob


def emulate(launch, mem):
    """Replay a launch's index arithmetic with numpy on flat arrays keyed by address."""
    k, a = launch.kernel, [x[0] if x.size == 1 else x for x in launch.args]
    if k in ("tg_binary", "tg_gather", "tg_copy"):
        out, n = mem[int(a[0])], int(a[3] if k == "tg_binary" else a[2])
        if k == "tg_copy":
            out[:] = mem[int(a[1])][:n]
        elif k == "tg_gather":
            out[:] = mem[int(a[1])][walk(a[3], n)[0]]
        else:
            oa, ob = walk(a[4], n)
            x, y = mem[int(a[1])][oa], mem[int(a[2])][ob]
            out[:] = [x + y, x - y, x * y][int(a[5])]
    elif k in ("tg_binary_vec", "tg_scale_vec"):   # flat: element i of each operand
        out, n = mem[int(a[0])], int(a[3] if k == "tg_binary_vec" else a[2])
        x = mem[int(a[1])][:n]
        out[:n] = x * a[3] if k == "tg_scale_vec" else \
            [x + mem[int(a[2])][:n], x - mem[int(a[2])][:n], x * mem[int(a[2])][:n]][int(a[4])]
    elif k in ("tg_reduce_block", "tg_reduce_thread"):
        out, x, n_out, kept, red, n_red = mem[int(a[0])], mem[int(a[1])], *a[2:]
        base, roff = walk(kept, int(n_out))[0], walk(red, int(n_red))[0]
        out[:] = x[base[:, None] + roff[None, :]].sum(axis=1)
    elif k == "tg_matmul":
        out, A, B = mem[int(a[0])], mem[int(a[1])], mem[int(a[2])]
        M, N, K, sam, sak, sbk, sbn, nbatch = (int(v) for v in a[3:11])
        oa, ob = walk(a[11], nbatch)
        m, kk, nn = np.arange(M)[:, None], np.arange(K)[None, :], np.arange(N)[None, :]
        for z in range(nbatch):
            am = A[oa[z] + m * sam + kk * sak]
            bm = B[ob[z] + kk.T * sbk + nn * sbn]
            out[z * M * N:(z + 1) * M * N] = (am @ bm).ravel()
    else:
        raise AssertionError(f"no emulation for {k}")


def check_lowering(node, srcs_values):
    mem, addr = {}, {}
    for t, v in zip(node.srcs, srcs_values):
        addr[t.id] = (t.id + 1) << 20
        mem[addr[t.id]] = np.asarray(v, np.float64).ravel()
    addr[node.id] = (node.id + 1) << 20
    mem[addr[node.id]] = np.zeros(node.size)
    for launch in dispatch.lower(node, lambda t: addr[t.id]):
        for x in launch.args:
            assert isinstance(x, np.ndarray) and x.dtype in (np.int32, np.uint64, np.float32,
                                                             np.float64)
        emulate(launch, mem)
    want = np.zeros(node.shape)
    CPU_KERNELS[node.op](want, [np.asarray(v, np.float64) for v in srcs_values], node.attrs)
    np.testing.assert_allclose(mem[addr[node.id]].reshape(node.shape), want, rtol=1e-12,
                               atol=1e-12)


def const_node(build, *shapes, seed=0):
    rng = np.random.default_rng(seed)
    g = Graph()
    vals = [rng.normal(size=s) for s in shapes]
    leaves = [g.const(f"c{i}", v) for i, v in enumerate(vals)]
    return build(*leaves), vals


BLOCK_FORMATS = blocks.BLOCK_FORMATS
#: The f32 kernels that read a weight in its block format (patterns of FORMAT_KERNELS): y =
#: x @ W^T ("nt"), dx = dy @ W ("nn"), get_rows from a block-format table ("rows").
QUANT_PATTERNS = {"nt": "tg_qmm_nt_<fmt>", "nn": "tg_qmm_nn_<fmt>", "rows": "tg_get_rows_<fmt>"}


def quant_kernels(fmt: str) -> dict[str, str]:
    """Format ``fmt``'s kernels of QUANT_PATTERNS, by kind."""
    return {kind: FORMAT_KERNELS[pattern][fmt] for kind, pattern in QUANT_PATTERNS.items()}


def qmm_format(kernel: str) -> tuple[str, str]:
    for fmt in BLOCK_FORMATS:
        for kind, name in quant_kernels(fmt).items():
            if name == kernel:
                return fmt, kind
    raise AssertionError(f"not a quantized kernel: {kernel}")


def emulate_quant(launch, mem, raw_rows):
    """Replay a fused kernel's host-computed arguments in numpy: the block-format weight is
    decoded from its bytes with the row length ``row_bytes`` implies."""
    fmt, kind = qmm_format(launch.kernel)
    a = [int(x[0]) for x in launch.args]
    elems, size = blocks.BLOCK[fmt]
    if kind == "rows":
        out, table, ids, n, D, rb = a
        assert rb % size == 0 and rb // size * elems == D
        W = blocks.dequantize(mem[table][:raw_rows * rb], fmt, (raw_rows, D))
        i = np.arange(n)
        mem[out][:n] = W[mem[ids].astype(np.int64)[i // D], i % D]
        return
    out, x, w, M, N, K, rb = a
    assert rb % size == 0
    cols = rb // size * elems
    W = blocks.dequantize(mem[w][:raw_rows * rb], fmt, (raw_rows, cols)).astype(np.float64)
    B = W.T if kind == "nt" else W
    assert B.shape == (K, N)
    mem[out][:M * N] = (mem[x][:M * K].reshape(M, K) @ B).ravel()


def qweight(rng, fmt, rows, cols):
    raw = block_encode.quantize(rng.normal(size=(rows, cols)).astype(np.float32), fmt)
    return raw, blocks.dequantize(raw, fmt, (rows, cols))


def training_plan(graph):
    """Session.realize's schedule, pins and buffer plan, without a backend."""
    done, order = set(), []
    for phase in PHASES:
        order = order + topo_order(graph.outputs[phase] + graph.effects[phase], done)
        done = {t.id for t in order}
    pinned = {t.id for t in order if t.role is not None}
    pinned |= {t.id for p in PHASES for t in graph.outputs[p]}
    outputs = [t for ts in graph.outputs.values() for t in ts]
    return order, pinned, plan_buffers(order, pinned, 4), outputs


def lora_graph(path, targets=("q", "v")):
    from toygraph.models.model import GGUFModel
    from toygraph.models.decoder import LoraConfig, WeightSource, build_decoder
    from toygraph.core.optimizer import build_training
    model = GGUFModel(path)
    g = Graph()
    net = build_decoder(g, model.config, WeightSource(model), batch=2, seq_len=8,
                        lora=LoraConfig(targets=targets, rank=4, alpha=8))
    lab = g.input("labels", (16,), "i32")
    loss = g.output(ops.cross_entropy(net.logits, lab, reduction="sum"))
    build_training(loss, net.params, count=g.output(ops.count_valid(lab)), max_norm=1.0)
    return g


def smollm2_training_graph(path, fused, batch, seq, build_training_too=True):
    from toygraph.models.model import GGUFModel
    from toygraph.models.decoder import (BuildOptions, LoraConfig, WeightSource, build_decoder,
                                         lm_head)
    from toygraph.core.optimizer import build_training
    model = GGUFModel(path)
    g = Graph()
    net = build_decoder(g, model.config, WeightSource(model), batch=batch, seq_len=seq,
                        lora=LoraConfig(targets=("q", "v"), rank=8, alpha=16),
                        options=BuildOptions(logits=False))
    lab = g.input("labels", (batch * seq,), "i32")
    loss = (ops.linear_cross_entropy(net.hidden, net.head, lab, reduction="sum") if fused else
            ops.cross_entropy(lm_head(net), lab, reduction="sum"))
    build_training(g.output(loss), net.params, count=g.output(ops.count_valid(lab)),
                   max_norm=1.0)
    return g


def resolve(mem, addr):
    """(array, element offset) of an f32 device address inside one of ``mem``'s buffers."""
    base = max(b for b in mem if b <= addr)
    assert (addr - base) % 4 == 0 and (addr - base) // 4 < mem[base].size, "address out of range"
    return mem[base], (addr - base) // 4


def block_weight_const(rng, fmt, rows, cols_k):
    """A random [rows, cols] const in block format ``fmt`` in a new graph, with cols a
    multiple of the format's block (``cols_k`` for the 256-element k-quants): (graph, the
    const, its block bytes, its values)."""
    elems = blocks.BLOCK[fmt][0]
    cols = max(2 * elems, 96) if elems < 256 else cols_k
    raw, wv = qweight(rng, fmt, rows, cols)
    g = Graph()
    return g, g.const("w", raw, shape=(rows, cols), storage=fmt), raw, wv


def host_library(tmp_path_factory, name, source, flags=()):
    """``source`` (C++) compiled by the host compiler into a shared library, loaded with
    ctypes; the test skips when there is no compiler."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    d = tmp_path_factory.mktemp(name)
    src, lib = d / f"{name}.cpp", d / f"{name}.so"
    src.write_text(source)
    subprocess.run([cxx, "-O1", *flags, "-shared", "-fPIC", "-o", str(lib), str(src)],
                   check=True, capture_output=True)
    return ctypes.CDLL(str(lib))
