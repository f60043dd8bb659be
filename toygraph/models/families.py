"""The model families toygraph runs, as data: one `Family` per GGUF architecture.

A family is the prototype of its layers (models/parts.py: which parts, with the flags the
family may have) and the few facts its reader (models/config.py) needs to turn a file's
metadata into the layer list: the sliding-window pattern, rope defaults and frequency
factors, the metadata keys it understands, and the Hugging Face names export uses. The
decoder builder, the cache and the exporters read the layer list, never the family's
name. A family that recombines existing parts is added by one `Family` here and its parity
tests.

Sources: llama.cpp (src/llama-model.cpp hparams and graph builders, convert_hf_to_gguf.py)
and Hugging Face transformers (modeling_<family>.py and its GGUF loader).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from toygraph.models.parts import Attention, Dense, Experts, Layer, Rope

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

# The mixture-of-experts keys a family whose layers have Experts understands
# (models/config.py reads each: implemented, or refused in one line when its value asks for
# what is not built: shared experts where the family has none, a gating function other
# than softmax). Expert groups and the other MoE keys of llama.cpp are not listed, so a file
# carrying them is refused as not understood.
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
class Sliding:
    """Sliding-window attention on every layer i except those with (i + 1) % ``period`` ==
    0, the window from ``attention.sliding_window``; the file's
    ``attention.sliding_window_pattern`` overrides the period (an integer, with llama.cpp's
    meaning, 0: every layer sliding; or per-layer "is sliding" booleans, Gemma 4).
    ``rope_base``: the sliding layers' rope base when the file has no
    ``rope.freq_base_swa`` (None: the file's base); ``rope_scaled``: whether the file's
    rope scaling applies to the sliding layers too (Gemma 3: only the global ones)."""

    period: int
    rope_base: float | None = 10000.0
    rope_scaled: bool = False


@dataclass(frozen=True)
class Family:
    """One architecture: the prototype of its layers and what its reader needs.

    ``layer``: the parts every block has, with the family's flags (models/parts.py); the
    reader fills in the numbers, makes the layers ``attention.recurrent_layers`` marks
    DeltaNet layers (``deltanet``, Qwen3.5), the FFNs before ``leading_dense_block_count``
    dense, and keeps a bias where the file has it.
    ``sliding``: the sliding-window pattern, or None (every layer full attention).
    ``rope_freqs``: where the optional ``rope_freqs.weight`` frequency factors apply:
    "" nowhere (the tensor is refused), "all" (Llama 3.x) or "global" (the full-attention
    layers only: llama.cpp's encoding of Gemma 4's "proportional" partial rope).
    ``yarn``: YaRN rope scaling (rope.scaling.type "yarn") is implemented for the family
    (on every layer; models/config.py _yarn).
    ``default_rope_base``: used when ``rope.freq_base`` is absent; None where llama.cpp
    (10000) and transformers (Gemma 3: 1e6) disagree, so the key is required.
    ``attn_scale_embd_layers``: layer counts where the attention scale is
    1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim) (Gemma 3 27B, as llama.cpp does).
    ``embed_scale_sqrt``: token embeddings multiplied by sqrt(n_embd).
    ``kv_sharing``: the last ``attention.shared_kv_layers`` layers attend with the K/V of
    the last earlier layer of their kind (sliding or global), Gemma 4.
    ``extra_keys``: metadata keys understood beyond COMMON_KEYS (and MOE_KEYS, which every
    family with Experts understands). Per-layer head sizes, KV-head counts and FFN widths
    come from the file (``*_swa`` keys, arrays) for any family that lists those keys, and
    so do Gemma 4's per-layer input embeddings (``embedding_length_per_layer_input``:
    ``per_layer_token_embd``, ``per_layer_model_proj``; per block ``inp_gate``/``proj``/
    ``post_norm``).
    ``hf_modules``: Hugging Face module paths by GGUF projection, for PEFT export;
    ``hf_gate_up``: how transformers' fused ``mlp.experts.gate_up_proj`` orders the gate and
    up rows, "halves" (gate then up) or "interleaved" (gpt-oss); expert LoRA export follows
    it (adapters/experts.py).
    """

    arch: str
    layer: Layer
    sliding: Sliding | None = None
    rope_freqs: str = ""
    yarn: bool = False
    default_rope_base: float | None = 10000.0
    attn_scale_embd_layers: tuple[int, ...] = ()
    embed_scale_sqrt: bool = False
    kv_sharing: bool = False
    deltanet: bool = False
    extra_keys: frozenset = frozenset()
    hf_modules: dict = field(default_factory=lambda: dict(HF_LAYER_MODULES))
    hf_gate_up: str = "halves"

    @property
    def keys(self) -> frozenset:
        moe = isinstance(self.layer.ffn, Experts)
        return COMMON_KEYS | self.extra_keys | (MOE_KEYS if moe else frozenset())

    @property
    def rope_mode(self) -> str:
        return self.layer.mixer.rope.mode

    @property
    def qk_permuted(self) -> bool:
        """Whether the GGUF stores q/k rows permuted for "normal" rope (llama's converter
        does; transformers rotates halves), so lora_B rows of q/k need reordering at the
        Hugging Face boundary (adapters/files.py hf_row_order)."""
        return self.rope_mode == "normal"


NORMAL, NEOX = Rope(mode="normal"), Rope(mode="neox")
SWA_KEYS = frozenset({"attention.sliding_window", "attention.sliding_window_pattern",
                      "rope.freq_base_swa"})

FAMILIES = {f.arch: f for f in (
    # Llama 2/3.x, SmolLM2, Mistral (llama.cpp writes Mistral as "llama").
    Family(arch="llama", layer=Layer(Attention(rope=NORMAL, bias=True), Dense()),
           rope_freqs="all"),
    Family(arch="qwen2", layer=Layer(Attention(rope=NEOX, bias=True), Dense())),
    Family(arch="qwen3", layer=Layer(Attention(rope=NEOX, qk_norm=True), Dense())),
    # Gemma 3 text. llama.cpp: n_swa_pattern 6, rope_freq_base_train_swa 10000 and
    # rope_freq_scale_train_swa 1, f_attention_scale 1/sqrt(n_embd_head_k) except 27B
    # (62 layers: 1/sqrt(n_embd/n_head)). GGUF norm weights already hold Gemma's 1 + w.
    Family(arch="gemma3", layer=Layer(Attention(rope=NEOX, qk_norm=True), Dense(activation="geglu"),
                                      post_norms=True),
           sliding=Sliding(period=6, rope_base=10000.0), attn_scale_embd_layers=(62,),
           default_rope_base=None, embed_scale_sqrt=True, extra_keys=SWA_KEYS),
    # Gemma 4 text (E2B/E4B/31B; the MoE variant's expert keys are refused). llama.cpp's
    # converter: norm weights stored as used (no 1 + w), head sizes and rope dims per layer
    # kind (*_swa), per-layer KV-head counts and FFN widths as arrays, the sliding pattern
    # as a bool array, rope_freqs (1 on rotated pairs, 1e30 elsewhere) for the global layers.
    # Softmax scale 1 (the q/k norms set it).
    Family(arch="gemma4",
           layer=Layer(Attention(rope=NEOX, scale=1.0, qk_norm=True, v_norm=True,
                                 keys_as_values=True),
                       Dense(activation="geglu"), post_norms=True, output_scale=True),
           sliding=Sliding(period=6, rope_base=10000.0), rope_freqs="global",
           default_rope_base=None, embed_scale_sqrt=True,
           kv_sharing=True,
           extra_keys=SWA_KEYS | {
               "attention.key_length_swa", "attention.value_length_swa",
               "rope.dimension_count_swa", "attention.shared_kv_layers",
               "embedding_length_per_layer_input", "final_logit_softcapping"}),
    # Qwen3.5 (dense): three Gated DeltaNet layers to one gated full-attention layer, as
    # ``attention.recurrent_layers`` says. Norm weights stored as 1 + w (llama.cpp's
    # converter), the DeltaNet's gated norm as is; the pre-FFN norm is called
    # post_attention_norm. ``rope.dimension_sections`` (M-RoPE) splits the rotary pairs
    # among position streams that are all the same for text, so it is plain partial neox
    # rope here.
    Family(arch="qwen35", layer=Layer(Attention(rope=NEOX, qk_norm=True, out_gate=True), Dense(),
                                      ffn_norm="post_attention_norm"),
           deltanet=True,
           extra_keys=frozenset({
               "ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank",
               "ssm.inner_size", "attention.recurrent_layers", "full_attention_interval",
               "rope.dimension_sections"}),
           hf_modules={**HF_LAYER_MODULES, "attn_qkv": "linear_attn.in_proj_qkv",
                       "attn_gate": "linear_attn.in_proj_z", "ssm_alpha": "linear_attn.in_proj_a",
                       "ssm_beta": "linear_attn.in_proj_b", "ssm_out": "linear_attn.out_proj"}),
    # Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3 attention, every FFN a mixture of
    # experts. llama.cpp's build_moe_ffn for it: softmax gating, weights renormalised
    # (norm_w = true; transformers: norm_topk_prob, true in the released configs).
    Family(arch="qwen3moe", layer=Layer(Attention(rope=NEOX, qk_norm=True),
                                        Experts(router="softmax_topk", norm_weights=True))),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention, every FFN a mixture
    # of experts and a shared expert. llama.cpp's llm_build_qwen2moe: softmax gating, the
    # chosen weights not renormalised (norm_w = false; transformers' norm_topk_prob, false
    # in the released configs), the shared expert's output times sigmoid(x ffn_gate_inp_shexp).
    Family(arch="qwen2moe", layer=Layer(Attention(rope=NEOX, bias=True),
                                        Experts(router="softmax_topk", shared=Dense()))),
    # gpt-oss (20b, 120b): llama.cpp's llama_model_openai_moe. Sliding window on even
    # layers (load_swa_pattern(ml, 2)) with the file's rope base and scaling on every
    # layer; q/k/v/o biases, attention sinks; the FFN norm is stored as
    # post_attention_norm; router with bias, top-k then softmax (SOFTMAX_WEIGHT gating),
    # experts with biases and the clamped SwiGLU (LLM_FFN_SWIGLU_OAI_MOE).
    Family(arch="gpt-oss",
           layer=Layer(Attention(rope=NEOX, bias=True, out_bias=True, sinks=True),
                       Experts(activation="swiglu_oai", router="topk_softmax", bias=True),
                       ffn_norm="post_attention_norm"),
           sliding=Sliding(period=2, rope_base=None, rope_scaled=True), yarn=True,
           extra_keys=SWA_KEYS, hf_gate_up="interleaved"),
)}
