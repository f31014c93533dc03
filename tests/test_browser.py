"""What a learner sees: JupyterLab in headless Chromium, the timeline widget switched by hand,
the judge's table in a notebook cell, and the static book.

nbval proves the cells run and print the same; this proves the chapter works in a browser.
JupyterLab is started as `make lab` starts it (scripts/lab.sh: the project's kernel, the set-up's
settings override that turns off the news popup) on a loopback port, over a copy of notebooks/
and practice/ (JupyterLab autosaves: the committed notebooks must stay untouched). The book is
built by scripts/build_book.py into a temporary folder and opened from file://. Chromium is
Debian's (scripts/install_chromium.sh), driven by Playwright. Screenshots of every state go to
build/screenshots/, printed at the end.
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
sys.path.insert(0, str(ROOT / "scripts"))
import build_book  # noqa: E402

CHAPTER = "04_1_static_vs_continuous.ipynb"
NEWS = "Jupyter news"  # JupyterLab's "Would you like to get notified about official Jupyter news?"
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
    # What a learner types into a chapter: no sys.path edit; the kernel must be the project's.
    judge_nb = nbformat.v4.new_notebook()
    judge_nb.cells = [nbformat.v4.new_code_cell("import sys, nano_engine, practice\nprint(sys.executable)"),
                      nbformat.v4.new_code_cell("from practice.judge import grade\ngrade(129)")]
    nbformat.write(judge_nb, root / "notebooks" / "try_the_judge.ipynb")
    port = free_port()
    log = open(root / "jupyter.log", "w")
    # As `make lab` starts it; only the root, the token and fresh workspace and user settings
    # (never reopen tabs or answers left by an earlier session) are the test's own.
    server = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "lab.sh"), f"--IdentityProvider.token={TOKEN}",
         f"--LabApp.workspaces_dir={root / 'workspaces'}", f"--LabApp.user_settings_dir={root / 'settings'}"],
        env={**os.environ, "LAB_HOST": "127.0.0.1", "LAB_PORT": str(port), "LAB_ROOT": str(root)},
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


def open_notebook(browser, url: str, notebook: str) -> Page:
    """The notebook in JupyterLab, its kernel started and idle."""
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
    return page


def open_and_run_all(browser, url: str, notebook: str) -> Page:
    page = open_notebook(browser, url, notebook)
    page.locator(".lm-MenuBar-item", has_text="Run").first.click()
    page.locator(".lm-Menu-item", has_text="Run All Cells").first.click()
    return page


def no_news_popup(page: Page) -> None:
    """JupyterLab asks about Jupyter news unless the set-up's settings override says never."""
    news = page.locator(".Toastify__toast").filter(has_text=NEWS)  # react-toastify draws the toasts
    assert not news.count(), f"JupyterLab shows its news popup: {news.first.inner_text()!r}"


def wait_for_output(page: Page, output, timeout: float) -> None:
    """Wait until output is visible, or stop at the first traceback (Run All stops there too)."""
    error = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").filter(
        has_text="Traceback")
    output.or_(error).first.wait_for(state="visible", timeout=timeout)
    assert not error.count(), f"a cell failed:\n{error.first.inner_text()[-3000:]}"


def screenshot(page: Page, name: str) -> None:
    no_news_popup(page)
    page.screenshot(path=SHOTS / name)


def test_first_screen_is_the_chapter_without_a_news_popup(lab, browser):
    page = open_notebook(browser, lab, "01_model.ipynb")
    # The popup would come as soon as JupyterLab has restored its layout and read its settings,
    # well before a kernel is idle; give it a few seconds more all the same.
    page.wait_for_timeout(3_000)
    expect(page.locator(".jp-NotebookPanel .jp-MarkdownOutput").first).to_contain_text("1 The model")
    screenshot(page, "0_first_screen_no_news.png")
    page.close()


def image_bytes(page: Page) -> bytes:
    """What the widget's figure looks like on screen (a screenshot of the <img>)."""
    return page.locator("img.widget-image").first.screenshot()


def wait_for_new_figure(page: Page, summary_before: str, src_before: str | None) -> None:
    expect(page.locator(".widget-html-content").filter(has_text="budget").first).not_to_have_text(
        summary_before, timeout=300_000)
    # The Image widget gets its new picture (a new blob URL) in the same update, but the browser
    # may draw it later than the text on a loaded machine: wait for the new src, then a moment.
    expect(page.locator("img.widget-image").first).not_to_have_attribute("src", src_before or "", timeout=60_000)
    page.wait_for_timeout(500)


