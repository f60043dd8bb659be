"""The model families toygraph runs, as data: one `Family` per GGUF architecture.

The decoder builder (models/decoder.py), the GGUF loader (models/config.py) and the
adapter exporters (adapters.py) read these descriptions; none of them branches on the
architecture's name. Adding a family means adding one `Family` here and its parity tests.

Every block is the same pre-norm decoder layer::

    x = attn_norm(h);  q, k, v = proj(x);  [q_norm(q), k_norm(k)];  rope(q, k)
    a = attn_output(attention(q, k, v));   [a = post_attention_norm(a)];  h = h + a
    x = ffn_norm(h);   f = ffn_down(act(ffn_gate(x)) * ffn_up(x));  [post_ffw_norm(f)];  h = h + f

and the families differ only in the bracketed parts and the numbers below. Sources:
llama.cpp (src/llama-model.cpp hparams and graph builders, convert_hf_to_gguf.py) and
Hugging Face transformers (modeling_llama/qwen2/qwen3/gemma3.py and its GGUF loader).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Metadata keys (after "<arch>.") every family understands. The loader fails on any other
# "<arch>." key, so a key that would change the math is never silently skipped.
COMMON_KEYS = frozenset({
    "block_count", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear",
    # YaRN (models/config.py _yarn: used, or refused when they ask for what is not built)
    "rope.scaling.original_context_length", "rope.scaling.attn_factor",
    "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_ext_factor",
    "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_log_multiplier",
    # Harmless: they describe the file or the training run, not the function computed.
    "context_length", "vocab_size", "rope.scaling.finetuned",
})

# Keys understood only with the value 0: a dense model saying it has no experts (some
# llama-arch converters write them). Any other value (a mixture of experts) is refused.
ZERO_ONLY_KEYS = frozenset({"expert_count", "expert_used_count"})

# The mixture-of-experts keys a family with ``moe`` understands (models/config.py reads
# each: implemented, or refused in one line when its value asks for what is not built:
# shared experts, a gating function other than softmax). Expert groups and the other
# MoE keys of llama.cpp are not listed, so a file carrying them is refused as not understood.
MOE_KEYS = frozenset({
    "expert_count", "expert_used_count", "expert_feed_forward_length",
    "expert_weights_norm", "expert_weights_scale", "expert_gating_func",
    "leading_dense_block_count", "expert_shared_count", "expert_shared_feed_forward_length",
})

# Hugging Face module paths inside a decoder layer, by GGUF projection name. The four
# families share them (LlamaDecoderLayer, Qwen2/3DecoderLayer, Gemma3DecoderLayer).
HF_LAYER_MODULES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Family:
    """What makes one architecture's decoder differ from the plain Llama one.

    ``rope_mode``: "normal" (adjacent pairs; llama GGUFs store Q/K rows permuted for it)
    or "neox" (rotate-half; rows stored as Hugging Face has them). ``qk_permuted`` says
    whether lora_B rows of q/k need reordering at the Hugging Face boundary.
    ``ffn``: "swiglu" (SiLU-gated) or "geglu" (tanh-GELU-gated).
    ``qk_norm``: per-head RMSNorm of q and k before rope (attn_q_norm / attn_k_norm).
    ``post_norms``: RMSNorm of the attention and FFN outputs before each residual add
    (post_attention_norm / post_ffw_norm).
    ``qkv_bias``: attn_q/k/v biases allowed (they are used when present).
    ``embed_scale_sqrt``: token embeddings multiplied by sqrt(n_embd).
    ``swa_period``: 0, or N: sliding-window attention (window from
    ``attention.sliding_window``) on every layer i except those with (i + 1) % N == 0;
    the file's ``attention.sliding_window_pattern`` (an integer) overrides N, with
    llama.cpp's meaning (0: every layer sliding).
    ``swa_rope_base``: rope base of the sliding layers (the file's base is used on the
    global ones; None: the file's base everywhere); ``swa_rope_scaled``: whether the
    file's rope scaling applies to the sliding layers too (Gemma 3: only the global ones).
    ``attn_scale_embd_layers``: layer counts where the attention scale is
    1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim) (Gemma 3 27B, as llama.cpp does).
    ``rope_freqs``: the optional ``rope_freqs.weight`` frequency factors (Llama 3.x).
    ``default_rope_base``: used when ``rope.freq_base`` is absent; None where llama.cpp
    (10000) and transformers (Gemma 3: 1e6) disagree, so the key is required.
    ``yarn``: YaRN rope scaling (rope.scaling.type "yarn") is implemented for the family
    (on every layer; models/config.py _yarn).
    ``ffn_norm``: the name of the RMSNorm before the FFN (gpt-oss's GGUFs call it
    post_attention_norm). ``o_bias``: attn_output has a bias. ``sinks``: each layer's
    attention has per-head sinks (attn_sinks.weight; ops.attention). ``expert_bias``: the
    router and the experts have biases.
    ``extra_keys``: metadata keys understood beyond COMMON_KEYS.
    ``moe``: the FFN of every layer from ``leading_dense_block_count`` on is a mixture of
    experts (models/moe.py): a router ``ffn_gate_inp`` and stacked experts
    ``ffn_{gate,up,down}_exps``. ``router``: how the k experts and their weights come from
    the router logits: "softmax_topk" (softmax over all experts, the k most probable, their
    probabilities renormalised to sum 1 when ``expert_weights_norm``) or "topk_softmax"
    (the k largest logits, softmax over those k). ``expert_weights_norm``: its default
    when the file has no ``expert_weights_norm`` key (llama.cpp's per-family choice).
    """

    arch: str
    rope_mode: str
    qk_permuted: bool
    ffn: str = "swiglu"
    qk_norm: bool = False
    post_norms: bool = False
    qkv_bias: bool = False
    embed_scale_sqrt: bool = False
    swa_period: int = 0
    swa_rope_base: float | None = 10000.0
    swa_rope_scaled: bool = False
    attn_scale_embd_layers: tuple[int, ...] = ()
    rope_freqs: bool = False
    default_rope_base: float | None = 10000.0
    extra_keys: frozenset = frozenset()
    yarn: bool = False
    ffn_norm: str = "ffn_norm"
    o_bias: bool = False
    sinks: bool = False
    expert_bias: bool = False
    moe: bool = False
    router: str = "softmax_topk"
    expert_weights_norm: bool = False
    hf_modules: dict = field(default_factory=lambda: dict(HF_LAYER_MODULES))

    @property
    def keys(self) -> frozenset:
        return COMMON_KEYS | self.extra_keys | (MOE_KEYS if self.moe else frozenset())


FAMILIES = {f.arch: f for f in (
    # Llama 2/3.x, SmolLM2, Mistral (llama.cpp writes Mistral as "llama").
    Family(arch="llama", rope_mode="normal", qk_permuted=True, qkv_bias=True, rope_freqs=True),
    Family(arch="qwen2", rope_mode="neox", qk_permuted=False, qkv_bias=True),
    Family(arch="qwen3", rope_mode="neox", qk_permuted=False, qk_norm=True),
    # Gemma 3 text. llama.cpp: n_swa_pattern 6, rope_freq_base_train_swa 10000 and
    # rope_freq_scale_train_swa 1, f_attention_scale 1/sqrt(n_embd_head_k) except 27B
    # (62 layers: 1/sqrt(n_embd/n_head)). GGUF norm weights already hold Gemma's 1 + w.
    Family(arch="gemma3", rope_mode="neox", qk_permuted=False, ffn="geglu", qk_norm=True,
           post_norms=True, embed_scale_sqrt=True, swa_period=6, swa_rope_base=10000.0,
           attn_scale_embd_layers=(62,), default_rope_base=None,
           extra_keys=frozenset({"attention.sliding_window", "attention.sliding_window_pattern",
                                 "rope.freq_base_swa"})),
    # Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3 attention, every FFN a mixture of
    # experts. llama.cpp's build_moe_ffn for it: softmax gating, weights renormalised
    # (norm_w = true; transformers: norm_topk_prob, true in the released configs).
    Family(arch="qwen3moe", rope_mode="neox", qk_permuted=False, qk_norm=True, moe=True,
           router="softmax_topk", expert_weights_norm=True),
    # gpt-oss (20b, 120b): llama.cpp's llama_model_openai_moe. Sliding window on even
    # layers (load_swa_pattern(ml, 2)) with the file's rope base and scaling on every
    # layer; q/k/v/o biases, attention sinks; the FFN norm is stored as
    # post_attention_norm; router with bias, top-k then softmax (SOFTMAX_WEIGHT gating),
    # experts with biases and the clamped SwiGLU (LLM_FFN_SWIGLU_OAI_MOE).
    Family(arch="gpt-oss", rope_mode="neox", qk_permuted=False, ffn="swiglu_oai",
           qkv_bias=True, o_bias=True, sinks=True, ffn_norm="post_attention_norm",
           swa_period=2, swa_rope_base=None, swa_rope_scaled=True, yarn=True, moe=True,
           router="topk_softmax", expert_bias=True,
           extra_keys=frozenset({"attention.sliding_window", "attention.sliding_window_pattern",
                                 "rope.freq_base_swa"})),
)}
