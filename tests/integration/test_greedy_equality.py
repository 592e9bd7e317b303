"""Greedy speculative decoding must reproduce vanilla greedy generate token for token (fp32)."""

import pytest
import torch

import hf_specdec
from hf_specdec import DraftModelAssistant
from hf_specdec.testing import CORE_ARCHS as ARCHS
from hf_specdec.testing import OracleProposer, RandomTreeProposer, assert_same_tokens, left_pad, tiny_causal_lm

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4], [12, 13, 12, 13, 12, 13, 12, 13, 12]]


def _assistants(model, arch):
    draft = tiny_causal_lm(arch, seed=7)
    return {
        "random-tree": RandomTreeProposer(model.config.vocab_size, nodes=8),
        "oracle-tree": OracleProposer(model, depth=3),
        "draft-chain": DraftModelAssistant(draft, depth=3),
        "self-draft-tree": DraftModelAssistant(model, depth=3, top_k=3, num_nodes=8),
        "draft-model-object": draft,
        "ngram": hf_specdec.NgramAssistant(),
    }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_matches_vanilla_for_every_assistant(tiny_models, arch, batch):
    model = tiny_models[arch]
    ids, mask = left_pad(PROMPTS[:batch])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    for name, assistant in _assistants(model, arch).items():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant=assistant)
        assert_same_tokens(out, expected, f"{arch} batch={batch} assistant={name}")


def test_self_draft_chain_accepts_everything(tiny_models):
    model = tiny_models["llama"]
    ids = torch.tensor([PROMPTS[0]])
    k = 4
    out = model.generate(
        ids,
        max_new_tokens=1 + 5 * (k + 1),
        do_sample=False,
        assistant=DraftModelAssistant(model, depth=k),
        return_dict_in_generate=True,
        tree_budget=False,  # every chain verified whole, as proposed
    )
    stats = out.spec_stats
    assert stats.acceptance_rate == 1.0
    assert stats.tau == k + 1
    assert stats.per_depth_acceptance == [1.0] * k


def test_custom_generate_route_gives_the_same_tokens(tiny_models):
    model = tiny_models["qwen3"]
    ids, mask = left_pad(PROMPTS[:2])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        custom_generate=hf_specdec.generate,
        assistant=OracleProposer(model),
    )
    assert_same_tokens(out, expected, "custom_generate")


def test_calls_without_assistant_are_untouched(tiny_models):
    from transformers.generation import GenerationMixin

    assert GenerationMixin.generate.__wrapped__ is not None
    model = tiny_models["llama"]
    ids = torch.tensor([PROMPTS[0]])
    hf_specdec.generation.hook.uninstall()
    try:
        plain = model.generate(ids, max_new_tokens=8, do_sample=False)
    finally:
        hf_specdec.generation.hook.install()
    assert_same_tokens(model.generate(ids, max_new_tokens=8, do_sample=False), plain, "no assistant")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_default_model_greedy_equality_on_spec_bench_sample(default_model):
    from hf_specdec.bench.questions import find_questions_file, load_questions, sample_questions

    model, tok = default_model
    questions = sample_questions(load_questions(find_questions_file()), per_category=1)
    ngram = hf_specdec.NgramAssistant()
    draft = DraftModelAssistant(model, depth=3)
    medusa = hf_specdec.load_default_assistant("medusa")  # the heads shipped in the package, their tuned tree
    both = hf_specdec.load_default_assistant("ngram+medusa")
    medusa_tau = []
    for q in questions:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        expected = model.generate(ids, max_new_tokens=48, do_sample=False)
        for name, assistant in [("ngram", ngram), ("self-draft", draft), ("medusa", medusa), ("ngram+medusa", both)]:
            # medusa's trees as proposed, so that its tau measures the heads, not this machine's cost curve
            out = model.generate(
                ids,
                max_new_tokens=48,
                do_sample=False,
                assistant=assistant,
                return_dict_in_generate=True,
                tree_budget=name != "medusa",
            )
            assert_same_tokens(out.sequences, expected, f"question {q['question_id']} {name}")
            if name == "medusa":
                medusa_tau.append(out.spec_stats.tau)
    # the shipped heads are trained: they draft far better than chance on questions they never saw
    assert sum(medusa_tau) / len(medusa_tau) > 1.1, medusa_tau


@pytest.mark.slow
def test_default_model_batch_of_four_mixed_lengths(default_model):
    model, tok = default_model
    tok.padding_side = "left"
    texts = ["Hi!", "Write a haiku about the sea.", "List three prime numbers and explain why they are prime.", "2+2?"]
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    expected = model.generate(**enc, max_new_tokens=32, do_sample=False)
    for name in ("ngram", "medusa", "ngram+medusa"):
        assistant = hf_specdec.load_default_assistant(name)
        out = model.generate(**enc, max_new_tokens=32, do_sample=False, assistant=assistant)
        assert_same_tokens(out, expected, f"default model batch 4, {name}")


@pytest.mark.slow
def test_default_model_self_draft_accepts_everything(default_model):
    model, tok = default_model
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me about the moon."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    k = 3
    out = model.generate(
        ids,
        max_new_tokens=1 + 8 * (k + 1),
        min_new_tokens=1 + 8 * (k + 1),
        do_sample=False,
        assistant=DraftModelAssistant(model, depth=k),
        return_dict_in_generate=True,
        tree_budget=False,  # the chains as proposed: a self-draft costs a full forward per level, the budget cuts it
    )
    assert out.spec_stats.tau == k + 1


@pytest.mark.parametrize("arch", ARCHS[:1])
def test_assistants_made_and_used_under_inference_mode_give_the_same_tokens(tiny_models, arch):
    """Users call generate inside ``torch.inference_mode()`` and may build their assistant there too: tensors made
    in inference mode carry no version counter, which the heads' caches of gathered lm_head rows must not need."""
    from hf_specdec.heads.eagle import EagleHead
    from hf_specdec.heads.medusa import MedusaHeads
    from hf_specdec.heads.mlp_speculator import MLPSpeculator

    model = tiny_models[arch]
    ids, mask = left_pad(PROMPTS)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    with torch.inference_mode():
        vocab = model.config.vocab_size
        half = torch.arange(0, vocab, 2)  # a truncated draft vocabulary: every head gathers lm_head rows for it
        assistants = (
            MedusaHeads.for_model(model, num_heads=3, draft_vocab_size=vocab // 2),
            EagleHead.for_model(model, draft_vocab=half).eval(),
            MLPSpeculator.for_model(model, inner_dim=32, n_predict=2, token_map=half).eval(),
            hf_specdec.NgramAssistant(),
        )
        for assistant in assistants:
            for _ in range(2):  # the second call reuses the cached rows
                out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant=assistant)
                assert_same_tokens(out, expected, f"inference_mode {type(assistant).__name__}")
