"""The CUDA lowering of the update family (kernels in update.cu; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.lowering import (Launch, declare_kernels, f64_arg, grid_1d, i32_arg, lowers,
                                   ptr_arg)
from toygraph.ops.lowering.constants import LIST_TENSORS, THREADS
from toygraph.ops.update import adamw_groups

# The family's CUDA kernels, beside this module.
declare_kernels(__file__, "update.cu")


#: At most this many partial sums per gradient in global_norm (a Python-side choice: the
#: kernels take the count as an argument).
SUMSQ_BLOCKS = 1024


def _sumsq_blocks(n: int) -> int:
    return max(1, min((n + THREADS - 1) // THREADS, SUMSQ_BLOCKS))


def _global_norm_scratch(node) -> int:
    """One f64 partial sum per block of every gradient."""
    return 8 * sum(_sumsq_blocks(g.size) for g in node.srcs[:-1])


def tensor_lists(tensors, blocks):
    """``tensors`` ([(buffers (up to 4 addresses), size, scale), ...]) in launches of up to
    LIST_TENSORS, tensor k given ``blocks(size)`` blocks: [(packed TgTensorList, its blocks)]."""
    T = LIST_TENSORS
    out = []
    for c in range(0, len(tensors), T):
        chunk = tensors[c:c + T]
        ptrs = np.zeros((4, T), np.uint64)
        sizes, scales = np.zeros(T, np.int32), np.zeros(T, np.float32)
        starts = np.zeros(T + 1, np.int32)
        for k, (bufs, n, scale) in enumerate(chunk):
            ptrs[:len(bufs), k] = bufs
            sizes[k], scales[k] = n, scale
            starts[k + 1] = starts[k] + blocks(n)
        starts[len(chunk) + 1:] = starts[len(chunk)]
        packed = b"".join(a.tobytes() for a in (ptrs, sizes, scales, starts,
                                                  np.array([len(chunk)], np.int32)))
        out.append((np.frombuffer(packed, np.uint8).copy(), int(starts[len(chunk)])))
    return out


@lowers("accumulate", kernels=("tg_accumulate",), has_output=False)
def _accumulate(node, at):
    acc, g = node.srcs
    return [Launch("tg_accumulate", grid_1d(acc.size),
                   [ptr_arg(at.ptr(acc)), ptr_arg(at.ptr(g)), i32_arg(acc.size)])]


@lowers("global_norm", kernels=("tg_sumsq_list", "tg_global_norm"),
        scratch=_global_norm_scratch)
def _global_norm(node, at):
    """Partial sums of squares of every gradient into scratch, LIST_TENSORS gradients a
    launch (partial b of a launch: its block b); then one block adds them up in order."""
    launches, offset = [], 0
    grads = [((at.ptr(g),), g.size, 1.0) for g in node.srcs[:-1]]
    for table, nb in tensor_lists(grads, _sumsq_blocks):
        launches.append(Launch("tg_sumsq_list", (nb, 1, 1), [ptr_arg(at.scratch + 8 * offset),
                                                             table]))
        offset += nb
    launches.append(Launch("tg_global_norm", (1, 1, 1),
                           [ptr_arg(at.out), ptr_arg(at.scratch), i32_arg(offset),
                            ptr_arg(at.ptr(node.srcs[-1]))]))
    return launches


@lowers("adamw", kernels=("tg_adamw_list",), has_output=False)
def _adamw(node, at):
    """Every param's update, LIST_TENSORS params a launch."""
    groups, (hp, norm, div) = adamw_groups(node.srcs)
    tensors = [(tuple(at.ptr(t) for t in grp), grp[0].size, s)
               for grp, s in zip(groups, node.attrs["lr_scales"])]
    tail = [ptr_arg(at.ptr(hp)), ptr_arg(at.ptr(norm)), ptr_arg(at.ptr(div)),
            f64_arg(node.attrs["max_norm"])]
    return [Launch("tg_adamw_list", (nb, 1, 1), [table, *tail])
            for table, nb in tensor_lists(tensors, lambda n: grid_1d(n)[0])]
