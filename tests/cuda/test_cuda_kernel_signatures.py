"""Every launch the CUDA lowering produces against the parameter list of its kernel in the
CUDA sources: the number of arguments and each one's fixed-width type (a pointer is one
np.uint64, int one np.int32, float one np.float32, double one np.float64, the ``Strided``
struct of common.cuh 1 + 3 * TG_MAXD np.int32). The driver packs ``Launch.args`` by
position and cannot tell a missing or mistyped argument; this test can.

The launches come from lowering training graphs of the tiny models (LoRA on block-format
weights at every precision, the fused head, full fine-tuning), every block format's fused
kernels, every attention head-dim bound, and a small graph of the remaining ops; the test
checks that together they cover every op of ``ops.OPS`` and every kernel in the sources
(except the dequantizers, which backend.py launches at realize, not through a lowering).
"""
import re

import numpy as np
import pytest

from support.cudaemu import lora_graph, qweight, smollm2_training_graph, training_plan
from toygraph import ops
from toygraph.gguf import blocks
from toygraph.core.autodiff import backward
from toygraph.cuda import devmem
from toygraph.ops.lowering import dispatch
from toygraph.ops.lowering.constants import ATTN_HEAD_DIMS, LIST_TENSORS, TCA_HEAD_DIMS
from support.kernelsrc import FAMILIES, KERNEL_NAMES, TC_FAMILIES, TC_KERNEL_NAMES
from toygraph.precision import TENSOR_CORE_PRECISIONS as TC_PRECISIONS
from toygraph.ops.lowering.sources import expand_block_formats, module_source
from toygraph.ops.lowering.launch import MAXD, Launch, f32_arg, f64_arg, i32_arg, ptr_arg, strided
from toygraph.core.buffer_plan import plan_buffers
from toygraph.core.graph import Graph, topo_order
from toygraph.ops.flash_attention import backward_node

PRECISIONS = ("f32",) + TC_PRECISIONS
BLOCK_FORMATS = blocks.BLOCK_FORMATS

#: C parameter type -> (numpy dtype, number of elements) of its packed launch argument.
SCALAR_TYPES = {"int": (np.int32, 1), "float": (np.float32, 1), "double": (np.float64, 1),
                "Strided": (np.int32, 1 + 3 * MAXD),
                # update.cu: 4 pointer arrays, n, scale, block_start[T + 1] and count
                "TgTensorList": (np.uint8, 44 * LIST_TENSORS + 8)}
POINTER = (np.uint64, 1)


# --- the parameter lists, parsed from the sources --------------------------------------------
def _object_macros(src: str) -> dict[str, str]:
    """``#define NAME body`` (continuation lines joined) for macros without arguments."""
    joined = src.replace("\\\n", " ")
    return {m[1]: m[2].strip() for m in re.finditer(r"^\s*#define\s+(\w+)[ \t]+(.*)$", joined,
                                                    re.M)}


def kernel_signatures(src: str) -> dict[str, list[str]]:
    """kernel name -> its parameter types, e.g. ``["float*", "int", "Strided"]``; the
    kernels TG_BLOCK_FORMATS defines per block format read from its expansion."""
    src = expand_block_formats(src)
    macros = _object_macros(src)
    sigs = {}
    pattern = (r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?'
               r'(\w+)\s*\(([^)]*)\)')
    for name, params in re.findall(pattern, src):
        params = macros.get(params.strip(), params)
        sigs[name] = [_param_type(decl) for decl in params.split(",") if decl.strip()]
    return sigs


def _param_type(decl: str) -> str:
    """The type of one declaration (``const float *q`` -> ``float*``), qualifiers dropped."""
    words = decl.replace("*", " * ").split()
    stars = words.count("*")
    base = [w for w in words[:-1] if w not in ("const", "*", "__restrict__")]
    return " ".join(base) + "*" * stars


SIGNATURES = kernel_signatures(module_source(FAMILIES + TC_FAMILIES))


