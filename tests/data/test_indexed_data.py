"""tools/preprocess_data.py round trip, file validation, and GPTDataset iterators."""

import json
import random

import numpy as np
import pytest
import torch

from megatron_ext.data.build import build_data_iterators
from megatron_ext.data.indexed import DataFileError, check_indexed_dataset
from megatron_ext.data.tokenizer import ByteTokenizer, JsonFileTokenizer
from megatron_ext.training.arguments import DataConfig
from tools.preprocess_data import main as preprocess_main
from tools.preprocess_data import preprocess

_QUIET = dict(log=lambda *_: None)


def _random_docs(seed, n):
    rng = random.Random(seed)
    alphabet = "the quick brown fox jumps \n\t{}\"é€😀中"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300))) for _ in range(n)]


def _write_jsonl(path, docs, key="text"):
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))


@pytest.fixture
def corpus(tmp_path):
    docs = _random_docs(0, 60)
    _write_jsonl(tmp_path / "in.jsonl", docs)
    prefix = str(tmp_path / "out" / "docs")
    preprocess(str(tmp_path / "in.jsonl"), prefix, **_QUIET)
    return docs, prefix


def test_round_trip_text_bin_idx_tokens_text(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs, prefix = corpus
    info = check_indexed_dataset(prefix)
    tok = ByteTokenizer()
    assert info["documents"] == len(docs)
    assert info["tokens"] == sum(len(d.encode()) + 1 for d in docs)
    ds = IndexedDataset(prefix)
    for i, doc in enumerate(docs):
        ids = ds[i]
        assert ids[-1] == tok.eod and tok.detokenize(ids[:-1]) == doc


def test_round_trip_with_a_local_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="optional extra: pip install tokenizers")
    from tokenizers import models, pre_tokenizers, trainers, decoders

    docs = [d.replace("\t", " ") for d in _random_docs(1, 30)]
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    _write_jsonl(tmp_path / "in.jsonl", docs, key="content")
    assert preprocess_main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "d"),
                            "--json-key", "content", "--tokenizer-json", str(tmp_path / "tokenizer.json")]) == 0
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ours = JsonFileTokenizer(str(tmp_path / "tokenizer.json"))
    assert ours.eod == tok.token_to_id("<|endoftext|>")
    ds = IndexedDataset(str(tmp_path / "d"))
    for i, doc in enumerate(docs):
        assert ds[i][-1] == ours.eod and ours.detokenize(ds[i][:-1]) == doc


def test_bad_json_lines_are_reported_with_line_numbers(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n{"text": broken\n\n{"other": 1}\n[1]\n{"text": "fine"}\n')
    assert preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "x")]) == 1
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.bin.tmp").exists()
    messages = []
    counts = preprocess(str(src), str(tmp_path / "x"), skip_bad_lines=True, log=messages.append)
    assert counts == {"documents": 2, "tokens": 2 + 1 + 4 + 1, "skipped": 3}
    joined = "\n".join(messages)
    assert "bad.jsonl:4: no key 'text'" in joined and "bad.jsonl:5: expected a JSON object" in joined


def test_missing_truncated_and_corrupt_files_fail_early_naming_the_file(corpus):
    _, prefix = corpus
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    idx_bytes, bin_bytes = open(idx, "rb").read(), open(bin_, "rb").read()
    with pytest.raises(DataFileError, match=r"nope\.idx: missing"):
        check_indexed_dataset(prefix + "nope")
    open(bin_, "wb").write(bin_bytes[:-3])
    with pytest.raises(DataFileError, match=r"docs\.bin: truncated: .* describes"):
        check_indexed_dataset(prefix)
    open(bin_, "wb").write(bin_bytes)
    open(idx, "wb").write(idx_bytes[:-8])
    with pytest.raises(DataFileError, match=r"docs\.idx: truncated or corrupt"):
        check_indexed_dataset(prefix)
    open(idx, "wb").write(b"garbage!!" + idx_bytes[9:])
    with pytest.raises(DataFileError, match=r"docs\.idx: not a Megatron index file"):
        check_indexed_dataset(prefix)
    open(idx, "wb").write(idx_bytes[:20])
    with pytest.raises(DataFileError, match=r"docs\.idx: truncated \(20 bytes"):
        build_data_iterators(DataConfig(data_path=[prefix]), seq_length=8, micro_batch_size=1,
                             global_batch_size=1, train_iters=1, seed=0, **_QUIET)


def test_gpt_dataset_iterators_read_the_preprocessed_tokens(corpus, tmp_path):
    docs, prefix = corpus
    stream = np.concatenate([np.frombuffer(d.encode(), np.uint8).astype(np.int64).tolist() + [256]
                             for d in docs])
    cfg = DataConfig(data_path=[prefix], split="90,10,0", data_cache_path=str(tmp_path / "cache"))
    kwargs = dict(seq_length=16, micro_batch_size=2, global_batch_size=4, train_iters=6, seed=5,
                  eval_iters=1, dp_size=2, **_QUIET)
    data = build_data_iterators(cfg, dp_rank=0, **kwargs)
    batches = [next(data.train) for _ in range(4)]
    text = stream.tobytes()
    for b in batches:
        assert set(b) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert b["tokens"].shape == (2, 16) and torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1])
        for row in torch.cat([b["tokens"], b["labels"][:, -1:]], dim=1):
            assert row.numpy().astype(np.int64).tobytes() in text  # a real window of the corpus
    resumed = build_data_iterators(cfg, dp_rank=0, consumed_samples=4, **kwargs)  # 1 global batch
    skip = data.train.num_micro_batches
    assert all(torch.equal(next(resumed.train)["tokens"], b["tokens"]) for b in batches[skip:])
    assert next(data.valid)["tokens"].shape == (2, 16)


def test_missing_dataset_helpers_without_pybind11_fail_with_instructions(monkeypatch, tmp_path):
    import sys

    from megatron_ext.data.indexed import ensure_dataset_helpers

    ensure_dataset_helpers()  # the prebuilt module of the wheel imports
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)  # as if never built
    monkeypatch.setitem(sys.modules, "pybind11", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="needs pybind11: pip install pybind11"):
        ensure_dataset_helpers()
