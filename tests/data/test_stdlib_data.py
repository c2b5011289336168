"""Byte tokenizer, stdlib corpus, GPT sample format, and resumable data-parallel sampling."""

import random

import numpy as np
import pytest
import torch

from megatron_ext.data.build import build_data_iterators
from megatron_ext.data.sampler import GlobalBatchSampler, MicroBatchIterator
from megatron_ext.data.samples import TokenStreamDataset
from megatron_ext.data.stdlib_corpus import list_stdlib_sources, load_stdlib_tokens, split_of
from megatron_ext.data.tokenizer import ByteTokenizer
from megatron_ext.training.arguments import DataConfig


def _random_text(rng: random.Random, n: int) -> str:
    alphabet = "abc xyz\n\té€😀ü中"
    return "".join(rng.choice(alphabet) for _ in range(n))


def test_byte_tokenizer_round_trip():
    rng = random.Random(0)
    tok = ByteTokenizer()
    for _ in range(20):
        text = _random_text(rng, rng.randint(0, 200))
        ids = tok.tokenize(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.detokenize(ids + [tok.eod]) == text
    assert tok.vocab_size == 257 and tok.eod == 256


def test_samples_are_shifted_windows_of_the_stream():
    rng = np.random.default_rng(1)
    stream = rng.integers(0, 257, size=1000).astype(np.uint16)
    seq = 37
    ds = TokenStreamDataset(stream, seq, eod=256, eod_mask_loss=True)
    assert len(ds) == (len(stream) - 1) // seq
    for i in rng.integers(0, len(ds), size=10):
        s = ds[int(i)]
        window = torch.from_numpy(stream[i * seq : i * seq + seq + 1].astype(np.int64))
        assert torch.equal(s["tokens"], window[:-1]) and torch.equal(s["labels"], window[1:])
        assert torch.equal(s["loss_mask"], (window[:-1] != 256).float())
        assert torch.equal(s["position_ids"], torch.arange(seq))
        assert s["tokens"].dtype == torch.int64 and s["loss_mask"].dtype == torch.float32


def test_stdlib_split_is_stable_and_disjoint():
    weights = (0.9, 0.07, 0.03)
    files = list_stdlib_sources()
    assert len(files) > 100 and files == sorted(files)
    assert not any("site-packages" in f for f in files)
    splits = {f: split_of(f, weights) for f in files}
    valid_share = sum(s == "valid" for s in splits.values()) / len(files)
    assert 0.02 < valid_share < 0.15
    small = load_stdlib_tokens(ByteTokenizer(), weights, max_mb=0.3)
    again = load_stdlib_tokens(ByteTokenizer(), weights, max_mb=0.3)
    for name in ("train", "valid"):
        assert np.array_equal(small[name], again[name])
    for name, w in zip(("train", "valid", "test"), weights):
        ends = np.flatnonzero(small[name] == 256)
        assert 0.3e6 * w <= len(small[name]) - len(ends)  # source bytes read: at least its share
        before_last = 0 if len(ends) == 1 else ends[-2] + 1 - (len(ends) - 1)
        assert before_last < 0.3e6 * w  # ... and it stopped after the file that filled it
    # Documents end in EOD and a larger budget only appends files (the prefix is unchanged).
    bigger = load_stdlib_tokens(ByteTokenizer(), weights, max_mb=0.6)
    assert small["train"][-1] == 256
    assert np.array_equal(bigger["train"][: len(small["train"])], small["train"])


def _take(sampler, n_batches):
    return [sampler.next_global_batch() for _ in range(n_batches)]


@pytest.mark.parametrize("trial", range(3))
def test_sampler_resume_is_exact_and_dp_slices_cover_the_global_batch(trial):
    rng = random.Random(trial)
    n, mbs, dp = rng.randint(20, 60), rng.choice([1, 2, 3]), rng.choice([1, 2, 4])
    gbs = mbs * dp * rng.randint(1, 3)
    seed, steps, cut = rng.randint(0, 99), 12, rng.randint(1, 11)
    full = [_take(GlobalBatchSampler(n, gbs, mbs, r, dp, seed), steps) for r in range(dp)]
    reference = _take(GlobalBatchSampler(n, gbs, gbs, 0, 1, seed), steps)
    for step in range(steps):
        joined = [i for r in range(dp) for mb in full[r][step] for i in mb]
        assert joined == reference[step][0]
    for r in range(dp):
        first = GlobalBatchSampler(n, gbs, mbs, r, dp, seed)
        _take(first, cut)
        resumed = GlobalBatchSampler(n, gbs, mbs, r, dp, seed)
        resumed.load_state_dict(first.state_dict())
        assert _take(resumed, steps - cut) == full[r][cut:]
    # Each epoch is a permutation, and epochs are shuffled differently.
    order = [i for b in reference for i in b[0]]
    epochs = [order[k * n : (k + 1) * n] for k in range(len(order) // n)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert len(epochs) < 2 or epochs[0] != epochs[1]


def test_build_iterators_from_stdlib_and_resume():
    cfg = DataConfig(stdlib_max_mb=0.5)
    kwargs = dict(seq_length=32, micro_batch_size=2, global_batch_size=8, train_iters=5,
                  seed=3, eval_iters=2, dp_size=2, log=lambda *_: None)
    data = build_data_iterators(cfg, dp_rank=1, **kwargs)
    assert data.train.num_micro_batches == 2
    batches = [next(data.train) for _ in range(6)]
    for b in batches:
        assert set(b) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert b["tokens"].shape == (2, 32) and torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1])
    state = {"consumed_samples": 8}
    resumed = build_data_iterators(cfg, dp_rank=1, consumed_samples=state["consumed_samples"], **kwargs)
    for expected in batches[2:]:
        got = next(resumed.train)
        assert all(torch.equal(got[k], expected[k]) for k in got)
    assert resumed.train.state_dict() == {"consumed_samples": 8 + 2 * 8}
    v1 = [next(data.valid)["tokens"] for _ in range(4)]
    data.valid.reset()
    assert all(torch.equal(a, next(data.valid)["tokens"]) for a in v1)
    assert not any(torch.equal(v1[0], b["tokens"]) for b in batches)


def test_iterator_refuses_to_save_mid_global_batch():
    ds = TokenStreamDataset(np.arange(200, dtype=np.uint16) % 256, 8, eod=256)
    it = MicroBatchIterator(ds, GlobalBatchSampler(len(ds), 4, 2))
    next(it)
    with pytest.raises(RuntimeError, match="middle of a global batch"):
        it.state_dict()
    next(it)
    assert it.state_dict() == {"consumed_samples": 4}
