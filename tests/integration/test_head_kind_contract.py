"""The contract every registered head kind (`hf_specdec.kinds.HEAD_KINDS`) passes, one parametrised test each: a kind
registered without passing it fails CI.

- every format the head class writes (``export_formats``) saves and loads back the same head (the loaded head drafts
  the same tokens), and the speculators export names one of the kind's ``speculators_kinds``;
- greedy output equals vanilla ``generate`` token for token, at batch 1 and in a ragged (left-padded) batch of 4;
- sampled output follows the target's own distribution (chi-square of the first 1, 2 and 3 tokens);
- a head built for another model is refused with an error naming the mismatch;
- the descriptor's pieces exist and agree (head, resolver, assistant, trainer, shipped folder, serving, scorer).

Random heads: what is checked is exactness and the kind's wiring, not acceptance (the tree budget is off so that a
random head's trees are verified in full). A trained kind's head is built for a tiny Llama (``for_model``); a kind whose
heads are the target's own layers (MTP: ``from_model``, nothing to save) drafts for a tiny model of a type that ships
them, named in `OWN_LAYERS` (a new such kind fails until it is given one).
"""

from __future__ import annotations

import pytest
import torch
from test_mtp_generate import saved_with_mtp  # noqa: E402  (tests/integration is on the path, as for every test)

from hf_specdec.generation.proposers import as_proposer
from hf_specdec.kinds import HEAD_KINDS, PATH_FIELDS, HeadKind
from hf_specdec.testing import (
    SAMPLING_VOCAB,
    assert_same_tokens,
    first_tokens_p_values,
    left_pad,
    sample_first_tokens,
    sampling_target,
    tiny_causal_lm,
)

KINDS = list(HEAD_KINDS)
# kinds whose heads are the target's own layers -> (tiny target with them, saved to and loaded from a folder)
OWN_LAYERS = {"mtp": lambda folder, seed=0, vocab=None: saved_with_mtp("deepseek_v3", folder, seed=seed, vocab=vocab)}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4], [12, 13, 12, 13, 12, 13, 12, 13, 12]]
FULL_TREES = {"tree_budget": False}
SAMPLED_ROWS = 2000


def own_layers(kind: HeadKind) -> bool:
    """Whether the kind's heads are the target's own layers (built ``from_model``), not trained heads."""
    return not hasattr(kind.load("head"), "for_model")


def random_head(kind: HeadKind, model, seed: int = 0):
    """A head of ``kind`` for ``model`` with random weights (std 0.1, so that its guesses vary), in eval mode; the
    target's own layers for an `own_layers` kind (their weights are the target's, random already)."""
    head_class = kind.load("head")
    if own_layers(kind):
        return head_class.from_model(model)
    torch.manual_seed(seed)
    head = head_class.for_model(model)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return head.eval()


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """``targets(name, seed=0, vocab=None)``: the tiny target a kind drafts for, built once per arguments."""
    built = {}

    def target(name: str, seed: int = 0, vocab: int | None = None):
        kind = HEAD_KINDS[name]
        key = (name if own_layers(kind) else "llama", seed, vocab)
        if key not in built:
            if own_layers(kind):
                assert name in OWN_LAYERS, f"{name}: give the contract test a tiny target with its layers"
                built[key] = OWN_LAYERS[name](tmp_path_factory.mktemp(name), seed=seed, vocab=vocab)
            elif vocab is not None:
                built[key] = sampling_target()
            else:
                built[key] = tiny_causal_lm("llama", num_layers=6, hidden_size=64 if seed == 0 else 32)
        return built[key]

    return target


def _vanilla(target):
    ids, mask = left_pad(PROMPTS)
    ragged = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    one = target.generate(ids[1:2, -3:], max_new_tokens=20, do_sample=False)
    return ids, mask, ragged, one


