"""The numpy kernels of the experts family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.table import block_kernel, kernel


@kernel("topk")
def _topk_numpy(out, srcs, attrs):
    # A stable sort of -x: largest first, equal values in index order.
    out[...] = np.argsort(-srcs[0], axis=-1, kind="stable")[..., :attrs["k"]]


@kernel("take_along")
def _take_along_numpy(out, srcs, attrs):
    out[...] = np.take_along_axis(srcs[0], srcs[1].astype(np.intp), axis=-1)


@kernel("put_along")
def _put_along_numpy(out, srcs, attrs):
    g, ids = srcs
    out.fill(0)
    rows = out.reshape(-1, out.shape[-1])
    idx = ids.reshape(-1, ids.shape[-1])
    np.add.at(rows, (np.arange(len(idx))[:, None], idx), g.reshape(idx.shape))


def split_routes(routes, n_expert: int):
    """(offsets [E + 1], perm [N*k]) of a group_by_expert result."""
    return routes[:n_expert + 1], routes[n_expert + 1:]


@kernel("group_by_expert")
def _group_numpy(out, srcs, attrs):
    flat = srcs[0].reshape(-1)
    E = attrs["n_expert"]
    out[0] = 0
    np.cumsum(np.bincount(flat, minlength=E), out=out[1:E + 1])
    out[E + 1:] = np.argsort(flat, kind="stable")


def _groups(routes, n_expert: int):
    """(expert, its slot ids) for every expert some slot chose."""
    off, perm = split_routes(routes, n_expert)
    for e in range(n_expert):
        if off[e + 1] > off[e]:
            yield e, perm[off[e]:off[e + 1]]


@kernel("expert_matmul")
def _expert_matmul_numpy(out, srcs, attrs):
    x, w, routes = srcs
    N, k, n_out = out.shape
    rows = out.reshape(N * k, n_out)
    xr = x.reshape(-1, x.shape[-1])
    for e, slots in _groups(routes, w.shape[0]):
        src = slots // k if x.ndim == 2 else slots
        we = w[e].T if attrs["trans_b"] else w[e]
        rows[slots] = xr[src] @ we


def _one_expert(w_shape) -> int:
    """Elements of one expert of expert_matmul's weights [E, ., .]."""
    return int(np.prod(w_shape[1:]))


@block_kernel("expert_matmul", reads=(1,), scratch=lambda node: _one_expert(node.srcs[1].shape))
def _expert_matmul_blocks(out, srcs, attrs, scratch):
    """Weights kept in their block format (a cpu.block_tensor.BlockTensor): each expert some
    slot chose is decoded, alone, into the scratch just before its GEMM, so the experts no
    token chose are never read (their pages of the mapped file stay untouched). The same
    decoded values in the same layout reach the same GEMM as in _expert_matmul_numpy."""
    x, w, routes = srcs
    N, k, n_out = out.shape
    rows = out.reshape(N * k, n_out)
    xr = x.reshape(-1, x.shape[-1])
    we = scratch[:_one_expert(w.shape)].reshape(w.shape[1:])
    groups = list(_groups(routes, w.shape[0]))
    w.read_sparsely()     # no read-ahead into the unused experts around a chosen one
    for e, _ in groups:   # start reading every chosen expert's pages, and only theirs
        w.part(e).prefetch()
    for e, slots in groups:
        src = slots // k if x.ndim == 2 else slots
        w.part(e).decode_into(we)
        rows[slots] = xr[src] @ (we.T if attrs["trans_b"] else we)


@kernel("expert_matmul_dw")
def _expert_matmul_dw_numpy(out, srcs, attrs):
    g, x, routes = srcs
    N, k, _ = g.shape
    gr = g.reshape(N * k, -1)
    xr = x.reshape(-1, x.shape[-1])
    out.fill(0)
    for e, slots in _groups(routes, out.shape[0]):
        src = slots // k if x.ndim == 2 else slots
        # y = x W^T: dW = dy^T x;  y = x W: dW = x^T dy
        out[e] = gr[slots].T @ xr[src] if attrs["trans_b"] else xr[src].T @ gr[slots]
