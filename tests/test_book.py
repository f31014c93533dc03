"""The static book (`make book`, scripts/build_book.py): every chapter, every figure, the index.

The book is built once, as `make book` builds it, into a temporary folder; the checks read the
notebooks themselves for what must be there (pages, headings, stored outputs, every image/png
output and every figure a widget held), so a new chapter or figure is covered without editing
this file. tests/test_browser.py opens the same pages in Chromium.
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import build_book  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


class Page(HTMLParser):
    """What a page links to, shows as images and says in text."""

    def __init__(self, path: Path):
        super().__init__()
        self.links, self.images, self.scripts, self.text = [], [], [], []
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        elif tag == "img":
            self.images.append(a.get("src", ""))
        elif tag in ("script", "link") and (a.get("src") or a.get("href")):
            self.scripts.append(a.get("src") or a.get("href"))

    def handle_data(self, data):
        self.text.append(data)


def widget_pngs(nb) -> list[bytes]:
    """The figures the notebook's widgets held when it was saved (Image models' bytes)."""
    state = nb.metadata.get("widgets", {}).get(build_book.WIDGET_STATE, {}).get("state", {})
    return [base64.b64decode(b["data"]) for m in state.values() if m["model_name"] == "ImageModel"
            for b in m.get("buffers", [])]


def output_pngs(nb) -> list[bytes]:
    return [base64.b64decode(o["data"]["image/png"]) for c in nb.cells if c.cell_type == "code"
            for o in c.outputs if "image/png" in o.get("data", {})]


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    out = tmp_path_factory.mktemp("book")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_book.py"), str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"book: {len(NOTEBOOKS)} chapters" in run.stdout
    return out


def test_the_index_links_every_chapter_by_its_heading(book):
    index = Page(book / "index.html")
    assert index.links == [nb.stem + ".html" for nb in NOTEBOOKS]
    text = " ".join("".join(index.text).split())
    for path in NOTEBOOKS:
        title, description = build_book.title_and_description(nbformat.read(path, as_version=4))
        assert title in text and title == nbformat.read(path, as_version=4).cells[0].source.splitlines()[0][2:]
        assert re.sub(r"[`*]", "", description)[:40] in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_figure_of_a_chapter_is_on_its_page(book, path):
    page_path = book / f"{path.stem}.html"
    assert page_path.is_file(), f"no page for {path.name}"
    page = Page(page_path)
    nb = nbformat.read(path, as_version=4)
    shown = Counter((book / src).read_bytes() for src in page.images if (book / src).is_file())
    assert len(shown) == len(set(page.images)), f"an <img> of {page_path.name} points to no file: {page.images}"
    wanted = Counter(output_pngs(nb) + widget_pngs(nb))
    assert not wanted - shown, f"{path.name}: {sum((wanted - shown).values())} figure(s) missing from the page"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_pages_show_the_stored_outputs_and_load_nothing_from_the_network(book, path):
    page = Page(book / f"{path.stem}.html")
    text = "".join(page.text)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.output_type == "stream" and o.text.strip():
                line = o.text.strip().splitlines()[0].strip()
                assert line in text, f"{path.name}: stored output {line!r} is not on the page"
    assert not [s for s in page.scripts if re.match(r"^(https?:)?//", s)], page.scripts
    assert build_book.WIDGET_VIEW not in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_interactive_widget_says_it_needs_a_kernel_and_a_progress_bar_is_drawn(book, path):
    nb = nbformat.read(path, as_version=4)
    page_html = (book / f"{path.stem}.html").read_text(encoding="utf-8")
    state = nb.metadata.get("widgets", {}).get(build_book.WIDGET_STATE, {}).get("state", {})
    views = [o["data"][build_book.WIDGET_VIEW]["model_id"] for c in nb.cells if c.cell_type == "code"
             for o in c.outputs if build_book.WIDGET_VIEW in o.get("data", {})]
    kinds = [{m["model_name"].removesuffix("Model") for m in build_book._walk(state, v)} for v in views]
    controls = [k - build_book.DISPLAY_ONLY - {n for n in k if "Layout" in n or "Style" in n} for k in kinds]
    # A widget whose state was not saved gets the note too: nothing can be shown without a kernel.
    assert page_html.count("needs a running kernel") == sum(bool(c) or not k for c, k in zip(controls, kinds))
    assert page_html.count("<progress ") == sum(
        not c and bool(k & {"FloatProgress", "IntProgress"}) for c, k in zip(controls, kinds))
    if path.stem == "04_1_static_vs_continuous":  # the timeline: the settings its stored figure was drawn with
        assert "method: <b>static batching</b>" in page_html


def _state(*models):
    return {mid: {"model_name": name + "Model", "state": state, **({"buffers": buffers} if buffers else {})}
            for mid, name, state, buffers in models}


def _widget_output(model_id):
    return nbformat.v4.new_output("display_data", {build_book.WIDGET_VIEW: {"model_id": model_id}})


def test_a_widget_without_a_figure_gets_the_note_and_a_progress_bar_its_text():
    png = base64.b64encode(b"\x89PNG fake").decode()
    state = _state(
        ("box", "VBox", {"children": ["IPY_MODEL_slider", "IPY_MODEL_img"]}, None),
        ("slider", "IntSlider", {"description": "budget", "value": 64}, None),
        ("img", "Image", {"format": "png"}, [{"path": ["value"], "encoding": "base64", "data": png}]),
        ("bare", "Dropdown", {"description": "method", "_options_labels": ["a", "b"], "index": 1}, None),
        ("bar", "HBox", {"children": ["IPY_MODEL_desc", "IPY_MODEL_prog", "IPY_MODEL_rate"]}, None),
        ("desc", "HTML", {"value": "Loading&#8199;weights: 100%"}, None),
        ("prog", "FloatProgress", {"value": 272.0, "max": 272.0}, None),
        ("rate", "HTML", {"value": "272/272 [00:01&lt;00:00]"}, None))
    with_figure = build_book.static_widget(_widget_output("box"), state)
    assert [list(o["data"]) for o in with_figure] == [["text/html"], ["image/png"]]
    assert "needs a running kernel" in with_figure[0]["data"]["text/html"]
    assert "budget: <b>64</b>" in with_figure[0]["data"]["text/html"] and with_figure[1]["data"]["image/png"] == png
    no_figure = build_book.static_widget(_widget_output("bare"), state)
    assert len(no_figure) == 1 and "method: <b>b</b>" in no_figure[0]["data"]["text/html"]
    bar = build_book.static_widget(_widget_output("bar"), state)[0]["data"]["text/html"]
    assert "needs a running kernel" not in bar and '<progress value="272.0" max="272.0">' in bar
    assert "Loading\u2007weights: 100%" in bar and "272/272 [00:01&lt;00:00]" in bar
    lost = build_book.static_widget(_widget_output("not-saved"), state)[0]["data"]["text/html"]
    assert "needs a running kernel" in lost and "not saved" in lost


def test_a_folder_without_chapters_or_a_chapter_without_heading_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no .ipynb file"):
        build_book.chapters(tmp_path)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("no heading here")])
    with pytest.raises(ValueError, match="without a heading"):
        build_book.title_and_description(nb)
