"""Pre-packed MKL linears (`generation.packed_linears`, over the GEMM forms of `kernels.cpu_linear`): same results
as `F.linear`, model restored, used by the loop."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_specdec
from hf_specdec.generation import packed_linears as cpu_linear
from hf_specdec.generation.packed_linears import packed_linears, release_packed_weights
from hf_specdec.kernels import few_rows_gemm
from hf_specdec.testing import OracleProposer, RandomTreeProposer, assert_same_tokens, left_pad, tiny_causal_lm

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no MKL packed linear")


cpu_linear.load_cpu_kernels()
_MACHINE_KERNEL = list(few_rows_gemm._MODULE)  # the few-rows kernel as this machine has it (built or not)


@pytest.fixture(autouse=True)
def _pack_at_once(monkeypatch):
    """Tests of the packed path pack at the first verify forward (a call waits PACK_AFTER forwards by default), with
    MKL's forms only: where the few-rows kernel is loaded it is a weight's one copy form and MKL's packed form is not
    offered (tests/unit/test_few_rows_gemm.py tests that)."""
    monkeypatch.setattr(few_rows_gemm, "_MODULE", [None])
    monkeypatch.setattr(cpu_linear, "_KERNELS_LOOKED_UP", [True])
    monkeypatch.setattr(cpu_linear, "PACK_AFTER", 1)
    monkeypatch.setattr(cpu_linear, "_GEMM_CHOICE", {})  # every test tunes the GEMM forms of its shapes afresh
    monkeypatch.setattr(cpu_linear, "_GEMM_TRIALS", {})


def _net(bias=True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40, bias=bias), nn.GELU(), nn.Linear(40, 16, bias=bias)).eval()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (4, 24), (9, 24), (2, 5, 24), (1, 33, 24)])
def test_packed_layers_compute_what_f_linear_computes(bias, shape):
    net = _net(bias)
    x = torch.randn(*shape)
    expected = net(x)
    with torch.no_grad(), packed_linears(net, enabled=True) as patched:
        assert patched == 2
        got = net(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _tuning_forwards(rows: int) -> int:
    """Forwards of ``rows`` rows that time every GEMM form this process can run TUNE_TRIALS times (packing allowed)."""
    return len(cpu_linear.available_forms(True, cpu_linear.tuning_rows(rows))) * cpu_linear.TUNE_TRIALS


def test_packed_path_is_taken_from_min_rows(monkeypatch):
    net = _net()
    calls = []
    real = cpu_linear.packed_weight
    monkeypatch.setattr(cpu_linear, "packed_weight", lambda w: calls.append(w) or real(w))
    with torch.no_grad(), packed_linears(net, enabled=True):
        for _ in range(_tuning_forwards(cpu_linear.MIN_ROWS - 1) + 2):
            net(torch.randn(cpu_linear.MIN_ROWS - 1, 24))
        assert calls == []  # few rows: no MKL packing (stock, weight-major or few-rows GEMM, the fastest here)
        for _ in range(_tuning_forwards(cpu_linear.MIN_ROWS)):
            net(torch.randn(cpu_linear.MIN_ROWS, 24))
        assert {id(w) for w in calls} == {id(net[0].weight), id(net[2].weight)}


def test_each_gemm_form_computes_the_linear_and_the_fastest_is_kept():
    net = _net()
    x = torch.randn(5, 24)
    expected = net(x)
    with torch.no_grad(), packed_linears(net, enabled=True):
        for _ in range(_tuning_forwards(5) + 2):  # through every form while they are timed, then the chosen
            torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)
    chosen = {k: v for k, v in cpu_linear.gemm_choices().items() if k.startswith(("40x24, 5 rows", "16x40, 5 rows"))}
    assert len(chosen) == 2 and set(chosen.values()) <= set(cpu_linear.GEMM_FORMS), chosen


def test_model_is_restored_after_the_block_and_on_errors():
    net = _net()
    with pytest.raises(RuntimeError, match="boom"):
        with torch.no_grad(), packed_linears(net, enabled=True):
            assert all("forward" in m.__dict__ for m in (net[0], net[2]))
            raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in net.modules())
    x = torch.randn(6, 24)
    torch.testing.assert_close(
        net(x), F.linear(F.gelu(F.linear(x, net[0].weight, net[0].bias)), net[2].weight, net[2].bias)
    )


def test_layers_with_their_own_forward_and_other_dtypes_are_left_alone():
    net = _net()
    own = lambda x: torch.zeros(x.shape[:-1] + (40,))  # noqa: E731 - a user's (or accelerate's) instance patch
    net[0].forward = own
    net[2].to(torch.float64)
    with torch.no_grad(), packed_linears(net, enabled=True) as patched:
        assert patched == 0
    assert net[0].forward is own


def test_changed_weights_are_repacked():
    net = _net()
    x = torch.randn(8, 24)
    with torch.no_grad(), packed_linears(net, enabled=True):
        before = net(x)
        net[2].weight.mul_(2.0)
        net[2].bias.zero_()
        after = net(x)
    torch.testing.assert_close(after, F.linear(F.gelu(net[0](x)), net[2].weight))
    assert not torch.allclose(before, after)
    release_packed_weights(net)


def test_weights_made_in_inference_mode_work():
    with torch.inference_mode():
        net = _net()
        x = torch.randn(8, 24)
        expected = net(x)
    with torch.no_grad(), packed_linears(net, enabled=True):
        torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)
    release_packed_weights(net)


def test_autograd_keeps_f_linear():
    net = _net()
    x = torch.randn(8, 24, requires_grad=True)
    with packed_linears(net, enabled=True):
        y = net(x)
    y.sum().backward()
    assert x.grad is not None and net[0].weight.grad is not None


def test_off_switches(monkeypatch):
    net = _net()
    with packed_linears(net, enabled=False) as patched:
        assert patched == 0
    monkeypatch.setenv(cpu_linear.ENV_FLAG, "0")
    with packed_linears(net) as patched:
        assert patched == 0
    monkeypatch.delenv(cpu_linear.ENV_FLAG)
    release_packed_weights(net)
    monkeypatch.setattr(cpu_linear, "_available_memory_bytes", lambda: 1024)  # no room for the packed copies
    with packed_linears(net) as patched:
        assert patched == 0
    monkeypatch.setattr(cpu_linear, "_available_memory_bytes", lambda: 1 << 40)
    with packed_linears(net) as patched:
        assert patched == 2


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_loop_uses_packed_layers_and_matches_vanilla(monkeypatch, batch):
    model = tiny_causal_lm("llama", hidden_size=64, num_layers=2)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 5], [9, 9, 8, 7, 6, 5, 4], [12, 13, 12, 13]][:batch])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    packed = []
    real = cpu_linear.packed_weight
    monkeypatch.setattr(cpu_linear, "packed_weight", lambda w: packed.append(w) or real(w))
    for assistant in (OracleProposer(model, depth=3), RandomTreeProposer(model.config.vocab_size, nodes=8)):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant=assistant)
        assert_same_tokens(out, expected, f"packed linears, batch {batch}, {type(assistant).__name__}")
    assert packed, "the speculative loop did not use the packed linears"
    assert all("forward" not in m.__dict__ for m in model.modules())
    monkeypatch.setenv(cpu_linear.ENV_FLAG, "0")
    packed.clear()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant=OracleProposer(model))
    assert_same_tokens(out, expected, "packing off")
    assert not packed
    assert hf_specdec  # the import installs the generate hook used above


def test_draft_model_linears_are_packed_for_the_call_and_restored(monkeypatch):
    from hf_specdec import DraftModelAssistant

    model = tiny_causal_lm("llama", seed=0)
    draft = tiny_causal_lm("llama", seed=7)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    tuned = []
    real = cpu_linear._fastest_gemm
    monkeypatch.setattr(cpu_linear, "_fastest_gemm", lambda x, w, *a: tuned.append(w) or real(x, w, *a))
    out = model.generate(ids, max_new_tokens=12, do_sample=False, assistant=DraftModelAssistant(draft, depth=3))
    assert_same_tokens(out, expected, "draft model with packed linears")
    draft_weights = {id(p) for p in draft.parameters()}
    assert any(id(w) in draft_weights for w in tuned), "the draft model's forwards did not use the patched linears"
    assert all("forward" not in m.__dict__ for m in (*model.modules(), *draft.modules()))


def test_eagle1_lm_head_rows_run_on_the_tuned_forms(monkeypatch):
    """EAGLE-1's gathered lm_head rows (its draft vocabulary) are a drafting module: a tree level's few rows run on
    the tuned GEMM forms, tokens stay vanilla's, and the head saves none of it."""
    from hf_specdec import EagleAssistant
    from hf_specdec.generation.draft_dtype import ENV_VAR
    from hf_specdec.heads.eagle import EagleHead

    monkeypatch.setenv(ENV_VAR, "float32")  # the tuned forms are fp32's; bf16 drafting would gather bf16 rows
    model = tiny_causal_lm("llama", num_layers=2)
    torch.manual_seed(0)
    head = EagleHead.for_model(model, draft_vocab=torch.arange(2, 90)).eval()
    saved = set(head.state_dict())
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    tuned = []
    real = cpu_linear._fastest_gemm
    monkeypatch.setattr(cpu_linear, "_fastest_gemm", lambda x, w, *a: tuned.append((w, x.shape[0])) or real(x, w, *a))
    assistant = EagleAssistant(head, top_k=3, depth=3, num_nodes=8)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, assistant=assistant)
    assert_same_tokens(out, expected, "EAGLE-1 with its lm_head rows on the tuned forms")
    (rows,) = head.drafting_linears()
    assert rows.weight.shape == (88, model.config.hidden_size)
    assert torch.equal(rows.weight, model.get_output_embeddings().weight[2:90])
    assert any(w is rows.weight and n >= 2 for w, n in tuned), "a tree level's lm_head product skipped the tuner"
    assert "forward" not in rows.__dict__ and set(head.state_dict()) == saved


