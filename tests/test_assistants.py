import pytest

import hf_specdec


def test_default_ngram_assistant_is_ready():
    assert isinstance(hf_specdec.load_default_assistant("ngram"), hf_specdec.NgramAssistant)


def test_methods_without_shipped_heads_say_so():
    with pytest.raises(NotImplementedError, match="no trained medusa heads"):
        hf_specdec.load_default_assistant("medusa")
    with pytest.raises(ValueError, match="unknown method"):
        hf_specdec.load_default_assistant("beam")
