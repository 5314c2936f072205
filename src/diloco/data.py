"""C4-format text -> fixed-length token sequences, sharded per rank, resumable to the exact sample.

One pipeline serves both sources: `allenai/c4` (`en`) streamed from the Hub with the Mistral-7B
tokenizer (bundled, assets/mistral-7b-v0.1) on GPU nodes, and the bundled offline sample (same json.gz
format, its own small BPE tokenizer) everywhere else. Both are read with `datasets.load_dataset(..., streaming=True)`.

Sequences (each `input_ids`/`labels` of shape [seq_len]):
- packing=false (OpenDiLoCo, the replication setting): one document per sequence, truncated and
  right-padded to seq_len; pad tokens (= eos = `</s>`) are masked out of the loss with -100.
- packing=true: documents joined with `</s>` and cut into seq_len chunks; every token is a target.

Sharding (shard s of n): `iid` uses `datasets.distributed.split_dataset_by_node` (whole files when
the file count divides n, otherwise every n-th document), as OpenDiLoCo does; `noniid` assigns each
document to shard `sha256(key) % n`, with key the URL's host (`domain`, for C4) or the URL without its
fragment (`page`, for the sample, whose URLs name their source work), so each shard sees a disjoint
set of sites/works. Shards never overlap; the train and eval splits are disjoint files.

Order (the training stream only; evaluation reads its split in file order): with `data.shuffle_seed`
(default: the run's `seed`) the shard's files are read in a seeded order that changes every epoch
(`datasets`' own `IterableDataset.shuffle`, `set_epoch`), and documents pass through a seeded rolling
buffer of `data.shuffle_buffer` documents (DocumentShuffle). Which documents make up a shard never
depends on the seed: files are shuffled only within a shard of whole files; a shard of every n-th
document keeps the file order and shuffles through the buffer alone.

The iterator's position (dataset state, epoch, packing leftovers, the shuffle buffer) is returned with
every batch, so a checkpoint stores exactly where the next batch starts.

Reading from the Hub: huggingface_hub retries each HTTP request (dropped connections, 429 with
Retry-After, 5xx; 5 times with backoff). A read that still fails reopens the stream at the position
after the last document read (up to STREAM_REOPENS times, each going through that backoff again), so
no document is skipped or read twice; past that, or on an error no retry cures (401/403/404, a corrupt
file), the run stops with one line (DataError) and resumes from its last checkpoint.
`datasets`' own retry of a failed read is switched off: it retries the read of the *decompressed*
file, whose bytes decompressed before the failure are lost, so it continued after a gap.
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import logging
import os
import queue
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import torch

from diloco.assets import asset_path, register_resolvers  # noqa: F401  (configs use ${diloco_asset:...})

if TYPE_CHECKING:
    from diloco.schema import DataConfig

IGNORE_INDEX = -100
STREAM_REOPENS = 10  # reopens of a stream whose read failed past the client's own retries, per document

log = logging.getLogger(__name__)


class DataError(ValueError):
    """Bad data input; the message is one readable line."""


# ---------------------------------------------------------------------------------------------------
# tokenizer


def _offline(*variables: str) -> str | None:
    """The first of these environment variables that tells the Hugging Face libraries to stay offline."""
    return next((k for k in variables if os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE")), None)


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached (one TCP connection, no retries), or None when it can.
    The libraries themselves retry a dead network with backoff for about a minute before failing."""
    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"{host}:{port} is unreachable ({type(e).__name__}: {e.strerror or e})"
    return None


def _needs_hub(what: str, *offline_variables: str) -> DataError | None:
    """A DataError naming the cause when `what` must come from the Hub and the Hub is out of reach."""
    flag = _offline(*offline_variables)
    why = f"{flag} is set" if flag else hub_unreachable()
    if why is None:
        return None
    return DataError(
        f"{what} needs the Hugging Face Hub and {why}: use data=sample (bundled, offline), "
        "or download it on a machine with network and run with HF_HUB_OFFLINE=1"
    )


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    if name_or_path.startswith(("/", ".", "~")) and not Path(name_or_path).expanduser().exists():
        raise DataError(f"tokenizer path does not exist: {name_or_path}")
    if Path(name_or_path).expanduser().exists():
        tok = AutoTokenizer.from_pretrained(name_or_path)
    else:
        try:  # the cache first: a tokenizer already here needs no network
            tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        except OSError:
            if (
                error := _needs_hub(f"tokenizer {name_or_path} (not in the cache)", "HF_HUB_OFFLINE")
            ) is not None:
                raise error from None
            tok = AutoTokenizer.from_pretrained(name_or_path)
    if tok.pad_token is None:  # Mistral ships no pad token; OpenDiLoCo uses </s>
        tok.pad_token = tok.eos_token
    # Pads go after the text: with causal attention no real token then attends to a pad, positions
    # start at 0, and no attention mask is needed (SDPA keeps its fast causal path).
    tok.padding_side = "right"
    return tok


