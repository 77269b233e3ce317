"""KV cache layers that share memory: one registered region per tensor address, covering every layer in it.

Under vLLM's hybrid KV cache manager one layer of each KV cache group shares a tensor (block ids are unique across
groups, so block ``b``'s page belongs to whichever group holds ``b``), and a Mamba / linear-attention layer's state
may fill less of its page than an attention layer's KV. A region's geometry is then the union of its layers' runs:
a block moves, is checksummed and pooled as every byte any of its layers uses. Without HMA, layers that share a
tensor (cross-layer KV sharing) have the same runs and the union is one layer's.
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.vllm.layout import merge_scaled
from pdserve.vllm.params import LayerGeometry


def join(region: LayerGeometry, layer: LayerGeometry) -> LayerGeometry:
    """``region`` (named after the first layer at its address) widened to also cover ``layer``'s runs."""
    if layer.block_stride != region.block_stride:
        raise ValueError(f"layers {region.name} and {layer.name} share a KV cache tensor with block strides "
                         f"{region.block_stride} B and {layer.block_stride} B; unsupported KV layout")
    if layer.runs == region.runs and layer.scales == region.scales:
        return region
    if any(layer.run_scales) or any(region.run_scales):
        raise ValueError(f"layers {region.name} and {layer.name} share a KV cache tensor with different runs that "
                         "depend on the block count; unsupported KV layout")
    merged = merge_scaled([(o, n, 0) for o, n in region.block_runs + layer.block_runs])
    runs = _disjoint(tuple((o, n) for o, n, _ in merged))
    interior = "|".join(sorted(set(region.interior.split("|")) | {layer.interior}))
    return replace(region, runs=runs, block_bytes=sum(n for _, n in runs), scales=(), interior=interior)


def _disjoint(runs: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """Sorted runs with overlaps folded together."""
    out: list[list[int]] = []
    for off, n in sorted(runs):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return tuple((o, n) for o, n in out)
