"""Build the static book: every chapter of notebooks/ as an HTML page, and an index page.

    .venv/bin/python scripts/build_book.py [OUT]      # OUT defaults to build/book/; `make book`

So that the series reads in a browser without a kernel, as a jupyter-book / mystmd site would,
but from what .venv already has (nbconvert, which comes with JupyterLab), offline. The chapters
are NOT re-executed: each page shows the outputs and figures stored in its notebook. Figures
are written as PNG files beside the pages (`<chapter>_files/`), and no page loads anything from
the network (nbconvert's require.js, MathJax, mermaid and widget-manager scripts are left out).

An ipywidgets output cannot run without a kernel. Where a widget has something to switch, the
page says at that cell that it needs a running kernel and shows what the widget showed when the
chapter was last run: its settings and its figure (an Image widget's bytes are kept in the
notebook's widget state). A widget with nothing to switch (a tqdm bar) is drawn from its
stored text. Links to another chapter point to its page; other relative links (../practice/)
to the repository's files.
"""

from __future__ import annotations

import argparse
import copy
import html
import os
import re
import sys
from pathlib import Path

import jinja2
import nbformat
from nbconvert import HTMLExporter
from nbconvert.filters.markdown_mistune import markdown2html_mistune
from traitlets.config import Config

ROOT = Path(__file__).resolve().parents[1]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# Widgets that only display something; any other model in a widget is a control a reader would use.
DISPLAY_ONLY = {"Box", "HBox", "VBox", "GridBox", "HTML", "HTMLMath", "Label", "Image",
                "FloatProgress", "IntProgress", "Output"}
NEEDS_KERNEL = ("Interactive widget: it needs a running kernel. Open this chapter in JupyterLab "
                "(<code>make lab</code>) to use it. Below, what it showed when the chapter was last run")
NOTE_STYLE = "border-left: 4px solid #e0a800; background: #fff8e1; padding: 6px 10px; margin: 4px 0"

# The lab template without the scripts it would fetch from a CDN; a bar to the index and neighbours.
PAGE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock -%}
{%- block jupyter_widgets -%}{%- endblock -%}
{%- block html_head_js_mathjax -%}{%- endblock -%}
{%- block html_head_js_mermaidjs -%}{%- endblock -%}
{%- block body_header -%}{{ super() }}{{ resources.book_nav }}{%- endblock -%}
{%- block body_footer -%}{{ resources.book_nav }}{{ super() }}{%- endblock -%}
"""


def chapters(src: Path) -> list[Path]:
    """The notebooks of src in reading order (their names start with the chapter number)."""
    found = sorted(p for p in src.glob("*.ipynb") if not p.name.startswith("."))
    if not found:
        raise ValueError(f"no chapters: {src} holds no .ipynb file")
    return found


def title_and_description(nb) -> tuple[str, str]:
    """The first heading, and the first sentence of the paragraph after it (Markdown)."""
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        lines = cell.source.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("#"):
                title = line.lstrip("#").strip()
                paragraph = " ".join(re.split(r"\n\s*\n", "\n".join(lines[i + 1:]).strip())[0].split())
                return title, re.split(r"(?<=[.!?])\s+", paragraph)[0]
    raise ValueError(f"chapter without a heading: {nb.metadata.get('name', 'notebook')}")


def _plain(markup: str) -> str:
    """A widget's HTML value as escaped text (its tags dropped)."""
    return html.escape(html.unescape(re.sub(r"<[^>]+>", "", markup)))


def _walk(state: dict, model_id: str) -> list[dict]:
    """The widget models under model_id, depth first, in display order (children before siblings)."""
    model = state.get(model_id)
    if model is None:
        return []
    found = [model]
    for child in model["state"].get("children", []):
        found += _walk(state, child.removeprefix("IPY_MODEL_"))
    return found


def static_widget(output, state: dict) -> list:
    """Outputs that stand for one widget output on a page without a kernel."""
    view = output["data"][WIDGET_VIEW]
    models = _walk(state, view["model_id"])
    if not models:
        return [nbformat.v4.new_output("display_data", {"text/html": (
            f'<div class="book-widget-note" style="{NOTE_STYLE}">Interactive widget: it needs a running '
            "kernel (<code>make lab</code>); its state was not saved with the notebook.</div>")})]
    kinds = [m["model_name"].removesuffix("Model") for m in models]
    controls = [m for m, k in zip(models, kinds) if k not in DISPLAY_ONLY and "Layout" not in k
                and "Style" not in k]
    texts, images = [], []
    for m, kind in zip(models, kinds):
        s = m["state"]
        if kind in ("HTML", "HTMLMath", "Label") and s.get("value"):
            texts.append(_plain(s["value"]))
        elif kind in ("FloatProgress", "IntProgress"):
            texts.append(f'<progress value="{s.get("value", 0)}" max="{s.get("max", 100)}"></progress>')
        elif kind == "Image":
            images += [b["data"] for b in m.get("buffers", []) if b.get("path") == ["value"]
                       and b.get("encoding") == "base64" and s.get("format", "png") == "png"]
    settings = []
    for m in controls:
        s = m["state"]
        value = s["_options_labels"][s["index"]] if "_options_labels" in s and s.get("index") is not None \
            else s.get("value")
        settings.append(f"{html.escape(str(s.get('description') or 'value'))}: "
                        f"<b>{html.escape(str(value))}</b>")
    body = " ".join(texts)
    if controls:
        body = (f'<div class="book-widget-note" style="{NOTE_STYLE}">{NEEDS_KERNEL}'
                + (f" ({'; '.join(settings)})" if settings else "") + ".</div>"
                + (f"<div>{body}</div>" if body else ""))
    outs = [nbformat.v4.new_output("display_data", {"text/html": body})] if body else []
    return outs + [nbformat.v4.new_output("display_data", {"image/png": png}) for png in images]


