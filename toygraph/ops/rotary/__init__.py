"""Rotary position embedding ("normal" and "neox" layouts, optional frequency factors and
linear scaling): builder, shape rule, backward rule (the inverse rotation), numpy kernel
and CUDA lowering (rotary.cu)."""
from __future__ import annotations

from toygraph.ops.table import F32, I32, INT32_MAX, check, define_op, make_node


def rope(x, positions, *, dims: int, base: float, mode: str = "normal", freq_factors=None,
         freq_scale: float = 1.0, inverse=False):
    """Rotary embedding of x [batch, seq, heads, head_dim] at positions [batch, seq].

    mode "normal" rotates adjacent pairs (2i, 2i+1), as llama.cpp does for the Q/K rows a
    GGUF stores; "neox" rotates (i, i + dims/2), as Hugging Face and Qwen2 GGUFs do. Only
    the first ``dims`` features of each head rotate.

    Pair i at position p turns by ``freq_scale * p * base^(-2i/dims) / freq_factors[i]``,
    as in ggml's rope: ``freq_factors`` is an f32 [dims/2] tensor (a Llama-3 GGUF's
    ``rope_freqs.weight``, which is how llama.cpp's converter encodes rope_type "llama3"),
    a third source that gets no gradient; ``freq_scale`` is linear rope scaling
    (1 / ``rope.scaling.factor``). The defaults leave the angles untouched.
    """
    srcs = [x, positions] + ([] if freq_factors is None else [freq_factors])
    return make_node("rope", srcs, dims=int(dims), base=float(base), mode=mode,
                     freq_scale=float(freq_scale), inverse=bool(inverse))


def _infer_rope(shapes, dtypes, attrs):
    (xs, ps), (xd, pd) = shapes[:2], dtypes[:2]
    check(xd == F32 and pd == I32, "rope needs f32 x and i32 positions")
    check(len(xs) == 4, f"x must be [batch, seq, heads, head_dim], got {xs}")
    check(tuple(ps) == tuple(xs[:2]), f"positions must be {xs[:2]}, got {ps}")
    check(attrs["mode"] in ("normal", "neox"),
          f"mode must be normal or neox, got {attrs['mode']!r}")
    d = attrs["dims"]
    check(0 < d <= xs[3] and d % 2 == 0, f"rope dims must be even and <= {xs[3]}, got {d}")
    check(attrs["freq_scale"] > 0, f"freq_scale must be positive, got {attrs['freq_scale']}")
    if len(shapes) == 3:
        check(dtypes[2] == F32 and tuple(shapes[2]) == (d // 2,),
              f"freq_factors must be f32 [{d // 2}] (dims / 2), got {dtypes[2]} {shapes[2]}")
    return xs, F32


def _grad_rope(n, g, need):
    a = n.attrs
    factors = n.srcs[2] if len(n.srcs) == 3 else None
    dx = rope(g, n.srcs[1], dims=a["dims"], base=a["base"], mode=a["mode"],
              freq_factors=factors, freq_scale=a["freq_scale"], inverse=not a["inverse"])
    return [dx] + [None] * (len(n.srcs) - 1)


define_op("rope", _infer_rope, _grad_rope,
    id_ranges=lambda n: {1: (0, INT32_MAX, "positions")})
