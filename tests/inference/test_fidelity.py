"""The fidelity report (inference/fidelity.py): each row's loss and KL equal a direct
evaluation of the file that row describes.

The requantized files are written independently of the module under test: an f32 base
and, from the same seed, the same random weights encoded straight to q8_0 / q6_k / q4_k
by the tiny-model writer. Requantizing the f32 base must give those files' bytes, so the
report's loss is theirs as ``LanguageModel.loss`` reads them, and its KL is the one
computed here from next-token logits of two separately loaded models (one sequence at a
time, through ``next_logits``, not the report's batched passes)."""
import json

import numpy as np
import pytest

from support.random_adapters import random_lora
from toygraph.adapters.files import save_peft
from toygraph.adapters.merge import export_merged
from toygraph.cli.main import main as cli_main
from toygraph.errors import DataError
from toygraph.fixtures.tiny_models import MATRIX_ROLES, write_tiny_llama
from toygraph.inference.fidelity import (FidelityReport, FidelityRow, RequantizedModel,
                                         fidelity_report, write_requantized)
from toygraph.inference.language_model import LanguageModel
from toygraph.models.model import GGUFModel

# K-quant rows need 256-wide matrices; an untied head makes every matrix kind appear.
SHAPE = dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, tied=False, seed=3)
QUANTS = ("q8_0", "q6_k", "q4_k")


def all_as(qtype):
    return {role: qtype for role in MATRIX_ROLES}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("fidelity")
    base = write_tiny_llama(d / "base.gguf", weight_types=all_as("f32"), **SHAPE)
    direct = {q: write_tiny_llama(d / f"{q}.gguf", weight_types=all_as(q), **SHAPE)
              for q in QUANTS}
    cfg = GGUFModel(base).config
    save_peft(d / "adapter", random_lora(cfg, targets=("q", "v", "down"), rank=4, seed=1,
                                         scale=0.05), cfg, rank=4, alpha=8,
              targets=("q", "v", "down"))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, cfg.n_vocab, size=n).tolist() for n in (17, 26, 10)]
    masks = [[i >= 4 for i in range(len(s))] for s in seqs]   # a prompt of 4, then targets
    return d, base, direct, seqs, masks


def next_token_logprobs(lm: LanguageModel, seqs, masks) -> list[np.ndarray]:
    """log-softmax of the next-token logits at each masked position, one prefix at a time
    through generation's window path (``next_logits`` without the KV cache, whose 8-bit
    products are not the forward pass's), not the report's batched forward passes."""
    out = []
    for s, m in zip(seqs, masks):
        context = s[:1]
        rows = lm.next_logits(context, len(s), kv_cache=False)
        for t in range(1, len(s)):
            p = next(rows).astype(np.float64)
            if m[t]:
                out.append(p - np.logaddexp.reduce(p))
            context.append(s[t])
    return out


def kl_direct(ref_logprobs, cand: LanguageModel, seqs, masks) -> float:
    """Mean KL(ref || cand) over the masked next tokens."""
    cand_logprobs = next_token_logprobs(cand, seqs, masks)
    return float(np.mean([np.sum(np.exp(p) * (p - q)) for p, q in zip(ref_logprobs, cand_logprobs)]))


def test_requantized_rows_equal_the_requantized_files(files):
    d, base, direct, seqs, masks = files
    report = fidelity_report(base, d / "adapter", seqs, masks, quants=QUANTS, merged_types=())
    ref = LanguageModel(base, adapter_dir=d / "adapter")
    ref_logprobs = next_token_logprobs(ref, seqs, masks)
    assert report.reference.loss == ref.loss(seqs, masks)[0]
    assert report.tokens == ref.loss(seqs, masks)[1]
    for row in report.of("requantized"):
        lm = LanguageModel(direct[row.qtype], adapter_dir=d / "adapter")
        loss, _ = lm.loss(seqs, masks)
        assert row.loss == loss, row.qtype      # the same bytes, the same graph: same bits
        assert row.cost == pytest.approx(loss - report.reference.loss)
        assert row.kl == pytest.approx(kl_direct(ref_logprobs, lm, seqs, masks), rel=1e-3, abs=1e-7)
        assert (row.fallbacks, row.kept) == (0, 0)
    kls = [r.kl for r in report.of("requantized")]
    assert 0 < kls[0] < kls[1] < kls[2]   # fewer bits, further from the trained pair


