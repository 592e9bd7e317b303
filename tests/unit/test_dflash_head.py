"""`DFlashHead`, judged by vLLM's ``speculators`` library (the ``speculators`` extra) and by its own teacher-forced pass:

- the library loads our ``format="speculators"`` export with its own config and model classes, and its forward (the
  anchored blocks it trains on) computes our logits, full vocabulary and draft vocabulary, both anchor modes;
- a checkpoint made by the library's training entry point and saved by its ``save_pretrained`` loads here and computes
  its logits; exports load back bit-identical;
- the drafting pass (cached context, one block after the committed text) equals the teacher-forced forward at that
  anchor; `ddtree` returns the best paths, parents first;
- kinds and layers DFlashHead cannot run, and mismatched files, are refused by name.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os

import pytest
import torch

from hf_specdec.generation.proposers.dflash import DFlashAssistant, ddtree
from hf_specdec.heads.dflash import DFlashHead
from hf_specdec.heads.eagle import EagleHead
from hf_specdec.heads.hub import CONFIG_NAME, WEIGHTS_NAME
from hf_specdec.testing import left_pad, tiny_causal_lm, torch_threads

if os.environ.get("CI"):  # CI installs the extra: the library checks must run there, never skip
    import speculators  # noqa: F401
else:
    pytest.importorskip("speculators")
from speculators import SpeculatorModel, SpeculatorModelConfig  # noqa: E402
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models: intra-op threads only add wake-up latency (badly so on a busy machine)."""
    with torch_threads(1):
        yield


DRAFT_IDS = torch.arange(10, 80)
BLOCK = 4
MASK = 96


def random_dflash(model, draft_vocab=DRAFT_IDS, seed=0, **kwargs) -> DFlashHead:
    """A two-layer head with random weights, norms included (a misplaced norm shows)."""
    head = DFlashHead.for_model(model, num_layers=2, block_size=BLOCK, draft_vocab=draft_vocab, mask_token_id=MASK,
                                **kwargs)  # fmt: skip
    _randomize(head.named_parameters(), seed)
    return head.eval()


def _randomize(named_parameters, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_parameters:
            if name.startswith("verifier") or name.startswith("embed_tokens"):
                continue  # the library's copies of the target's weights (never saved)
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.1 if p.dim() >= 2 else 1.0 + 0.2 * noise)


def library_model(folder) -> DFlashDraftModel:
    """The library's own loader (SDPA attention: its default flex attention wants a compiler)."""
    config = SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "sdpa"
    return SpeculatorModel.from_pretrained(folder, config=config).eval()


