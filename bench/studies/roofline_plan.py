"""toygraph's side of the cost model (bench/studies/roofline.py): the CUDA plan of one LoRA training
step, lowered to its kernel launches without a GPU, and what each launch does.

``plan_launches(config)`` builds the step exactly as a LoRA run on ``backend="cuda"`` does
(recipes.LoRA's graph, build_training's backward, clip and AdamW), orders and plans it as
Session.realize does, then asks the CUDA lowering (toygraph.ops.lowering.dispatch.lower) for
every node's launches, with fake device addresses: nothing is compiled, allocated or run.
The model needs shapes only, so no GGUF is read: ``shape_model`` makes a llama config and
weight records (block format, no bytes) with the config's dimensions.

``launch_cost(node, launch)`` reads each launch's own shapes (a GEMM's M, N, K and batch from
its arguments, by the names the kernel's parameter list gives them; attention's tiles from
its kernel's head-dim bound and the node's shapes) and returns a :class:`Cost`: FLOPs by
unit, global-memory bytes, the kernel class. A kernel this file has no rule for is an error
naming it: a new kernel needs its cost written down here; tests/bench/test_roofline.py checks
every rule against the kernels the sources define.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple
from math import ceil

SHAPES = {  # the configs' model dimensions (bench/random_model.py's, which bench_lora uses)
    "smollm2": dict(n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152,
                    n_ctx=8192, rope_base=100000.0),
    "llama1b": dict(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, n_vocab=32000,
                    n_ctx=4096, rope_base=10000.0),
}


@dataclass
class Cost:
    """One launch: ``kind`` its class; FLOPs issued on tensor cores (``tc``: bf16 or tf32 per
    ``tc_type``), on CUDA-core f32 pipes (``fma``, 2 per FMA), special-function ops (``sfu``:
    exp, rsqrt, sin...); ``bytes`` global memory read + written, each tensor once (the
    compulsory traffic; re-reads are assumed to hit L2); ``useful`` the FLOPs of the math
    (2*M*N*K for a GEMM) where the kernel issues more (tile padding); for the
    tensor-core tile kernels, ``blocks`` tiles of ``tile_flops`` each."""
    kernel: str
    kind: str
    tc: float = 0.0
    fma: float = 0.0
    sfu: float = 0.0
    bytes: float = 0.0
    useful: float = 0.0
    tc_type: str = "bf16"
    blocks: int = 0
    tile_flops: float = 0.0
    node: str = ""

    @property
    def flops(self) -> float:
        return self.tc + self.fma


# --- the model and the plan ----------------------------------------------------------------------
def shape_model(dims: dict, wtype: str):
    """(ModelConfig, a GGUFModel stand-in) for a llama of ``dims`` whose matrices are stored
    as ``wtype``: the config comes from the same metadata keys a GGUF would carry."""
    from toygraph.models.config import read_config, tensor_shapes
    from toygraph.gguf.file import WeightTensor

    a, d = "llama", dims
    meta = {"general.architecture": a, f"{a}.context_length": d["n_ctx"],
            f"{a}.embedding_length": d["n_embd"], f"{a}.block_count": d["n_layer"],
            f"{a}.feed_forward_length": d["n_ff"], f"{a}.attention.head_count": d["n_head"],
            f"{a}.attention.head_count_kv": d["n_head_kv"], f"{a}.rope.freq_base": d["rope_base"],
            f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
            f"{a}.rope.dimension_count": d["n_embd"] // d["n_head"], f"{a}.vocab_size": d["n_vocab"]}
    index = {"token_embd.weight": (d["n_vocab"], d["n_embd"])}
    index.update({f"blk.{i}.attn_norm.weight": (d["n_embd"],) for i in range(d["n_layer"])})
    cfg = read_config(meta.get, list(meta), index, "<roofline shapes>")
    shapes = tensor_shapes(cfg)

    class ShapeModel:
        def tensor_names(self):
            return list(shapes)

        def tensor(self, name):
            shape = shapes[name]
            return WeightTensor(name, wtype if len(shape) >= 2 else "f32", shape, None)
    return cfg, ShapeModel()


def plan_launches(dims: dict, *, batch: int, seq: int, wtype: str, precision: str,
                  targets=("q", "k", "v", "o", "gate", "up", "down"), rank: int = 16,
                  alpha: float = 32, clip: float = 1.0, bf16_activations: bool = True):
    """[(node, Launch)] of one LoRA step on CUDA, in launch order, the config, and how the
    plan stores tensors (:class:`Stored`); ``bf16_activations`` False models
    TOYGRAPH_CUDA_BF16_ACTIVATIONS=0."""
    import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
    from toygraph.core.optimizer import build_training
    from toygraph.core.session import Session
    from toygraph.cuda.devmem import plan_device_memory
    from toygraph.ops.lowering.dispatch import lower
    from toygraph.cuda.bf16_storage import plan_storage
    from toygraph.recipes import LoRA, RecipeOptions

    class NoDevice:
        itemsize = 4          # the CUDA backend's f32 buffers

        def storage(self, schedule, pinned):   # as CudaBackend's
            st = plan_storage(schedule, pinned, precision)
            return st if bf16_activations else st._replace(bf16=frozenset())

        def realize(self, *args):
            pass

    class PlanSession(Session):  # Session.realize's ordering and buffer plan, no backend
        def __init__(self, graph):
            self.graph, self.backend_name, self.backend = graph, "cuda", NoDevice()
            self.realized, self.plan, self.base_memory = False, None, None

    cfg, model = shape_model(dims, wtype)
    recipe = LoRA(targets=tuple(targets), rank=rank, alpha=alpha)
    opts = RecipeOptions(seq_len=seq, batch=batch, backend="cuda", precision=precision, clip=clip)
    recipe.build_graph(model, cfg, opts)   # as Recipe.realize, up to its Session
    build_training(recipe.loss, recipe.net.params, count=recipe.count, max_norm=opts.clip)
    sess = PlanSession(recipe.graph)
    sess.realize()
    schedule = sess.schedules["step"]
    outputs = [t for ts in recipe.graph.outputs.values() for t in ts]
    mem = plan_device_memory(schedule, sess.plan, sess.pinned, outputs, qmatmul=True)
    stored = Stored(frozenset(mem.raw_consts), sess.plan.bf16)
    # Addresses: launches need them and the model never dereferences them, but an arena
    # tensor's must be its plan offset, so the views the plan makes launch nothing.
    arena, pinned_at = 1 << 40, 1 << 50

    def ptr(t):
        off = sess.plan.offsets.get(t.id)
        return arena + off if off is not None else pinned_at + (t.id << 24)
    out = []
    for t in schedule:
        if t.op is not None:
            scratch = 1 << 32 if t.id in mem.scratch else 0
            out += [(t, l) for l in lower(t, ptr, scratch, stored.raw, precision,
                                          stored.half, sess.plan.absorbed)]
    return out, cfg, stored


# --- per launch ------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def kernel_params() -> dict[str, tuple[str, ...]]:
    """kernel name -> its parameter names, parsed from the kernel sources (the bf16 module:
    every kernel; the per-format kernels of its TG_BLOCK_FORMATS lines expanded), so a cost
    rule reads a launch's arguments by the name the kernel gives them: a parameter renamed
    or moved is an error or is followed, never a wrong count."""
    import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
    from toygraph.ops.lowering.sources import backend_source, expand_block_formats
    src = expand_block_formats(backend_source("bf16"))
    macros = {m[1]: m[2].strip() for m in re.finditer(r"^\s*#define\s+(\w+)[ \t]+(.*)$",
                                                      src.replace("\\\n", " "), re.M)}
    decl = (r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?'
            r'(\w+)\s*\(([^)]*)\)')
    return {name: tuple(re.findall(r"\w+", d)[-1] for d in macros.get(ps.strip(), ps).split(",")
                        if d.strip())
            for name, ps in re.findall(decl, src)}


def _raw(launch, name: str):
    """The argument ``launch`` passes for its kernel's parameter ``name`` (a numpy array)."""
    params = kernel_params().get(launch.kernel, ())
    if name not in params:
        raise ValueError(f"bench/studies/roofline_plan.py reads parameter {name!r} of {launch.kernel}, "
                         f"whose parameters are {params}: update its cost rule")
    if len(launch.args) <= params.index(name):
        raise ValueError(f"a {launch.kernel} launch with {len(launch.args)} arguments for "
                         f"{len(params)} parameters has no {name!r}")
    return launch.args[params.index(name)]


