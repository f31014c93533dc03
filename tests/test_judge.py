"""The judge's self-checks: the reference passes every case, an untouched starter is not attempted,
each deliberately wrong solution in judge_mutants/ fails with a message that names its mistake,
and loops, exceptions, broken files and bad arguments get clear verdicts instead of a hang."""

import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import practice.judge as judge  # noqa: E402
from practice.judge import JudgeError, MissingDependency, exercises, grade, main  # noqa: E402
from practice.report import CaseResult, Result  # noqa: E402

MUTANTS = ROOT / "tests" / "judge_mutants"

# Each mutant, and a phrase that its first failing case must contain.
MUTANT_PHRASES = {
    "126_rope_rotates_the_wrong_way.py": "the rotation goes the wrong way",
    "126_rope_adjacent_pairs.py": "not the neighbours (2i, 2i + 1)",
    "126_attention_not_causal.py": "not causal",
    "126_attention_mask_ignores_cache.py": "the mask ignores the cached prefix",
    "126_attention_gqa_repeat.py": "repeat_interleave",
    "126_softmax_in_float32.py": "keep the input dtype (torch.float64)",
    "127_forgets_reference_counts.py": "free drops one reference per block",
    "127_frees_to_the_front.py": "holds a cached prefix joins the END",
    "127_frees_everything_to_the_end.py": "holds no prefix (block_hash None) goes to the FRONT",
    "127_front_in_reverse_order.py": "moving each to the front as it comes reverses them",
    "127_allows_double_free.py": "must raise RuntimeError",
    "127_touch_leaves_block_free.py": "must leave the free queue",
    "127_keeps_stale_prefix.py": "may still hold a cached prefix",
    "128_slot_is_position.py": "comes from the block table",
    "128_start_off_by_one.py": "off by one",
    "128_logits_of_the_first_token.py": "LAST new token",
    "128_samples_every_chunk.py": "only a chunk with sample=True",
    "129_admits_after_preemption.py": "admitted in a step that preempted",
    "129_preempts_the_head.py": "tail of the running queue",
    "129_running_pass_ignores_budget.py": "exceeded max_num_batched_tokens",
    "129_never_chunks.py": "should be chunked",
    "129_forgets_max_num_seqs.py": "more than max_num_seqs",
    "129_preempted_to_the_back.py": "FRONT of the waiting queue",
    "129_preempt_keeps_blocks.py": "free all its blocks",
    "129_chunks_without_chunked_prefill.py": "enable_chunked_prefill=False",
    "129_kind_by_length.py": "req.chunk_kind(start)",
    "129_allocates_a_block_too_many.py": "allocate_slots should take exactly",
    "129_victim_stays_running.py": "preempt must set req.status = RequestStatus.WAITING",
    "129_forgets_to_count_preemptions.py": "its num_preemptions should be 1: preempt must count the preemption",
    "129_admits_after_preemption_with_a_large_budget.py": "admitted in a step that preempted",
    "130_priority_inverted.py": "smallest key first",
    "130_no_aging.py": "priority_aging=1",
    "130_aging_wrong_sign.py": "priority_aging=1",
    "130_victim_is_the_tail.py": "the largest key (priority, arrival_time, seq)",
    "130_victim_is_the_most_urgent.py": "the largest key (priority, arrival_time, seq)",
    "130_ties_ignore_arrival.py": "among equal priorities the earlier arrival_time is served first",
    "130_key_without_arrival_time.py": "'b' (priority 1, arrival_time 1, seq 1) comes before 'a' (priority 1, "
                                       "arrival_time 2, seq 0); among equal priorities the earlier arrival_time",
    "130_key_without_seq.py": "with equal priority and equal arrival_time, seq (the order they were added) decides: "
                              "the larger seq is preempted first",
    "132_tpot_divides_by_output_tokens.py": "(E2EL - TTFT) / (output_tokens - 1)",
    "132_itl_includes_ttft.py": "TTFT is not an inter-token gap",
    "132_percentile_nearest_rank.py": "interpolate linearly",
    "132_failed_counted_in_throughput.py": "failed requests are counted in `failed` and left out",
    "132_goodput_strictly_below_slo.py": "value <= the SLO",
    "132_duration_from_first_start.py": "the duration you are given",
    "132_itl_pools_failed_requests.py": "a failed one is left out, even when chunks came",
}