def _count_packing(monkeypatch) -> list:
    packed = []
    real = cpu_linear.packed_weight
    monkeypatch.setattr(cpu_linear, "packed_weight", lambda w: packed.append(w) or real(w))
    return packed


def test_forwards_above_max_rows_and_short_calls_pack_nothing(monkeypatch):
    """A long prompt's prefill runs stock kernels; a call packs only from its PACK_AFTER-th verify forward."""
    net = nn.Sequential(nn.Linear(24, 32), nn.Linear(32, 8)).eval()
    monkeypatch.setattr(cpu_linear, "PACK_AFTER", 5)
    packed = _count_packing(monkeypatch)
    with torch.no_grad(), packed_linears(net, enabled=True):
        net(torch.randn(cpu_linear.MAX_ROWS + 1, 24))  # a prefill
        for _ in range(cpu_linear.PACK_AFTER - 1):
            net(torch.randn(cpu_linear.MIN_ROWS, 24))  # verify forwards of a short call
        assert not packed
        net(torch.randn(cpu_linear.MIN_ROWS, 24))
        assert len(packed) == 2
        assert cpu_linear.packed_bytes(net) > 0
    assert cpu_linear.packed_bytes(net) == 0, "the copies outlived the call"


def test_keep_and_the_packed_weights_block_keep_the_copies_until_released(monkeypatch):
    net = nn.Sequential(nn.Linear(24, 32), nn.Linear(32, 8)).eval()
    x = torch.randn(cpu_linear.MIN_ROWS, 24)
    with torch.no_grad(), packed_linears(net, enabled=True, keep=True):
        net(x)  # kept: packs at the first verify forward
    held = cpu_linear.packed_bytes(net)
    weight_bytes = sum(m.weight.numel() * 4 for m in net)
    assert held >= weight_bytes, "packed_bytes must count the whole packed buffers"
    release_packed_weights(net)
    assert cpu_linear.packed_bytes(net) == 0
    with hf_specdec.packed_weights(net) as warm:  # packs at once: the warm-up
        assert warm == cpu_linear.packed_bytes(net) > 0
        packed = _count_packing(monkeypatch)
        with torch.no_grad(), packed_linears(net, enabled=True):
            net(x)
        assert cpu_linear.packed_bytes(net) == warm, "a call inside the block released the copies"
    assert cpu_linear.packed_bytes(net) == 0
    assert {id(w) for w in packed} <= {id(net[0].weight), id(net[1].weight)}  # (the tuner may pick another form)


