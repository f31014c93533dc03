"""bench/online.py's bookkeeping, without servers: medians and ranges over rounds, the direction of
the ratios, the clients' command lines (loopback, bounded, the same dataset and seed for both)."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import online  # noqa: E402


def run(rate, server, client, rnd, tput, ttft, tpot):
    m = dict(request_throughput=tput, output_throughput=tput * 32, median_ttft_ms=ttft, p99_ttft_ms=ttft * 2,
             median_tpot_ms=tpot, p99_tpot_ms=tpot * 2, median_itl_ms=tpot, median_e2el_ms=ttft + 31 * tpot)
    return dict(round=rnd, rate=rate, server=server, client=client, completed=16, **m)


def test_rows_are_medians_with_the_range_over_rounds():
    runs = [run("1", "nano_engine", "vllm bench serve", r, t, 300 + 10 * r, 100) for r, t in enumerate([1.0, 3.0, 2.5])]
    [row] = online.summarize(runs, ["1"])
    assert row["rounds"] == 3 and row["completed"] == [16, 16, 16]
    assert row["request_throughput"] == dict(median=2.5, min=1.0, max=3.0)
    assert row["median_ttft_ms"] == dict(median=310, min=300, max=320)
    assert "2.50 (1.00-3.00)" in online.table([row])


def test_ratios_say_who_is_ahead_the_right_way_round():
    runs = [run("inf", "nano_engine", c, 0, 2.0, 100, 50) for c in online.CLIENTS]
    runs += [run("inf", "vLLM", c, 0, 1.0, 400, 200) for c in online.CLIENTS]
    lines = online.ratios(online.summarize(runs, ["inf"]), ["inf"])
    assert len(lines) == 2
    # nano_engine has twice the throughput, a quarter of the TTFT and TPOT: ahead on all three.
    assert all("output tok/s 2.00x, TTFT 4.00x, TPOT 4.00x" in line for line in lines), lines


def test_both_clients_send_the_same_bounded_dataset_to_loopback(tmp_path):
    a = SimpleNamespace(num_prompts=16, input_len=128, output_len=32, seed=7)
    cmds = [online.client_cmd(c, "http://127.0.0.1:8123", tmp_path, "2", a, tmp_path / "x.json")
            for c in online.CLIENTS]
    for cmd in cmds:
        for flag, value in (("--num-prompts", "16"), ("--random-input-len", "128"), ("--random-output-len", "32"),
                            ("--request-rate", "2"), ("--seed", "7"), ("--base-url", "http://127.0.0.1:8123"),
                            ("--dataset-name", "random")):
            assert cmd[cmd.index(flag) + 1] == value, (flag, cmd)
        assert "--ignore-eos" in cmd
    assert "bench-serve" in cmds[0] and any("vllm.benchmarks.serve" in part for part in cmds[1])
