import pytest
import torch

from hf_specdec import DraftTree, PagedCache
from hf_specdec.attention.plan import build_plan
from hf_specdec.cache.model_arg import cache_kwarg
from hf_specdec.testing import CORE_ARCHS as ARCHS
from hf_specdec.testing import assert_same_tokens, left_pad

LAYOUTS = {"slot-major": False, "head-major": True}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_drop_in_generate_matches_default_cache(tiny_models, arch, block_size, layout):
    model = tiny_models[arch]
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [9, 9, 8, 7, 6]])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    cache = PagedCache(model.config, block_size=block_size, head_major=LAYOUTS[layout])
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **cache_kwarg(model.forward, cache)
    )
    assert_same_tokens(out, ref, f"{arch} block_size={block_size}")
    assert cache.get_seq_length() == ids.shape[1] + 12 - 1


def _write_tree(cache, row, n_tokens, layer_vals):
    """Write n_tokens past the row's committed length, each token's K/V = a distinct value per layer."""
    positions = torch.arange(n_tokens)
    plan = build_plan(cache, [row], [n_tokens], positions, [torch.ones(n_tokens, n_tokens, dtype=torch.bool)], "cpu")
    for layer_idx, vals in enumerate(layer_vals):
        k = vals[:, None, None].expand(n_tokens, 2, 3).clone()
        cache.layer(layer_idx).write(plan.slot_mapping, k, -k)
    return plan


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_commit_and_rollback_match_dense_reference(block_size, layout):
    gen = torch.Generator().manual_seed(block_size)
    cache = PagedCache(block_size=block_size, num_layers=2, head_major=LAYOUTS[layout])
    rows = cache.add_rows(3)
    dense = {r: [[], []] for r in rows}  # per row, per layer: committed K values
    counter = 0.0
    for step in range(40):
        row = rows[int(torch.randint(0, 3, (1,), generator=gen))]
        n = int(torch.randint(1, 12, (1,), generator=gen))
        vals = [torch.arange(n, dtype=torch.float32) + counter + 1000 * layer for layer in range(2)]
        counter += n
        _write_tree(cache, row, n, vals)
        action = int(torch.randint(0, 3, (1,), generator=gen))
        if action < 2:  # commit a random root-to-node path of a random tree over the written tokens
            parent = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n - 1)]
            tree = DraftTree.from_parents(torch.zeros(n - 1, dtype=torch.long), parent)
            node = int(torch.randint(-1, n - 1, (1,), generator=gen))
            path = tree.ancestor_mask()[node + 1].nonzero().flatten()
            cache.commit([row], [path])
            for layer in range(2):
                dense[row][layer] += vals[layer][path].tolist()
        else:  # commit only the root, then roll back some committed tokens
            cache.commit([row], [[0]])
            for layer in range(2):
                dense[row][layer].append(float(vals[layer][0]))
            keep = int(torch.randint(0, len(dense[row][0]) + 1, (1,), generator=gen))
            cache.rollback(row, keep)
            for layer in range(2):
                dense[row][layer] = dense[row][layer][:keep]
        for r in rows:
            assert cache.lengths[r] == len(dense[r][0])
            for layer in range(2):
                k, v = cache.layers[layer].gather(r, cache.lengths[r])
                assert k[:, 0, 0].tolist() == dense[r][layer], f"row {r} layer {layer} step {step}"
                assert torch.equal(v, -k)
                kh, vh = cache.layers[layer].gather_heads(r, cache.lengths[r])  # [H_kv, L, D]
                assert torch.equal(kh, k.transpose(0, 1)) and torch.equal(vh, v.transpose(0, 1))
    # blocks in use are exactly what the committed lengths need
    need = sum(-(-cache.lengths[r] // block_size) for r in rows)
    assert cache.blocks_in_use() == need
    for r in rows:
        cache.free(r)
    assert cache.blocks_in_use() == 0


def test_memory_grows_with_kept_tokens_only():
    cache = PagedCache(block_size=4, num_layers=1)
    (row,) = cache.add_rows(1)
    for _ in range(20):
        _write_tree(cache, row, 8, [torch.zeros(8)])
        cache.commit([row], [[0, 1]])  # keep 2 of 8 every step
    assert cache.lengths[row] == 40
    assert cache.blocks_in_use() == 10


def test_commit_requires_root_first():
    cache = PagedCache(block_size=4, num_layers=1)
    (row,) = cache.add_rows(1)
    _write_tree(cache, row, 3, [torch.zeros(3)])
    with pytest.raises(ValueError, match="start with the root"):
        cache.commit([row], [[1, 2]])
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(row, 5)


def test_commit_of_roots_alone_advances_every_row_by_one():
    """A step that drafted nothing keeps each row's root (a shortcut: nothing moves); a non-root is still refused."""
    cache = PagedCache(block_size=4, num_layers=1)
    rows = cache.add_rows(2)
    for row, n in zip(rows, (3, 5)):
        _write_tree(cache, row, n, [torch.zeros(n)])
        cache.commit([row], [list(range(n))])
    for row in rows:
        _write_tree(cache, row, 1, [torch.ones(1)])
    cache.commit(rows, [torch.zeros(1, dtype=torch.long)] * 2)
    assert [cache.lengths[r] for r in rows] == [4, 6]
    for row in rows:
        _write_tree(cache, row, 1, [torch.ones(1)])
    with pytest.raises(ValueError, match="start with the root"):
        cache.commit(rows, [[0], [1]])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_writes_at_consecutive_slots_equal_indexed_writes(layout):
    """`PagedLayer.write` / `write_heads` at an int (the first of consecutive slots, a plan's `slot_start`) store
    what the indexed write stores; a plan gives `slot_start` only when its slots are consecutive."""
    pools = []
    for how in ("indexed", "start", "heads"):
        cache = PagedCache(block_size=4, num_layers=1, head_major=LAYOUTS[layout])
        (row,) = cache.add_rows(1)
        plan = build_plan(cache, [row], [6], torch.arange(6), None, "cpu")
        assert plan.slot_start == int(plan.slot_mapping[0]) and plan.write_slots == plan.slot_start
        torch.manual_seed(0)
        key, value = torch.randn(6, 2, 3), torch.randn(6, 2, 5)  # [N, H_kv, D]
        layer = cache.layer(0)
        if how == "indexed":
            layer.write(plan.slot_mapping, key, value)
        elif how == "start":
            layer.write(plan.slot_start, key, value)
        else:
            layer.write(plan.slot_mapping[:1], key[:1], value[:1])  # first write creates the pools
            layer.write_heads(plan.slot_start, key.transpose(0, 1), value.transpose(0, 1))  # [H_kv, N, D]
        pools.append((layer.keys.clone(), layer.values.clone()))
    for keys, values in pools[1:]:
        assert torch.equal(keys, pools[0][0]) and torch.equal(values, pools[0][1])
    cache = PagedCache(block_size=2, num_layers=1)
    rows = cache.add_rows(2)
    plan = build_plan(cache, rows, [3, 3], torch.arange(6), None, "cpu")  # slots 0-2 and 4-6: a gap between rows
    assert plan.slot_start is None and plan.write_slots is plan.slot_mapping


def test_head_major_rows_read_as_unit_stride_views():
    """A row whose pages are consecutive reads as a view of the head-major pool with unit stride between positions
    (what SDPA reads fastest), after the pool grew several times."""
    cache = PagedCache(block_size=4, num_layers=1, head_major=True)
    (row,) = cache.add_rows(1)
    for _ in range(5):
        _write_tree(cache, row, 6, [torch.arange(6, dtype=torch.float32)])
        cache.commit([row], [[0, 1, 2, 3, 4, 5]])
    layer = cache.layer(0)
    k, v = layer.gather_heads(row, cache.lengths[row])
    assert k.shape == (2, 30, 3) and k.stride() == (layer.keys.stride(0), 3, 1)
    assert k.data_ptr() == layer.keys[:, cache.allocator.read_index(row, 30)].data_ptr()
    assert k[0, :, 0].tolist() == list(range(6)) * 5