def test_generate_keeps_the_copies_for_later_calls_or_releases_them(monkeypatch):
    model = tiny_causal_lm("llama", hidden_size=64, num_layers=2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    out = model.generate(ids, assistant=RandomTreeProposer(model.config.vocab_size, nodes=8), **kw)
    assert_same_tokens(out.sequences, expected, "packed")
    kept = cpu_linear.packed_bytes(model)
    assert kept == out.spec_stats.packed_weight_bytes > 0, "a plain call keeps its copies for the next"
    held = {id(p) for p in model.parameters() if p in cpu_linear._PACKED}
    packed, real = [], cpu_linear.pack_weight
    monkeypatch.setattr(cpu_linear, "pack_weight", lambda w: packed.append(w) or real(w))  # packings, not uses
    out = model.generate(ids, assistant=RandomTreeProposer(model.config.vocab_size, nodes=8), **kw)
    assert_same_tokens(out.sequences, expected, "packed, second call")
    assert not held & {id(w) for w in packed}, "the second call packed a kept copy again"
    out = model.generate(ids, assistant=RandomTreeProposer(model.config.vocab_size, nodes=8), keep_packed=False, **kw)
    assert out.spec_stats.packed_weight_bytes > 0 and cpu_linear.packed_bytes(model) == 0, "keep_packed=False"
    model.generate(ids, assistant=RandomTreeProposer(model.config.vocab_size, nodes=8), keep_packed=True, **kw)
    assert cpu_linear.packed_bytes(model) > 0
    release_packed_weights(model)
    assert cpu_linear.packed_bytes(model) == 0


def test_kept_copies_of_forms_the_tuner_chose_nowhere_are_dropped():
    """The first process on a machine times every form, so it packs every form once; once a shape's row counts are
    all timed, what stays after the call is only what the choices run."""
    net = nn.Sequential(nn.Linear(24, 32), nn.Linear(32, 8)).eval()
    x, x_other = torch.randn(cpu_linear.MIN_ROWS, 24), torch.randn(cpu_linear.MIN_ROWS + 1, 24)
    forms = cpu_linear.available_forms(True, cpu_linear.MIN_ROWS)
    with torch.no_grad(), packed_linears(net, enabled=True, keep=None):
        for _ in range(cpu_linear.TUNE_TRIALS * len(forms)):
            net(x)
        for _ in range(len(forms)):  # every form once: this row count is still being timed when the call ends
            net(x_other)
        during = cpu_linear.packed_bytes(net)
    assert cpu_linear.packed_bytes(net) == during, "a copy the tuner's trials still use was dropped"
    with torch.no_grad(), packed_linears(net, enabled=True, keep=None):
        for _ in range(cpu_linear.TUNE_TRIALS * len(forms)):
            y = net(x_other)
    assert not cpu_linear._GEMM_TRIALS, "the tuner should have chosen"
    chosen: dict[tuple, set] = {}
    for (out, inp, *_), form in cpu_linear._GEMM_CHOICE.items():
        chosen.setdefault((out, inp), set()).add(form)
    for m in net:
        for form, cache in cpu_linear._COPY_FORMS.items():
            assert (m.weight in cache) == (form in chosen[tuple(m.weight.shape)]), (form, chosen)
    expected = F.linear(F.linear(x_other, net[0].weight, net[0].bias), net[1].weight, net[1].bias)
    torch.testing.assert_close(y, expected)
    release_packed_weights(net)


def test_planned_forwards_say_when_the_gemm_tuner_ran_inside_them():
    """The first forwards at a new row count time slower GEMM forms: they are flagged, so the tree budget's cost
    curve does not learn from them; once every form is timed the same forward is a fair sample again."""
    from hf_specdec.generation.target import PlannedModel

    model = tiny_causal_lm("llama", seed=1)
    flags = []
    with torch.no_grad(), PlannedModel(model, pack_linears=True) as target:
        (row,) = target.add_rows(1)
        out = target.forward([row], torch.arange(3, 9), torch.arange(6), [6])  # prefill: above no tuned size
        target.commit_chunks([row], [6])
        for _ in range(_tuning_forwards(3) + 2):  # 3 new tokens a forward: one tuned row count
            n = target.length(row)
            out = target.forward([row], torch.tensor([5, 6, 7]), torch.arange(n, n + 3), [3])
            target.commit_trees([row], [torch.tensor([0])])
            flags.append(out.tuned)
    assert flags[0] and not flags[-1] and flags == sorted(flags, reverse=True), flags


def test_row_counts_above_eight_share_a_choice_per_bucket():
    """Up to 8 rows each count is timed on its own; above, nearby counts share one measured choice (four buckets per
    doubling), so a tree budget that meets every count from 2 to 64 times 19 of them, not 63."""
    assert [cpu_linear.tuning_rows(r) for r in (2, 8, 9, 10, 11, 16, 17, 20, 21, 33, 64)] == [
        2, 8, 10, 10, 12, 16, 20, 20, 24, 40, 64,
    ]  # fmt: skip
    assert len({cpu_linear.tuning_rows(r) for r in range(2, cpu_linear.TUNE_MAX_ROWS + 1)}) == 19
    net = _net()
    x9, x10 = torch.randn(9, 24), torch.randn(10, 24)
    expected = net(x9)
    with torch.no_grad(), packed_linears(net, enabled=True):
        for _ in range(_tuning_forwards(10)):
            net(x10)
        before = cpu_linear.tuning_calls()
        torch.testing.assert_close(net(x9), expected, rtol=1e-5, atol=1e-5)
        assert cpu_linear.tuning_calls() == before, "9 rows use the choice timed on 10"


def _random_head(kind: str, model):
    """A draft head of ``kind`` for ``model`` with random weights, and its assistant."""
    from hf_specdec import EagleAssistant, EagleHead, MLPSpeculator, MLPSpeculatorAssistant
    from hf_specdec.generation.proposers.dflash import DFlashAssistant
    from hf_specdec.heads.dflash import DFlashHead

    if kind == "eagle":
        head = EagleHead.for_model(model, draft_vocab=torch.arange(2, 90))
    elif kind == "dflash":
        head = DFlashHead.for_model(model, num_layers=2, block_size=4, draft_vocab=torch.arange(10, 80), mask_token_id=96)
    elif kind == "mlp_speculator":
        head = MLPSpeculator.for_model(model, inner_dim=48, n_predict=3, top_k_tokens_per_head=[3, 2, 1])
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2 and not name.startswith(("verifier", "embed_tokens")):
                p.normal_(0.0, 0.15)
    if kind == "mlp_speculator":
        return head.eval(), MLPSpeculatorAssistant(head, widths=[3, 3, 2])  # a stage over several nodes at once
    assistant = {"eagle": EagleAssistant, "dflash": DFlashAssistant}[kind]
    return head.eval(), assistant(head)


@pytest.mark.parametrize("kind", ["eagle", "dflash", "mlp_speculator"])
def test_draft_heads_linears_run_the_tuned_forms_for_the_call_and_are_restored(monkeypatch, kind):
    """A head drafts a tree level of a few rows: its linears go through the same GEMM forms as the target's verify
    forwards (MKL's re-packing GEMM cost several times the few-rows kernel's there), and are stock again after; the
    head's copies are kept (small, and costly to make again every call) until released.
    (Medusa's heads multiply their own stacked weights, no `nn.Linear`; a shared lm_head is the target's.)"""
    monkeypatch.setenv("HF_SPECDEC_DRAFT_DTYPE", "float32")  # not a bf16 drafting copy, whatever a probe measures
    monkeypatch.setattr(few_rows_gemm, "_MODULE", list(_MACHINE_KERNEL))  # every form this machine has
    model = tiny_causal_lm("llama", hidden_size=64, num_layers=2)
    head, assistant = _random_head(kind, model)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9]])
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)
    tuned = []
    real = cpu_linear._fastest_gemm
    monkeypatch.setattr(cpu_linear, "_fastest_gemm", lambda x, w, *a: tuned.append(w) or real(x, w, *a))
    out = model.generate(ids, max_new_tokens=16, do_sample=False, assistant=assistant, tree_budget=False)
    assert_same_tokens(out, expected, f"{kind} head with packed linears")
    head_weights = {id(p) for p in head.parameters()}
    assert any(id(w) in head_weights for w in tuned), f"the {kind} head's forwards did not use the patched linears"
    assert all("forward" not in m.__dict__ for m in (*model.modules(), *head.modules()))
    assert cpu_linear.packed_bytes(head) > 0, "the head's copies are kept for its next call"
    release_packed_weights(head)
    assert cpu_linear.packed_bytes(head) == 0


