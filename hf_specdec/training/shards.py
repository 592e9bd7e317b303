"""How self-distillation data are stored and read back: a folder of safetensors shards and a manifest.

On disk (``out_dir``): ``manifest.json`` (the recipe: prompt templates, seed, counts, generation settings, the base
model's sizes, one entry per finished shard) and ``shard-00000.safetensors``... Each shard holds, for its sequences
(prompt + answer, no padding) concatenated: ``input_ids`` `[N]` int32, ``hidden`` `[N, H]` (fp16 or fp32: the base
model's final normed hidden states, what its lm_head sees; ``hidden[t]`` maps to token ``t + 1``), and per sequence
``seq_lens`` / ``prompt_lens`` `[S]` int64. Data built with ``aux_layers`` also hold ``aux_hidden``
`[N, H * len(aux_layers)]`. Data built by teacher forcing over fixed text (`hf_specdec.training.teacher_forced`)
also hold ``target_next`` `[N]` int32 (the target's arg-max next token at each position, over its whole vocabulary)
and ``answer_mask`` `[N]` uint8 (the tokens an assistant wrote; several turns per sequence). A builder records each
shard in the manifest as soon as it is written (`record_shard`), so a rerun skips the shards the manifest already
lists (resumable); a manifest written for other prompts or settings is refused (`open_manifest`), except that a
build whose sequences extend a smaller build's in the same folder keeps that build's full shards (`grown_shards`:
``--conversations 14803`` over a 10240-conversation ShareGPT build only teacher-forces the new conversations).

    data = load_distillation_data("out/data")                    # flat ids / hidden states / sequence bounds
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..heads.hub import base_model_dims
from ..heads.hub import base_model_name as loaded_name

MANIFEST_NAME = "manifest.json"
DATA_FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------------------- writing
def _fingerprint(prompt_ids: Sequence[Sequence[int]], settings: dict) -> str:
    h = hashlib.sha256(json.dumps([list(map(int, p)) for p in prompt_ids]).encode())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:16]


def write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (a temporary file renamed over it)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def target_dtype_setting(model) -> dict:
    """``{"target_dtype": ...}`` when ``model`` (the building target) is not float32, else ``{}``: a build by a
    bfloat16 target is other data, so its fingerprint differs and a float32 build does not resume it (float32
    builds keep the fingerprints they had)."""
    dtype = next(model.parameters()).dtype
    return {} if dtype == torch.float32 else {"target_dtype": str(dtype).removeprefix("torch.")}


def open_manifest(
    out: Path,
    model,
    prompt_ids,
    settings: dict,
    recipe,
    base_model_name,
    same_shard: Callable[[dict], bool] | None = None,
) -> dict:
    """The folder's manifest (refused when written for other prompts or settings), or a fresh one.

    ``same_shard`` (builders whose sequences are known before the build, e.g. teacher forcing) lets a build grow: when
    the folder holds a smaller build with the same settings, each of whose full shards ``same_shard(entry)`` finds
    identical to what this build writes at that place, the fresh manifest keeps those shards (`grown_shards`)."""
    fresh = _fresh_manifest(_fingerprint(prompt_ids, settings), model, len(prompt_ids), settings, recipe,
                            base_model_name)  # fmt: skip
    path = out / MANIFEST_NAME
    if not path.is_file():
        return fresh
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("fingerprint") == fresh["fingerprint"]:
        return manifest
    kept = grown_shards(manifest, fresh, same_shard) if same_shard else None
    if kept is None:
        raise ValueError(
            f"{out} already holds distillation data for other prompts or generation settings "
            f"(fingerprint {manifest.get('fingerprint')} vs {fresh['fingerprint']}); use another folder or delete it"
        )
    fresh["grown_from"] = {"fingerprint": manifest["fingerprint"], "num_prompts": manifest["num_prompts"],
                           "shards_kept": len(kept)}  # fmt: skip
    fresh["shards"] = kept
    write_json(path, fresh)
    return fresh


def _fresh_manifest(fingerprint: str, model, num_prompts: int, settings: dict, recipe, base_model_name) -> dict:
    hidden_size, vocab_size = base_model_dims(model)
    return {
        "format_version": DATA_FORMAT_VERSION,
        "fingerprint": fingerprint,
        "base_model": base_model_name or loaded_name(model) or type(model).__name__,
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "prompt_recipe": recipe,
        "num_prompts": num_prompts,
        **settings,
        "shards": [],
        "complete": False,
    }


# what a smaller build must share with a larger one for the larger to keep its shards (`grown_shards`): every key of
# a manifest but these (the recipe, the shards and counts, and settings that hash the whole sequence list)
PER_BUILD_KEYS = frozenset({"fingerprint", "prompt_recipe", "num_prompts", "shards", "complete", "grown_from",
                            "num_sequences", "num_tokens", "num_answer_tokens", "answer_mask_sha256"})  # fmt: skip


def grown_shards(manifest: dict, fresh: dict, same_shard: Callable[[dict], bool]) -> list[dict] | None:
    """The shards of ``manifest`` (an earlier, smaller build) that the build of ``fresh`` (its new manifest) keeps,
    or None when that build is not a prefix of this one: fewer sequences, the same model and settings (every key of
    ``fresh`` but `PER_BUILD_KEYS`, and no setting ``fresh`` lacks), and every full shard identical to this build's
    at its place (``same_shard(entry)``). A last, partial shard is not kept: this build fills it."""
    if fresh["num_prompts"] <= manifest.get("num_prompts", fresh["num_prompts"]):
        return None
    keys = (set(fresh) | set(manifest)) - PER_BUILD_KEYS
    if any(manifest.get(k) != fresh.get(k) for k in keys):
        return None
    full = [e for e in manifest["shards"] if e["num_sequences"] == fresh["shard_size"]]
    if not all(same_shard(e) for e in full):
        return None
    return full


def write_shard(
    path: Path,
    seqs: list[list[int]],
    hiddens: list[torch.Tensor],
    prompts,
    hidden_dtype,
    num_aux: int = 0,
    per_token: dict[str, torch.Tensor] | None = None,
) -> dict:
    """Write one shard atomically (``hiddens``: `[len, H * (1 + num_aux)]` each, the final state first; ``per_token``:
    more `[N]` tensors, e.g. ``target_next`` and ``answer_mask``); returns its manifest counts."""
    states = torch.cat(hiddens).to(hidden_dtype)  # [N, H * (1 + num_aux)]
    h = states.shape[-1] // (1 + num_aux)
    tensors = {
        "input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "hidden": states[:, :h].contiguous(),
        "seq_lens": torch.tensor([len(s) for s in seqs], dtype=torch.int64),
        "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
        **(per_token or {}),
    }
    if num_aux:
        tensors["aux_hidden"] = states[:, h:].contiguous()
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    if "answer_mask" in tensors:
        answer_tokens = int(tensors["answer_mask"].sum())
    else:
        answer_tokens = int(sum(len(s) - len(p) for s, p in zip(seqs, prompts)))
    return {
        "num_sequences": len(seqs),
        "num_tokens": int(tensors["input_ids"].numel()),
        "num_answer_tokens": answer_tokens,
    }


def record_shard(out: Path, manifest: dict, name: str, start: int, entry: dict, t0: float) -> None:
    """Add a written shard (``entry`` from `write_shard`, begun at ``t0``) to ``manifest`` and save it, so that a
    build stopped after this shard resumes after it."""
    manifest["shards"].append({"file": name, "first_prompt": start, **entry,
                               "seconds": round(time.perf_counter() - t0, 2)})  # fmt: skip
    manifest["shards"].sort(key=lambda s: s["first_prompt"])
    write_json(out / MANIFEST_NAME, manifest)


def finish_manifest(out: Path, manifest: dict) -> dict:
    """Mark ``manifest`` complete with its totals over the shards, save and return it."""
    manifest["complete"] = True
    for key in ("num_sequences", "num_tokens", "num_answer_tokens"):
        manifest[key] = sum(s[key] for s in manifest["shards"])
    write_json(out / MANIFEST_NAME, manifest)
    return manifest


# ---------------------------------------------------------------------------------------------------- loading
@dataclass
class DistillationData:
    """Every cached sequence, concatenated.

    Attributes:
        input_ids: `[N]` int64 token ids.
        hidden: `[N, H]` the target's final hidden states (stored dtype).
        seq_start: `[N]` int64, index of the first token of each token's sequence.
        seq_end: `[N]` int64, one past the last token of each token's sequence.
        answer_start: `[N]` int64, index of the first answer token of each token's sequence.
        seq_bounds: `[S, 3]` int64 (start, answer start, end) per sequence.
        manifest: the manifest dict.
        folder: the data folder it was read from.
        aux_hidden: `[N, H * len(aux_layers)]` the states of the target's ``hidden_states`` entries ``aux_layers``
            (EAGLE-3's features; built with ``aux_layers``), or None.
        aux_layers: those entries, or None.
        answer_mask: `[N]` bool, the tokens an assistant wrote (the target's answers; in teacher-forced data, every
            assistant turn). None means: from each sequence's answer start to its end.
        target_next: `[N]` int64, the target's arg-max next token after each position (teacher-forced data), or
            None. `next_tokens` gives it for any data.
    """

    input_ids: torch.Tensor
    hidden: torch.Tensor
    seq_start: torch.Tensor
    seq_end: torch.Tensor
    answer_start: torch.Tensor
    seq_bounds: torch.Tensor
    manifest: dict
    folder: Path | None = None
    aux_hidden: torch.Tensor | None = None
    aux_layers: tuple[int, ...] | None = None
    answer_mask: torch.Tensor | None = None
    target_next: torch.Tensor | None = None

    @classmethod
    def from_lengths(
        cls, input_ids: torch.Tensor, hidden: torch.Tensor, lens: torch.Tensor, answer_offsets: torch.Tensor,
        manifest: dict, **fields,
    ) -> DistillationData:  # fmt: skip
        """Sequences of ``lens`` `[S]` tokens laid end to end in ``input_ids`` `[N]` and ``hidden`` `[N, H]`, the
        first answer token of each ``answer_offsets`` `[S]` tokens in; ``fields``: the other attributes."""
        ends = lens.cumsum(0)
        starts = ends - lens
        answers = starts + answer_offsets
        return cls(input_ids=input_ids, hidden=hidden, seq_start=starts.repeat_interleave(lens),
                   seq_end=ends.repeat_interleave(lens), answer_start=answers.repeat_interleave(lens),
                   seq_bounds=torch.stack([starts, answers, ends], dim=1), manifest=manifest, **fields)  # fmt: skip

    def __post_init__(self):
        if self.answer_mask is None:
            pos = torch.arange(self.input_ids.numel())
            self.answer_mask = (pos >= self.answer_start) & (pos < self.seq_end)

    def next_tokens(self) -> torch.Tensor:
        """`[N]` int64: the target's next token after each position where the data say it, -1 elsewhere.

        Teacher-forced data store it for every position. In self-distilled data the answers are the target's own
        greedy tokens, so after position t it is token t + 1 wherever that is an answer token; after prompt
        positions it is unknown here (-1; the trainers take the arg-max of the target's lm_head over the stored state
        where they need it).
        """
        if self.target_next is not None:
            return self.target_next
        n = self.input_ids.numel()
        nxt = torch.full((n,), -1, dtype=torch.long)
        pos = torch.arange(n - 1)
        known = self.answer_mask[1:] & (pos + 1 < self.seq_end[:-1])
        nxt[:-1][known] = self.input_ids[1:][known]
        return nxt

    def on_target_path(self) -> torch.Tensor:
        """`[N]` bool: whether the token after each position is one the decoding loop would also have there:
        given text (a prompt or user turn) or the target's own greedy choice.

        Self-distilled answers are the target's own tokens, so every position is on the path. Teacher-forced answers
        are someone else's text: token t + 1 is on the path only where it equals the target's arg-max after t (about
        two thirds of ShareGPT's answer tokens for SmolLM2-135M). Heads that guess several tokens ahead from the
        state at t (Medusa, the MLP speculator) are trained only where the tokens between are on it: elsewhere
        their labels describe a continuation the target never writes.
        """
        on = torch.ones(self.input_ids.numel(), dtype=torch.bool)
        if self.target_next is None:
            return on
        answer_next = self.answer_mask[1:]  # the token after t was written by an assistant
        on[:-1] = ~answer_next | (self.input_ids[1:] == self.target_next[:-1])
        return on

    def features(self, layers: Sequence[int]) -> torch.Tensor:
        """`[N, F]` the stored states a head reads: ``(-1,)`` = the final states (EAGLE-1), else the aux layers these
        data were built with (EAGLE-3); other layers are an error naming what the data hold."""
        layers = tuple(int(i) for i in layers)
        if layers == (-1,):
            return self.hidden
        if self.aux_hidden is None or layers != self.aux_layers:
            held = f"the states of layers {list(self.aux_layers)}" if self.aux_layers else "only the final states"
            raise ValueError(
                f"the head reads the target's hidden states {list(layers)}, but {self.folder} holds {held}; build "
                f"the data with aux_layers={list(layers)}"
            )
        return self.aux_hidden


def load_distillation_data(
    data_dir: str | os.PathLike | Sequence[str | os.PathLike],
    evaluation_only_ok: bool = False,
    with_aux: bool = True,
    max_tokens: int | None = None,
) -> DistillationData:
    """Read the shards of ``data_dir`` (built by `build_distillation_data` or `build_teacher_forced_data`) into
    memory; a list of folders (built for the same base model) is read as one dataset, in order. ``with_aux=False``
    leaves the EAGLE-3 layer states on disk (a head reading the final states alone does not need them).
    ``max_tokens``: only the first sequences, in build order, up to that many tokens in all (whole sequences, at least
    one; shards past it are not read): the data a shorter build would have given, for a data-scaling curve.

    A folder whose prompt recipe says ``evaluation_only`` (the target's answers to benchmark questions,
    `hf_specdec.bench.head_eval`) is refused unless ``evaluation_only_ok``: heads are never trained on it.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive number of tokens, got {max_tokens}")
    if not isinstance(data_dir, (str, os.PathLike)):
        parts, left = [], max_tokens
        for folder in data_dir:
            if left is not None and left <= 0:
                break
            part = load_distillation_data(folder, evaluation_only_ok, with_aux, left)
            if parts and left is not None and part.input_ids.numel() > left:
                break  # its first sequence is over the budget (only the first folder's is always kept)
            parts.append(part)
            left = None if left is None else left - part.input_ids.numel()
        if not parts:
            raise ValueError("no data folder given")
        return _concatenate(parts) if len(parts) > 1 else parts[0]
    folder = Path(data_dir)
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{folder} has no {MANIFEST_NAME}; build the data with build_distillation_data first")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    if (manifest.get("prompt_recipe") or {}).get("evaluation_only") and not evaluation_only_ok:
        raise ValueError(
            f"{folder} holds the target's answers to benchmark questions (evaluation only); heads are never trained "
            "on it. Pass it to the head evaluation (hf-specdec eval-heads), not to a trainer"
        )
    if not manifest["shards"]:
        raise ValueError(f"{folder}: the manifest lists no finished shard")
    ids, lens, plens, masks, nexts = [], [], [], [], []
    aux_layers = tuple(manifest.get("aux_layers") or ()) or None
    if aux_layers and not with_aux:
        aux_layers = None
    teacher_forced = bool(manifest.get("teacher_forced"))
    shards = _shards_within(manifest["shards"], max_tokens)
    files = [str(folder / shard["file"]) for shard in shards]
    rows = [shard["num_tokens"] for shard in shards]
    hidden = _stacked(files, rows, "hidden")
    aux = _stacked(files, rows, "aux_hidden") if aux_layers else None
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            ids.append(f.get_tensor("input_ids").long())
            lens.append(f.get_tensor("seq_lens"))
            plens.append(f.get_tensor("prompt_lens"))
            if teacher_forced:
                masks.append(f.get_tensor("answer_mask").bool())
                nexts.append(f.get_tensor("target_next").long())
    if max_tokens is not None:
        manifest = {**manifest, "shards": shards, "max_tokens": int(max_tokens)}
    data = DistillationData.from_lengths(
        torch.cat(ids),
        hidden,
        torch.cat(lens),
        torch.cat(plens),
        manifest,
        folder=folder,
        aux_hidden=aux,
        aux_layers=aux_layers,
        answer_mask=torch.cat(masks) if teacher_forced else None,
        target_next=torch.cat(nexts) if teacher_forced else None,
    )
    return data if max_tokens is None else first_sequences(data, max_tokens)


def _stacked(files: Sequence[str], rows: Sequence[int], name: str) -> torch.Tensor:
    """`[N, F]` the tensor ``name`` of every shard file (``rows`` each, the manifest's ``num_tokens``), one after
    another, copied into one tensor allocated up front: the states are most of the data, and joining a list of them
    would need twice their size in memory."""
    out, row = None, 0
    for file, n in zip(files, rows):
        with safe_open(file, framework="pt", device="cpu") as f:
            part = f.get_tensor(name)
        if out is None:
            out = torch.empty((sum(rows), *part.shape[1:]), dtype=part.dtype)
        out[row : row + n] = part
        row += n
    return out


def _shards_within(shards: list[dict], max_tokens: int | None) -> list[dict]:
    """The leading ``shards`` (manifest entries) that hold the first ``max_tokens`` tokens (all when None)."""
    if max_tokens is None:
        return shards
    taken, total = [], 0
    for shard in shards:
        if total >= max_tokens:
            break
        taken.append(shard)
        total += shard["num_tokens"]
    return taken


def first_sequences(data: DistillationData, max_tokens: int) -> DistillationData:
    """The leading sequences of ``data`` that fit in ``max_tokens`` tokens (at least one), as a dataset of their
    own; its manifest records ``first_tokens`` and ``first_sequences``."""
    ends = data.seq_bounds[:, 2]  # [S] cumulative, from 0
    keep = max(1, int((ends <= max_tokens).sum()))
    n = int(ends[keep - 1])

    def cut(x: torch.Tensor | None) -> torch.Tensor | None:  # [N, ...] -> [n, ...]
        return None if x is None else x[:n]

    manifest = {**data.manifest, "first_tokens": n, "first_sequences": keep}
    return dataclasses.replace(
        data, input_ids=data.input_ids[:n], hidden=data.hidden[:n], seq_start=data.seq_start[:n],
        seq_end=data.seq_end[:n], answer_start=data.answer_start[:n], seq_bounds=data.seq_bounds[:keep],
        manifest=manifest, aux_hidden=cut(data.aux_hidden), answer_mask=cut(data.answer_mask),
        target_next=cut(data.target_next),
    )  # fmt: skip


def _concatenate(parts: list[DistillationData]) -> DistillationData:
    first = parts[0].manifest
    for part in parts[1:]:
        m = part.manifest
        if (m["base_model"], m["hidden_size"], m["vocab_size"]) != (
            first["base_model"],
            first["hidden_size"],
            first["vocab_size"],
        ):
            raise ValueError(
                f"data folders {parts[0].folder} and {part.folder} were built for different base models "
                f"({first['base_model']} vs {m['base_model']})"
            )
    offsets = [0]
    for part in parts[:-1]:
        offsets.append(offsets[-1] + part.input_ids.numel())
    manifest = {
        **first,
        "parts": [p.manifest for p in parts],
        "num_sequences": sum(int(p.seq_bounds.shape[0]) for p in parts),
        "num_tokens": sum(int(p.input_ids.numel()) for p in parts),
        "num_answer_tokens": sum(int(p.manifest.get("num_answer_tokens", 0)) for p in parts),
        "num_prompts": sum(int(p.manifest.get("num_prompts", 0)) for p in parts),
    }
    return DistillationData(
        input_ids=torch.cat([p.input_ids for p in parts]),
        hidden=torch.cat([p.hidden for p in parts]),
        seq_start=torch.cat([p.seq_start + o for p, o in zip(parts, offsets)]),
        seq_end=torch.cat([p.seq_end + o for p, o in zip(parts, offsets)]),
        answer_start=torch.cat([p.answer_start + o for p, o in zip(parts, offsets)]),
        seq_bounds=torch.cat([p.seq_bounds + o for p, o in zip(parts, offsets)]),
        manifest=manifest,
        folder=parts[0].folder,
        **_concatenated_aux(parts),
        answer_mask=torch.cat([p.answer_mask for p in parts]),
        target_next=torch.cat([p.next_tokens() for p in parts])
        if any(p.target_next is not None for p in parts)
        else None,
    )


def _concatenated_aux(parts: list[DistillationData]) -> dict:
    """The aux states of ``parts`` joined when every part holds the same layers, else none."""
    layers = {p.aux_layers for p in parts}
    if len(layers) != 1 or None in layers:
        return {"aux_hidden": None, "aux_layers": None}
    return {"aux_hidden": torch.cat([p.aux_hidden for p in parts]), "aux_layers": parts[0].aux_layers}


__all__ = [
    "DATA_FORMAT_VERSION",
    "MANIFEST_NAME",
    "DistillationData",
    "finish_manifest",
    "first_sequences",
    "target_dtype_setting",
    "load_distillation_data",
    "grown_shards",
    "open_manifest",
    "record_shard",
    "write_json",
    "write_shard",
]