def _arg(launch, name: str) -> int:
    return int(_raw(launch, name)[0])


class Stored(NamedTuple):
    """How the plan stores tensors besides f32: ``raw`` the consts kept in their block
    format, ``half`` the activations kept in bf16 (cuda/bf16_storage.py)."""
    raw: frozenset = frozenset()
    half: frozenset = frozenset()


def _nbytes(t, stored: Stored) -> int:
    """Bytes of tensor ``t`` on the device: block bytes for a const kept in its format, 2 an
    element for an activation kept in bf16."""
    if t.id in stored.raw:
        from toygraph.gguf import blocks
        return blocks.nbytes(t.storage, t.shape)
    return (2 if t.id in stored.half else 4) * max(t.size, 1)


def _gemm(node, launch, stored) -> Cost:
    """tg_tc_matmul_* / tg_tc_qmm_* / tg_matmul(_acc) / tg_qmm_*: M, N, K from the arguments;
    the tensor-core kernels issue whole 128 x 128 x BK tiles (zeros past the edges)."""
    from toygraph.ops.lowering.constants import MM_BM, MM_BK, TC_BM, TC_BF16_BK, TC_TF32_BK
    k = launch.kernel
    M, N, K = _arg(launch, "M"), _arg(launch, "N"), _arg(launch, "K")
    quant = "qmm" in k
    nbatch = 1 if quant else _arg(launch, "nbatch")
    if quant:   # B is the block-format weight: all its rows, row_bytes each
        b_bytes = _arg(launch, "row_bytes") * (N if "_nt_" in k else K)
    elif node.op in ("matmul", "matmul_add"):
        b_bytes = 4 * node.srcs[-1].size
    else:
        b_bytes = 4 * K * N
    c_bytes = 4 * M * N * nbatch * (2 if k.endswith("_acc") else 1)
    useful = 2.0 * M * N * K * nbatch
    cost = Cost(k, "", bytes=4 * M * K * nbatch + b_bytes + c_bytes, useful=useful)
    if k.startswith("tg_tc_"):
        tc_type = "tf32" if k.endswith("_tf32") else "bf16"
        bk = TC_TF32_BK if tc_type == "tf32" else TC_BF16_BK
        cost.blocks = ceil(M / TC_BM) * ceil(N / TC_BM) * nbatch
        cost.tile_flops = 2.0 * TC_BM * TC_BM * ceil(K / bk) * bk
        cost.tc, cost.tc_type = cost.blocks * cost.tile_flops, tc_type
        cost.kind = "gemm tensor-core (block-format B)" if quant else "gemm tensor-core"
    else:
        cost.fma = 2.0 * ceil(M / MM_BM) * MM_BM * ceil(N / MM_BM) * MM_BM * ceil(K / MM_BK) * MM_BK * nbatch
        cost.kind = "gemm f32 CUDA cores"
    return cost


