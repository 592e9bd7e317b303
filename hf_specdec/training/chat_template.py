"""Training text through the tokenizer's chat template: a prompt's messages with the assistant prompt appended
(`chat_ids`), and a whole conversation with the tokens the assistant wrote marked (`templated_ids`). Every training
data builder templates its text here.

    ids = chat_ids(tokenizer, [{"role": "user", "content": "Hi"}])      # ready for the target to answer
    seq = templated_ids(tokenizer, conversation, max_tokens=2048)       # token ids + which tokens the assistant wrote
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .conversations import Conversation


def chat_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of ``messages`` in ``tokenizer``'s chat template, with the assistant prompt appended."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class TemplatedConversation:
    """A conversation in a tokenizer's chat template.

    Attributes:
        ids: `[n]` token ids of the whole conversation (cut at ``max_tokens``).
        answer_mask: `[n]` True where the token belongs to an assistant turn (its text and its end-of-turn token:
            what the target writes when it answers).
        first_answer: index of the first assistant token.
    """

    ids: list[int]
    answer_mask: list[bool]
    first_answer: int


def templated_ids(tokenizer, conversation: Conversation, max_tokens: int | None = None) -> TemplatedConversation | None:
    """``conversation`` through ``tokenizer``'s chat template, with the tokens the assistant wrote marked; None when
    no assistant token falls within ``max_tokens``.

    The assistant spans are found on the rendered text: assistant turn i starts where the template of the turns
    before it with the generation prompt ends, and ends where the template of the turns up to it ends (trailing
    whitespace excluded); a token is the assistant's when it starts inside such a span. Needs a fast tokenizer
    (character offsets).
    """
    messages = conversation.messages()
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True))
        end = len(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False).rstrip())
        spans.append((start, end))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if max_tokens is not None:
        ids, offsets = ids[:max_tokens], offsets[:max_tokens]
    mask = [any(s <= a < e for s, e in spans) for a, _ in offsets]
    if not any(mask):
        return None
    return TemplatedConversation(list(ids), mask, mask.index(True))


__all__ = ["TemplatedConversation", "chat_ids", "templated_ids"]
