"""GPT samples from a flat token stream, in Megatron-Core's batch format.

A sample ``i`` is the window ``stream[i*s : i*s + s + 1]`` (``s`` = seq_length): consecutive
windows share one token so every token is a label exactly once. Each sample is a dict

    tokens        int64   [s]   window[:-1]
    labels        int64   [s]   window[1:]
    loss_mask     float32 [s]   1.0 (0.0 where the input token is EOD if eod_mask_loss)
    position_ids  int64   [s]   0..s-1

the same keys as ``megatron.core.datasets.gpt_dataset.GPTDataset`` with
``create_attention_mask=False`` (attention is causal, built by the model). ``collate`` stacks
samples into ``[micro_batch, s]`` tensors.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenStreamDataset(torch.utils.data.Dataset):
    def __init__(self, stream: np.ndarray, seq_length: int, eod: int, eod_mask_loss: bool = False):
        self.stream = stream
        self.seq_length = seq_length
        self.eod = eod
        self.eod_mask_loss = eod_mask_loss
        self._position_ids = torch.arange(seq_length, dtype=torch.int64)

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_length)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)})")
        start = idx * self.seq_length
        window = torch.from_numpy(self.stream[start : start + self.seq_length + 1].astype(np.int64))
        tokens, labels = window[:-1], window[1:]
        loss_mask = torch.ones(self.seq_length, dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[tokens == self.eod] = 0.0
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                "position_ids": self._position_ids.clone()}


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
