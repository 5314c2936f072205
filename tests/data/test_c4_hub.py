"""`data=c4` end to end against a loopback Hub (src/diloco/testing/hub_server.py) serving a small `allenai/c4`.

The repository has C4's layout and format: a README whose `configs` name the `en` config's files,
`en/c4-train.0000N-of-00004.json.gz` and `en/c4-validation.0000N-of-00002.json.gz`, compact JSON lines
`{"text","timestamp","url"}`, built here from the bundled sample's documents with C4-like URLs on
several sites. `datasets` and `huggingface_hub` talk to it unchanged through HF_ENDPOINT, in
subprocesses: `python -m diloco.train data=c4 ...` as a user runs it, and a probe that reads the
streams `diloco.data` builds. Each subprocess gets a `sitecustomize` that refuses any connection or name
lookup that is not loopback (datasets asks the dataset viewer at `datasets-server.<host>`, which is
refused, as it is for C4 on the real Hub) and, for the fault runs, records huggingface_hub's backoff
waits instead of sleeping them. Files are read in 512-byte blocks (FSSPEC_HF), so each file takes three
range requests, as C4's 300 MB files do in 5 MiB blocks.

What is checked: the stream yields exactly the files' documents in order; 2 and 3 workers split them
file-wise when the file count divides the workers and document-wise otherwise (what
`split_dataset_by_node` does), disjoint and covering; `noniid` by `domain` puts each site on one shard;
`eval_subset` report/tune are the validation split's even/odd documents; a training run consumes the
same sequences as the same files read locally (bit-identical losses) and counts one epoch per 64
documents; a failure no retry cures (a 403) stops the run with one line, and the same command resumes
it at the next document, bit for bit, while a dropped connection, a 500, a 429 and a failure past
huggingface_hub's retries are retried without changing a loss.

Five subprocesses in all (the probe and four training runs), most of their time importing torch.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from diloco.testing.hub_server import HubServer

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "src" / "diloco" / "assets" / "sample"
REPO = "allenai/c4"
TRAIN_FILES, DOCS_PER_TRAIN_FILE = 4, 16
VAL_FILES, DOCS_PER_VAL_FILE = 2, 6
# hosts that C4 draws from; noniid_shard_of puts at least one on every shard of 2 and of 3
SITES = [
    "klyq.com",
    "www.bbc.co.uk",
    "www.theguardian.com",
    "www.instructables.com",
    "patents.google.com",
    "www.forbes.com",
    "www.reuters.com",
    "www.ebay.com",
]
README = b"""---
pretty_name: C4
language:
- en
license: odc-by
task_categories:
- text-generation
viewer: false
dataset_info:
- config_name: en
  features:
  - name: text
    dtype: string
  - name: timestamp
    dtype: string
  - name: url
    dtype: string
configs:
- config_name: en
  data_files:
  - split: train
    path: en/c4-train.*.json.gz
  - split: validation
    path: en/c4-validation.*.json.gz
- config_name: realnewslike
  data_files:
  - split: train
    path: realnewslike/c4-train.*.json.gz
---
# C4 (a loopback stand-in with the real repository's layout)
"""
# a micro model shrunk to fit the bundled Mistral tokenizer's 32000 tokens cheaply (~1M parameters);
# one document per 64-token sequence, four a step
RUN = [
    "model=micro",
    "model.vocab_size=32000",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=2",
    "model.intermediate_size=64",
    "model.tie_word_embeddings=true",
    "data=c4",
    "data.seq_len=64",
    # the files' own order: the faults below are placed on the requests of a known file sequence (the
    # seeded order's resume is tests/data/test_data.py's and tests/test_train.py's)
    "data.shuffle_seed=null",
    "train.batch_size=4",
    "train.micro_batch_size=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.checkpoint_every=4",
    "train.progress=false",
    "eval.tokens=640",
    "eval.micro_batch_size=4",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "optim.total_steps=18",
    "device=cpu",
    "wandb.mode=disabled",
]
STEPS = 18  # 72 documents: the 64 of the train split, then 8 into its second epoch
GUARD = """
import os, socket, ipaddress, time

