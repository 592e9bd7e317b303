import pytest

import hf_specdec


def test_default_ngram_assistant_is_ready():
    assert isinstance(hf_specdec.load_default_assistant("ngram"), hf_specdec.NgramAssistant)


def test_default_medusa_assistant_is_the_shipped_heads_with_their_tuned_tree():
    from hf_specdec.assistants import DEFAULT_MEDUSA_DIR
    from hf_specdec.heads.medusa import MedusaHeads

    assistant = hf_specdec.load_default_assistant("medusa")
    assert isinstance(assistant, hf_specdec.MedusaAssistant)
    heads = assistant.heads
    # sized for SmolLM2-135M (hidden 576, vocabulary 49152), sharing its lm_head; small enough to ship
    assert (heads.hidden_size, heads.vocab_size, heads.share_lm_head) == (576, 49152, True)
    assert heads.tree_choices and assistant.tree_choices == sorted(heads.tree_choices, key=lambda c: (len(c), c))
    assert sum(f.stat().st_size for f in DEFAULT_MEDUSA_DIR.iterdir()) < 25 * 2**20
    card = (DEFAULT_MEDUSA_DIR / "README.md").read_text()
    assert "SmolLM2-135M-Instruct" in card and "top-1" in card
    # a fresh assistant per call, the heads loaded once
    assert hf_specdec.load_default_assistant("medusa") is not assistant
    assert hf_specdec.load_default_assistant("medusa").heads is heads
    assert isinstance(heads, MedusaHeads)


def test_methods_without_shipped_heads_say_so():
    with pytest.raises(NotImplementedError, match="no trained eagle heads"):
        hf_specdec.load_default_assistant("eagle")
    with pytest.raises(ValueError, match="unknown method"):
        hf_specdec.load_default_assistant("beam")


def test_shipped_medusa_heads_refuse_another_model_and_leave_it_usable():
    import torch

    from hf_specdec.testing import tiny_causal_lm

    model = tiny_causal_lm("llama")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="hidden size 576 cannot serve a model with hidden size 64"):
        model.generate(ids, max_new_tokens=4, assistant=hf_specdec.load_default_assistant("medusa"))
    assert model.config._attn_implementation == "sdpa"
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 7)
