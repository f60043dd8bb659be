"""The Gated DeltaNet ops (Qwen3.5's linear-attention layers): the causal depthwise conv1d
over the q/k/v projections, and the gated delta rule. Builders, shape rules, backward rules,
numpy kernels and CUDA lowering (deltanet.cu).

The gated delta rule, per head, with a state S [dk, dv] starting at 0 (or a given state):

    S_t = a_t S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - a_t S_{t-1}^T k_t),   a_t = exp(g_t)
    o_t = S_t^T q_t

(transformers' torch_recurrent_gated_delta_rule; q and k arrive L2-normalised, q scaled).
The numpy forward computes it chunk by chunk in the WY form (transformers'
torch_chunk_gated_delta_rule: a unit lower-triangular system per chunk turns the chunk's
delta updates into matmuls, then one state update per chunk); the backward keeps the state
at each chunk start and differentiates each chunk's matmuls in closed form, from the last
chunk, carrying the gradient of the state. The CUDA kernels (deltanet.cu) compute the same chunked form, forward
and backward (the backward in closed form per chunk, from the chunk-start states), one block
per (batch, head); decoding one token from a state runs a step-wise kernel instead.
"""
from __future__ import annotations

import numpy as np

from toygraph.core.ops.shape import unpack
from toygraph.core.ops.table import F32, check, check_floats, define_op, kernel, make_node
from toygraph.cuda.lowering import Launch, declare_kernels, grid_1d, i32_arg, lowers, ptr_arg
from toygraph.cuda.lowering.constants import DELTA_CHUNK, DELTA_MAX_DK, THREADS
from toygraph.errors import CudaError, GraphError

declare_kernels(__file__, "deltanet.cu")

#: Time steps per chunk of the WY forward (transformers' and FLA's default).
CHUNK = 64


# --- causal depthwise conv1d -------------------------------------------------------------------
def causal_conv1d(x, w):
    """y[b, t, c] = sum_j w[c, j] x[b, t - K + 1 + j, c] (zeros before t = 0): a depthwise
    convolution over time of x [B, T, C] with the kernel w [C, K], seeing no future step."""
    return make_node("causal_conv1d", [x, w])


def _infer_conv(shapes, dtypes, attrs):
    check_floats(dtypes)
    (xs, ws) = shapes
    check(len(xs) == 3 and len(ws) == 2 and ws[0] == xs[2],
          f"x must be [B, T, C] and w [C, K], got {xs} and {ws}")
    return tuple(xs), F32


def _infer_conv_back(shapes, dtypes, attrs):
    (xs, ws, gs) = shapes
    check(tuple(gs) == tuple(xs), f"the gradient must be {xs}, got {gs}")
    return (int(np.prod(xs)) + int(np.prod(ws)),), F32


def _grad_conv(n, g, need):
    x, w = n.srcs
    back = make_node("causal_conv1d_back", [x, w, g])
    return [unpack(back, 0, x.shape) if need[0] else None,
            unpack(back, x.size, w.shape) if need[1] else None]


define_op("causal_conv1d", _infer_conv, _grad_conv)
define_op("causal_conv1d_back", _infer_conv_back)


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


# --- the gated delta rule ----------------------------------------------------------------------
def delta_rule(q, k, v, g, beta, state=None, chunk: int = CHUNK):
    """The gated delta rule over q, k [B, T, H, dk], v [B, T, H, dv], the log decays g and
    the write strengths beta [B, T, H]: o [B, T, H, dv].

    With ``state`` [B, H, dk, dv] (generation: the state after the tokens before these),
    returns (o, the state after the last token); no gradient flows then.
    """
    srcs = [q, k, v, g, beta] + ([] if state is None else [state])
    node = make_node("delta_rule", srcs, chunk=int(chunk))
    if state is None:
        return node
    B, T, H, dv = v.shape
    return unpack(node, 0, (B, T, H, dv)), unpack(node, B * T * H * dv, state.shape)


def _infer_delta(shapes, dtypes, attrs):
    check_floats(dtypes)
    qs, ks, vs, gs, bs = (tuple(s) for s in shapes[:5])
    check(len(qs) == 4 and qs == ks and len(vs) == 4 and vs[:3] == qs[:3],
          f"q, k must be [B, T, H, dk] and v [B, T, H, dv], got {qs}, {ks}, {vs}")
    check(gs == qs[:3] and bs == qs[:3], f"g and beta must be {list(qs[:3])}, got {gs} and {bs}")
    check(attrs["chunk"] >= 1, f"chunk must be >= 1, got {attrs['chunk']}")
    B, T, H, dk = qs
    if len(shapes) == 6:
        check(tuple(shapes[5]) == (B, H, dk, vs[3]),
              f"state must be {[B, H, dk, vs[3]]}, got {list(shapes[5])}")
        return (B * T * H * vs[3] + B * H * dk * vs[3],), F32
    return vs, F32


def _infer_delta_back(shapes, dtypes, attrs):
    _infer_delta(shapes[:5], dtypes[:5], attrs)
    check(tuple(shapes[5]) == tuple(shapes[2]), f"the gradient must be {shapes[2]}, got {shapes[5]}")
    return (sum(int(np.prod(s)) for s in shapes[:5]),), F32


def _grad_delta(n, gout, need):
    if len(n.srcs) == 6:
        raise GraphError("delta_rule with a given state (generation) has no gradient")
    back = make_node("delta_rule_back", [*n.srcs, gout], chunk=n.attrs["chunk"])
    grads, offset = [], 0
    for src, wanted in zip(n.srcs, need):
        grads.append(unpack(back, offset, src.shape) if wanted else None)
        offset += src.size
    return grads


define_op("delta_rule", _infer_delta, _grad_delta)
define_op("delta_rule_back", _infer_delta_back)


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


# --- CUDA lowering (deltanet.cu) ---------------------------------------------------------------
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
