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

    Gemma 4's parts (all off elsewhere): ``v_norm``, an
    RMSNorm without weight of v per head; ``attn_scale_one``, softmax scale 1 (the q/k norms
    set it); ``k_eq_v``, a layer without ``attn_v`` uses its key projection as values;
    ``kv_sharing``, the last ``attention.shared_kv_layers`` layers attend with the K/V of
    the last earlier layer of their kind (sliding or global); ``per_layer_inputs``, the
    per-layer input embeddings (``per_layer_token_embd``, ``per_layer_model_proj``, and
    per block ``inp_gate``/``proj``/``post_norm``); ``layer_output_scale``, each block's
    output times its ``layer_output_scale`` scalar; ``global_rope_freqs``,
    ``rope_freqs.weight`` applies to the global layers only (llama.cpp's encoding of
    "proportional" partial rope). Per-layer head sizes, KV-head counts and FFN widths come
    from the file (``*_swa`` keys, arrays) for any family that lists those keys.

    Qwen3.5's parts: ``deltanet``, the layers ``attention.recurrent_layers`` marks are Gated
    DeltaNet layers (models/deltanet.py) instead of attention; ``attn_output_gate``, the
    attention's q projection holds [q | gate] per head and the output is o * sigmoid(gate)
    (its GGUFs, like gpt-oss's, call the pre-FFN norm post_attention_norm: ``ffn_norm``).
    ``moe``: the FFN of every layer from ``leading_dense_block_count`` on is a mixture of
    experts (models/moe.py): a router ``ffn_gate_inp`` and stacked experts
    ``ffn_{gate,up,down}_exps``. ``router``: how the k experts and their weights come from
    the router logits: "softmax_topk" (softmax over all experts, the k most probable, their
    probabilities renormalised to sum 1 when ``expert_weights_norm``) or "topk_softmax"
    (the k largest logits, softmax over those k). ``expert_weights_norm``: its default
    when the file has no ``expert_weights_norm`` key (llama.cpp's per-family choice).
    ``hf_gate_up``: how transformers' fused ``mlp.experts.gate_up_proj`` orders the gate and
    up rows, "halves" (gate then up: Qwen3-MoE) or "interleaved" (gpt-oss); expert LoRA
    export follows it (adapters/experts.py).
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
    hf_gate_up: str = "halves"
    hf_modules: dict = field(default_factory=lambda: dict(HF_LAYER_MODULES))
    v_norm: bool = False
    attn_scale_one: bool = False
    k_eq_v: bool = False
    kv_sharing: bool = False
    per_layer_inputs: bool = False
    layer_output_scale: bool = False
    global_rope_freqs: bool = False
    deltanet: bool = False
    attn_output_gate: bool = False

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
    # Gemma 4 text (E2B/E4B/31B; the MoE variant's expert keys are refused). llama.cpp's
    # converter: norm weights stored as used (no 1 + w), head sizes and rope dims per layer
    # kind (*_swa), per-layer KV-head counts and FFN widths as arrays, the sliding pattern
    # as a bool array, rope_freqs (1 on rotated pairs, 1e30 elsewhere) for the global layers.
    Family(arch="gemma4", rope_mode="neox", qk_permuted=False, ffn="geglu", qk_norm=True,
           post_norms=True, embed_scale_sqrt=True, swa_period=6, default_rope_base=None,
           rope_freqs=True, v_norm=True, attn_scale_one=True, k_eq_v=True, kv_sharing=True,
           per_layer_inputs=True, layer_output_scale=True, global_rope_freqs=True,
           extra_keys=frozenset({
               "attention.sliding_window", "attention.sliding_window_pattern",
               "rope.freq_base_swa", "attention.key_length_swa", "attention.value_length_swa",
               "rope.dimension_count_swa", "attention.shared_kv_layers",
               "embedding_length_per_layer_input", "final_logit_softcapping"})),
    # Qwen3.5 (dense): three Gated DeltaNet layers to one gated full-attention layer, as
    # ``attention.recurrent_layers`` says. Norm weights stored as 1 + w (llama.cpp's
    # converter), the DeltaNet's gated norm as is. ``rope.dimension_sections`` (M-RoPE)
    # splits the rotary pairs among position streams that are all the same for text, so
    # it is plain partial neox rope here.
    Family(arch="qwen35", rope_mode="neox", qk_permuted=False, qk_norm=True, deltanet=True,
           attn_output_gate=True, ffn_norm="post_attention_norm",
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
           router="topk_softmax", expert_bias=True, hf_gate_up="interleaved",
           extra_keys=frozenset({"attention.sliding_window", "attention.sliding_window_pattern",
                                 "rope.freq_base_swa"})),
)}