def test_a_memory_cap_on_the_copies_of_every_model(monkeypatch):
    """HF_SPECDEC_PACKED_MEMORY_MB caps what the copies of every model hold together: a model whose copies would
    pass it runs stock kernels (nothing patched, nothing packed); a cap that is no number is refused by name."""
    net, other = _net(), _net()
    x = torch.randn(cpu_linear.MIN_ROWS, 24)
    monkeypatch.setenv(cpu_linear.MEMORY_ENV, "1000")
    with torch.no_grad(), packed_linears(other, keep=True) as patched:
        other(x)
    assert patched == 2 and cpu_linear.packed_bytes(other) > 0
    held = cpu_linear.packed_bytes(other)
    monkeypatch.setenv(cpu_linear.MEMORY_ENV, str(held / 1e6))  # the other model's copies fill the cap
    with torch.no_grad(), packed_linears(net) as patched:
        torch.testing.assert_close(net(x), F.linear(F.gelu(F.linear(x, net[0].weight, net[0].bias)),
                                   net[2].weight, net[2].bias))  # fmt: skip
    assert patched == 0 and cpu_linear.packed_bytes(net) == 0
    for bad in ("lots", "-1", "nan", "inf"):
        monkeypatch.setenv(cpu_linear.MEMORY_ENV, bad)
        with pytest.raises(ValueError, match=f"{cpu_linear.MEMORY_ENV}="), packed_linears(net):
            pass
    release_packed_weights(other)
