"""PyTorch's side of the cost model (bench/studies/roofline.py): what PyTorch eager + PEFT launches
for the same LoRA step that bench/bench_lora.py times as "torch" on a GPU.

The forward and backward are not guessed: the transformers Llama model (bf16, sdpa
attention) with PEFT LoRA adapters is run on PyTorch's ``meta`` device (shapes only, no
memory, no GPU) under a dispatch mode that records every aten op with its operand shapes
and dtypes, as bench_lora's ``child_torch`` calls it (``model(input_ids=...)``, then
``cross_entropy(logits.float(), ...)``, ``backward()``). What the meta device cannot show
is patched to what CUDA does, each patch stated:

- transformers builds no mask for sdpa when there is no padding and calls
  ``scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)``; on CUDA with bf16
  that is the FlashAttention-2 backend, the one SDPA backend that takes enable_gqa
  (pytorch/pytorch#139586), reading K/V in place (one forward kernel; a backward of
  three: dot(dO, O), dq/dk/dv, dq convert). On meta SDPA would decompose into the math path, so
  it is replaced by a function recording one "flash_fwd" / "flash_bwd" op per call.
- ``find_packed_sequence_indices`` (a data-dependent check) is skipped: no packing.

Each recorded op becomes one launch (views and metadata ops none): a GEMM (mm/addmm/bmm,
cuBLAS: bf16 on tensor cores, f32 on CUDA cores since torch's default matmul precision is
"highest"), FlashAttention, or a memory-bound kernel reading its tensor operands and
writing its outputs once. PEFT keeps the adapters in f32 on a bf16 model
(autocast_adapter_dtype) and casts x to f32 for them: those casts, the f32 LoRA GEMMs and
the f32 ``result + lora * scaling`` show up in the trace as PyTorch launches them.

The optimizer is not traced (the meta device has no fused AdamW): ``optimizer_launches``
models ``clip_grad_norm_`` (foreach norm, stack, norm, clamp, foreach mul) and
``AdamW(fused=True)`` (multi-tensor launches of at most 36 tensors: param, grad, m, v) as
PyTorch's multi_tensor_apply groups them.
"""
from __future__ import annotations

from math import ceil

from roofline_plan import Cost

VIEW_OPS = {"view", "_unsafe_view", "t", "transpose", "expand", "slice", "unsqueeze", "squeeze",
            "detach", "alias", "permute", "as_strided", "select", "split", "unbind",
            "_reshape_alias", "reshape", "empty_like", "empty", "lift_fresh"}
GEMM_OPS = {"mm", "addmm", "bmm"}
SFU_OPS = {"silu", "silu_backward", "rsqrt", "exp", "sin", "cos", "log", "tanh", "sigmoid",
           "_log_softmax", "_softmax", "_safe_softmax", "pow"}
REDUCTION_OPS = {"sum", "mean", "norm", "linalg_vector_norm", "amax"}
LOSS_OPS = {"_log_softmax", "_log_softmax_backward_data", "nll_loss_forward",
            "nll_loss_backward"}
ITEMSIZE = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4, "torch.int64": 8,
            "torch.int32": 4, "torch.bool": 1}


def trace(dims: dict, *, batch: int, seq: int, targets, rank: int, alpha: float):
    """[(op name, [(shape, dtype) of tensor operands], [(shape, dtype) of outputs], extra)]
    of one forward + backward, in dispatch order."""
    import torch
    import transformers
    import peft
    import transformers.masking_utils as masking
    import transformers.models.llama.modeling_llama as llama
    from torch.utils._python_dispatch import TorchDispatchMode

    d = dims
    cfg = transformers.LlamaConfig(
        vocab_size=d["n_vocab"], hidden_size=d["n_embd"], intermediate_size=d["n_ff"],
        num_hidden_layers=d["n_layer"], num_attention_heads=d["n_head"],
        num_key_value_heads=d["n_head_kv"], max_position_embeddings=d["n_ctx"],
        rope_theta=d["rope_base"], tie_word_embeddings=True, rms_norm_eps=1e-5)
    cfg._attn_implementation = "sdpa"
    ops = []

    def meta(ts):
        return [(tuple(t.shape), str(t.dtype)) for t in ts if isinstance(t, torch.Tensor)]

    class Flash(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ops.append(("flash_fwd", meta((q, k, v)), meta((q,)), {}))
            ctx.shapes = meta((q, k, v))
            return torch.empty_like(q)

        @staticmethod
        def backward(ctx, g):
            ops.append(("flash_bwd", ctx.shapes + meta((g,)), ctx.shapes, {}))
            (qs, qd), (ks, kd), _ = ctx.shapes
            return (torch.empty(qs, dtype=g.dtype, device=g.device),
                    torch.empty(ks, dtype=g.dtype, device=g.device),
                    torch.empty(ks, dtype=g.dtype, device=g.device))

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if attn_mask is not None or not is_causal or dropout_p:
            raise ValueError("roofline_torch: expected causal SDPA without a mask or dropout")
        return Flash.apply(q, k, v)

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            ops.append((func.overloadpacket.__name__, meta(args), meta(outs), {}))
            return out

    saved = (torch.nn.functional.scaled_dot_product_attention,
             masking.find_packed_sequence_indices, llama.create_causal_mask)
    torch.nn.functional.scaled_dot_product_attention = sdpa
    masking.find_packed_sequence_indices = lambda *a, **k: None
    llama.create_causal_mask = lambda *a, **k: None   # sdpa without padding: no mask
    try:
        with torch.device("meta"):
            base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                 "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        model = peft.get_peft_model(base, peft.LoraConfig(
            r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=[names[t] for t in targets]))
        params = [p for p in model.parameters() if p.requires_grad]
        ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
        with Record():
            logits = model(input_ids=ids, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), ids.reshape(-1), ignore_index=-1)
            loss.backward()
    finally:
        (torch.nn.functional.scaled_dot_product_attention,
         masking.find_packed_sequence_indices, llama.create_causal_mask) = saved
    return ops, [p.numel() for p in params], {str(p.dtype) for p in params}