def test_small_passes_and_no_kept_reference_give_the_same_report(files, monkeypatch):
    """Many forward passes of a few rows each, the reference rerun beside each candidate:
    the same positions are paired, so the same numbers (up to the passes' summation)."""
    import toygraph.inference.fidelity as fidelity
    d, base, _, seqs, masks = files
    kw = dict(quants=("q4_k",), merged_types=("q8_0",))
    whole = fidelity_report(base, d / "adapter", seqs, masks, **kw)
    monkeypatch.setattr(fidelity, "REFERENCE_BYTES", 0)
    monkeypatch.setattr(fidelity, "LOGITS_BYTES", 32 * 4 * GGUFModel(base).config.n_vocab)
    chunked = fidelity_report(base, d / "adapter", seqs, masks, **kw)
    assert chunked.tokens == whole.tokens
    for a, b in zip(whole.rows, chunked.rows):
        assert (a.loss, a.kl) == pytest.approx((b.loss, b.kl), rel=1e-6, abs=1e-9)


def test_requantized_model_has_the_written_files_bytes(files):
    _, base, direct, _, _ = files
    for q in QUANTS:
        mine, theirs = RequantizedModel(GGUFModel(base), q), GGUFModel(direct[q])
        for name in theirs.tensor_names():
            a, b = mine.tensor(name), theirs.tensor(name)
            assert (a.qtype, a.shape) == (b.qtype, b.shape), name
            assert a.raw.tobytes() == b.raw.tobytes(), name


def test_merged_rows_equal_the_exported_files(files):
    d, base, _, seqs, masks = files
    report = fidelity_report(base, d / "adapter", seqs, masks, quants=("q8_0",),
                             merged_types=("f16", "q8_0"))
    ref = LanguageModel(base, adapter_dir=d / "adapter")
    ref_logprobs = next_token_logprobs(ref, seqs, masks)
    for row in report.of("merged"):
        out = export_merged(base, d / "adapter", d / f"merged-{row.qtype}.gguf", row.qtype)
        lm = LanguageModel(out)
        assert row.loss == lm.loss(seqs, masks)[0], row.qtype
        assert row.kl == pytest.approx(kl_direct(ref_logprobs, lm, seqs, masks), rel=1e-3, abs=1e-7)


def test_write_requantized_writes_what_the_report_evaluated(files):
    d, base, direct, seqs, masks = files
    out = write_requantized(base, "q4_k", d / "written-q4_k.gguf")
    assert out.read_bytes() != base.read_bytes()
    a, b = GGUFModel(out), GGUFModel(direct["q4_k"])
    for name in b.tensor_names():
        assert a.tensor(name).raw.tobytes() == b.tensor(name).raw.tobytes(), name


def test_rows_not_whole_blocks_take_llama_cpps_fallback(tmp_path):
    base = write_tiny_llama(tmp_path / "b.gguf", weight_types=all_as("f32"))   # 64-wide rows
    m = RequantizedModel(GGUFModel(base), "q4_k")
    w = m.tensor("blk.0.attn_q.weight")
    assert w.qtype == "q5_0" and m.fallbacks["blk.0.attn_q.weight"] == "q5_0"
    assert len(m.fallbacks) == 2 * 7 + 1 and not m.kept   # every matrix: 64-wide rows
    assert m.tensor("blk.0.attn_norm.weight").qtype == "f32"   # vectors keep theirs


def row(qtype, cost, kl, kind="requantized"):
    return FidelityRow(qtype, kind, qtype, 1.0 + cost, kl, cost=cost)


