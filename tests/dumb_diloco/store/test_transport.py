"""DumbDiLoCo transport: shared-directory repository and the Hub through the real client.

The Hub tests run `huggingface_hub` unmodified against src/diloco/testing/hub_server.py on loopback.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback

import pytest
import torch

from diloco.dumb_diloco.store.budget import commit_budget
from diloco.dumb_diloco.store.transport import (
    DirectoryTransport,
    FileTooLarge,
    HubTransport,
    ReadsInto,
    RemoteFile,
    RemoteNotFound,
    RetryPolicy,
    RevisionConflict,
    TransientError,
    Transport,
    TransportError,
    open_transport,
)
from diloco.dumb_diloco.wire.tensor_format import InvalidTensorFile, encode

pytestmark = pytest.mark.usefixtures("no_network")

W, S = "global/latest.safetensors", "global/step_count.json"
FAKE_TOKEN = "hf_FakeTokenDoNotLog0123456789abcdef"
FAST = RetryPolicy(max_attempts=5, base_delay_s=0.001, max_delay_s=0.01, max_total_s=30)

BAD_PATHS = [
    "/abs",
    "../x",
    "a/../b",
    "a\\b",
    "a\nb",
    "a\x7fb",
    "",
    "a//b",
    "./a",
    "a/",
    ".dumb_diloco/x",
    ".git/x",
]


def _tensor_file(n: int = 1000) -> bytes:
    return encode({"w": torch.arange(n, dtype=torch.float32), "b": torch.ones(3)}, {"k": "v"})


# ============================================================== shared directory


@pytest.fixture
def repo(tmp_path) -> DirectoryTransport:
    return DirectoryTransport(tmp_path / "repo")


def test_directory_write_list_read_delete(repo):
    assert isinstance(repo, Transport)
    r0 = repo.revision()
    r1 = repo.write({W: b"weights-1", S: b'{"outer_step": 1}'}, message="round 1", parent_revision=r0)
    r2 = repo.write({"nodes/w1/delta_500.safetensors": b"d1"})
    assert r0 < r1 < r2
    assert repo.list("") == [
        RemoteFile(W, 9),
        RemoteFile(S, 17),
        RemoteFile("nodes/w1/delta_500.safetensors", 2),
    ]
    assert repo.list("nodes/") == [RemoteFile("nodes/w1/delta_500.safetensors", 2)]
    assert repo.list("nodes/w1") == repo.list("nodes")
    assert repo.list("missing") == [] and repo.list("global", r0) == []
    assert repo.read(S) == b'{"outer_step": 1}'
    r3 = repo.delete(["nodes/w1/delta_500.safetensors"])
    assert repo.list("nodes") == [] and repo.revision() == r3
    with pytest.raises(RemoteNotFound):
        repo.read("nodes/w1/delta_500.safetensors")
    # pinned to an older revision, the deleted file is still there (grace period)
    assert repo.read("nodes/w1/delta_500.safetensors", revision=r2) == b"d1"
    with pytest.raises(RemoteNotFound):
        repo.delete(["nodes/w1/delta_500.safetensors"])
    assert repo.write({}) == r3  # empty unit: no new revision


def test_directory_plain_paths_are_readable_by_cat(repo):
    repo.write({W: b"w1", S: b"1"})
    repo.write({W: b"w2", S: b"2"})
    assert (repo.root / W).read_bytes() == b"w2" and (repo.root / S).read_bytes() == b"2"
    assert (repo.root / S).is_symlink()
    repo.delete([S])
    assert not (repo.root / S).exists() and (repo.root / W).exists()


def test_directory_revision_pinning_and_conflicts(repo):
    r1 = repo.write({W: b"a", S: b"1"})
    r2 = repo.write({W: b"bb", S: b"2"}, parent_revision=r1)
    assert repo.read(W, revision=r1) == b"a" and repo.read(W, revision=r2) == b"bb"
    assert repo.list("global", revision=r1) == [RemoteFile(W, 1), RemoteFile(S, 1)]
    with pytest.raises(RevisionConflict):
        repo.write({W: b"c"}, parent_revision=r1)
    assert repo.read(W) == b"bb"
    with pytest.raises(RemoteNotFound, match="unknown revision"):
        repo.read(W, revision="000000009999")
    with pytest.raises(RemoteNotFound, match="unknown revision"):
        repo.read(W, revision="not-a-revision")


def test_directory_caps_and_headers(repo):
    blob = _tensor_file()
    repo.write({"nodes/a/delta_1.safetensors": blob, "junk.safetensors": b"\x10" + bytes(20)})
    with pytest.raises(FileTooLarge):
        repo.read("nodes/a/delta_1.safetensors", max_bytes=len(blob) - 1)
    assert repo.read("nodes/a/delta_1.safetensors", max_bytes=len(blob)) == blob
    header = repo.read_header("nodes/a/delta_1.safetensors")
    assert header.tensors["w"].shape == (1000,) and header.metadata["k"] == "v"
    assert header.file_size == len(blob)
    with pytest.raises(InvalidTensorFile):
        repo.read_header("junk.safetensors")
    with pytest.raises(RemoteNotFound):
        repo.read_header("nodes/a/delta_2.safetensors")


def test_directory_read_into_gives_the_bytes_of_read_in_a_reused_buffer_and_caps_before_reading(repo):
    big, small = _tensor_file(1000), _tensor_file(10)
    r1 = repo.write({"nodes/a/delta_1.safetensors": big, "nodes/a/delta_2.safetensors": small})
    repo.write({"nodes/a/delta_1.safetensors": small})
    assert isinstance(repo, ReadsInto) and isinstance(repo, Transport)
    view = repo.read_into("nodes/a/delta_1.safetensors", None, revision=r1, max_bytes=len(big))
    assert bytes(view) == repo.read("nodes/a/delta_1.safetensors", revision=r1) == big
    buffer = view.obj
    assert isinstance(buffer, bytearray) and len(buffer) == len(big)
    again = repo.read_into("nodes/a/delta_2.safetensors", buffer)  # fits: read into the same buffer
    assert again.obj is buffer and bytes(again) == repo.read("nodes/a/delta_2.safetensors") == small
    assert bytes(repo.read_into("nodes/a/delta_1.safetensors", buffer)) == small  # the newest version
    tiny = bytearray(8)
    grown = repo.read_into("nodes/a/delta_1.safetensors", tiny, revision=r1)  # too small: a new buffer
    assert grown.obj is not tiny and bytes(grown) == big and tiny == bytearray(8)
    before = bytes(buffer)
    with pytest.raises(FileTooLarge):  # refused from its size: nothing is read into the buffer
        repo.read_into("nodes/a/delta_1.safetensors", buffer, revision=r1, max_bytes=len(big) - 1)
    assert bytes(buffer) == before
    with pytest.raises(RemoteNotFound):
        repo.read_into("nodes/a/delta_3.safetensors", buffer)
    stored, _ = repo.locate("nodes/a/delta_2.safetensors", int(repo.revision()))
    with open(stored, "ab") as f:  # a file grown behind the log's back: capped by its size on disk too
        f.write(bytes(100))
    with pytest.raises(FileTooLarge):
        repo.read_into("nodes/a/delta_2.safetensors", buffer, max_bytes=len(small) + 99)


@pytest.mark.parametrize("bad", BAD_PATHS)
def test_directory_rejects_bad_paths(repo, bad):
    with pytest.raises(ValueError):
        repo.write({bad: b"x"})
    with pytest.raises(ValueError):
        repo.read(bad)
    with pytest.raises(ValueError):
        repo.delete([bad])


def test_directory_rejects_file_directory_clash(repo):
    repo.write({"a/b": b"1"})
    with pytest.raises(ValueError, match="is a file"):
        repo.write({"a/b/c": b"2"})
    with pytest.raises(ValueError, match="is a directory"):
        repo.write({"a": b"3"})
    with pytest.raises(ValueError, match="both written and deleted"):
        repo.write({"x": b"1"}, delete=["x"])


def test_directory_temp_and_uncommitted_files_are_never_listed(repo):
    r1 = repo.write({"nodes/a/delta_1.safetensors": b"1"})
    index = repo.root / ".dumb_diloco" / "files" / "nodes" / "a"
    # a writer staging a file, and one that crashed after naming its file but before committing
    (index / ".delta_2.safetensors.0123456789abcdef.tmp").write_bytes(b"partial")
    head = int(r1)
    (index / f"delta_3.safetensors@{head + 1:012d}-0123456789abcdef").write_bytes(b"crashed")
    (repo.root / "nodes" / "a" / ".delta_4.safetensors.lnk").write_bytes(b"x")
    assert repo.list("") == [RemoteFile("nodes/a/delta_1.safetensors", 1)]
    # the next commit takes the crashed writer's revision number; its file stays invisible
    repo.write({"nodes/b/delta_1.safetensors": b"2"})
    assert [f.path for f in repo.list("nodes")] == [
        "nodes/a/delta_1.safetensors",
        "nodes/b/delta_1.safetensors",
    ]
    with pytest.raises(RemoteNotFound):
        repo.read("nodes/a/delta_3.safetensors")


def test_directory_multi_file_write_is_atomic_for_a_concurrent_reader(tmp_path):
    writer = DirectoryTransport(tmp_path / "repo")
    reader = DirectoryTransport(tmp_path / "repo")  # another "host": its own caches
    writer.write({W: b"w0", S: b"0"})
    units = 40
    done = threading.Event()
    seen: list[tuple[bytes, bytes]] = []
    errors: list[BaseException] = []
    progress = threading.Condition()

    def read_loop():
        try:
            while not done.is_set():
                rev = reader.revision()
                w, s = reader.read(W, revision=rev), reader.read(S, revision=rev)
                listed = {f.path: f.size for f in reader.list("global", revision=rev)}
                assert listed == {W: len(w), S: len(s)}
                with progress:
                    seen.append((w, s))
                    progress.notify_all()
        except BaseException as err:  # surfaced below
            errors.append(err)
            with progress:
                progress.notify_all()

    thread = threading.Thread(target=read_loop)
    thread.start()
    try:
        for i in range(1, units + 1):
            # the sizes differ between units too, so a mix would show in the listing as well
            writer.write({W: b"w%d" % i + b"." * i, S: b"%d" % i})
            # The reader reads on while the next write runs. Before it, wait for two more of its reads: the
            # second began after this write, so every unit is seen, however the threads are scheduled.
            with progress:
                n = len(seen)
                progressed = progress.wait_for(lambda n=n: errors or len(seen) >= n + 2, timeout=60)
            assert progressed and not errors, errors[0] if errors else "the reader stalled"
    finally:
        done.set()
        thread.join(60)
    assert not errors, errors[0]
    for w, s in seen:
        assert w.split(b".")[0] == b"w" + s, (w, s)  # both files from the same unit
    assert {s for _, s in seen} >= {b"%d" % i for i in range(1, units + 1)}


def test_directory_concurrent_writers_lose_nothing(tmp_path):
    DirectoryTransport(tmp_path / "repo")
    per_node, nodes = 8, 4
    revisions: list[str] = []
    lock = threading.Lock()

    def node(k: int):
        t = DirectoryTransport(tmp_path / "repo")
        for step in range(per_node):
            rev = t.write({f"nodes/n{k}/delta_{step}.safetensors": b"%d" % step})
            with lock:
                revisions.append(rev)

    threads = [threading.Thread(target=node, args=(k,)) for k in range(nodes)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    t = DirectoryTransport(tmp_path / "repo")
    assert len(t.list("nodes")) == per_node * nodes
    assert len(set(revisions)) == per_node * nodes  # every unit its own revision
    assert int(t.revision()) == per_node * nodes


class _WallClock:
    """The transport module's `time`, with a wall clock (time.time) that moves only when told to."""

    def __init__(self):
        self.now = time.time()

    def time(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def test_directory_old_versions_kept_for_grace_period_then_collected(tmp_path, monkeypatch):
    import diloco.dumb_diloco.store.directory as directory_module

    clock = _WallClock()  # commit times and the collector's "now" come from it: no race with a slow disk
    monkeypatch.setattr(directory_module, "time", clock)
    repo = DirectoryTransport(tmp_path / "repo", keep_old_versions_s=0.3)
    r1 = repo.write({W: b"old", S: b"1"})
    repo.write({W: b"new", S: b"2"})
    r3 = repo.delete([S])
    assert repo.read(W, revision=r1) == b"old" and repo.read(S, revision=r1) == b"1"
    clock.now += 0.4
    repo.write({W: b"newest"})  # collection runs in writers, on the directories they touch
    with pytest.raises(RemoteNotFound):
        repo.read(W, revision=r1)
    with pytest.raises(RemoteNotFound):
        repo.read(S, revision=r1)
    assert repo.read(W) == b"newest" and repo.list("global") == [RemoteFile(W, 6)]
    # W as of r3 was superseded just now, so it is still readable; S's versions and its
    # tombstone are older than the grace period and gone
    assert repo.list("global", revision=r3) == [RemoteFile(W, 3)]
    leftovers = [p.name for p in (repo.root / ".dumb_diloco" / "files" / "global").iterdir()]
    assert len(leftovers) == 2 and all(name.startswith("latest.safetensors@") for name in leftovers)


def test_open_transport_dispatch(tmp_path, monkeypatch):
    assert isinstance(open_transport(f"file://{tmp_path}/a"), DirectoryTransport)
    assert isinstance(open_transport(str(tmp_path / "b")), DirectoryTransport)
    monkeypatch.chdir(tmp_path)
    assert isinstance(open_transport("./c"), DirectoryTransport)
    assert (tmp_path / "c" / ".dumb_diloco" / "FORMAT").exists()
    for bad in ["bogus", "a/b/c", "file://otherhost/x"]:
        with pytest.raises(ValueError):
            open_transport(bad)
    with pytest.raises(RemoteNotFound):
        DirectoryTransport(tmp_path / "never-created", create=False)


def test_network_guard_refuses_the_outside_world():
    with pytest.raises(OSError, match="must not touch the network"):
        socket.create_connection(("huggingface.co", 443), timeout=1)
    with pytest.raises(OSError, match="must not touch the network"):
        socket.create_connection(("192.0.2.1", 443), timeout=1)


def test_commit_budget():  # the whole budget: tests/dumb_diloco/store/test_dumb_budget.py
    level, line = commit_budget(8, 60, 3.0, quorum=8).verdict()  # 8 nodes every 180 s: 160 uploads
    assert level == "refuse" and "uploads 160" in line and "128" in line
    assert commit_budget(8, 100, 3.0, quorum=8, lease_seconds=2400).verdict()[0] == "warn"  # 96 + 12 rounds
    assert commit_budget(8, 200, 3.0, quorum=8, lease_seconds=2400).verdict() is None  # 48 + 6 rounds


# ============================================================== Hub through the real client


class Sleeps(list):
    """Records backoff delays instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def _hub(server, **kw) -> HubTransport:
    kw.setdefault("retry", FAST)
    kw.setdefault("token", FAKE_TOKEN)
    return HubTransport("org/run", **kw)  # endpoint from HF_ENDPOINT, set by the fixture


@pytest.fixture
def hub(hub_server):
    hub_server.token = FAKE_TOKEN  # the server refuses requests without it
    return _hub(hub_server)


def test_hub_write_is_one_commit_with_adds_and_deletes(hub, hub_server):
    assert isinstance(hub, Transport) and hub.endpoint == hub_server.url
    r0 = hub.revision()
    r1 = hub.write(
        {W: _tensor_file(), S: b'{"outer_step": 1}', "nodes/a/delta_1.safetensors": b"d"}, parent_revision=r0
    )
    commits = hub_server.counts["commit"]
    r2 = hub.write({S: b'{"outer_step": 2}'}, delete=["nodes/a/delta_1.safetensors"], parent_revision=r1)
    assert hub_server.counts["commit"] == commits + 1
    assert len({r0, r1, r2}) == 3 and hub.revision() == r2
    snap = hub_server.snapshot("org/run")
    assert snap[S] == b'{"outer_step": 2}' and "nodes/a/delta_1.safetensors" not in snap
    assert [f.path for f in hub.list("")] == [".gitattributes", W, S]
    assert hub.list("nodes") == [] and hub.list("nodes", revision=r1) == [
        RemoteFile("nodes/a/delta_1.safetensors", 1)
    ]
    assert hub.commits_last_hour() == 2
    assert hub_server.unknown == []


def test_hub_reads_pinned_to_an_older_sha(hub):
    r1 = hub.write({W: b"w1", S: b"1"})
    hub.write({W: b"w2", S: b"2"})
    r3 = hub.delete([S])
    assert hub.read(W, revision=r1) == b"w1" and hub.read(S, revision=r1) == b"1"
    assert hub.read(W) == b"w2"
    with pytest.raises(RemoteNotFound):
        hub.read(S)
    with pytest.raises(RemoteNotFound):
        hub.read(S, revision=r3)
    with pytest.raises(RemoteNotFound):
        hub.read(W, revision="0" * 40)
    with pytest.raises(RemoteNotFound):
        hub.list("global", revision="0" * 40)
    with pytest.raises(RemoteNotFound):
        hub.delete([S])


def test_hub_read_header_fetches_only_the_header(hub, hub_server):
    blob = _tensor_file(100_000)  # 400 kB payload
    rev = hub.write({"nodes/a/delta_1.safetensors": blob})
    hub_server.reset_counters()
    header = hub.read_header("nodes/a/delta_1.safetensors", revision=rev)
    assert header.tensors["w"].shape == (100_000,) and header.file_size == len(blob)
    assert hub_server.counts["resolve_get"] == 2
    assert hub_server.bytes_out["resolve_get"] == 8 + header.header_len
    assert all(r["range"] for r in hub_server.requests if r["kind"] == "resolve_get")
    hub.write({"junk.safetensors": b"\x40" + bytes(7) + b"{}"})
    with pytest.raises(InvalidTensorFile):
        hub.read_header("junk.safetensors")
    hub.write({"tiny.safetensors": b"abc"})
    with pytest.raises(InvalidTensorFile, match="too short"):
        hub.read_header("tiny.safetensors")


def test_hub_read_cap(hub):
    blob = _tensor_file()
    hub.write({"f.safetensors": blob})
    with pytest.raises(FileTooLarge):
        hub.read("f.safetensors", max_bytes=len(blob) - 1)
    assert hub.read("f.safetensors", max_bytes=len(blob)) == blob


def test_hub_stale_parent_is_a_revision_conflict_not_retried(hub, hub_server):
    r1 = hub.write({S: b"1"})
    hub.write({S: b"2"})
    before = hub_server.counts["commit"]
    with pytest.raises(RevisionConflict):
        hub.write({S: b"3"}, parent_revision=r1)
    assert hub_server.counts["commit"] == before + 1
    assert hub.read(S) == b"2"


@pytest.mark.parametrize(
    "fault",
    [
        {"status": 429, "retry_after": 7},
        {"status": 503},
        {"status": 500},
        {"drop": True},
    ],
    ids=["429-retry-after", "503", "500", "dropped-connection"],
)
def test_hub_commit_retries_then_succeeds(hub_server, fault):
    sleeps = Sleeps()
    hub = _hub(hub_server, sleep=sleeps)
    r1 = hub.write({S: b"1"})
    hub_server.fail_next(2, kinds="commit", **fault)
    r2 = hub.write({S: b"2"}, parent_revision=r1)
    assert hub.read(S, revision=r2) == b"2"
    assert len(hub_server.repos["org/run"].order) == 3  # initial, r1, r2: no duplicate commit
    assert len(sleeps) == 2
    if "retry_after" in fault:
        assert min(sleeps) >= 7


def test_hub_lost_commit_response_is_not_sent_twice(hub, hub_server):
    r1 = hub.write({S: b"1"})
    hub_server.fail_next(1, kinds="commit", drop=True, after_apply=True)
    r2 = hub.write({S: b"2", W: b"w"}, parent_revision=r1)  # no spurious RevisionConflict
    order = hub_server.repos["org/run"].order
    assert len(order) == 3 and r2 == order[-1]
    assert hub_server.snapshot("org/run")[S] == b"2"


def test_hub_reads_and_lists_retry(hub, hub_server):
    hub.write({S: b"1"})
    hub_server.fail_next(2, kinds=("resolve_get", "repo_info"), status=503)
    hub_server.fail_next(1, kinds="resolve_get", drop=True)
    assert hub.revision()  # 1 failure
    assert hub.read(S) == b"1"  # 1 failure + 1 drop
    hub_server.fail_fraction(0.3, status=502, seed=1, kinds="resolve_get")
    for _ in range(10):
        assert hub.read(S) == b"1"


def test_hub_gives_up_after_max_attempts(hub_server):
    sleeps = Sleeps()
    hub = _hub(hub_server, retry=RetryPolicy(max_attempts=3, base_delay_s=1, max_delay_s=4), sleep=sleeps)
    hub_server.fail_next(10, kinds="commit", status=503)
    with pytest.raises(TransientError, match=r"gave up after 3 attempt\(s\).*503") as info:
        hub.write({S: b"1"})
    assert isinstance(info.value, TransportError)
    assert len(sleeps) == 2 and 0.5 <= sleeps[0] <= 1 and 1 <= sleeps[1] <= 2  # jittered exponential backoff


def test_hub_gives_up_when_retry_after_exceeds_the_time_budget(hub_server):
    sleeps = Sleeps()
    hub = _hub(hub_server, retry=RetryPolicy(max_total_s=60), sleep=sleeps)
    hub_server.fail_next(1, kinds="commit", status=429, retry_after=3600)
    with pytest.raises(TransientError, match="429"):
        hub.write({S: b"1"})
    assert sleeps == []


@pytest.mark.parametrize("status", [400, 403, 422])
def test_hub_other_client_errors_are_not_retried(hub, hub_server, status):
    hub_server.fail_next(1, kinds="commit", status=status)
    before = hub_server.counts["commit"]
    with pytest.raises(TransportError, match=str(status)) as info:
        hub.write({S: b"1"})
    assert not isinstance(info.value, TransientError | RevisionConflict)
    assert hub_server.counts["commit"] == before + 1


def test_hub_list_pages_through_the_tree(hub, hub_server):
    hub_server.page_size = 3
    files = {f"nodes/n{i % 3}/delta_{i}.safetensors": b"x" * i for i in range(10)}
    hub.write(files)
    listed = hub.list("nodes")
    assert [f.path for f in listed] == sorted(files)
    assert {f.path: f.size for f in listed} == {p: len(d) for p, d in files.items()}
    assert hub_server.counts["tree"] > 3


@pytest.mark.parametrize("bad", BAD_PATHS)
def test_hub_rejects_bad_paths_before_any_request(hub, hub_server, bad):
    hub_server.reset_counters()
    with pytest.raises(ValueError):
        hub.write({bad: b"x"})
    with pytest.raises(ValueError):
        hub.read(bad)
    assert sum(hub_server.counts.values()) == 0


def test_hub_commit_rate_warning(hub_server, caplog):
    hub = _hub(hub_server, commit_limit_per_hour=4)
    with caplog.at_level(logging.WARNING, logger="diloco.dumb_diloco.transport"):
        for i in range(4):
            hub.write({S: b"%d" % i})
    assert hub.commits_last_hour() == 4
    assert "4 commits to org/run in the last hour" in caplog.text


def test_token_never_logged_or_shown(hub_server, caplog):
    hub_server.token = FAKE_TOKEN
    texts: list[str] = []
    with caplog.at_level(logging.DEBUG):
        hub = _hub(hub_server, retry=RetryPolicy(max_attempts=2, base_delay_s=0.001), sleep=Sleeps())
        texts.append(repr(hub))
        hub.write({S: b"1"})
        hub_server.fail_next(5, kinds="commit", status=429, retry_after=0)
        hub_server.fail_next(1, kinds="resolve_get", status=503)
        for action in (
            lambda: hub.write({S: b"2"}),
            lambda: hub.write({S: b"3"}, parent_revision="0" * 40),
            lambda: hub.read("missing.json"),
            lambda: _hub(hub_server, token="hf_WrongTokenAlsoSecret0123456789"),
        ):
            with pytest.raises(TransportError) as info:
                action()
            err: BaseException | None = info.value
            while err is not None:  # our error and everything chained to it
                texts += [str(err), repr(err), "".join(traceback.format_exception_only(err))]
                err = err.__cause__ or err.__context__
        assert hub.read(S) == b"1"
    texts.append(caplog.text)
    texts += [str(r.args) for r in caplog.records]
    assert "429" in caplog.text  # the failures were logged ...
    for text in texts:
        assert FAKE_TOKEN not in text and "WrongTokenAlsoSecret" not in text  # ... the token never


def test_hub_wrong_token_is_a_clear_error(hub_server):
    hub_server.token = FAKE_TOKEN
    with pytest.raises(TransportError, match="401") as info:
        _hub(hub_server, token="hf_SomeOtherToken000000000000")
    assert not isinstance(info.value, TransientError)


def test_hub_open_transport_and_standard_download(hub_server, tmp_path):
    from huggingface_hub import hf_hub_download

    hub = open_transport("org/run", None, str(tmp_path / "cache"), retry=FAST)
    assert isinstance(hub, HubTransport)
    r1 = hub.write({S: b"1"})
    hub.write({S: b"2"})
    # the stock download path (HEAD + GET on resolve) works against the loopback Hub too
    local = hf_hub_download(
        "org/run", S, revision=r1, cache_dir=str(tmp_path / "cache"), endpoint=hub_server.url
    )
    assert open(local, "rb").read() == b"1"
    assert hub_server.counts["resolve_head"] >= 1 and hub_server.unknown == []


def test_hub_endpoint_comes_from_env_at_construction(hub_server, monkeypatch):
    hub = _hub(hub_server)
    assert hub.endpoint == hub_server.url == os.environ["HF_ENDPOINT"]
    monkeypatch.delenv("HF_ENDPOINT")
    explicit = HubTransport("org/run", token=FAKE_TOKEN, endpoint=hub_server.url + "/", create=False)
    assert explicit.endpoint == hub_server.url
