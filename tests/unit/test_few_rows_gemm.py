"""The compiled few-rows CPU GEMM (`kernels.few_rows_gemm`): built here, the same products as `F.linear`, never
compiled implicitly, and one form among the others of `packed_linears` (timed, chosen only where fastest, kept
apart in the per-machine caches)."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_specdec.cli import main as cli_main
from hf_specdec.generation import gemm_cache
from hf_specdec.generation import packed_linears as pl
from hf_specdec.kernels import few_rows_gemm
from hf_specdec.testing import RandomTreeProposer, assert_same_tokens, tiny_causal_lm

pytestmark = pytest.mark.skipif(
    few_rows_gemm.variant() is None or shutil.which("c++") is None,
    reason="the few-rows GEMM needs an x86-64 CPU with AVX2 and a C++ compiler",
)


@pytest.fixture(scope="module")
def built():
    """The kernel built (or found built by scripts/install.sh) in hf_specdec's cache folder, and loaded."""
    assert pl.build_cpu_kernels()
    return few_rows_gemm


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 9, 16, 17])
@pytest.mark.parametrize("out_features, in_features", [(70, 37), (32, 64), (1, 5), (96, 576)])
@pytest.mark.parametrize("bias", [True, False])
def test_products_are_f_linear_s(built, rows, out_features, in_features, bias):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features)
    w = torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    packed = built.pack_weight(w)
    assert packed.shape[1:] == (in_features, packed.shape[2]) and packed.shape[0] * packed.shape[2] >= out_features
    got = built.linear(x, packed, out_features, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    # fp32 sums of in_features terms in another order than F.linear's: within the classic bound of either order
    bound = (
        (in_features + 1) * 2.0**-24 * (F.linear(x.abs().double(), w.abs().double()) + (0 if b is None else b.abs()))
    )
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((F.linear(x, w, b).double() - exact).abs() <= bound).all()  # the bound F.linear itself keeps


@pytest.mark.parametrize("rows", [4, 13])
def test_threads_split_the_panels_and_every_chunk_of_rows_lands_in_its_own_place(built, rows):
    """Two threads, each a range of panels, each panel every chunk of rows in turn (more rows than one chunk)."""
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, 40), torch.randn(1001, 40), torch.randn(1001)  # 1001: a ragged last panel
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = built.linear(x, built.pack_weight(w), 1001, b)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_an_operand_it_did_not_pack_is_refused(built):
    w = torch.randn(40, 24)
    with pytest.raises(RuntimeError, match="packed by pack_weight"):
        built.linear(torch.randn(3, 24), w, 40, None)  # the weight itself, not its panels
    with pytest.raises(RuntimeError, match="packed by pack_weight"):
        built.linear(torch.randn(3, 24), built.pack_weight(w), 80, None)  # other out_features
    with pytest.raises(RuntimeError, match="float32"):
        built.linear(torch.randn(3, 24).double(), built.pack_weight(w), 40, None)


def test_load_never_compiles_and_unloaded_means_not_offered(monkeypatch, tmp_path):
    monkeypatch.setattr(few_rows_gemm, "_MODULE", [None])
    assert few_rows_gemm.load(tmp_path) is False and list(tmp_path.iterdir()) == []
    assert "few_rows" not in pl.available_forms(True, 5)
    assert not pl.is_gemm_choice((40, 24, 5, False, 1, True), "few_rows"), "a saved choice it cannot run"
    with pytest.raises(RuntimeError, match="not loaded"):
        few_rows_gemm.linear(torch.randn(2, 4), torch.zeros(1, 4, 32), 3, None)


def test_switched_off_by_the_environment(monkeypatch, built):
    monkeypatch.setattr(few_rows_gemm, "_MODULE", [None])
    monkeypatch.setattr(pl, "_KERNELS_LOOKED_UP", [False])
    monkeypatch.setenv(pl.KERNELS_ENV_FLAG, "0")
    assert pl.load_cpu_kernels() is False
    monkeypatch.setattr(pl, "_KERNELS_LOOKED_UP", [False])
    monkeypatch.setenv(pl.KERNELS_ENV_FLAG, "1")
    assert pl.load_cpu_kernels() is True  # the earlier build, loaded without compiling


