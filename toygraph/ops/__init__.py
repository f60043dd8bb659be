"""The ops, one folder per family. Each family folder holds, for each of its ops:

- ``__init__.py``: the builder function and the shape/dtype and backward rules (entered in
  ``OPS`` by ``define_op``) -- what the graph core builds and differentiates with;
- ``numpy.py``: the numpy kernels (``KERNELS``, the reference backend every graph runs on);
- ``cuda.py``: the CUDA lowering (``@lowers`` entries in ``lowering.registry.REGISTRY``),
  with the family's kernels beside it in ``<family>.cu`` (the shared headers in include/);
- room for the CPU engine's kernels of the family, when they move here from toygraph/cpu/.

Importing this package loads every family's definitions and numpy kernels; the CUDA
lowerings are loaded by the CUDA runtime (toygraph/cuda/lowerings.py), so nothing the graph
core imports reaches a GPU backend. Adding an op means its family's files and its tests.

No family is named like an op: ``ops.matmul`` is the op's builder, so the family that
defines it is ``ops.gemm`` (likewise ``ops.rotary`` for rope, ``ops.flash_attention`` for
attention).

===============  =======================================================================
table            OpSpec, OPS, KERNELS and the helpers the families fill them with
groups           the op groups (views, pass-through, in place, packed results)
shape            reshape, permute, contiguous, expand, sum_to, sum, unpack
elementwise      add, sub, mul, scale, silu, gelu, sigmoid, softcap, swiglu_oai (+ mean)
gated            glu (act(gate) * up fused: swiglu, geglu) and its one-pass backward
norm             rms_norm, softmax, inv_row_norm (row-wise normalisations)
rotary           rope
flash_attention  attention (fused, flash-style)
gemm             matmul (f32, block-format weights, tensor cores), matmul_add (with an
                 epilogue: add + alpha * product) and the dequantizers
rows             get_rows
loss             cross_entropy, count_valid, linear_cross_entropy (fused head + loss)
update           accumulate, global_norm, adamw
collective       all_reduce (data parallelism over MPI/NCCL)
cache            cache_write (generation's KV cache)
deltanet         causal_conv1d, delta_rule (Qwen3.5's Gated DeltaNet)
slicing          narrow (a slice of the last axis)
preference       token_logprobs, softplus, log_sigmoid, log1mexp (DPO/ORPO losses)
experts          topk, take_along, group_by_expert, expert_matmul (mixtures of experts)
policy           clipped_surrogate, kl_penalty (GRPO's policy-gradient loss)
stochastic       dropout (a counter-based mask keyed by the hp row's step)
===============  =======================================================================

The builders are re-exported here, so ``ops.<name>`` is every op:

>>> from toygraph import ops
>>> y = ops.rms_norm(x, 1e-5)                     # doctest: +SKIP
"""
from __future__ import annotations

# The families in the order of the table above (isort would sort them).
# isort: off
from toygraph.ops.table import (BLOCK_KERNELS, F32, I32, INT32_MAX, KERNELS, LABELS, NONE, OPS,
                                OpSpec, block_kernel, check, check_floats, define_op, kernel,
                                make_node)
from toygraph.ops.shape import (broadcast_shapes, contiguous, expand, permute, reshape, sum, sum_to,
                                unpack)
from toygraph.ops.elementwise import (add, gelu, gelu_back, mean, mul, scale, silu, sigmoid,
                                      silu_back, softcap, sub, swiglu_oai)
from toygraph.ops.gated import geglu, glu, swiglu
from toygraph.ops.norm import inv_row_norm, rms_norm, softmax
from toygraph.ops.rotary import rope
from toygraph.ops.flash_attention import attention
from toygraph.ops.gemm import matmul, matmul_add
from toygraph.ops.rows import get_rows
from toygraph.ops.loss import count_valid, cross_entropy, linear_cross_entropy
from toygraph.ops.update import accumulate, adamw, global_norm
from toygraph.ops.collective import all_reduce
from toygraph.ops.cache import cache_write
from toygraph.ops.deltanet import causal_conv1d, delta_rule
from toygraph.ops.slicing import narrow
from toygraph.ops.preference import log1mexp, log_sigmoid, softplus, token_logprobs
from toygraph.ops.experts import expert_matmul, group_by_expert, take_along, topk
from toygraph.ops.policy import clipped_surrogate, kl_penalty
from toygraph.ops.stochastic import dropout
# isort: on
# Every family's numpy kernels (KERNELS, BLOCK_KERNELS), in the same order.
# isort: off
import toygraph.ops.shape.numpy  # noqa: F401
import toygraph.ops.elementwise.numpy  # noqa: F401
import toygraph.ops.gated.numpy  # noqa: F401
import toygraph.ops.norm.numpy  # noqa: F401
import toygraph.ops.rotary.numpy  # noqa: F401
import toygraph.ops.flash_attention.numpy  # noqa: F401
import toygraph.ops.gemm.numpy  # noqa: F401
import toygraph.ops.rows.numpy  # noqa: F401
import toygraph.ops.loss.numpy  # noqa: F401
import toygraph.ops.update.numpy  # noqa: F401
import toygraph.ops.collective.numpy  # noqa: F401
import toygraph.ops.cache.numpy  # noqa: F401
import toygraph.ops.deltanet.numpy  # noqa: F401
import toygraph.ops.slicing.numpy  # noqa: F401
import toygraph.ops.preference.numpy  # noqa: F401
import toygraph.ops.experts.numpy  # noqa: F401
import toygraph.ops.policy.numpy  # noqa: F401
import toygraph.ops.stochastic.numpy  # noqa: F401
# isort: on

__all__ = ["BLOCK_KERNELS", "F32", "I32", "INT32_MAX", "KERNELS", "LABELS", "NONE", "OPS",
           "OpSpec", "block_kernel", "check", "check_floats", "define_op", "kernel", "make_node", "broadcast_shapes",
           "contiguous", "expand", "permute", "reshape", "sum", "sum_to", "unpack", "add",
           "geglu", "glu", "gelu", "gelu_back", "mean", "mul", "scale", "silu", "silu_back", "sub",
           "swiglu", "swiglu_oai", "sigmoid", "softcap", "rms_norm", "softmax", "rope", "attention",
           "matmul", "matmul_add", "get_rows", "count_valid", "cross_entropy", "linear_cross_entropy",
           "accumulate", "adamw", "global_norm", "log1mexp", "log_sigmoid", "softplus",
           "token_logprobs", "cache_write", "causal_conv1d", "delta_rule", "narrow", "all_reduce",
           "expert_matmul", "group_by_expert", "take_along", "topk", "clipped_surrogate",
           "kl_penalty", "inv_row_norm", "dropout"]
