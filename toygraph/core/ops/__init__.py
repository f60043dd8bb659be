"""The ops, one module per family. Each family module holds, for each of its ops, the
builder function, the shape/dtype rule and backward rule (entered in ``OPS``), the numpy
kernel (``KERNELS``) and the CUDA lowering (``toygraph.cuda.lowering.registry.REGISTRY``), and its
CUDA kernels sit beside it in ``<family>.cu``. Adding an op means one family module (and
its ``.cu``) and its tests.

No family module is named like an op: ``ops.matmul`` is the op's builder, so the module
that defines it is ``ops.gemm`` (likewise ``ops.rotary`` for rope, ``ops.flash_attention``
for attention).

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

>>> from toygraph.core import ops
>>> y = ops.rms_norm(x, 1e-5)                     # doctest: +SKIP
"""
from __future__ import annotations

# The families in the order of the table above (isort would sort them).
# isort: off
from toygraph.core.ops.table import (BLOCK_KERNELS, F32, I32, INT32_MAX, KERNELS, LABELS, NONE,
                                     OPS, OpSpec, block_kernel, check, check_floats, define_op,
                                     kernel, make_node)
from toygraph.core.ops.shape import (broadcast_shapes, contiguous, expand, permute, reshape,
                                     sum, sum_to, unpack)
from toygraph.core.ops.elementwise import (add, gelu, gelu_back, mean, mul, scale, silu, sigmoid,
                                           silu_back, softcap, sub, swiglu_oai)
from toygraph.core.ops.gated import geglu, glu, swiglu
from toygraph.core.ops.norm import inv_row_norm, rms_norm, softmax
from toygraph.core.ops.rotary import rope
from toygraph.core.ops.flash_attention import attention
from toygraph.core.ops.gemm import matmul, matmul_add
from toygraph.core.ops.rows import get_rows
from toygraph.core.ops.loss import count_valid, cross_entropy, linear_cross_entropy
from toygraph.core.ops.update import accumulate, adamw, global_norm
from toygraph.core.ops.collective import all_reduce
from toygraph.core.ops.cache import cache_write
from toygraph.core.ops.deltanet import causal_conv1d, delta_rule
from toygraph.core.ops.slicing import narrow
from toygraph.core.ops.preference import log1mexp, log_sigmoid, softplus, token_logprobs
from toygraph.core.ops.experts import expert_matmul, group_by_expert, take_along, topk
from toygraph.core.ops.policy import clipped_surrogate, kl_penalty
from toygraph.core.ops.stochastic import dropout
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
           "kl_penalty"]
