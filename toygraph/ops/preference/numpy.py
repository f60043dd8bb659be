"""The numpy kernels of the preference family (the reference backend; its ops and their rules are
in __init__.py)."""
from __future__ import annotations

import numpy as np

from toygraph.ops.table import kernel

#: Logit rows handled at once, so no [N, vocab] temporary beside the logits themselves.
_ROWS = 256


def _log_softmax_rows(logits, start, stop):
    z = logits[start:stop] - logits[start:stop].max(axis=1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
    return z


@kernel("token_logprobs")
def _token_logprobs_numpy(out, srcs, attrs):
    logits, labels = srcs
    out[...] = 0
    for start in range(0, len(labels), _ROWS):
        stop = min(start + _ROWS, len(labels))
        lab = labels[start:stop]
        rows = np.nonzero(lab >= 0)[0]
        if len(rows):
            z = _log_softmax_rows(logits, start, stop)
            out[start + rows] = z[rows, lab[rows]]


@kernel("token_logprobs_back")
def _token_logprobs_back_numpy(out, srcs, attrs):
    logits, labels, g = srcs
    for start in range(0, len(labels), _ROWS):
        stop = min(start + _ROWS, len(labels))
        lab = labels[start:stop]
        valid = lab >= 0
        o = out[start:stop]
        np.exp(_log_softmax_rows(logits, start, stop), out=o)
        np.negative(o, out=o)                         # -softmax
        rows = np.nonzero(valid)[0]
        o[rows, lab[rows]] += 1.0                     # onehot - softmax
        o *= (valid * g[start:stop])[:, None].astype(o.dtype)


@kernel("softplus")
def _softplus_numpy(out, srcs, attrs):
    x = srcs[0]
    np.log1p(np.exp(-np.abs(x)), out=out)
    out += np.maximum(x, 0)


@kernel("softplus_back")
def _softplus_back_numpy(out, srcs, attrs):
    x, g = srcs
    # sigmoid(x) from exp(-|x|), which never overflows: e/(1+e) below 0, 1/(1+e) above.
    e = np.exp(-np.abs(x))
    np.divide(np.where(x >= 0, 1.0, e), 1.0 + e, out=out)
    out *= g


@kernel("log1mexp")
def _log1mexp_numpy(out, srcs, attrs):
    x = srcs[0]
    near = x > -np.log(2.0)
    with np.errstate(divide="ignore", invalid="ignore"):  # x = 0: -inf, x > 0: nan, as log(1-e^x)
        out[...] = np.where(near, np.log(-np.expm1(x)), np.log1p(-np.exp(x)))


@kernel("log1mexp_back")
def _log1mexp_back_numpy(out, srcs, attrs):
    x, g = srcs
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(-g, np.expm1(-x), out=out)
