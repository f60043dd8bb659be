"""The real Gemma 3 270M (Q4_K_M, 262144-token vocabulary, 18 layers, 5 sliding + 1 global)
against transformers loading the same GGUF: the loss of real text tokenized by toygraph
(code with indentation: the whitespace-run tokens), past the 512-token sliding window; and
LoRA steps against torch + PEFT AdamW from the same init."""
import numpy as np
import pytest

from test_llama import toygraph_loss
from test_peft_reference import ALL, _report_and_check, rel, train_both
from test_tokenizer_real_files import CODE, CORPUS
from toygraph.gguf.tokenizer import Tokenizer
from toygraph.models.model import GGUFModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = [pytest.mark.slow, pytest.mark.reference]


def reference_loss(path, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.double()
    lp = torch.log_softmax(logits[:, :-1], -1)
    return -lp.gather(-1, torch.tensor(tokens[:, 1:], dtype=torch.long)[..., None]).mean().item()


def test_config_is_the_released_model(gemma3_270m):
    cfg = GGUFModel(gemma3_270m).config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_vocab) == \
        (18, 640, 4, 1, 256, 262144)
    windows = [a.window for a in cfg.attention]
    assert windows.count(0) == 3 and set(windows) == {0, 512} and cfg.tied_output


def test_loss_of_real_text_past_the_window_matches_transformers(gemma3_270m):
    tok = Tokenizer.from_gguf(gemma3_270m)
    ids = tok.encode("".join(CORPUS * 3))
    assert len(ids) > 600 and tok.id_to_token(140) == "    " and 140 in ids  # past the window; indentation
    tokens = np.array([ids[:600]], np.int32)
    mine, ref = toygraph_loss(gemma3_270m, tokens), reference_loss(gemma3_270m, tokens)
    print(f"Gemma 3 270M, 600 tokens: toygraph {mine:.7f} transformers {ref:.7f} rel {rel(mine, ref):.2e}")
    assert rel(mine, ref) <= 1e-4


def test_lora_steps_match_peft(gemma3_270m, tmp_path):
    tok = Tokenizer.from_gguf(gemma3_270m)
    tokens = np.array([tok.encode(t)[:24] for t in (CODE, CORPUS[0] + CORPUS[2])], np.int32)
    mine, ref, norms = train_both(gemma3_270m, tmp_path, targets=ALL, rank=4, alpha=8,
                                  tokens=tokens, n_prompt=4, steps=3, lr=3e-4)
    _report_and_check("Gemma 3 270M", mine, ref, norms, 0.5)
