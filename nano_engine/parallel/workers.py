"""The processes of a tensor-parallel engine: rank 0 is the engine's own process, ranks 1 .. N - 1
are workers it starts, and every rank runs the same method at the same time.

vLLM's CPU executor (vllm/v1/executor/multiproc_executor.py) starts one worker process per rank
and broadcasts each step's call to all of them through a shared-memory queue; the scheduler's
process holds no shard. Here rank 0 lives in the engine's process (as vLLM's older driver worker
did): the step's batch then travels once, from rank 0 to the others, and the logits need no trip
back. The ranks talk through a private gloo group on 127.0.0.1 (not torch.distributed's default
group, so that one process can hold several engines), with collectives only: `Group`.

A worker that dies (killed, or its method raised) closes its sockets, so the collective rank 0
waits in fails at once; one that hangs fails it after `timeout_s`. Either way `Workers.call`
raises WorkerError naming the rank, its exit code and, when it raised, its traceback, and the
group is shut down: every worker stopped, none left behind. Each worker also watches the engine's
process, and exits when it goes (vLLM's death pipe).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import platform
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

HOST = "127.0.0.1"


class WorkerError(RuntimeError):
    """A rank failed: the group is shut down and cannot run another call."""


class SharedGather:
    """An all-gather through shared memory, for the ranks of one machine: each rank copies its tensor
    into its slot and raises its flag to the call's number; when every flag has reached it, each
    copies every slot out. Two sets of slots, used in turn: a rank cannot write a slot again before
    every rank has read it (it would need their flags for the call in between, raised only after
    their reads). x86 keeps a core's stores in order (the data before the flag), so no fence is
    needed; elsewhere gloo's all-gather runs instead. vLLM's CPU all-reduce (csrc/cpu/shm.cpp) works
    the same way, in C++. A call larger than a slot goes through gloo."""

    SLOT = 8 << 20  # bytes per rank and set: a (2,048 x 1,024) float32 tensor

    def __init__(self, path: str, rank: int, size: int, timeout_s: float, alive=None):
        self.rank, self.size, self.timeout_s, self.alive = rank, size, timeout_s, alive
        mem = torch.from_file(path, shared=True, size=self.nbytes(size), dtype=torch.uint8)
        self.flags = mem[:8 * size].view(torch.int64).numpy()  # one int64 per rank; numpy: a cheap read
        self.slots = mem[64:].view(2, size, self.SLOT)
        self.calls = 0

    @classmethod
    def nbytes(cls, size: int) -> int:
        return 64 + 2 * size * cls.SLOT

    @staticmethod
    def usable(size: int) -> bool:
        return platform.machine().lower() in ("x86_64", "amd64") and size <= 8

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        flat = t.contiguous().view(-1).view(torch.uint8)
        n = flat.numel()
        self.calls += 1
        slots = self.slots[self.calls & 1]
        slots[self.rank, :n].copy_(flat)
        self.flags[self.rank] = self.calls  # after the data (x86: stores stay in order)
        self._wait()
        return [slots[r, :n].view(t.dtype).view(t.shape).clone() for r in range(self.size)]

    def _wait(self) -> None:
        spins, deadline = 0, None
        while self.flags.min() < self.calls:
            spins += 1
            if spins > 64:  # more ranks than cores: let the others run
                os.sched_yield()
            if spins % 1024 == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                late = [r for r in range(self.size) if self.flags[r] < self.calls]
                if self.alive is not None and not self.alive():
                    raise RuntimeError(f"rank {late} exited during an all-gather")
                if now > deadline:
                    raise TimeoutError(f"ranks {late} did not reach all-gather {self.calls} in {self.timeout_s} s")


def _shared_folder(nbytes: int) -> str | None:
    """/dev/shm where it has room for the slots (a container's is often 64 MiB, and a shared file
    larger than its tmpfs kills the process that touches the missing pages), else the temporary
    folder: a file there is shared through the page cache all the same."""
    try:
        stat = os.statvfs("/dev/shm")
        if stat.f_bavail * stat.f_frsize >= 2 * nbytes:
            return "/dev/shm"
    except OSError:
        pass
    return None


class Group:
    """The collectives the ranks use, on one gloo process group (the all-gather through shared
    memory where `share` has set it up)."""

    def __init__(self, pg: dist.ProcessGroupGloo, rank: int, size: int):
        self.pg, self.rank, self.size = pg, rank, size
        self.shared: SharedGather | None = None

    def share(self, timeout_s: float, alive=None) -> None:
        """Set up the shared-memory all-gather (every rank calls this at once): rank 0 makes the
        file, the others map it, then it is unlinked: the memory goes when the last rank does."""
        if self.size == 1 or not SharedGather.usable(self.size):
            return
        path = None
        if self.rank == 0:
            fd, path = tempfile.mkstemp(prefix="nano_engine-tp-", dir=_shared_folder(SharedGather.nbytes(self.size)))
            os.close(fd)
        path = self.broadcast_object(path)
        try:
            self.shared = SharedGather(path, self.rank, self.size, timeout_s, alive)
            self._gloo_all_gather(torch.zeros(1))  # every rank has mapped it
        finally:
            if self.rank == 0:
                os.unlink(path)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """t from rank src, in place on every rank (its shape and dtype must already agree)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([t], opts).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's t (tensors of one shape and dtype), in rank order, on every rank."""
        if self.shared is not None and t.numel() * t.element_size() <= SharedGather.SLOT:
            return self.shared.all_gather(t)
        return self._gloo_all_gather(t)

    def _gloo_all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([out], [t.contiguous()]).wait()
        return out

    def gather(self, t: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's t (one shape and dtype), in rank order, on rank dst only (None elsewhere)."""
        opts = dist.GatherOptions()
        opts.rootRank = dst
        out = [[torch.empty_like(t) for _ in range(self.size)]] if self.rank == dst else []
        self.pg.gather(out, [t.contiguous()], opts).wait()
        return out[0] if self.rank == dst else None

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.pg.send([t.contiguous()], dst, 0).wait()

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Into t (its shape and dtype must be the sender's), from rank src."""
        self.pg.recv([t], src, 0).wait()
        return t

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """A picklable object from rank src (others pass None): its length, then its bytes."""
        data = pickle.dumps(obj) if self.rank == src else b""
        n = self.broadcast(torch.tensor([len(data)], dtype=torch.int64), src)
        if self.rank == src:
            if data:
                self.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src)
            return obj
        buf = self.broadcast(torch.empty(int(n), dtype=torch.uint8), src)
        return pickle.loads(buf.numpy().tobytes())


def _cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cores_of(rank: int, world: int) -> list[int] | None:
    """The cores rank `rank` runs on: an equal share of this process's, or None where there are
    fewer cores than ranks (then every rank runs one thread where the OS puts it)."""
    cores = _cores()
    if len(cores) < world:
        return None
    share = len(cores) // world
    return cores[rank * share:(rank + 1) * share]


def max_ranks() -> int:
    """Two ranks a core at most: beyond that a step waits on the OS scheduler more than it computes."""
    return 2 * len(_cores())


STARTUP_S = 120.0  # seconds a worker may take to start (spawn, import torch) on a busy machine


def _group(rank: int, world: int, port: int, timeout_s: float, store=None) -> Group:
    """This rank's group. A worker says it is ready in the store first; rank 0 (which holds the
    store) makes its group once every worker is: the group's own timeout is then for collectives
    only, not for a slow start."""
    if store is None:
        store = dist.TCPStore(HOST, port, world, False, datetime.timedelta(seconds=max(timeout_s, STARTUP_S)))
        store.set(f"ready{rank}", "1")
    return Group(dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=timeout_s)), rank, world)


