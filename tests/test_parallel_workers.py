"""Tensor-parallel ranks as processes (nano_engine/parallel/workers.py): every rank runs each call,
and a rank that fails, dies or hangs fails the call with its reason and leaves no process behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from nano_engine.parallel.workers import SharedGather, WorkerError, Workers, max_ranks


class Toy:
    def __init__(self, group):
        self.group = group

    def gather(self, n):
        return torch.cat(self.group.all_gather(torch.full((n,), float(self.group.rank))))

    def pid(self):
        return os.getpid()

    def raise_on(self, rank):
        if self.group.rank == rank:
            raise ValueError("a worker's own trouble")
        return self.group.all_gather(torch.zeros(1))

    def sleep_on(self, rank, seconds):
        if self.group.rank == rank:
            time.sleep(seconds)
        return self.group.all_gather(torch.zeros(1))


def make_toy(group):
    return Toy(group)


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):  # a zombie: exited, not yet reaped
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def workers():
    w = Workers(2, make_toy, timeout_s=5)
    yield w
    w.close()


def test_every_rank_runs_the_call_and_collectives_come_in_rank_order(workers):
    assert torch.equal(workers.call("gather", 3), torch.tensor([0.0, 0, 0, 1, 1, 1]))
    assert workers.call("gather", 1).tolist() == [0.0, 1.0]  # and again: the group lives on
    big = SharedGather.SLOT // 4 + 1  # more than a shared-memory slot holds: through gloo
    for n in (big, 5, big, 2, 7):  # sizes in turn, each set of slots reused
        assert torch.equal(workers.call("gather", n), torch.cat([torch.zeros(n), torch.ones(n)]))


def test_a_worker_that_raises_fails_the_call_with_its_reason_and_stops_the_group(workers):
    pids = [p.pid for p in workers.procs]
    with pytest.raises(WorkerError, match=r"rank 1 .*ValueError: a worker's own trouble"):
        workers.call("raise_on", 1)
    assert all(gone(pid) for pid in pids)
    with pytest.raises(WorkerError, match="stopped"):
        workers.call("gather", 1)


def test_a_worker_killed_mid_call_fails_the_call_and_nothing_is_left(workers):
    pid = workers.procs[0].pid
    killer = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(0.5); os.kill({pid}, 9)"])
    t = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        workers.call("sleep_on", 1, 30)  # rank 0 waits in the gather while rank 1 sleeps; then it is killed
    killer.wait()
    assert time.monotonic() - t < 10  # the closed socket fails the gather at once, not at the 5 s timeout + more
    assert gone(pid)


def test_a_hung_worker_fails_the_call_after_the_timeout():
    w = Workers(2, make_toy, timeout_s=2)
    pid = w.procs[0].pid
    t = time.monotonic()
    with pytest.raises(WorkerError, match="rank"):
        w.call("sleep_on", 1, 60)
    assert time.monotonic() - t < 30
    assert gone(pid)


def test_the_workers_go_when_the_engine_process_dies(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_parallel_workers import make_toy
        from nano_engine.parallel.workers import Workers
        if __name__ == "__main__":
            w = Workers(2, make_toy, timeout_s=5)
            print(w.procs[0].pid, flush=True)
            os._exit(0)  # no close(), no atexit: only the pipe tells the worker
    """)
    (tmp_path / "parent.py").write_text(script)
    out = subprocess.run([sys.executable, str(tmp_path / "parent.py")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert gone(int(out.stdout.split()[0]))


def test_a_number_of_ranks_the_machine_cannot_run_is_refused_before_any_process_starts():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            Workers(bad, make_toy)
    with pytest.raises(ValueError, match=rf"{max_ranks() + 1} ranks"):
        Workers(max_ranks() + 1, make_toy)


def test_one_rank_needs_no_process():
    with Workers(1, make_toy) as w:
        assert w.procs == [] and w.call("pid") == os.getpid()
        assert w.call("gather", 2).tolist() == [0.0, 0.0]


class _FailsToUnpickle:
    def __reduce__(self):
        return (int, ("not a number",))  # raises in the worker, before any of our code runs there


def _toy_with(extra, group):
    return Toy(group)


def test_a_worker_that_cannot_start_fails_the_start_at_once_not_after_the_timeout():
    import functools

    t = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1"):
        Workers(2, functools.partial(_toy_with, _FailsToUnpickle()), timeout_s=300)
    assert time.monotonic() - t < 60


def test_without_room_in_dev_shm_the_slots_live_in_the_temporary_folder(monkeypatch):
    """A container's /dev/shm is often 64 MiB: the shared file goes to the temporary folder instead
    (shared through the page cache), and the all-gather gives the same answers."""
    import nano_engine.parallel.workers as workers_module

    monkeypatch.setattr(workers_module, "_shared_folder", lambda nbytes: None)
    with Workers(2, make_toy) as w:
        assert w.group.shared is not None
        assert torch.equal(w.call("gather", 3), torch.tensor([0.0, 0, 0, 1, 1, 1]))
