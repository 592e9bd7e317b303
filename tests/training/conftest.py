"""What several training tests share: a tiny chat target and conversations of random words to teacher-force."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.testing import tiny_causal_lm, tiny_chat_tokenizer
from hf_specdec.training.conversations import Conversation, ConversationSet, Turn

WORDS = "alpha beta gamma delta eps zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
ROLES = ("user", "assistant", "user", "assistant")


def _word_conversations(count: int, lengths: tuple[tuple[int, int], ...]) -> ConversationSet:
    """``count`` four-turn conversations (user, assistant, user, assistant) of random WORDS, turn j of conversation
    i ``base_j + i % mod_j`` words long for ``lengths`` = ``((base_j, mod_j), ...)``; seeded, so a call is repeatable."""
    gen = torch.Generator().manual_seed(0)

    def text(n: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=gen).tolist())

    convs = [Conversation(f"c{i}", tuple(Turn(role, text(base + i % mod)) for role, (base, mod) in zip(ROLES, lengths)))
             for i in range(count)]  # fmt: skip
    return ConversationSet(convs, [], {"records": count})


@pytest.fixture(scope="module")
def word_chat():
    """``(model, tokenizer)``: a tiny llama target (vocabulary 64, 3 layers) and a chat tokenizer over WORDS."""
    model = tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=3, seed=5)
    return model, tiny_chat_tokenizer(WORDS + ["user", "assistant"], vocab_size=64)


@pytest.fixture(scope="module")
def base_word_tokenizer():
    """A tokenizer over WORDS and the plain rendering's role words without a chat template (as a base model's)."""
    return tiny_chat_tokenizer(WORDS + ["System:", "User:", "Assistant:"], vocab_size=64, chat_template=None)


@pytest.fixture(scope="session")
def word_conversations():
    """``word_conversations(count, lengths)``: conversations of random WORDS (`_word_conversations`)."""
    return _word_conversations