def _tc_gemm(node, launch, stored) -> Cost:
    """tc_gemm.cu (the bf16 GEMM, issue 25): the f32 -> bf16 operand copies and the
    block-format weights' decoded copies, the GEMM over
    128 x 128 tiles x splits of k (ptxas, sm_90: 126 registers x 256 threads, 40 KB of
    shared memory, two blocks per SM: bench/results/tc-gemm-ptxas-2026-11-25.md), and the
    split sum."""
    from toygraph.ops.lowering.constants import TC_BM, TC_BF16_BK
    k, kind = launch.kernel, "gemm tensor-core (cp.async + ldmatrix)"
    if k == "tg_tcg_to_bf16":           # R x K f32 (or bf16) per matrix in, R x Kp bf16 out
        R, K, Kp, nmat = (_arg(launch, n) for n in ("R", "K", "Kp", "nmat"))
        src = 2 if _arg(launch, "bf16") else 4
        return Cost(k, kind, bytes=nmat * (src * R * K + 2 * R * Kp))
    if k.startswith("tg_tcg_deq_"):     # the block-format weight once in, N x Kp bf16 out
        R, Kp = _arg(launch, "R"), _arg(launch, "Kp")
        w = node.srcs[-1]
        return Cost(k, kind, bytes=_nbytes(w, stored) + 2 * R * Kp)
    add = _arg(launch, "add") != 0     # matmul_add's epilogue: the added tensor read once
    half = _arg(launch, "bf16")        # the bf16 mask: bit 0 the added tensor, bit 16 C
    c_size, add_size = (2 if half >> 16 else 4), (2 if half & 1 else 4) * add
    if k == "tg_tcg_sum_splits":        # splits partials in, one out
        splits, n = _arg(launch, "splits"), _arg(launch, "n")
        return Cost(k, kind, fma=(splits - 1.0 + 2 * add) * n,
                    bytes=(4.0 * splits + add_size + c_size) * n)
    M, N, Kp, splits, kts, nbatch = (_arg(launch, n)
                                     for n in ("M", "N", "Kp", "splits", "kts", "nbatch"))
    if k == "tg_tcg_gemm2_bf16":        # the dual GEMM: the second product's k after the first's
        Kp += _arg(launch, "Kp2")
    slices = ceil(Kp / TC_BF16_BK)
    blocks = ceil(M / TC_BM) * ceil(N / TC_BM) * nbatch * splits
    # bf16 copies read once (re-reads by other tiles assumed to hit L2); C (or the f32
    # partials) written, the added tensor read
    c_bytes = 4 * splits if splits > 1 else c_size + add_size
    cost = Cost(k, kind, bytes=2 * (M + N) * Kp * nbatch + c_bytes * M * N * nbatch,
                useful=2.0 * M * N * Kp * nbatch, blocks=blocks,
                tile_flops=2.0 * TC_BM * TC_BM * min(kts, slices) * TC_BF16_BK)
    cost.tc = cost.blocks * cost.tile_flops
    return cost


