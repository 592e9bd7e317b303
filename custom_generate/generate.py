"""hf-specdec's speculative decoding as a transformers ``custom_generate`` method (token trees, exact verification).

transformers reads this folder's layout from a Hub repository or a local folder holding ``custom_generate/``:

    model.generate(ids, custom_generate="<repo id or folder>", trust_remote_code=True, assistant="ngram")

runs hf-specdec's loop with no import of hf_specdec in the caller's code. transformers checks
``custom_generate/requirements.txt`` first (hf-specdec must be installed: ``bash scripts/install.sh`` in a checkout of its repository), then calls
`generate` below with the model and every argument of ``model.generate``.

``assistant=`` is a ready-made assistant's name (``"ngram"``, the default: prompt lookup, for any model; the others,
``hf_specdec.assistants.available_assistants()``, are trained for SmolLM2-135M-Instruct), a draft model (any causal
LM sharing the target's vocabulary), or any hf-specdec assistant object (heads, `Proposer`). Every other argument
keeps its ``generate`` meaning: greedy output is token-for-token vanilla's, sampling keeps the target's distribution,
``return_dict_in_generate=True`` adds ``spec_stats``.
"""

import hf_specdec
from hf_specdec.assistants import available_assistants, load_default_assistant

DEFAULT_ASSISTANT = "ngram"


def _assistant(assistant):
    """The assistant object for ``assistant=`` (a ready-made name is built fresh for this call)."""
    if assistant is None:
        assistant = DEFAULT_ASSISTANT
    if isinstance(assistant, str):
        names = available_assistants()
        if assistant not in names:
            raise ValueError(f"assistant={assistant!r}: not a ready-made assistant; pass one of {', '.join(names)}, "
                             "a draft model, or an hf-specdec assistant object")  # fmt: skip
        return load_default_assistant(assistant)
    return assistant


def generate(model, *args, assistant=None, **kwargs):
    """transformers' ``custom_generate`` entry point: ``model.generate``'s arguments, run by hf-specdec's loop."""
    return model.generate(*args, custom_generate=hf_specdec.generate, assistant=_assistant(assistant), **kwargs)