def mismatches(launch: Launch, signatures=SIGNATURES) -> list[str]:
    """What is wrong with ``launch.args`` for its kernel's parameter list (empty: nothing)."""
    params = signatures.get(launch.kernel)
    if params is None:
        return [f"{launch.kernel}: no such kernel in the sources"]
    if len(launch.args) != len(params):
        return [f"{launch.kernel}: {len(launch.args)} arguments for {len(params)} parameters "
                f"({', '.join(params)})"]
    problems = []
    for i, (arg, ctype) in enumerate(zip(launch.args, params)):
        want = POINTER if ctype.endswith("*") else SCALAR_TYPES.get(ctype)
        if want is None:
            problems.append(f"{launch.kernel} parameter {i}: no packing rule for C type {ctype}")
        elif not (isinstance(arg, np.ndarray) and arg.dtype == want[0] and arg.size == want[1]):
            got = (f"{arg.dtype}[{arg.size}]" if isinstance(arg, np.ndarray)
                   else type(arg).__name__)
            problems.append(f"{launch.kernel} parameter {i} ({ctype}): got {got}, want "
                            f"{np.dtype(want[0])}[{want[1]}]")
    return problems


# --- the launches --------------------------------------------------------------------------
def _lower_all(nodes, raw=frozenset(), precisions=PRECISIONS, storage=None, offsets=None):
    """(op, launch) for every non-leaf node of ``nodes`` at every precision (kernel launches
    only: all_reduce's Collective step is no kernel; tests/foundation/test_distributed.py covers it);
    ``storage``: a bf16 plan's (cuda/bf16_storage.py) bf16 tensors and absorbed products,
    ``offsets`` the arena offsets of the buffer plan made with it (:func:`_arena`): as on the
    device, a view of a bf16 buffer then has its source's address and launches nothing.
    Every other tensor gets an address of its own."""
    out = []
    bf16, absorbed = storage or (frozenset(), {})
    offsets = offsets or {}

    def ptr(t):
        return (1 << 44) + offsets[t.id] if t.id in offsets else (t.id + 1) << 20
    for node in nodes:
        if node.op is None:
            continue
        for prec in precisions:
            out += [(node.op, l) for l in dispatch.lower(node, ptr, 1 << 40, raw, prec, bf16,
                                                         absorbed)
                    if isinstance(l, Launch)]
    return out


def _arena(order, pinned, storage):
    """The arena offsets of the buffer plan of schedule ``order`` with ``storage``."""
    return plan_buffers(order, pinned, 4, storage=storage).offsets


def _k_major_launches():
    """A product of two bf16-kept operands both read k-major (glu outputs, k = rows):
    tg_tcg_gemm_tab_bf16, which the tiny models' plans do not reach."""
    from toygraph.cuda.bf16_storage import plan_storage
    g = Graph()
    act, y = (ops.glu(g.param(n + "g", np.ones((40, 24))), g.param(n + "u", np.ones((40, 24))),
                      "silu") for n in "ay")
    z = g.output(ops.matmul(act, y, trans_a=True))
    order, pinned, _, _ = training_plan(g)
    storage = plan_storage(order, pinned, "bf16")
    return _lower_all([z], frozenset(), ("bf16",), storage, _arena(order, pinned, storage))


def _model_launches(path, **lora_graph_kw):
    """Every precision as the backends lower it, and bf16 again with its storage plan (bf16
    activations, the dual GEMM)."""
    from toygraph.cuda.bf16_storage import plan_storage
    order, pinned, plan, outputs = training_plan(lora_graph(path, **lora_graph_kw))
    raw = frozenset(devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=True)
                    .raw_consts)
    storage = plan_storage(order, pinned, "bf16")
    return _lower_all(order, raw) + _lower_all(order, raw, ("bf16",), storage,
                                               _arena(order, pinned, storage))


def _full_finetune_launches(path):
    from toygraph.models.model import GGUFModel
    from toygraph.models.decoder import BuildOptions, WeightSource, build_decoder
    from toygraph.core.optimizer import build_training
    model = GGUFModel(path)
    g = Graph()
    net = build_decoder(g, model.config, WeightSource(model, "finetune"), batch=1, seq_len=4,
                        options=BuildOptions(logits=False))
    lab = g.input("labels", (4,), "i32")   # the fused head, trained: tg_matmul_acc
    loss = ops.linear_cross_entropy(net.hidden, net.head, lab, reduction="sum")
    build_training(g.output(loss), net.params)
    return _lower_all(training_plan(g)[0])