#: Attention kernels: passes of a [BT x HD] x [HD x BT] product per visible (query tile, key
#: tile) pair, as flash_attention.cu's kernels do them: the forward S = q k^T and P v (and
#: it saves the row log-sum-exp L); dq recomputes S and forms dP = dO v^T and dq = dS k,
#: dk/dv recomputes S and dP and forms dv = P^T dO and dk = dS^T q. One exp per score in
#: each kernel. All f32 on CUDA cores. The backward's prep only sums D = rowsum(dO * O).
ATTN_PASSES = {"tg_attn_fwd": 2, "tg_attn_bwd_dq": 3, "tg_attn_bwd_dkdv": 4}


@lru_cache(maxsize=None)
def visible_tile_pairs(T: int, BQ: int, BK: int, causal: bool, window: int) -> int:
    """(query tile of BQ rows, key tile of BK rows) pairs the kernels compute for one
    (batch, head): causal ones skip the pairs where no key is at or before a query, windowed
    ones those wholly outside the window (flash_attention.cu's and tc_attention.cu's rule)."""
    if not causal:
        return ceil(T / BQ) * ceil(T / BK)
    pairs = 0
    for q_lo in range(0, T, BQ):
        q_hi = min(T, q_lo + BQ) - 1
        for k_lo in range(0, q_hi + 1, BK):
            k_hi = min(T, k_lo + BK) - 1
            if not window or q_lo - min(k_hi, q_lo) < window:
                pairs += 1
    return pairs