def figure_src(page: Page) -> str | None:
    return page.locator("img.widget-image").first.get_attribute("src")


def test_timeline_widget_switches_methods_and_budget(lab, browser):
    page = open_and_run_all(browser, lab, CHAPTER)
    figure = page.locator("img.widget-image").first
    wait_for_output(page, figure, RUN_ALL_TIMEOUT)
    expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first).to_be_visible(
        timeout=RUN_ALL_TIMEOUT)
    figure.scroll_into_view_if_needed()
    summary = page.locator(".widget-html-content").filter(has_text="budget").first
    states = {"static": (summary.inner_text(), image_bytes(page))}
    screenshot(page, "1_static_batching.png")
    assert "static batching" in states["static"][0]

    for name, label in [("continuous", "continuous, no chunking"), ("chunked", "continuous + chunked prefill")]:
        before, src = summary.inner_text(), figure_src(page)
        page.locator("button.widget-toggle-button", has_text=label).first.click()
        wait_for_new_figure(page, before, src)
        states[name] = (summary.inner_text(), image_bytes(page))
        screenshot(page, f"{len(states)}_{name}.png")
        assert label in states[name][0]

    # The budget slider: one step to the left with the keyboard, as a learner would.
    before, src = summary.inner_text(), figure_src(page)
    page.locator(".widget-slider .noUi-handle").first.focus()
    page.keyboard.press("ArrowLeft")
    wait_for_new_figure(page, before, src)
    states["smaller budget"] = (summary.inner_text(), image_bytes(page))
    screenshot(page, "4_chunked_smaller_budget.png")

    texts = [t for t, _ in states.values()]
    figures = [f for _, f in states.values()]
    assert len(set(texts)) == len(texts), texts
    assert len(set(figures)) == len(figures), "a switch did not change the figure"
    assert not page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").filter(
        has_text="Traceback").count()
    page.close()


def test_judge_in_a_notebook_cell_is_a_table_with_no_path_edits(lab, browser):
    page = open_and_run_all(browser, lab, "try_the_judge.ipynb")
    out = page.locator(".jp-OutputArea-output").filter(has=page.locator("table")).first
    wait_for_output(page, out, 300_000)
    expect(out).to_contain_text("failed")
    screenshot(page, "5_judge_129_starter.png")
    # The first cell: the kernel is the project's Python (it imported nano_engine and practice).
    executable = page.locator(".jp-OutputArea-output").first.inner_text().strip()
    assert Path(executable).parent == ROOT / ".venv" / "bin", executable
    rows = out.locator("table tbody tr")
    assert rows.count() >= 3
    for i in range(rows.count()):  # the starter attempts nothing: every case says so, in its row
        expect(rows.nth(i)).to_contain_text("NOT ATTEMPTED")
    assert "schedule() raises NotImplementedError" in out.inner_text()
    assert out.inner_text().strip().splitlines()[-1] == f"0 passed, {rows.count()} failed"
    page.close()


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    out = tmp_path_factory.mktemp("book")
    return out, build_book.build(ROOT / "notebooks", out)


def test_book_index_and_a_chapter_page(book, browser):
    out, written = book
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto((out / "index.html").as_uri())
    links = page.locator("table a")
    assert [links.nth(i).inner_text() for i in range(links.count())] == [w["title"] for w in written]
    screenshot(page, "6_book_index.png")

    page.locator("table a", has_text="4.1").click()
    page.wait_for_load_state("load")
    assert page.url.endswith("/04_1_static_vs_continuous.html")
    expect(page.locator("h1").first).to_contain_text("4.1 Static vs continuous batching")
    screenshot(page, "7_book_chapter_4_1.png")
    # Every figure is on the page and drawn (a missing file has no natural width).
    images = page.evaluate("() => [...document.images].map(i => [i.getAttribute('src'), i.naturalWidth])")
    chapter = next(w for w in written if w["page"] == "04_1_static_vs_continuous.html")
    assert sorted(src for src, _ in images) == chapter["figures"]
    assert all(width > 0 for _, width in images), images
    # The widget cell: what it needs, and the figure it showed, in place of the widget.
    note = page.locator(".book-widget-note")
    expect(note).to_contain_text("needs a running kernel")
    note.scroll_into_view_if_needed()
    screenshot(page, "8_book_widget_without_kernel.png")
    page.close()