def _link(target: str, src: Path, out: Path, names: set[str]) -> str:
    """A chapter's relative link as the book needs it."""
    if re.match(r"^([a-z][a-z0-9+.-]*:|#|/)", target, re.I):
        return target
    path, _, anchor = target.partition("#")
    if path in names:
        path = path.removesuffix(".ipynb") + ".html"
    else:
        tail = "/" if path.endswith("/") else ""
        path = Path(os.path.relpath((src / path).resolve(), out.resolve())).as_posix() + tail
    return path + (f"#{anchor}" if anchor else "")


def for_the_page(nb, src: Path, out: Path, names: set[str]):
    """A copy of the notebook as the page shows it: widgets made static, links rewritten."""
    nb = copy.deepcopy(nb)
    state = nb.metadata.pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = re.sub(r"\]\(([^)\s]+)\)",
                                 lambda m: f"]({_link(m.group(1), src, out, names)})", cell.source)
        elif cell.cell_type == "code":
            cell.outputs = [new for o in cell.outputs for new in
                            (static_widget(o, state) if WIDGET_VIEW in o.get("data", {}) else [o])]
    return nb


def _nav(pages: list[tuple[str, str]], i: int) -> str:
    links = ['<a href="index.html">Contents</a>']
    if i > 0:
        links.insert(0, f'<a href="{pages[i - 1][0]}">&larr; {html.escape(pages[i - 1][1])}</a>')
    if i + 1 < len(pages):
        links.append(f'<a href="{pages[i + 1][0]}">{html.escape(pages[i + 1][1])} &rarr;</a>')
    return ('<nav class="book-nav" style="display: flex; justify-content: space-between; '
            'padding: 8px 16px; font-family: sans-serif">' + "".join(links) + "</nav>")


def index_page(rows: list[tuple[str, str, str]]) -> str:
    """The contents: one row per chapter, its title linked to its page."""
    body = "\n".join(f'<tr><td><a href="{page}">{html.escape(title)}</a></td>'
                     f"<td>{markdown2html_mistune(description).strip().removeprefix('<p>').removesuffix('</p>')}</td></tr>"
                     for page, title, description in rows)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>nano_engine: the chapters</title>
<style>
body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; line-height: 1.5; padding: 0 1em }}
table {{ border-collapse: collapse }} td, th {{ border-bottom: 1px solid #ddd; padding: 6px 10px; text-align: left; vertical-align: top }}
td:first-child {{ white-space: nowrap }} code {{ background: #f3f3f3; padding: 0 3px }}
</style></head><body>
<h1>nano_engine: build an LLM inference engine from scratch</h1>
<p>The chapters as they were last run, with their outputs and figures. Nothing here runs: to run the
cells, switch the widgets and change the code, open the chapters in JupyterLab with <code>make lab</code>.</p>
<table><thead><tr><th>Chapter</th><th>What it is about</th></tr></thead><tbody>
{body}
</tbody></table></body></html>
"""


def build(src: Path, out: Path) -> list[dict]:
    """Write out/index.html, a page per chapter and its figures; return what was written."""
    paths = chapters(src)
    out.mkdir(parents=True, exist_ok=True)
    notebooks = [nbformat.read(p, as_version=4) for p in paths]
    titles = [title_and_description(nb) for nb in notebooks]
    pages = [(p.stem + ".html", t) for p, (t, _) in zip(paths, titles)]
    config = Config()
    config.HTMLExporter.preprocessors = ["nbconvert.preprocessors.ExtractOutputPreprocessor"]
    exporter = HTMLExporter(config=config, template_name="lab", template_file="book.html.j2",
                            extra_loaders=[jinja2.DictLoader({"book.html.j2": PAGE_TEMPLATE})])
    written = []
    for i, (path, nb) in enumerate(zip(paths, notebooks)):
        page_nb = for_the_page(nb, src, out, {p.name for p in paths})
        page_nb.metadata["title"] = titles[i][0]
        resources = {"metadata": {"name": path.stem}, "unique_key": path.stem,
                     "output_files_dir": f"{path.stem}_files", "book_nav": _nav(pages, i)}
        body, resources = exporter.from_notebook_node(page_nb, resources=resources)
        (out / pages[i][0]).write_text(body, encoding="utf-8")
        for name, data in resources.get("outputs", {}).items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(data)
        written.append(dict(notebook=path.name, page=pages[i][0], title=titles[i][0],
                            figures=sorted(n for n in resources.get("outputs", {}) if n.endswith(".png"))))
    (out / "index.html").write_text(
        index_page([(page, title, desc) for (page, _), (title, desc) in zip(pages, titles)]), encoding="utf-8")
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=ROOT / "build" / "book", help="where to write the site")
    ap.add_argument("--notebooks", type=Path, default=ROOT / "notebooks", help="the chapters (default notebooks/)")
    args = ap.parse_args(argv)
    written = build(args.notebooks, args.out)
    figures = sum(len(w["figures"]) for w in written)
    print(f"book: {len(written)} chapters, {figures} figures in {args.out}/")
    print(f"book: open file://{(args.out / 'index.html').resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