def _block_format_launches(rng):
    """The fused kernels of every block format: y = x @ W^T, dx = dy @ W, get_rows; and at
    bf16 the decoded-once copies of a large W (tc_gemm.cu)."""
    out = []
    for fmt in BLOCK_FORMATS:
        rows, cols = 8, blocks.BLOCK[fmt][0]
        g = Graph()
        w = g.const("w", qweight(rng, fmt, rows, cols)[0], shape=(rows, cols), storage=fmt)
        nodes = [w, ops.matmul(g.const("x", np.ones((3, cols))), w, trans_b=True),
                 ops.matmul(g.const("dy", np.ones((3, rows))), w),
                 ops.get_rows(w, g.input("ids", (5,), "i32"))]
        out += _lower_all(nodes, frozenset({w.id}))
        # a product large enough that bf16 decodes W once for tc_gemm.cu (tg_tcg_deq_*)
        big = g.const("big", None, shape=(4096, 4096), storage=fmt)
        x = g.input("xbig", (4096, 4096))
        out += _lower_all([ops.matmul(x, big, trans_b=True), ops.matmul(x, big)],
                          frozenset({big.id}), precisions=("bf16",))
    return out


def _expert_launches(rng):
    """The mixture-of-experts ops (ops/experts/, and gpt-oss's swiglu_oai) forward and
    backward with f32 expert weights trained (their dW), and every block format's grouped
    GEMMs (nt and nn)."""
    g = Graph()
    x, w = g.param("x", np.ones((3, 32))), g.param("w", np.ones((4, 5, 32)))
    logits = g.param("logits", np.ones((3, 4)))
    ids = ops.topk(logits, 2)
    y = ops.expert_matmul(x, w, ops.group_by_expert(ids, 4))
    y = ops.swiglu_oai(y, y)                                 # gpt-oss's expert activation
    loss = ops.sum(ops.mul(y, ops.take_along(logits, ids).reshape(3, 2, 1)))
    grads = backward(loss, [x, w, logits])
    out = _lower_all(topo_order([loss, *grads.values()]), precisions=("f32",))
    for fmt in BLOCK_FORMATS:
        cols = blocks.BLOCK[fmt][0]
        g = Graph()
        w = g.const("w", qweight(rng, fmt, 4 * 5, cols)[0], shape=(4, 5, cols), storage=fmt)
        routes = ops.group_by_expert(g.input("ids", (3, 2), "i32"), 4)
        nodes = [ops.expert_matmul(g.const("x", np.ones((3, cols))), w, routes),
                 ops.expert_matmul(g.const("dy", np.ones((3, 2, 5))), w, routes, trans_b=False)]
        out += _lower_all(nodes, frozenset({w.id}), precisions=("f32",))
    return out


def _attention_launches():
    out = []

    def forward_backward(hd, layout, sinks=False):
        """attention of 2 heads of 5 tokens in ``layout`` and its backward."""
        g = Graph()
        q, k, v = (g.const(n, np.ones((1, 5, 2, hd) if layout == "bthd" else (1, 2, 5, hd)))
                   for n in "qkv")
        sk = g.const("sinks", np.ones(2)) if sinks else None   # gpt-oss: pointer and kernel
        att = ops.attention(q, k, v, scale=hd ** -0.5, sinks=sk, layout=layout).srcs[0]
        return [att, backward_node(att, g.const("g", np.ones(q.shape)))]
    for layout in ("bhtd", "bthd"):
        for hd in ATTN_HEAD_DIMS:
            for sinks in (False, True):
                out += _lower_all(forward_backward(hd, layout, sinks), precisions=("f32",))
        for hd in TCA_HEAD_DIMS:                  # bf16: the tensor-core kernels
            out += _lower_all(forward_backward(hd, layout, True), precisions=("bf16",))
    return out


