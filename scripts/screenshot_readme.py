"""Screenshots of README.md as a reader sees it on a repository or Hub page, at desktop and phone widths:

    python scripts/screenshot_readme.py                  # writes docs/images/readme_desktop.png, readme_phone.png

The README is rendered locally (this machine cannot reach the Hub) by markdown-it-py with GitHub-flavoured tables and
strikethrough, GitHub / Hub alert boxes (``> [!WARNING]``), relative images resolved from the checkout, and a plain
stylesheet close to the Hub's model-card column (at most 1000 px of text, system fonts, tables scrolling sideways on
narrow screens). Chromium takes the full-page screenshots through Playwright (`scripts/install_browser.sh` installs
both). Needs the test extra (markdown-it-py comes with it through rich, playwright).
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VIEWPORTS = {"desktop": (1280, 900), "phone": (390, 844)}
ALERT = re.compile(r"<blockquote>\s*<p>\[!(NOTE|TIP|IMPORTANT|WARNING|CAUTION)\]\s*", re.S)
STYLE = """
body { font: 16px/1.6 -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; color: #1f2328; margin: 0; }
main { max-width: 1000px; margin: 0 auto; padding: 24px 16px; }
p, li { overflow-wrap: break-word; }
h1, h2 { border-bottom: 1px solid #d1d9e0; padding-bottom: .3em; }
code, pre { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 85%; background: #f6f8fa; }
code { padding: .2em .4em; border-radius: 6px; }
pre { padding: 16px; overflow-x: auto; border-radius: 6px; line-height: 1.45; }
pre code { padding: 0; background: none; }
table { border-collapse: collapse; display: block; overflow-x: auto; max-width: 100%; }
th, td { border: 1px solid #d1d9e0; padding: 6px 13px; }
tr:nth-child(2n) { background: #f6f8fa; }
img { max-width: 100%; }
blockquote { margin: 0; padding: 0 1em; color: #59636e; border-left: .25em solid #d1d9e0; }
blockquote.alert { color: inherit; border-left-color: #9a6700; }
blockquote.alert b.alert-title { color: #9a6700; display: block; margin-top: 8px; }
a { color: #0969da; text-decoration: none; }
"""


def readme_html(markdown_text: str) -> str:
    """The README as one standalone HTML page (alerts as titled boxes)."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"]).render(markdown_text)
    body = ALERT.sub(lambda m: f'<blockquote class="alert"><b class="alert-title">{m[1].title()}</b><p>', body)
    return f"<!doctype html><meta charset=utf-8><style>{STYLE}</style><main>{body}</main>"


def _shrink(png: Path) -> None:
    """Re-save ``png`` with a 64-colour palette (text on a plain page: a third of the bytes, no visible change)."""
    from PIL import Image

    with Image.open(png) as image:
        small = image.convert("RGB").quantize(colors=64)
    small.save(png, optimize=True)


def screenshot(readme: Path, out_dir: Path) -> list[Path]:
    """Full-page PNGs of ``readme`` at each of `VIEWPORTS`, written to ``out_dir``."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        page_file = Path(tmp) / readme.parent.name / "index.html"  # beside a copy of the checkout's docs/
        page_file.parent.mkdir()
        shutil.copytree(readme.parent / "docs", page_file.parent / "docs")
        page_file.write_text(readme_html(readme.read_text()))
        written = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=shutil.which("chromium") or shutil.which("chromium-browser"))
            for name, (width, height) in VIEWPORTS.items():
                page = browser.new_page(viewport={"width": width, "height": height}, device_scale_factor=1)
                page.goto(page_file.as_uri())
                out = out_dir / f"readme_{name}.png"
                page.screenshot(path=str(out), full_page=True)
                _shrink(out)
                written.append(out)
            browser.close()
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in screenshot(args.readme, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
