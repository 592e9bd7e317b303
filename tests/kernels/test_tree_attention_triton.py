"""The Triton kernels (paged tree attention, commit copy) against the torch reference.

Runs on a GPU, or on a CPU under Triton's interpreter:

    TRITON_INTERPRET=1 HF_SPECDEC_ATTENTION=triton python -m pytest tests/kernels/test_tree_attention_triton.py

Without triton, or on a CPU-only machine without ``TRITON_INTERPRET=1``, every test here is skipped.
Shapes are small on purpose: the interpreter runs each program instance in Python.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1 on a CPU", allow_module_level=True)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hf_specdec import DraftTree, PagedCache, Proposer  # noqa: E402
from hf_specdec.attention import backend  # noqa: E402
from hf_specdec.attention.backend import tree_attention_metadata, triton_tree_attention  # noqa: E402
from hf_specdec.attention.plan import build_plan  # noqa: E402
from hf_specdec.attention.reference import dense_tree_attention, paged_attention_reference  # noqa: E402
from hf_specdec.generation.target import PlannedModel  # noqa: E402
from hf_specdec.kernels import move_kv, tree_attention  # noqa: E402
from hf_specdec.kernels.move_kv import move_kv_triton  # noqa: E402
from hf_specdec.testing import tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() and not tree_attention.INTERPRETED else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


# ------------------------------------------------------------------------------------------------ helpers
def _random_tree(n: int, gen: torch.Generator) -> DraftTree:
    parent = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]
    return DraftTree.from_parents(torch.zeros(n, dtype=torch.long), parent)


def _shuffle_pages(cache: PagedCache, gen: torch.Generator) -> None:
    """Relabel every physical block with a random permutation (data moves with it), so block tables are scattered."""
    alloc = cache.allocator
    perm = torch.randperm(alloc.num_blocks, generator=gen)
    for layer in cache.layers:
        if layer.is_initialized:
            layer.ensure_capacity()
            for name in ("keys", "values"):
                pool = getattr(layer, name)
                shuffled = torch.empty_like(pool)
                shuffled[perm.to(pool.device)] = pool
                setattr(layer, name, shuffled)
    alloc.relabel_blocks(perm.tolist())


def _cache_with_prefixes(prefixes, block_size, hkv, d, dtype, gen):
    """A one-layer cache whose rows hold random committed prefixes, written in interleaved chunks, pages shuffled."""
    cache = PagedCache(block_size=block_size, num_layers=1)
    rows = cache.add_rows(len(prefixes))
    layer = cache.layer(0)
    for chunk in range(3):
        for r, plen in zip(rows, prefixes):
            n = plen // 3 + (1 if chunk < plen % 3 else 0)
            if n == 0:
                continue
            plan = build_plan(cache, [r], [n], torch.arange(n), [None], DEVICE)
            k = torch.randn(n, hkv, d, generator=gen).to(DEVICE, dtype)
            v = torch.randn(n, hkv, d, generator=gen).to(DEVICE, dtype)
            layer.write(plan.slot_mapping, k, v)
            cache.commit_chunk(r, n)
    if layer.is_initialized:
        _shuffle_pages(cache, gen)
    return cache, rows


def _packed_forward(cache, rows, q_lens, masks, hq, hkv, d, dtype, gen, pending_lens=None):
    """Plan a forward, write the new tokens' K/V into the pools, return (plan, queries)."""
    n_tot = sum(q_lens)
    layer = cache.layer(0)
    plan = build_plan(
        cache, rows, q_lens, torch.zeros(n_tot, dtype=torch.long), masks, DEVICE, pending_lens=pending_lens
    )
    layer.write(
        plan.slot_mapping,
        torch.randn(n_tot, hkv, d, generator=gen).to(DEVICE, dtype),
        torch.randn(n_tot, hkv, d, generator=gen).to(DEVICE, dtype),
    )
    q = torch.randn(n_tot, hq, d, generator=gen).to(DEVICE, dtype)
    return plan, q


def _dense_expected(q, cache, plan, scale, masks, sinks=None):
    """fp64 oracle: each row's K/V gathered densely, its `[n, L + P + n]` mask spelled out from the per-row
    ``masks`` the forward was planned with (None: causal); `[H_q]` ``sinks`` as `_dense_with_sinks`."""
    layer = cache.layer(0)
    out = torch.empty_like(q)
    cu = plan.cu_seqlens.tolist()
    for b, row in enumerate(plan.rows.tolist()):
        s, e = cu[b], cu[b + 1]
        n, prefix, pending = e - s, int(plan.prefix_lens[b]), int(plan.pending_lens[b])
        k, v = layer.gather(row, prefix + pending + n)
        mask = torch.ones(n, prefix + pending + n, dtype=torch.bool)
        own = masks[b]
        mask[:, prefix:] = own.cpu() if own is not None else torch.ones(n, n, dtype=torch.bool).tril()
        if sinks is None:
            out[s:e] = dense_tree_attention(q[s:e], k, v, mask, scale)
        else:
            out[s:e] = _dense_with_sinks(q[s:e], k, v, mask, scale, sinks)
    return out