def _small_op_launches():
    """The ops no model graph above uses, forward and backward."""
    g = Graph()
    x = g.param("x", np.ones((2, 3, 4)))
    b = g.param("b", np.ones((4,)))
    y = ops.softmax(ops.silu(ops.gelu(ops.sub(ops.scale(x, 0.5), b))), scale=2.0, causal=False)
    y = ops.sigmoid(ops.softcap(y, 30.0))
    y = ops.contiguous(ops.permute(y, (1, 0, 2))).reshape(3, 8)
    packed = g.const("packed", np.ones(40))
    loss = ops.sum(ops.mul(y, ops.unpack(packed, 16, (3, 8))))
    grads = backward(loss, [x, b])
    acc_state = g.state("acc", (4,), kind="grad")
    acc = ops.accumulate(acc_state, grads[b])
    summed = ops.all_reduce([g.state("count", (), kind="count"), acc_state], ranks=2)
    conv = ops.narrow(ops.causal_conv1d(g.param("cx", np.ones((1, 3, 2))), g.param("cw", np.ones((2, 4)))), 1, 1)
    dq, dk_, dv_ = (g.param(f"d{n}", np.ones((1, 2, 1, 3))) for n in "qkv")
    gb = [g.param(f"d{n}", np.ones((1, 2, 1))) for n in "gb"]
    delta = ops.delta_rule(dq, dk_, dv_, *gb)
    _, state = ops.delta_rule(dq, dk_, dv_, *gb, state=g.const("s0", np.zeros((1, 1, 3, 3))))
    _, step = ops.delta_rule(*(g.param(f"s{n}", np.ones(s)) for n, s in zip(
        "qkvgb", [(1, 1, 1, 3)] * 3 + [(1, 1, 1)] * 2)), state=state)   # decoding: step-wise
    loss = ops.add(loss, ops.add(ops.sum(conv), ops.sum(delta)))
    grads = backward(loss, [x, b] + [n for n in g.nodes if n.role == "param" and n.name in
                                      ("cx", "cw", "dq", "dk", "dv", "dg", "db")])
    cached = ops.cache_write(g.state("cache", (2, 6, 4), kind="cache"),
                             g.const("new", np.ones((2, 1, 4))), g.input("start", (1,), "i32"))
    row_norm = ops.inv_row_norm(x)   # DoRA's detached norm: no backward
    dropped = ops.dropout(x, g.input("hp", (9,)), p=0.1, seed=1, salt=2)   # LoRA dropout
    # scale's scalar kernel runs only where a buffer is not 16-byte aligned
    unaligned = [("scale", l) for l in dispatch.lower(ops.scale(x, 3.0),
                                                      lambda t: 4 + ((t.id + 1) << 20))]
    return unaligned + _lower_all(topo_order([loss, *grads.values(), acc, summed, cached, state,
                                              step, row_norm, dropped]),
                                  precisions=("f32",))


def _preference_op_launches():
    """The preference-loss ops (ops/preference/), and the fused head's per-row log-probs
    (linear_cross_entropy "none") the recipes use instead on CUDA, forward and backward."""
    g = Graph()
    x = g.param("x", np.ones((3, 5)))
    lab = g.input("lab", (3,), "i32")
    loss = ops.sum(ops.log1mexp(ops.log_sigmoid(ops.token_logprobs(x, lab))))
    h = g.param("h", np.ones((3, 4)))
    rows = ops.linear_cross_entropy(h, g.const("w", np.ones((5, 4))), lab, reduction="none")
    loss = ops.add(loss, ops.sum(rows))
    grads = backward(loss, [x, h])
    return _lower_all(topo_order([loss, grads[x], grads[h]]), precisions=("f32",))


def _policy_op_launches():
    """The policy-gradient loss ops (ops/policy/, GRPO), forward and backward."""
    g = Graph()
    x = g.param("x", np.ones((3, 5)))
    c = g.input("c", (3, 5))
    loss = ops.sum(ops.add(ops.clipped_surrogate(x, c, c, 0.2, 0.28), ops.kl_penalty(x, c)))
    grads = backward(loss, [x])
    return _lower_all(topo_order([loss, grads[x]]), precisions=("f32",))