def _declared_phrases() -> dict[str, str]:
    """Mutants may instead declare their phrase in the file: a line `EXPECTED_HINT = "..."`."""
    return _declared("EXPECTED_HINT")


def _declared(name: str) -> dict[str, str]:
    out = {}
    for path in MUTANTS.glob("1[0-9][0-9]_*.py"):
        m = re.search(rf'^{name} = "(.+)"$', path.read_text(), re.M)
        if m:
            out[path.name] = m[1]
    return out


MUTANT_PHRASES.update(_declared_phrases())
EXERCISES = sorted(int(p.name[:3]) for p in (ROOT / "practice").glob("1[0-9][0-9]_*") if p.is_dir())
# Where the mistake shows first: a case that only a random scenario catches must stay caught there.
MUTANT_CASES = {
    "129_admits_after_preemption_with_a_large_budget.py": "random_scenarios_",
    "130_key_without_seq.py": "victim_among_equal_priority_and_arrival_time_is_the_last_added",
    "130_key_without_arrival_time.py": "ties_go_to_the_earlier_arrival_time_not_the_first_added",
}
MUTANT_CASES.update(_declared("EXPECTED_CASE"))  # or in the file: a line `EXPECTED_CASE = "..."`
GRADED_APART = {"129_loops_when_blocks_run_out.py", "129_raises.py"}


@pytest.mark.parametrize("number", EXERCISES)
def test_reference_passes_every_case(number):
    result = grade(number, reference=True)
    assert result.ok and result.passed == len(result.cases) > 0, result.report()


@pytest.mark.parametrize("number", EXERCISES)
def test_untouched_starter_is_not_attempted(number):
    result = grade(number)
    assert [c.status for c in result.cases] == ["not attempted"] * len(result.cases)
    lines = result.report().splitlines()
    assert lines[1].startswith("NOT ATTEMPTED  ") and "raises NotImplementedError" in lines[1]
    assert lines[-1] == f"0 passed, {len(result.cases)} failed"


@pytest.mark.parametrize("name", sorted(p.name for p in MUTANTS.glob("model_*.py")))
def test_a_solution_written_from_the_statement_passes(name):
    # model_130_sorts_the_waiting_queue.py keeps the waiting queue sorted in place: it decides as the
    # reference does, so only decisions may be compared, not the queue's internal order.
    result = grade(int(name[6:9]), MUTANTS / name)
    assert result.ok, result.report()


def test_every_mutant_file_is_checked():
    files = {p.name for p in MUTANTS.glob("1[0-9][0-9]_*.py")}
    assert files == set(MUTANT_PHRASES) | GRADED_APART


@pytest.mark.parametrize("name", sorted(MUTANT_PHRASES))
def test_mutant_fails_with_a_message_naming_its_mistake(name):
    # a learner's case has 5 s; here the message is the point, and a busy machine must not turn it into a timeout
    result = grade(int(name[:3]), MUTANTS / name, exitfirst=True, timeout=60)
    failed = [c for c in result.cases if c.status == "fail"]
    assert failed, result.report()
    first = "\n".join(failed[0].format())
    assert MUTANT_PHRASES[name] in first, first
    assert failed[0].name.startswith(MUTANT_CASES.get(name, "")), first
    assert "hint: " in first and "expected" in first
    assert result.report().splitlines()[-1] == f"{result.passed} passed, {result.failed} failed"


def test_a_float32_computation_shows_the_largest_difference_and_the_tolerance():
    result = grade(126, MUTANTS / "126_softmax_in_float32.py", only="attention_prefill_is_causal")
    text = "\n".join(result.cases[0].format())
    expected, got = re.search(r"expected \[(.*)\]\n.*got +\[(.*)\]", text).groups()
    assert expected == got, text  # 4 decimals agree: without the next lines the report would show no difference
    diff = float(re.search(r"largest difference ([0-9.e+-]+) at index", text)[1])
    assert 1e-9 < diff < 1e-5, text
    assert "tolerance: |got - expected| <= 1e-09 + 1e-07 x |expected|" in text


