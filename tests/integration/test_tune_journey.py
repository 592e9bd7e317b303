"""``hf-specdec tune`` end to end on models nobody tuned for: tiny random models of three families (llama, qwen3, and
gemma2 with sliding-window layers), each with its own tokenizer and vocabulary size and no chat template, saved to
folders; local conversations as the training data (nothing from the Hub). The command writes the head, its card with
the measured table, its exports and the report; the head reloads and decodes vanilla's greedy tokens; a rerun skips
the finished steps; a bad option fails before any weights load, naming the option."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from hf_specdec import tune
from hf_specdec.cli import main
from hf_specdec.kinds import HEAD_KINDS
from hf_specdec.models import PLAIN_RENDERING, chat_prompt_ids
from hf_specdec.testing import char_tokenizer, tiny_causal_lm, tiny_chat_tokenizer
from hf_specdec.training.shards import load_distillation_data
from hf_specdec.tune import STEPS, usage_line

WORDS = "alpha beta gamma delta eps zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
# family -> (the kind tune trains for it, the model's settings, its tokenizer)
FAMILIES = {
    "llama": ("eagle", dict(vocab_size=97), lambda: char_tokenizer(97)),
    "qwen3": ("dflash", dict(vocab_size=64),
              lambda: tiny_chat_tokenizer(WORDS + ["System:", "User:", "Assistant:"], 64, chat_template=None)),
    "gemma2": ("medusa", dict(vocab_size=130), lambda: char_tokenizer(130)),  # sliding windows of 8 tokens
}  # fmt: skip


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """A JSON file of 40 four-turn conversations of random words, in ShareGPT's layout."""
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    records = [{"id": f"c{i}", "conversations": [{"from": f, "value": text(n)} for f, n in
                                                 (("human", 5), ("gpt", 12), ("human", 4), ("gpt", 10))]}
               for i in range(40)]  # fmt: skip
    path = tmp_path_factory.mktemp("data") / "conversations.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """family -> a folder holding a tiny 4-layer model of the family and its tokenizer (no chat template)."""
    folders = {}
    for family, (_, settings, tokenizer) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(family) / "model"
        tiny_causal_lm(family, hidden_size=32, num_layers=4, seed=3, **settings).save_pretrained(folder)
        tok = tokenizer()
        assert not tok.chat_template
        tok.save_pretrained(folder)
        folders[family] = folder
    return folders


def _tune(folder, out, data, kind: str, *extra: str) -> list[str]:
    return ["tune", "--model", str(folder), "--out", str(out), "--data", str(data), "--kind", kind,
            "--budget-minutes", "0.5", "--prompts", "2", "--max-new-tokens", "12", "--conversation-tokens", "96",
            *extra]  # fmt: skip


def _reloads_greedy_equal(folder, out, kind: str, methods: set[str]) -> None:
    """The saved head, loaded as a user would, drafts for the model with vanilla's greedy tokens; so does the line
    tune would print for each benched assistant, run as it is printed."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    head = HEAD_KINDS[kind].load("head").from_pretrained(out / "head", base_model=model)
    ids = chat_prompt_ids(tok, "alpha beta gamma delta")  # [1, W]
    mask = torch.ones_like(ids)
    vanilla = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    spec = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant=head,
                          return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(spec.sequences, vanilla) and spec.spec_stats.steps >= 1
    draft_layers = json.loads((out / "steps" / "options.json").read_text())["draft_layers"]
    vocab = out / tune.DRAFT_VOCAB_FILE
    plain = torch.tensor([[1, 5, 9, 14, 3, 7, 22, 11, 6]])  # [1, 9]: no pad id (the lines pass no attention_mask)
    names = {"hf_specdec": hf_specdec, "model": model, "ids": plain}
    for method in [*methods, None]:  # None: vanilla won
        line = usage_line({"method": method} if method else None, kind, out / "head", draft_layers,
                          vocab if vocab.is_file() else None)  # fmt: skip
        assert torch.equal(eval(line, names), eval("model.generate(ids)", names)), line


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_journey_on_a_model_nobody_tuned_for(family, model_folders, conversations, tmp_path, capsys, monkeypatch):
    """Vocabularies above 64 tokens count as large here (262k-token ones in a real run): the layer-skip draft of llama
    (97) and gemma2 (130) is benched over the 32 ids most frequent in the data's answers, qwen3's (64) over all."""
    monkeypatch.setattr(tune, "DRAFT_VOCAB_SIZE", 32)
    monkeypatch.setattr(tune, "LARGE_VOCAB", 64)
    kind = FAMILIES[family][0]
    out = tmp_path / "tuned"
    assert main(_tune(model_folders[family], out, conversations, kind)) == 0
    printed = capsys.readouterr()
    assert "no chat template" in printed.err and "| assistant | speedup |" in printed.out
    assert "use it: model.generate(ids" in printed.out

    report = json.loads((out / "tune_report.json").read_text())
    assert report["complete"] and list(report["steps"]) == list(STEPS)
    assert all(step["seconds"] >= 0 for step in report["steps"].values())
    assert report["steps"]["data"]["prompt_format"] == PLAIN_RENDERING
    data = report["steps"]["data"]  # more conversations where the predicted ones took under 2/3 of the data's share
    assert len(data["folders"]) == 1 + (data["conversations"] > data["conversations_predicted"])
    assert report["steps"]["train"]["steps"] >= 1 and report["steps"]["verify_cost"]["seconds_by_tokens"]["1"] > 0
    published = report["steps"]["publish"]
    benched = {row["method"] for row in published["table"]}
    assert {"ngram", "suffix", "draft", kind, f"ngram+{kind}"} <= benched
    assert all(row["mismatches"] == 0 for row in published["table"] if row["checked"])  # fp32: vanilla's tokens
    vocab = out / tune.DRAFT_VOCAB_FILE
    assert vocab.is_file() == (FAMILIES[family][1]["vocab_size"] > 64)
    if vocab.is_file():
        ids = json.loads(vocab.read_text())
        assert len(ids) == 32 and "draft_vocab=" in report["steps"]["bench_untrained"]["methods"]["draft"]
    beside_the_head = {row["method"] for row in published["table"] if row["run"] == "bench_head"}
    assert published["winner"] in beside_the_head | {"vanilla"}  # picked within one interleaved run

    config = json.loads((out / "head" / "config.json").read_text())
    assert config["head_type"] == kind
    card = (out / "head" / "README.md").read_text()
    assert "Measured by `hf-specdec tune`" in card and "| `NgramAssistant()` |" in card
    assert "conversations of conversations.json" in config["model_card"]["training_data"]  # not "ShareGPT"
    formats = [f for f in HEAD_KINDS[kind].load("head").export_formats if f != "hf-specdec"]
    assert set(published["exports"]) == set(formats)
    for fmt, where in published["exports"].items():
        assert where.startswith("not written") or (out / f"export-{fmt}" / "config.json").is_file()
    if "speculators" in formats and kind == "dflash":
        assert (out / "export-speculators" / "config.json").is_file()
    _reloads_greedy_equal(model_folders[family], out, kind, benched)

    before = {p.name: p.stat().st_mtime_ns for p in (out / "steps").iterdir()}
    assert main(_tune(model_folders[family], out, conversations, kind)) == 0  # a rerun: every step skipped
    err = capsys.readouterr().err
    assert all(f"{step}: done earlier" in err for step in STEPS) and "loaded" not in err
    assert {p.name: p.stat().st_mtime_ns for p in (out / "steps").iterdir()} == before
    with pytest.raises(SystemExit) as exit_:  # another kind into the same folder: refused, not mixed with this run
        main(_tune(model_folders[family], out, conversations, "mlp_speculator"))
    assert exit_.value.code == 2
    assert f"--kind mlp_speculator: {out} holds a run made with {kind}" in capsys.readouterr().err