def assert_same_computation(head: DFlashHead, lib: DFlashDraftModel, seed: int = 0) -> None:
    """Blocks at every anchor of a 12-token sequence: the library's forward (every valid position an anchor) and ours."""
    g = torch.Generator().manual_seed(seed)
    t, k = 12, lib.block_size
    features = torch.randn(1, t, lib.fc.in_features, generator=g)
    tokens = torch.randint(0, head.vocab_size, (1, t), generator=g)
    with torch.no_grad():
        _, theirs, *_ = lib._backbone_forward(
            features, tokens, torch.ones(1, t), torch.zeros(1, t, head.hidden_size), torch.zeros_like(tokens),
            max_anchors=t,
        )  # fmt: skip
        anchors = torch.arange(t - k)[None]  # the library's valid anchors: all but the last block
        ours = head(tokens, features, anchors)
    torch.testing.assert_close(ours, theirs.view(1, t, k, -1)[:, : t - k], rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def target(saved_tiny_llama):
    return saved_tiny_llama


# --------------------------------------------------------------------------------------------- our export -> library
@pytest.mark.parametrize("draft_vocab", [DRAFT_IDS, None], ids=["draft-vocab", "full-vocab"])
@pytest.mark.parametrize("from_anchor", [False, True], ids=["mask-slots", "from-anchor"])
def test_export_is_loaded_by_the_library_and_computes_our_logits(tmp_path, target, draft_vocab, from_anchor):
    head = random_dflash(target, draft_vocab, seed=1, sample_from_anchor=from_anchor)
    head.save_pretrained(tmp_path, format="speculators")
    config = SpeculatorModelConfig.from_pretrained(tmp_path)
    assert isinstance(config, DFlashSpeculatorConfig)
    assert config.block_size == BLOCK and config.mask_token_id == MASK and config.sample_from_anchor is from_anchor
    assert config.aux_hidden_state_layer_ids == [2, 4, 5]
    assert config.speculators_config.verifier.architectures == ["LlamaForCausalLM"]
    assert config.speculators_config.proposal_methods[0].speculative_tokens == head.num_depths
    lib = library_model(tmp_path)
    theirs = lib.state_dict()
    for key, value in head.state_dict().items():  # every tensor where the library expects it
        assert torch.equal(theirs[key], value), key
    assert torch.equal(theirs["embed_tokens.weight"], target.get_input_embeddings().weight)  # from the verifier
    assert_same_computation(head, lib)


@pytest.mark.parametrize("fmt", ["speculators", "hf-specdec"])
def test_exports_load_back_bit_identical(tmp_path, target, fmt):
    head = random_dflash(target, seed=2, tree={"top_k": 5, "num_nodes": 20}, model_card={"tau": 1.5})
    head.to(torch.bfloat16)
    head.save_pretrained(tmp_path, format=fmt)
    back = DFlashHead.from_pretrained(tmp_path, base_model=target)
    assert back.source_format == fmt and (tmp_path / "README.md").is_file()
    ours, theirs = head.state_dict(), back.state_dict()
    assert set(ours) == set(theirs)
    for key, value in ours.items():
        assert theirs[key].dtype == value.dtype and torch.equal(theirs[key], value), key
    for field in ("aux_layers", "block_size", "mask_token_id", "draft_vocab_size", "tree", "model_card"):
        assert getattr(back, field) == getattr(head, field), field


# --------------------------------------------------------------------------------------------- library -> us
def library_checkpoint(folder, target, seed: int, draft_ids=DRAFT_IDS) -> DFlashDraftModel:
    """A checkpoint made by the library's own training entry point and ``save_pretrained`` (random weights)."""
    from transformers import AutoConfig

    verifier = target.config._name_or_path
    layer_config = AutoConfig.from_pretrained(verifier)
    layer_config.num_hidden_layers = 2
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    lib = DFlashDraftModel.from_training_args(
        layer_config, t2d=t2d, d2t=draft_ids - torch.arange(draft_ids.numel()), verifier_name_or_path=verifier,
        draft_vocab_size=draft_ids.numel(), block_size=BLOCK, target_layer_ids=[1, 4, 7], mask_token_id=MASK,
        draft_attn_impl="sdpa",
    )  # fmt: skip
    _randomize(lib.named_parameters(), seed)
    lib.save_pretrained(folder)
    return library_model(folder)  # as the library loads it back (a full-vocabulary lm_head is the verifier's)


@pytest.mark.parametrize("draft_vocab", [DRAFT_IDS, None], ids=["draft-vocab", "full-vocab"])
def test_library_checkpoint_loads_here_and_drafts_greedy_equal(tmp_path, target, draft_vocab):
    ids = DRAFT_IDS if draft_vocab is not None else torch.arange(target.config.vocab_size)
    lib = library_checkpoint(tmp_path, target, seed=3, draft_ids=ids)
    head = DFlashHead.from_pretrained(tmp_path, base_model=target)
    assert head.source_format == "speculators" and head.aux_layers == [1, 4, 7] and head.mask_token_id == MASK
    assert head.draft_vocab_size == (None if draft_vocab is None else DRAFT_IDS.numel())
    if draft_vocab is not None:
        assert torch.equal(head.draft_to_token(torch.arange(DRAFT_IDS.numel())), DRAFT_IDS)
    assert_same_computation(head, lib, seed=4)
    prompts, mask = left_pad([[5, 6, 7, 8, 9, 10], [3, 4, 5]])
    expected = target.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = target.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant=head,
                          tree_budget=False, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, expected) and out.spec_stats.drafted_tokens > 0


# --------------------------------------------------------------------------------------------- drafting pass
class Recording(DFlashAssistant):
    """Keeps every block's log-probabilities with the row's committed length at that step."""

    def _block_logp(self, slots, roots):
        logp = super()._block_logp(slots, roots)
        self.log += [(slot, int(self.cache.lengths[slot]), lp) for slot, lp in zip(slots, logp)]
        return logp


