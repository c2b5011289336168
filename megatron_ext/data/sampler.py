"""Deterministic, resumable, data-parallel sampling of global batches.

The sample order is an endless sequence over epochs: position ``p`` is sample
``perm_e[p % N]`` with ``e = p // N`` and ``perm_e`` a permutation seeded by ``(seed, e)``
(identity when ``shuffle=False``). Global batch ``g`` covers positions
``[g*G, (g+1)*G)``; data-parallel rank ``r`` takes the contiguous slice
``[r*G/dp, (r+1)*G/dp)`` of it, cut into ``G/(dp*mbs)`` micro-batches. The only state is
``consumed_samples`` (global, a multiple of G), so a run resumed from a checkpoint sees exactly
the batches the uninterrupted run would have seen, for any dp size.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from megatron_ext.data.samples import collate


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, shuffle: bool = True,
                 consumed_samples: int = 0):
        if num_samples <= 0:
            raise ValueError("the dataset has no samples (is the split empty or seq_length too long?)")
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"global batch {global_batch_size} is not divisible by "
                             f"micro batch {micro_batch_size} x dp {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.consumed_samples = consumed_samples
        self._perm_epoch, self._perm = -1, None

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def _sample_at(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if not self.shuffle:
            return offset
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.num_samples), epoch
        return int(self._perm[offset])

    def next_global_batch(self) -> list[list[int]]:
        """This rank's micro-batches (lists of sample indices) of the next global batch."""
        per_rank = self.global_batch_size // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        mine = [self._sample_at(p) for p in range(start, start + per_rank)]
        self.consumed_samples += self.global_batch_size
        mbs = self.micro_batch_size
        return [mine[i : i + mbs] for i in range(0, per_rank, mbs)]

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])


class MicroBatchIterator:
    """Endless iterator of collated micro-batches for this rank.

    ``next()`` returns one micro-batch dict of ``[micro_batch, seq]`` tensors; a training
    iteration draws ``num_micro_batches`` of them. ``consumed_samples`` counts whole global
    batches handed out (it advances when the first micro-batch of a global batch is drawn).
    """

    def __init__(self, dataset, sampler: GlobalBatchSampler):
        self.dataset, self.sampler = dataset, sampler
        self._pending: list[list[int]] = []

    @property
    def num_micro_batches(self) -> int:
        return self.sampler.num_micro_batches

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if not self._pending:
            self._pending = self.sampler.next_global_batch()
        return collate([self.dataset[i] for i in self._pending.pop(0)])

    def reset(self, consumed_samples: int = 0) -> None:
        """Restart at ``consumed_samples`` (e.g. 0 before each evaluation)."""
        self.sampler.consumed_samples, self._pending = consumed_samples, []

    def state_dict(self) -> dict:
        if self._pending:
            raise RuntimeError("data position saved in the middle of a global batch; "
                               "save between training iterations")
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.reset(int(state["consumed_samples"]))
