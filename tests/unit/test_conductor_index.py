import msgpack
import pytest

from pdserve.conductor.events import EventTranslator, decode_batch
from pdserve.conductor.index import PrefixIndex
from pdserve.hashing import block_hashes


def test_store_remove_clear_and_longest_prefix():
    ix = PrefixIndex()
    k = [11, 12, 13, 14]
    ix.stored("a", k[:3])
    ix.stored("b", k[:1])
    ix.stored("c", [12, 13])  # holds later blocks but not the first: no usable prefix
    assert ix.prefix_lengths(k) == {"a": 3, "b": 1}
    ix.removed("a", [12])
    assert ix.prefix_lengths(k) == {"a": 1, "b": 1}
    ix.stored("a", [12, 14])
    assert ix.prefix_lengths(k) == {"a": 4, "b": 1}
    ix.cleared("a")
    assert ix.prefix_lengths(k) == {"b": 1}
    assert len(ix) == 3 and ix.blocks_of("a") == 0  # 11 (b), 12 and 13 (c)
    ix.cleared("b")
    ix.cleared("c")
    assert len(ix) == 0 and ix.prefix_lengths(k) == {}


def test_prefix_lengths_empty_and_unknown():
    ix = PrefixIndex()
    assert ix.prefix_lengths([]) == {}
    ix.stored("a", [1])
    assert ix.prefix_lengths([2, 1]) == {}
    ix.removed("zzz", [1])  # unknown holder: no-op
    assert ix.prefix_lengths([1]) == {"a": 1}


def _stored(hashes, parent, tokens, bs):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": bs, "lora_id": None, "medium": "GPU", "lora_name": None}


def test_translator_rekeys_vllm_events_with_our_hash():
    bs = 4
    toks = list(range(12))
    ours = block_hashes(toks, bs)
    tr = EventTranslator(bs)
    up = tr.apply([_stored([b"h0", b"h1"], None, toks[:8], bs)])
    assert up.stored == ours[:2] and not up.cleared
    up = tr.apply([_stored([b"h2"], b"h1", toks[8:12], bs)])  # child of an earlier event
    assert up.stored == [ours[2]]
    up = tr.apply([{"type": "BlockRemoved", "block_hashes": [b"h1", b"unknown"], "medium": None}])
    assert up.removed == [ours[1]]
    up = tr.apply([_stored([b"x"], b"never-seen", toks[:4], bs)])
    assert up.stored == [] and up.skipped == 1
    up = tr.apply([_stored([b"y"], None, toks[:4], 8)])  # another block size: not comparable
    assert up.skipped == 1
    up = tr.apply([{"type": "AllBlocksCleared"}])
    assert up.cleared and tr.keys == {}


def test_translator_sequence_gap_and_restart():
    tr = EventTranslator(4)
    assert tr.sequence(0) is False
    assert tr.sequence(1) is False
    tr.keys[b"a"] = 1
    assert tr.sequence(5) is True and tr.keys == {}
    assert tr.sequence(0) is True  # publisher restarted


def test_decode_batch():
    payload = msgpack.packb([1.5, [{"type": "AllBlocksCleared"}], None])
    assert decode_batch(payload) == [{"type": "AllBlocksCleared"}]
    with pytest.raises(ValueError):
        decode_batch(b"\xc1garbage")
    with pytest.raises(ValueError):
        decode_batch(msgpack.packb({"a": 1}))


def test_translator_ops_keep_event_order():
    from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel

    bs = 4
    toks = list(range(8))
    ours = block_hashes(toks, bs)
    tr = EventTranslator(bs)
    up = tr.apply([_stored([b"h0", b"h1"], None, toks, bs),
                   {"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": None}])
    assert up.ops == [("stored", ours, "device"), ("removed", [ours[1]], "device")]
    c = Conductor(ConductorConfig(block_size=bs), OnlineCostModel(1))
    up.apply_to("w", c)
    assert c.index.prefix_lengths(ours) == {"w": 1}  # stored then removed: block 1 is gone


def test_translator_keys_salted_and_adapter_blocks_in_their_own_domain():
    """A salted (or LoRA) block is keyed from domain_root(salt, lora), as the router keys that request's prompt:
    equal tokens under another salt share no key."""
    from pdserve.hashing import domain_root

    bs = 4
    toks = list(range(8))
    tr = EventTranslator(bs)
    ev = _stored([b"s0", b"s1"], None, toks, bs)
    ev["extra_keys"] = [["salt-a"], None]
    up = tr.apply([ev])
    assert up.stored == block_hashes(toks, bs, domain_root("salt-a"))
    assert not set(up.stored) & set(block_hashes(toks, bs)) & set(block_hashes(toks, bs, domain_root("salt-b")))
    child = _stored([b"s2"], b"s1", list(range(8, 12)), bs)  # the salt is only in the first block's keys
    assert tr.apply([child]).stored == block_hashes(list(range(12)), bs, domain_root("salt-a"))[2:]
    lo = _stored([b"l0", b"l1"], None, toks, bs)
    lo["lora_name"], lo["extra_keys"] = "ad", [["ad", "salt-a"], ["ad"]]
    assert tr.apply([lo]).stored == block_hashes(toks, bs, domain_root("salt-a", "ad"))
    for extra in ([["salt-a", "mm-hash"], None], [None, ["x"]]):  # multimodal or unknown extra keys: skipped
        odd = _stored([b"o0", b"o1"], None, toks, bs)
        odd["extra_keys"] = extra
        up = tr.apply([odd])
        assert up.stored == [] and up.skipped == 2


def test_domain_root_separates_salt_and_adapter():
    from pdserve.hashing import ROOT_KEY, domain_root

    assert domain_root() == domain_root(None, "") == ROOT_KEY
    roots = {domain_root("a"), domain_root("b"), domain_root(None, "a"), domain_root("a", "a"), domain_root("ab"),
             domain_root("a", "b")}
    assert len(roots) == 6 and ROOT_KEY not in roots
