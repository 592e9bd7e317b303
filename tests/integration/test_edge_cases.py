"""Edge cases a hostile or careless caller reaches: huge ``max_new_tokens``, an unwritable ``--out``, head folders with
a missing or malformed config, an empty CLI message, a benchmark stopped before its first prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hf_specdec
from hf_specdec import EagleHead, MedusaHeads, MLPSpeculator
from hf_specdec.cli import main
from hf_specdec.generation import loop
from hf_specdec.testing import assert_same_tokens, char_tokenizer, left_pad

PROMPT = [5, 6, 7, 8, 9, 10, 11]
CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _peak_growth_mb(fn) -> float:
    """Peak resident memory above the starting point while ``fn`` runs (Linux: VmHWM reset through clear_refs)."""
    CLEAR_REFS.write_text("5")
    before = _status_mb("VmRSS")
    fn()
    return _status_mb("VmHWM") - before


def test_row_buffers_start_small_whatever_max_new_tokens():
    ids = torch.tensor([PROMPT] * 4)
    rows = loop._rows_from_input(ids, None, 10**12)
    assert all(r.buf.numel() == len(PROMPT) + loop._INITIAL_ROOM for r in rows)


@pytest.mark.parametrize("batch,max_new", [(4, 10**8), (1, 10**9), (1, 10**12)])
def test_huge_max_new_tokens_costs_what_is_generated(tiny_models, batch, max_new):
    model = tiny_models["llama"]
    ids = torch.tensor([PROMPT] * batch)
    answer = model.generate(ids[:1], max_new_tokens=4, do_sample=False)[0, len(PROMPT) :].tolist()
    kw = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=answer[1], pad_token_id=0)  # two tokens
    expected = model.generate(ids, **kw)
    got = {}

    def run():
        got["out"] = model.generate(ids, assistant=hf_specdec.NgramAssistant(), **kw)

    if CLEAR_REFS.exists():
        growth = _peak_growth_mb(run)
        assert growth < 64, f"peak memory grew by {growth:.0f} MB for a two-token answer"
    else:
        run()
    assert_same_tokens(got["out"], expected, f"max_new_tokens={max_new}")


def test_rows_grow_past_their_first_buffer(tiny_models):
    model = tiny_models["qwen3"]
    n = loop._INITIAL_ROOM + 40
    ids, mask = left_pad([PROMPT, PROMPT[2:]])
    kw = dict(attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    expected = model.generate(ids, **kw)
    out = model.generate(ids, assistant=hf_specdec.NgramAssistant(), **kw)
    assert out.shape[1] == ids.shape[1] + n
    assert_same_tokens(out, expected, "past the first buffer")


def _error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("out", ["/proc/forbidden", "/proc/forbidden/deeper"])
def test_bench_refuses_an_unwritable_out_folder_before_any_work(capsys, out):
    err = _error_line(capsys, ["bench", "--methods", "ngram", "--out", out])
    assert f"--out {out}" in err and "cannot create that folder or write in it" in err
    assert "loaded" not in err  # refused before the model


def test_bench_out_check_leaves_nothing_behind(tmp_path):
    from hf_specdec.cli_args import check_out_folder  # what the bench checks --out with

    check_out_folder(str(tmp_path / "a" / "b"))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    check_out_folder(str(tmp_path / "kept"))
    assert list((tmp_path / "kept").iterdir()) == []


@pytest.mark.parametrize("question", ["", "   ", "\n\t"])
def test_generate_refuses_an_empty_message(capsys, question):
    err = _error_line(capsys, ["generate", question])
    assert "the question is empty" in err


@pytest.mark.slow  # the default model: the run must reach its first prompt
def test_bench_interrupted_before_its_first_prompt_says_so(tmp_path, monkeypatch, capsys):
    from hf_specdec.bench import spec_bench

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C inside the first generate call

    monkeypatch.setattr(spec_bench, "timed_generate", interrupted)
    out = tmp_path / "results"
    rc = main(["bench", "--methods", "ngram", "--max-new-tokens", "8", "--threads", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 130
    assert "interrupted before the first prompt finished" in err and "no results were written" in err
    assert "records kept" not in err
    assert not (out / "results.json").exists()


# ----------------------------------------------------------------------------------------- head folders
def _saved(head, folder: Path) -> Path:
    head.save_pretrained(folder)
    return folder


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_medusa_names_a_missing_or_empty_config(tiny_models, tmp_path):
    folder = _saved(MedusaHeads.for_model(tiny_models["llama"], num_heads=2), tmp_path / "medusa")
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match=r"medusa/config\.json is missing, but .*model\.safetensors holds"):
        MedusaHeads.from_pretrained(folder)
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"medusa/config\.json is empty"):
        MedusaHeads.from_pretrained(folder)


@pytest.mark.parametrize("field,value", [("num_heads", "two"), ("hidden_size", True), ("vocab_size", 2.5)])
def test_medusa_names_a_malformed_config_field(tiny_models, tmp_path, field, value):
    heads = MedusaHeads.for_model(tiny_models["llama"], num_heads=2, share_lm_head=False)
    folder = _saved(heads, tmp_path / "medusa")
    _edit_config(folder, **{field: value})
    with pytest.raises(ValueError, match=rf"medusa/config\.json field '{field}' must be an integer"):
        MedusaHeads.from_pretrained(folder)


@pytest.mark.parametrize(
    "field,value", [("hidden_size", "big"), ("num_attention_heads", 0), ("head_dim", 1.5), ("rms_norm_eps", "x")]
)
def test_eagle_names_the_file_and_the_field(tiny_models, tmp_path, field, value):
    folder = _saved(EagleHead.for_model(tiny_models["llama"]), tmp_path / "eagle")
    _edit_config(folder, **{field: value})
    with pytest.raises(ValueError, match=rf"eagle/config\.json.*'{field}'"):
        EagleHead.from_pretrained(folder)


@pytest.mark.parametrize("value", ["big", 12345, 3.5, False])
def test_mlp_speculator_names_a_bad_hidden_size(tiny_models, tmp_path, value):
    spec = MLPSpeculator.for_model(tiny_models["llama"], inner_dim=32, n_predict=2)
    folder = _saved(spec, tmp_path / "mlp")
    _edit_config(folder, hidden_size=value)
    with pytest.raises(ValueError, match=r"mlp/config\.json field 'hidden_size'"):
        MLPSpeculator.from_pretrained(folder)
    _edit_config(folder, hidden_size=None, inner_dim="wide")
    with pytest.raises(ValueError, match=r"mlp/config\.json field 'inner_dim' must be an integer"):
        MLPSpeculator.from_pretrained(folder)


def test_stop_strings_in_a_generation_config_stop_like_vanilla_without_warnings(tiny_models, monkeypatch):
    import copy

    from transformers.generation import utils as generation_utils

    model = tiny_models["llama"]
    ids = torch.tensor([PROMPT])
    tok = char_tokenizer(model.config.vocab_size)
    gen = model.generate(ids, max_new_tokens=12, do_sample=False)[0, len(PROMPT) :].tolist()
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=12, do_sample=False, stop_strings=[tok.convert_ids_to_tokens(gen[4])])
    expected = model.generate(ids, generation_config=config, tokenizer=tok)
    warned = []
    monkeypatch.setattr(generation_utils.logger, "warning_once", lambda msg, *a, **k: warned.append(msg))
    out = model.generate(ids, generation_config=config, tokenizer=tok, assistant=hf_specdec.NgramAssistant())
    assert not [w for w in warned if "deprecated" in w], warned  # nothing about arguments the caller never passed
    assert out.shape[1] < len(PROMPT) + 12 and config.stop_strings is not None
    assert_same_tokens(out, expected, "stop_strings in a GenerationConfig")