def _attention(node, launch, stored) -> Cost:
    from toygraph.ops.flash_attention.cuda import attention_dims
    from toygraph.ops.lowering.constants import ATTN_TILES
    if launch.kernel == "tg_attn_bwd_sinks":   # L and D [B, H, T] in, one exp and FMA each
        n = _arg(launch, "B") * _arg(launch, "H") * _arg(launch, "T")
        return Cost(launch.kernel, "attention", fma=2.0 * n, sfu=n, bytes=8 * n,
                    useful=2.0 * n)
    stem, HD = re.fullmatch(r"(tg_attn_\w+?)_(\d+)", launch.kernel).groups()
    HD = int(HD)
    BT = ATTN_TILES[HD][0]
    q, k = node.srcs[0], node.srcs[1]
    B, H, _, T, hd = attention_dims(node)
    qb, kb = 4 * q.size, 4 * k.size
    stats = 4 * B * H * T            # one of L or D, [B, H, T]
    if stem == "tg_attn_bwd_prep":   # o, dO in; D out
        return Cost(launch.kernel, "attention", fma=2.0 * q.size, bytes=2 * qb + stats,
                    useful=2.0 * q.size)
    pairs = visible_tile_pairs(T, BT, BT, bool(node.attrs["causal"]), int(node.attrs["window"]))
    scores = B * H * pairs * BT * BT
    traffic = {"tg_attn_fwd": 2 * qb + 2 * kb + stats,             # q, k, v in; o, L out
               "tg_attn_bwd_dq": 3 * qb + 2 * kb + 2 * stats,      # q, dO, k, v, L, D; dq out
               "tg_attn_bwd_dkdv": 2 * qb + 4 * kb + 2 * stats}    # q, dO, k, v, L, D; dk, dv
    fma = 2.0 * ATTN_PASSES[stem] * scores * HD
    useful = 2.0 * ATTN_PASSES[stem] * scores * hd
    return Cost(launch.kernel, "attention", fma=fma, sfu=scores, bytes=traffic[stem], useful=useful)


#: Tensor-core attention (tc_attention.cu, issue 25): bf16 mma passes per visible pair of
#: (64-row block, streamed tile): the forward S and P v (it saves L: the backward has no
#: statistics pass), dq S, dP, dS k, dk/dv S, dP, P^T dO, dS^T q.
TCA_PASSES = {"tg_tca_fwd": 2, "tg_tca_bwd_dq": 3, "tg_tca_bwd_dkdv": 4}


