"""scripts/mutants_report.py (make mutants): the score, and survivors explained as equivalent.

mutmut itself is replaced by a fake `results` / `show` answer: the report's arithmetic and its
check of the equivalents file are what is tested here."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def report(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("mutants_report", ROOT / "scripts" / "mutants_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    results = "\n".join([
        "    nano_engine.m.x_f__mutmut_1: killed", "    nano_engine.m.x_f__mutmut_2: killed",
        "    nano_engine.m.x_f__mutmut_3: survived", "    nano_engine.m.x_f__mutmut_4: survived",
        "    nano_engine.m.x_f__mutmut_5: timeout", "    nano_engine.m.x_f__mutmut_6: not checked",
        "    nano_engine.m.x_f__mutmut_7: segfault", "    nano_engine.m.x_f__mutmut_8: suspicious"])
    diffs = {"nano_engine.m.x_f__mutmut_3": "--- a\n+++ b\n-    y = x or 1\n+    y = x or 2\n",
             "nano_engine.m.x_f__mutmut_4": "--- a\n+++ b\n-    return a < b\n+    return a <= b\n"}

    def fake_run(cmd, **kwargs):
        out = results if cmd[1] == "results" else diffs[cmd[2]]
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(mod.subprocess, "run", fake_run)
    mod.EQUIVALENT_FILE = tmp_path / "equivalent.txt"
    return mod


def test_score_counts_timeouts_and_crashes_as_killed_and_lists_survivors(report, capsys):
    assert report.main([]) == 0
    out = capsys.readouterr().out
    # 5 killed (2, a timeout, a segfault, an abort) of 7 checked: 71%; the unchecked one is counted, not scored
    assert "nano_engine.m" in out and " 71%" in out
    assert "mutmut_7" not in out and "mutmut_8" not in out
    assert "x_f__mutmut_3 (survived)" in out and "x_f__mutmut_4 (survived)" in out
    assert "mutmut_6" not in out.split("survivors in")[1]


def test_an_explained_equivalent_is_listed_apart_and_a_stale_one_is_not_trusted(report, capsys):
    report.EQUIVALENT_FILE.write_text(
        "# comment\nnano_engine.m.x_f__mutmut_3 | y = x or 2 | x is never 0 here\n"
        "nano_engine.m.x_f__mutmut_4 | return a < b + 1 | an older mutant\n")  # mutmut_4's diff has changed
    report.main([])
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("nano_engine.m "))
    assert line.split()[1:] == ["8", "5", "2", "0", "1", "71%", "86%"]  # the second score leaves mutmut_3 out
    assert "x_f__mutmut_3: x is never 0 here" in out and "x_f__mutmut_3 (" not in out
    (line,) = [ln for ln in out.splitlines() if "x_f__mutmut_4 (" in ln]
    assert "survived" in line and "stale" in line and "an older mutant" not in out
