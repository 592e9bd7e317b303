import pytest
import torch

from hf_specdec import DraftTree, PagedCache
from hf_specdec.attention.plan import build_plan
from hf_specdec.attention.reference import dense_tree_attention, paged_attention_reference


def _random_tree(n, gen):
    parent = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]
    return DraftTree.from_parents(torch.zeros(n, dtype=torch.long), parent)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2), (3, 1)])
@pytest.mark.parametrize("head_major", [False, True])
def test_reference_matches_dense_mask_for_random_trees(block_size, heads, head_major):
    hq, hkv = heads
    d = 16
    gen = torch.Generator().manual_seed(block_size * 100 + hq)
    cache = PagedCache(block_size=block_size, num_layers=1, head_major=head_major)
    rows = cache.add_rows(3)
    layer = cache.layer(0)
    dense_k, dense_v = {}, {}
    # committed prefixes of odd lengths, written through plans, pages shuffled by interleaving rows
    prefixes = [13, 1, 29]
    for r in rows:
        dense_k[r], dense_v[r] = torch.empty(0, hkv, d), torch.empty(0, hkv, d)
    for chunk in range(3):
        for r, plen in zip(rows, prefixes):
            n = plen // 3 + (1 if chunk < plen % 3 else 0)
            if n == 0:
                continue
            plan = build_plan(cache, [r], [n], torch.arange(n), [None], "cpu")
            k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
            layer.write(plan.slot_mapping, k, v)
            cache.commit_chunk(r, n)
            dense_k[r], dense_v[r] = torch.cat([dense_k[r], k]), torch.cat([dense_v[r], v])
    # one packed forward: a tree, a single decode token, a causal chunk
    trees = [_random_tree(7, gen), DraftTree.empty(), None]
    q_lens = [8, 1, 5]
    masks = [trees[0].ancestor_mask(), None, None]
    plan = build_plan(cache, rows, q_lens, torch.zeros(sum(q_lens), dtype=torch.long), masks, "cpu")
    n_tot = sum(q_lens)
    q = torch.randn(n_tot, hq, d, generator=gen)
    k_new, v_new = torch.randn(n_tot, hkv, d, generator=gen), torch.randn(n_tot, hkv, d, generator=gen)
    layer.write(plan.slot_mapping, k_new, v_new)
    out = paged_attention_reference(q, layer, plan, scale=0.3)
    cu = plan.cu_seqlens.tolist()
    for b, r in enumerate(rows):
        s, e = cu[b], cu[b + 1]
        n, L = e - s, prefixes[b]
        keys = torch.cat([dense_k[r], k_new[s:e]])
        vals = torch.cat([dense_v[r], v_new[s:e]])
        mask = torch.ones(n, L + n, dtype=torch.bool)
        mask[:, L:] = masks[b] if masks[b] is not None else torch.ones(n, n, dtype=torch.bool).tril()
        expected = dense_tree_attention(q[s:e], keys, vals, mask, 0.3)
        torch.testing.assert_close(out[s:e], expected, atol=1e-5, rtol=1e-5)


def test_pending_tokens_are_visible_only_through_the_mask():
    gen = torch.Generator().manual_seed(0)
    cache = PagedCache(block_size=4, num_layers=1)
    (r,) = cache.add_rows(1)
    layer = cache.layer(0)
    plan = build_plan(cache, [r], [6], torch.arange(6), [None], "cpu")
    k0, v0 = torch.randn(6, 1, 8, generator=gen), torch.randn(6, 1, 8, generator=gen)
    layer.write(plan.slot_mapping, k0, v0)
    cache.commit_chunk(r, 6)
    # two pending tokens written by an earlier forward, then two new ones: new0 sees pending1, new1 sees pending0
    p = build_plan(cache, [r], [2], torch.zeros(2, dtype=torch.long), [torch.tensor([[1, 0], [0, 1]]).bool()], "cpu")
    kp, vp = torch.randn(2, 1, 8, generator=gen), torch.randn(2, 1, 8, generator=gen)
    layer.write(p.slot_mapping, kp, vp)
    own = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1]]).bool()
    plan2 = build_plan(cache, [r], [2], torch.zeros(2, dtype=torch.long), [own], "cpu", pending_lens=[2])
    kn, vn = torch.randn(2, 1, 8, generator=gen), torch.randn(2, 1, 8, generator=gen)
    layer.write(plan2.slot_mapping, kn, vn)
    q = torch.randn(2, 2, 8, generator=gen)
    out = paged_attention_reference(q, layer, plan2, scale=0.5)
    keys, vals = torch.cat([k0, kp, kn]), torch.cat([v0, vp, vn])
    mask = torch.cat([torch.ones(2, 6, dtype=torch.bool), own], 1)
    torch.testing.assert_close(out, dense_tree_attention(q, keys, vals, mask, 0.5), atol=1e-5, rtol=1e-5)


def test_dispatch_rule(monkeypatch):
    """CUDA tensors and CPU tensors under Triton's interpreter take the Triton path; HF_SPECDEC_ATTENTION forces."""
    from hf_specdec.attention.backend import choose_backend

    pytest.importorskip("triton")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("HF_SPECDEC_ATTENTION", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert choose_backend(cpu) == "torch"
    assert choose_backend(cuda) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose_backend(cpu) == "triton"
    monkeypatch.setenv("HF_SPECDEC_ATTENTION", "torch")
    assert choose_backend(cpu) == choose_backend(cuda) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("HF_SPECDEC_ATTENTION", "triton")
    assert choose_backend(cpu) == "triton"
    assert choose_backend(cpu, "torch") == "torch"  # an explicit choice wins over the environment
    monkeypatch.setenv("HF_SPECDEC_ATTENTION", "fast")
    with pytest.raises(ValueError, match="HF_SPECDEC_ATTENTION"):
        choose_backend(cpu)