def _drafts(model, head, ids, mask) -> tuple[torch.Tensor, int]:
    """``(sequences, drafted tokens)`` of a greedy call drafting with ``head``."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant=head,
                         return_dict_in_generate=True, **FULL_TREES)  # fmt: skip
    return out.sequences, out.spec_stats.drafted_tokens


@pytest.mark.parametrize("name", KINDS)
def test_the_descriptor_names_pieces_that_exist(name):
    kind = HEAD_KINDS[name]
    for piece in PATH_FIELDS:
        assert (kind.load(piece) is None) == (getattr(kind, piece) is None), (name, piece)
    head_class = kind.load("head")
    assert head_class.head_type == name
    if own_layers(kind):  # nothing to train, ship or export: the layers come with the model
        assert kind.trainer is None and kind.shipped is None and not hasattr(head_class, "save_pretrained")
    if kind.shipped is not None:
        assert (kind.shipped_dir() / "config.json").is_file(), kind.shipped_dir()
    if kind.trainer is not None:
        trainer = kind.load("trainer")
        assert trainer.name == name and trainer.head_class() is head_class
        assert trainer.command().name.replace("-", "_") == name


@pytest.mark.parametrize("name", KINDS)
def test_greedy_equals_vanilla_at_batch_1_and_ragged_4(name, targets):
    kind = HEAD_KINDS[name]
    target = targets(name)
    ids, mask, ragged, one = _vanilla(target)
    head = random_head(kind, target)
    proposer = as_proposer(head, target)
    assert isinstance(proposer, kind.load("assistant")), type(proposer)
    sequences, drafted = _drafts(target, head, ids, mask)
    assert_same_tokens(sequences, ragged, f"{name} ragged batch 4")
    assert drafted > 0, f"{name}: drafted nothing, the check is vacuous"
    sequences, _ = _drafts(target, kind.load("assistant")(head), ids[1:2, -3:], None)
    assert_same_tokens(sequences, one, f"{name} batch 1")


@pytest.mark.parametrize("name", KINDS)
def test_every_format_round_trips(name, targets, tmp_path):
    kind = HEAD_KINDS[name]
    if own_layers(kind):
        pytest.skip(f"{name}: the heads are the target's own layers, saved with the model")
    target = targets(name)
    ids, mask, _, _ = _vanilla(target)
    head = random_head(kind, target, seed=1)
    head.bind(target) if hasattr(head, "bind") else None  # an export records the target's architecture
    head.base_model_name_or_path = str(tmp_path / "target")
    target.save_pretrained(tmp_path / "target")
    expected, _ = _drafts(target, kind.load("assistant")(head), ids, mask)
    written = []
    for fmt in head.export_formats:
        try:
            head.save_pretrained(tmp_path / fmt, format=fmt)
        except ValueError as err:  # a variant the format cannot express is refused before anything is written
            assert not (tmp_path / fmt / "config.json").exists(), (name, fmt, err)
            continue
        written.append(fmt)
        loaded = type(head).from_pretrained(tmp_path / fmt, base_model=target)
        assert type(loaded) is type(head)
        drafted_by_loaded, _ = _drafts(target, kind.load("assistant")(loaded), ids, mask)
        assert_same_tokens(drafted_by_loaded, expected, f"{name} reloaded from {fmt}")
        params = dict(head.named_parameters())
        for key, value in loaded.state_dict().items():
            if key in params:
                assert torch.allclose(value.float(), params[key].float(), atol=1e-6), (name, fmt, key)
        if fmt == "speculators":
            config = (tmp_path / fmt / "config.json").read_text(encoding="utf-8")
            assert any(f'"speculators_model_type": "{k}"' in config for k in kind.speculators_kinds), (name, config)
    assert written[0] == "hf-specdec" and (len(written) > 1 or len(head.export_formats) == 1), (name, written)


@pytest.mark.parametrize("name", KINDS)
def test_sampling_follows_the_target_distribution(name, targets):
    kind = HEAD_KINDS[name]
    model = targets(name, vocab=SAMPLING_VOCAB)
    model.generation_config.eos_token_id = 2  # the enumeration pads after EOS
    rows = SAMPLED_ROWS if not own_layers(kind) else SAMPLED_ROWS // 5  # a tiny MoE / MLA verify costs far more
    counts = sample_first_tokens(model, random_head(kind, model, seed=2), rows, check_power=False, **FULL_TREES)
    ps = first_tokens_p_values(counts, model)
    assert min(ps) > 1e-4, f"{name}: chi-square p-values of the first 1, 2, 3 tokens: {ps}"


@pytest.mark.parametrize("name", KINDS)
def test_a_head_for_another_model_is_refused(name, targets):
    kind = HEAD_KINDS[name]
    other = targets(name, seed=1)
    head = random_head(kind, targets(name))
    with pytest.raises(ValueError, match=r"hidden size|vocab|does not fit|cannot serve|another .* model"):
        other.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant=head)
