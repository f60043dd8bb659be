"""Data parallelism (distributed.py, ops/collective/): the launcher's
environment, the all_reduce op, and real 2-rank jobs under MPICH's mpiexec on the tiny
model — the same losses and adapter as one process, resume across rank counts, a killed
or stalled rank ending the job, a one-process run importing nothing new.

The 2-rank tests skip (with the reason) when mpi4py or an mpiexec is not installed
(``pip install -e ".[mpi]"`` brings both)."""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from toygraph import ops
from toygraph import distributed
from toygraph.errors import GraphError
from toygraph.core.graph import Graph
from toygraph.core.session import Session
from test_run import write_chat_data

LAUNCHER_ENV = [v for pair in distributed.LAUNCHER_VARS for v in pair]


def _mpiexec():
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


if importlib.util.find_spec("mpi4py") is None:
    MPI_SKIP = "mpi4py is not installed (pip install -e '.[mpi]')"
else:
    MPI_SKIP = None if _mpiexec() else "no mpiexec on PATH or beside the interpreter"
needs_mpi = pytest.mark.skipif(MPI_SKIP is not None, reason=str(MPI_SKIP))

ARGS = ["--targets", "q,v", "--rank", "4", "--alpha", "8", "--batch", "4", "--seq-len", "32",
        "--lr", "5e-3", "--seed", "7", "--quiet"]


# --- the launcher's environment ----------------------------------------------------------------
def test_launched_size_reads_each_launchers_variables(monkeypatch):
    for var in LAUNCHER_ENV:
        monkeypatch.delenv(var, raising=False)
    assert distributed.launched_size() == 1
    monkeypatch.setenv("PMI_SIZE", "3")
    assert distributed.launched_size() == 1          # a size without a rank is not a launch
    monkeypatch.setenv("PMI_RANK", "2")
    assert distributed.launched_size() == 3
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    assert distributed.launched_size() == 4
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "four")
    with pytest.raises(distributed.DistributedError, match="OMPI_COMM_WORLD_SIZE='four'"):
        distributed.launched_size()


def test_local_rank_picks_a_ranks_gpu_only_in_a_job_of_several(monkeypatch):
    for var in LAUNCHER_ENV + list(distributed.LOCAL_RANK_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    assert distributed.local_rank() == 0          # one process: device 0 as always
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "1")
    assert distributed.local_rank() == 1


def test_one_process_imports_no_mpi_and_trains_as_before(tmp_path, tiny_llama):
    """No launcher: nothing new is imported, even through a whole training run."""
    data = write_chat_data(tmp_path / "chat.jsonl")
    code = (f"import sys, toygraph.training.run, toygraph.cli, toygraph.recipes, toygraph.training.supervisor\n"
            f"from toygraph.training import RunConfig, run_training\n"
            f"run_training(RunConfig(model={str(tiny_llama)!r}, data={str(data)!r}, "
            f"out={str(tmp_path / 'run')!r}, steps=1, batch=2, seq_len=16, quiet=True))\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'nccl'))\n"
            f"assert not bad, bad\n")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


# --- the op -------------------------------------------------------------------------------------
def test_all_reduce_sums_in_place_and_yields_the_count():
    """In one process (no launcher) the sum over one rank leaves the sources as they are;
    its value is the summed count, which the nodes after it read."""
    g = Graph()
    count = g.state("count", (), kind="count")
    grad = g.state("grad", (2, 3), kind="grad")
    total = g.output(ops.all_reduce([count, grad], ranks=1) * 2.0)
    s = Session(g)
    s.realize()
    s.load_param(count, np.array(5.0))
    s.load_param(grad, np.arange(6.0).reshape(2, 3))
    s.run("forward")
    assert float(s.download(total)) == 10.0
    np.testing.assert_array_equal(s.download(grad), np.arange(6.0).reshape(2, 3))


def test_all_reduce_checks_its_operands_and_the_job_size():
    g = Graph()
    grad = g.state("grad", (2,), kind="grad")
    with pytest.raises(GraphError, match="first operand must be a scalar count"):
        ops.all_reduce([grad], ranks=2)
    count = g.state("count", (), kind="count")
    out = g.output(ops.all_reduce([count, grad], ranks=2))
    s = Session(g)
    s.realize()
    with pytest.raises(distributed.DistributedError, match="over 2 ranks but the job has 1"):
        s.run("forward")
    assert out.shape == ()


