"""Two threads, one model: vanilla and speculative `generate` at the same time give single-threaded outputs, and
the model (configs, modules) is exactly as before afterwards, also after an error."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_specdec import DraftModelAssistant, MedusaAssistant, NgramAssistant, Proposer
from hf_specdec.testing import random_medusa_heads, tiny_causal_lm

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13, 14, 15], [3, 9, 3, 9, 3, 9, 3]]
ROUNDS = 2  # calls per thread and prompt (a few seconds on an idle 2-core machine)


def _snapshot(model) -> dict:
    """Everything a speculative call could leave behind on the model object."""
    configs = {}
    for name, module in model.named_modules():
        cfg = getattr(module, "config", None)
        if cfg is not None:
            configs[name] = (id(cfg), cfg._attn_implementation, repr(cfg.to_dict()))
    patched = [name for name, module in model.named_modules() if "forward" in module.__dict__]
    return dict(configs=configs, patched=patched, attrs=sorted(model.__dict__))


@pytest.fixture(scope="module")
def setup():
    model = tiny_causal_lm("llama", num_layers=2)
    draft = tiny_causal_lm("llama", num_layers=1, seed=1)
    heads = random_medusa_heads(model, num_heads=2)
    methods = {
        "vanilla": lambda: None,
        "ngram": NgramAssistant,
        "medusa": lambda: MedusaAssistant(heads),
        "draft": lambda: DraftModelAssistant(draft, depth=3),
    }
    return model, methods


def _run(model, make_assistant, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    assistant = make_assistant()
    kwargs = {} if assistant is None else {"assistant": assistant}
    return model.generate(ids, max_new_tokens=12, do_sample=False, **kwargs)[0].tolist()


def test_vanilla_and_speculative_threads_on_one_model(setup):
    model, methods = setup
    before = _snapshot(model)
    expected = {(m, i): _run(model, make, p) for m, make in methods.items() for i, p in enumerate(PROMPTS)}
    vanilla = {i: expected["vanilla", i] for i in range(len(PROMPTS))}
    assert all(expected[m, i] == vanilla[i] for m in methods for i in range(len(PROMPTS))), "greedy != vanilla"

    got: dict[str, list] = {m: [] for m in methods}
    errors: list[BaseException] = []
    start = threading.Barrier(len(methods))

    def worker(method: str) -> None:
        try:
            start.wait(timeout=30)
            for _ in range(ROUNDS):
                for i, p in enumerate(PROMPTS):
                    got[method].append((i, _run(model, methods[method], p)))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(m,)) for m in methods]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    assert not errors, errors
    for method, outputs in got.items():
        assert len(outputs) == ROUNDS * len(PROMPTS)
        for i, tokens in outputs:
            assert tokens == expected[method, i], f"{method} prompt {i} differs from its single-threaded output"
    assert _snapshot(model) == before


def test_the_model_is_unchanged_after_an_error(setup):
    model, _ = setup
    before = _snapshot(model)

    class Failing(Proposer):
        def propose(self, rows):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4, assistant=Failing())
    assert _snapshot(model) == before


def test_an_assistant_in_use_by_another_call_is_a_clear_error(setup):
    model, _ = setup
    shared = NgramAssistant()
    ids = torch.tensor([PROMPTS[0]])
    with shared.claimed():  # as if another thread's generate call were running with it
        with pytest.raises(RuntimeError, match="already in use by another generate call.*one assistant per thread"):
            model.generate(ids, max_new_tokens=4, do_sample=False, assistant=shared)
    # free again: it works, and gives vanilla's output
    out = model.generate(ids, max_new_tokens=4, do_sample=False, assistant=shared)
    assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False))


def test_one_assistant_object_shared_by_concurrent_calls_works_or_says_so(setup):
    """Threads sharing one assistant object: each call returns vanilla's output or raises the clear 'in use' error,
    never a wrong output; a batch of two rows runs at the same time as single rows."""
    model, _ = setup
    shared = NgramAssistant()
    ids = torch.tensor([PROMPTS[0], PROMPTS[0]])
    vanilla = model.generate(ids, max_new_tokens=12, do_sample=False)
    outcomes: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(3)

    def worker(rows: int) -> None:
        start.wait(timeout=30)
        for _ in range(ROUNDS * 2):
            try:
                out = model.generate(ids[:rows], max_new_tokens=12, do_sample=False, assistant=shared)
                result = "ok" if torch.equal(out, vanilla[:rows]) else "WRONG OUTPUT"
            except RuntimeError as exc:
                result = "in use" if "already in use by another generate call" in str(exc) else f"error: {exc}"
            with lock:
                outcomes.append(result)

    threads = [threading.Thread(target=worker, args=(rows,)) for rows in (1, 2, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 3 * ROUNDS * 2
    assert set(outcomes) <= {"ok", "in use"}, outcomes
    assert "ok" in outcomes


class _Gate:
    """A streamer (what ``streamer=`` takes) that holds its call at the first generated token (after the prefill,
    its assistant started) until the other thread has tried the same assistant."""

    def __init__(self, reached: threading.Barrier, go_on: threading.Event):
        self.reached, self.go_on, self.puts = reached, go_on, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:  # the prompt, then the first generated token
            self.reached.wait(timeout=30)
            assert self.go_on.wait(timeout=60)

    def end(self) -> None:
        pass


def test_a_shared_fallback_assistant_refuses_the_second_call_and_the_first_goes_on(setup):
    """The first call holds a FallbackAssistant over unbound Medusa heads; a second thread's call with it used to
    re-resolve its proposers in validate() before the claim, so the *first* call died ("call heads.bind(model)")."""
    from hf_specdec import FallbackAssistant, MedusaHeads

    model, _ = setup
    heads = MedusaHeads(hidden_size=model.config.hidden_size, num_heads=2, vocab_size=model.config.vocab_size)
    shared = FallbackAssistant(NgramAssistant(), heads)  # the heads are resolved (and bound) per call
    ids = torch.tensor([PROMPTS[1]])
    vanilla = model.generate(ids, max_new_tokens=12, do_sample=False)
    reached, go_on = threading.Barrier(2), threading.Event()
    results: dict[str, object] = {}

    def first() -> None:
        try:
            results["first"] = model.generate(
                ids, max_new_tokens=12, do_sample=False, assistant=shared, streamer=_Gate(reached, go_on)
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            results["first"] = exc

    def second() -> None:
        reached.wait(timeout=30)  # the first call is inside generate, its assistant claimed
        try:
            results["second"] = model.generate(ids, max_new_tokens=12, do_sample=False, assistant=shared)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            results["second"] = exc
        finally:
            go_on.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert isinstance(results["second"], RuntimeError), results["second"]
    assert "already in use by another generate call" in str(results["second"])
    assert isinstance(results["first"], torch.Tensor), results["first"]
    assert torch.equal(results["first"], vanilla)
    # free again afterwards
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, assistant=shared), vanilla)


def test_one_assistant_twice_in_a_fallback_assistant_is_refused_when_built():
    from hf_specdec import FallbackAssistant

    ngram = NgramAssistant()
    with pytest.raises(ValueError, match=r"same NgramAssistant object twice \(assistants 0 and 1\).*pass it once"):
        FallbackAssistant(ngram, ngram)
    inner = FallbackAssistant(ngram, NgramAssistant())
    with pytest.raises(ValueError, match=r"same NgramAssistant object twice \(assistants 0.0 and 1\)"):
        FallbackAssistant(inner, ngram)


def test_a_nested_call_with_the_same_assistant_in_one_thread_says_so(setup):
    """A generate call made while another with the same assistant runs in the same thread (here from its streamer)
    is not "another thread"."""
    model, _ = setup
    shared = NgramAssistant()
    ids = torch.tensor([PROMPTS[0]])

    class Nested:
        def put(self, value) -> None:
            model.generate(ids, max_new_tokens=2, do_sample=False, assistant=shared)

        def end(self) -> None:
            pass

    with pytest.raises(RuntimeError, match="already in use by another generate call in this same thread"):
        model.generate(ids, max_new_tokens=4, do_sample=False, assistant=shared, streamer=Nested())
    out = model.generate(ids, max_new_tokens=4, do_sample=False, assistant=shared)  # free again
    assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False))
