"""`moeserve serve` refuses bad server flags with a message naming the flag, before starting anything."""
from __future__ import annotations

import socket

import pytest

from moeserve.cli import main
from tests.test_cli import NCCL_USABLE


@pytest.mark.parametrize("flags,needle", [
    (["--port", "70000"], "--port"),
    (["--api-server-count", "0"], "--api-server-count"),
    (["--max-waiting-requests", "0"], "--max-waiting-requests"),
    (["--chat-template", "/no/such/file.jinja"], "--chat-template"),
    (["--max-model-len", "100000"], "--max-model-len"),
    (["--max-model-len", "0"], "--max-model-len must be >= 2, got 0"),
    (["--master-port", "99999"], "--master-port must be in 1..65535"),
    # Refused before the engine-core process starts, not as a traceback from each rank
    pytest.param(["--data-parallel-size", "2", "--distributed-backend", "nccl"], "--distributed-backend nccl",
                 marks=pytest.mark.skipif(NCCL_USABLE, reason="NCCL and a GPU are available here")),
])
def test_bad_server_flags(ckpt_dir, capsys, flags, needle):
    assert main(["serve", ckpt_dir("v3"), *flags]) == 2
    assert needle in capsys.readouterr().err


def test_port_in_use(ckpt_dir, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", ckpt_dir("v3"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err