def test_an_interrupted_journey_resumes_after_its_last_finished_step(model_folders, conversations, tmp_path, capsys):
    out = tmp_path / "tuned"
    argv = _tune(model_folders["llama"], out, conversations, "eagle")
    assert main(argv) == 0
    for step in ("bench_head", "publish"):  # as if the run had stopped after training
        (out / "steps" / f"{step}.json").unlink()
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert all(f"{step}: done earlier" in err for step in ("verify_cost", "bench_untrained", "data", "train"))
    assert "bench_head: benching" in err and "publish: picking" in err
    report = json.loads((out / "tune_report.json").read_text())
    assert report["complete"]

    built = report["steps"]["data"]["folders"]  # data built before, passed as folders: trained on as they are
    again = tmp_path / "from-folders"
    assert main(_tune(model_folders["llama"], again, built[0], "eagle")) == 0
    steps = json.loads((again / "tune_report.json").read_text())["steps"]
    assert steps["data"]["folders"] == built and steps["data"]["tokens"] == report["steps"]["data"]["tokens"]
    assert (again / "head" / "config.json").is_file()


@pytest.mark.parametrize(
    "change, words",
    [
        (("--model", "/no/such/model"), "--model /no/such/model"),
        (("--model", "NO_TOKENIZER"), "no tokenizer"),
        (("--model", "SILENT_TOKENIZER"), "encodes a prompt to no tokens"),
        (("--data", "/no/such/conversations.json"), "--data /no/such/conversations.json"),
        (("--data", "NOT_AN_ARRAY"), "an array of conversations"),
        (("--kind", "lookahead"), "--kind"),
        (("--budget-minutes", "0"), "--budget-minutes"),
        (("--draft-layers", "4"), "--draft-layers 4: the model has 4 layers"),
        (("--chat-template", "/no/such/template.jinja"), "--chat-template"),
        (("--device", "cuda:7" if not torch.cuda.is_available() else "nonsense"), "--device"),
    ],
)
def test_a_bad_option_fails_at_once_naming_it(change, words, model_folders, conversations, tmp_path, capsys):
    bare = tmp_path / "bare"  # a model folder without a tokenizer
    bare.mkdir()
    (bare / "config.json").write_text((model_folders["llama"] / "config.json").read_text())
    argv = _tune(model_folders["llama"], tmp_path / "out", conversations, "eagle")
    flag, value = change
    (tmp_path / "object.json").write_text('{"conversations": []}')
    silent = tmp_path / "qwen2"  # transformers reads a word tokenizer saved beside a qwen2 config as Qwen2Tokenizer
    tiny_causal_lm("qwen2", vocab_size=64, hidden_size=32).config.save_pretrained(silent)
    FAMILIES["qwen3"][2]().save_pretrained(silent)
    value = {"NO_TOKENIZER": str(bare), "SILENT_TOKENIZER": str(silent),
             "NOT_AN_ARRAY": str(tmp_path / "object.json")}.get(value, value)  # fmt: skip
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and time.perf_counter() - start < 5
    assert words in capsys.readouterr().err
    assert not (tmp_path / "out" / "steps").exists()


