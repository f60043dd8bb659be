"""The numpy kernels of the deltanet family (the reference backend; its ops and their rules are in
__init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.table import kernel


@kernel("causal_conv1d")
def _conv_numpy(out, srcs, attrs):
    x, w = srcs
    T, K = x.shape[1], w.shape[1]
    out.fill(0)
    for j in range(K):
        s = K - 1 - j  # tap j reads s steps back
        if s < T:
            out[:, s:] += x[:, :T - s] * w[:, j]


@kernel("causal_conv1d_back")
def _conv_back_numpy(out, srcs, attrs):
    x, w, g = srcs
    T, K = x.shape[1], w.shape[1]
    dx = out[:x.size].reshape(x.shape)
    dw = out[x.size:].reshape(w.shape)
    dx.fill(0)
    dw.fill(0)
    for j in range(K):
        s = K - 1 - j
        if s < T:
            dx[:, :T - s] += g[:, s:] * w[:, j]
            dw[:, j] = np.sum(g[:, s:] * x[:, :T - s], axis=(0, 1))


def _heads_first(*arrays):
    """[B, T, H, ...] -> [B, H, T, ...] copies (g and beta [B, H, T])."""
    return (np.ascontiguousarray(np.moveaxis(x, 1, 2)) for x in arrays)


def _solve_unit_lower(L, b):
    """x with (I + strictly_lower(L)) x = b, by forward substitution over the chunk rows."""
    x = np.array(b)
    for i in range(1, L.shape[-1]):
        x[..., i, :] -= np.einsum("...j,...jd->...d", L[..., i, :i], x[..., :i, :])
    return x


def delta_rule_chunked(q, k, v, g, beta, S, chunk):
    """The WY (chunked) forward on [B, H, T, ...] arrays from state S [B, H, dk, dv]:
    returns (o [B, H, T, dv], the final state)."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:  # padded steps have g = 0 and beta = 0: they leave the state as it is
        q, k, v = (np.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (np.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    cg = np.cumsum(g, axis=-1)                              # log decay from the chunk start
    lower = np.tril(np.ones((chunk, chunk), bool))
    decay = np.where(lower, np.exp(np.where(lower, cg[..., :, None] - cg[..., None, :], 0)), 0)
    kb, vb = k * beta[..., None], v * beta[..., None]
    system = (kb @ np.swapaxes(k, -1, -2)) * decay          # its strictly lower part
    u = _solve_unit_lower(system, vb)                        # the chunk's new values
    w = _solve_unit_lower(system, kb * np.exp(cg)[..., None])
    intra = (q @ np.swapaxes(k, -1, -2)) * decay
    qd = q * np.exp(cg)[..., None]
    kd = k * np.exp(cg[..., -1:] - cg)[..., None]
    out = np.empty((B, H, n, chunk, dv), q.dtype)
    S = np.array(S, q.dtype)
    for i in range(n):
        vn = u[:, :, i] - w[:, :, i] @ S
        out[:, :, i] = qd[:, :, i] @ S + intra[:, :, i] @ vn
        S = S * np.exp(cg[:, :, i, -1])[..., None, None] + np.swapaxes(kd[:, :, i], -1, -2) @ vn
    return out.reshape(B, H, n * chunk, dv)[:, :, :T], S


@kernel("delta_rule")
def _delta_numpy(out, srcs, attrs):
    q, k, v, g, beta = _heads_first(*srcs[:5])
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    S0 = srcs[5] if len(srcs) == 6 else np.zeros((B, H, dk, dv), q.dtype)
    o, S = delta_rule_chunked(q, k, v, g, beta, S0, attrs["chunk"])
    flat, n_o = out.reshape(-1), B * T * H * dv
    flat[:n_o] = np.moveaxis(o, 1, 2).reshape(-1)
    if len(srcs) == 6:
        flat[n_o:] = S.reshape(-1)


def _solve_unit_lower_t(L, b):
    """x with (I + strictly_lower(L))^T x = b, by back substitution from the last row."""
    x = np.array(b)
    for i in range(L.shape[-1] - 2, -1, -1):
        x[..., i, :] -= np.einsum("...j,...jd->...d", L[..., i + 1:, i], x[..., i + 1:, :])
    return x


def _chunk_back(q, k, v, g, beta, S0, do, dS):
    """One chunk's backward in closed form (the forward of delta_rule_chunked written with
    U = (I + A)^-1 diag(beta) (V - diag(gam) K S0), A = diag(beta) P; deltanet.cu derives
    each line): the gradients of q, k, v, g, beta and of the state S0 the chunk starts from,
    given do and dS, the gradient of the state after the chunk. Arrays [B, H, n, ...]."""
    n = q.shape[2]
    T_ = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731
    lower = np.tril(np.ones((n, n), bool))
    strict = np.tril(np.ones((n, n), bool), -1)
    cg = np.cumsum(g, axis=-1)
    gam, cdec = np.exp(cg), np.exp(cg[..., -1:] - cg)
    D = np.where(lower, np.exp(np.where(lower, cg[..., :, None] - cg[..., None, :], 0)), 0)
    P, M = np.where(strict, (k @ T_(k)) * D, 0), (q @ T_(k)) * D
    A = beta[..., :, None] * P
    KS, QS, KdS = k @ S0, q @ S0, k @ dS
    U = _solve_unit_lower(A, beta[..., None] * (v - gam[..., None] * KS))
    dR = _solve_unit_lower_t(A, T_(M) @ do + cdec[..., None] * KdS)
    dA = np.where(strict, -(dR @ T_(U)), 0)
    dM = np.where(lower, do @ T_(U), 0)
    dMD, E = dM * D, beta[..., :, None] * dA * D
    dq = gam[..., None] * (do @ T_(S0)) + dMD @ k
    dk = (T_(dMD) @ q + cdec[..., None] * (U @ T_(dS))
          - (gam * beta)[..., None] * (dR @ T_(S0)) + (E + T_(E)) @ k)
    dbeta = np.sum(dR * (v - gam[..., None] * KS), -1) + np.sum(dA * P, -1)
    F = dM * M + dA * A     # the gradient of log D, row i's decay minus column l's
    uk = cdec * np.sum(U * KdS, -1)
    dcg = (F.sum(-1) - F.sum(-2) - uk
           + gam * (np.sum(do * QS, -1) - beta * np.sum(dR * KS, -1)))
    dcg[..., -1] += uk.sum(-1) + gam[..., -1] * np.sum(dS * S0, axis=(-2, -1))
    dg = np.cumsum(dcg[..., ::-1], axis=-1)[..., ::-1]
    dS0 = (gam[..., -1, None, None] * dS + T_(q) @ (gam[..., None] * do)
           - T_(k) @ ((gam * beta)[..., None] * dR))
    return (dq, dk, beta[..., None] * dR, dg, dbeta), dS0


@kernel("delta_rule_back")
def _delta_back_numpy(out, srcs, attrs):
    """The state at each chunk start by the chunked forward, then each chunk's closed-form
    backward from the last, carrying the state's gradient."""
    q, k, v, g, beta, do = _heads_first(*srcs)
    B, H, T, dk = q.shape
    dv, C = v.shape[-1], attrs["chunk"]
    chunks = [slice(c0, min(T, c0 + C)) for c0 in range(0, T, C)]
    starts = [np.zeros((B, H, dk, dv), q.dtype)]
    for s in chunks[:-1]:
        starts.append(delta_rule_chunked(q[:, :, s], k[:, :, s], v[:, :, s], g[:, :, s],
                                         beta[:, :, s], starts[-1], C)[1])
    grads = [np.zeros_like(x) for x in (q, k, v, g, beta)]
    dS = np.zeros((B, H, dk, dv), q.dtype)
    for s, S0 in reversed(list(zip(chunks, starts))):
        parts, dS = _chunk_back(q[:, :, s], k[:, :, s], v[:, :, s], g[:, :, s], beta[:, :, s],
                                S0, do[:, :, s], dS)
        for grad, part in zip(grads, parts):
            grad[:, :, s] = part
    offset = 0
    for grad in grads:
        flat = np.moveaxis(grad, 2, 1).reshape(-1)  # back to [B, T, H, ...]
        out[offset:offset + flat.size] = flat
        offset += flat.size
