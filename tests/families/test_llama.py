"""The Llama graph computes what the model computes: against Hugging Face transformers
loading the same GGUF (float32), and finite differences through the whole graph."""
import numpy as np
import pytest

from support.gradcheck import check_gradients
from toygraph import ops
from toygraph.errors import GraphError
from toygraph.models.model import GGUFModel
from toygraph.core.graph import Graph
from toygraph.models.decoder import BuildOptions, LoraConfig, WeightSource, build_decoder
from toygraph.core.session import Session


def toygraph_loss(path, tokens):
    """Mean next-token cross-entropy of ``tokens`` [batch, seq] by our graph (CPU, f32)."""
    m = GGUFModel(path)
    B, T = tokens.shape
    g = Graph()
    net = build_decoder(g, m.config, WeightSource(m), batch=B, seq_len=T)
    labels = g.input("labels", (B * T,), "i32")
    loss = g.output(ops.cross_entropy(net.logits, labels))
    s = Session(g)
    s.realize()
    s.upload(net.tokens, tokens)
    s.upload(net.positions, np.tile(np.arange(T, dtype=np.int32), (B, 1)))
    s.upload(labels, np.concatenate([tokens[:, 1:], np.full((B, 1), -1)], 1).ravel())
    s.run("forward")
    return float(s.download(loss))


def transformers_loss(path, tokens):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor(tokens, dtype=torch.long)).logits.double()
    lp = torch.log_softmax(logits[:, :-1], -1)
    return -lp.gather(-1, torch.tensor(tokens[:, 1:], dtype=torch.long)[..., None]).mean().item()


@pytest.mark.reference
@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen2", "tiny_llama_kquant"])
def test_tiny_models_match_transformers(which, request):
    path = request.getfixturevalue(which)
    vocab = GGUFModel(path).config.n_vocab
    tokens = np.random.default_rng(0).integers(0, vocab, size=(2, 16)).astype(np.int32)
    mine, ref = toygraph_loss(path, tokens), transformers_loss(path, tokens)
    print(f"{which}: toygraph {mine:.7f} transformers {ref:.7f}")
    assert abs(mine - ref) / ref <= 1e-4


@pytest.mark.reference   # not slow: the default run keeps one real file against transformers
def test_smollm2_matches_transformers(smollm2):
    from toygraph.gguf.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(smollm2)
    texts = ["The capital of France is Paris. It is known for the Eiffel Tower and",
             "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5, of course"]
    ids = [tok.encode(t) for t in texts]
    T = min(len(i) for i in ids)
    tokens = np.array([i[:T] for i in ids], np.int32)
    mine, ref = toygraph_loss(smollm2, tokens), transformers_loss(smollm2, tokens)
    print(f"SmolLM2 on real text: toygraph {mine:.7f} transformers {ref:.7f}")
    assert abs(mine - ref) / ref <= 1e-4
    assert mine < 5.0  # real text is predictable; random weights would give ~ln(49152)=10.8


def test_lora_gradients_through_the_whole_model(tiny_qwen2):
    """Finite differences (f64) for every LoRA param through embeddings, attention with
    rope and GQA, SwiGLU, tied/untied head and the loss. B starts non-zero here so the
    gradient of A is not trivially zero."""
    m = GGUFModel(tiny_qwen2)
    g = Graph()
    lora = LoraConfig(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=2, alpha=4,
                      init_scale=0.3)
    net = build_decoder(g, m.config, WeightSource(m), batch=2, seq_len=5, lora=lora)
    rng = np.random.default_rng(1)
    for a, b in net.lora.values():
        b.data = (rng.normal(size=b.shape) * 0.3).astype(np.float32)
    labels = g.input("labels", (10,), "i32")
    loss = ops.cross_entropy(net.logits, labels)
    toks = rng.integers(0, m.config.n_vocab, size=(2, 5)).astype(np.int32)
    lab = np.concatenate([toks[:, 1:], np.full((2, 1), -1)], 1).ravel().astype(np.int32)
    pos = np.tile(np.arange(5, dtype=np.int32), (2, 1))
    params = net.params[:4] + net.params[-4:]  # layer 0 and the last layer's adapters
    err = check_gradients(g, loss, params, {net.tokens: toks, net.positions: pos, labels: lab},
                          max_elems=12)
    assert err <= 1e-6


def lora_step_graph(path, T=12):
    """(graph, config) of a LoRA step on q, k, v, o of the GGUF at ``path``: the decoder
    over [2, T] tokens and its backward."""
    from toygraph.core.autodiff import backward
    m = GGUFModel(path)
    g = Graph()
    net = build_decoder(g, m.config, WeightSource(m), batch=2, seq_len=T,
                        lora=LoraConfig(targets=("q", "k", "v", "o")))
    labels = g.input("labels", (2 * T,), "i32")
    backward(ops.cross_entropy(net.logits, labels), net.params)
    return g, m.config


