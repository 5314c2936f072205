"""Shared pytest fixtures; each section is owned by the part of the code it serves."""

# ======================================================================================
# Whole suite: offline, no W&B network, deterministic single-threaded math where it matters.
# ======================================================================================
import os as _os

_os.environ.setdefault("WANDB_MODE", "disabled")
_os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


# ======================================================================================
# DumbDiLoCo transport fixtures (tests/dumb_diloco/store/test_transport.py, tests/dumb_diloco/wire/test_tensor_format.py):
# a loopback Hugging Face Hub server and a guard that refuses non-loopback connections.
# ======================================================================================
import ipaddress as _dd_ipaddress
import os as _dd_os
import socket as _dd_socket

import pytest as _dd_pytest

# huggingface_hub reads these at import time; set them before anything imports it.
_dd_os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def _dd_is_loopback(address) -> bool:
    if not isinstance(address, tuple) or not address:
        return True  # AF_UNIX and friends
    try:
        return _dd_ipaddress.ip_address(address[0]).is_loopback
    except ValueError:
        return address[0] == "localhost"


@_dd_pytest.fixture
def no_network(monkeypatch):
    """Fail any name lookup or socket connection that is not for a loopback address."""
    real_connect = _dd_socket.socket.connect
    real_getaddrinfo = _dd_socket.getaddrinfo

    def guarded_connect(sock, address):
        if sock.family in (_dd_socket.AF_INET, _dd_socket.AF_INET6) and not _dd_is_loopback(address):
            raise ConnectionRefusedError(f"tests must not touch the network (tried {address!r})")
        return real_connect(sock, address)

    def guarded_getaddrinfo(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if name is not None and not _dd_is_loopback((name,)):
            raise _dd_socket.gaierror(f"tests must not touch the network (tried to resolve {name!r})")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(_dd_socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(_dd_socket, "getaddrinfo", guarded_getaddrinfo)


@_dd_pytest.fixture
def hub_server(monkeypatch, tmp_path, no_network):
    """A started loopback Hub (src/diloco/testing/hub_server.py); HF_ENDPOINT points at it.

    HF_HUB_OFFLINE is removed rather than set: huggingface_hub's offline mode refuses every
    request, loopback included. HF_HOME and the token path move to tmp_path so no real
    credential or cache is used.
    """
    import huggingface_hub.constants as hf_constants

    from diloco.testing.hub_server import HubServer

    server = HubServer().start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    # Import-time copies of the settings above.
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setattr(hf_constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf_home" / "stored_tokens"))
    try:
        yield server
    finally:
        server.stop()


# ======================================================================================
# Whole suite under pytest-xdist (`make test`, --dist loadgroup, issue 54): a test is sent to any idle
# worker, except that the tests of a module with a fixture built once per module (or class) go to one
# worker together, so that fixture is built once, as in a serial run.
# ======================================================================================
_SHARED_SCOPES = ("module", "class", "package")


def pytest_collection_modifyitems(config, items):
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        scopes = {d.scope for ds in (defs.name2fixturedefs.values() if defs else ()) for d in ds}
        if scopes & set(_SHARED_SCOPES):
            item.add_marker(_dd_pytest.mark.xdist_group(item.nodeid.split("::")[0]))
