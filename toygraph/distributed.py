"""Data parallelism: which rank this process is, and the collectives the run needs.

>>> w = world()                     # size 1 unless started by an MPI launcher
>>> w.rank, w.size
(0, 1)

``mpirun -n N toygraph finetune ...`` starts N processes; each finds its rank in the
launcher's environment (MPICH/Hydra's and PMI-2's ``PMI_RANK``/``PMI_SIZE``, Open MPI's
``OMPI_COMM_WORLD_*``, MVAPICH's ``MV2_COMM_WORLD_*``). Slurm's ``SLURM_NTASKS`` is not
read: a batch script's own single process has it too. Only when that says more than one rank is ``mpi4py`` imported: a
single process, with or without a launcher, runs exactly as before and imports nothing new.

Every collective is nonblocking underneath and polled against a deadline
(``$TOYGRAPH_MPI_TIMEOUT`` seconds): a rank that died or hangs cannot hold the others
forever. When the deadline passes, or when a rank fails on its own (an error the others
do not share), that rank says why on stderr and calls ``MPI_Abort``, which ends the whole
job. Errors that every rank meets alike (bad options, a missing file) go through
:meth:`World.agree` instead, so every rank exits with the same one-line message.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from toygraph import environment
from toygraph.errors import ToygraphError

#: (size variable, rank variable) of the launchers toygraph recognises, first match wins.
LAUNCHER_VARS = (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
                 ("PMI_SIZE", "PMI_RANK"),
                 ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"))


#: The rank's index among the ranks on its own node, by launcher.
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")


class DistributedError(ToygraphError):
    """The ranks of a data-parallel run cannot work together (mpi4py missing, a rank failed)."""


def launched_size() -> int:
    """How many ranks the launcher started (1 without a launcher); reads only the
    environment."""
    for size_var, rank_var in LAUNCHER_VARS:
        raw = os.environ.get(size_var)
        if raw and os.environ.get(rank_var) is not None:
            try:
                size = int(raw)
            except ValueError:
                raise DistributedError(f"{size_var}={raw!r}: not a number of ranks") from None
            if size < 1:
                raise DistributedError(f"{size_var}={raw!r}: must be >= 1")
            return size
    return 1


def local_rank() -> int:
    """This rank's index on its node (0 for a single process): its default GPU."""
    if launched_size() == 1:
        return 0
    for var in LOCAL_RANK_VARS:
        raw = os.environ.get(var, "")
        if raw.isdigit():
            return int(raw)
    return 0


class World:
    """The ranks of one job. This base class is the single process: every collective
    returns its input. :class:`MpiWorld` is the real thing."""

    rank, size = 0, 1

    def sum(self, values) -> np.ndarray:
        """Element-wise sum over ranks of a small float64 vector (losses, token counts)."""
        return np.asarray(values, np.float64).copy()

    def sum_inplace(self, buf: np.ndarray, what: str) -> None:
        """``buf`` becomes the element-wise sum of every rank's ``buf``."""

    def sum_arrays(self, arrays, what: str) -> None:
        """Each of ``arrays`` becomes its sum over ranks, in place, through one collective
        over a packed copy (one message per step, not one per gradient)."""
        if self.size == 1:
            return
        flat = np.concatenate([a.reshape(-1) for a in arrays])
        self.sum_inplace(flat, what)
        offset = 0
        for a in arrays:
            np.copyto(a, flat[offset:offset + a.size].reshape(a.shape))
            offset += a.size

    def any(self, flags) -> list[bool]:
        """Element-wise OR over ranks (e.g. "a signal arrived", "a checkpoint is due")."""
        return [bool(f) for f in flags]

    def agree(self, error: BaseException | None) -> None:
        """Raise on every rank when any rank brings an error (a ToygraphError); the rank
        that had it raises its own, the others a DistributedError naming it. Either is
        marked ``agreed`` (every rank raises it: no need to abort the job)."""
        if error is not None:
            raise _agreed(error)

    def gather_info(self) -> list[dict]:
        """[{rank, host, pid}] of every rank (rank 0's list is the one that is logged)."""
        return self.gather(_my_info(self.rank))

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (plain JSON: None, numbers, strings, lists, dicts), by rank."""
        return [obj]

    def check_same_job(self, facts: dict) -> None:
        """Refuse on every rank (an agreed DistributedError) when a rank's ``facts`` (what
        makes its job that job: the options, digests of the model and data) differ from
        rank 0's, naming the first rank and the first fact that differ. Ranks that run
        different jobs would sum gradients of different models or data without a word."""
        if self.size == 1:
            return
        everyone = self.gather(facts)
        ours = everyone[0]
        for r, theirs in enumerate(everyone[1:], 1):
            key = next((k for k in [*ours, *theirs] if ours.get(k) != theirs.get(k)), None)
            if key is not None:
                raise _agreed(DistributedError(
                    f"rank {r} of {self.size} does not run rank 0's job: {key} is "
                    f"{_shown(theirs.get(key))} there and {_shown(ours.get(key))} on rank 0; "
                    f"start every rank with the same options, model and data"))

    def bcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank."""
        return data

    def fail(self, message: str, code: int = 1):
        """Report ``message`` and end the job (a single process just raises it)."""
        raise DistributedError(message)


def _shown(value) -> str:
    """A fact's value in a message: a string as it is (quoted when empty), else JSON."""
    import json
    return value if isinstance(value, str) and value else json.dumps(value)