def _dense_with_sinks(query, keys, values, mask, scale, sinks):
    """fp64 oracle with attention sinks, as transformers' gpt_oss eager attention: each head's sink logit joins every
    query's softmax as one more column, whose probability is dropped. `[n, H_q, D]` queries, `[L, H_kv, D]` keys and
    values, `[n, L]` mask, `[H_q]` sinks -> `[n, H_q, D]`."""
    q = query.double().transpose(0, 1)  # [H_q, n, D]
    rep = q.shape[0] // keys.shape[1]
    k = keys.double().transpose(0, 1).repeat_interleave(rep, 0)  # [H_q, L, D]
    v = values.double().transpose(0, 1).repeat_interleave(rep, 0)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask.to(q.device), float("-inf"))  # [H_q, n, L]
    sink = sinks.double().to(q.device)[:, None, None].expand(-1, q.shape[1], 1)  # [H_q, n, 1]
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return (probs @ v).transpose(0, 1).to(query.dtype)


def _sinks_around_the_scores(hq: int, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """`[H_q]` sink logits on DEVICE: moderate ones, one above every score (the running max starts at the sink and
    stays there) and, with 3+ heads, one far below (the sink weighs nothing)."""
    sinks = torch.randn(hq, generator=gen) * 2
    sinks[0] = 9.0
    if hq >= 3:
        sinks[1] = -40.0
    return sinks.to(DEVICE, dtype)


def _assert_close(actual, expected, dtype, what):
    tol = TOL[dtype]
    err = (actual.double() - expected.double()).abs()
    worst = int(err.flatten().argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    assert err.max() <= tol * (1 + expected.double().abs().max()), (
        f"{what}: max abs error {err.max():.3g} at (query, head, dim) {where}: got {actual[where].item():.6g}, "
        f"expected {expected[where].item():.6g}"
    )


# ------------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(2, 2), (6, 2), (8, 2)], ids=["mha", "gqa3", "gqa4"])
def test_kernel_matches_reference_on_ragged_batch_of_tree_decode_and_chunk(block_size, heads):
    hq, hkv = heads
    d = 16
    gen = torch.Generator().manual_seed(block_size * 10 + hq)
    cache, rows = _cache_with_prefixes([13, 1, 29, 0], block_size, hkv, d, torch.float32, gen)
    tree = _random_tree(7, gen)
    # a draft tree, a single decode token, a causal chunk after a prefix, a fresh prefill
    q_lens = [8, 1, 5, 6]
    masks = [tree.ancestor_mask(), None, None, None]
    plan, q = _packed_forward(cache, rows, q_lens, masks, hq, hkv, d, torch.float32, gen)
    layer = cache.layer(0)
    expected = paged_attention_reference(q, layer, plan, scale=0.3)
    for splits in (1, 3):
        out = triton_tree_attention(q, layer.keys, layer.values, plan, 0.3, num_splits=splits)
        _assert_close(out, expected, torch.float32, f"block_size={block_size} heads={heads} splits={splits}")


@pytest.mark.parametrize(
    "dtype,hq,hkv,d",
    [
        (torch.float16, 9, 3, 64),  # SmolLM2-135M's attention shape
        (torch.bfloat16, 8, 2, 128),
        (torch.float32, 4, 1, 64),  # MQA
    ],
    ids=["fp16-9x3x64", "bf16-8x2x128", "fp32-4x1x64"],
)
def test_kernel_matches_fp64_oracle_per_dtype_and_head_dim(dtype, hq, hkv, d):
    gen = torch.Generator().manual_seed(d + hq)
    cache, rows = _cache_with_prefixes([70, 9], 16, hkv, d, dtype, gen)
    tree = _random_tree(11, gen)
    plan, q = _packed_forward(cache, rows, [12, 1], [tree.ancestor_mask(), None], hq, hkv, d, dtype, gen)
    layer = cache.layer(0)
    expected = _dense_expected(q, cache, plan, d**-0.5, [tree.ancestor_mask(), None])
    out = triton_tree_attention(q, layer.keys, layer.values, plan, d**-0.5, num_splits=2)
    assert out.dtype == dtype and out.shape == q.shape
    _assert_close(out, expected, dtype, f"{dtype} {hq}/{hkv} heads, head_dim {d}")


def test_split_k_over_long_context_matches_single_pass():
    gen = torch.Generator().manual_seed(7)
    cache, rows = _cache_with_prefixes([333], 8, 1, 16, torch.float32, gen)
    tree = _random_tree(5, gen)
    plan, q = _packed_forward(cache, rows, [6], [tree.ancestor_mask()], 2, 1, 16, torch.float32, gen)
    layer = cache.layer(0)
    expected = paged_attention_reference(q, layer, plan, scale=0.25)
    for splits in (1, 2, 5, 16):  # 16 splits > key tiles: some programs get nothing and must not disturb the merge
        out = triton_tree_attention(q, layer.keys, layer.values, plan, 0.25, num_splits=splits)
        _assert_close(out, expected, torch.float32, f"num_splits={splits}")


@pytest.mark.parametrize("heads", [(2, 2), (6, 2)], ids=["mha", "gqa3"])
def test_kernel_with_sinks_matches_the_oracle_and_the_torch_path_on_a_ragged_batch(heads):
    """Sinks on a tree, a decode token, a causal chunk after a prefix and a fresh prefill (whose first token sees one
    key besides the sink), in one pass and split-K."""
    hq, hkv = heads
    gen = torch.Generator().manual_seed(hq)
    cache, rows = _cache_with_prefixes([13, 1, 29, 0], 4, hkv, 16, torch.float32, gen)
    masks = [_random_tree(7, gen).ancestor_mask(), None, None, None]
    plan, q = _packed_forward(cache, rows, [8, 1, 5, 6], masks, hq, hkv, 16, torch.float32, gen)
    sinks = _sinks_around_the_scores(hq, gen)
    layer = cache.layer(0)
    expected = _dense_expected(q, cache, plan, 0.3, masks, sinks)
    torch_path = paged_attention_reference(q, layer, plan, 0.3, sinks=sinks)
    _assert_close(torch_path, expected, torch.float32, "the torch path with sinks against the oracle")
    for splits in (1, 3):
        out = triton_tree_attention(q, layer.keys, layer.values, plan, 0.3, sinks=sinks, num_splits=splits)
        _assert_close(out, expected, torch.float32, f"heads={heads} splits={splits} with sinks")
    plain = triton_tree_attention(q, layer.keys, layer.values, plan, 0.3)
    assert (plain - expected).abs().max() > 0.1, "the sinks should change the output"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_k_with_sinks_counts_each_sink_once(dtype):
    """Every split (even one with no key tile) leaves the sink out; the merge adds it once. bf16 sinks as a bf16
    gpt-oss gives them."""
    gen = torch.Generator().manual_seed(11)
    cache, rows = _cache_with_prefixes([333], 8, 2, 16, dtype, gen)
    mask = _random_tree(5, gen).ancestor_mask()
    plan, q = _packed_forward(cache, rows, [6], [mask], 8, 2, 16, dtype, gen)
    sinks = _sinks_around_the_scores(8, gen, dtype)
    sinks[2] = 3.0  # near the largest scores of a long context, where a sink counted per split weighs too much
    expected = _dense_expected(q, cache, plan, 0.25, [mask], sinks)
    layer = cache.layer(0)
    for splits in (1, 2, 5, 16):
        out = triton_tree_attention(q, layer.keys, layer.values, plan, 0.25, sinks=sinks, num_splits=splits)
        _assert_close(out, expected, dtype, f"num_splits={splits} with sinks")


def test_sinks_of_the_wrong_shape_are_refused_with_the_expected_shape():
    gen = torch.Generator().manual_seed(0)
    cache, rows = _cache_with_prefixes([3], 4, 1, 16, torch.float32, gen)
    plan, q = _packed_forward(cache, rows, [2], [None], 4, 1, 16, torch.float32, gen)
    layer = cache.layer(0)
    with pytest.raises(ValueError, match=r"one float logit per query head, shape \(4,\); got \(2,\)"):
        triton_tree_attention(q, layer.keys, layer.values, plan, 0.25, sinks=torch.zeros(2, device=DEVICE))


def test_tail_tiles_nobody_sees_are_skipped_without_changing_the_result():
    """Pending tokens hidden from every query fill whole key tiles; those tiles are skipped, the result is exact."""
    gen = torch.Generator().manual_seed(3)
    hkv, d = 1, 16
    cache, rows = _cache_with_prefixes([5], 4, hkv, d, torch.float32, gen)
    (r,) = rows
    layer = cache.layer(0)
    pend = 150  # earlier draft levels: two and a bit 64-key tiles
    p = build_plan(
        cache, [r], [pend], torch.zeros(pend, dtype=torch.long), [torch.ones(pend, pend).tril().bool()], DEVICE
    )
    keys, values = (torch.randn(pend, hkv, d, generator=gen).to(DEVICE) for _ in range(2))  # [pend, H_kv, D]
    layer.write(p.slot_mapping, keys, values)
    own = torch.zeros(3, pend + 3, dtype=torch.bool)
    own[:, pend - 2 :] = torch.tensor([[1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [1, 1, 1, 0, 1]]).bool()
    plan, q = _packed_forward(cache, [r], [3], [own], 2, hkv, d, torch.float32, gen, pending_lens=[pend])
    expected = _dense_expected(q, cache, plan, 0.5, [own])
    torch.testing.assert_close(paged_attention_reference(q, layer, plan, 0.5), expected, atol=1e-5, rtol=1e-5)
    out = triton_tree_attention(q, layer.keys, layer.values, plan, 0.5, num_splits=2)
    _assert_close(out, expected, torch.float32, "pending tokens behind a tree mask")


def test_split_k_fills_the_gpu_only_when_tiles_do_not():
    split_count = tree_attention.split_count
    assert split_count(num_programs=8, max_kv_len=16384, sm_count=132) == 32  # batch 1, long context: split
    assert split_count(num_programs=8, max_kv_len=600, sm_count=132) == 2  # short context: >= 256 keys a split
    assert split_count(num_programs=1024, max_kv_len=16384, sm_count=132) == 1  # enough programs already
    assert all(s & (s - 1) == 0 for s in (split_count(p, 5000, 132) for p in range(1, 300)))


def test_metadata_is_built_once_per_forward_and_packs_tree_bits():
    gen = torch.Generator().manual_seed(1)
    cache, rows = _cache_with_prefixes([4, 40], 4, 1, 16, torch.float32, gen)
    own = torch.zeros(40, 40, dtype=torch.bool)
    own[:, 0] = True
    own[torch.arange(40), torch.arange(40)] = True
    own[39, 33] = True
    plan, q = _packed_forward(cache, rows, [1, 40], [None, own], 2, 1, 16, torch.float32, gen)
    meta = tree_attention_metadata(plan, q.device, group=2, max_block_m=64)
    assert tree_attention_metadata(plan, q.device, group=2, max_block_m=64) is meta
    assert meta.words == 2 and meta.is_causal.tolist() == [1, 0]
    words = meta.mask_words[1 + 39].cpu().tolist()  # packed query 40 = tree token 39
    bits = [j for j in range(64) if (words[j // 32] >> (j % 32)) & 1]
    assert bits == [0, 33, 39]
    # each tile stops at the last key any of its queries sees
    assert meta.tile_kv_len.tolist()[0] == 4 + 1
    layer = cache.layer(0)
    out = triton_tree_attention(q, layer.keys, layer.values, plan, 0.25)
    _assert_close(out, paged_attention_reference(q, layer, plan, 0.25), torch.float32, "40-node tree over 2 words")


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    heads=st.sampled_from([(1, 1), (3, 1), (4, 2), (6, 2)]),
    num_rows=st.integers(1, 3),
    splits=st.integers(1, 4),
)
def test_property_random_trees_and_block_tables_match_the_dense_oracle(data, block_size, heads, num_rows, splits):
    hq, hkv = heads
    seed = data.draw(st.integers(0, 2**16), label="seed")
    gen = torch.Generator().manual_seed(seed)
    prefixes = data.draw(st.lists(st.integers(0, 45), min_size=num_rows, max_size=num_rows), label="prefixes")
    sizes = data.draw(st.lists(st.integers(1, 12), min_size=num_rows, max_size=num_rows), label="tree sizes")
    kinds = data.draw(st.lists(st.sampled_from(["tree", "causal"]), min_size=num_rows, max_size=num_rows))
    cache, rows = _cache_with_prefixes(prefixes, block_size, hkv, 16, torch.float32, gen)
    masks = [_random_tree(n - 1, gen).ancestor_mask() if k == "tree" else None for n, k in zip(sizes, kinds)]
    plan, q = _packed_forward(cache, rows, sizes, masks, hq, hkv, 16, torch.float32, gen)
    layer = cache.layer(0)
    out = triton_tree_attention(q, layer.keys, layer.values, plan, 0.4, num_splits=splits)
    _assert_close(out, _dense_expected(q, cache, plan, 0.4, masks), torch.float32, f"prefixes={prefixes} sizes={sizes}")


# ------------------------------------------------------------------------------------------------ commit copy
@pytest.mark.parametrize("num_moves", [3, 300], ids=["registers", "scratch"])
@pytest.mark.parametrize(
    "layout", ["same", "v_dim", "dtypes"], ids=["one-group", "k-and-v-dims-differ", "layers-differ-in-dtype"]
)
def test_move_kv_moves_every_layer_and_reads_every_source_before_writing(num_moves, layout):
    gen = torch.Generator().manual_seed(num_moves)
    slots, layers = num_moves + 40, 3
    dtypes = [torch.float32, torch.bfloat16, torch.float32] if layout == "dtypes" else [torch.float32] * layers
    dv = 8 if layout == "v_dim" else 16
    pools = [
        (
            torch.randn(slots, 3, 16, generator=gen).to(DEVICE, dt),
            torch.randn(slots, 3, dv, generator=gen).to(DEVICE, dt),
        )
        for dt in dtypes
    ]
    # a shift by one: every destination but the first is also a source, and some sources come after it
    src = torch.arange(1, num_moves + 1)
    dst = torch.arange(0, num_moves)
    if num_moves > 3:
        order = torch.randperm(num_moves, generator=gen)
        src, dst = src[order], dst[order]
    expected = []
    for k, v in pools:
        k_ref, v_ref = k.clone(), v.clone()
        k_ref.index_copy_(0, dst.to(DEVICE), k_ref.index_select(0, src.to(DEVICE)))
        v_ref.index_copy_(0, dst.to(DEVICE), v_ref.index_select(0, src.to(DEVICE)))
        expected.append((k_ref, v_ref))
    launches = move_kv_triton(pools, src, dst)
    assert launches == {"same": 1, "v_dim": 2, "dtypes": 2}[layout]
    for i, ((k, v), (k_ref, v_ref)) in enumerate(zip(pools, expected)):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref), f"layer {i}"


def test_move_kv_rejects_mismatched_moves():
    k = torch.zeros(8, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="2 sources but 1 destinations"):
        move_kv_triton([(k, k.clone())], torch.tensor([1, 2]), torch.tensor([0]))
    assert move_kv_triton([(k, k.clone())], torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)) == 0


@pytest.mark.parametrize("block_size", [1, 4])
def test_commit_with_triton_copy_equals_torch_copy(block_size, monkeypatch):
    hkv, d = 2, 16
    caches = []
    for _ in range(2):
        g = torch.Generator().manual_seed(block_size)
        cache, rows = _cache_with_prefixes([6, 11], block_size, hkv, d, torch.bfloat16, g)
        _packed_forward(cache, rows, [9, 5], [None, None], 2, hkv, d, torch.bfloat16, g)
        caches.append((cache, rows))
    accepted = [[0, 2, 3, 7, 8], [0, 4]]  # positions move inside and across blocks
    calls = _count_calls(monkeypatch, "move_kv_triton", move_kv)
    for (cache, rows), use_triton in zip(caches, (False, True)):
        cache.commit(rows, accepted, use_triton=use_triton)
    assert len(calls) == 1
    (c_torch, rows), (c_triton, _) = caches
    assert c_torch.lengths == c_triton.lengths == [11, 13]
    for r in rows:
        kt, vt = c_torch.layer(0).gather(r, c_torch.lengths[r])
        kk, vk = c_triton.layer(0).gather(r, c_triton.lengths[r])
        assert torch.equal(kt, kk) and torch.equal(vt, vk), f"row {r}: committed K/V differ"


def test_commit_moves_kv_with_triton_when_requested(monkeypatch):
    cache = PagedCache(block_size=2, num_layers=1)
    (r,) = cache.add_rows(1)
    plan = build_plan(cache, [r], [4], torch.arange(4), [None], DEVICE)
    kv = torch.arange(8.0, device=DEVICE).view(4, 1, 2)
    cache.layer(0).write(plan.slot_mapping, kv, kv.clone())
    calls = _count_calls(monkeypatch, "move_kv_triton", move_kv)
    cache.commit([r], [[0, 3]], use_triton=True)  # position 3 moves to position 1
    assert calls and cache.lengths[r] == 2
    assert cache.layer(0).gather(r, 2)[0].tolist() == [[[0.0, 1.0]], [[6.0, 7.0]]]


# ------------------------------------------------------------------------------------------------ whole model
def _model_logits_with_tree(model, backend_name):
    """Prefill two rows of different lengths, then verify a tree on row 0 and a chain on row 1 in one forward."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (n,), generator=gen) for n in (11, 6)]
    tree = _random_tree(6, gen)
    chain = DraftTree.chain([5, 9, 17])
    q_lens = [p.numel() for p in prompts]
    positions = torch.cat([torch.arange(n) for n in q_lens])
    with torch.no_grad(), PlannedModel(model, backend=backend_name, block_size=4) as target:
        rows = target.add_rows(2)
        prefill = target.forward(rows, torch.cat(prompts).to(DEVICE), positions.to(DEVICE), q_lens).logits
        target.commit_chunks(rows, q_lens)
        roots = [int(prefill[q_lens[0] - 1].argmax()), int(prefill[-1].argmax())]
        ids = torch.cat([torch.tensor([roots[0]]), torch.randint(3, 97, (6,), generator=gen)])
        ids = torch.cat([ids, torch.tensor([roots[1], 5, 9, 17])])
        positions = torch.cat([tree.positions(q_lens[0]), chain.positions(q_lens[1])])
        masks = [tree.ancestor_mask(), chain.ancestor_mask()]
        verify = target.forward(rows, ids.to(DEVICE), positions.to(DEVICE), [7, 4], masks).logits
    return prefill, verify


def _count_calls(monkeypatch, name, module=tree_attention):
    """Wrap ``module.<name>`` so a test can check that the Triton path really ran."""
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _tiny_model(arch: str):
    """A tiny random ``arch`` on DEVICE; gpt_oss's attention sinks drawn large enough to matter (its init draws them
    with std 0.02, next to scores of about +-1)."""
    model = tiny_causal_lm(arch).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            sinks = getattr(layer.self_attn, "sinks", None)
            if sinks is not None:
                sinks.copy_(torch.randn(sinks.shape, generator=gen) * 2)
    return model


def _kernel_layers(model) -> int:
    """Attention layers the Triton kernel serves: those without a sliding window (which runs on the torch path)."""
    return sum(getattr(layer.self_attn, "sliding_window", None) is None for layer in model.model.layers)


def _kernel_sinks(monkeypatch) -> list[bool]:
    """Per call of the Triton kernel from now on, whether it got attention sinks (the kernel still runs)."""
    seen = []
    original = tree_attention.paged_tree_attention

    def counted(*args, sinks=None, **kwargs):
        seen.append(sinks is not None)
        return original(*args, sinks=sinks, **kwargs)

    monkeypatch.setattr(tree_attention, "paged_tree_attention", counted)
    return seen


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"], ids=["llama", "gpt_oss-sinks"])
def test_model_forward_with_a_tree_gives_the_same_logits_on_triton_and_torch(arch, monkeypatch):
    model = _tiny_model(arch)
    calls = _kernel_sinks(monkeypatch)
    config_before = repr(model.config.to_dict())
    pre_torch, ver_torch = _model_logits_with_tree(model, "torch")
    assert not calls
    pre_triton, ver_triton = _model_logits_with_tree(model, "triton")
    assert repr(model.config.to_dict()) == config_before  # the model is never switched
    assert len(calls) == 2 * _kernel_layers(model) > 0
    assert set(calls) == {arch == "gpt_oss"}, calls  # gpt_oss's sinks reach the kernel, llama passes none
    torch.testing.assert_close(pre_triton, pre_torch, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ver_triton, ver_torch, atol=1e-4, rtol=1e-4)


class _OracleTreeProposer(Proposer):
    """Drafts, at every level, a wrong sibling before the right token (known from a reference run), so accepted
    nodes are not contiguous and committing them moves K/V inside and across blocks."""

    def __init__(self, reference: torch.Tensor, depth: int = 3):
        self.reference = reference  # [B, W + G] greedy output of vanilla generate
        self.depth = depth

    def propose(self, rows):
        trees = []
        for r in rows:
            n = r.tokens.numel()
            right = self.reference[r.row, n : n + min(self.depth, r.max_depth)].tolist()
            tokens, parent, last = [], [], -1
            for tok in right:
                tokens += [(tok + 1) % 97, tok]
                parent += [last, last]
                last = len(tokens) - 1
            trees.append(DraftTree.from_parents(torch.tensor(tokens, dtype=torch.long), parent))
        return trees


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"], ids=["llama", "gpt_oss-sinks"])
def test_speculative_generate_on_triton_matches_vanilla_greedy(arch, monkeypatch):
    model = _tiny_model(arch)
    ids = torch.tensor([[1, 5, 7, 11, 13, 17, 19], [0, 0, 0, 1, 23, 29, 31]], device=DEVICE)
    attention_mask = (torch.arange(7) >= torch.tensor([[0], [3]])).long().to(DEVICE)
    expected = model.generate(ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    monkeypatch.delenv("HF_SPECDEC_ATTENTION", raising=False)  # the default dispatch: CUDA, or the interpreter
    attention_calls = _kernel_sinks(monkeypatch)
    launches = []
    original_move = move_kv.move_kv_triton

    def move_counted(pools, src, dst):
        launches.append((len(pools), original_move(pools, src, dst)))
        return launches[-1][1]

    monkeypatch.setattr(move_kv, "move_kv_triton", move_counted)
    out = model.generate(
        ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False, assistant=_OracleTreeProposer(expected)
    )
    for b in range(ids.shape[0]):
        got, want = out[b].tolist(), expected[b].tolist()
        first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
        assert got == want, f"row {b}: first differing token at {first}: {got} vs {want}"
    assert attention_calls and launches, "the speculative loop did not run the Triton kernels"
    assert set(attention_calls) == {arch == "gpt_oss"}, "gpt_oss's attention sinks should reach the kernel"
    # every commit moves K and V of all layers in one launch
    assert all(layers == model.config.num_hidden_layers and n == 1 for layers, n in launches), launches


# ------------------------------------------------------------------------------------------------ benchmark
def test_kernel_benchmark_dry_run_writes_markdown_and_json(tmp_path):
    from hf_specdec.bench.kernels import run_kernel_bench

    if DEVICE != "cpu":
        pytest.skip("the dry run is the CPU-interpreter path")
    report = run_kernel_bench(tmp_path, dry_run_cpu=True)
    (row,) = report["attention"]
    assert row["times_us"]["ours"] is not None and row["max_abs_err"]["ours"] < 1e-5, row
    assert report["verify_curve"]["max_abs_logit_diff_largest_tree"] < 1e-4
    assert (tmp_path / "kernels.md").read_text().startswith("# hf-specdec kernel benchmark")
    assert (tmp_path / "kernels.json").exists()


def test_kernel_benchmark_refuses_without_a_gpu(capsys):
    from hf_specdec.bench.kernels import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["unused-out-dir"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_specdec.kernels import move_kv as mv
from hf_specdec.kernels import tree_attention as ta


def compile_kernel(fn, pointer_types, constexprs, num_warps, num_stages=3):
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = "*" + pointer_types[name] if name in pointer_types else "fp32" if name == "scale_log2" else "i32"
        if name in pointer_types or (name.startswith("stride") and name != "stride_bt"):
            attrs[(i,)] = [["tt.divisibility", 16]]  # what the launcher specialises on for aligned tensors
    source = ASTSource(fn, signature, constexprs, attrs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def attention(dt, head_dim, group, block_m, split, page, warps, sinks=False):
    ptrs = {n: dt for n in ("Q", "K", "V", "Out")}
    ptrs.update({n: "fp32" for n in ("OPart", "MPart", "LPart", "Sinks")})
    ptrs.update({n: "i32" for n in ("BlockTables", "CuSeqlens", "PrefixLens", "IsCausal", "MaskWords", "TileRow",
                                    "TileQStart", "TileKvLen")})
    consts = dict(GROUP=group, TOKENS_PER_TILE=block_m // group, PAGE=page, HEAD_DIM=head_dim, BLOCK_M=block_m,
                  BLOCK_N=64 if dt != "fp32" else 32, BLOCK_D=triton.next_power_of_2(head_dim), SPLIT_K=split,
                  HAS_SINKS=sinks, DOT_PRECISION="ieee" if dt == "fp32" else "tf32", DOT_FP32=False)
    compile_kernel(ta._paged_tree_attention_kernel, ptrs, consts, warps)


attention("fp16", 64, 3, 16, False, 16, 4)   # SmolLM2 decode
attention("bf16", 128, 4, 64, True, 16, 8)   # Llama-3-8B tree, split-K
attention("fp32", 64, 1, 16, False, 1, 4)    # fp32, block size 1
attention("bf16", 64, 8, 64, False, 16, 8, sinks=True)   # gpt-oss (64/8 heads, dim 64) with sinks, one pass
attention("bf16", 64, 8, 64, True, 16, 8, sinks=True)    # and split-K
for sinks in (False, True):
    compile_kernel(ta._merge_splits_kernel,
                   {"Out": "bf16", "OPart": "fp32", "MPart": "fp32", "LPart": "fp32", "Sinks": "fp32"},
                   dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32, HAS_SINKS=sinks), 4)
for single in (True, False):
    compile_kernel(mv._move_kv_kernel, {"Pools": "i64", "Scratch": "bf16", "Src": "i64", "Dst": "i64"},
                   dict(D=128, DTYPE=mv.tl.bfloat16, BLOCK_R=16 if single else 64, BLOCK_C=128, SINGLE_CHUNK=single), 4)
print("compiled")
"""


def test_kernels_compile_for_an_h100_without_a_gpu():
    """The interpreter accepts programs the GPU compiler rejects (types of loop-carried values, names): compile
    every kernel for sm_90 in a process without TRITON_INTERPRET (ptxas ships with triton; no GPU needed)."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def _kernel_plans(monkeypatch, what) -> list:
    """``what(plan)`` of every plan the Triton kernel serves from now on (the kernel still runs)."""
    seen = []
    original = backend.triton_tree_attention

    def counted(query, k_pool, v_pool, plan, scale, **kwargs):
        seen.append(what(plan))
        return original(query, k_pool, v_pool, plan, scale, **kwargs)

    monkeypatch.setattr(backend, "triton_tree_attention", counted)
    return seen


def test_draft_model_levels_with_pending_tokens_run_on_triton_and_stay_greedy_exact(monkeypatch):
    """A draft model expands its tree one level per forward over *pending* tokens; those forwards use the kernel."""
    import hf_specdec

    model = tiny_causal_lm("llama").to(DEVICE)
    ids = torch.tensor([[1, 5, 7, 11, 13, 17, 19]], device=DEVICE)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    monkeypatch.setenv("HF_SPECDEC_ATTENTION", "triton")
    # every level drafted, not planned from the draft's measured cost (which starts at one level per step and here,
    # a draft as costly as the target, stops drafting): this test is about the kernel on multi-level expansions
    monkeypatch.setenv("HF_SPECDEC_PROPOSING_COST", "0")
    pending = _kernel_plans(monkeypatch, lambda plan: plan.has_pending)
    assistant = hf_specdec.DraftModelAssistant(model, depth=3, top_k=3, num_nodes=8)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, assistant=assistant)
    assert out[0].tolist() == expected[0].tolist()
    assert any(pending), "no forward with pending tokens reached the Triton kernel"


@pytest.mark.parametrize("batch", [1, 2])
def test_a_layer_skip_draft_over_the_target_cache_runs_on_triton_and_stays_greedy_exact(monkeypatch, batch):
    """A draft of the target's own first layers writes its levels as pending tokens into the target's slot-major
    cache (`ProposerSetup.target_cache`); the kernel serves them and the target's verify forward writes over them."""
    import hf_specdec

    model = tiny_causal_lm("llama", num_layers=3).to(DEVICE)
    ids = torch.tensor([[1, 5, 7, 11, 13, 17, 19], [1, 4, 4, 9, 13, 2, 8]][:batch], device=DEVICE)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    monkeypatch.setenv("HF_SPECDEC_ATTENTION", "triton")
    monkeypatch.setenv("HF_SPECDEC_PROPOSING_COST", "0")  # every level drafted (see the test above)
    pending = _kernel_plans(monkeypatch, lambda plan: plan.has_pending)
    draft = hf_specdec.draft_model_from_layers(model, 2)
    assistant = hf_specdec.DraftModelAssistant(draft, depth=3, top_k=2, num_nodes=6)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, assistant=assistant, return_dict_in_generate=True)
    assert out.sequences.tolist() == expected.tolist()
    assert any(pending) and out.spec_stats.drafted_tokens > 0


def test_the_interpreter_probe_passes_here_and_its_failure_is_a_clear_error(monkeypatch):
    if tree_attention.INTERPRETED:
        assert tree_attention._interpreter_runs_scalar_ranges()  # the stack CI installs runs the kernels
    monkeypatch.setattr(tree_attention, "INTERPRETED", True)
    monkeypatch.setattr(tree_attention, "_LANG_INTERPRETED", True)
    monkeypatch.setattr(tree_attention, "_interpreter_runs_scalar_ranges", lambda: False)
    cache = PagedCache(block_size=4, num_layers=1)
    (r,) = cache.add_rows(1)
    plan = build_plan(cache, [r], [2], torch.arange(2), [None], DEVICE)
    pool = torch.zeros(4, 4, 1, 16)
    with pytest.raises(RuntimeError, match="numpy<2.4 or a newer triton"):
        triton_tree_attention(torch.zeros(2, 1, 16), pool, pool, plan, 0.25)


def test_short_single_row_decodes_fall_back_to_sdpa_and_stay_greedy_exact(monkeypatch):
    """A Triton call serves one row decoding one token over few keys with SDPA (the torch path); trees and batches
    keep the kernel; the output is vanilla's either way."""
    import hf_specdec
    from hf_specdec.bench.methods import NullAssistant

    model = tiny_causal_lm("llama").to(DEVICE)
    ids = torch.tensor([[1, 5, 7, 11, 13, 17, 19]], device=DEVICE)
    expected = model.generate(ids, max_new_tokens=10, do_sample=False)
    monkeypatch.setenv("HF_SPECDEC_ATTENTION", "triton")
    kernel_rows = _kernel_plans(monkeypatch, lambda plan: (plan.num_rows, int(plan.q_lens.max())))
    for keys, decodes_on_kernel in (("0", True), ("4096", False)):
        monkeypatch.setenv("HF_SPECDEC_SDPA_DECODE_KEYS", keys)
        kernel_rows.clear()
        out = model.generate(ids, max_new_tokens=10, do_sample=False, assistant=NullAssistant(), tree_budget=False)
        assert out[0].tolist() == expected[0].tolist()
        assert ((1, 1) in kernel_rows) == decodes_on_kernel, (keys, kernel_rows)
        assert kernel_rows, "the prefill (7 tokens) runs the kernel"
    tree = hf_specdec.NgramAssistant()
    kernel_rows.clear()
    out = model.generate(ids, max_new_tokens=10, do_sample=False, assistant=tree, tree_budget=False)
    assert out[0].tolist() == expected[0].tolist()
    monkeypatch.setenv("HF_SPECDEC_SDPA_DECODE_KEYS", "many")
    with pytest.raises(ValueError, match="HF_SPECDEC_SDPA_DECODE_KEYS"):
        model.generate(ids, max_new_tokens=2, do_sample=False, assistant=NullAssistant())
