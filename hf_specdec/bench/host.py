"""Host time of one verify step's bookkeeping: ancestor masks, attention plan, Triton metadata, commit.

``python -m hf_specdec.bench.host`` times, for batch 1/8/32 x trees of 1/16/64 nodes, what the host does around
one verify forward (nothing of the forward itself):

- **ancestor**: the tree masks of every row, bit-packed for the attention and as booleans for the acceptance walks
  (`PackedTrees.ancestor_bits` / `ancestor_masks`),
- **plan**: packing the rows' ``[root, nodes...]`` and their position ids (`pack_trees`), reserving their cache
  slots and building the forward's `AttentionPlan`,
- **metadata**: the Triton kernel's per-forward metadata (work tiles, bit-packed masks, block tables) for a
  Llama-shaped forward (4 query heads per KV head, bf16 tiles),
- **commit**: moving each row's accepted path into place in the paged cache and freeing the rest (one cache layer,
  so the figure is the bookkeeping, not the copy).

On a machine without a GPU, CPU tensors stand in for the device tensors. Every row has a committed prefix of a few
hundred tokens; trees have random shapes (each node's parent drawn among the earlier nodes and the root) and the
accepted path is a random root-to-node path. Each configuration is timed ``repeats`` times after a warm-up and the
median of each part is reported, in milliseconds.

    python -m hf_specdec.bench.host                  # the table, markdown
    python -m hf_specdec.bench.host --json out.json  # and the raw medians
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..attention.plan import TailMask, build_plan
from ..cache.paged import PagedCache
from ..generation.tree import DraftTree, pack_trees
from ..kernels.tree_attention import build_tree_attention_metadata

PARTS = ("ancestor", "plan", "metadata", "commit")
GROUP = 4  # query heads per KV head (Llama-3.2-1B and -8B)
BLOCK_M = 64  # the kernel's largest work tile for bf16 queries


@dataclass
class StepCase:
    """One configuration's fixed inputs: the cache with its committed rows, the trees and their accepted paths."""

    cache: PagedCache
    rows: list[int]
    lengths: list[int]
    roots: list[int]  # [B] (the loop keeps each row's root on the host)
    parents: list[torch.Tensor]  # per row [T]
    tokens: list[torch.Tensor]  # per row [T]
    accepted: list[torch.Tensor]  # per row [1 + a] tree positions, root first


def random_parents(nodes: int, gen: torch.Generator) -> torch.Tensor:
    """`[T]` parents of a random tree in topological order: node i hangs under the root or an earlier node."""
    return torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(nodes)], dtype=torch.long)