def assert_attention_is_token_major(path):
    """Every attention of a LoRA step reads q, k, v token-major, straight from rope, norms
    or the projections: no permute node (a gather kernel) before or after it, forward or
    backward."""
    g, cfg = lora_step_graph(path)
    atts = [t for t in g.nodes if t.op == "attention"]
    assert len(atts) == len(cfg.attention)
    assert all(t.attrs["layout"] == "bthd" for t in atts)
    near = {s.id for t in g.nodes if t.op in ("attention", "attention_back") for s in t.srcs}
    near |= {t.id for t in g.nodes if t.op == "unpack"
             and t.srcs[0].op in ("attention", "attention_back")}
    assert not [t for t in g.nodes if t.op == "permute"
                and (t.id in near or t.srcs[0].id in near)]


def test_attention_never_materialises_seq_by_seq_scores(tiny_llama):
    """Forward and backward of a LoRA step: no node is [.., T, T] (fused attention), each
    layer has one attention and one attention_back node, and nothing is permuted."""
    g, cfg = lora_step_graph(tiny_llama, T=12)
    assert not [t for t in g.nodes if t.shape[-2:] == (12, 12)]
    ops_used = [t.op for t in g.nodes]
    assert ops_used.count("attention") == ops_used.count("attention_back") == cfg.n_layer
    assert "permute" not in ops_used
    assert_attention_is_token_major(tiny_llama)


def test_build_errors(tiny_llama):
    m = GGUFModel(tiny_llama)
    with pytest.raises(GraphError, match="exceeds the model's context length"):
        build_decoder(Graph(), m.config, WeightSource(m), batch=1, seq_len=m.config.n_ctx + 1)
    with pytest.raises(GraphError, match="LoRA targets"):
        LoraConfig(targets=("q", "query"))
    with pytest.raises(GraphError, match="needs a GGUF model"):
        build_decoder(Graph(), m.config, WeightSource(), batch=1, seq_len=4)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("weights", ["frozen", "finetune"])
def test_fused_head_training_graph_equals_the_unfused_one(model, weights, request):
    """BuildOptions(logits=False) stops at hidden/head; the recipe's fused loss
    (linear_cross_entropy, used on CUDA) gives the unfused head's loss and gradients (f64),
    tied (tiny_llama) and untied (tiny_qwen2) heads, frozen (LoRA) or trainable."""
    from toygraph.core.autodiff import accumulate_grads, backward
    from toygraph.recipes.base import head_loss
    m = GGUFModel(request.getfixturevalue(model))
    B, T = 2, 6
    rng = np.random.default_rng(0)
    tok = rng.integers(0, m.config.n_vocab, size=(B, T)).astype(np.int32)
    lab = np.roll(tok, -1, axis=1).reshape(-1).astype(np.int32)
    lab[::T] = -1
    results = []
    for fused in (True, False):   # both graphs run on numpy here
        g = Graph()
        lora = LoraConfig(targets=("q", "v"), init_scale=0.1) if weights == "frozen" else None
        net = build_decoder(g, m.config, WeightSource(m, weights), batch=B, seq_len=T,
                            lora=lora, options=BuildOptions(logits=False))
        assert net.logits is None and net.hidden.shape == (B * T, m.config.n_embd)
        assert net.head.shape == (m.config.n_vocab, m.config.n_embd)
        assert (net.head.name == "token_embd.weight") == m.config.tied_output
        labels = g.input("labels", (B * T,), "i32")
        loss = g.output(head_loss(net, labels, fused))
        assert loss.op == ("linear_cross_entropy" if fused else "cross_entropy")
        assert not [t for t in g.nodes if t.shape == (B * T, m.config.n_vocab)] or not fused
        params = net.params[:6] + ([net.head] if net.head.role == "param" else [])
        accumulate_grads(backward(loss, params))
        s = Session(g, dtype="f64"); s.realize(); s.reset()
        s.upload(net.tokens, tok); s.upload(net.positions, np.tile(np.arange(T), (B, 1)))
        s.upload(labels, lab); s.run("backward")
        results.append([s.download(loss)] + [s.download(g.find(f"grad.{p.name}")) for p in params])
    for a, b in zip(*results):
        assert np.abs(a - b).max() <= 1e-10 * max(np.abs(b).max(), 1.0)


def test_logits_are_built_when_asked(tiny_llama):
    from toygraph.models.decoder import lm_head
    m = GGUFModel(tiny_llama)
    g = Graph()
    net = build_decoder(g, m.config, WeightSource(m), batch=1, seq_len=4)
    assert net.logits is not None and net.logits.shape == (4, m.config.n_vocab)
    assert net.logits.op == "matmul" and list(net.logits.srcs) == [net.hidden, net.head]
    assert lm_head(net).shape == net.logits.shape
