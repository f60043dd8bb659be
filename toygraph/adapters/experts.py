"""Expert LoRA adapters (models/decoder.EXPERT_TARGETS) at the file boundaries.

In memory an expert adapter is stacked per expert, in the GGUF layout the graph computes
in: A [E, r, n_in], B [E, n_out, r], for ``blk.N.ffn_down_exps.weight`` and for
``blk.N.ffn_gate_up_exps.weight``, the one adapter the gate and up experts share (B's rows:
the gate's n_ff_exp, then the up's).

PEFT (0.17+, with transformers 5's fused experts): the experts of Qwen3-MoE and gpt-oss are
3-D parameters ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``, adapted through
``target_parameters`` (PEFT's ParamWrapper): one ``lora_A`` [E * r, n_in] and one
``lora_B`` [n_out, r * E] per parameter, read back as ``A.reshape(E, r, n_in)`` and
``B.reshape(n_out, r, E)`` (rank-major, expert-minor columns). The gate/up rows of
``gate_up_proj`` are the gate's then the up's for Qwen3-MoE (``chunk(2)``) and interleaved
for gpt-oss (``[..., ::2]`` the gate): Family.hf_gate_up. Two adapted parameters of one
module nest: PEFT wraps them in the module's parameter order (gate_up_proj, then down_proj,
in both families; not the order of ``target_parameters``, which it saves from a set), so
gate_up_proj's keys sit one ``base_layer.`` deeper than down_proj's.

llama.cpp (llama-graph.cpp's build_lora_mm_id) adds ``<ffn_*_exps>.weight.lora_a`` ne
[n_in, r, E] and ``.lora_b`` ne [r, n_out, E] to each expert matmul (mul_mat_id over the
same ids): the numpy shapes above. It has separate gate and up expert tensors for these
families, so the shared adapter is written twice, A the same, B split (exact)."""
from __future__ import annotations

import numpy as np

from toygraph.errors import DataError

GATE_UP, DOWN = "ffn_gate_up_exps", "ffn_down_exps"
#: GGUF expert projection -> the Hugging Face parameter inside a decoder layer, in the
#: order the experts module defines them (PEFT's nesting order).
HF_EXPERT_PARAMS = {GATE_UP: "mlp.experts.gate_up_proj", DOWN: "mlp.experts.down_proj"}


def is_expert(name: str) -> bool:
    """Whether GGUF weight ``name`` ("blk.N.<proj>.weight") is an expert adapter's."""
    return name.split(".")[-2] in HF_EXPERT_PARAMS


def _gate_up_rows(cfg) -> bool:
    """True when the Hugging Face gate_up_proj interleaves the gate and up rows."""
    return cfg.family.hf_gate_up == "interleaved"


def to_peft(name: str, a: np.ndarray, b: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's (lora_A [E * r, n_in], lora_B [n_out, r * E]) of a stacked expert adapter."""
    E, r, n_in = a.shape
    n_out = b.shape[1]
    if name.split(".")[-2] == GATE_UP and _gate_up_rows(cfg):
        f = n_out // 2
        b = np.stack([b[:, :f], b[:, f:]], axis=2).reshape(E, n_out, r)   # g0 u0 g1 u1 ...
    return (np.ascontiguousarray(a.reshape(E * r, n_in), np.float32),
            np.ascontiguousarray(b.transpose(1, 2, 0).reshape(n_out, r * E), np.float32))


def from_peft(name: str, a: np.ndarray, b: np.ndarray, cfg, where: str):
    """The stacked (A [E, r, n_in], B [E, n_out, r]) of PEFT's expert lora_A / lora_B."""
    E = cfg.n_expert
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] % E or b.shape[1] != a.shape[0]:
        raise DataError(f"{where}: {name!r} expert adapter shapes A {a.shape}, B {b.shape} are "
                        f"not PEFT's [{E} * r, n_in] and [n_out, r * {E}] for {E} experts")
    r = a.shape[0] // E
    a3 = a.reshape(E, r, a.shape[1])
    b3 = b.reshape(b.shape[0], r, E).transpose(2, 0, 1)
    if name.split(".")[-2] == GATE_UP and _gate_up_rows(cfg):
        b3 = np.concatenate([b3[:, 0::2], b3[:, 1::2]], axis=1)
    return np.ascontiguousarray(a3, np.float32), np.ascontiguousarray(b3, np.float32)


def peft_keys(layer: int, procs: list[str]) -> dict[str, str]:
    """The PEFT key prefix of each adapted expert parameter of one layer, ``procs`` in
    HF_EXPERT_PARAMS order (the first one the most deeply nested)."""
    n = len(procs)
    base = f"base_model.model.model.layers.{layer}.mlp.experts."
    return {proj: base + "base_layer." * (n - 1 - i) for i, proj in enumerate(procs)}


def per_base_tensor(lora: dict) -> dict:
    """The adapter by GGUF base tensor: the shared gate/up adapter becomes one for
    ``ffn_gate_exps`` and one for ``ffn_up_exps`` (the same A, B's halves); everything else
    as it is. What llama.cpp's adapter GGUF holds and what a merge adds."""
    out = {}
    for name, pair in lora.items():
        if name.split(".")[-2] != GATE_UP:
            out[name] = pair
            continue
        a, b = pair
        f = b.shape[1] // 2
        out[name.replace(GATE_UP, "ffn_gate_exps")] = (a, np.ascontiguousarray(b[:, :f]))
        out[name.replace(GATE_UP, "ffn_up_exps")] = (a, np.ascontiguousarray(b[:, f:]))
    return out
