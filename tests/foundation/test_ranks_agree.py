"""The ranks of a data-parallel job agree (issue 46, item 5): at start they compare their
run configuration, model and data (a digest of each) and every rank refuses, naming the
rank and the first difference, before anything is written; and a rank that stops (a
divergence only it sees) makes every rank stop with the same status, so rank 0 never
records "completed" beside it.

The 2-rank jobs run under MPICH's mpiexec in Hydra's MPMD form, rank 1 with its own
arguments; they skip when mpi4py or mpiexec is missing, as tests/foundation/test_distributed.py's do."""
import os
import subprocess
import sys

import pytest

from test_distributed import ARGS, LAUNCHER_ENV, MPI_SKIP, _mpiexec, needs_mpi
from test_run import write_chat_data
from toygraph import distributed
from toygraph.training.guard import Diverged


def _two_ranks(model, data, out, rank1_extra=(), rank1_data=None):
    """A 1-step 2-rank finetune, rank 1 given ``rank1_extra`` options (and its own data)."""
    def prog(data_path, extra):
        return [sys.executable, "-m", "toygraph.cli", "finetune", "--model", str(model),
                "--data", str(data_path), "--out", str(out), *ARGS, "--steps", "1",
                "--val-split", "0", *extra]
    cmd = [_mpiexec(), "-n", "1", *prog(data, ()), ":", "-n", "1",
           *prog(rank1_data or data, rank1_extra)]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, env=env)


@needs_mpi
@pytest.mark.parametrize("case", ["lr", "seed", "data"])
def test_ranks_that_run_different_jobs_refuse_naming_the_rank_and_difference(
        case, tmp_path, tiny_llama):
    data = write_chat_data(tmp_path / "chat.jsonl")
    other = tmp_path / "other.jsonl"
    other.write_text(data.read_text() + data.read_text().splitlines()[0] + "\n")   # a row more
    extra, rank1_data, named = {"lr": (["--lr", "1e-3"], None, "--lr"),
                                "seed": (["--seed", "8"], None, "--seed"),
                                "data": ([], other, "--data")}[case]
    r = _two_ranks(tiny_llama, data, tmp_path / "run", extra, rank1_data)
    assert r.returncode == 2, r.stderr[-2000:]
    said = "rank 1 of 2 does not run rank 0's job"
    assert r.stderr.count(said) == 2, r.stderr[-2000:]      # each rank says it
    lines = [l for l in r.stderr.splitlines() if "rank 1 of 2" in l]
    assert all(named in l and "Traceback" not in l for l in lines), lines
    assert not (tmp_path / "run").exists()


@needs_mpi
def test_ranks_that_agree_still_train(tmp_path, tiny_llama):
    data = write_chat_data(tmp_path / "chat.jsonl")
    r = _two_ranks(tiny_llama, data, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "run" / "adapter_model.safetensors").exists()


class _TwoRanks(distributed.World):
    """Rank 0 of a pretend 2-rank job whose rank 1 gathers ``theirs`` (what rank 1
    differs in is the case under test)."""
    rank, size = 0, 2

    def __init__(self, theirs):
        self.theirs = theirs

    def gather(self, obj):
        return [obj, self.theirs]


def test_a_divergence_one_rank_sees_stops_every_rank():
    """Rank 0 saw nothing wrong; rank 1 diverged: rank 0 raises Diverged too, naming it."""
    from toygraph.training.supervisor import agree_on_divergence
    with pytest.raises(Diverged, match=r"rank 1 of 2: step 3: loss nan"):
        agree_on_divergence(_TwoRanks("step 3: loss nan"), None)
    agree_on_divergence(_TwoRanks(None), None)   # neither diverged: nothing happens
    with pytest.raises(Diverged, match="^step 2: mine$"):
        agree_on_divergence(_TwoRanks(None), Diverged("step 2: mine"))


def _facts():
    from test_run import cfg_for
    from toygraph.training.run import _job_facts
    from types import SimpleNamespace
    cfg = cfg_for("m.gguf", "d.jsonl", "out")
    prep = SimpleNamespace(state=SimpleNamespace(
        model_fingerprint={"name": "m.gguf", "size": 10, "sha256_sampled": "ab" * 32},
        data_hash="cd" * 32))
    return _job_facts(cfg, prep)


@pytest.mark.parametrize("key", list(_facts()))
def test_each_fact_that_differs_is_named(key):
    """The fuzz of rank mismatches: each fact changed alone on rank 1 is refused naming it;
    the same facts pass."""
    ours = _facts()
    _TwoRanks(dict(ours)).check_same_job(ours)
    theirs = {**ours, key: ["something", "else"]}
    with pytest.raises(distributed.DistributedError) as e:
        _TwoRanks(theirs).check_same_job(ours)
    assert str(e.value).startswith(f"rank 1 of 2 does not run rank 0's job: {key} is ")
    assert distributed.is_agreed(e.value) and "\n" not in str(e.value)