_CUT = re.compile(r"(?<=\S)\s")  # a whitespace character right after a non-whitespace one


def prefix_cut_chars(tokenizer, seq_len: int) -> int:
    """Characters after which a document may be cut before tokenising it into a padded sequence
    (0: never). Only for tokenizers whose tokens provably never cross such a cut: no normalizer, the
    GPT-2 regex byte-level pre-tokenizer (a pre-token never spans a whitespace character preceded by a
    non-whitespace one), a BPE model (pre-tokens are encoded independently), and no added token that
    contains whitespace. Then the tokens of the cut text are a prefix of the whole text's tokens, so
    truncating either to seq_len gives the same sequence whenever the cut one did not need padding.
    Mistral's tokenizer (a normalizer, or Metaspace) does not qualify and is always given whole documents."""
    from tokenizers import pre_tokenizers

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or type(backend.model).__name__ != "BPE":
        return 0
    pre = backend.pre_tokenizer
    if not isinstance(pre, pre_tokenizers.ByteLevel) or not getattr(pre, "use_regex", False):
        return 0
    if any(c.isspace() for t in tokenizer.get_added_vocab() for c in t):
        return 0
    return 4 * seq_len  # grows when a cut turns out too short (chars per token above 4)


def cut_document(text: str, chars: int) -> str:
    """text up to the first whitespace character at or after `chars` that follows a non-whitespace one."""
    if chars <= 0 or len(text) <= chars:
        return text
    m = _CUT.search(text, chars)
    return text if m is None else text[: m.start()]


# ---------------------------------------------------------------------------------------------------
# documents


def _check_local_files(data_files: dict | None) -> None:
    """Fail early, with one line, on a missing, empty or corrupt local json.gz shard."""
    import glob

    if not data_files:
        return
    for split, pattern in data_files.items():
        patterns = [pattern] if isinstance(pattern, str) else list(pattern)
        for pat in patterns:
            if "://" in pat:
                continue
            files = sorted(glob.glob(pat))
            if not files:
                raise DataError(f"data.data_files.{split}: no file matches {pat}")
            for f in files:
                _check_json_gz(f)


def _check_json_gz(path: str) -> None:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            first = fh.readline()
            if not first.strip():
                raise DataError(f"data file is empty: {path}")
            record = json.loads(first)
        # read to the end so a truncated gzip stream is found now, not hours into training
        with gzip.open(path, "rb") as fh:
            while fh.read(1 << 20):
                pass
    except DataError:
        raise
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"data file is corrupt: {path} ({type(e).__name__}: {e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise DataError(f"data file is not in C4 format (no 'text' field): {path}")


def noniid_shard_of(url: str, key: str, num_shards: int) -> int:
    """Deterministic shard of a document for non-i.i.d. sharding (same on every machine)."""
    parts = urlsplit(url or "")
    if key == "domain":
        k = parts.netloc.lower()
    elif key == "page":
        k = f"{parts.netloc.lower()}{parts.path}"
    else:
        raise DataError(f"data.noniid_key must be 'domain' or 'page', got {key!r}")
    return int.from_bytes(hashlib.sha256(k.encode()).digest()[:8], "big") % num_shards


def document_stream(
    data_cfg: DataConfig,
    split: str,
    shard: int = 0,
    num_shards: int = 1,
    part: tuple[int, int] = (0, 1),
    file_seed: int | None = None,
):
    """A `datasets.IterableDataset` of this shard's documents (dicts with `text` and `url`); with `part`
    (r, G), the r-th of G disjoint parts of the shard (a DumbDiLoCo node's shard split among its ranks).
    With `file_seed`, the shard's files in that seeded order (`set_epoch` reorders them), where the
    shard is made of whole files; the parts of a shard share the seed (one run's ranks)."""
    from datasets.distributed import split_dataset_by_node

    rank, parts = part
    if parts > 1 and num_shards > 1 and data_cfg.sharding == "iid":
        ds, whole_files = _part_of_iid_shard(data_cfg, split, shard, num_shards, rank, parts, file_seed)
    else:
        ds, whole_files = _shard_documents(data_cfg, split, shard, num_shards)
        if file_seed is not None and whole_files:
            ds = shuffle_files(ds, file_seed)
        if parts > 1:
            ds = split_dataset_by_node(ds, rank=rank, world_size=parts)
    return ds