def _bytes(tensors) -> int:
    total = 0
    for shape, dtype in tensors:
        n = 1
        for s in shape:
            n *= s
        total += n * ITEMSIZE.get(dtype, 4)
    return total


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def flash_costs(name, ins, causal_tile: int = 128) -> list[Cost]:
    """FlashAttention-2's launches for one SDPA call: q [B, H, T, hd], k/v [B, KV, T, hd]
    (GQA read in place); causal tiles past the diagonal are skipped."""
    (qs, _), (ks, _) = ins[0], ins[1]
    B, H, T, hd = qs
    n = ceil(T / causal_tile)
    scores = B * H * T * T * (n + 1) / (2 * n)      # the visible tiles' scores
    qb, kb, lse = 2 * _numel(qs), 2 * _numel(ks), 4 * B * H * T
    if name == "flash_fwd":   # S = q k^T, O = P v
        return [Cost("flash_fwd", "attention", tc=4.0 * scores * hd, sfu=scores,
                     bytes=2 * qb + 2 * kb + lse, useful=4.0 * scores * hd)]
    # backward: D = rowsum(dO * O); S, dP, dV, dQ, dK (5 products); dq accumulated in f32
    return [Cost("flash_bwd_dot_do_o", "attention", fma=2.0 * _numel(qs), bytes=2 * qb + lse),
            Cost("flash_bwd_dq_dk_dv", "attention", tc=10.0 * scores * hd, sfu=scores,
                 bytes=3 * qb + 2 * kb + 2 * lse + 2 * qb + 2 * kb, useful=10.0 * scores * hd),
            Cost("flash_bwd_convert_dq", "attention", bytes=2 * qb + qb)]


def op_costs(ops) -> tuple[list[Cost], int, int]:
    """(the launches of the traced ops, the ops that launch, the view ops)."""
    costs, views, launching = [], 0, 0
    for name, ins, outs, _ in ops:
        if name in VIEW_OPS:
            views += 1
            continue
        launching += 1
        if name.startswith("flash_"):
            costs += flash_costs(name, ins)
            continue
        if name in GEMM_OPS:
            a, b = ins[-2], ins[-1]
            m, k = a[0][-2], a[0][-1]
            nb = _numel(a[0][:-2])
            flops = 2.0 * m * k * b[0][-1] * nb
            bf16 = a[1] in ("torch.bfloat16", "torch.float16")
            costs.append(Cost(f"cublas_{name}_{'bf16' if bf16 else 'f32'}",
                              "gemm cuBLAS bf16" if bf16 else "gemm cuBLAS f32 (CUDA cores)",
                              tc=flops if bf16 else 0.0, fma=0.0 if bf16 else flops,
                              bytes=_bytes(ins) + _bytes(outs), useful=flops))
            continue
        n = max((_numel(s) for s, _ in outs + ins), default=1)
        kind = ("loss (softmax rows)" if name in LOSS_OPS else
                "norm (row reductions)" if name in REDUCTION_OPS else "elementwise")
        costs.append(Cost(name, kind, fma=float(n), sfu=float(n) if name in SFU_OPS else 0.0,
                          bytes=_bytes(ins) + _bytes(outs), useful=float(n)))
    return costs, launching, views


def optimizer_launches(sizes: list[int]) -> list[Cost]:
    """clip_grad_norm_(foreach) and AdamW(fused=True) over f32 params of ``sizes``.

    multi_tensor_apply packs at most 110 tensors (depth 1: the norm, the scaling) or 36
    (depth 4: AdamW's param, grad, m, v) and 320 blocks of 65536-element chunks per launch."""
    n, total = len(sizes), sum(sizes)
    chunks = sum(ceil(s / 65536) for s in sizes)
    per_depth = lambda cap: max(ceil(n / cap), ceil(chunks / 320))  # noqa: E731
    k1, k4 = per_depth(110), per_depth(36)   # launches; the work splits among them
    costs = [Cost("foreach_norm", "adamw + clip", fma=2.0 * total / k1, bytes=4 * total / k1)
             for _ in range(k1)]
    costs.append(Cost("foreach_norm_cleanup", "adamw + clip", bytes=4 * n))
    costs += [Cost(k, "adamw + clip", bytes=4 * n) for k in ("stack", "vector_norm", "add",
                                                             "reciprocal_mul", "clamp")]
    costs += [Cost("foreach_mul_", "adamw + clip", fma=total / k1, bytes=8 * total / k1)
              for _ in range(k1)]
    costs.append(Cost("foreach_add_steps", "adamw + clip", bytes=8 * n))
    costs += [Cost("fused_adamw", "adamw + clip", fma=12.0 * total / k4, sfu=total / k4,
                   bytes=28 * total / k4) for _ in range(k4)]
    return costs
