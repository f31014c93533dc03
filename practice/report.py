"""The judge's report: one verdict per case, as plain text for a terminal and as a table for a notebook.

`Result` is what `practice.judge.grade()` returns. In a terminal (or `print(result)`) it is the
plain report: one line per case (PASS, FAIL or NOT ATTEMPTED, then indented details) and the
"N passed, N failed" line. In a notebook, Jupyter asks for `_repr_html_` and shows the same
verdicts as a table: the case, the verdict in colour, expected vs got, the hint. Like okpy's and
otter-grader's feedback: name the case, show expected and actual, one hint sentence, a score line.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

# Verdict -> (label, background colour): green, red, grey, as a learner expects them.
_BADGES = {"pass": ("PASS", "#1a7f37"), "fail": ("FAIL", "#cf222e"), "not attempted": ("NOT ATTEMPTED", "#6e7781"),
           "not run": ("NOT RUN", "#6e7781")}
_CELL = "text-align:left;vertical-align:top;padding:4px 8px"


@dataclass
class CaseResult:
    name: str
    status: str  # "pass", "fail", "not attempted" or "not run" (the file did not load)
    lines: list[str] = field(default_factory=list)

    def format(self) -> list[str]:
        if self.status == "pass":
            return [f"PASS  {self.name}"]
        if self.status == "not attempted":
            return [f"NOT ATTEMPTED  {self.name}: {self.lines[0]}"]
        if self.status == "not run":
            return [f"NOT RUN  {self.name}"]
        return [f"FAIL  {self.name}"] + ["      " + line for line in self.lines]

    def details(self) -> tuple[list[str], list[str]]:
        """(what was expected and what came, the hints): the table's two text columns."""
        hints = [line.removeprefix("hint: ") for line in self.lines if line.startswith("hint: ")]
        return [line for line in self.lines if not line.startswith("hint: ")], hints


@dataclass
class Result:
    number: int
    header: str
    cases: list[CaseResult]
    load_error: CaseResult | None = None  # a file that does not load: reported once, no case runs
    stopped: int = 0  # cases left out after the first failure (exitfirst)

    @property
    def preface(self) -> list[str]:
        return self.load_error.format() if self.load_error else []

    @property
    def passed(self) -> int:
        return sum(c.status == "pass" for c in self.cases)

    @property
    def failed(self) -> int:
        return len(self.cases) - self.passed

    @property
    def ok(self) -> bool:
        return self.failed == 0

    def summary(self) -> str:
        return f"{self.passed} passed, {self.failed} failed"

    def not_run(self) -> str:
        """The one line that stands for every case when the file did not load."""
        return f"NOT RUN  all {len(self.cases)} cases: fix the error above, then grade again"

    def stopped_line(self) -> str:
        return f"stopped at the first failure: {self.stopped} more case(s) not run"

    def body(self) -> list[str]:
        if self.preface:
            return [*self.preface, self.not_run()]
        return [line for c in self.cases for line in c.format()] + ([self.stopped_line()] if self.stopped else [])

    def report(self) -> str:
        return "\n".join([self.header, *self.body(), self.summary()])

    __str__ = report
    __repr__ = report  # a Python prompt shows the whole report too

    def _repr_pretty_(self, p, cycle):  # IPython's plain-text display (a terminal IPython, nbconvert to text)
        p.text(self.report())

    def _repr_html_(self) -> str:  # Jupyter's rich display: the same verdicts as a table
        if self.load_error:
            rows = [_row(self.load_error), _row(CaseResult(f"all {len(self.cases)} cases", "not run",
                                                           ["fix the error above, then grade again"]))]
        else:
            rows = [_row(c) for c in self.cases]
            if self.stopped:
                rest = CaseResult(f"{self.stopped} more case(s)", "not run", ["stopped at the first failure"])
                rows.append(_row(rest))
        colour = _BADGES["pass" if self.ok else "fail"][1]
        head = "".join(f'<th style="{_CELL}">{h}</th>' for h in ("case", "verdict", "expected vs got", "hint"))
        return (f'<div class="nano-engine-judge" style="overflow-x:auto">'
                f'<p style="text-align:left"><b>{html.escape(self.header)}</b></p>'
                f'<table style="border-collapse:collapse"><thead><tr>{head}</tr></thead>'
                f'<tbody>{"".join(rows)}</tbody></table>'
                f'<p style="text-align:left;color:{colour}"><b>{html.escape(self.summary())}</b></p></div>')


def _row(case: CaseResult) -> str:
    label, colour = _BADGES[case.status]
    got, hints = case.details()
    # Expected and got stay aligned, unwrapped (the table scrolls sideways); names and hints wrap.
    pre = (f'<pre style="margin:0;white-space:pre;text-align:left;font-size:12px">'
           f'{html.escape(chr(10).join(got))}</pre>' if got else "")
    cells = [f"<code>{html.escape(case.name).replace('_', '_<wbr>')}</code>",  # long names break at underscores
             f'<span style="color:#fff;background:{colour};padding:1px 6px;border-radius:3px;'
             f'font-weight:bold;white-space:nowrap">{label}</span>',
             pre, "<br>".join(html.escape(h) for h in hints)]
    widths = ["min-width:12em;max-width:20em", "", "", "min-width:20em"]
    return "<tr>" + "".join(f'<td style="{_CELL};{w}">{c}</td>' for c, w in zip(cells, widths)) + "</tr>"
