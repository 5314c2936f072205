"""Checks of the bundled offline C4-format sample and its tokenizer (built by src/diloco/assets/sample/build_sample.py)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

SAMPLE_DIR = Path(__file__).resolve().parents[2] / "src" / "diloco" / "assets" / "sample"
TRAIN_FILES = [f"c4-train.{i:05d}-of-00004.json.gz" for i in range(4)]
VALIDATION_FILES = ["c4-validation.00000-of-00001.json.gz"]
URL_RE = re.compile(r"^https://[a-z0-9.-]+/\S+#part-\d+$")


def _read(name: str) -> list[dict]:
    with gzip.open(SAMPLE_DIR / name, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict]]:
    return {
        "train": [d for name in TRAIN_FILES for d in _read(name)],
        "validation": [d for name in VALIDATION_FILES for d in _read(name)],
    }


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(SAMPLE_DIR / "tokenizer"))


def test_files_exist():
    for name in [*TRAIN_FILES, *VALIDATION_FILES, "PROVENANCE.md", "tokenizer/tokenizer.json"]:
        assert (SAMPLE_DIR / name).is_file(), name


def test_c4_json_lines(splits):
    for split, docs in splits.items():
        assert len(docs) > (5000 if split == "train" else 200), split
        for d in docs:
            assert list(d) == ["text", "timestamp", "url"]
            assert isinstance(d["text"], str) and len(d["text"]) >= 200
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", d["timestamp"])
            assert URL_RE.match(d["url"]), d["url"]
    train_chars = sum(len(d["text"]) for d in splits["train"])
    assert train_chars > 10_000_000


def test_train_validation_disjoint(splits):
    train = {d["text"] for d in splits["train"]}
    validation = {d["text"] for d in splits["validation"]}
    assert len(train) == len(splits["train"]) and len(validation) == len(splits["validation"])
    assert not train & validation


def test_many_sources(splits):
    works = {d["url"].split("#", 1)[0] for d in splits["train"]}
    assert len(works) >= 60
    hosts = {re.match(r"https://([^/]+)/", w).group(1) for w in works}
    assert len(hosts) >= 4


def test_tokenizer(tokenizer, splits):
    assert tokenizer.is_fast
    assert len(tokenizer) == 1024
    assert tokenizer.convert_tokens_to_ids(["<unk>", "<s>", "</s>"]) == [0, 1, 2]
    assert (tokenizer.unk_token, tokenizer.bos_token, tokenizer.eos_token) == ("<unk>", "<s>", "</s>")
    assert tokenizer.bos_token_id == 1
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    assert tokenizer.model_max_length >= 100_000
    texts = [
        "It is a truth universally acknowledged, that a single man in possession of a good fortune.",
        "Naïve café “quotes” — 3€ and 42 tabs\tand\nnew lines.",
        splits["validation"][0]["text"],
    ]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == 1 and ids[1] != 1  # BOS prepended once
        assert ids[-1] != 2  # no EOS appended
        assert max(ids) < 1024
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.decode(ids[1:]) == text


def test_total_size():
    total = sum(p.stat().st_size for p in SAMPLE_DIR.rglob("*") if p.is_file())
    assert total < 10 * 1000 * 1000