def random_path(parent: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """`[1 + a]` tree positions of the path from the root to a random node (or the root alone)."""
    node = int(torch.randint(-1, parent.numel(), (1,), generator=gen))
    path = []
    while node >= 0:
        path.append(node + 1)
        node = int(parent[node])
    return torch.tensor([0, *reversed(path)], dtype=torch.long)


def make_case(batch: int, nodes: int, seed: int = 0, device: str = "cpu") -> StepCase:
    gen = torch.Generator().manual_seed(seed)
    cache = PagedCache(num_layers=1, block_size=16)
    rows = cache.add_rows(batch)
    lengths = torch.randint(200, 800, (batch,), generator=gen).tolist()
    for row, n in zip(rows, lengths):
        cache.reserve(row, 0, n)
        cache.commit_chunk(row, n)
    kv = torch.zeros(1, 2, 64, device=device)  # [1, H_kv, D]: makes the layer's pools
    cache.layer(0).write(torch.zeros(1, dtype=torch.long, device=device), kv, kv)
    parents = [random_parents(nodes, gen) for _ in rows]
    return StepCase(
        cache=cache,
        rows=rows,
        lengths=lengths,
        roots=torch.randint(0, 32000, (batch,), generator=gen).tolist(),
        parents=[p.to(device) for p in parents],
        tokens=[torch.randint(0, 32000, (nodes,), generator=gen).to(device) for _ in rows],
        accepted=[random_path(p, gen) for p in parents],
    )


def fresh_trees(case: StepCase) -> list[DraftTree]:
    """The rows' trees as a proposer hands them over: nothing derived from them yet, and the depth bound a proposer
    knows of its own trees (`DraftTree.depth_bound`)."""
    trees = []
    for tokens, parent in zip(case.tokens, case.parents):
        depth: list[int] = []
        for p in parent.tolist():
            depth.append(1 if p < 0 else depth[p] + 1)
        depth_t = torch.tensor(depth, dtype=torch.long, device=parent.device)
        trees.append(DraftTree(tokens, parent, depth_t, depth_bound=max(depth, default=0)))
    return trees


def time_step(case: StepCase, trees: Sequence[DraftTree], device: str = "cpu") -> dict[str, float]:
    """Seconds of each part of one step's host work (`PARTS`); the cache is back as it was afterwards."""
    rows = np.asarray(case.rows)
    t0 = time.perf_counter()
    packed = pack_trees(case.roots, trees, base=case.cache.lengths_of(rows))
    t1 = time.perf_counter()
    bits = packed.ancestor_bits()  # what the plan and the kernel read
    packed.ancestor_masks(bits)  # what the rows' acceptance walks read
    t2 = time.perf_counter()
    mask = TailMask(bits, packed.q_lens == 1)
    plan = build_plan(case.cache, rows, packed.q_lens, packed.positions, mask, device, backend="triton")
    t3 = time.perf_counter()
    build_tree_attention_metadata(
        plan.q_lens,
        plan.prefix_lens,
        plan.pending_lens,
        plan.mask.causal,
        plan.mask.words,
        case.cache.block_tables(plan.rows),
        torch.device(device),
        GROUP,
        BLOCK_M,
    )
    case.cache.layer(0).ensure_capacity()  # what the forward's K/V write does
    t4 = time.perf_counter()
    case.cache.commit(case.rows, case.accepted)
    t5 = time.perf_counter()
    times = dict(ancestor=t2 - t1, plan=(t1 - t0) + (t3 - t2), metadata=t4 - t3, commit=t5 - t4)
    case.cache.allocator.truncate_rows(rows, np.asarray(case.lengths))  # back as it was (rollback of every row)
    return times


def measure(
    batch: int, nodes: int, repeats: int = 30, warmup: int = 3, seed: int = 0, device: str = "cpu"
) -> dict[str, float]:
    """Median milliseconds of each part and of their sum over ``repeats`` steps."""
    case = make_case(batch, nodes, seed, device)
    samples: dict[str, list[float]] = {p: [] for p in (*PARTS, "total")}
    for i in range(warmup + repeats):
        times = time_step(case, fresh_trees(case), device)
        if i >= warmup:
            for part, s in times.items():
                samples[part].append(s * 1e3)
            samples["total"].append(sum(times.values()) * 1e3)
    return {part: statistics.median(v) for part, v in samples.items()}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table(results: dict[tuple[int, int], dict[str, float]]) -> str:
    lines = [
        "| batch | nodes | " + " | ".join(PARTS) + " | total (ms) |",
        "|---:|---:|" + "---:|" * (len(PARTS) + 1),
    ]
    for (batch, nodes), r in sorted(results.items()):
        cells = " | ".join(f"{r[p]:.3f}" for p in (*PARTS, "total"))
        lines.append(f"| {batch} | {nodes} | {cells} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m hf_specdec.bench.host", description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--nodes", default="1,16,64", help="comma-separated tree sizes (draft nodes per row)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None, help="also write the medians to this JSON file")
    parser.add_argument("--device", default="cpu", help="where the trees and the cache live (cuda: device tensors)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for nodes in (int(n) for n in args.nodes.split(",")):
            results[batch, nodes] = measure(batch, nodes, args.repeats, device=args.device)
    where = args.device if args.device == "cpu" else f"{args.device} ({torch.cuda.get_device_name(args.device)})"
    print(f"host time per verify step (median ms), {cpu_name()}, tensors on {where}, torch {torch.__version__}\n")
    print(table(results))
    out = {"cpu": cpu_name(), "device": where, "torch": torch.__version__, "results": [
        {"batch": b, "nodes": n, **r} for (b, n), r in sorted(results.items())
    ]}  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