def shuffle_files(ds, seed: int):
    """The dataset's files in a seeded order: `datasets`' shuffle with a buffer of one document, which
    holds nothing between reads, so its state_dict is the exact position (its own buffer is not saved in
    the state_dict; DocumentShuffle is the document-level shuffle)."""
    return ds.shuffle(seed=seed, buffer_size=1)


def _part_of_iid_shard(
    data_cfg: DataConfig,
    split: str,
    shard: int,
    num_shards: int,
    rank: int,
    parts: int,
    file_seed: int | None,
):
    """Part `rank` of `parts` of i.i.d. shard `shard`: the shard's own documents, split again.
    split_dataset_by_node of a dataset it split already splits the whole split once more (part
    shard*parts+rank of num_shards*parts; `datasets` applies the split when iterating, after any
    filter), so a node's ranks read files of other nodes' shards, and a node of 2 ranks overlaps a
    node of 1. Here: the shard's files (as split_dataset_by_node picks them) split among the parts,
    or, when the shard is every num_shards-th document, every (num_shards*parts)-th from its first."""
    from datasets.distributed import split_dataset_by_node

    if not 0 <= shard < num_shards:
        raise DataError(f"data shard {shard} is outside [0, {num_shards})")
    whole, _ = _shard_documents(data_cfg, split, 0, 1)
    if whole.num_shards % num_shards == 0:  # file-wise: files shard, shard+num_shards, ...
        files = whole.shard(num_shards=num_shards, index=shard, contiguous=False)
        if file_seed is not None:
            files = shuffle_files(files, file_seed)
        return split_dataset_by_node(files, rank=rank, world_size=parts), True
    return split_dataset_by_node(whole, rank=shard + num_shards * rank, world_size=num_shards * parts), False


