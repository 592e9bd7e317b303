"""Tokens/s of a tensor-parallel target (transformers' ``tp_plan="auto"``, gloo on the CPU) on 2 ranks against the same
model on 1 process, vanilla `generate` and prompt lookup (`NgramAssistant`), the CPU's cores shared out equally
(1 process x 2 threads, 2 ranks x 1 thread).

The model has SmolLM2-135M's shape (30 layers, width 576, vocabulary 49152) with 8 attention heads and 4 KV heads
(SmolLM2's 9 and 3 do not split over 2 ranks) and random weights, so the text is not language and the n-gram
acceptance is the random model's; the figure this measures is what sharding costs and saves per token. Each process
times the methods interleaved, 3 rounds of 4 prompts of 64 random tokens and 64 new tokens, greedy; the fastest
round counts. Run: python benchmarks/tensor_parallel_speed.py (figures in docs/multi_device.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPTS, PROMPT_LEN, NEW_TOKENS, ROUNDS, CORES = 4, 64, 64, 3, 2


def build(folder: Path) -> None:
    """The random SmolLM2-shaped Llama, saved to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=True, rms_norm_eps=1e-5)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


def _timed(model, ids, **kwargs) -> tuple[float, int, float | None]:
    """``(seconds, new tokens, tau)`` of one greedy generate call."""
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                         return_dict_in_generate=True, **kwargs)  # fmt: skip
    seconds = time.perf_counter() - start
    stats = getattr(out, "spec_stats", None)
    return seconds, NEW_TOKENS * ids.shape[0], (stats.tau if stats else None)


def worker(folder: str, out_file: str) -> None:
    """One process (a rank under torchrun): each method per prompt in turn, rounds of all prompts; rank 0 writes."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_specdec

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(CORES // world)
    if world > 1:
        from transformers.distributed import DistributedConfig

        dist.init_process_group("gloo")
        model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"))
    else:
        model = AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 49000, (1, PROMPT_LEN), generator=gen) for _ in range(PROMPTS)]
    methods = {"vanilla": {}, "ngram": {"assistant": hf_specdec.NgramAssistant()}}
    _timed(model, prompts[0], **methods["ngram"])  # warm-up (packed weights, the verify cost curve)
    rounds = {name: [] for name in methods}
    taus = {name: [] for name in methods}
    for _ in range(ROUNDS):
        totals = dict.fromkeys(methods, 0.0)
        for ids in prompts:
            for name, kwargs in methods.items():
                seconds, _tokens, tau = _timed(model, ids, **kwargs)
                totals[name] += seconds
                if tau is not None:
                    taus[name].append(tau)
        for name in methods:
            rounds[name].append(totals[name])
    if world == 1 or dist.get_rank() == 0:
        tokens = PROMPTS * NEW_TOKENS
        result = {name: {"tokens_per_s": tokens / min(r), "rounds_s": r,
                         "tau": (sum(taus[name]) / len(taus[name])) if taus[name] else None}
                  for name, r in rounds.items()}  # fmt: skip
        Path(out_file).write_text(json.dumps({"ranks": world, "threads": CORES // world, **result}))
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, "model")
        build(folder)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path.cwd()), *sys.path]))
        for ranks in (1, 2):
            out = Path(tmp, f"ranks{ranks}.json")
            env["OMP_NUM_THREADS"] = str(CORES // ranks)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   __file__, "--worker", str(folder), str(out)]  # fmt: skip
            subprocess.run(cmd, env=env, check=True, timeout=1800)
            rows.append(json.loads(out.read_text()))
    print("| ranks x threads | vanilla tokens/s | ngram tokens/s | ngram / vanilla | ngram τ |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        van, ngram = r["vanilla"]["tokens_per_s"], r["ngram"]["tokens_per_s"]
        print(f"| {r['ranks']} x {r['threads']} | {van:.1f} | {ngram:.1f} | {ngram / van:.2f}x | {r['ngram']['tau']:.2f} |")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