@pytest.fixture(scope="module")
def launches(tiny_llama, tiny_qwen2, tiny_llama_kquant):
    rng = np.random.default_rng(0)
    targets = ("q", "k", "v", "o", "gate", "up", "down")
    out = []
    for path in (tiny_llama, tiny_qwen2, tiny_llama_kquant):
        out += _model_launches(path, targets=targets)
    for fused in (True, False):
        g = smollm2_training_graph(tiny_llama_kquant, fused=fused, batch=2, seq=8)
        order, pinned, plan, outputs = training_plan(g)
        raw = frozenset(devmem.plan_device_memory(order, plan, pinned, outputs, qmatmul=True)
                        .raw_consts)
        out += _lower_all(order, raw)
    out += _full_finetune_launches(tiny_qwen2)
    out += _block_format_launches(rng) + _attention_launches() + _small_op_launches()
    out += _k_major_launches()
    out += _preference_op_launches() + _expert_launches(rng) + _policy_op_launches()
    return out


# --- the tests -----------------------------------------------------------------------------
def test_every_kernel_in_the_sources_is_parsed():
    assert set(SIGNATURES) == set(KERNEL_NAMES) | set(TC_KERNEL_NAMES)
    assert SIGNATURES["tg_binary"] == ["float*", "float*", "float*", "int", "Strided", "int"]
    assert SIGNATURES["tg_adamw_list"] == ["TgTensorList", "float*", "float*", "float*", "double"]
    dkdv = SIGNATURES["tg_attn_bwd_dkdv_64"]                      # through TG_ATTN_DKDV_ARGS
    assert len(dkdv) > 10 and dkdv[:2] == ["float*", "float*"] and dkdv[-1] == "int"
    assert SIGNATURES["tg_tc_matmul_bf16"] == SIGNATURES["tg_matmul"]
    assert SIGNATURES["tg_matmul"][-1] == "Strided"               # through TG_MM_ARGS
    assert SIGNATURES["tg_qmm_nt_q4_k"] == ["float*", "float*", "unsigned char*"] + ["int"] * 4


def test_the_launches_cover_every_op_and_kernel(launches):
    assert {op for op, _ in launches} == set(ops.OPS)
    launched = {l.kernel for _, l in launches}
    dequantizers = {k for k in SIGNATURES if k.startswith("tg_deq_")}  # backend.py's realize
    assert launched == set(SIGNATURES) - dequantizers


def test_every_launch_matches_its_kernel_signature(launches):
    problems = sorted({m for _, launch in launches for m in mismatches(launch)})
    assert not problems, "\n".join(problems)


def test_a_wrong_launch_is_caught():
    good = Launch("tg_scale", (1, 1, 1), [ptr_arg(1 << 20), ptr_arg(2 << 20), i32_arg(8),
                                          f32_arg(0.5)])
    assert mismatches(good) == []
    bad = {
        "missing": (good.args[:3], "3 arguments for 4 parameters"),
        "extra": (good.args + [i32_arg(0)], "5 arguments for 4 parameters"),
        "f64 for float": (good.args[:3] + [f64_arg(0.5)],
                          "parameter 3 .float.: got float64.1., want float32.1."),
        "python int": (good.args[:2] + [8, good.args[3]], "parameter 2 .int.: got int, want"),
        "int for pointer": (good.args[:1] + [i32_arg(7)] + good.args[2:],
                            "parameter 1 .float..: got int32.1., want uint64.1."),
    }
    for what, (args, message) in bad.items():
        found = mismatches(Launch("tg_scale", (1, 1, 1), args))
        assert len(found) == 1 and re.search(message, found[0]), (what, found)
    short = strided([2, 3], [3, 1])[:-1]                         # a Strided struct too short
    gather = Launch("tg_gather", (1, 1, 1), [ptr_arg(1), ptr_arg(2), i32_arg(6), short])
    assert mismatches(gather) == [f"tg_gather parameter 3 (Strided): got int32[{3 * MAXD}], "
                                  f"want int32[{3 * MAXD + 1}]"]
    assert mismatches(Launch("tg_nope", (1, 1, 1), [])) == ["tg_nope: no such kernel in the "
                                                            "sources"]


def test_a_type_without_a_packing_rule_is_reported():
    sigs = kernel_signatures('extern "C" __global__ void k(float* a, unsigned short n) {}')
    assert sigs == {"k": ["float*", "unsigned short"]}
    assert mismatches(Launch("k", (1, 1, 1), [ptr_arg(1), i32_arg(1)]), sigs) == [
        "k parameter 1: no packing rule for C type unsigned short"]