def test_drafting_pass_equals_the_teacher_forced_forward(monkeypatch):
    """Each step's block (cached context of the committed text, anchor = the root) computes what `forward` computes at
    that anchor over the whole sequence with the target's own hidden states: the cache holds exactly the committed
    text, at the right positions, in every row of a ragged batch."""
    monkeypatch.setenv("HF_SPECDEC_DRAFT_DTYPE", "float32")  # the head itself drafts (no bf16 copy on this CPU)
    model = tiny_causal_lm("llama", num_layers=6)
    head = random_dflash(model, None, seed=5)
    assistant = Recording(head, num_nodes=12)
    assistant.log = []
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10, 11, 5], [3, 4, 5], [9, 9, 8, 7, 6]])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, assistant=assistant,
                         tree_budget=False)  # fmt: skip
    assert len(assistant.log) > 6
    for row, committed, logp in assistant.log:
        seq = out[row][mask[row].bool().nonzero()[0, 0] :]  # the row's text, no padding
        seq = seq[: committed + 1]  # the committed text and the root
        with torch.no_grad():
            states = model(seq[None], output_hidden_states=True).hidden_states
            features = torch.cat([states[i] for i in head.feature_layers], dim=-1)
            full = torch.log_softmax(head(seq[None], features, torch.tensor([[committed]])), dim=-1)
        torch.testing.assert_close(logp, full[0, 0, 1:], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------- DDTree
def brute_force_best(logp: list[list[float]], depth: int, n: int) -> list[float]:
    """The n best path log-probabilities over every rank path up to ``depth`` (exhaustive)."""
    scores = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(len(logp[0])), repeat=d):
            scores.append(sum(logp[i][r] for i, r in enumerate(ranks)))
    return heapq.nlargest(n, scores)


@pytest.mark.parametrize("seed", range(4))
def test_ddtree_pops_the_best_paths_parents_first(seed):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(4, 6, generator=g) * 2, -1).sort(-1, descending=True).values[:, :3].tolist()
    parent, depth, rank, score = ddtree(logp, max_depth=3, num_nodes=20)
    assert len(parent) == 20
    assert all(p < i for i, p in enumerate(parent)) and max(depth) <= 3
    for i, p in enumerate(parent):  # each node's score is its parent's plus its own rank's log-probability
        assert depth[i] == (1 if p < 0 else depth[p] + 1)
        assert score[i] == pytest.approx((0.0 if p < 0 else score[p]) + logp[depth[i] - 1][rank[i]])
    siblings = {(parent[i], rank[i]) for i in range(20)}
    assert len(siblings) == 20  # distinct ranks among siblings: distinct tokens
    assert sorted(score, reverse=True) == pytest.approx(brute_force_best(logp, 3, 20))
    assert ddtree(logp, max_depth=0, num_nodes=5) == ([], [], [], [])
    inf = [[0.0, float("-inf")], [float("-inf"), float("-inf")]]
    assert ddtree(inf, max_depth=2, num_nodes=5)[0] == [-1]  # zero-probability paths are never drafted


# --------------------------------------------------------------------------------------------- refusals
def test_other_kinds_point_to_their_class(tmp_path, target):
    random_dflash(target).save_pretrained(tmp_path / "d", format="speculators")
    with pytest.raises(ValueError, match="'dflash' checkpoint: load it with DFlashHead"):
        EagleHead.from_pretrained(tmp_path / "d")
    eagle = EagleHead.for_model(target, version=3)
    eagle.save_pretrained(tmp_path / "e", format="speculators")
    with pytest.raises(ValueError, match=r"'eagle3' checkpoint, not 'dflash' \(load it with EagleHead \(hf_specdec.heads.eagle\)\)"):
        DFlashHead.from_pretrained(tmp_path / "e")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"transformer_layer_config": {"hidden_size": 64}}, "lacks \\['intermediate_size'"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window attention"),
        ({"aux_hidden_state_layer_ids": None}, "lacks aux_hidden_state_layer_ids"),
        ({"block_size": 1}, "at least one mask token"),
        ({"draft_vocab_size": 60}, "tensor 'd2t' in .*model.safetensors .* has shape \\[70\\], expected \\[60\\]"),
        ({"hidden_size": 48}, "tensor 'fc.weight' in .*model.safetensors .* has shape"),
    ],
)
def test_unsupported_or_mismatched_checkpoints_are_refused(tmp_path, target, changes, message):
    random_dflash(target).save_pretrained(tmp_path, format="speculators")
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    for key, value in changes.items():
        holder = config["transformer_layer_config"] if key in ("layer_types", "hidden_size") else config
        holder[key] = value
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        DFlashHead.from_pretrained(tmp_path)


def test_target_mismatch_and_unbound_export_are_refused(tmp_path, target):
    head = random_dflash(target)
    with pytest.raises(ValueError, match="hidden size 64 cannot serve .* hidden size 32"):
        head.bind(tiny_causal_lm("llama", hidden_size=32, num_layers=8))
    with pytest.raises(ValueError, match="hidden states \\[2, 4, 5\\], but .* has 3 layers"):
        head.bind(tiny_causal_lm("llama", num_layers=3))
    head.base_model_name_or_path = None
    with pytest.raises(ValueError, match="names its verifier"):
        head.save_pretrained(tmp_path / "x", format="speculators")
    assert not (tmp_path / "x" / WEIGHTS_NAME).exists()
