import pytest
import torch

from hf_specdec import DraftTree
from hf_specdec.generation.tree import pack_trees


def test_chain_has_consecutive_parents_and_depths():
    t = DraftTree.chain([4, 5, 6])
    assert t.parent.tolist() == [-1, 0, 1]
    assert t.depth.tolist() == [1, 2, 3]
    assert t.positions(10).tolist() == [10, 11, 12, 13]


def test_ancestor_mask_marks_self_ancestors_and_root():
    t = DraftTree.from_parents([1, 2, 3, 4], [-1, -1, 0, 2])
    a = t.ancestor_mask().int().tolist()
    assert a == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ]
    assert t.paths() == [[1], [0, 2, 3]]


def test_parent_must_precede_child():
    with pytest.raises(ValueError, match="parents must precede"):
        DraftTree.from_parents([1, 2], [1, -1])


def test_medusa_choices_take_ranked_tokens_per_depth():
    topk = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    t = DraftTree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 2]], topk)
    assert t.tokens.tolist() == [10, 11, 20, 21, 20, 32]
    assert t.parent.tolist() == [-1, -1, 0, 0, 1, 2]
    with pytest.raises(ValueError, match="no parent path"):
        DraftTree.from_choices([[0, 0]], topk)


def test_dedup_merges_duplicate_siblings_and_their_subtrees():
    t = DraftTree.from_parents([7, 7, 8, 9, 8], [-1, -1, 0, 1, 1])
    d = t.dedup_siblings()
    assert d.tokens.tolist() == [7, 8, 9]
    assert d.parent.tolist() == [-1, 0, 0]


def test_from_paths_builds_trie():
    t = DraftTree.from_paths([[1, 2, 3], [1, 2, 4], [5]])
    assert t.tokens.tolist() == [1, 2, 3, 4, 5]
    assert t.parent.tolist() == [-1, 0, 1, 1, -1]


def test_subtree_keep_rejects_orphans():
    t = DraftTree.chain([1, 2, 3])
    assert t.subtree_keep(t.depth <= 2).tokens.tolist() == [1, 2]
    with pytest.raises(ValueError, match="parent was dropped"):
        t.subtree_keep(torch.tensor([False, True, True]))


def test_pack_trees_concatenates_rows():
    p = pack_trees([100, 200], [DraftTree.chain([1, 2]), DraftTree.empty()])
    assert p.tokens.tolist() == [100, 1, 2, 200]
    assert p.depth.tolist() == [0, 1, 2, 0]
    assert p.cu_seqlens.tolist() == [0, 3, 4]


@pytest.mark.parametrize("roots_as_tensor", [False, True])
def test_pack_trees_of_empty_trees_pack_the_roots_as_the_general_path_does(roots_as_tensor):
    """A step that drafts nothing packs each row's root alone (a shortcut past the array bookkeeping); its fields are
    those the general path gives a root: its own parent, depth 0, its own mask bit, position = the row's length."""
    roots = torch.tensor([7, 8, 9]) if roots_as_tensor else [7, 8, 9]
    fast = pack_trees(roots, [DraftTree.empty()] * 3, base=[4, 10, 0])
    general = pack_trees([7, 5, 8, 9], [DraftTree.empty(), DraftTree.chain([1]), DraftTree.empty(), DraftTree.empty()])
    assert fast.tokens.tolist() == [7, 8, 9] and fast.tokens.dtype == torch.long
    assert fast.depth.tolist() == [0, 0, 0] and fast.positions.tolist() == [4, 10, 0]
    assert fast.parent.tolist() == [0, 1, 2]
    assert fast.cu_seqlens.tolist() == [0, 1, 2, 3] and fast.q_lens.tolist() == [1, 1, 1]
    assert (fast.width, fast.depth_bound, fast.total) == (1, 0, 3)
    roots_of_general = [0, 3, 4]  # packed positions of the general pack's empty rows' roots
    assert general.parent[roots_of_general].tolist() == roots_of_general  # a root is its own parent there too
    assert fast.ancestor_bits().tolist() == [[1], [1], [1]] == general.ancestor_bits()[roots_of_general, :1].tolist()
    assert fast.ancestor_masks().tolist() == [[True]] * 3