def test_the_update_waits_for_the_reduction():
    """build_training(ranks=...) puts all_reduce between the accumulated gradients and the
    clip/AdamW nodes, which read its value as their divisor."""
    from toygraph.core.graph import topo_order
    from toygraph.core.optimizer import build_training
    g = Graph()
    w = g.param("w", np.ones((3,), np.float32))
    x = g.input("x", (3,))
    step = build_training(ops.sum(ops.mul(w, x)), [w], count=g.scalar(1.0), ranks=2)
    order = topo_order(g.outputs["step"] + g.effects["step"])
    kinds = [t.op for t in order if t.op in ("accumulate", "all_reduce", "global_norm", "adamw")]
    assert kinds.index("all_reduce") < kinds.index("global_norm") < kinds.index("adamw")
    assert step.grad_norm.srcs[-1].op == "all_reduce"


# --- real jobs ------------------------------------------------------------------------------
def _finetune(ranks: int, model, data, out, *extra, env=None, check=True):
    cmd = [sys.executable, "-m", "toygraph.cli", "finetune", "--model", str(model),
           "--data", str(data), "--out", str(out), *ARGS, *extra]
    if ranks > 1:
        cmd = [_mpiexec(), "-n", str(ranks), *cmd]
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                       env={**base, **(env or {})})
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def _losses(out) -> dict[int, float]:
    evs = [json.loads(l) for l in (Path(out) / "events.jsonl").read_text().splitlines()]
    return {e["step"]: e["loss"] for e in evs if e["event"] == "step"}


def _adapter(out) -> dict:
    from safetensors.numpy import load_file
    return load_file(str(Path(out) / "adapter_model.safetensors"))


def _assert_close(a: dict, b: dict, rtol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert np.linalg.norm(a[k] - b[k]) <= rtol * np.linalg.norm(b[k]), k
        else:
            assert abs(a[k] - b[k]) <= rtol * abs(b[k]), (k, a[k], b[k])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama):
    """The same 4-step runs on 1 and on 2 ranks, with and without accumulation: run
    directories by (ranks, accum), and the data file."""
    if MPI_SKIP:
        pytest.skip(MPI_SKIP)
    tmp = tmp_path_factory.mktemp("dp")
    data = write_chat_data(tmp / "chat.jsonl")
    out = {}
    for accum in (1, 2, "packed"):
        extra = (["--grad-accum", "2", "--pack", "--seq-len", "96"] if accum == "packed"                  else ["--grad-accum", str(accum)])
        for ranks in (1, 2):
            out[ranks, accum] = tmp / f"ranks{ranks}-accum{accum}"
            r = _finetune(ranks, tiny_llama, data, out[ranks, accum], "--steps", "4",
                          *extra, "--val-split", "0.25", "--eval-every",
                          "2", "--save-every", "2", "--keep-checkpoints", "5")
            (out[ranks, accum] / "stdout.txt").write_text(r.stdout)
    return out, data


@needs_mpi
@pytest.mark.parametrize("accum", [1, 2, "packed"])
def test_two_ranks_match_one_process(runs, accum):
    """Same global batch: per-step losses and final adapter within 1e-6 relative (only the
    summation order differs); rank 0 alone wrote the run, with both ranks recorded. Packed
    rows (with accumulation) shard their segment ids like the other inputs."""
    dirs, _ = runs
    one, two = dirs[1, accum], dirs[2, accum]
    _assert_close(_losses(two), _losses(one))
    _assert_close(_adapter(two), _adapter(one))
    evs = [json.loads(l) for l in (two / "events.jsonl").read_text().splitlines()]
    assert [x["rank"] for x in evs[0]["ranks"]] == [0, 1]
    assert sum(e["event"] == "run_start" for e in evs) == 1
    assert [e["step"] for e in evs if e["event"] == "eval"] == [0, 2, 4]
    summaries = [l for l in (two / "stdout.txt").read_text().splitlines() if l.startswith("{")]
    assert len(summaries) == 1 and json.loads(summaries[0])["status"] == "completed"


@needs_mpi
def test_resume_across_rank_counts(runs, tiny_llama, tmp_path):
    """A 2-rank checkpoint resumed on 1 rank, and a 1-rank one on 2 ranks, continue with
    the losses of the run that was never stopped."""
    dirs, data = runs
    for ranks, src in ((1, dirs[2, 1]), (2, dirs[1, 1])):
        out = tmp_path / f"resumed-on-{ranks}"
        _finetune(ranks, tiny_llama, data, out, "--steps", "4", "--val-split", "0.25",
                  "--eval-every", "2", "--resume", str(src / "checkpoints" / "step-000002"))
        resumed, full = _losses(out), _losses(src)
        assert sorted(resumed) == [3, 4]
        _assert_close(resumed, {t: full[t] for t in (3, 4)})
        _assert_close(_adapter(out), _adapter(src))