def test_verdict_names_the_last_type_that_holds_and_what_the_next_costs():
    ref = FidelityRow("trained", "reference", "f16", 1.0)
    rows = [ref, row("q4_k", 0.09, 0.07), row("q8_0", 0.001, 0.0005), row("q5_k", 0.01, 0.01)]
    text = FidelityReport(rows, tokens=100).verdict()
    assert text.startswith("holds up to q5_k; q4_k costs 0.0900 nats of loss (KL 0.0700)")
    text = FidelityReport([ref, row("q8_0", -0.01, 0.05)], tokens=100).verdict()
    assert text.startswith("holds at no type asked: q8_0 costs 0.0500 nats of KL")
    text = FidelityReport([ref, row("f16", 0.0, 0.0, "merged"),
                           row("q8_0", 0.03, 0.01, "merged")], tokens=100).verdict()
    assert text.startswith("merged f16 holds; merged q8_0 costs 0.0300 nats of loss")


def test_cli_eval_quants_over_a_data_file(files, tmp_path, capsys):
    d, base, direct, _, _ = files
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {w}", "response": f"the {w} is here"})
                            + "\n" for w in ("cat", "dog", "sun")))
    rc = cli_main(["eval", "--model", str(base), "--adapter", str(d / "adapter"),
                    "--quants", "q4_k,q8_0", "--merged-types", "none", "--data", str(data),
                    "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in out["rows"]][1:] == ["q4_k + adapter", "q8_0 + adapter"]
    lm = LanguageModel(direct["q4_k"], adapter_dir=d / "adapter")
    from toygraph.data.batches import encode_dataset
    from toygraph.data.examples import load_examples
    items = encode_dataset(load_examples(data), lm.tokenizer, lm.cfg.n_ctx - 1).items
    assert out["rows"][1]["loss"] == lm.loss([e.tokens for e in items],
                                             [e.target_mask for e in items])[0]


@pytest.mark.parametrize("argv, needle", [
    (["--quants", "q4_k"], "--quants needs --adapter"),
    (["--quants", "q4_x", "--adapter", "A"], "--quants 'q4_x': unknown type 'q4_x'"),
    (["--quants", "q4_k", "--merged-types", "q4_k", "--adapter", "A"],
     "--merged-types 'q4_k': unknown type"),
    ([], "one of the arguments --tokens --text --data is required"),
    (["--text", "hi", "--write-quants", "d"], "--write-quants is for the fidelity report: give "
                                              "--quants too"),
    (["--text", "hi", "--merged-types", "f16"], "--merged-types is for the fidelity report"),
])
def test_cli_eval_quants_errors_are_one_line(files, capsys, argv, needle):
    _, base, _, _, _ = files
    assert cli_main(["eval", "--model", str(base)] + argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_a_directory_without_run_file_asks_for_data(files, capsys):
    d, base, _, _, _ = files
    assert cli_main(["eval", "--model", str(base), "--adapter", str(d / "adapter"),
                      "--quants", "q8_0"]) == 2
    assert "no run.yaml (not a run directory); give --data" in capsys.readouterr().err


def test_fidelity_refuses_a_type_it_cannot_encode(files):
    _, base, _, _, _ = files
    with pytest.raises(DataError, match="--quants 'mxfp4'"):
        RequantizedModel(GGUFModel(base), "mxfp4")


def test_run_directory_report_runs_over_the_runs_validation_split(tiny_llama, tmp_path, capsys):
    from test_run import cfg_for, write_chat_data
    from toygraph.training import run_training
    out = tmp_path / "run"
    summary = run_training(cfg_for(tiny_llama, write_chat_data(tmp_path / "chat.jsonl"), out))
    assert cli_main(["eval", "--model", str(tiny_llama), "--adapter", str(out),
                     "--quants", "q8_0,q4_k", "--merged-types", "f16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # the run saved its best adapter by this very loss, over the same 6 held-out rows
    assert report["rows"][0]["loss"] == pytest.approx(summary["best_val_loss"], rel=1e-5)
    q4 = report["rows"][2]
    assert q4["label"] == "q4_k + adapter" and q4["fallbacks"] > 0   # 64-wide rows: q5_0


def test_export_prints_the_merged_files_loss_and_kl_on_the_runs_data(tiny_llama, tmp_path,
                                                                      capsys):
    from test_run import cfg_for, write_chat_data
    from toygraph.training import run_training
    from toygraph.training.validation import run_sample
    from toygraph.inference.fidelity import compare
    run = tmp_path / "run"
    run_training(cfg_for(tiny_llama, write_chat_data(tmp_path / "chat.jsonl"), run))
    capsys.readouterr()
    out = tmp_path / "merged.gguf"
    assert cli_main(["export", "--model", str(tiny_llama), "--adapter", str(run), "--out",
                     str(out), "--type", "q8_0", "--check", "4"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    # the numbers, recomputed: the written file, and base + adapter, on the run's 4 first
    # validation rows (6 held out of 24)
    pair = LanguageModel(tiny_llama, adapter_dir=run)
    seqs, masks, what = run_sample(run, pair.tokenizer, 4)
    assert what == "4 of the run's 6 validation rows"
    merged_loss, n = LanguageModel(out).loss(seqs, masks)
    pair_loss, _ = pair.loss(seqs, masks)
    _, [(_, kl)], _ = compare(pair, [LanguageModel(out)], seqs, masks)
    assert 0 < kl < 0.02
    assert line == (f"check on {what}: merged loss {merged_loss:.4f}, base + adapter "
                    f"{pair_loss:.4f} ({merged_loss - pair_loss:+.4f} nats), KL {kl:.5f} nats "
                    f"over {n} tokens: the merge holds")


def test_export_of_a_dpo_run_checks_the_chosen_replies(tiny_llama, tmp_path, capsys):
    """A DPO run's examples are pairs: the export's check takes their chosen sequences
    (it refused, exit 2, after writing the file); a GRPO run's prompts have no targets to
    check on, which it says and exits 0."""
    from pathlib import Path
    from test_run import cfg_for
    from toygraph.training import run_training
    pairs = Path(__file__).resolve().parents[2] / "fixtures" / "data" / "preferences.jsonl"
    run = tmp_path / "dpo"
    run_training(cfg_for(tiny_llama, pairs, run, recipe="dpo", steps=2, seq_len=96))
    capsys.readouterr()
    out = tmp_path / "merged.gguf"
    assert cli_main(["export", "--model", str(tiny_llama), "--adapter", str(run), "--out",
                     str(out), "--type", "f32", "--check", "4"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("check on 4 of the run's 12 validation pairs' chosen replies: "
                           "merged loss ") and line.endswith("the merge holds")
    from test_grpo import cfg as grpo_cfg, write_prompts
    grpo = tmp_path / "grpo"
    run_training(grpo_cfg(tiny_llama, write_prompts(tmp_path), grpo))
    capsys.readouterr()
    assert cli_main(["export", "--model", str(tiny_llama), "--adapter", str(grpo), "--out",
                     str(tmp_path / "grpo.gguf"), "--type", "f32"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        f"not checked: {grpo / 'run.yaml'}: the grpo run's examples are not token sequences")
    assert (tmp_path / "grpo.gguf").is_file()


def test_export_of_a_plain_adapter_directory_says_it_is_not_checked(files, capsys):
    d, base, _, _, _ = files
    assert cli_main(["export", "--model", str(base), "--adapter", str(d / "adapter"), "--out",
                     str(d / "m.gguf")]) == 0
    assert "not checked: " in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:   # argparse's refusal, before any work
        cli_main(["export", "--model", str(base), "--adapter", str(d / "adapter"), "--out",
                  str(d / "m2.gguf"), "--check", "-1"])
    assert refused.value.code == 2
    assert "--check: expected a whole number >= 0, got '-1'" in capsys.readouterr().err
    assert not (d / "m2.gguf").exists()   # refused before anything is written


def test_a_lora_run_with_a_validation_split_ends_with_the_fidelity_line(tiny_llama, tmp_path,
                                                                        capsys):
    from test_run import cfg_for, write_chat_data
    from toygraph.training import run_training
    from toygraph.training.validation import END_ROWS
    out = tmp_path / "run"
    run_training(cfg_for(tiny_llama, write_chat_data(tmp_path / "chat.jsonl"), out,
                         quiet=False, fidelity=("q8_0", "q4_1")))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("fidelity on 6 validation rows (toygraph eval --quants for all 6): ")
    # the same numbers as the report over those rows
    pair = LanguageModel(tiny_llama, adapter_dir=out)
    from toygraph.training.validation import run_validation
    seqs, masks = run_validation(out, pair.tokenizer)
    report = fidelity_report(tiny_llama, out, seqs[:END_ROWS], masks[:END_ROWS],
                             quants=("q8_0", "q4_1"), merged_types=())
    assert last.endswith(report.verdict())


def test_fidelity_off_and_bad_types(tiny_llama, tmp_path, capsys):
    from test_run import cfg_for, write_chat_data
    from toygraph.errors import ToygraphError
    from toygraph.training import run_training
    data = write_chat_data(tmp_path / "chat.jsonl")
    run_training(cfg_for(tiny_llama, data, tmp_path / "a", quiet=False, fidelity=("none",)))
    assert "fidelity on" not in capsys.readouterr().err
    with pytest.raises(ToygraphError, match="--fidelity: 'q9' is not a block type"):
        run_training(cfg_for(tiny_llama, data, tmp_path / "b", fidelity=("q9",)))


def test_write_quants_writes_the_files_the_rows_describe(files, tmp_path, capsys):
    d, base, direct, seqs, _ = files
    folder = tmp_path / "q"
    argv = ["eval", "--model", str(base), "--adapter", str(d / "adapter"), "--quants",
            "q6_k", "--merged-types", "none", "--tokens", ",".join(map(str, seqs[0])),
            "--write-quants", str(folder), "--json"]
    assert cli_main(argv) == 0
    row = json.loads(capsys.readouterr().out)["rows"][1]
    written = folder / "base.q6_k.gguf"
    assert written.read_bytes() != base.read_bytes()
    assert row["loss"] == LanguageModel(written, adapter_dir=d / "adapter").loss(seqs[0])[0]
    before = written.stat().st_mtime_ns
    assert cli_main(argv) == 2   # never replaced
    assert "--write-quants: " in capsys.readouterr().err
    assert written.stat().st_mtime_ns == before


@pytest.mark.parametrize("source,target", [("q8_0", "q4_k"), ("q4_k", "q8_0"), ("f32", "q6_k")])
def test_requantizing_chunk_by_chunk_is_the_whole_matrix_bits(monkeypatch, source, target):
    """requantize_tensor decodes and encodes a few rows at a time (never the whole matrix
    in f32): the same bytes as encoding the whole decoded matrix, with a last chunk short."""
    from toygraph.gguf import block_encode
    from toygraph.gguf.file import WeightTensor
    from toygraph.inference import fidelity
    x = (np.random.default_rng(0).standard_normal((11, 512)) * 0.1).astype(np.float32)
    raw = block_encode.quantize(x, source) if source != "f32" else x
    w = WeightTensor("m", source, x.shape, np.ascontiguousarray(raw).view(np.uint8).reshape(-1))
    monkeypatch.setattr(fidelity, "_ROWS", 4)
    got = fidelity.requantize_tensor(w, target)
    want = block_encode.quantize(w.dequantize(), target)
    assert got.qtype == target and got.shape == x.shape
    assert np.array_equal(got.raw, np.ascontiguousarray(want).view(np.uint8).reshape(-1))
