"""The benchmark's side of the vLLM worker protocol (bench/systems.VLLMOffline), without vLLM.

A fake worker, written here, speaks the protocol of bench/vllm_worker.py: a ready line, then one
JSON answer per request, with outputs that show whether the parent kept request order, truncated
at end of sequence and honoured max_tokens. The faults a real worker can have (dying, hanging,
writing something other than the protocol) must end in a RuntimeError that names the worker's
last stderr lines, within a timeout: the benchmark must never hang on vLLM.
"""

import sys
import textwrap
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import run as bench_run  # noqa: E402
import systems as S  # noqa: E402
from workloads import Req, Workload  # noqa: E402

FAKE = textwrap.dedent('''
    import json, sys, time
    mode = sys.argv[1]
    print("fake vLLM: building the engine", file=sys.stderr, flush=True)
    if mode == "die_at_start":
        print("fake vLLM: out of memory while allocating the KV cache", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "noise":
        print("INFO a log line on stdout", flush=True)
    print(json.dumps({"ready": True, "vllm": "0.0-fake", "block_size": 128, "num_kv_blocks": 10}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("quit"):
            open(sys.argv[2], "w").write("quit")
            break
        if mode == "die_on_request":
            print("fake vLLM: segmentation fault in the attention kernel", file=sys.stderr, flush=True)
            sys.exit(7)
        if mode == "hang":
            time.sleep(60)
        if mode == "short":
            msg["prompts"] = msg["prompts"][:-1]
        # Each output names its prompt (first and last id), then end of sequence, then more: the
        # parent must cut after the 2 unless the request ignores it, and at max_tokens.
        outs = [[p[0], p[-1], 2, 7, 7, 7, 7, 7] for p in msg["prompts"]]
        print(json.dumps({"outputs": outs, "seconds": 0.25}), flush=True)
''')

W = Workload("fake", "", (Req((11, 12, 13), 8, False), Req((21, 22), 5, True), Req((31,), 1, False),
                          Req((41, 42), 8, True)))


def fake(tmp_path, mode="ok", **kw) -> S.VLLMOffline:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE)
    kw = dict(ready_timeout=20, run_timeout=20) | kw
    return S.VLLMOffline("bfloat16", command=[sys.executable, str(script), mode, str(tmp_path / "quit")], **kw)


def test_outputs_come_back_in_request_order_truncated(tmp_path):
    s = fake(tmp_path)
    s.setup()
    try:
        assert s.name == "vLLM offline bfloat16"
        assert s.info == {"ready": True, "vllm": "0.0-fake", "block_size": 128, "num_kv_blocks": 10}
        s.setup()  # already running: the same worker
        out = s.run(W)
        assert out == [[11, 13, 2], [21, 22, 2, 7, 7], [31], [41, 42, 2, 7, 7, 7, 7, 7]]
        assert s.run(W.subset(2)) == [[11, 13, 2], [31]]
        assert s.worker_seconds == [0.25, 0.25]
        proc = s.proc
    finally:
        s.close()
    assert s.proc is None and proc.returncode == 0
    assert (tmp_path / "quit").read_text() == "quit"  # it was asked to quit, and exited by itself
    s.close()  # twice is harmless


def _stopped(pid: int, timeout: float = 5.0) -> bool:
    """Whether the process is stopped (state T), waiting up to `timeout` for a signal to land."""
    end = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return True
        if time.monotonic() > end:
            return False
        time.sleep(0.01)


def test_the_worker_is_stopped_outside_its_own_turns(tmp_path):
    """An idle vLLM takes CPU time that would be charged to whichever system runs beside it, so
    the benchmark stops the worker's process group between its runs."""
    s = fake(tmp_path)
    s.setup()
    try:
        assert _stopped(s.proc.pid)  # ready, and stopped until its turn
        s.prepare(W)
        assert not _stopped(s.proc.pid, timeout=0.2)
        assert s.run(W.subset(2)) == [[11, 13, 2], [31]]
        s.finish()
        assert _stopped(s.proc.pid)
        assert s.run(W.subset(2)) == [[11, 13, 2], [31]]  # a run without prepare() continues it too
        proc = s.proc
    finally:
        s.close()
    assert proc.returncode == 0  # continued to quit by itself


