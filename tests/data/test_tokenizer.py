"""The paper's tokenizer, offline (issue 15): the vendored file is Mistral-7B-v0.1's tokenizer.model, and
the fast tokenizer the C4 path loads from beside it (`load_tokenizer`, `tokenizers` only) encodes every
text exactly as SentencePiece itself does with that model, save one documented difference: the text
"<s>" (or "</s>", "<unk>") becomes the special token, as it did with the Hub's tokenizer in OpenDiLoCo."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from trainer_utils import compose_cfg

from diloco.assets import asset_path
from diloco.data import IGNORE_INDEX, SequenceStream, eval_batches, load_tokenizer, prefix_cut_chars

ROOT = Path(__file__).resolve().parents[2]
MISTRAL = Path(asset_path("mistral-7b-v0.1"))
SAMPLE = Path(asset_path("sample"))
SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"  # the Hub's, and mistral-common's

EDGE_CASES = [
    "",
    " ",
    "   ",
    "\n",
    " \n ",
    "\n\n\n",
    " Hello  world ",
    "trailing   ",
    "\tTab\t\ttabs",
    "a\n\nb",
    "\r\n crlf",
    " " * 37 + "x",
    "a" + " " * 17 + "b",
    "1234567890 3.14159 -42 1e10 2,000,000",
    "naïve café Zürich ﬁ ＡＢＣ ǅ İstanbul ß ẞ",  # no normalisation: composed, ligature, full-width as given
    "nai\u0308ve",  # decomposed: kept decomposed
    "東京 мир مرحبا بالعالم नमस्ते दुनिया",
    "🙂👍🏽 \U0001f9ec \u2603",  # pieces missing from the vocabulary: byte fallback
    "\u200b\u00a0x\u3000y\ufeff",
    "\x00\x01\x7f control",
    "Ω≈ç√∫˜µ≤≥÷",
    "x" * 3000,
]


def sample_texts() -> list[str]:
    """The bundled sample's validation split and its first train file: 3,374 documents."""
    texts = []
    for name in ("c4-validation.00000-of-00001.json.gz", "c4-train.00000-of-00004.json.gz"):
        with gzip.open(SAMPLE / name, "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f]
    return texts


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(MISTRAL))


@pytest.fixture(scope="module")
def sp():
    spm = pytest.importorskip(
        "sentencepiece", reason="sentencepiece (a dev dependency: make setup) is the reference"
    )
    return spm.SentencePieceProcessor(model_file=str(MISTRAL / "tokenizer.model"))


def test_the_vendored_model_is_mistral_7b_v0_1s():
    data = (MISTRAL / "tokenizer.model").read_bytes()
    assert len(data) == 493_443 and hashlib.sha256(data).hexdigest() == SHA256
    assert (MISTRAL / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_identity(tok):
    assert len(tok) == tok.vocab_size == 32_000
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.pad_token_id == 2  # load_tokenizer pads with </s>, as OpenDiLoCo
    assert tok("Hello world", add_special_tokens=False).input_ids == [22557, 1526]
    assert tok("Hello world").input_ids == [1, 22557, 1526]  # <s> first, no </s> last
    assert tok.model_max_length > 10**12  # no truncation warning at any seq_len
    assert not tok.backend_tokenizer.pre_tokenizer  # whole documents: nothing the prefix cut could use
    assert prefix_cut_chars(tok, 1024) == 0


def test_encodes_exactly_as_sentencepiece(tok, sp):
    texts = sample_texts() + EDGE_CASES
    assert tok(texts, add_special_tokens=False).input_ids == sp.encode(texts)
    assert tok(EDGE_CASES).input_ids == [[1, *ids] for ids in sp.encode(EDGE_CASES)]
    raw = Tokenizer.from_file(str(MISTRAL / "tokenizer.json"))  # the file alone, without transformers
    assert [e.ids for e in raw.encode_batch(EDGE_CASES, add_special_tokens=False)] == sp.encode(EDGE_CASES)
    for ids in sp.encode(EDGE_CASES):
        assert tok.decode(ids) == sp.decode(ids)


def test_special_token_text_is_the_special_token_as_on_the_hub(tok, sp):
    # The one difference from SentencePiece, kept because OpenDiLoCo's tokenizer (the Hub's tokenizer.json,
    # transformers 4.x) had it: "<s>" in a text is <s>, and the text after it gets its own "▁" prefix.
    assert tok("a<s>b", add_special_tokens=False).input_ids == [264, 1, 287]
    assert sp.encode("a<s>b") == [264, 28789, 28713, 28767, 28726]


def test_the_script_rebuilds_the_committed_files(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import build_tokenizer

    shutil.copy(MISTRAL / "tokenizer.model", tmp_path)
    build_tokenizer.build(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (MISTRAL / name).read_bytes(), name


@pytest.mark.parametrize("packing", [False, True])
def test_the_sample_reads_with_the_papers_tokenizer(packing):
    cfg = compose_cfg(
        [
            "data=sample",
            "data.seq_len=64",
            f"data.packing={packing}",
            "data.tokenizer=${diloco_asset:mistral-7b-v0.1}",
        ]
    ).data
    tok = load_tokenizer(cfg.tokenizer)
    assert len(tok) == 32_000
    batch = SequenceStream(cfg, tok, "train", 0, 2).next_batch(8)
    assert batch.input_ids.shape == (8, 64) and batch.input_ids.dtype == torch.int64
    assert batch.input_ids.min() >= 0 and batch.input_ids.max() < 32_000
    assert (batch.input_ids[:, 0] == 1).all() or packing
    assert batch.input_ids.max() > 1024  # not the sample's own 1024-token tokenizer
    if not packing:  # pads (= </s>) and only pads are masked out of the loss
        assert ((batch.labels == IGNORE_INDEX) == (batch.input_ids == tok.pad_token_id)).all()
    evals = eval_batches(cfg, tok, num_tokens=64 * 6, micro_batch_size=4)
    assert sum(b.input_ids.shape[0] for b in evals) == 6