def _watch_parent(conn) -> None:
    """Exit when the engine's process goes: its end of the pipe closes."""
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    os._exit(0)


def _worker_main(rank: int, world: int, port: int, timeout_s: float, factory, conn) -> None:
    cores = cores_of(rank, world)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores) if cores else 1)
    threading.Thread(target=_watch_parent, args=(conn,), daemon=True).start()
    try:
        group = _group(rank, world, port, timeout_s)
        group.share(timeout_s)
        obj = factory(group)
        while True:
            call = group.broadcast_object()
            if call is None:
                break
            name, args, kwargs = call
            getattr(obj, name)(*args, **kwargs)
    except BaseException as e:  # tell rank 0 why, then go: our closed sockets fail its collective
        try:
            conn.send(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


class Workers:
    """Ranks 1 .. world - 1 as processes, rank 0 here; `call` runs a method on every rank's object.

    `factory(group)` builds a worker's object: a top-level function, or a functools.partial of
    one, since workers are started with spawn, like vLLM's. `main(group)` builds rank 0's (default:
    factory); it is not sent anywhere, so it may hold what cannot travel, such as the whole model."""

    def __init__(self, world: int, factory: Callable[[Group], Any], timeout_s: float = 120.0,
                 main: Callable[[Group], Any] | None = None):
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"the number of ranks must be a positive integer, got {world!r}")
        if world > max_ranks():
            raise ValueError(f"{world} ranks on {max_ranks() // 2} cores: at most {max_ranks()} (two a core)")
        self.world, self.closed, self.error = world, False, None
        self._threads = torch.get_num_threads()
        self.procs, self.conns = [], []
        store = dist.TCPStore(HOST, 0, world, True, datetime.timedelta(seconds=max(timeout_s, STARTUP_S)),
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, world):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=_worker_main, args=(rank, world, store.port, timeout_s, factory, theirs),
                                name=f"nano_engine-rank{rank}", daemon=True)
                p.start()
                theirs.close()
                self.procs.append(p)
                self.conns.append(ours)
            cores = cores_of(0, world)
            torch.set_num_threads(len(cores) if cores else 1)
            self._wait_ready(store, max(timeout_s, STARTUP_S))
            self.group = _group(0, world, store.port, timeout_s, store=store)
            self.group.share(timeout_s, alive=lambda: all(p.is_alive() for p in self.procs))
            self._store = store
            self.obj = (main or factory)(self.group)
        except BaseException as e:
            self._fail(e)

    def _wait_ready(self, store, seconds: float) -> None:
        """Until every worker has started; a worker that exits first (a failed import, a bad
        factory argument) fails this at once, not after the timeout."""
        keys, deadline = [f"ready{rank}" for rank in range(1, self.world)], time.monotonic() + seconds
        while not store.check(keys):
            if any(p.exitcode is not None for p in self.procs):
                raise RuntimeError("a worker exited while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers did not start in {seconds:.0f} s")
            time.sleep(0.01)

    def call(self, name: str, *args, **kwargs):
        """obj.name(*args, **kwargs) on every rank at once; rank 0's result."""
        if self.closed:
            raise WorkerError(f"the workers are stopped{': ' + self.error if self.error else ''}")
        try:
            self.group.broadcast_object((name, args, kwargs))
            return getattr(self.obj, name)(*args, **kwargs)
        except BaseException as e:
            self._fail(e)

    def _fail(self, e: BaseException):
        dead = self._dead()
        self.error = dead or f"{type(e).__name__}: {e}"
        self.close()
        raise WorkerError(f"tensor-parallel rank failed: {self.error}") from e

    def _dead(self) -> str | None:
        """Which worker died and why, waiting a moment for one whose sockets closed first."""
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            p.join(timeout=2.0)
            if p.exitcode not in (None, 0):
                try:
                    why = conn.recv() if conn.poll(0.5) else None
                except (EOFError, OSError):
                    why = None
                return f"rank {rank} (pid {p.pid}) {why or f'exited with code {p.exitcode}'}"
        return None

    def close(self) -> None:
        """Stop every worker: a stop call where the group still works, then SIGTERM, then SIGKILL."""
        if self.closed:
            return
        self.closed = True
        if self.error is None:
            try:
                self.group.broadcast_object(None)
            except BaseException:
                pass
        for p in self.procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=4.0)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
        torch.set_num_threads(self._threads)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # a forgotten group: its workers go with it (they also watch this process)
        if not getattr(self, "closed", True):
            try:
                self.close()
            except Exception:
                pass
