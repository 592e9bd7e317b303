"""Self-distillation data: the target answers every prompt and its answers and hidden states are stored in shards
(`shards`), so that head training never runs the target again.

    ids = [chat_ids(tok, [{"role": "user", "content": p}]) for p in make_prompts(2000, seed=0)]
    manifest = build_distillation_data(model, ids, "out/data", recipe=prompt_recipe(2000, 0), max_new_tokens=256)
    data = load_distillation_data("out/data")

How the target answers is `target_states.Answering`; the format on disk is in `shards`' docstring.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .shards import finish_manifest, open_manifest, record_shard, target_dtype_setting, write_shard
from .target_states import Answering


def build_distillation_data(
    model,
    prompt_ids: Sequence[Sequence[int]],
    out_dir: str | os.PathLike,
    *,
    recipe: dict | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    shard_size: int = 64,
    do_sample: bool = False,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int = 0,
    hidden_dtype: torch.dtype = torch.float16,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    base_model_name: str | None = None,
    aux_layers: Sequence[int] = (),
    tokens_per_batch: int | None = None,
    static_decoding: bool = False,
    progress: bool = True,
) -> dict:
    """Let ``model`` answer every prompt and cache ids + final hidden states in safetensors shards under ``out_dir``.

    Resumable: shards the manifest already lists are skipped; a manifest written for other prompts or settings is
    refused (use a fresh folder).

    Args:
        model: the target (a transformers causal LM), in eval mode.
        prompt_ids: token ids of each prompt, chat template applied.
        out_dir: the data folder (created).
        recipe: how the prompts were made (`prompt_recipe`), recorded in the manifest.
        max_new_tokens: answer length cap.
        batch_size: prompts per `generate` / forward call.
        shard_size: sequences per shard file.
        do_sample / temperature / top_p: generation (greedy by default; sampling is seeded per shard).
        seed: sampling seed.
        hidden_dtype: dtype of the stored hidden states.
        eos_token_id / pad_token_id: default to the model's generation config.
        base_model_name: recorded in the manifest (default: ``model.config._name_or_path``).
        aux_layers: also store the states of these entries of transformers' ``hidden_states`` tuple (an EAGLE-3
            head's feature layers, e.g. ``EagleHead.bind(model).feature_layers``) as ``aux_hidden``
            `[N, H * len(aux_layers)]`.
        tokens_per_batch: also cap a batch at this many rows x (longest prompt + ``max_new_tokens``), the cache it
            can grow to (`Answering.batches`): a large ``batch_size`` for short prompts without running out of memory
            on long ones. None: ``batch_size`` alone.
        static_decoding: greedy answers over a static cache, each step a replayed CUDA graph on a GPU
            (`static_decoding`; the same data, several times faster there).
        progress: tqdm bar.
    Returns:
        the manifest dict (also in ``out_dir/manifest.json``).
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    how = Answering.of(model, max_new_tokens, batch_size, do_sample, temperature, top_p, eos_token_id, pad_token_id,
                       aux_layers, tokens_per_batch, static_decoding)  # fmt: skip
    settings = {"generation": how.describe(seed), "shard_size": int(shard_size), "hidden_dtype": str(hidden_dtype)}
    if how.aux_layers:  # only then: folders built before keep their fingerprint
        settings["aux_layers"] = list(how.aux_layers)
    settings.update(target_dtype_setting(model))
    manifest = open_manifest(out, model, prompt_ids, settings, recipe, base_model_name)
    done = {s["file"] for s in manifest["shards"] if (out / s["file"]).is_file()}
    manifest["shards"] = [s for s in manifest["shards"] if s["file"] in done]
    bar = tqdm(total=len(prompt_ids), desc="target answers", unit="prompt", disable=not progress)
    for index, start in enumerate(range(0, len(prompt_ids), shard_size)):
        name = f"shard-{index:05d}.safetensors"
        chunk = prompt_ids[start : start + shard_size]
        if name in done:
            bar.update(len(chunk))
            continue
        t0 = time.perf_counter()
        if do_sample:
            torch.manual_seed(seed * 1_000_003 + index)
        seqs, hiddens = how.answer(model, chunk, bar)
        entry = write_shard(out / name, seqs, hiddens, chunk, hidden_dtype, len(how.aux_layers))
        record_shard(out, manifest, name, start, entry, t0)
    bar.close()
    return finish_manifest(out, manifest)


__all__ = ["build_distillation_data"]