def _tc_attention(node, launch, stored) -> Cost:
    from toygraph.ops.flash_attention.cuda import attention_dims
    from toygraph.ops.lowering import constants
    k, kind = launch.kernel, "attention tensor-core"
    q, kk = node.srcs[0], node.srcs[1]
    B, H, KV, T, hd = attention_dims(node)
    if k == "tg_tca_to_bf16":       # rows x hd f32 (or bf16) in, rows x HD bf16 out
        rows, hd_, HD = _arg(launch, "rows"), _arg(launch, "hd"), _arg(launch, "HD")
        src = 2 if _arg(launch, "bf16") else 4
        return Cost(k, kind, bytes=src * rows * hd_ + 2 * rows * HD)
    if k == "tg_tca_bwd_prep":      # o f32, dO f32 or bf16 in; D and (unless read as is) dO bf16 out
        rows, hd_, HD = _arg(launch, "rows"), _arg(launch, "hd"), _arg(launch, "HD")
        g = 2 if _arg(launch, "bf16") else 4
        copy = 2 * rows * HD if _arg(launch, "gb") else 0
        return Cost(k, kind, fma=2.0 * rows * hd_, bytes=(4 + g) * rows * hd_ + copy + 4 * rows)
    stem, HD = re.fullmatch(r"(tg_tca_\w+?)_(\d+)", k).groups()
    HD, BQ = int(HD), constants.TCA_BQ
    tile = constants.TCA_TILES[HD]
    causal, window = bool(node.attrs["causal"]), int(node.attrs["window"])
    pairs = (visible_tile_pairs(T, tile, BQ, causal, window) if stem == "tg_tca_bwd_dkdv"
             else visible_tile_pairs(T, BQ, tile, causal, window))
    scores = B * H * pairs * BQ * tile
    passes = TCA_PASSES[stem]
    qh, kh, stats = 2 * B * H * T * HD, 2 * B * KV * T * HD, 4 * B * H * T
    if stem == "tg_tca_fwd":                   # q, k, v in; o (and L when saved) out
        traffic = qh + 2 * kh + 4 * q.size + (stats if _arg(launch, "lse") else 0)
    elif stem == "tg_tca_bwd_dq":              # q, k, v, dO, L, D in; dq out
        traffic = 2 * qh + 2 * kh + 2 * stats + 4 * q.size
    else:                                      # the same in; dk, dv out
        traffic = 2 * qh + 2 * kh + 2 * stats + 8 * kk.size
    return Cost(k, kind, tc=2.0 * passes * scores * HD, sfu=scores, bytes=traffic,
                useful=2.0 * passes * scores * hd)


def _streaming(kind: str, flops_per_elem: float = 1.0, sfu_per_elem: float = 0.0):
    """A kernel that reads its node's operands and writes its output once: bytes of the
    distinct sources (block bytes for a const kept in its format) plus the output."""
    def cost(node, launch, stored) -> Cost:
        srcs = {s.id: s for s in node.srcs}.values()
        n = max(node.size, 1)
        if launch.kernel == "tg_fill":                 # writes n zeros, reads nothing
            return Cost(launch.kernel, kind, bytes=4 * _arg(launch, "n"))
        if launch.kernel.startswith("tg_get_rows_"):   # reads only the rows it gathers
            table = node.srcs[0]
            rows = node.size // table.shape[-1]
            read = _nbytes(table, stored) * rows // table.shape[0] + 4 * node.srcs[1].size
        else:
            read = sum(_nbytes(s, stored) for s in srcs)
        return Cost(launch.kernel, kind, fma=flops_per_elem * n, sfu=sfu_per_elem * n,
                    bytes=read + _nbytes(node, stored), useful=flops_per_elem * n)
    return cost


def _list_sizes(table) -> list[int]:
    """The tensor sizes in a packed TgTensorList (ops/update/'s tensor_lists)."""
    import numpy as np
    from toygraph.ops.lowering.constants import LIST_TENSORS as T
    count = int(np.frombuffer(table[-4:].tobytes(), np.int32)[0])
    return [int(x) for x in np.frombuffer(table[32 * T:36 * T].tobytes(), np.int32)[:count]]


def _optimizer(node, launch, stored) -> Cost:
    k = launch.kernel
    if k == "tg_adamw_list":             # per tensor: w, g, m, v in; w, m, v out
        n = sum(_list_sizes(_raw(launch, "l")))
        return Cost(k, "adamw + clip", fma=12.0 * n, sfu=n, bytes=28 * n, useful=12.0 * n)
    if k == "tg_accumulate":             # acc += g
        n = node.srcs[0].size
        return Cost(k, "adamw + clip", fma=n, bytes=12 * n, useful=n)
    if k == "tg_sumsq_list":             # the gradients' squares, per-block partial sums
        n = sum(_list_sizes(_raw(launch, "l")))
        return Cost(k, "adamw + clip", fma=2.0 * n, bytes=4 * n, useful=2.0 * n)
    return Cost(k, "adamw + clip", bytes=8 * _arg(launch, "nparts"))   # tg_global_norm: the partials


