"""Tensor parallelism (transformers' ``tp_plan="auto"``) under ``torchrun --nproc-per-node 2`` with gloo on the CPU:
speculative greedy output equals vanilla's on both ranks, also when one rank is much slower than the other (the
tree budget would size trees from each rank's own timings, the ranks' verify forwards would then pack different
token counts and their collectives disagree: generation/tensor_parallel.py).

The test runs this file as the worker of a two-process torchrun job on a tiny Llama (4 heads, 2 KV heads: divisible
by 2) saved to a folder; each rank writes its outputs to a JSON file that the test compares.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10], [12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 3, 4])
NEW_TOKENS = 24
SLOW_RANK_SECONDS = 0.03  # rank 1's proposing time in the slow-rank case: far above a tiny verify forward


def _worker(folder: str, out_dir: str) -> None:
    """One rank: vanilla, then speculative greedy with n-gram (as is, and with rank 1 slowed), and a draft model, each row's tokens written to ``out_dir/rank<r>.json``."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_specdec
    from hf_specdec.generation.tree import DraftTree
    from hf_specdec.testing import left_pad, random_medusa_heads, tiny_causal_lm

    dist.init_process_group("gloo", timeout=timedelta(seconds=40))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"))
    model.eval()
    assert model.tp_size == 2, model.tp_size

    class SlowRankNgram(hf_specdec.NgramAssistant):
        """Prompt lookup whose proposing takes `SLOW_RANK_SECONDS` longer on rank 1 (a loaded or slower rank)."""

        def propose(self, rows):
            if rank == 1:
                time.sleep(SLOW_RANK_SECONDS)
            return super().propose(rows)

    class RankDependentNgram(hf_specdec.NgramAssistant):
        """Prompt lookup that drafts nothing on rank 1: an assistant whose drafts depend on the process."""

        def propose(self, rows):
            trees = super().propose(rows)
            return [DraftTree.empty() for _ in trees] if rank == 1 else trees

    ids, mask = left_pad([list(p) for p in PROMPTS])
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    results = {"vanilla": model.generate(ids, **kwargs).tolist()}
    assistants = {
        "ngram": hf_specdec.NgramAssistant(),
        "ngram, rank 1 slow": SlowRankNgram(),
        "draft model": tiny_causal_lm("llama", seed=7),  # unsharded: every rank runs its own copy
        # heads with lm_heads of their own start as copies of the sharded lm_head, gathered whole
        "medusa": random_medusa_heads(model, share_lm_head=False),
    }
    for name, assistant in assistants.items():
        out = model.generate(ids, **kwargs, assistant=assistant, return_dict_in_generate=True)
        results[name] = out.sequences.tolist()
        results[name + " drafted"] = out.spec_stats.drafted_tokens
    try:
        model.generate(ids, **kwargs, assistant=RankDependentNgram())
        results["rank-dependent"] = "no error"
    except RuntimeError as e:
        results["rank-dependent"] = str(e)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    if shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists():
        pytest.fail("torchrun (part of torch) is not on PATH")
    from hf_specdec.testing import tiny_causal_lm

    folder = tmp_path_factory.mktemp("tiny_tp")
    tiny_causal_lm("llama", num_layers=2).save_pretrained(folder)
    out_dir = tmp_path_factory.mktemp("tp_out")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(Path.cwd()), *sys.path]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           str(folder), str(out_dir)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    if proc.returncode != 0:
        pytest.fail(f"the torchrun job failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in (0, 1)]


def test_both_ranks_generate_vanillas_tokens(tp_results):
    rank0, rank1 = tp_results
    assert rank0["vanilla"] == rank1["vanilla"]
    for name in ("ngram", "ngram, rank 1 slow", "draft model", "medusa"):
        assert rank0[name] == rank0["vanilla"], f"{name}: rank 0 differs from vanilla"
        assert rank1[name] == rank1["vanilla"], f"{name}: rank 1 differs from vanilla"
        assert rank0[name + " drafted"] == rank1[name + " drafted"], f"{name}: the ranks verified different trees"
    assert rank0["ngram drafted"] > 0, "n-gram drafted nothing: the test would not exercise a tree"


def test_an_assistant_drafting_differently_per_rank_is_refused_on_every_rank(tp_results):
    for rank, results in enumerate(tp_results):
        assert "ranks drafted different trees" in results["rank-dependent"], (rank, results["rank-dependent"])


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
