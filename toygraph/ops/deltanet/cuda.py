"""The CUDA lowering of the deltanet family (kernels in deltanet.cu; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

from toygraph.errors import CudaError
from toygraph.ops.lowering import Launch, declare_kernels, grid_1d, i32_arg, lowers, ptr_arg
from toygraph.ops.lowering.constants import DELTA_CHUNK, DELTA_MAX_DK, THREADS

declare_kernels(__file__, "deltanet.cu")


@lowers("causal_conv1d", "causal_conv1d_back", kernels=("tg_causal_conv1d", "tg_causal_conv1d_back"))
def _conv(node, at):
    x, w = node.srcs[:2]
    (B, T, C), K = x.shape, w.shape[1]
    srcs = [ptr_arg(at.ptr(s)) for s in node.srcs]
    name = "tg_causal_conv1d" if node.op == "causal_conv1d" else "tg_causal_conv1d_back"
    return [Launch(name, grid_1d(node.size), [ptr_arg(at.out), *srcs, i32_arg(B), i32_arg(T),
                                              i32_arg(C), i32_arg(K)])]


def _delta_dims(node):
    q, _, v = node.srcs[:3]
    return (*q.shape, v.shape[3])


def _chunk(node) -> int:
    """The chunk the kernels walk: the op's, at most DELTA_CHUNK (the chunk only changes
    the rounding, as in the numpy form)."""
    return min(node.attrs["chunk"], DELTA_CHUNK)


def _stepwise(node) -> bool:
    """Decoding (one new token from a given state) runs the step-wise kernel."""
    return len(node.srcs) == 6 and node.srcs[0].shape[1] == 1


def _fwd_scratch_bytes(node) -> int:
    B, T, H, dk, dv = _delta_dims(node)
    C = _chunk(node)
    return 0 if _stepwise(node) else 4 * B * H * (dk * dv + 3 * C * C + 3 * C * dv)


def _back_scratch_bytes(node) -> int:
    B, T, H, dk, dv = _delta_dims(node)
    C = _chunk(node)
    return 4 * B * H * ((-(-T // C) + 1) * dk * dv + 5 * C * C + 5 * C * dv)


@lowers("delta_rule", kernels=("tg_delta_rule", "tg_delta_chunked"), scratch=_fwd_scratch_bytes)
def _delta(node, at):
    """The chunked kernel, one block per (batch, head); decoding: the step-wise kernel, one
    thread per (batch, head, state column)."""
    B, T, H, dk, dv = _delta_dims(node)
    with_state = len(node.srcs) == 6
    srcs = [ptr_arg(at.ptr(s)) for s in node.srcs[:5]]
    state = ptr_arg(at.ptr(node.srcs[5] if with_state else node.srcs[0]))  # unread if 0
    dims = [i32_arg(B), i32_arg(T), i32_arg(H), i32_arg(dk), i32_arg(dv)]
    if _stepwise(node):
        if dk > DELTA_MAX_DK:
            raise CudaError(f"{node.op} {node.name!r}: key head size {dk} exceeds the step-wise "
                            f"kernel's bound {DELTA_MAX_DK}")
        return [Launch("tg_delta_rule", grid_1d(B * H * dv),
                       [ptr_arg(at.out), *srcs, state, *dims, i32_arg(with_state)])]
    return [Launch("tg_delta_chunked", (B * H, 1, 1),
                   [ptr_arg(at.out), *srcs, state, ptr_arg(at.scratch), *dims,
                    i32_arg(_chunk(node)), i32_arg(with_state)], block=(THREADS, 1, 1))]


@lowers("delta_rule_back", kernels=("tg_delta_chunked_back",), scratch=_back_scratch_bytes)
def _delta_back(node, at):
    """One block per (batch, head), walking the chunks from the last."""
    B, T, H, dk, dv = _delta_dims(node)
    srcs = [ptr_arg(at.ptr(s)) for s in node.srcs]
    return [Launch("tg_delta_chunked_back", (B * H, 1, 1),
                   [ptr_arg(at.out), *srcs, ptr_arg(at.scratch), i32_arg(B), i32_arg(T),
                    i32_arg(H), i32_arg(dk), i32_arg(dv),
                    i32_arg(_chunk(node))], block=(THREADS, 1, 1))]
