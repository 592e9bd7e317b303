"""Training text through the tokenizer's chat template, or the plain rendering when it has none
(`hf_specdec.models.chat_text`: "User: ..." / "Assistant: ..." turns): a prompt's messages with the assistant prompt
appended (`chat_ids`), and a whole conversation with the tokens the assistant wrote marked (`templated_ids`). Every
training data builder templates its text here; ``--chat-template`` (`read_chat_template`, `check_chat_template`)
names a template for a tokenizer that lacks one.

    ids = chat_ids(tokenizer, [{"role": "user", "content": "Hi"}])      # ready for the target to answer
    seq = templated_ids(tokenizer, conversation, max_tokens=2048)       # token ids + which tokens the assistant wrote
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..models import PLAIN_RENDERING, chat_ids, chat_rendering, chat_text, encode_chat, has_chat_template
from .conversations import Conversation

# what `check_chat_template` renders: every role a conversation has, and the assistant prompt
SAMPLE_MESSAGES = (
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one."},
)


@dataclass
class TemplatedConversation:
    """A conversation in a tokenizer's chat template (or the plain rendering).

    Attributes:
        ids: `[n]` token ids of the whole conversation (cut at ``max_tokens``).
        answer_mask: `[n]` True where the token belongs to an assistant turn (its text and, with a chat template, its
            end-of-turn token: what the target writes when it answers).
        first_answer: index of the first assistant token.
    """

    ids: list[int]
    answer_mask: list[bool]
    first_answer: int


def templated_ids(tokenizer, conversation: Conversation, max_tokens: int | None = None) -> TemplatedConversation | None:
    """``conversation`` through ``tokenizer``'s chat template (`chat_text`), with the tokens the assistant wrote
    marked; None when no assistant token falls within ``max_tokens``.

    The assistant spans are found on the rendered text: assistant turn i starts where the rendering of the turns
    before it with the assistant prompt ends, and ends where the rendering of the turns up to it ends (trailing
    whitespace excluded); a token is the assistant's when it starts inside such a span. Needs a fast tokenizer
    (character offsets).
    """
    messages = conversation.messages()
    spans = [_answer_span(tokenizer, messages, i) for i, m in enumerate(messages) if m["role"] == "assistant"]
    enc = encode_chat(tokenizer, chat_text(tokenizer, messages), return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if max_tokens is not None:
        ids, offsets = ids[:max_tokens], offsets[:max_tokens]
    mask = [any(s <= a < e for s, e in spans) for a, _ in offsets]
    if not any(mask):
        return None
    return TemplatedConversation(list(ids), mask, mask.index(True))


def _answer_span(tokenizer, messages: list[dict], i: int) -> tuple[int, int]:
    """``(start, end)`` characters of assistant message ``i`` in the rendering of ``messages``."""
    start = len(chat_text(tokenizer, messages[:i], add_generation_prompt=True))
    return start, len(chat_text(tokenizer, messages[: i + 1]).rstrip())


def read_chat_template(value: str) -> str:
    """The Jinja chat template ``--chat-template`` names: ``value`` itself when it holds Jinja markup, else a file's
    text. Raises ValueError (neither)."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ValueError("no such file, and not a Jinja template either (no {{ ... }} or {% ... %})")


def check_chat_template(tokenizer, template: str) -> None:
    """``template`` renders `SAMPLE_MESSAGES` with ``tokenizer``'s special tokens, every message's text included.
    Raises ValueError (what went wrong, in one line)."""
    try:
        text = tokenizer.apply_chat_template(list(SAMPLE_MESSAGES), chat_template=template, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    except Exception as err:  # noqa: BLE001  (jinja2's syntax and runtime errors, the template's raise_exception)
        raise ValueError(f"does not render a conversation ({type(err).__name__}: {first_line(err)})") from err
    missing = [m["content"] for m in SAMPLE_MESSAGES if m["content"] not in text]
    if missing:
        raise ValueError(f"renders a conversation without its messages' text ({missing[0]!r} is missing)")


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (empty when it has none)."""
    return (str(err).splitlines() or [""])[0]


__all__ = [
    "PLAIN_RENDERING",
    "SAMPLE_MESSAGES",
    "TemplatedConversation",
    "chat_ids",
    "chat_rendering",
    "check_chat_template",
    "first_line",
    "has_chat_template",
    "read_chat_template",
    "templated_ids",
]
