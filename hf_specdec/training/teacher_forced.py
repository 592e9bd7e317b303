"""Training data from fixed text: whole conversations teacher-forced through the target, labels from the target.

Self-distillation (`distillation_data.build_distillation_data`) lets the target write every answer, one token per
forward: on a CPU that is ~100 answer tokens/s for a 135M model. Teacher forcing runs one prefill per batch of
conversations instead (hundreds of tokens/s), over text somebody else wrote (ShareGPT's assistant turns), and takes
each label from the target's own distribution at that position, as EAGLE's fixed-data training does: after position t
the head learns the target's arg-max ``target_next[t]`` given the real text up to t, not the text's own next token.
Greedy self-distilled data are the special case where the two coincide.

    seqs = [templated_ids(tok, c, max_tokens=2048) for c in load_sharegpt().train[:2000]]
    build_teacher_forced_data(model, [s for s in seqs if s], "out/fixed", recipe={...})
    data = load_distillation_data("out/fixed")         # data.answer_mask, data.target_next

The states come from `target_states.teacher_forced_states`. Each shard is a `build_distillation_data` shard plus
``target_next`` `[N]` int32 and ``answer_mask`` `[N]` uint8 (the tokens of assistant turns, which the heads are
evaluated on); ``prompt_lens`` is each sequence's first assistant token. Resumable and fingerprinted like the
self-distilled data (`shards`); and growable: a build over more conversations (the same ones first, as
`conversation_data.pick_conversations` takes them) in a folder holding a smaller build keeps its full shards and
teacher-forces only the rest.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from .chat_template import TemplatedConversation
from .shards import finish_manifest, open_manifest, record_shard, target_dtype_setting, write_shard
from .target_states import teacher_forced_states


def token_batches(lengths: Sequence[int], tokens_per_batch: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped so that a batch (padded to its longest) stays within ``tokens_per_batch``;
    longest first, so that a batch pads little."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= tokens_per_batch:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def build_teacher_forced_data(
    model,
    sequences: Sequence[TemplatedConversation],
    out_dir: str | os.PathLike,
    *,
    recipe: dict | None = None,
    shard_size: int = 256,
    tokens_per_batch: int = 8192,
    hidden_dtype: torch.dtype = torch.float16,
    aux_layers: Sequence[int] = (),
    base_model_name: str | None = None,
    progress: bool = True,
) -> dict:
    """Teacher-force ``sequences`` through ``model`` and cache ids, states, the target's next tokens and the
    assistant mask in shards under ``out_dir`` (module docstring).

    Args:
        model: the target (a transformers causal LM), in eval mode.
        sequences: templated conversations (`chat_template.templated_ids`).
        out_dir: the data folder (created; a rerun resumes, a build extending the folder's sequences keeps its full
            shards, other sequences or settings are refused).
        recipe: how the sequences were made, recorded in the manifest.
        shard_size: sequences per shard.
        tokens_per_batch: padded tokens per forward.
        hidden_dtype: dtype of the stored states.
        aux_layers: also store these entries of transformers' ``hidden_states`` (EAGLE-3's feature layers).
        base_model_name: recorded in the manifest (default: the model's name).
        progress: tqdm bar (tokens).
    Returns:
        the manifest (also in ``out_dir/manifest.json``).
    """
    from tqdm.auto import tqdm

    if not sequences:
        raise ValueError("no sequences to teacher-force")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "teacher_forced": True,
        "shard_size": int(shard_size),
        "hidden_dtype": str(hidden_dtype),
        "labels": "the target's arg-max next token at every position (full vocabulary)",
        "answer_mask_sha256": hashlib.sha256(bytes(m for s in sequences for m in s.answer_mask)).hexdigest()[:16],
    }
    if aux_layers:
        settings["aux_layers"] = [int(i) for i in aux_layers]
    settings.update(target_dtype_setting(model))
    manifest = open_manifest(
        out,
        model,
        [s.ids for s in sequences],
        settings,
        recipe,
        base_model_name,
        same_shard=lambda entry: _holds(out / entry["file"], sequences, entry["first_prompt"]),
    )
    done = {s["file"] for s in manifest["shards"] if (out / s["file"]).is_file()}
    manifest["shards"] = [s for s in manifest["shards"] if s["file"] in done]
    total = sum(len(s.ids) for s in sequences)
    bar = tqdm(total=total, desc="teacher forcing", unit="tok", unit_scale=True, disable=not progress)
    for index, start in enumerate(range(0, len(sequences), shard_size)):
        name = f"shard-{index:05d}.safetensors"
        chunk = sequences[start : start + shard_size]
        if name in done:
            bar.update(sum(len(s.ids) for s in chunk))
            continue
        t0 = time.perf_counter()
        states: list[torch.Tensor | None] = [None] * len(chunk)
        nexts: list[torch.Tensor | None] = [None] * len(chunk)
        for batch in token_batches([len(s.ids) for s in chunk], tokens_per_batch):
            got, nxt = teacher_forced_states(model, [chunk[i].ids for i in batch], aux_layers)
            for i, g, n in zip(batch, got, nxt):
                states[i], nexts[i] = g, n
            bar.update(sum(len(chunk[i].ids) for i in batch))
        per_token = {
            "target_next": torch.cat(nexts).to(torch.int32),
            "answer_mask": torch.tensor([m for s in chunk for m in s.answer_mask], dtype=torch.uint8),
        }
        prompts = [s.ids[: s.first_answer] for s in chunk]
        entry = write_shard(
            out / name, [s.ids for s in chunk], states, prompts, hidden_dtype, len(aux_layers), per_token
        )
        record_shard(out, manifest, name, start, entry, t0)
    bar.close()
    return finish_manifest(out, manifest)


def _holds(path: Path, sequences: Sequence[TemplatedConversation], start: int) -> bool:
    """Whether the shard at ``path`` (of an earlier build) holds exactly ``sequences[start:]``'s first shard's worth:
    the same ids, lengths and assistant masks, so a larger build over the same conversations can keep it."""
    if not path.is_file():
        return False
    with safe_open(str(path), framework="pt") as f:
        lens, ids, mask = (f.get_tensor(k) for k in ("seq_lens", "input_ids", "answer_mask"))
    chunk = sequences[start : start + lens.numel()]
    return (
        [len(s.ids) for s in chunk] == lens.tolist()
        and [t for s in chunk for t in s.ids] == ids.tolist()
        and [m for s in chunk for m in s.answer_mask] == mask.tolist()
    )


__all__ = ["build_teacher_forced_data", "token_batches"]
