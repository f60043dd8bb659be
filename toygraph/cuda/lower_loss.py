"""CUDA lowering of the loss ops (loss.cu): cross-entropy over logit rows, its backward,
and the count of labelled positions."""
from __future__ import annotations

from .launch import Launch, _rows_grid, i32, p
from .registry import lowers


def _ce_scratch(node) -> int:
    """One f32 loss per row."""
    return 4 * node.srcs[0].shape[0]


@lowers("cross_entropy", kernels=("tg_ce_rows", "tg_ce_reduce"), scratch=_ce_scratch)
def _cross_entropy(node, at):
    """Per-row losses into scratch, then one block sums (or averages) them in order."""
    logits, labels = node.srcs
    N, V = logits.shape
    mean = i32(node.attrs["reduction"] == "mean")
    return [Launch("tg_ce_rows", _rows_grid(N), [p(at.scratch), p(at.ptr(logits)),
                                                 p(at.ptr(labels)), i32(N), i32(V)]),
            Launch("tg_ce_reduce", (1, 1, 1),
                   [p(at.out), p(at.scratch), p(at.ptr(labels)), i32(N), mean])]


@lowers("cross_entropy_back", kernels=("tg_ce_back",))
def _cross_entropy_back(node, at):
    logits, labels, g = node.srcs
    N, V = logits.shape
    return [Launch("tg_ce_back", _rows_grid(N),
                   [p(at.out), p(at.ptr(logits)), p(at.ptr(labels)), p(at.ptr(g)), i32(N),
                    i32(V), i32(node.attrs["reduction"] == "mean")])]


@lowers("count_valid", kernels=("tg_count_valid",))
def _count_valid(node, at):
    labels = node.srcs[0]
    return [Launch("tg_count_valid", (1, 1, 1), [p(at.out), p(at.ptr(labels)), i32(labels.size)])]
