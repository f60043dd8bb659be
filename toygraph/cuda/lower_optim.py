"""CUDA lowering of the optimizer ops (optim.cu): gradient accumulation, the global
gradient norm and AdamW. accumulate and adamw update their sources in place."""
from __future__ import annotations

from .launch import Launch, _blocks, f64, i32, p
from .constants import THREADS
from .registry import lowers

#: At most this many partial sums per gradient in global_norm (a Python-side choice: the
#: kernels take the count as an argument).
SUMSQ_BLOCKS = 1024


def _sumsq_blocks(n: int) -> int:
    return max(1, min((n + THREADS - 1) // THREADS, SUMSQ_BLOCKS))


def _global_norm_scratch(node) -> int:
    """One f64 partial sum per block of every gradient."""
    return 8 * sum(_sumsq_blocks(g.size) for g in node.srcs[:-1])


@lowers("accumulate", kernels=("tg_accumulate",), has_output=False)
def _accumulate(node, at):
    acc, g = node.srcs
    return [Launch("tg_accumulate", _blocks(acc.size),
                   [p(at.ptr(acc)), p(at.ptr(g)), i32(acc.size)])]


@lowers("global_norm", kernels=("tg_sumsq_partial", "tg_global_norm"),
        scratch=_global_norm_scratch)
def _global_norm(node, at):
    """Per gradient, partial sums of squares into scratch; then one block adds them up."""
    launches, offset = [], 0
    for g in node.srcs[:-1]:
        nb = _sumsq_blocks(g.size)
        launches.append(Launch("tg_sumsq_partial", (nb, 1, 1),
                               [p(at.scratch + 8 * offset), p(at.ptr(g)), i32(g.size)]))
        offset += nb
    launches.append(Launch("tg_global_norm", (1, 1, 1),
                           [p(at.out), p(at.scratch), i32(offset), p(at.ptr(node.srcs[-1]))]))
    return launches


@lowers("adamw", kernels=("tg_adamw",), has_output=False)
def _adamw(node, at):
    w, g, m, v, hp, norm, div = node.srcs
    return [Launch("tg_adamw", _blocks(w.size),
                   [p(at.ptr(w)), p(at.ptr(g)), p(at.ptr(m)), p(at.ptr(v)), p(at.ptr(hp)),
                    p(at.ptr(norm)), p(at.ptr(div)), i32(w.size), f64(node.attrs["max_norm"])])]