def _shard_documents(data_cfg: DataConfig, split: str, shard: int, num_shards: int):
    """(the shard's documents, whether the shard is whole files of its own: a seeded file order then
    cannot move documents between shards)."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    if not 0 <= shard < num_shards:
        raise DataError(f"data shard {shard} is outside [0, {num_shards})")
    data_files = dict(data_cfg.data_files) if data_cfg.data_files else None
    _check_local_files(data_files)
    if not data_files and not Path(data_cfg.path).exists():  # streamed from the Hub (C4)
        error = _needs_hub(f"data set {data_cfg.path} (streamed)", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
        if error is not None:
            raise error
    _no_decompressed_read_retries()
    ds = load_dataset(data_cfg.path, data_cfg.config_name, data_files=data_files, split=split, streaming=True)
    if split == data_cfg.eval_split and (subset := data_cfg.eval_subset) != "all":
        ds = ds.filter(lambda _, i: i % 2 == (subset == "tune"), with_indices=True)  # disjoint halves
    if num_shards == 1:
        return ds, True
    if data_cfg.sharding == "iid":
        if ds.num_shards % num_shards == 0:  # whole files: shard, shard + num_shards, ... (as
            # split_dataset_by_node picks them, but now, so a file order set later stays inside the shard)
            return ds.shard(num_shards=num_shards, index=shard, contiguous=False), True
        return split_dataset_by_node(ds, rank=shard, world_size=num_shards), False  # every n-th document
    if data_cfg.sharding == "noniid":
        key = data_cfg.noniid_key
        return ds.filter(lambda ex: noniid_shard_of(ex.get("url", ""), key, num_shards) == shard), True
    raise DataError(f"data.sharding must be 'iid' or 'noniid', got {data_cfg.sharding!r}")


def _no_decompressed_read_retries() -> None:
    """Make `datasets` raise a failed streaming read at once instead of retrying it. Its retry wraps the
    read() of the decompressed file (gzip over the HTTP file): the bytes gzip had decompressed in the
    failed call are gone, so the retried read went on after a gap (a JSON parse error ~30 s later, or
    silently fewer documents when the gap ends on a line break). Retries happen below (huggingface_hub,
    per HTTP request) and above (SequenceStream reopens at the last document) instead."""
    from datasets import config

    config.STREAMING_READ_MAX_RETRIES = 1
    config.STREAMING_READ_RETRY_INTERVAL = 0
    config.STREAMING_READ_SERVER_UNAVAILABLE_RETRY_INTERVAL = 0
    config.STREAMING_READ_RATE_LIMIT_RETRY_INTERVAL = 0


def _transient(error: BaseException) -> bool:
    """A read failure that reading again may cure: a lost connection, a timeout, 408/429/5xx."""
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import httpx

    while error is not None:
        if isinstance(error, HfHubHTTPError):
            status = error.response.status_code if error.response is not None else None
            return status in (408, 429) or (status or 0) >= 500
        if isinstance(error, (ConnectionError, TimeoutError, httpx.TransportError)):
            return True
        error = error.__cause__
    return False


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    response = getattr(error, "response", None)  # an HTTP error: name the file
    url = getattr(getattr(response, "request", None), "url", None) if response is not None else None
    return f"{line} ({url})" if url else line


# ---------------------------------------------------------------------------------------------------
# sequences


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, seq_len] int64
    labels: torch.Tensor  # [B, seq_len] int64, IGNORE_INDEX where there is no target

    @property
    def num_target_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


class DocumentShuffle:
    """A seeded rolling shuffle of documents, `datasets`' algorithm (fill the buffer to `size`, permute it,
    hand out all but size // 2, keep those for the next fill), with the buffer and the fill count in the
    stream's position. Kept here rather than `IterableDataset.shuffle`'s buffer because that buffer is
    not in the library's state_dict: it is refilled on resume, so a resumed run would read other
    documents. The permutation of fill k of epoch e comes from a generator seeded with (seed, shard,
    part, e, k), so the order depends on nothing but the seed and the position."""

    def __init__(self, size: int, key: tuple[int, ...]):
        self.size, self.key = size, key
        self.kept: list[str] = []  # documents waiting for the next permutation
        self.ready: list[str] = []  # permuted documents to hand out, the next one last
        self.fills = 0

    def add(self, text: str, epoch: int) -> None:
        self.kept.append(text)
        if len(self.kept) >= self.size:
            self._permute(epoch, keep=self.size // 2)

    def flush(self, epoch: int) -> bool:
        """At the end of a pass: every kept document becomes ready. False if there were none."""
        if not self.kept:
            return False
        self._permute(epoch, keep=0)
        return True

    def _permute(self, epoch: int, keep: int) -> None:
        import numpy as np

        order = np.random.default_rng([*self.key, epoch, self.fills]).permutation(len(self.kept))
        out = len(self.kept) - keep
        self.ready = [self.kept[i] for i in reversed(order[:out])] + self.ready
        self.kept = [self.kept[i] for i in order[out:]]
        self.fills += 1

    def next(self) -> str | None:
        return self.ready.pop() if self.ready else None

    def state_dict(self) -> dict:
        return {"kept": list(self.kept), "ready": list(self.ready), "fills": self.fills}

    def load_state_dict(self, state: dict) -> None:
        self.kept, self.ready, self.fills = list(state["kept"]), list(state["ready"]), int(state["fills"])

    def clear(self) -> None:
        self.kept, self.ready, self.fills = [], [], 0


class SequenceStream:
    """Endless, resumable stream of [B, seq_len] batches from one shard (epochs repeat the shard).
    `shuffle_seed`: the shard's files in a seeded order per epoch and its documents through a seeded
    buffer of `data.shuffle_buffer` (the module docstring); None reads them in file order."""

    def __init__(
        self,
        data_cfg: DataConfig,
        tokenizer,
        split: str,
        shard: int,
        num_shards: int,
        wrap: bool = True,
        part: tuple[int, int] = (0, 1),
        shuffle_seed: int | None = None,
    ):
        self.cfg, self.tok, self.split = data_cfg, tokenizer, split
        self.shard, self.num_shards = shard, num_shards
        self.seq_len = int(data_cfg.seq_len)
        self.packing = bool(data_cfg.packing)
        self.shuffle_seed = shuffle_seed
        self.ds = document_stream(data_cfg, split, shard, num_shards, part, file_seed=shuffle_seed)
        size = int(data_cfg.shuffle_buffer) if shuffle_seed is not None else 0
        key = (int(shuffle_seed or 0), shard, num_shards, *part)
        self.shuffle = DocumentShuffle(size, key) if size > 1 else None
        self.wrap = wrap  # False: stop after one pass (evaluation)
        self.epoch = 0
        self._buffer: list[int] = []  # packing leftovers
        self._docs: Iterator | None = None
        self._init_state = self.ds.state_dict()
        # The position after the last document read: what a checkpoint stores and a reopen starts from.
        # Only a document read moves it. `datasets` reports a loaded position only once it has read from
        # it (until then its state_dict() is where the dataset was built), so a resumed packing stream
        # serving its leftovers must not ask it.
        self._doc_state = self._init_state
        self.cut_chars = 0 if self.packing else prefix_cut_chars(tokenizer, self.seq_len)

    # -- position ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "dataset": copy.deepcopy(self._doc_state), "buffer": list(self._buffer)}
        state["shuffle_seed"] = self.shuffle_seed
        if self.shuffle is not None:
            state["shuffle"] = self.shuffle.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        seed = state.get("shuffle_seed")  # absent in checkpoints from before the shuffle: file order
        if seed != self.shuffle_seed or ("shuffle" in state) != (self.shuffle is not None):
            raise DataError(
                f"the checkpoint's data position was written with data.shuffle_seed={seed} and "
                f"{'a' if 'shuffle' in state else 'no'} document buffer; this run has shuffle_seed="
                f"{self.shuffle_seed} and {'a' if self.shuffle is not None else 'no'} buffer: resume with "
                "the checkpoint's values (or resume=never)"
            )
        self.epoch = int(state["epoch"])
        self._buffer = list(state["buffer"])
        self._doc_state = copy.deepcopy(state["dataset"])
        self._start_epoch(self._doc_state)
        self._from_start = False
        if self.shuffle is not None:
            self.shuffle.load_state_dict(state["shuffle"])

    def _start_epoch(self, position: dict) -> None:
        """Read on from `position` in the current epoch's file order."""
        if self.shuffle_seed is not None:
            self.ds.set_epoch(self.epoch)
        self.ds.load_state_dict(copy.deepcopy(position))
        self._docs = None

    # -- documents --------------------------------------------------------------------------------
    def next_texts(self, n: int) -> list[str]:
        """The next n documents' texts in the stream's order (fewer at the end of a non-wrapping stream)."""
        texts: list[str] = []
        while len(texts) < n:
            if self.shuffle is not None and (text := self.shuffle.next()) is not None:
                texts.append(text)
                continue
            text = self._read_document()
            if text is None and self.shuffle is not None and self.shuffle.flush(self.epoch):
                continue  # the pass's last documents, permuted
            if text is None:
                if not self.wrap:
                    self.epoch += 1
                    break
                self._next_epoch()
            elif self.shuffle is not None:
                self.shuffle.add(text, self.epoch)
            else:
                texts.append(text)
        return texts

    def _next_epoch(self) -> None:
        """The shard is exhausted: start the next epoch from its beginning (in that epoch's file order)."""
        if self._from_start and not self._read_in_pass:
            raise DataError(
                f"data shard {self.shard}/{self.num_shards} of split {self.split!r} has no documents"
            )
        self.epoch += 1
        self._doc_state = self._init_state
        self._start_epoch(self._init_state)
        self._from_start, self._read_in_pass = True, False
        if self.shuffle is not None:
            self.shuffle.fills = 0

    # A whole pass from the shard's beginning that read nothing means an empty shard (a pass resumed at
    # the shard's end reads nothing too, legitimately).
    _from_start, _read_in_pass = True, False

    def _read_document(self) -> str | None:
        """The shard's next document in this pass (None at its end), reopening the stream at the last
        position after a read failure that reading again may cure."""
        reopens = 0
        while True:
            if self._docs is None:
                self._docs = iter(self.ds)
            try:
                text = next(self._docs)["text"]
            except DataError:  # e.g. a bad noniid_key, met by the filter while reading
                raise
            except StopIteration:
                return None
            except (OSError, ValueError, EOFError) as e:  # network, HTTP, gzip, JSON (pyarrow's ArrowInvalid)
                if not _transient(e) or reopens == STREAM_REOPENS:
                    tried = f" (reopened {reopens} times)" if reopens else ""
                    raise DataError(
                        f"reading data split {self.split!r} of {self.cfg.path} failed{tried}: {_one_line(e)}; "
                        "the last checkpoint is intact: rerun the same command to resume from it"
                    ) from e
                reopens += 1
                log.warning("data stream read failed (%s); reopening it at the next document", _one_line(e))
                self._start_epoch(self._doc_state)
                continue
            self._doc_state = self.ds.state_dict()
            self._read_in_pass = True
            return text

    # -- sequences --------------------------------------------------------------------------------
    def next_batch(self, batch_size: int) -> Batch | None:
        """The next batch_size sequences (fewer, or None, at the end of a non-wrapping stream)."""
        if self.packing:
            ids = self._packed(batch_size)
            if ids is None:
                return None
            labels = ids.clone()
        else:
            texts = self.next_texts(batch_size)
            if not texts:
                return None
            ids = self._padded(texts)
            labels = ids.masked_fill(ids == self.tok.pad_token_id, IGNORE_INDEX)
        return Batch(ids.long(), labels.long())

    def _encode(self, texts: list[str]) -> dict:
        return self.tok(
            texts, max_length=self.seq_len, truncation=True, padding="max_length", return_tensors="pt"
        )

    def _padded(self, texts: list[str]) -> torch.Tensor:
        """One document per row, truncated and padded to seq_len. Long documents are tokenised from a
        prefix (see prefix_cut_chars); a row whose prefix fell short is redone from the whole text."""
        short = [cut_document(t, self.cut_chars) for t in texts]
        enc = self._encode(short)
        ids = enc["input_ids"]
        redo = [
            i
            for i, (a, b) in enumerate(zip(short, texts))
            if a is not b and not enc["attention_mask"][i].all()
        ]
        if redo:
            ids[redo] = self._encode([texts[i] for i in redo])["input_ids"]
            self.cut_chars = self.cut_chars * 3 // 2  # fewer fallbacks from now on
        return ids

    def _packed(self, batch_size: int) -> torch.Tensor | None:
        need = batch_size * self.seq_len
        while len(self._buffer) < need:
            texts = self.next_texts(batch_size)
            if not texts:
                break
            for ids in self.tok(texts)["input_ids"]:
                self._buffer.extend(ids)
                self._buffer.append(self.tok.eos_token_id)
        rows = min(batch_size, len(self._buffer) // self.seq_len)
        if rows == 0:
            return None
        n = rows * self.seq_len
        chunk, self._buffer = self._buffer[:n], self._buffer[n:]
        return torch.tensor(chunk, dtype=torch.long).view(rows, self.seq_len)


def eval_batches(
    data_cfg: DataConfig, tokenizer, num_tokens: int, micro_batch_size: int, shard=0, num_shards=1
):
    """The fixed held-out evaluation set: the first num_tokens/seq_len sequences of the eval split."""
    num_seqs = max(1, int(num_tokens) // int(data_cfg.seq_len))
    stream = SequenceStream(data_cfg, tokenizer, data_cfg.eval_split, shard, num_shards, wrap=False)
    out, left = [], num_seqs
    while left > 0:  # a split smaller than asked is evaluated whole, once
        b = stream.next_batch(min(micro_batch_size, left))
        if b is None:
            break
        out.append(b)
        left -= b.input_ids.shape[0]
    if not out:
        raise DataError(f"eval split {data_cfg.eval_split!r} has no documents")
    return out


class PrefetchedStream:
    """The training stream with the next micro-batches read and tokenised on a background thread while
    the model computes (tokenizers and torch release the GIL): data preparation leaves the step's
    critical path. `state_dict()` is the position after the last batch handed out, so checkpoints and
    resume stay exact. Hand-written rather than torchdata's StatefulDataLoader: one thread keeps the
    exact position without worker processes or a new dependency, and the trainer already runs at the
    plain loop's speed (results/bench/trainer.json)."""

    def __init__(self, stream: SequenceStream, batch_size: int, depth: int = 2):
        # This thread is the data pipeline's parallelism: a tokenizer thread pool on top would compete
        # with torch's threads for the cores (an explicit TOKENIZERS_PARALLELISM is respected).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.stream, self.batch_size = stream, batch_size
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._state = stream.state_dict()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _fill(self) -> None:
        while not self._stop.is_set():
            try:
                item = (self.stream.next_batch(self.batch_size), self.stream.state_dict(), None)
            except Exception as e:  # raised on the training thread when it asks for this batch
                item = (None, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    pass
            if item[2] is not None:
                return

    def next_batch(self, batch_size: int):
        if batch_size != self.batch_size:
            raise ValueError(f"prefetching batches of {self.batch_size}, asked for {batch_size}")
        if self._thread is None:  # started late: a resumed position is loaded first
            self._thread = threading.Thread(target=self._fill, name="data-prefetch", daemon=True)
            self._thread.start()
        batch, state, error = self._queue.get()
        if error is not None:
            raise error
        self._state = state
        return batch

    def state_dict(self) -> dict:
        return self._state

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("the data position can only be restored before the first batch")
        self.stream.load_state_dict(state)
        self._state = self.stream.state_dict()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