def _loopback(host):
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"

def _refused(what):
    with open(os.environ["C4HUB_RECORD"] + ".refused", "a") as fh:
        fh.write(what + "\\n")

_connect, _getaddrinfo = socket.socket.connect, socket.getaddrinfo

def connect(sock, address):
    if sock.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
        _refused(str(address[0]))
        raise ConnectionRefusedError(f"loopback only (tried {address!r})")
    return _connect(sock, address)

def getaddrinfo(host, *args, **kwargs):
    name = host.decode() if isinstance(host, bytes) else host
    if name is not None and not _loopback(name):
        _refused(name)
        raise socket.gaierror(f"loopback only (tried to resolve {name!r})")
    return _getaddrinfo(host, *args, **kwargs)

socket.socket.connect, socket.getaddrinfo = connect, getaddrinfo

if os.environ.get("C4HUB_NO_BACKOFF_WAIT"):
    import huggingface_hub.utils._http as _http

    class _Clock:
        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, seconds):  # huggingface_hub's backoff: recorded, not waited
            with open(os.environ["C4HUB_RECORD"] + ".waits", "a") as fh:
                fh.write(f"{seconds}\\n")

    _http.time = _Clock()
"""
PROBE = textwrap.dedent(
    """
    import json, re, sys
    from omegaconf import OmegaConf
    from diloco.data import document_stream
    base = OmegaConf.load("configs/data/c4.yaml")
    out = {}
    for name, split, shard, num_shards, extra, part in json.loads(sys.argv[1]):
        cfg = OmegaConf.merge(base, extra)
        # the timestamp's digits: pyarrow reads C4's "2019-04-25T12:57:54Z" as a timestamp, which the
        # README's `string` feature turns into "2019-04-25 12:57:54" (data.py reads text and url only)
        out[name] = [[d["text"], re.sub(r"\\D", "", str(d["timestamp"])), d["url"]]
                     for d in document_stream(cfg, split, shard, num_shards, tuple(part))]
    print(json.dumps(out))
    """
)


# ------------------------------------------------------------------------------------------ the repository
def _slug(text: str) -> str:
    return "-".join(re.findall(r"[a-z0-9]+", text.lower())[:6])


def _sample_docs(name: str, n: int) -> list[str]:
    with gzip.open(SAMPLE / name, "rt", encoding="utf-8") as fh:
        return [json.loads(next(fh))["text"] for _ in range(n)]


def _c4_file(texts: list[str], rng: random.Random) -> list[dict]:
    docs = []
    for text in texts:
        day, hms = rng.randint(18, 26), [rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59)]
        docs.append(
            {
                "text": text,
                "timestamp": f"2019-04-{day:02d}T{hms[0]:02d}:{hms[1]:02d}:{hms[2]:02d}Z",
                "url": f"https://{SITES[rng.randrange(len(SITES))]}/{_slug(text)}/",
            }
        )
    return docs


def _encode(docs: list[dict]) -> bytes:
    lines = "".join(json.dumps(d, separators=(",", ":")) + "\n" for d in docs)  # C4's compact lines
    return gzip.compress(lines.encode(), mtime=0)


@pytest.fixture(scope="module")
def c4(tmp_path_factory):
    """The loopback Hub with `allenai/c4`; `.files` maps each repo path to its documents."""
    rng = random.Random(4)
    files: dict[str, list[dict]] = {}
    for i in range(TRAIN_FILES):
        texts = _sample_docs(f"c4-train.{i:05d}-of-00004.json.gz", DOCS_PER_TRAIN_FILE)
        files[f"en/c4-train.{i:05d}-of-{TRAIN_FILES:05d}.json.gz"] = _c4_file(texts, rng)
    val = _sample_docs("c4-validation.00000-of-00001.json.gz", VAL_FILES * DOCS_PER_VAL_FILE)
    for i in range(VAL_FILES):
        texts = val[i * DOCS_PER_VAL_FILE : (i + 1) * DOCS_PER_VAL_FILE]
        files[f"en/c4-validation.{i:05d}-of-{VAL_FILES:05d}.json.gz"] = _c4_file(texts, rng)
    contents = {path: _encode(docs) for path, docs in files.items()}
    local = tmp_path_factory.mktemp("c4_local")  # the same files on disk: the reference runs read them
    for path, data in contents.items():
        (local / Path(path).name).write_bytes(data)
    server = HubServer().start()
    server.create_dataset(REPO, {"README.md": README, **contents})
    server.files, server.local = files, local
    try:
        yield server
    finally:
        server.stop()


def _row(d: dict) -> list[str]:
    return [d["text"], re.sub(r"\D", "", d["timestamp"]), d["url"]]


def _file_docs(c4, split: str) -> list[list[list[str]]]:
    return [[_row(d) for d in ds] for p, ds in sorted(c4.files.items()) if split in p]


def _docs(c4, split: str) -> list[list[str]]:
    return [d for f in _file_docs(c4, split) for d in f]


def _domain(url: str) -> str:
    return urlsplit(url).netloc


# ------------------------------------------------------------------------------------------ subprocesses
def _env(c4, record: Path, *, no_backoff_wait: bool = False) -> dict:
    guard = record.parent / "guard"
    guard.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(GUARD)
    # online (to the loopback Hub only), no token, and every cache under the test's folder
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "HUGGINGFACE_"))}
    env |= {
        "HF_ENDPOINT": c4.url,
        "HF_HOME": str(record.parent / "hf_home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_UPDATE_DOWNLOAD_COUNTS": "0",  # else datasets pings s3.amazonaws.com per load
        "FSSPEC_HF": json.dumps({"block_size": 512}),
        "PYTHONPATH": os.pathsep.join([str(guard), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "C4HUB_RECORD": str(record),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
    }
    if no_backoff_wait:
        env["C4HUB_NO_BACKOFF_WAIT"] = "1"
    return env


def _refused(record: Path) -> set[str]:
    path = Path(str(record) + ".refused")
    return set(path.read_text().split()) if path.exists() else set()


def _waits(record: Path) -> list[float]:
    path = Path(str(record) + ".waits")
    return [float(x) for x in path.read_text().split()] if path.exists() else []


def _train(
    c4, tmp_path: Path, name: str, *overrides: str, no_backoff_wait=False
) -> subprocess.CompletedProcess:
    record = tmp_path / f"{name}.record"
    cmd = [sys.executable, "-m", "diloco.train", *RUN, f"out_dir={tmp_path}", f"run_name={name}", *overrides]
    env = _env(c4, record, no_backoff_wait=no_backoff_wait)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["Loss"]) for r in records if "Loss" in r]


def _data_state(run_dir: Path) -> dict:
    from diloco import checkpoint

    ckpt = checkpoint.latest(run_dir)
    return torch.load(ckpt / "rank0.pt", map_location="cpu", weights_only=False)["data"]


# ------------------------------------------------------------------------------------------ the streams
def test_streams_read_the_repositorys_documents_split_and_sharded(c4, tmp_path):
    whole = (0, 1)
    queries = [
        ("train", "train", 0, 1, {}, whole),
        ("validation", "validation", 0, 1, {}, whole),
        ("report", "validation", 0, 1, {"eval_subset": "report"}, whole),
        ("tune", "validation", 0, 1, {"eval_subset": "tune"}, whole),
    ]
    noniid = {"sharding": "noniid", "noniid_key": "domain"}
    for n in (2, 3):
        for s in range(n):
            queries.append((f"iid{n}.{s}", "train", s, n, {}, whole))
            queries.append((f"noniid{n}.{s}", "train", s, n, noniid, whole))
    # a DumbDiLoCo node's shard (data.shard) split among the node's 2 ranks
    for r in range(2):
        queries.append((f"node0of2.{r}", "train", 0, 2, {}, (r, 2)))
        queries.append((f"node1of3.{r}", "train", 1, 3, {}, (r, 2)))
        queries.append((f"noniid-node1of2.{r}", "train", 1, 2, noniid, (r, 2)))
    c4.reset_counters()
    record = tmp_path / "probe.record"
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(queries)],
        cwd=ROOT,
        env=_env(c4, record),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])

    train, val = _docs(c4, "train"), _docs(c4, "validation")
    assert (
        got["train"] == train and len(train) == TRAIN_FILES * DOCS_PER_TRAIN_FILE
    )  # every document, in order
    assert got["validation"] == val
    # evaluation's halves: even- and odd-numbered documents of the validation split
    assert got["report"] == val[0::2] and got["tune"] == val[1::2]
    # i.i.d.: 4 files over 2 workers is file-wise (files r, r+2), over 3 it is every 3rd document
    files = _file_docs(c4, "train")
    for s in range(2):
        assert got[f"iid2.{s}"] == [d for f in files[s::2] for d in f]
    for s in range(3):
        assert got[f"iid3.{s}"] == train[s::3]
    # non-i.i.d. by domain: each site on exactly one shard, every shard has some, nothing lost or doubled
    for n in (2, 3):
        shards = [got[f"noniid{n}.{s}"] for s in range(n)]
        assert sorted(d for sh in shards for d in sh) == sorted(train)
        sites = [{_domain(d[2]) for d in sh} for sh in shards]
        assert all(sites) and sum(len(x) for x in sites) == len(set().union(*sites)) == len(SITES)
        for sh in shards:  # and each shard keeps the split's order
            assert sh == [d for d in train if d in sh]
    # a DumbDiLoCo node's 2 ranks split the node's own shard: its 2 files one each, or its every-3rd
    # documents every 6th (before, they split the whole split again and read other nodes' files)
    for r in range(2):
        assert got[f"node0of2.{r}"] == files[0::2][r]
        assert got[f"node1of3.{r}"] == train[1 + 3 * r :: 6]
    assert sorted(got["node1of3.0"] + got["node1of3.1"]) == sorted(got["iid3.1"])
    assert sorted(got["noniid-node1of2.0"] + got["noniid-node1of2.1"]) == sorted(got["noniid2.1"])
    assert not {tuple(d) for d in got["noniid-node1of2.0"]} & {tuple(d) for d in got["noniid-node1of2.1"]}
    # the client made only calls this Hub models; the one it refused was the dataset viewer (another host)
    assert c4.unknown == []
    assert _refused(record) <= {f"datasets-server.{urlsplit(c4.url).hostname}"}
    assert c4.counts["dataset_resolve_get"] > len(c4.files)  # files read in several ranges


# ------------------------------------------------------------------------------------------ training runs
@pytest.fixture(scope="module")
def full_run(c4, tmp_path_factory):
    """An uninterrupted run over the loopback Hub, and the same run on the files read from disk."""
    tmp = tmp_path_factory.mktemp("c4_runs")
    hub = _train(c4, tmp, "hub", "train.checkpoint_every=0")
    assert hub.returncode == 0, hub.stderr[-3000:]
    local = c4.local
    disk = _train(
        c4,
        tmp,
        "disk",
        "train.checkpoint_every=0",
        "data.path=json",
        "data.config_name=null",
        f"+data.data_files.train={local}/c4-train.*.json.gz",
        f"+data.data_files.validation={local}/c4-validation.*.json.gz",
    )
    assert disk.returncode == 0, disk.stderr[-3000:]
    # the one call refused was the dataset viewer's (another host), as for C4 on the real Hub
    assert _refused(tmp / "hub.record") <= {f"datasets-server.{urlsplit(c4.url).hostname}"}
    return tmp / "hub", tmp / "disk"


def test_a_c4_run_trains_on_exactly_the_files_documents(full_run):
    hub, disk = full_run
    losses = _losses(hub)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    assert losses == _losses(disk)  # the same sequences, in the same order, as the files read locally
    state = _data_state(hub)  # 18 steps x 4 documents = the 64 of the split, then 8 of its second epoch
    assert state["epoch"] == 1
    summary = json.loads((hub / "summary.json").read_text())
    assert summary["status"] == "completed"


@pytest.fixture(scope="module")
def stopped_and_resumed(c4, tmp_path_factory):
    """A run stopped by a failure no retry cures (a 403 on the third train file, after the checkpoint
    at step 5, mid-file), then rerun with the same command while the Hub drops a connection mid-response,
    answers a 500 and a 429 (Retry-After 7), and drops one request more often than huggingface_hub
    retries it (6 times; on a file's third request, after gzip has decompressed its second within the
    same read: datasets' own retry of that read lost those bytes, now the stream is reopened)."""
    tmp = tmp_path_factory.mktemp("c4_stopped")
    get = "dataset_resolve_get"
    c4.clear_faults()
    c4.fail_next(1, kinds=get, path="train.00002", skip=1, status=403)
    try:
        stopped = _train(c4, tmp, "run", "train.checkpoint_every=5")
        left = c4.faults_left()
    finally:
        c4.clear_faults()
    assert left == 0, stopped.stderr[-3000:]
    stopped_losses = _losses(tmp / "run")
    # each file is three range requests here; `skip` counts the requests a fault lets through (retries
    # included; a request is met by the first fault that matches it)
    c4.fail_next(1, kinds=get, path="train.00001", skip=1, drop_after=1000)  # cut mid-response
    c4.fail_next(1, kinds=get, path="train.00002", status=500)
    c4.fail_next(1, kinds=get, path="train.00003", skip=2, status=429, retry_after=7)
    c4.fail_next(6, kinds=get, path="train.00002", skip=2, drop_after=1000)
    try:
        resumed = _train(c4, tmp, "run", "train.checkpoint_every=5", no_backoff_wait=True)
        left = c4.faults_left()
    finally:
        c4.clear_faults()
    assert left == 0, resumed.stderr[-3000:]  # every fault was met
    return stopped, stopped_losses, resumed, tmp / "run"


def test_a_failure_no_retry_cures_stops_the_run_with_one_line(stopped_and_resumed):
    stopped, losses, _, _ = stopped_and_resumed
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("error: reading data split 'train' of allenai/c4 failed: HfHubHTTPError: ")
    assert (
        "403" in last and "/en/c4-train.00002-of-00004.json.gz)" in last and "rerun the same command" in last
    )
    assert 5 <= losses[-1][0] < STEPS  # it had trained past its checkpoint at step 5


def test_the_rerun_resumes_at_the_next_document(stopped_and_resumed, full_run):
    _, _, resumed, run_dir = stopped_and_resumed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 5" in resumed.stderr  # document 20 of 64, mid-file
    assert _losses(run_dir) == _losses(full_run[0])  # bit for bit, through every injected fault


def test_dropped_connections_500s_and_429s_are_retried_without_changing_a_loss(stopped_and_resumed):
    _, _, resumed, run_dir = stopped_and_resumed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("reopening it at the next document") == 1  # the one past the client's retries
    assert 8.0 in _waits(run_dir.parent / "run.record")  # the 429's Retry-After (7 s, +1 s) was honoured


def test_domains_of_the_fixture_reach_every_noniid_shard():
    """The fixture's sites hash onto every shard of 2 and of 3 (else a noniid shard would be empty)."""
    from diloco.data import noniid_shard_of

    for n in (2, 3):
        assert {noniid_shard_of(f"https://{s}/x", "domain", n) for s in SITES} == set(range(n))


def test_the_fixture_is_c4s_format(c4):
    stored = c4.datasets[REPO].head.files
    for path, docs in c4.files.items():
        assert re.fullmatch(r"en/c4-(train|validation)\.\d{5}-of-\d{5}\.json\.gz", path)
        first = gzip.decompress(stored[path]).split(b"\n", 1)[0].decode()
        assert first == json.dumps(docs[0], separators=(",", ":"))  # compact, text/timestamp/url
    assert len({_domain(d["url"]) for ds in c4.files.values() for d in ds}) == len(SITES)