def test_exitfirst_stops_at_the_first_failure():
    result = grade(129, MUTANTS / "129_preempts_the_head.py", exitfirst=True)
    assert [c.status for c in result.cases[:-1]] == ["pass"] * (len(result.cases) - 1)
    assert result.cases[-1].status == "fail" and result.stopped > 0
    assert result.report().splitlines()[-2:] == [f"stopped at the first failure: {result.stopped} more case(s) not run",
                                                 f"{result.passed} passed, 1 failed"]


def test_infinite_loop_is_cut_at_the_time_limit_and_located():
    result = grade(129, MUTANTS / "129_loops_when_blocks_run_out.py", timeout=2.0,
                   only=["budget_shared_by_one_step", "preempt_the_tail"])
    ok, looped = result.cases
    assert ok.status == "pass"
    text = "\n".join(looped.format())
    assert looped.status == "fail" and "time limit exceeded (2 s)" in text
    assert "129_loops_when_blocks_run_out.py" in text and "in waiting_pass" in text  # where it was stuck


def test_exception_is_a_runtime_error_with_the_learners_traceback():
    result = grade(129, MUTANTS / "129_raises.py", only="one_request_prefill_then_decode")
    text = "\n".join(result.cases[0].format())
    assert "runtime error: AttributeError" in text
    assert '129_raises.py", line' in text and "budget -= req.num_behnd" in text
    assert "judge.py" not in text and "scenarios.py" not in text  # only the learner's own frames


def test_a_not_implemented_error_from_torch_is_a_runtime_error(tmp_path):
    """torch raises NotImplementedError where a dtype lacks an operation (bincount of floats): the learner
    did attempt the exercise, so it is a runtime error on their line, not "not attempted"."""
    solution = tmp_path / "bincount.py"
    solution.write_text((MUTANTS / "model_136.py").read_text().replace(
        "    out = logits.clone()\n", "    out = logits.clone()\n    torch.bincount(torch.tensor([1.0]))\n"))
    result = grade(136, solution, exitfirst=True)
    case = next(c for c in result.cases if c.status != "pass")
    text = "\n".join(case.format())
    assert case.status == "fail" and "runtime error: NotImplementedError" in text, text
    assert "torch.bincount(torch.tensor([1.0]))" in text