def test_the_data_grows_where_the_predicted_conversations_went_fast(
    model_folders, conversations, tmp_path, monkeypatch
):
    """8 conversations predicted for the data's share, teacher-forced in a fraction of it: the rest of the file's
    training conversations are added in a second folder, and the journey trains on both."""
    monkeypatch.setattr(tune, "_conversations_for_budget", lambda journey: 8)
    out = tmp_path / "tuned"
    assert main(_tune(model_folders["llama"], out, conversations, "eagle")) == 0
    data = json.loads((out / "tune_report.json").read_text())["steps"]["data"]
    assert data["conversations_predicted"] == 8 and data["conversations"] > 8
    assert [f.split("/")[-2] for f in data["folders"]] == ["conversations", "conversations-more"]
    assert data["sequences"] > 8


def test_the_data_grows_before_training_where_the_epochs_would_leave_time_unspent(
    model_folders, conversations, tmp_path, monkeypatch
):
    """8 conversations, no growth in the data step, a budget whose training time their epochs cannot fill: the train
    step teacher-forces more of the file's conversations (those after the 8, into a folder of their own) and trains
    on both folders; a rerun keeps every step."""
    monkeypatch.setattr(tune, "_conversations_for_budget", lambda journey: 8)
    monkeypatch.setattr(tune, "_more_conversations", lambda *args: 0)
    out = tmp_path / "tuned"
    assert main(_tune(model_folders["llama"], out, conversations, "eagle", "--budget-minutes", "3")) == 0
    steps = json.loads((out / "tune_report.json").read_text())["steps"]
    assert steps["data"]["conversations"] == 8 and len(steps["data"]["folders"]) == 1
    assert steps["data"]["conversations_left"] == 40 - 8  # recorded where the file was read, not read again
    train = steps["train"]
    added = train["conversations_added"]
    assert added == train["schedule"]["more_conversations"] and 8 <= added <= 40 - 8  # the rest of the file
    assert [f.split("/")[-2] for f in train["data_folders"]] == ["conversations", "conversations-for-training"]
    assert train["growing_s"] > 0 and train["schedule"]["spare_s"] > 0
    grown = load_distillation_data([Path(f) for f in train["data_folders"]], with_aux=True)
    assert grown.seq_bounds.shape[0] > steps["data"]["sequences"]
    assert main(_tune(model_folders["llama"], out, conversations, "eagle", "--budget-minutes", "3")) == 0
    # interrupted after the probes, before the schedule was kept: the rerun probes again over the probes' checkpoints
    assert sorted(p.name for p in (out / "train-probe").iterdir()) == ["1-steps", "3-steps"]
    for name in ("train", "bench_head", "publish"):
        (out / "steps" / f"{name}.json").unlink()
    shutil.rmtree(out / "train")
    shutil.rmtree(out / "data" / "conversations-for-training")
    assert main(_tune(model_folders["llama"], out, conversations, "eagle", "--budget-minutes", "3")) == 0


