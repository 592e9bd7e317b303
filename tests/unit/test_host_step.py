"""The host work of a verify step (ancestor masks, attention plan, Triton metadata, commit) is vectorised over rows and
nodes: these tests hold it to the row-by-row, node-by-node implementation it replaced (kept here as the oracle) on
random batches of trees, so the rewrite changes speed only; and check that it never reads the device (meta tensors
cannot be read: any read would raise)."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch

from hf_specdec.attention.plan import TailMask, build_plan
from hf_specdec.cache.paged import PagedCache
from hf_specdec.generation.tree import DraftTree, pack_trees
from hf_specdec.kernels.mask_bits import pack_bits, unpack_bits
from hf_specdec.kernels.tree_attention import _next_pow2, build_tree_attention_metadata


# ------------------------------------------------------------------------------------ the replaced implementation
def old_ancestor_mask(tree: DraftTree) -> torch.Tensor:
    n = tree.num_nodes + 1
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(tree.position_parents().tolist(), start=1):
        mask[i] |= mask[p]
    return mask


def old_pack_bits(visible: torch.Tensor, words: int) -> torch.Tensor:
    n, length = visible.shape
    padded = torch.zeros(n, words * 32, dtype=torch.int64)
    padded[:, :length] = visible.to(torch.int64)
    packed = (padded.view(n, words, 32) * (torch.ones(32, dtype=torch.int64) << torch.arange(32))).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def old_metadata(cu, prefix_lens, pending_lens, masks, group, max_block_m):
    """The per-row metadata builder: (tile_row, tile_q_start, tile_kv_len, is_causal, mask_words, block_m, tpt)."""
    q_lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    block_m = max(min(max_block_m, max(16, _next_pow2(max(q_lens, default=1) * group))), _next_pow2(group))
    tpt = block_m // group
    tails = [p + n for p, n in zip(pending_lens, q_lens)]
    words = max(1, -(-max([t for t, m in zip(tails, masks) if m is not None], default=1) // 32))
    mask_words = torch.zeros(max(cu[-1], 1), words, dtype=torch.int32)
    is_causal, rows, starts, kv_lens = [], [], [], []
    for b, n in enumerate(q_lens):
        own = masks[b]
        if own is None:
            last = torch.arange(n)
        else:
            last = torch.where(own, torch.arange(tails[b]), -1).amax(1)
            mask_words[cu[b] : cu[b + 1]] = old_pack_bits(own, words)
        is_causal.append(int(own is None))
        padded = torch.full((-(-n // tpt) * tpt,), -1, dtype=torch.long)
        padded[:n] = last
        q_start = torch.arange(0, n, tpt)
        rows += [b] * q_start.numel()
        starts += q_start.tolist()
        kv_lens += (prefix_lens[b] + 1 + padded.view(-1, tpt).amax(1)).tolist()
    return rows, starts, kv_lens, is_causal, mask_words, block_m, tpt


class OldAllocator:
    """The heap allocator, row by row: reserve, slots, truncate, free."""

    def __init__(self, block_size):
        self.bs, self.num_blocks, self.free = block_size, 0, []
        self.tables: list[list[int]] = []
        self.lengths: list[int] = []

    def add_rows(self, n):
        self.tables += [[] for _ in range(n)]
        self.lengths += [0] * n

    def reserve(self, row, total):
        while len(self.tables[row]) < -(-total // self.bs):
            if not self.free:
                grow = max(16, self.num_blocks)
                for blk in range(self.num_blocks, self.num_blocks + grow):
                    heapq.heappush(self.free, blk)
                self.num_blocks += grow
            self.tables[row].append(heapq.heappop(self.free))

    def slots(self, row, positions):
        return [self.tables[row][p // self.bs] * self.bs + p % self.bs for p in positions]

    def truncate(self, row, length):
        keep = -(-length // self.bs)
        for blk in self.tables[row][keep:]:
            heapq.heappush(self.free, blk)
        del self.tables[row][keep:]
        self.lengths[row] = length

    def commit(self, row, accepted):
        """Per row: the (src, dst) slot moves and the truncation of the replaced `PagedCache.commit`."""
        base = self.lengths[row]
        moves = [(s, d) for i, a in enumerate(accepted) if a != i for s, d in [(base + a, base + i)]]
        src = self.slots(row, [s for s, _ in moves])
        dst = self.slots(row, [d for _, d in moves])
        self.truncate(row, base + len(accepted))
        return src, dst


# ------------------------------------------------------------------------------------ random batches
def random_tree(nodes: int, gen: torch.Generator) -> DraftTree:
    parent = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(nodes)]
    return DraftTree.from_parents(torch.randint(0, 1000, (nodes,), generator=gen), parent)


def random_path(tree: DraftTree, gen: torch.Generator) -> list[int]:
    node, path = int(torch.randint(-1, tree.num_nodes, (1,), generator=gen)), []
    while node >= 0:
        path.append(node + 1)
        node = int(tree.parent[node])
    return [0, *reversed(path)]


def random_batch(gen: torch.Generator) -> list[DraftTree]:
    batch = int(torch.randint(1, 9, (1,), generator=gen))
    sizes = [
        int(torch.randint(0, 80, (1,), generator=gen)) if torch.rand(1, generator=gen) < 0.8 else 0
        for _ in range(batch)
    ]
    return [random_tree(n, gen) for n in sizes]


SEEDS = range(12)


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("seed", SEEDS)
def test_ancestor_masks_equal_the_node_by_node_masks(seed):
    gen = torch.Generator().manual_seed(seed)
    trees = random_batch(gen)
    packed = pack_trees(list(range(len(trees))), trees, base=[7 * b for b in range(len(trees))])
    bits, masks = packed.ancestor_bits(), packed.ancestor_masks()
    words = bits.shape[1]
    for b, tree in enumerate(trees):
        rows, n = packed.row_slice(b), tree.num_nodes + 1
        want = old_ancestor_mask(tree)
        assert torch.equal(DraftTree(tree.tokens, tree.parent, tree.depth).ancestor_mask(), want)
        assert torch.equal(masks[rows, :n], want) and not masks[rows, n:].any()
        assert torch.equal(bits[rows], old_pack_bits(want, words))
        assert packed.tokens[rows].tolist() == [b, *tree.tokens.tolist()]
        assert packed.positions[rows].tolist() == [7 * b, *(tree.depth + 7 * b).tolist()]


def test_bits_round_trip():
    x = torch.rand(37, 3, 70, generator=torch.Generator().manual_seed(0)) > 0.5
    assert torch.equal(unpack_bits(pack_bits(x), 70), x)
    assert torch.equal(pack_bits(x[0]), old_pack_bits(x[0], 3))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("group,max_block_m", [(1, 16), (4, 64), (8, 64)])
def test_triton_metadata_equals_the_row_by_row_metadata(seed, group, max_block_m):
    gen = torch.Generator().manual_seed(seed)
    trees = random_batch(gen)
    batch = len(trees)
    prefix = torch.randint(0, 900, (batch,), generator=gen).tolist()
    masks = [old_ancestor_mask(t) if t.num_nodes else None for t in trees]  # what the loop plans
    if seed % 3 == 0:  # a draft model's level: pending tokens behind each row's new tokens
        pending = torch.randint(0, 40, (batch,), generator=gen).tolist()
        masks = [torch.cat([torch.rand(t.num_nodes + 1, p, generator=gen) < 0.3, old_ancestor_mask(t)], 1)
                 for t, p in zip(trees, pending)]  # fmt: skip
    else:
        pending = [0] * batch
    q_lens = [t.num_nodes + 1 for t in trees]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    tables = torch.randint(0, 500, (batch, 70), generator=gen, dtype=torch.int32)
    mask = TailMask.from_rows(masks, q_lens, pending, "cpu")
    meta = build_tree_attention_metadata(
        q_lens, prefix, pending, mask.causal, mask.words, tables, torch.device("cpu"), group, max_block_m
    )
    rows, starts, kv_lens, is_causal, words, block_m, tpt = old_metadata(cu, prefix, pending, masks, group, max_block_m)
    assert (meta.block_m, meta.tokens_per_tile, meta.num_queries, meta.words) == (block_m, tpt, cu[-1], words.shape[1])
    assert meta.tile_row.tolist() == rows and meta.tile_q_start.tolist() == starts
    assert meta.tile_kv_len.tolist() == kv_lens and meta.max_kv_len == max(kv_lens)
    assert meta.is_causal.tolist() == is_causal and meta.cu_seqlens.tolist() == cu
    assert meta.prefix_lens.tolist() == prefix and torch.equal(meta.block_tables, tables)
    tree_tokens = torch.repeat_interleave(torch.tensor(is_causal) == 0, torch.tensor(q_lens))
    assert torch.equal(meta.mask_words[tree_tokens], words[tree_tokens])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_plans_and_commits_equal_the_row_by_row_allocator(seed, block_size):
    gen = torch.Generator().manual_seed(seed)
    cache, old = PagedCache(num_layers=1, block_size=block_size), OldAllocator(block_size)
    cache.add_rows(8)
    old.add_rows(8)
    layer = cache.layer(0)
    for step in range(6):
        live = sorted(torch.randperm(8, generator=gen)[: int(torch.randint(1, 9, (1,), generator=gen))].tolist())
        trees = [random_tree(int(torch.randint(0, 40, (1,), generator=gen)), gen) for _ in live]
        q_lens = [t.num_nodes + 1 for t in trees]
        plan = build_plan(cache, live, q_lens, torch.zeros(sum(q_lens), dtype=torch.long), None, "cpu")
        want = []
        for r, n in zip(live, q_lens):
            old.reserve(r, old.lengths[r] + n)
            want += old.slots(r, range(old.lengths[r], old.lengths[r] + n))
        assert plan.slot_mapping.tolist() == want
        assert plan.prefix_lens.tolist() == [old.lengths[r] for r in live]
        values = torch.arange(plan.slot_mapping.numel(), dtype=torch.float32)[:, None, None] + 1
        layer.write(plan.slot_mapping, values, -values)  # [N, 1, 1]: each token's K is its packed index + 1
        accepted = [random_path(t, gen) for t in trees]
        cache.commit(live, [torch.tensor(a) for a in accepted])
        for b, (r, acc) in enumerate(zip(live, accepted)):
            old.commit(r, acc)
            keys, _ = layer.gather(r, cache.length(r))
            kept = keys[-len(acc) :, 0, 0].tolist()
            assert kept == [plan.cu_seqlens[b] + a + 1 for a in acc], f"step {step} row {r}"
        assert cache.lengths == old.lengths and cache.allocator.block_tables == old.tables
        assert cache.allocator.num_blocks == old.num_blocks
        assert sorted(cache.allocator._free.tolist()) == sorted(old.free)
        if step == 3:  # a row finishes, another rolls back
            cache.free(live[0])
            old.truncate(live[0], 0)
            cache.rollback(live[-1], old.lengths[live[-1]] // 2)
            old.truncate(live[-1], old.lengths[live[-1]] // 2)


def test_commit_still_requires_the_root_first():
    cache = PagedCache(num_layers=1)
    rows = cache.add_rows(2)
    build_plan(cache, rows, [3, 3], torch.zeros(6, dtype=torch.long), None, "cpu")
    with pytest.raises(ValueError, match="row 1: accepted positions must start with the root"):
        cache.commit(rows, [torch.tensor([0, 1]), torch.tensor([1, 2])])


def test_a_step_plans_without_reading_the_device():
    """Trees on the meta device: packing, ancestor masks, the plan and the Triton metadata only queue work on the
    device (a meta tensor cannot be read: a hidden sync would raise)."""
    gen = torch.Generator().manual_seed(0)
    trees = [random_tree(n, gen).to("meta") for n in (0, 5, 17, 64)]
    cache = PagedCache(num_layers=1)
    rows = cache.add_rows(len(trees))
    for r in rows:
        cache.reserve(r, 0, 30)
        cache.commit_chunk(r, 30)
    packed = pack_trees([1, 2, 3, 4], trees, base=cache.lengths_of(np.asarray(rows)))
    bits = packed.ancestor_bits()
    assert bits.device.type == "meta" and packed.ancestor_masks(bits).shape == (packed.total, packed.width)
    mask = TailMask(bits, packed.q_lens == 1)
    plan = build_plan(cache, rows, packed.q_lens, packed.positions, mask, "meta", backend="triton")
    meta = build_tree_attention_metadata(
        plan.q_lens, plan.prefix_lens, plan.pending_lens, mask.causal, mask.words, cache.block_tables(rows),
        torch.device("meta"), 4, 64,
    )  # fmt: skip
    assert meta.tile_kv_len.device.type == "meta" and meta.num_tiles == sum(-(-(t.num_nodes + 1) // 16) for t in trees)
    assert plan.slot_mapping.device.type == "meta"


def test_the_tree_budget_reads_a_batch_of_trees_once(monkeypatch):
    """The budget reads every row's parents, depths and scores in one copy (`budget.read_trees`) and nothing else of
    the trees: here they live on the meta device, which any other read would fail on."""
    from hf_specdec.generation import budget as budget_module
    from hf_specdec.generation.budget import TreeBudgeter
    from hf_specdec.generation.cost_model import StepCostModel

    gen = torch.Generator().manual_seed(3)
    host_trees = [random_tree(n, gen) for n in (6, 0, 12, 30)]
    for tree in host_trees:
        tree.scores = torch.linspace(0.9, 0.1, tree.num_nodes) ** tree.depth.float()
        tree.source = "test"
    reads = []
    real = budget_module.read_trees

    def read(trees, with_scores):
        reads.append(len(trees))
        return real([host_trees[[t.num_nodes for t in host_trees].index(t.num_nodes)] for t in trees], with_scores)

    monkeypatch.setattr(budget_module, "read_trees", read)
    cost = StepCostModel()
    for n in range(1, 80):
        cost.record_verify(n, 1, 0.02 * (1 + 0.05 * (n - 1)))
    budgeter = TreeBudgeter(cost)
    cuts = budgeter.cut_trees([0, 1, 2, 3], [t.to("meta") for t in host_trees])
    assert reads == [3]  # one read, of the three trees that have nodes
    assert all(c.tree.device.type == "meta" for c in cuts if c.num_nodes)
    assert sum(c.num_nodes for c in cuts) > 0