def test_a_syntax_error_is_reported_once_with_its_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import math\n\nclass Scheduler(\n")
    result = grade(130, broken)
    assert not result.ok and result.passed == 0 and result.failed == len(result.cases) > 1
    text = result.report()
    assert text.count("was never closed") == 1 and "runtime error" not in text, text
    lines = text.splitlines()
    # The path as _show writes it: relative to the working directory when it is at most one level
    # up (a notebook's ../practice/...), absolute otherwise; tmp_path may be either, by where the
    # checkout lies.
    assert lines[1] == f"FAIL  loading {judge._show(broken)}"
    assert judge._show(broken) in (str(broken), os.path.relpath(broken))
    assert lines[2] == f"      syntax error at line 3 of {judge._show(broken)}: '(' was never closed", text
    assert lines[3].strip() == "class Scheduler(" and lines[4].strip() == "^"
    assert lines[5:] == [f"NOT RUN  all {len(result.cases)} cases: fix the error above, then grade again",
                         f"0 passed, {len(result.cases)} failed"]
    html = result._repr_html_()
    assert html.count("<tr>") == 3 and "NOT RUN" in html and "syntax error at line 3" in html


def test_a_runtime_error_while_loading_is_reported_once(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("x = undefined_name\n")
    result = grade(131, broken)
    text = result.report()
    assert text.count("runtime error: NameError") == 1 and "broken.py\", line 1" in text, text
    assert f"NOT RUN  all {len(result.cases)} cases" in text


def test_unknown_exercise_and_missing_file_list_what_exists(capsys):
    assert main(["999"]) == 2
    err = capsys.readouterr().err
    assert "there is no exercise '999'" in err
    assert all(f"  {n}  " in err for n in exercises())
    with pytest.raises(JudgeError, match=r"there is no file .*129_scheduler/solution\.py"):
        grade(129, ROOT / "no_such_solution.py")


def _cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "practice" / "judge.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_command_line_exit_status():
    one = ("-k", "max_decodes")
    good, starter, listed = _cli("131", "--reference", *one), _cli("131", *one), _cli("--list")
    assert good.returncode == 0 and good.stdout.splitlines()[-1] == "1 passed, 0 failed"
    assert starter.returncode == 1 and starter.stdout.splitlines()[-1] == "0 passed, 1 failed"
    assert listed.returncode == 0 and "129_scheduler/solution.py" in listed.stdout


# ----- a Python that is not the project's -----

def _system_python() -> str:
    """A python3 outside .venv (on this machine /usr/bin/python3, which has no torch)."""
    venv = str(ROOT / ".venv")
    for path in ["/usr/bin/python3", shutil.which("python3", path=os.defpath)]:
        if path and os.path.exists(path) and not os.path.realpath(path).startswith(venv):
            return path
    raise AssertionError("no python3 outside .venv on this machine")


def test_a_python_without_torch_is_told_in_one_line_how_to_fix_it():
    python = _system_python()
    has_torch = subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
    # Where the system Python does have torch, hide it, so the check still has something to find.
    cmd = ([python, "-c", "import runpy, sys; sys.modules['torch'] = None; sys.argv = ['practice/judge.py', '129']; "
            "runpy.run_path('practice/judge.py', run_name='__main__')"] if has_torch
           else [python, "practice/judge.py", "129"])
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr.splitlines() == [f"judge: this Python ({python}) cannot import torch: "
                                       "run `source .venv/bin/activate` and try again"], run.stderr


def test_a_notebook_kernel_that_is_not_the_projects_is_told_before_any_case_starts(monkeypatch):
    monkeypatch.setattr(judge, "DEPENDENCIES", ("torch", "no_such_module_of_the_project"))
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    monkeypatch.setattr(judge, "_run_child", lambda *a: pytest.fail("a child process was started"))
    with pytest.raises(MissingDependency) as e:
        grade(129)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"this kernel's Python ({sys.executable}) cannot import "
                                                       "no_such_module_of_the_project: switch to the project's kernel")


# ----- the report: plain text in a terminal, a table in a notebook -----

def _sample_result():
    return Result(129, "Exercise 129: the scheduler, grading solution.py", [
        CaseResult("budget_shared", "pass"),
        CaseResult("preempt_<tail>", "fail", ["scenario: budget 8 & 4 blocks", "  expected  a 4 prefill",
                                              "  got       <b>bold</b> & more", "hint: preempt the <tail> & retry"]),
        CaseResult("recompute", "not attempted", ["preempt() raises NotImplementedError"]),
    ])


def test_report_plain_text_is_one_line_per_case_and_a_summary():
    result = _sample_result()
    assert str(result) == repr(result) == result.report() == "\n".join([
        "Exercise 129: the scheduler, grading solution.py",
        "PASS  budget_shared",
        "FAIL  preempt_<tail>",
        "      scenario: budget 8 & 4 blocks",
        "        expected  a 4 prefill",
        "        got       <b>bold</b> & more",
        "      hint: preempt the <tail> & retry",
        "NOT ATTEMPTED  recompute: preempt() raises NotImplementedError",
        "1 passed, 2 failed"])


def test_report_html_is_a_table_with_every_case_escaped():
    html = _sample_result()._repr_html_().replace("<wbr>", "")  # names may break at underscores
    assert html.count("<tr>") == 4  # the header and one row per case
    for name in ("budget_shared", "preempt_&lt;tail&gt;", "recompute"):
        assert f"<code>{name}</code>" in html
    for label, colour in (("PASS", "#1a7f37"), ("FAIL", "#cf222e"), ("NOT ATTEMPTED", "#6e7781")):
        assert f"background:{colour};" in html and f">{label}</span>" in html
    assert "got       &lt;b&gt;bold&lt;/b&gt; &amp; more" in html and "<b>bold</b>" not in html
    assert "<td" in html and ">preempt the &lt;tail&gt; &amp; retry</td>" in html  # the hint, in its own column
    assert "budget 8 &amp; 4 blocks" in html and "preempt() raises NotImplementedError" in html
    assert html.endswith("<b>1 passed, 2 failed</b></p></div>")
