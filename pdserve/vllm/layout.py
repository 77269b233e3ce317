"""A layer's KV cache layout as pure data: where each block's bytes lie inside the layer's cache tensor.

vLLM hands the connector one tensor per layer. Which dim indexes blocks comes from vLLM itself:

* vLLM 0.32 (this build): every attention layer's cache is the logical view ``[B, H, N, C]``
  (blocks, kv heads, tokens, content = K and V of one token) whose physical order is the resolved
  ``cache_config.kv_cache_layout`` (``vllm.v1.kv_cache_layout.KVCacheLayout``: LBHNC, LBNHC, LHBNC,
  BLHNC, ...), i.e. ``layer_view_order``; the tensor's strides must agree with it.
* older vLLM backends expose ``get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)``
  (FlashAttention ``[2, B, N, H, D]``, FlashInfer ``[B, 2, H, N, D]``, ...): the blocks dim is the one that
  moves with ``num_blocks``, the tokens dim the one that moves with ``block_size``.

From the blocks dim and the tensor's own shape and strides, :func:`derive_layout` finds the byte stride
between blocks and the contiguous runs of one block (one run when a block's interior is contiguous, two when K
and V live in separate planes, one per head when heads are outside the blocks dim). Nothing here imports
torch or vLLM.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

MAX_RUNS = 1024  # per block per layer: beyond this the layout is too fragmented to move block by block
LOGICAL_BHNC = ("blocks", "heads", "tokens", "content")  # vLLM 0.32 per-layer logical view


class LayoutError(RuntimeError):
    """A layer's KV cache layout the connector cannot move block by block; the message names it."""


@dataclass(frozen=True)
class KVLayout:
    """One layer's KV cache: block ``b``'s bytes are ``[b*block_stride + off, +len)`` for each run."""

    backend: str  # the attention backend vLLM chose (for messages)
    order: str  # vLLM's KVCacheLayout name, or "shape:<dims>" from a backend shape function
    block_dim: int  # which tensor dim indexes blocks
    tokens_dim: int  # which tensor dim indexes the tokens of one (kernel) block
    num_blocks: int
    block_tokens: int  # tokens per kernel block
    block_stride: int  # bytes between consecutive kernel blocks
    runs: tuple[tuple[int, int], ...]  # (byte offset from block start, byte length), ascending
    span: int  # bytes from the tensor's first to one past its last byte
    interior: str = ""  # logical dims (B = blocks) in physical order: what a block's bytes mean
    scales: tuple[int, ...] = ()  # per run: bytes its offset grows per kernel block of the cache (a V plane
    # after all K blocks sits num_blocks * plane bytes in), so a peer with another block count differs by
    # scale * (its num_blocks - ours)
    shape: tuple[int, ...] = ()  # the tensor's shape and strides (elements): what reshard/head_runs start from
    strides: tuple[int, ...] = ()
    elem: int = 0  # bytes per element
    heads_dim: int = -1  # which dim indexes KV heads (-1: unknown, no head slicing)
    phys: tuple[int, ...] = ()  # dims in physical order, outermost first (vLLM's layout, else by stride)

    @property
    def block_bytes(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def split(self) -> bool:
        """True when one block is more than one contiguous run (e.g. K and V in separate planes)."""
        return len(self.runs) > 1

    def manager_runs(self, ratio: int) -> tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]]:
        """(stride, runs, scales) of a vLLM block spanning ``ratio`` consecutive kernel blocks."""
        triples = [(k * self.block_stride + off, n, sc) for k in range(ratio)
                   for (off, n), sc in zip(self.runs, self.scales)]
        merged = merge_scaled(triples)
        return self.block_stride * ratio, tuple((o, n) for o, n, _ in merged), tuple(sc for _, _, sc in merged)

    def describe(self) -> str:
        return (f"{self.backend} {self.order} {self.interior} stride {self.block_stride} B, "
                f"{len(self.runs)} run(s)/block of {sorted({n for _, n in self.runs})} B")