def _loss(node, launch, stored) -> Cost:
    """The fused head's row kernels over one chunk's [rows, V] logits (arguments c, V)."""
    k = launch.kernel
    if k in ("tg_ce_rows", "tg_ce_back", "tg_ce_back_rows"):
        c, V = _arg(launch, "N"), _arg(launch, "V")
        writes = 4 * c * V if k != "tg_ce_rows" else 4 * c
        return Cost(k, "loss (softmax rows)", fma=3.0 * c * V, sfu=c * V,
                    bytes=4 * c * V + writes, useful=3.0 * c * V)
    return Cost(k, "loss (softmax rows)", bytes=4 * max(node.srcs[0].size, 1))  # tiny reductions


#: kernel name pattern -> its cost rule (the first match wins).
RULES = [
    (r"tg_tc_matmul_\w+|tg_tc_qmm_\w+|tg_matmul(_acc)?|tg_qmm_\w+", _gemm),
    (r"tg_tcg_to_bf16|tg_tcg_gemm(2|_ta|_tb|_tab)?_bf16|tg_tcg_sum_splits|tg_tcg_deq_(nt|nn)_\w+",
     _tc_gemm),
    (r"tg_attn_(fwd|bwd_prep|bwd_dq|bwd_dkdv)_\d+|tg_attn_bwd_sinks", _attention),
    (r"tg_tca_to_bf16|tg_tca_bwd_prep|tg_tca_(fwd|bwd_dq|bwd_dkdv)_\d+", _tc_attention),
    (r"tg_adamw_list|tg_accumulate|tg_sumsq_list|tg_global_norm", _optimizer),
    (r"tg_ce_rows|tg_ce_back|tg_ce_back_rows|tg_ce_reduce|tg_lce_grad_scale|tg_count_valid", _loss),
    (r"tg_rms_norm|tg_rms_norm_back", _streaming("norm (row reductions)", 4.0, 0.0)),
    (r"tg_silu|tg_silu_back", _streaming("elementwise", 4.0, 1.0)),
    # gated.cu: act(gate) * up (gate, up in; out); the backward's gate, up, g in and
    # d gate, d up out (its node is the packed pair: ~5 FLOPs and 1/2 exp per element)
    (r"tg_glu", _streaming("elementwise", 5.0, 1.0)),
    (r"tg_glu_back", _streaming("elementwise", 5.0, 0.5)),
    (r"tg_rope", _streaming("elementwise", 6.0, 2.0)),
    # elementwise.cu's float4 kernels for contiguous same-shape operands
    (r"tg_binary_vec|tg_scale_vec", _streaming("elementwise vectorised")),
    (r"tg_binary|tg_scale|tg_copy|tg_gather|tg_fill|tg_get_rows(_\w+)?", _streaming("elementwise")),
    # matmul_add's epilogue after a kernel without one: the product and the add in, out
    (r"tg_matmul_add_epilogue", lambda node, launch, stored: Cost(
        launch.kernel, "elementwise", fma=2.0 * node.size, bytes=12.0 * node.size,
        useful=2.0 * node.size)),
]


def launch_cost(node, launch, stored=frozenset()) -> Cost:
    """The :class:`Cost` of ``launch``, one of ``node``'s launches; ``stored`` the plan's
    :class:`Stored` (or just the ids of the consts kept in their block format)."""
    if not isinstance(stored, Stored):
        stored = Stored(frozenset(stored))
    for pattern, rule in RULES:
        if re.fullmatch(pattern, launch.kernel):
            cost = rule(node, launch, stored)
            cost.node = node.name
            return cost
    raise ValueError(f"bench/studies/roofline_plan.py has no cost rule for kernel {launch.kernel!r} "
                     f"(op {node.op}): add one to RULES")