def _agreed(error: BaseException) -> BaseException:
    error.agreed = True
    return error


def is_agreed(error: BaseException) -> bool:
    """Whether every rank raises ``error`` (from :meth:`World.agree`)."""
    return getattr(error, "agreed", False)


def agreed_call(w: World, fn, *args):
    """``fn(*args)`` on every rank, then :meth:`World.agree` on its ToygraphError."""
    try:
        result, error = fn(*args), None
    except ToygraphError as e:
        result, error = None, e
    w.agree(error)
    return result


def _my_info(rank: int) -> dict:
    import socket
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}


class MpiWorld(World):
    """COMM_WORLD through mpi4py, every collective bounded by ``timeout`` seconds."""

    def __init__(self, comm, timeout: float):
        from mpi4py import MPI
        self.MPI, self.comm, self.timeout = MPI, comm, timeout
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def _wait(self, request, what: str) -> None:
        """Poll ``request`` until done or the deadline; backs off to 1 ms sleeps so a rank
        that waits leaves the CPU to the ranks still computing."""
        deadline = time.monotonic() + self.timeout
        pause = 1e-5
        while not request.Test():
            if time.monotonic() > deadline:
                self.fail(f"{what} did not complete within {self.timeout:g} s "
                          f"(TOYGRAPH_MPI_TIMEOUT): another rank has failed or stalled")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def sum_inplace(self, buf: np.ndarray, what: str = "an all-reduce") -> None:
        self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM), what)

    def sum(self, values) -> np.ndarray:
        buf = np.array(values, np.float64)
        self.sum_inplace(buf, "the all-reduce of the step's loss")
        return buf

    def any(self, flags) -> list[bool]:
        buf = np.array([1 if f else 0 for f in flags], np.int32)
        self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.MAX),
                   "the ranks' agreement on stopping or saving")
        return [bool(x) for x in buf]

    def _allgather_bytes(self, data: bytes, what: str) -> list[bytes]:
        size = np.array([len(data)], np.int64)
        sizes = np.zeros(self.size, np.int64)
        self._wait(self.comm.Iallgather(size, sizes), what)
        out = np.zeros(int(sizes.sum()), np.uint8)
        counts, displs = sizes.tolist(), np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        mine = np.frombuffer(data, np.uint8) if data else np.zeros(0, np.uint8)
        self._wait(self.comm.Iallgatherv(mine, [out, counts, displs, self.MPI.BYTE]), what)
        return [out[d:d + c].tobytes() for c, d in zip(counts, displs)]

    def agree(self, error: BaseException | None) -> None:
        mine = b"" if error is None else (" ".join(str(error).split()) or type(error).__name__).encode()
        msgs = self._allgather_bytes(mine, "the ranks' check that every rank is ready")
        if error is not None:
            raise _agreed(error)
        failed = [(r, m.decode(errors="replace")) for r, m in enumerate(msgs) if m]
        if failed:
            r, m = failed[0]
            raise _agreed(DistributedError(f"rank {r} of {self.size} failed: {m}"))

    def gather(self, obj) -> list:
        import json
        parts = self._allgather_bytes(json.dumps(obj).encode(),
                                      "the gathering of what every rank reports")
        return [json.loads(p) for p in parts]

    def bcast_bytes(self, data: bytes | None) -> bytes:
        n = np.array([len(data) if self.rank == 0 else 0], np.int64)
        self._wait(self.comm.Ibcast(n, root=0), "a broadcast from rank 0")
        buf = (np.frombuffer(data, np.uint8).copy() if self.rank == 0
               else np.zeros(int(n[0]), np.uint8))
        self._wait(self.comm.Ibcast(buf, root=0), "a broadcast from rank 0")
        return buf.tobytes()

    def fail(self, message: str, code: int = 1):
        """Say why on stderr and end every rank of the job (MPI_Abort)."""
        try:
            print(f"toygraph: rank {self.rank} of {self.size}: {message}; aborting the MPI job",
                  file=sys.stderr, flush=True)
        finally:
            self.comm.Abort(code)
            os._exit(code)  # MPICH's MPI_Abort can return once the launcher is told


_WORLD: World | None = None


def world_of(ranks: int) -> World:
    """This process's World, checked to have the ``ranks`` ranks a graph was built for."""
    w = world()
    if w.size != ranks:
        raise DistributedError(f"this graph sums gradients over {ranks} ranks but the job "
                               f"has {w.size}: realize it in the job that runs it")
    return w


def world() -> World:
    """This process's World, made on first use: an MpiWorld when a launcher started more
    than one rank (mpi4py is imported only then), else the single-process World."""
    global _WORLD
    if _WORLD is None:
        size = launched_size()
        _WORLD = _mpi_world(size) if size > 1 else World()
    return _WORLD


def _mpi_world(size: int) -> World:
    try:
        from mpi4py import MPI
    except ImportError:
        raise DistributedError(
            f"started as one of {size} MPI ranks, but mpi4py is not installed: "
            f"pip install 'toygraph[mpi]' (mpi4py and an MPI library)") from None
    w = MpiWorld(MPI.COMM_WORLD, environment.get("TOYGRAPH_MPI_TIMEOUT"))
    if w.size != size:
        raise DistributedError(f"the launcher's environment says {size} ranks but MPI says "
                               f"{w.size}: is mpi4py built against another MPI than mpirun's?")
    return w