@pytest.mark.parametrize("mode, when, what", [
    ("die_on_request", "run", "segmentation fault in the attention kernel"),
    ("die_at_start", "setup", "out of memory while allocating the KV cache"),
    ("hang", "run", "gave no answer in 1 s"),
    ("noise", "setup", "not a JSON object"),
    ("short", "run", "answered 3 outputs for 4 requests"),
])
def test_a_failing_worker_raises_with_its_last_words(tmp_path, mode, when, what):
    s = fake(tmp_path, mode, run_timeout=1)
    t = time.perf_counter()
    with pytest.raises(RuntimeError) as e:
        s.setup()
        assert when == "run"
        s.run(W)
    assert time.perf_counter() - t < 10
    assert what in str(e.value)
    assert "fake vLLM: building the engine" in str(e.value)  # the stderr tail is in the message
    if mode.startswith("die"):
        assert "exit status" in str(e.value)
    assert s.proc is None  # ended: nothing left running
    s.close()


def test_vllm_is_skipped_when_not_installed(tmp_path, monkeypatch):
    assert S.vllm_available(tmp_path / "no-such-venv" / "bin" / "python") is False
    monkeypatch.setattr(S, "vllm_available", lambda: False)
    skipped: set[str] = set()
    systems = bench_run.make_systems(["vllm"], ["float32"], {"float32": None}, 2, W, skipped)
    assert [s.name for s in systems] == ["nano_engine float32"] and skipped == {"vLLM"}


def test_vllm_runs_every_dtype_once_and_meets_its_own_reference(monkeypatch):
    monkeypatch.setattr(S, "vllm_available", lambda: True)
    kept: dict = {}
    first = bench_run.make_systems(["vllm"], ["float32", "bfloat16"], {"float32": None, "bfloat16": None}, 2, W, set(), kept)
    again = bench_run.make_systems(["vllm"], ["float32", "bfloat16"], {"float32": None, "bfloat16": None}, 2, W, set(), kept)
    assert [s.name for s in first[2:]] == ["vLLM offline float32", "vLLM offline bfloat16"]
    assert first[2:] == again[2:]  # the same workers for the next workload
    refs = {"float32": "fp32 reference", "bfloat16": "bf16 reference"}
    assert bench_run.reference_of(first[3], refs) == "bf16 reference"
    assert bench_run.reference_of(first[2], refs) == "fp32 reference"
    assert bench_run.reference_of(S.HFOneByOne("float32"), refs) == "fp32 reference"


def test_vllm_gets_the_benchmarks_settings():
    args = S.vllm_engine_args()
    assert args == dict(max_num_batched_tokens=512, max_num_seqs=64, enable_chunked_prefill=True,
                        enable_prefix_caching=True, scheduling_policy="fcfs", scheduler_reserve_full_isl=False,
                        max_model_len=4096)


def test_targets_compare_each_dtype_with_vllm_in_the_same_dtype():
    wl = {name: {"nano_engine float32": {"median_s": 1.0}, "vLLM offline float32": {"median_s": 1.5},
                 "nano_engine bfloat16": {"median_s": 2.0}, "vLLM offline bfloat16": {"median_s": 1.0}}
          for name in ("W1", "W3")}
    lines = [t for t in bench_run.targets({"workloads": wl}) if "vLLM offline" in t and "faster than vLLM" in t]
    assert lines == ["W1, nano_engine float32 faster than vLLM offline float32: 1.50x (1.00 s vs 1.50 s): met",
                     "W1, nano_engine bfloat16 faster than vLLM offline bfloat16: 0.50x (2.00 s vs 1.00 s): NOT met",
                     "W3, nano_engine float32 faster than vLLM offline float32: 1.50x (1.00 s vs 1.50 s): met",
                     "W3, nano_engine bfloat16 faster than vLLM offline bfloat16: 0.50x (2.00 s vs 1.00 s): NOT met"]


def test_the_worker_command_names_the_folder_of_the_embedded_weights():
    """What `make vllm` users run: the command is built without vLLM, from nano_engine's own
    dequantized folder of the embedded model (config, weights and tokenizer files)."""
    cmd = S.VLLMOffline("float32").worker_command()
    folder = Path(cmd[cmd.index("--model") + 1])
    assert all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer_config.json"))
    assert cmd[cmd.index("--dtype") + 1] == "float32"
