"""Per-row histograms over a fixed range, and locating ranks/quantiles in them.

Both quantile-balancing modes build one histogram row per expert, sum it over ranks (the
counts are int64, so sums are exact and every rank sees the same numbers), then find where a
given rank falls: capacity mode resolves the boundary bin exactly, dual-bias mode interpolates
inside it (:func:`histogram_quantile`). :func:`bin_of_rank` is the piece both share.
"""

from __future__ import annotations

import torch

__all__ = ["histogram_bins", "flat_counts", "row_offsets", "histogram_counts", "bin_of_rank", "histogram_quantile"]

Bound = float | torch.Tensor


def histogram_bins(values: torch.Tensor, lo: Bound, hi: Bound, num_bins: int,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """int64 bin index of each value in ``num_bins`` equal bins over ``[lo, hi]``; values outside
    the range land in the edge bins. ``scale``: ``num_bins / (hi - lo)`` when the caller already
    holds it (tensor bounds fixed over many calls: two kernels fewer per call)."""
    # Kernel launches dominate on the GPU: skip the shift when lo is a literal 0, and clamp
    # before the int cast (equal to floor-then-clamp, one kernel fewer).
    shifted = values if isinstance(lo, float | int) and lo == 0 else values - lo
    if scale is None:
        scale = num_bins / (hi - lo)
    return (shifted * scale).clamp_(0, num_bins - 1).long()


_ONES: dict[torch.device, torch.Tensor] = {}
_ROW_OFFSETS: dict[tuple, torch.Tensor] = {}


def _int64_one(device: torch.device) -> torch.Tensor:
    """A cached 0-dim int64 ``1`` per device (read only: it is only ever expanded)."""
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.int64, device=device)
    return one


def row_offsets(num_rows: int, num_bins: int, device: torch.device) -> torch.Tensor:
    """Cached int64 ``[num_rows]`` ``arange(num_rows) * num_bins`` (read only)."""
    key = (num_rows, num_bins, device)
    offsets = _ROW_OFFSETS.get(key)
    if offsets is None:
        offsets = _ROW_OFFSETS[key] = torch.arange(0, num_rows * num_bins, num_bins, device=device)
    return offsets


def flat_counts(index: torch.Tensor, size: int) -> torch.Tensor:
    """int64 ``[size]`` counts of the values of ``index`` (all in ``[0, size)``): one
    ``index_add_``, no host sync (CUDA ``bincount`` reads the max back to the host)."""
    flat = index.reshape(-1)
    counts = torch.zeros(size, dtype=torch.int64, device=index.device)
    return counts.index_add_(0, flat, _int64_one(index.device).expand(flat.shape))


def histogram_counts(rows: torch.Tensor, bins: torch.Tensor, num_rows: int, num_bins: int,
                     valid: torch.Tensor | None = None, rows_are_offsets: bool = False) -> torch.Tensor:
    """int64 counts ``[num_rows, num_bins]``: one count at ``(rows[m], bins[m])`` for every ``m``
    where ``valid[m]`` (all when None); ``rows`` broadcasts against ``bins`` and must be in range
    even where invalid. Fixed output shape and no host sync, so it can be all-reduced.
    ``rows_are_offsets``: ``rows`` already holds ``row * num_bins`` (see :func:`row_offsets`)."""
    size = num_rows * num_bins
    flat = bins + (rows if rows_are_offsets else rows * num_bins)
    if valid is None:
        return flat_counts(flat, size).view(num_rows, num_bins)
    # Invalid entries go to a spare copy of the table rather than one spare bin, which would
    # serialise the GPU atomics when most entries are invalid.
    return flat_counts(flat.where(valid, flat + size), 2 * size)[:size].view(num_rows, num_bins)


def bin_of_rank(counts: torch.Tensor, rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (the last dim holds the bins), the bin holding the element of 0-based ascending
    ``rank`` and the number of elements in lower bins. Ranks past the end give the last bin."""
    cum = counts.cumsum(dim=-1)
    last = counts.shape[-1] - 1
    bin_index = (cum <= rank.unsqueeze(-1)).sum(dim=-1).clamp_(max=last)
    below = (cum - counts).gather(-1, bin_index.unsqueeze(-1)).squeeze(-1)
    return bin_index, below


def histogram_quantile(counts: torch.Tensor, lo: Bound, hi: Bound, q: float | torch.Tensor) -> torch.Tensor:
    """Per-row ``q``-quantile (fp32 ``[rows]``) of values binned into ``counts`` over ``[lo, hi]``.

    Same convention as ``torch.quantile(..., interpolation="linear")``: position ``q * (n - 1)``
    between the sorted values. Inside a bin the ``c`` elements are placed at the midpoints of
    ``c`` equal sub-intervals, so each estimated element lies in its true bin and the result is
    within one bin width of the exact quantile whenever the values lie in ``[lo, hi]``.
    ``counts`` may be int64 or fp32 (summed in fp64 here); empty rows give NaN. ``counts`` may
    also be ``[..., rows, num_bins]`` (several histograms at once, e.g. one per layer) with ``lo``
    and ``hi`` broadcasting against the ``[..., rows]`` result (e.g. ``[layers, 1]``): every row's
    value is the same as from its own call.
    """
    if counts.dim() < 2:
        raise ValueError(f"counts must be a [..., rows, num_bins] tensor (2-D or more), got shape "
                         f"{tuple(counts.shape)}")
    if isinstance(q, float | int) and not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    num_bins = counts.shape[-1]
    counts = counts.double()
    n = counts.sum(dim=-1)
    last = (n - 1).clamp(min=0)
    position = q * last
    rank0 = position.floor()
    rank1 = (rank0 + 1).minimum(last)

    def bin_units(rank):  # the element's estimated position, in bin widths above lo
        bin_index, below = bin_of_rank(counts, rank)
        in_bin = counts.gather(-1, bin_index.unsqueeze(-1)).squeeze(-1)
        return bin_index + (rank - below + 0.5) / in_bin

    u0 = bin_units(rank0)
    units = u0 + (position - rank0) * (bin_units(rank1) - u0)
    units = torch.where(n > 0, units, torch.nan)
    width = (hi - lo) / num_bins
    return (lo + units * width).float()
