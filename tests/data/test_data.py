"""Data pipeline: shards never overlap (i.i.d. and non-i.i.d.), train and eval are disjoint, sequences
are padded and masked the OpenDiLoCo way (or packed), and a stream resumes at the exact next sample."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from trainer_utils import compose_cfg

from diloco.data import (
    IGNORE_INDEX,
    DataError,
    SequenceStream,
    cut_document,
    document_stream,
    eval_batches,
    load_tokenizer,
    prefix_cut_chars,
)


@pytest.fixture(scope="module")
def data_cfg():
    return compose_cfg(["data=sample", "data.seq_len=64"]).data


@pytest.fixture(scope="module")
def tok(data_cfg):
    return load_tokenizer(data_cfg.tokenizer)


def _texts(data_cfg, split, shard=0, num_shards=1, sharding="iid"):
    cfg = data_cfg.copy()
    cfg.sharding = sharding
    return [ex["text"] for ex in document_stream(cfg, split, shard, num_shards)]


@pytest.fixture(scope="module")
def all_train(data_cfg):
    return _texts(data_cfg, "train")


@pytest.mark.parametrize("sharding", ["iid", "noniid"])
@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_shards_partition_the_train_split(data_cfg, all_train, sharding, num_shards):
    shards = [_texts(data_cfg, "train", s, num_shards, sharding) for s in range(num_shards)]
    assert sorted(t for sh in shards for t in sh) == sorted(all_train)  # nothing lost, nothing doubled
    for i in range(num_shards):
        assert len(shards[i]) > 0.3 * len(all_train) / num_shards  # roughly balanced
        for j in range(i + 1, num_shards):
            assert not set(shards[i]) & set(shards[j])


def test_noniid_shards_hold_disjoint_source_works(data_cfg):
    cfg = data_cfg.copy()
    cfg.sharding = "noniid"

    def sources(shard):
        return {ex["url"].split("#")[0] for ex in document_stream(cfg, "train", shard, 4)}

    per_shard = [sources(s) for s in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not per_shard[i] & per_shard[j]
    # while i.i.d. shards each see (almost) every source work
    cfg.sharding = "iid"
    iid0 = sources(0)
    assert len(iid0) > 2 * max(len(s) for s in per_shard)


def test_train_and_eval_are_disjoint(data_cfg, all_train):
    assert not set(all_train) & set(_texts(data_cfg, "validation"))


def test_the_tuning_and_report_subsets_split_the_eval_documents_in_two(data_cfg, tok):
    """eval_subset=tune (odd-numbered documents of the eval split) and report (even-numbered) are disjoint
    and make up the split; the train split is untouched; `all` is the whole split as before."""
    every = _texts(data_cfg, "validation")
    subsets = {}
    for subset in ("report", "tune"):
        cfg = data_cfg.copy()
        cfg.eval_subset = subset
        subsets[subset] = _texts(cfg, "validation")
        assert _texts(cfg, "train")[:50] == _texts(data_cfg, "train")[:50]
    assert subsets["report"] == every[0::2] and subsets["tune"] == every[1::2]
    cfg = data_cfg.copy()
    cfg.eval_subset = "tune"
    tuned = eval_batches(cfg, tok, num_tokens=64 * 4, micro_batch_size=4)[0].input_ids
    reported = eval_batches(data_cfg, tok, num_tokens=64 * 4, micro_batch_size=4)[0].input_ids
    assert not torch.equal(tuned, reported)  # the eval reads the tuning documents, not the first ones


def test_padding_masks_pads_out_of_the_loss(data_cfg, tok):
    stream = SequenceStream(data_cfg, tok, "train", 0, 1)
    batch = stream.next_batch(8)
    assert batch.input_ids.shape == (8, 64)
    assert (batch.input_ids[:, 0] == tok.bos_token_id).all()  # Mistral-style BOS
    pad = batch.input_ids == tok.pad_token_id
    assert ((batch.labels == IGNORE_INDEX) == pad).all()  # every </s> is masked, as in OpenDiLoCo
    assert (batch.labels[~pad] == batch.input_ids[~pad]).all()
    short = SequenceStream(data_cfg, tok, "train", 0, 1)
    short.seq_len = 4096  # longer than any document: every row ends in pads, none starts with one
    rows = short.next_batch(4).input_ids
    assert (rows[:, -1] == tok.pad_token_id).all() and (rows[:, 0] == tok.bos_token_id).all()


def test_packing_fills_every_position(data_cfg, tok):
    cfg = data_cfg.copy()
    cfg.packing = True
    batch = SequenceStream(cfg, tok, "train", 0, 1).next_batch(32)
    assert batch.input_ids.shape == (32, 64) and batch.num_target_tokens == 32 * 64
    assert (batch.input_ids == tok.eos_token_id).any()  # documents are separated by </s>


HOSTILE = [
    "Hello world.  Two  spaces,\tthen a tab\n\nand   three\r\n lines; don't, we'll, it's 12,345.67 ok?!",
    "  leading spaces and trailing ones   ",
    "mixed\u3000ideographic\u00a0no-break\u2009thin\u2028line sep\x1f unit sep \x0bvt end",
    "punct...!!! ??? --- *** ((nested)) [x] {y} </s> <s> literal specials </s>after",
    "digits 0001 2 33 444 5555 and 3.14159e-10, x2y3z 2024-11-29T11:16",
    "unicode: naïve café Ünïcödé 😀 emoji 😀😀 中文 字符 and ﬁ ligature  done",
    "a" * 50 + " " + "b" * 3 + "  \n  " + "c" * 20,
]


def test_tokens_of_a_cut_document_are_a_prefix_of_the_whole_documents(tok):
    """The property prefix_cut_chars relies on, at every possible cut of hostile texts: whitespace runs,
    unicode spaces, control characters, specials written out, digits, contractions, emoji."""
    assert prefix_cut_chars(tok, 64) == 256  # the sample's tokenizer qualifies
    for text in HOSTILE:
        whole = tok(text, add_special_tokens=False)["input_ids"]
        for chars in range(len(text) + 1):
            cut = cut_document(text, chars)
            assert text.startswith(cut) and (cut is text or len(cut) >= chars)
            ids = tok(cut, add_special_tokens=False)["input_ids"]
            assert whole[: len(ids)] == ids, (text, chars)


def test_cutting_long_documents_changes_no_sequence(data_cfg, tok):
    """The shortcut against whole documents, on the sample's train and eval splits (seq_len 64), with
    cut points from 1 character per token (most prefixes fall short and are redone) to the default 4."""
    for split, chars in (("train", 64), ("train", 256), ("validation", 96)):
        fast = SequenceStream(data_cfg, tok, split, 0, 1, wrap=False)
        slow = SequenceStream(data_cfg, tok, split, 0, 1, wrap=False)
        fast.cut_chars, slow.cut_chars = chars, 0
        for _ in range(25):
            a, b = fast.next_batch(16), slow.next_batch(16)
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert fast.cut_chars > chars or chars == 256  # the fallback ran (and the cut point grew)


def test_tokenizers_that_may_merge_across_a_cut_get_whole_documents(tok):
    import copy as copymod

    from tokenizers import normalizers, pre_tokenizers

    other = copymod.deepcopy(tok)
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()  # Mistral/Llama style
    assert prefix_cut_chars(other, 64) == 0
    other = copymod.deepcopy(tok)
    other.backend_tokenizer.normalizer = normalizers.NFKC()
    assert prefix_cut_chars(other, 64) == 0


@pytest.mark.parametrize("seed", [None, 1, 2])
@pytest.mark.parametrize("packing", [False, True])
def test_stream_resumes_at_the_exact_next_batch(data_cfg, tok, packing, seed):
    cfg = data_cfg.copy()
    cfg.packing, cfg.shuffle_buffer = packing, 16
    a = SequenceStream(cfg, tok, "train", 1, 2, shuffle_seed=seed)
    for _ in range(3):
        a.next_batch(5)
    state = json.loads(json.dumps(a.state_dict()))  # survives serialisation
    expected = [a.next_batch(5) for _ in range(3)]
    b = SequenceStream(cfg, tok, "train", 1, 2, shuffle_seed=seed)
    b.load_state_dict(state)
    for want in expected:
        got = b.next_batch(5)
        assert (got.input_ids == want.input_ids).all() and (got.labels == want.labels).all()


@pytest.mark.parametrize("packing", [False, True])
def test_a_resumed_stream_checkpoints_where_it_is_before_reading_a_document(data_cfg, tok, packing):
    """Resume, one batch, checkpoint, resume again: the second checkpoint is the uninterrupted stream's
    position. With packing and short sequences the batch after a resume comes from the leftovers alone,
    and `datasets` reports where it was built (not the loaded position) until it reads a document: the
    checkpoint once stored the start of the shard, and the run resumed from it read the shard again."""
    cfg = data_cfg.copy()
    cfg.packing, cfg.seq_len = packing, 16
    whole = SequenceStream(cfg, tok, "train", 0, 2)
    want = [whole.next_batch(1).input_ids for _ in range(8)]
    stream = SequenceStream(cfg, tok, "train", 0, 2)
    got = [stream.next_batch(1).input_ids for _ in range(3)]
    for _ in range(2):  # two resumes, each after one batch
        state = json.loads(json.dumps(stream.state_dict()))
        stream = SequenceStream(cfg, tok, "train", 0, 2)
        stream.load_state_dict(state)
        got.append(stream.next_batch(1).input_ids)
    assert json.loads(json.dumps(stream.state_dict())) == json.loads(json.dumps(_after(cfg, tok, 5)))
    got += [stream.next_batch(1).input_ids for _ in range(3)]
    assert all((g == w).all() for g, w in zip(got, want, strict=True))


def _after(cfg, tok, batches: int) -> dict:
    stream = SequenceStream(cfg, tok, "train", 0, 2)
    for _ in range(batches):
        stream.next_batch(1)
    return stream.state_dict()


def test_stream_repeats_the_shard_in_epochs(tmp_path, data_cfg, tok):
    path = tmp_path / "c4-train.00000-of-00001.json.gz"
    with gzip.open(path, "wt") as fh:
        for i in range(3):
            fh.write(json.dumps({"text": f"document number {i}", "url": f"https://x.org/{i}"}) + "\n")
    cfg = data_cfg.copy()
    cfg.data_files = {"train": str(path), "validation": str(path)}
    stream = SequenceStream(cfg, tok, "train", 0, 1)
    first = stream.next_batch(3).input_ids
    second = stream.next_batch(3).input_ids
    assert stream.epoch == 1 and (first == second).all()


def test_eval_set_is_fixed_size_and_deterministic(data_cfg, tok):
    a = eval_batches(data_cfg, tok, num_tokens=64 * 10, micro_batch_size=4)
    b = eval_batches(data_cfg, tok, num_tokens=64 * 10, micro_batch_size=4)
    assert [x.input_ids.shape[0] for x in a] == [4, 4, 2]
    assert all((x.input_ids == y.input_ids).all() for x, y in zip(a, b))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no file matches"),
        (b"", "empty"),
        (b"not gzip at all", "corrupt"),
        ("truncated", "corrupt"),
        ('{"txt": "no text field"}\n', "not in C4 format"),
    ],
)
def test_bad_data_files_are_named(tmp_path, data_cfg, content, message):
    path = tmp_path / "c4-train.00000-of-00001.json.gz"
    if isinstance(content, bytes):
        path.write_bytes(content if content else gzip.compress(b""))
    elif content == "truncated":
        good = gzip.compress(("\n".join(json.dumps({"text": "x" * 50}) for _ in range(2000))).encode())
        path.write_bytes(good[: len(good) // 2])
    elif content is not None:
        path.write_bytes(gzip.compress(content.encode()))
    cfg = data_cfg.copy()
    cfg.data_files = {"train": str(path), "validation": str(path)}
    with pytest.raises(DataError, match=message) as err:
        document_stream(cfg, "train")
    assert "\n" not in str(err.value)


def _documents(stream: SequenceStream, n: int) -> list[str]:
    return stream.next_texts(n)  # the documents themselves, before tokenising


@pytest.mark.parametrize(("sharding", "num_shards"), [("iid", 1), ("iid", 2), ("iid", 3), ("noniid", 2)])
def test_the_seed_orders_a_shard_but_never_changes_which_documents_it_holds(
    data_cfg, tok, sharding, num_shards
):
    """One pass over a shard reads the same documents, each once, under any seed (files shuffled only
    inside a shard of whole files, documents through the buffer); two seeds read them in other orders."""
    cfg = data_cfg.copy()
    cfg.sharding, cfg.shuffle_buffer = sharding, 64
    whole = _texts(cfg, "train", 0, num_shards, sharding)
    passes = {}
    for seed in (None, 1, 2):
        stream = SequenceStream(cfg, tok, "train", 0, num_shards, shuffle_seed=seed)
        passes[seed] = _documents(stream, len(whole))
        assert stream.epoch == 0 and sorted(passes[seed]) == sorted(whole)
    assert passes[None] == whole
    assert passes[1][:20] != passes[None][:20] and passes[1][:20] != passes[2][:20]


def test_a_document_buffer_permutes_each_fill_by_the_library_rule():
    """By hand: fill to 4, hand out 2 of the permuted 4 and keep 2; at the end of the pass the kept ones
    come out permuted too. The permutation is numpy's PCG64 seeded with (seed, shard, ..., epoch, fill)."""
    import numpy as np

    from diloco.data import DocumentShuffle

    buf, out = DocumentShuffle(4, (5, 0, 1, 0, 1)), []
    for doc in "abcdef":
        buf.add(doc, epoch=0)
        while (d := buf.next()) is not None:
            out.append(d)
    buf.flush(epoch=0)
    while (d := buf.next()) is not None:
        out.append(d)
    p0 = np.random.default_rng([5, 0, 1, 0, 1, 0, 0]).permutation(4)
    first = [list("abcd")[i] for i in p0]
    p1 = np.random.default_rng([5, 0, 1, 0, 1, 0, 1]).permutation(4)
    second = [[*first[2:], "e", "f"][i] for i in p1]
    p2 = np.random.default_rng([5, 0, 1, 0, 1, 0, 2]).permutation(2)
    last = [second[2:][i] for i in p2]
    assert out == first[:2] + second[:2] + last
    assert sorted(out) == list("abcdef")