def test_it_is_one_timed_form_of_the_verify_linears(monkeypatch, built):
    monkeypatch.setattr(pl, "PACK_AFTER", 1)
    monkeypatch.setattr(pl, "_GEMM_CHOICE", {})
    monkeypatch.setattr(pl, "_GEMM_TRIALS", {})
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 16)).eval()
    x = torch.randn(3, 24)  # below MKL's packed rows: the few-rows GEMM is offered all the same
    expected = net(x)
    forms = pl.available_forms(True, 3)
    assert "few_rows" in forms and "packed" not in forms
    ran = []
    real = few_rows_gemm.linear
    monkeypatch.setattr(few_rows_gemm, "linear", lambda *a: ran.append(1) or real(*a))
    with torch.no_grad(), pl.packed_linears(net, enabled=True):
        for _ in range(len(forms) * pl.TUNE_TRIALS + 2):
            torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)
        assert pl.packed_bytes(net) >= sum(m.weight.numel() * 4 for m in (net[0], net[2]))  # the panels
    assert len(ran) >= 2 * pl.TUNE_TRIALS, "each layer timed it"
    assert pl.packed_bytes(net) == 0, "the panels outlived the call"
    assert all("forward" not in m.__dict__ for m in net.modules())


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_are_vanilla_s_with_it(monkeypatch, built, batch):
    monkeypatch.setattr(pl, "PACK_AFTER", 1)
    monkeypatch.setattr(pl, "_GEMM_CHOICE", {})
    monkeypatch.setattr(pl, "_GEMM_TRIALS", {})
    model = tiny_causal_lm("llama", hidden_size=64, num_layers=2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7]] * batch)
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)
    ran = []
    real = few_rows_gemm.linear
    monkeypatch.setattr(few_rows_gemm, "linear", lambda *a: ran.append(1) or real(*a))
    out = model.generate(
        ids, max_new_tokens=16, do_sample=False, assistant=RandomTreeProposer(model.config.vocab_size, nodes=6)
    )
    assert_same_tokens(out, expected, "few-rows GEMM")
    assert ran, "the verify forwards never ran it"


def test_the_caches_keep_choices_and_curves_made_without_it_apart(monkeypatch, tmp_path, built):
    monkeypatch.setenv("HF_SPECDEC_COST_CACHE", str(tmp_path))
    with_kernel = gemm_cache.choices_file()
    monkeypatch.setattr(few_rows_gemm, "_MODULE", [None])
    monkeypatch.setattr(pl, "_KERNELS_LOOKED_UP", [True])
    assert gemm_cache.choices_file() != with_kernel


def test_the_command_builds_or_finds_it(built, capsys):
    assert cli_main(["build-kernels"]) == 0
    assert "built and loaded" in capsys.readouterr().err


@pytest.mark.skipif(few_rows_gemm.variant() != "avx512", reason="the AVX2 build is checked where AVX-512 runs it too")
def test_the_avx2_build_computes_the_same(monkeypatch, tmp_path):
    """CPUs without AVX-512 get the AVX2 build (8 lanes, 16-feature panels, 6 rows a chunk): built and checked here."""
    monkeypatch.setattr(few_rows_gemm, "_MODULE", [None])
    monkeypatch.setattr(few_rows_gemm, "variant", lambda: "avx2")
    assert few_rows_gemm.build(tmp_path)
    assert few_rows_gemm._MODULE[0].panel_width() == 16
    torch.manual_seed(0)
    for rows in (1, 5, 6, 7, 13):
        x, w, b = torch.randn(rows, 77), torch.randn(50, 77), torch.randn(50)
        got = few_rows_gemm.linear(x, few_rows_gemm.pack_weight(w), 50, b)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_a_weight_holds_one_copy_whatever_row_counts_its_layer_meets(monkeypatch, built):
    """Where the kernel is loaded its panels are a weight's one copy form (the weight's size again): MKL's packed
    form (3.35x) is not offered beside it, so copies kept across calls stay bounded by the weights' own size."""
    monkeypatch.setattr(pl, "_GEMM_CHOICE", {})
    monkeypatch.setattr(pl, "_GEMM_TRIALS", {})
    assert all("packed" not in pl.available_forms(True, rows) for rows in (2, 4, 8, 14, 64, 200))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 16)).eval()
    inputs = {rows: torch.randn(rows, 24) for rows in (2, 4, 8, 14, 16, 100)}  # tree levels, verifies, a prefill
    with torch.no_grad():
        expected = {rows: net(x) for rows, x in inputs.items()}
    with torch.no_grad(), pl.packed_linears(net, enabled=True, keep=True):
        for rows, x in inputs.items():
            for _ in range(len(pl.available_forms(True, rows)) * pl.TUNE_TRIALS + 1):
                torch.testing.assert_close(net(x), expected[rows], rtol=1e-5, atol=1e-5)
    assert not any(m.weight in pl._PACKED for m in (net[0], net[2])), "an MKL copy beside the panels"
    weights = sum(m.weight.numel() * 4 for m in (net[0], net[2]))
    assert pl.packed_bytes(net) <= 2 * weights, "more than one copy's worth (panels round out_features up)"
    pl.release_packed_weights(net)
