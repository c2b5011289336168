"""One function from a ``DataConfig`` to this rank's train / valid micro-batch iterators."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from megatron_ext.data.sampler import GlobalBatchSampler, MicroBatchIterator
from megatron_ext.data.samples import TokenStreamDataset
from megatron_ext.data.tokenizer import build_tokenizer
from megatron_ext.training.arguments import DataConfig


@dataclass
class TrainValidData:
    """``train`` continues from ``consumed_samples``; call ``valid.reset()`` before each eval."""

    train: MicroBatchIterator
    valid: Optional[MicroBatchIterator]
    tokenizer: object


def build_data_iterators(
    data: DataConfig,
    *,
    seq_length: int,
    micro_batch_size: int,
    global_batch_size: int,
    train_iters: int,
    seed: int,
    eval_iters: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
    consumed_samples: int = 0,
    log=print,
) -> TrainValidData:
    """Datasets, samplers and iterators for either source.

    ``data.data_path`` None: the stdlib corpus, shuffled each epoch by our sampler (seeded by
    ``seed``). Otherwise Megatron ``GPTDataset``s (which shuffle themselves with ``seed``) read in
    order. Every rank must call this (Megatron builds its index cache on rank 0 behind a barrier).
    ``eval_iters`` global batches of validation data are drawn from position 0 at each ``reset``.
    """
    start = time.perf_counter()
    tokenizer = build_tokenizer(data.tokenizer_json)
    if data.data_path is None:
        streams = _stdlib_streams(data, tokenizer)
        train_ds = TokenStreamDataset(streams["train"], seq_length, tokenizer.eod, data.eod_mask_loss)
        valid_ds = TokenStreamDataset(streams["valid"], seq_length, tokenizer.eod, data.eod_mask_loss)
        shuffle = True
    else:
        from megatron_ext.data.indexed import build_gpt_datasets

        sizes = (train_iters * global_batch_size, eval_iters * global_batch_size, 0)
        train_ds, valid_ds, _ = build_gpt_datasets(
            data.data_path, data.split, tokenizer, seq_length, seed, sizes,
            data.data_cache_path, data.eod_mask_loss)
        shuffle = False
    if train_ds is None or len(train_ds) == 0:
        raise ValueError(f"no training samples of seq_length {seq_length} (data_path="
                         f"{data.data_path}, split={data.split!r})")

    def iterator(dataset, shuffle_seed, position):
        sampler = GlobalBatchSampler(len(dataset), global_batch_size, micro_batch_size,
                                     dp_rank, dp_size, shuffle_seed, shuffle, position)
        return MicroBatchIterator(dataset, sampler)

    train = iterator(train_ds, seed, consumed_samples)
    valid = None
    if eval_iters > 0 and valid_ds is not None and len(valid_ds) > 0:
        valid = iterator(valid_ds, seed + 1, 0)
    log(f"> data: {len(train_ds)} train / {len(valid_ds) if valid_ds is not None else 0} valid "
        f"samples of {seq_length} tokens, vocab {tokenizer.vocab_size}, "
        f"built in {time.perf_counter() - start:.1f}s")
    return TrainValidData(train, valid, tokenizer)


def _stdlib_streams(data: DataConfig, tokenizer):
    from megatron_ext.data.stdlib_corpus import load_stdlib_tokens

    return load_stdlib_tokens(tokenizer, data.split_weights(), data.stdlib_max_mb)
