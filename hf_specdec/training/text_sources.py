"""Real text for training prompts, read from Debian packages installed on this machine (no network at run time).

The self-instructed material of `task_prompts` is written by the target itself: short (a 135M model writes ~160
tokens before it drifts) and narrow (31 template sentences to translate). Spec-Bench's translation and summarisation
prompts are real text of several hundred tokens, and heads trained without such prompts fail there. Two packaged
sources give real prose in many languages without any download at run time:

- *The Debian Administrator's Handbook* (``debian-handbook``): the same book in 26 languages, HTML, one file per
  section. Its paragraphs give foreign sentences to translate and English passages to summarise or answer from.
- ``fortunes`` / ``fortunes-de`` / ``fortunes-es`` / ``fortunes-it``: quotations, anecdotes, poems and jokes,
  entries separated by ``%`` lines. They give varied, non-technical sentences.

`install_hint()` names the packages (``scripts/install_text_sources.sh`` installs them). Nothing here is Spec-Bench
text; prompts built from it still pass `benchmark_questions.spec_bench_overlap` like every other prompt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

HANDBOOK_ROOT = Path("/usr/share/doc/debian-handbook/html")
FORTUNES_ROOT = Path("/usr/share/games/fortunes")
PACKAGES = ("debian-handbook", "fortunes", "fortunes-de", "fortunes-es", "fortunes-it")
# Handbook folder and fortunes sub-folder of each language used for translation prompts.
LANGUAGES = {
    "German": ("de-DE", "de"),
    "French": ("fr-FR", None),
    "Spanish": ("es-ES", "es"),
    "Italian": ("it-IT", "it"),
    "Portuguese": ("pt-BR", None),
    "Dutch": ("nl-NL", None),
}
MIN_WORDS, MAX_SENTENCE_WORDS = 6, 60


def install_hint() -> str:
    return f"apt-get install -y {' '.join(PACKAGES)}  (or: bash scripts/install_text_sources.sh)"


class _Paragraphs(HTMLParser):
    """Collects the text of each paragraph (``<p>``, or DocBook's ``<div class="para">``, outside ``<pre>``) and
    the latest ``<h1>``-``<h3>`` title before it."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[tuple[str, str]] = []  # (section title, paragraph text)
        self._title, self._buf, self._in = "", [], None
        self._pre = self._depth = 0  # open <pre>; open tags of the paragraph's own name inside it

    def handle_starttag(self, tag, attrs):
        if tag == "pre":
            self._pre += 1
        elif self._in is not None:
            self._depth += tag == self._in
        elif tag in ("p", "h1", "h2", "h3") or (tag == "div" and ("class", "para") in attrs):
            self._in, self._buf, self._depth = tag, [], 0

    def handle_endtag(self, tag):
        if tag == "pre":
            self._pre = max(0, self._pre - 1)
        elif tag == self._in and self._depth:
            self._depth -= 1
        elif tag == self._in:
            text = " ".join("".join(self._buf).split())
            if tag in ("p", "div"):
                self.paragraphs.append((self._title, text))
            else:
                self._title = text
            self._in = None

    def handle_data(self, data):
        if self._in and not self._pre:
            self._buf.append(data)


def html_paragraphs(html: str) -> list[tuple[str, str]]:
    """``(section title, text)`` of each prose paragraph of an HTML page: ``<p>`` outside ``<pre>``, whitespace
    collapsed, at least `MIN_WORDS` words, mostly letters (navigation, code and tables dropped)."""
    parser = _Paragraphs()
    parser.feed(html)
    return [(t, p) for t, p in parser.paragraphs if _is_prose(p)]


def _is_prose(text: str) -> bool:
    letters = sum(c.isalpha() for c in text)
    return len(text.split()) >= MIN_WORDS and letters >= 0.7 * len(text.replace(" ", ""))


def fortune_entries(text: str) -> list[str]:
    """The entries of a fortune file (separated by lines holding only ``%``), each with its lines joined; prose
    entries only (ASCII art, tables and dialogues with attribution lines are kept only if mostly letters)."""
    entries = []
    for chunk in re.split(r"^%\s*$", text, flags=re.M):
        lines = [line.strip() for line in chunk.splitlines() if line.strip() and not line.strip().startswith("--")]
        entry = " ".join(" ".join(lines).split())
        if _is_prose(entry):
            entries.append(entry)
    return entries


def sentences(text: str) -> list[str]:
    """A paragraph split after ``.``, ``!`` or ``?`` followed by a space and an upper-case letter."""
    parts = re.split(r"(?<=[.!?])\s+(?=[A-ZÄÖÜÀ-ÝÉ¿¡])", text)
    return [p.strip() for p in parts if MIN_WORDS <= len(p.split()) <= MAX_SENTENCE_WORDS]


@dataclass
class LocalText:
    """Real text found on this machine.

    Attributes:
        passages: English ``(title, text)`` passages of ~120-700 words (consecutive paragraphs of one section).
        foreign: per language name, sentences and short paragraphs (real text to translate).
        sources: per source, how many items it gave (recorded in the data manifests).
    """

    passages: list[tuple[str, str]] = field(default_factory=list)
    foreign: dict[str, list[str]] = field(default_factory=dict)
    sources: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.passages or self.foreign)

    def save(self, path: str | Path) -> Path:
        """Write the text as JSON (to build data on a machine where the packages are not installed)."""
        path = Path(path)
        body = {"passages": [list(p) for p in self.passages], "foreign": self.foreign, "sources": self.sources}
        path.write_text(json.dumps(body, ensure_ascii=False) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> LocalText:
        """The text `save` wrote.

        Raises:
            ValueError: the file holds no passages or no foreign text.
        """
        body = json.loads(Path(path).read_text(encoding="utf-8"))
        text = cls([tuple(p) for p in body.get("passages", [])], body.get("foreign", {}), body.get("sources", {}))
        if not text.passages or not text.foreign:
            raise ValueError(f"{path} holds {len(text.passages)} passages and {len(text.foreign)} languages; need both")
        return text


def handbook_passages(folder: Path, min_words: int = 120, max_words: int = 700) -> list[tuple[str, str]]:
    """English passages: the prose paragraphs of each handbook section joined in order, cut into pieces of
    ``min_words``..``max_words`` words at paragraph boundaries."""
    out = []
    for page in sorted(folder.glob("*.html")):
        current, words, title = [], 0, ""
        for section, para in html_paragraphs(page.read_text(encoding="utf-8", errors="replace")):
            if section != title and words >= min_words:
                out.append((title, "\n\n".join(current)))
                current, words = [], 0
            title = section
            n = len(para.split())
            if words + n > max_words and words >= min_words:
                out.append((title, "\n\n".join(current)))
                current, words = [], 0
            current.append(para)
            words += n
        if words >= min_words:
            out.append((title, "\n\n".join(current)))
    return out


def _fortune_files(folder: Path) -> list[Path]:
    """The text files of a fortunes folder (the ``.u8`` UTF-8 copy where there is one; no ``.dat`` indexes)."""
    files = {}
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.suffix == ".dat":
            continue
        stem = path.name.removesuffix(".u8")
        if path.suffix == ".u8" or stem not in files:
            files[stem] = path
    return list(files.values())


def foreign_texts(language: str, handbook: Path, fortunes: Path) -> tuple[list[str], int, int]:
    """``(texts, from the handbook, from fortunes)`` of one language: handbook sentences (and runs of two or three
    consecutive ones) plus fortune entries of at most `MAX_SENTENCE_WORDS` words."""
    book_dir, fortune_dir = LANGUAGES[language]
    from_book, from_fortunes = [], []
    folder = handbook / book_dir
    if folder.is_dir():
        for page in sorted(folder.glob("*.html")):
            for _, para in html_paragraphs(page.read_text(encoding="utf-8", errors="replace")):
                sents = sentences(para)
                from_book += sents
                from_book += [" ".join(sents[i : i + 2]) for i in range(0, len(sents) - 1, 3)]
    if fortune_dir and (fortunes / fortune_dir).is_dir():
        for path in _fortune_files(fortunes / fortune_dir):
            text = path.read_text(encoding="utf-8", errors="replace")
            from_fortunes += [e for e in fortune_entries(text) if len(e.split()) <= MAX_SENTENCE_WORDS]
    return from_book + from_fortunes, len(from_book), len(from_fortunes)


def find_local_text(handbook: Path = HANDBOOK_ROOT, fortunes: Path = FORTUNES_ROOT) -> LocalText:
    """Read every source that is installed. An empty result means none is (see `install_hint`)."""
    found = LocalText()
    english = Path(handbook) / "en-US"
    untranslated: set[str] = set()  # translations leave some paragraphs in English: not foreign text
    if english.is_dir():
        found.passages = handbook_passages(english)
        found.sources["handbook:en-US passages"] = len(found.passages)
        for page in english.glob("*.html"):
            for _, para in html_paragraphs(page.read_text(encoding="utf-8", errors="replace")):
                untranslated.update(sentences(para))
    for language in LANGUAGES:
        texts, n_book, n_fortunes = foreign_texts(language, Path(handbook), Path(fortunes))
        texts = [t for t in texts if not any(s in untranslated for s in sentences(t))]
        if texts:
            found.foreign[language] = texts
            found.sources[f"handbook:{language}"] = n_book
            found.sources[f"fortunes:{language}"] = n_fortunes
    return found


def require_local_text(**kwargs) -> LocalText:
    """`find_local_text`, raising when nothing is installed.

    Raises:
        FileNotFoundError: neither the handbook nor the foreign fortunes are installed; names the packages.
    """
    found = find_local_text(**kwargs)
    if not found.passages or not found.foreign:
        raise FileNotFoundError(
            f"real-text sources missing (found {found.sources or 'nothing'} under {HANDBOOK_ROOT} and "
            f"{FORTUNES_ROOT}); install them with: {install_hint()}"
        )
    return found


__all__ = [
    "LANGUAGES",
    "LocalText",
    "find_local_text",
    "fortune_entries",
    "handbook_passages",
    "html_paragraphs",
    "install_hint",
    "require_local_text",
    "sentences",
]