def test_a_stream_resumes_exactly_across_an_epoch_with_a_shuffle(tmp_path, data_cfg, tok):
    path = tmp_path / "c4-train.00000-of-00001.json.gz"
    with gzip.open(path, "wt") as fh:
        for i in range(7):
            fh.write(json.dumps({"text": f"document number {i}", "url": f"https://x.org/{i}"}) + "\n")
    cfg = data_cfg.copy()
    cfg.data_files, cfg.shuffle_buffer = {"train": str(path), "validation": str(path)}, 4
    whole = SequenceStream(cfg, tok, "train", 0, 1, shuffle_seed=3)
    want = [_documents(whole, 3) for _ in range(6)]  # 18 documents: 2.6 epochs
    flat = sum(want, [])
    assert whole.epoch == 2 and sorted(flat[:7]) == sorted(flat[7:14]) and flat[:7] != flat[7:14]
    for stop in range(1, 6):
        first = SequenceStream(cfg, tok, "train", 0, 1, shuffle_seed=3)
        got = [_documents(first, 3) for _ in range(stop)]
        resumed = SequenceStream(cfg, tok, "train", 0, 1, shuffle_seed=3)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        got += [_documents(resumed, 3) for _ in range(6 - stop)]
        assert got == want, stop


def test_a_checkpoint_of_another_shuffle_seed_is_refused_in_one_line(data_cfg, tok):
    a = SequenceStream(data_cfg, tok, "train", 0, 1, shuffle_seed=1)
    a.next_batch(2)
    b = SequenceStream(data_cfg, tok, "train", 0, 1, shuffle_seed=2)
    with pytest.raises(DataError, match="shuffle_seed=1 .* shuffle_seed=2"):
        b.load_state_dict(a.state_dict())
