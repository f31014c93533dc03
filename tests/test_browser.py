"""What a learner sees: JupyterLab in headless Chromium, the timeline widget switched by hand.

nbval proves the cells run and print the same; this proves the chapter works in a browser.
JupyterLab is started from the project's own environment on a loopback port, over a copy of
notebooks/ and practice/ (JupyterLab autosaves: the committed notebooks must stay untouched).
Chromium is Debian's (scripts/install_chromium.sh), driven by Playwright. Screenshots of every
state go to build/screenshots/, printed at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import Page, expect, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = "04_1_static_vs_continuous.ipynb"
SHOTS = ROOT / "build" / "screenshots"
TOKEN = "nano-engine-browser-test"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps dialling Google on a closed network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_ALL_TIMEOUT = 15 * 60_000  # ms: the chapter runs the embedded model several times


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server over a copy of the chapters; stopped however the tests end."""
    if not os.path.exists(CHROMIUM):
        raise RuntimeError(f"no Chromium at {CHROMIUM}: run `bash scripts/install_chromium.sh`")
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", root / "notebooks")
    shutil.copytree(ROOT / "practice", root / "practice",
                    ignore=shutil.ignore_patterns("__pycache__"))
    judge_nb = nbformat.v4.new_notebook()
    judge_nb.cells = [nbformat.v4.new_code_cell(
        "import sys; sys.path.insert(0, '..')\nfrom practice.judge import grade\ngrade(129)")]
    nbformat.write(judge_nb, root / "notebooks" / "try_the_judge.ipynb")
    port = free_port()
    log = open(root / "jupyter.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={root}",
         # A fresh workspace and settings: never reopen tabs or answers left by an earlier session.
         f"--LabApp.workspaces_dir={root / 'workspaces'}", f"--LabApp.user_settings_dir={root / 'settings'}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        + (["--allow-root"] if os.geteuid() == 0 else []),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"jupyter lab exited: {(root / 'jupyter.log').read_text()[-2000:]}")
                time.sleep(1)
        else:
            raise RuntimeError("jupyter lab did not answer within 2 minutes")
        yield url
    finally:
        stop(server)
        log.close()


def stop(server: subprocess.Popen) -> None:
    """The server and its kernels (one process group): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
            server.wait(timeout=20)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def browser():
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()
    print(f"\nscreenshots in {SHOTS}: " + ", ".join(sorted(f.name for f in SHOTS.glob("*.png"))))


def open_and_run_all(browser, url: str, notebook: str) -> Page:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(120_000)
    # A workspace of its own, reset: only this notebook is open, whatever ran before.
    page.goto(f"{url}/lab/workspaces/{Path(notebook).stem}/tree/notebooks/{notebook}?reset&token={TOKEN}")
    page.locator(".jp-NotebookPanel").first.wait_for()
    # JupyterLab may ask which kernel to start: take the one it proposes, as a learner would.
    # The kernel is ready when the toolbar's status says Idle.
    dialog = page.locator(".jp-Dialog").filter(has_text="Select Kernel")
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first
    try:
        dialog.wait_for(timeout=30_000)
        dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
        dialog.wait_for(state="detached")
    except PlaywrightTimeout:
        pass  # it started the notebook's kernel without asking
    expect(idle).to_be_visible(timeout=120_000)
    page.locator(".lm-MenuBar-item", has_text="Run").first.click()
    page.locator(".lm-Menu-item", has_text="Run All Cells").first.click()
    return page


def screenshot(page: Page, name: str) -> None:
    """Save the page, without JupyterLab's question about news, which may cover the figure."""
    news = page.locator(".jp-Notification-Toast").filter(has_text="Jupyter news")
    if news.count():
        news.get_by_role("button", name="No").click()
    page.screenshot(path=SHOTS / name)


def image_bytes(page: Page) -> bytes:
    """What the widget's figure looks like on screen (a screenshot of the <img>)."""
    return page.locator("img.widget-image").first.screenshot()


def wait_for_new_figure(page: Page, summary_before: str) -> None:
    expect(page.locator(".widget-html-content").filter(has_text="budget").first).not_to_have_text(
        summary_before, timeout=300_000)
    page.wait_for_timeout(500)  # the Image widget's new src is set in the same update


def test_timeline_widget_switches_methods_and_budget(lab, browser):
    page = open_and_run_all(browser, lab, CHAPTER)
    figure = page.locator("img.widget-image").first
    figure.wait_for(state="visible", timeout=RUN_ALL_TIMEOUT)
    expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first).to_be_visible(
        timeout=RUN_ALL_TIMEOUT)
    figure.scroll_into_view_if_needed()
    summary = page.locator(".widget-html-content").filter(has_text="budget").first
    states = {"static": (summary.inner_text(), image_bytes(page))}
    screenshot(page, "1_static_batching.png")
    assert "static batching" in states["static"][0]

    for name, label in [("continuous", "continuous, no chunking"), ("chunked", "continuous + chunked prefill")]:
        before = summary.inner_text()
        page.locator("button.widget-toggle-button", has_text=label).first.click()
        wait_for_new_figure(page, before)
        states[name] = (summary.inner_text(), image_bytes(page))
        screenshot(page, f"{len(states)}_{name}.png")
        assert label in states[name][0]

    # The budget slider: one step to the left with the keyboard, as a learner would.
    before = summary.inner_text()
    page.locator(".widget-slider .noUi-handle").first.focus()
    page.keyboard.press("ArrowLeft")
    wait_for_new_figure(page, before)
    states["smaller budget"] = (summary.inner_text(), image_bytes(page))
    screenshot(page, "4_chunked_smaller_budget.png")

    texts = [t for t, _ in states.values()]
    figures = [f for _, f in states.values()]
    assert len(set(texts)) == len(texts), texts
    assert len(set(figures)) == len(figures), "a switch did not change the figure"
    assert not page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").filter(
        has_text="Traceback").count()
    page.close()


def test_judge_from_a_notebook_cell_reports_not_attempted(lab, browser):
    page = open_and_run_all(browser, lab, "try_the_judge.ipynb")
    out = page.locator(".jp-OutputArea-output").filter(has_text="passed").first
    expect(out).to_contain_text("failed", timeout=300_000)
    screenshot(page, "5_judge_129_starter.png")
    text = out.inner_text()
    assert "NOT ATTEMPTED" in text and "schedule() raises NotImplementedError" in text
    assert text.strip().splitlines()[-1].startswith("0 passed")
    page.close()