@pytest.mark.parametrize(
    ("spare", "left", "data_s", "train_s", "available", "more"),
    [
        (60.0, 100.0, 2.0, 1.0, 100, 20),  # 60 s over 3 s a conversation
        (60.0, 100.0, 2.0, 1.0, 12, 12),  # all that is left of the source
        (20.0, 100.0, 2.0, 1.0, 100, 0),  # under a quarter of the training time spare
        (60.0, 100.0, 2.0, 6.0, 100, 0),  # 7 conversations: not worth a second build
        (60.0, 100.0, None, 1.0, 100, 0),  # the data step's rate is unknown (a resumed build)
    ],
)
def test_training_grows_its_data_by_the_spare_time_over_a_conversations_cost(
    spare, left, data_s, train_s, available, more
):
    assert tune._more_for_training(spare, left, data_s, train_s, available) == more


@pytest.mark.parametrize(
    ("count", "seconds", "share", "available", "more"),
    [
        (10, 20.0, 90.0, 100, 35),
        (10, 20.0, 90.0, 30, 20),
        (10, 70.0, 90.0, 100, 0),
        (10, 0.0, 90.0, 100, 0),
        (10, None, 90.0, 100, 0),
    ],  # None: a resumed build, whose first part's time is unknown
)
def test_the_data_grows_by_the_measured_rate_while_a_third_of_its_share_is_left(count, seconds, share, available, more):
    assert tune._more_conversations(count, seconds, share, available) == more


@pytest.mark.parametrize(
    ("short", "long", "per_step"),
    [
        (1.4, 2.2, 0.4),  # the 1-step run's warm-up left out: (2.2 - 1.4) / 2
        (0.0, 0.0, 1e-3),  # tiny steps, rounded to 0.0 s: at least 1 ms
        (0.5, 0.3, 0.1),  # the longer run no longer (noise): its mean, 0.3 / 3
    ],
)
def test_a_training_step_is_timed_by_the_difference_of_two_probes(short, long, per_step):
    assert tune._seconds_per_step(short, long) == pytest.approx(per_step)
