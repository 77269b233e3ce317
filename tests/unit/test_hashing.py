import pytest

from pdserve.hashing import ROOT_KEY, block_hashes, block_key


def test_full_blocks_only_and_chained():
    toks = list(range(300))
    keys = block_hashes(toks, 128)
    assert len(keys) == 2  # 44 trailing tokens have no key
    assert keys[0] == block_key(ROOT_KEY, toks[:128])
    assert keys[1] == block_key(keys[0], toks[128:256])


def test_equal_prefixes_equal_keys_and_divergence_propagates():
    a = list(range(512))
    b = a[:200] + [7] + a[201:]
    ka, kb = block_hashes(a, 128), block_hashes(b, 128)
    assert ka[0] == kb[0]
    assert all(x != y for x, y in zip(ka[1:], kb[1:]))  # block 1 differs, so every later key differs


def test_same_block_different_parent_differs():
    blk = [5] * 16
    assert block_key(1, blk) != block_key(2, blk)


def test_keys_are_uint64_and_stable():
    keys = block_hashes(list(range(64)), 16)
    assert all(0 <= k < 2**64 for k in keys)
    assert keys == block_hashes(list(range(64)), 16)
    assert block_hashes(list(range(64)), 16, parent=keys[0])[0] != keys[0]


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)