def merge_scaled(runs: Sequence[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    """Sort (offset, length, scale) runs and join adjacent ones that move alike with the block count."""
    out: list[list[int]] = []
    for off, n, sc in sorted(runs):
        if out and out[-1][0] + out[-1][1] == off and out[-1][2] == sc:
            out[-1][1] += n
        else:
            out.append([off, n, sc])
    return tuple((o, n, sc) for o, n, sc in out)


def _describe(backend: str, shape: Sequence[int], strides: Sequence[int]) -> str:
    return f"backend {backend}: KV cache shape {tuple(shape)} strides {tuple(strides)}"


def block_runs(shape: Sequence[int], strides: Sequence[int], elem: int, block_dim: int,
               backend: str = "?") -> tuple[tuple[int, int, int], ...]:
    """Contiguous byte runs (offset from block 0's first byte, length, scale) of a tensor with these
    shape/strides (in elements), blocks along ``block_dim``. A dim laid out outside the blocks dim has a
    stride proportional to the block count (vLLM allocates one dense buffer and permutes it): its share of a
    run's offset is ``scale`` bytes per kernel block."""
    dims = sorted(((strides[i], shape[i]) for i in range(len(shape)) if i != block_dim and shape[i] > 1),
                  reverse=True)
    run = 1  # elements in one contiguous run, grown from the innermost dim outwards
    while dims and dims[-1][0] == run:
        run *= dims.pop()[1]
    if run == 1 and dims:
        raise LayoutError(f"{_describe(backend, shape, strides)}: a block's innermost dim is strided; "
                          "unsupported KV layout")
    nb, bstride = shape[block_dim], strides[block_dim]
    for st, _ in dims:
        if st > bstride and st % nb:
            raise LayoutError(f"{_describe(backend, shape, strides)}: stride {st} of a dim outside the blocks "
                              f"dim is not a multiple of the {nb} blocks; unknown KV layout")
    outer = [[(i * st, i * st // nb if st > bstride else 0) for i in range(n)] for st, n in dims]
    count = math.prod(n for _, n in dims)
    if count > MAX_RUNS:
        raise LayoutError(f"{_describe(backend, shape, strides)}: one block is {count} separate runs "
                          f"(over {MAX_RUNS}); unsupported KV layout")
    runs = merge_scaled([(sum(o for o, _ in combo) * elem, run * elem, sum(c for _, c in combo) * elem)
                         for combo in itertools.product(*outer)])
    for (a, n, _), (b, _, _) in zip(runs, runs[1:]):
        if a + n > b:
            raise LayoutError(f"{_describe(backend, shape, strides)}: a block's runs overlap")
    return runs


def _non_overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    extent = 1
    for s, n in sorted((s, n) for s, n in zip(strides, shape) if n > 1):
        if s < extent:
            return False
        extent = s * (n - 1) + extent
    return True


def derive_layout(shape: Sequence[int], strides: Sequence[int], elem: int, block_dim: int, tokens_dim: int,
                  backend: str, order: str, heads_dim: int = -1, phys: Sequence[int] = ()) -> KVLayout:
    """The :class:`KVLayout` of a tensor (shape/strides in elements) with blocks along ``block_dim``."""
    shape, strides = tuple(int(x) for x in shape), tuple(int(x) for x in strides)
    if len(shape) != len(strides) or not 0 <= block_dim < len(shape) or not 0 <= tokens_dim < len(shape):
        raise LayoutError(f"{_describe(backend, shape, strides)}: blocks dim {block_dim} / tokens dim "
                          f"{tokens_dim} out of range; unknown KV layout")
    if any(s <= 0 for s, n in zip(strides, shape) if n > 1) or not _non_overlapping(shape, strides):
        raise LayoutError(f"{_describe(backend, shape, strides)}: zero, negative or overlapping strides; "
                          "unknown KV layout")
    scaled = block_runs(shape, strides, elem, block_dim, backend)
    span = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * elem
    return KVLayout(backend, order, block_dim, tokens_dim, shape[block_dim], shape[tokens_dim],
                    strides[block_dim] * elem, tuple((o, n) for o, n, _ in scaled), span,
                    interior(shape, strides, block_dim), tuple(sc for _, _, sc in scaled), shape, strides, elem,
                    heads_dim, tuple(phys) or tuple(sorted(range(len(shape)), key=lambda i: (-strides[i], i))))


def interior(shape: Sequence[int], strides: Sequence[int], block_dim: int) -> str:
    """The logical dims in memory order (outermost first), sizes kept and the blocks dim written ``B``:
    equal on P and D iff a block's bytes are arranged alike (NHD vs HND, K/V planes vs joined)."""
    dims = sorted(range(len(shape)), key=lambda i: (-strides[i], i))
    return "[" + ",".join(f"{i}:{'B' if i == block_dim else shape[i]}" for i in dims) + "]"


def layout_from_order(shape: Sequence[int], strides: Sequence[int], elem: int, backend: str, order_name: str,
                      view_order: Sequence[int]) -> KVLayout:
    """vLLM 0.32: the logical ``[B, H, N, C]`` view laid out in ``view_order`` (physical axis order)."""
    if len(shape) != 4 or sorted(view_order) != [0, 1, 2, 3]:
        raise LayoutError(f"{_describe(backend, shape, strides)} under vLLM layout {order_name}: expected "
                          f"the 4-D per-layer view {LOGICAL_BHNC}; unknown KV layout")
    physical = [strides[d] for d in view_order if shape[d] > 1]
    if any(a < b for a, b in zip(physical, physical[1:])):
        raise LayoutError(f"{_describe(backend, shape, strides)}: strides disagree with vLLM's KV cache "
                          f"layout {order_name} (physical order {tuple(view_order)}); unknown KV layout")
    return derive_layout(shape, strides, elem, 0, 2, backend, order_name, heads_dim=1, phys=view_order)


def dims_from_shape_fn(shape_fn: Callable[..., Sequence[int]], shape: Sequence[int], block_size: int,
                       num_kv_heads: int, head_size: int, backend: str) -> tuple[int, int]:
    """(blocks dim, tokens dim) of a backend's ``get_kv_cache_shape``: the dims that move when
    ``num_blocks`` / ``block_size`` do. The tensor's shape must be the function's for its block count."""
    def probe(nb: int, bs: int) -> tuple[int, ...]:
        return tuple(int(x) for x in shape_fn(nb, bs, num_kv_heads, head_size))

    try:
        base, more = probe(1009, block_size), probe(1013, block_size)
        bigger = probe(1009, 2 * block_size)
    except Exception as exc:
        raise LayoutError(f"{_describe(backend, shape, ())}: get_kv_cache_shape failed ({exc})") from None
    bdims = [i for i, (a, b) in enumerate(zip(base, more)) if a != b]
    tdims = [i for i, (a, b) in enumerate(zip(base, bigger)) if a != b]
    if len(bdims) != 1 or len(tdims) != 1 or len(base) != len(shape):
        raise LayoutError(f"{_describe(backend, shape, ())}: get_kv_cache_shape gives {base}; cannot tell "
                          "the blocks/tokens dims; unknown KV layout")
    expect = probe(int(shape[bdims[0]]), block_size)
    if tuple(shape) != expect:
        raise LayoutError(f"{_describe(backend, shape, ())}: not the backend's shape {expect}; unknown KV layout")
    return bdims[0], tdims[0]


def layout_of_tensor(t: Any, backend: Any, vllm_order: Any, block_size: int, num_kv_heads: int,
                     head_size: int) -> KVLayout:
    """The layout of vLLM's cache tensor ``t`` (anything with shape/stride()/element_size())."""
    name = backend.get_name() if hasattr(backend, "get_name") else str(backend or "unknown")
    shape, strides, elem = tuple(t.shape), tuple(t.stride()), t.element_size()
    if backend is not None and hasattr(backend, "get_kv_cache_shape"):
        bdim, tdim = dims_from_shape_fn(backend.get_kv_cache_shape, shape, block_size, num_kv_heads, head_size,
                                        name)
        hdim = heads_dim_from_shape_fn(backend.get_kv_cache_shape, block_size, num_kv_heads, head_size)
        return derive_layout(shape, strides, elem, bdim, tdim, name, f"shape:{shape}", heads_dim=hdim)
    if vllm_order is None:
        raise LayoutError(f"{_describe(name, shape, strides)}: vLLM gave no KV cache layout and the backend no "
                          "get_kv_cache_shape; unknown KV layout")
    return layout_from_order(shape, strides, elem, name, vllm_order.name, vllm_order.layer_view_order)


def heads_dim_from_shape_fn(shape_fn: Callable[..., Sequence[int]], block_size: int, num_kv_heads: int,
                            head_size: int) -> int:
    """The dim of a backend's ``get_kv_cache_shape`` that moves with the KV head count (-1: none found)."""
    try:
        a = tuple(int(x) for x in shape_fn(1009, block_size, max(num_kv_heads, 1), head_size))
        b = tuple(int(x) for x in shape_fn(1009, block_size, max(num_kv_heads, 1) + 6, head_size))
    except Exception:
        return -1
    dims = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return dims[0] if len(dims) == 1 and len(a) == len(b) else -1


# ---- tensor parallelism: a rank's cache holds its KV heads only ----

def _need_heads(kv: KVLayout) -> int:
    if kv.heads_dim < 0 or not kv.shape or not kv.elem:
        raise LayoutError(f"{kv.describe()}: the KV heads dim is unknown; cannot slice heads across "
                          "tensor-parallel ranks")
    return kv.heads_dim


def reshard(kv: KVLayout, heads: int, num_blocks: int) -> KVLayout:
    """The layout of the same arrangement holding ``heads`` KV heads and ``num_blocks`` blocks: what a peer
    rank with another tensor-parallel degree (and block count) has. vLLM allocates each cache as one dense
    buffer and views it, so a dim's stride grows with the sizes of the heads and blocks dims inside it."""
    hdim = _need_heads(kv)
    if heads < 1 or num_blocks < 1:
        raise LayoutError(f"reshard to {heads} heads x {num_blocks} blocks: both must be >= 1")
    pos = {d: i for i, d in enumerate(kv.phys)}
    new = {hdim: heads, kv.block_dim: num_blocks}
    shape, strides = list(kv.shape), []
    for i, st in enumerate(kv.strides):
        scaled = Fraction(st)
        for j, size in new.items():
            if j != i and pos[j] > pos[i]:
                scaled = scaled * size / kv.shape[j]
        if scaled.denominator != 1:
            raise LayoutError(f"{kv.describe()}: stride {st} of dim {i} is not a whole multiple of the heads and "
                              "blocks dims inside it; cannot derive another rank's layout")
        strides.append(int(scaled))
    shape[hdim], shape[kv.block_dim] = heads, num_blocks
    return derive_layout(shape, strides, kv.elem, kv.block_dim, kv.tokens_dim, kv.backend, kv.order, hdim, kv.phys)


def head_runs(kv: KVLayout, head: int, ratio: int = 1) -> tuple[tuple[int, int], ...]:
    """Byte runs (offset from the manager block's start, length) of local KV head ``head`` inside one vLLM
    block of ``ratio`` kernel blocks, NOT merged and in logical order (kernel block, then the dims outside the
    heads dim by logical index), so two ranks with different head counts list matching runs pairwise: the
    i-th run of head h on one rank holds the same tokens and K/V elements as the i-th on the other. Offsets
    are absolute for this layout's block count."""
    hdim = _need_heads(kv)
    if not 0 <= head < kv.shape[hdim]:
        raise LayoutError(f"head {head} out of range: this rank holds {kv.shape[hdim]} KV heads")
    pos = {d: i for i, d in enumerate(kv.phys)}
    inner = sorted((d for d in range(len(kv.shape)) if pos[d] > pos[hdim] and d != kv.block_dim
                    and kv.shape[d] > 1), key=lambda d: kv.strides[d])
    run = 1
    for d in inner:
        if kv.strides[d] != run:
            raise LayoutError(f"{kv.describe()}: one head's elements are not contiguous (dim {d}); cannot "
                              "slice heads")
        run *= kv.shape[d]
    bstride = kv.strides[kv.block_dim]
    outer = [d for d in range(len(kv.shape)) if pos[d] < pos[hdim] and d not in (kv.block_dim, hdim)
             and kv.shape[d] > 1]
    runs = []
    for k in range(ratio):
        for idx in itertools.product(*(range(kv.shape[d]) for d in outer)):
            off = head * kv.strides[hdim] + k * bstride + sum(i * kv.strides[d] for d, i in zip(outer, idx))
            runs.append((off * kv.elem, run * kv.elem))
    return tuple(runs)


def attn_backend(vllm_config: Any, layer: str) -> Any:
    """The attention backend class vLLM chose for ``layer`` (None when vLLM cannot say, e.g. in tests)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        backends = get_current_attn_backends(vllm_config, [layer])
        return backends[0] if backends else None
    except Exception:
        return None
