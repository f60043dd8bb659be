"""bench/slice_gguf.py, which makes the SmolLM2 slice the GPU session carries: the first N
blocks of a GGUF as a valid smaller model (bytes untouched, block_count cut) that toygraph
and transformers load and agree on; bad arguments are one-line refusals."""
import sys
from pathlib import Path

import numpy as np
import pytest

from test_llama import toygraph_loss, transformers_loss
from toygraph.models.model import GGUFModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from slice_gguf import main, slice_gguf  # noqa: E402


def test_a_slice_keeps_the_first_blocks_bytes_and_metadata(tiny_llama, tmp_path):
    import gguf
    full = GGUFModel(tiny_llama).config
    assert full.n_layer >= 2
    out = tmp_path / "slice.gguf"
    summary = slice_gguf(tiny_llama, out, 1, quiet=True)
    cfg = GGUFModel(out).config
    assert cfg.n_layer == 1 and summary["blocks"] == f"{full.n_layer} -> 1"
    assert (cfg.n_embd, cfg.n_vocab, cfg.n_head) == (full.n_embd, full.n_vocab, full.n_head)
    src = {t.name: t for t in gguf.GGUFReader(tiny_llama).tensors}
    got = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert set(got) == {n for n in src if not n.startswith("blk.") or n.startswith("blk.0.")}
    for name, t in got.items():
        assert t.tensor_type == src[name].tensor_type, name
        assert np.array_equal(np.asarray(t.data).view(np.uint8),
                              np.asarray(src[name].data).view(np.uint8)), name


@pytest.mark.reference
def test_toygraph_and_transformers_agree_on_a_slice(tiny_llama, tmp_path):
    out = tmp_path / "slice.gguf"
    slice_gguf(tiny_llama, out, 1, quiet=True)
    tokens = np.random.default_rng(3).integers(0, GGUFModel(out).config.n_vocab,
                                               size=(2, 12)).astype(np.int32)
    mine, ref = toygraph_loss(out, tokens), transformers_loss(out, tokens)
    assert abs(mine - ref) / ref <= 1e-4
    assert mine != toygraph_loss(tiny_llama, tokens)   # the dropped block mattered


def test_bad_arguments_are_one_line_refusals(tiny_llama, tmp_path, capsys):
    out = tmp_path / "slice.gguf"
    for layers in (0, 99):
        with pytest.raises(SystemExit, match=rf"--layers {layers}: the model has \d+ blocks"):
            slice_gguf(tiny_llama, out, layers, quiet=True)
    out.write_bytes(b"not overwritten")
    with pytest.raises(SystemExit):
        main([str(tiny_llama), str(out), "--layers", "1"])
    assert "exists (--force to overwrite)" in capsys.readouterr().err
    assert out.read_bytes() == b"not overwritten"
    assert main([str(tiny_llama), str(out), "--layers", "1", "--force", "--quiet"]) == 0
    assert GGUFModel(out).config.n_layer == 1
