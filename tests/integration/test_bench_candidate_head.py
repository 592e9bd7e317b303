"""``hf-specdec bench --candidate-head KIND=FOLDER``: a saved head benched beside the shipped one of its kind, in the
same run, interleaved prompt by prompt (``NAME@candidate`` twins of the methods built on that kind)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

import hf_specdec
from hf_specdec.assistants import EAGLE, assistant_heads, check_head_folders
from hf_specdec.bench.methods import BenchContext, candidate_methods, resolve_methods
from hf_specdec.bench.spec_bench import Prompt, run_bench, settings_for


@pytest.fixture(scope="module")
def candidate_folder(tmp_path_factory):
    """The shipped EAGLE head with one weight changed, saved: a head that drafts differently."""
    folder = tmp_path_factory.mktemp("candidate") / "eagle"
    head = type(EAGLE.load()).from_pretrained(EAGLE.folder)
    with torch.no_grad():
        next(head.parameters()).mul_(-1.0)
    head.save_pretrained(folder)
    return folder


def test_each_method_on_the_kind_gets_a_twin_with_the_candidate_head_and_the_shipped_one_stays(candidate_folder):
    assert assistant_heads("ngram+eagle") == ("eagle",) and assistant_heads("ngram") == ()
    methods = resolve_methods("eagle,ngram+eagle,medusa,ngram")
    twins = candidate_methods(methods, check_head_folders({"eagle": candidate_folder}))
    assert [m.name for m in twins] == ["eagle@candidate", "ngram+eagle@candidate"]
    assert str(candidate_folder.resolve()) in twins[0].description and twins[0].spec_stats
    ctx = BenchContext(model=None)
    alone = twins[0].kwargs(ctx)["assistant"].head
    behind_ngram = twins[1].kwargs(ctx)["assistant"].assistants[1].head
    shipped = EAGLE.load()
    assert alone is behind_ngram and alone is not shipped
    assert torch.equal(next(alone.parameters()), -next(shipped.parameters()))
    assert hf_specdec.load_default_assistant("eagle").head is shipped  # outside the twin's call: the shipped head


def test_a_candidate_no_chosen_method_drafts_with_is_refused(candidate_folder):
    with pytest.raises(ValueError, match="no method chosen drafts with a eagle head"):
        candidate_methods(resolve_methods("ngram,medusa"), check_head_folders({"eagle": candidate_folder}))


@pytest.mark.slow  # the default model
def test_shipped_and_candidate_heads_run_interleaved_in_one_bench_and_both_stay_greedy_equal(candidate_folder):
    model, tokenizer = hf_specdec.load_default_model()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours of the rainbow."}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )["input_ids"][0]  # fmt: skip
    methods = resolve_methods("eagle")
    methods += candidate_methods(methods, check_head_folders({"eagle": candidate_folder}))
    # fixed trees (no tree budget): whether the budget drafts in a given run follows the machine's timings, while
    # this test is about which head drafts and whether both stay exact
    methods = [methods[0], *(replace(m, kwargs=_fixed_trees(m.kwargs)) for m in methods[1:])]
    heads = {"eagle": EAGLE.load(), "eagle@candidate": methods[-1].kwargs(BenchContext(model=None))["assistant"].head}
    calls = {name: 0 for name in heads}  # forwards of each head's input projection while the bench runs
    # told apart by their weights, not by module: a head drafts from a copy in another dtype where this machine
    # multiplies it faster (`drafting_head`), so a hook on the head's own module may never fire
    firsts = {name: head.fc.weight.detach().flatten()[:8].float() for name, head in heads.items()}

    def count(module, _args):
        if isinstance(module, torch.nn.Linear) and module.weight.shape == heads["eagle"].fc.weight.shape:
            first = module.weight.detach().flatten()[:8].float()
            for name, want in firsts.items():
                if torch.allclose(first, want, rtol=1e-2, atol=1e-3):
                    calls[name] += 1

    hook = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        records = run_bench(model, [Prompt(0, "qa", ids)], methods, settings_for(sample=False), max_new_tokens=24)
    finally:
        hook.remove()
    by_method = {r["method"]: r for r in records}
    assert list(by_method) == ["vanilla", "eagle", "eagle@candidate"]
    for name in ("eagle", "eagle@candidate"):
        assert by_method[name]["error"] is None and by_method[name]["match"], by_method[name]
        assert by_method[name]["drafted"] > 0, by_method[name]
    # each method drafted with its own head: the twin did not reuse the shipped one
    assert heads["eagle"] is not heads["eagle@candidate"] and all(calls.values()), calls


def _fixed_trees(kwargs: Callable[[BenchContext], dict]) -> Callable[[BenchContext], dict]:
    """A method's generate() arguments with the tree budget off: the assistant's own fixed tree every step."""
    return lambda ctx: {**kwargs(ctx), "tree_budget": False}