@needs_mpi
def test_a_batch_that_does_not_divide_is_a_clear_error(tmp_path, tiny_llama):
    data = write_chat_data(tmp_path / "chat.jsonl")
    r = _finetune(2, tiny_llama, data, tmp_path / "run", "--steps", "1", "--batch", "3",
                  check=False)
    assert r.returncode != 0
    assert "--batch 3 is the global batch and must divide evenly over the 2 MPI ranks" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def _rank_stderr(tmp_path, rank: int) -> str:
    p = tmp_path / f"rank{rank}.err"
    return p.read_text(errors="replace") if p.exists() else ""


def _start_long_job(tmp_path, model, timeouts: tuple[str, str]):
    """A 2-rank finetune of many steps, rank r with TOYGRAPH_MPI_TIMEOUT ``timeouts[r]``
    (Hydra's MPMD form, one ``-env`` per rank), returned once rank 0 logged a step.

    Each rank writes its stderr straight to ``rank<r>.err`` (_rank_stderr): what mpiexec
    forwards can lose a rank's last lines when MPI_Abort tears the job down (seen: a
    stalled-rank job that ended with rank 0's abort message nowhere in mpiexec's stderr)."""
    data = write_chat_data(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    prog = [sys.executable, "-m", "toygraph.cli", "finetune",
            "--model", str(model), "--data", str(data), "--out", str(out), *ARGS,
            "--steps", "100000", "--val-split", "0"]
    cmd = [_mpiexec()]
    for rank, timeout_s in enumerate(timeouts):
        cmd += [":"] * (rank > 0) + ["-n", "1", "-env", "TOYGRAPH_MPI_TIMEOUT", timeout_s,
                                     "/bin/sh", "-c", 'exec "$@" 2>"$0"',
                                     str(tmp_path / f"rank{rank}.err"), *prog]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.pop("TOYGRAPH_MPI_TIMEOUT", None)
    job = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    for _ in range(1200):  # until rank 0 logged a step (at most ~2 minutes on a busy machine)
        if (out / "events.jsonl").exists() and _losses(out):
            break
        if job.poll() is not None:
            pytest.fail(f"the job ended early: {job.communicate()[1][-1000:]}\n"
                        f"rank 0: {_rank_stderr(tmp_path, 0)[-1000:]}\n"
                        f"rank 1: {_rank_stderr(tmp_path, 1)[-1000:]}")
        time.sleep(0.1)
    start = json.loads((out / "events.jsonl").read_text().splitlines()[0])
    return job, {r["rank"]: r["pid"] for r in start["ranks"]}


def _end(job, pids):
    try:
        _, err = job.communicate(timeout=120)  # a hang guard, not a timing assertion
    finally:
        for pid in pids.values():              # never leave a rank behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            job.kill()
    return err


@needs_mpi
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, tiny_llama):
    """SIGTERM to rank 1 only: the ranks agree to stop after the same step, rank 0 writes
    the interrupt checkpoint and the job exits 130 (nobody waits for a lost partner)."""
    job, pids = _start_long_job(tmp_path, tiny_llama, ("60", "60"))
    os.kill(pids[1], signal.SIGTERM)
    _end(job, pids)
    assert job.returncode == 130
    evs = [json.loads(l) for l in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    end = evs[-1]
    assert end["event"] == "run_end" and end["status"] == "interrupted"
    assert end["reason"] == "stopped by a signal to another MPI rank"
    assert [e["kind"] for e in evs if e["event"] == "checkpoint"] == ["interrupt"]


@needs_mpi
def test_a_killed_rank_ends_the_job(tmp_path, tiny_llama):
    job, pids = _start_long_job(tmp_path, tiny_llama, ("10", "10"))
    os.kill(pids[1], signal.SIGKILL)
    _end(job, pids)
    assert job.returncode != 0


@needs_mpi
def test_a_stalled_rank_makes_the_others_abort_after_the_timeout(tmp_path, tiny_llama):
    """Rank 1 stopped (not dead, so the launcher sees nothing): rank 0's collective passes
    its deadline and it aborts the job, saying why.

    Only rank 0's deadline is under test, so only rank 0 gets a short one: with the same
    short timeout on both, a loaded machine could delay one rank's step past it before the
    SIGSTOP, and then either rank could abort first. Rank 1's 600 s never fires (it is
    stopped, then killed); rank 0's 10 s is still far below the 120 s that _end waits, and
    far above a tiny step's normal skew between the ranks. The message is read from rank
    0's own stderr file, which mpiexec's forwarding cannot cut short (_start_long_job)."""
    job, pids = _start_long_job(tmp_path, tiny_llama, ("10", "600"))
    assert job.poll() is None, "the job ended before rank 1 was stopped"
    os.kill(pids[1], signal.SIGSTOP)
    _end(job, pids)
    assert job.returncode != 0
    err = _rank_stderr(tmp_path, 0)
    assert ("toygraph: rank 0 of 2:" in err
            and "did not complete within 10 s (TOYGRAPH_MPI_TIMEOUT)" in err), err[-2000:]
    assert "toygraph: rank 1 of 2:" not in _rank_stderr(tmp_path, 1)


# --- the CUDA backend's collective --------------------------------------------------------
def test_cuda_lowering_is_a_collective_then_a_copy_of_the_count():
    import toygraph.cuda  # noqa: F401  (loads every family's CUDA lowering)
    from toygraph.ops.lowering.launch import Collective
    from toygraph.ops.lowering.dispatch import Launch, lower
    g = Graph()
    count = g.state("count", (), kind="count")
    grad = g.state("grad", (2, 3), kind="grad")
    node = ops.all_reduce([count, grad], ranks=2)
    addr = {count.id: 0x1000, grad.id: 0x2000, node.id: 0x3000}
    collective, copy = lower(node, lambda t: addr[t.id])
    assert collective == Collective(((0x1000, 1), (0x2000, 6)), ranks=2)
    assert isinstance(copy, Launch) and copy.kernel == "tg_copy"
    assert [int(a[0]) for a in copy.args] == [0x3000, 0x1000, 1]


def test_nccl_is_imported_only_when_used_and_fails_clearly_without_a_gpu():
    """nccl4py imports (CI installs it with [dev]); without a GPU or libnccl, making the
    communicator is a one-line CudaError, not a crash."""
    pytest.importorskip("nccl.core", reason="nccl4py is not installed (pip install -e '.[cuda]')")
    from toygraph.cuda import driver, nccl
    from toygraph.errors import CudaError
    if driver.available():
        pytest.skip("a GPU is present: bench/gpu_session.sh's nccl stage runs NCCL for real")
    with pytest.raises(CudaError, match="NCCL") as e:
        nccl.communicator(1)
    assert "\n" not in str(e.value)


def test_nccl_communicator_passes_nccl4pys_own_unique_id_through(monkeypatch):
    """The unique id goes through nccl4py's real UniqueId class (bytes out, from_bytes in)
    with only the library calls replaced: the H200 session of 2026-11-28 found
    ``get_unique_id().as_bytes()`` calling a property (nccl4py 0.6), which the test above
    could not see behind its missing-libnccl error."""
    core = pytest.importorskip("nccl.core", reason="nccl4py is not installed")
    from toygraph.cuda import nccl
    made, seen = core.get_unique_id(empty=True), {}
    monkeypatch.setattr(core, "get_unique_id", lambda *a, **k: made)

    def init(nranks, rank, unique_id, config=None):
        seen.update(nranks=nranks, rank=rank, uid=bytes(unique_id))
        return "communicator"

    monkeypatch.setattr(core.Communicator, "init", staticmethod(init))
    monkeypatch.setattr(nccl, "_COMMS", {})
    assert nccl.communicator(1) == "communicator"
    assert seen == {"nranks": 1, "rank": 0, "uid": bytes(made)} and len(seen["uid"]) == 128
    assert nccl.communicator(1) == "communicator"  # made once


@needs_mpi
@pytest.mark.skipif(shutil.which("g++") is None, reason="the host device needs g++")
def test_two_ranks_on_the_cuda_backend_host_device(tmp_path, tiny_llama):
    """The CUDA backend's all_reduce (a Collective step in the captured launch sequence),
    run by the host device over MPI: 2 ranks give one process's losses (1e-6) and adapter.
    The adapter gets 1e-5: the CUDA kernels tile their sums over the batch differently at
    2 rows than at 4, and AdamW's first steps magnify rounding in the near-zero gradients of
    lora_A (B starts at 0), measured 4e-6 here against 2e-7 on the numpy backend."""
    data = write_chat_data(tmp_path / "chat.jsonl")
    run = ["--steps", "3", "--batch", "4", "--seq-len", "16", "--val-split", "0",
           "--backend", "cuda"]
    env = {"TOYGRAPH_CUDA_DEVICE": "host"}
    _finetune(1, tiny_llama, data, tmp_path / "one", *run, env=env)
    _finetune(2, tiny_llama, data, tmp_path / "two", *run, env=env)
    _assert_close(_losses(tmp_path / "two"), _losses(tmp_path / "one"))
    _assert_close(_adapter(tmp_path / "two"), _adapter(tmp_path / "one"), rtol=1e-5)


def test_preference_recipes_refuse_data_parallel(tiny_llama):
    """DPO/ORPO average per pair, which a sum over ranks would not reproduce: refused."""
    from toygraph.models.model import GGUFModel
    from toygraph.recipes import RecipeOptions
    from toygraph.recipes.dpo import DPO
    model = GGUFModel(str(tiny_llama))
    with pytest.raises(GraphError, match="--recipe dpo does not run data parallel"):
        DPO().realize(model, model.config, RecipeOptions(seq_len=8, batch=2, data_parallel=True))
