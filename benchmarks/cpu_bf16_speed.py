"""What bf16 saves a head's training on a CPU with AMX or AVX512-BF16 (docs/heads_training.md, "The data-scaling
curve on a CPU"): teacher-forced tokens per CPU-second of the default model in float32 and in bfloat16 (what
``--build-dtype`` changes for teacher-forced data), the CPU-seconds of one greedy decoding step of a batch of 32 rows
(what it changes for self-distilled data, whose answers the target writes one token per step), and the CPU-seconds of
an EAGLE training step in float32 and under bfloat16 autocast (what ``--mixed-precision`` changes), interleaved, on
one torch thread, counted in process CPU time so that other work on the machine does not enter the figures.

    python benchmarks/cpu_bf16_speed.py --data DATA/fixed --out docs/results/intel_cpu_bf16_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from hf_specdec.cache.model_arg import cache_kwarg
from hf_specdec.heads.derived import dense_weight
from hf_specdec.heads.eagle import EagleHead
from hf_specdec.models import load_default_model
from hf_specdec.training.eagle import EagleTrainingConfig, eagle_loss
from hf_specdec.training.labels import draft_vocabulary, head_positions, token_targets, window_starts
from hf_specdec.training.run import step_precision
from hf_specdec.training.shards import load_distillation_data
from hf_specdec.training.target_states import teacher_forced_states


def float32_and_bfloat16_targets() -> dict:
    """``{"float32": model, "bfloat16": model}``: the default model in each dtype, in eval mode."""
    return {name: load_default_model(dtype=dtype)[0].eval() for name, dtype in
            (("float32", torch.float32), ("bfloat16", torch.bfloat16))}  # fmt: skip


def teacher_forcing_speed(rounds: int) -> dict:
    """Teacher-forced tokens per CPU-second, float32 and bfloat16 targets, 8 x 512 and 4 x 1024 random tokens."""
    models = float32_and_bfloat16_targets()
    gen = torch.Generator().manual_seed(0)
    seen: dict[str, list[float]] = {name: [] for name in models}
    for length, batch in ((512, 8), (1024, 4)):
        seqs = [torch.randint(100, 40000, (length,), generator=gen).tolist() for _ in range(batch)]
        for _ in range(rounds):
            for name, model in models.items():
                t0 = time.process_time()
                teacher_forced_states(model, seqs, ())
                seen[name].append(length * batch / (time.process_time() - t0))
    return {name: round(sum(v) / len(v), 1) for name, v in seen.items()}


@torch.no_grad()
def decoding_step_speed(rounds: int, batch: int = 32, steps: int = 4) -> dict:
    """CPU-seconds of one decoding step (the decoder over one new token per row, a growing `DynamicCache`, then the
    lm_head's arg-max) for ``batch`` rows whose cache holds 200 and 800 tokens, float32 and bfloat16 targets."""
    from transformers import DynamicCache

    models = float32_and_bfloat16_targets()
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {}
    for width in (200, 800):
        ids = torch.randint(100, 40000, (batch, width), generator=gen)
        seen: dict[str, list[float]] = {name: [] for name in models}
        caches = {name: DynamicCache() for name in models}
        for name, model in models.items():  # the prompt once; each round decodes from it again (the cache cut back)
            decoder = model.get_decoder()
            decoder(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwarg(decoder.forward, caches[name]))
        for _ in range(rounds):
            for name, model in models.items():
                decoder, cache = model.get_decoder(), caches[name]
                if cache.get_seq_length() > width:  # the last round's decoded tokens
                    cache.crop(width - cache.get_seq_length())
                mask = torch.ones(batch, width, dtype=torch.long)
                token = ids[:, -1]  # [B]
                t0 = time.process_time()
                for step in range(steps):
                    mask = torch.cat([mask, mask[:, :1]], dim=1)
                    position = torch.full((batch, 1), width + step)
                    h = decoder(
                        input_ids=token[:, None],
                        attention_mask=mask,
                        position_ids=position,
                        **cache_kwarg(decoder.forward, cache),
                    ).last_hidden_state  # [B, 1, H]
                    token = model.get_output_embeddings()(h[:, -1]).argmax(-1)  # [B]
                seen[name].append((time.process_time() - t0) / steps)
        out[f"cache_{width}"] = {name: round(sum(v) / len(v), 4) for name, v in seen.items()}
    return out


def training_step_speed(data_dir: str, rounds: int, steps: int = 3) -> dict:
    """CPU-seconds of one EAGLE-1 step of 8 windows of 512 positions, float32 and under bf16 autocast."""
    model, _ = load_default_model()
    data = load_distillation_data(data_dir, with_aux=False, max_tokens=300_000)
    seqs = torch.arange(data.seq_bounds.shape[0])
    vocab, _ = draft_vocabulary(data, head_positions(data, seqs), 8192)
    head = EagleHead.for_model(model, version=1, draft_vocab=vocab).train()
    labels = token_targets(data, dense_weight(model.get_output_embeddings().weight), vocab)
    starts, cfg = window_starts(data, seqs, 512), EagleTrainingConfig(window=512)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)

    def step(precision: str) -> None:
        windows = starts[torch.randint(0, starts.shape[0], (8,), generator=gen)]
        with step_precision(precision, head):
            loss = eagle_loss(head, data, labels, windows, cfg, 1.0)[0]
        loss.backward()
        opt.step()
        opt.zero_grad()

    seen: dict[str, list[float]] = {"no": [], "bf16": []}
    for precision in seen:  # warm-up
        step(precision)
    for _ in range(rounds):
        for precision in seen:
            t0 = time.process_time()
            for _ in range(steps):
                step(precision)
            seen[precision].append((time.process_time() - t0) / steps)
    return {("float32" if k == "no" else "bf16_autocast"): round(sum(v) / len(v), 3) for k, v in seen.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a teacher-forced data folder (the training step reads it)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").is_file() else []
    result = {
        "machine": {"processor": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags, "threads": 1},
        "teacher_forced_tokens_per_cpu_s": teacher_forcing_speed(args.rounds),
        "decoding_step_cpu_s_batch_32": decoding_step_speed(args.rounds),
        "eagle_step_cpu_s_8x512": training_step_speed(args.data, args.rounds),
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
