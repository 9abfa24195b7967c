"""`tailrace cluster`'s refusals and start-up failures: no model is served here."""
from __future__ import annotations

import logging
import socket
import subprocess
import sys

import pytest

from pipeline.tools import cluster
from web import cli


def test_without_the_router_it_refuses_with_the_install_command(monkeypatch, caplog):
    monkeypatch.setattr(cluster, "router_installed", lambda: False)
    with caplog.at_level(logging.ERROR, logger="tailrace"):
        rc = cli.main(["cluster", "--replicas", "2"])
    assert rc == 2
    assert "pip install 'tailrace[cluster]'" in caplog.text


def test_vllm_routers_pd_mode_needs_the_router_too(monkeypatch, caplog):
    monkeypatch.setattr(cluster, "router_installed", lambda: False)
    with caplog.at_level(logging.ERROR, logger="tailrace"):
        rc = cli.main(["cluster", "--prefill", "1", "--decode", "1",
                       "--pd-router", "vllm-router"])
    assert rc == 2
    assert "pip install 'tailrace[cluster]'" in caplog.text


@pytest.mark.parametrize("argv, words", [
    (["--policy", "fastest"], "invalid choice: 'fastest'"),
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--replicas", "2", "--replica-ports", "9001"], "lists 1 ports for 2 replicas"),
    (["--replicas", "2", "--devices", "0,1,2"], "lists 3 devices for 2 replicas"),
    (["--max-num-seqs", "-3"], "max_num_seqs"),            # a serve flag, checked once
    (["--no-such-flag"], "bad `tailrace serve` flags"),
    (["--pd-router", "vllm-router"], "--pd-router goes with --prefill N --decode M"),
    (["--prefill", "1", "--decode", "1", "--pd-router", "sglang"], "invalid choice: 'sglang'"),
])
def test_bad_flags_are_refused_before_anything_starts(monkeypatch, capsys, argv, words):
    monkeypatch.setattr(cluster, "router_installed", lambda: True)
    with pytest.raises(SystemExit) as info:
        cli.main(["cluster", *argv])
    assert info.value.code == 2
    assert words in capsys.readouterr().err


def test_a_taken_port_fails_at_once(monkeypatch, caplog):
    monkeypatch.setattr(cluster, "router_installed", lambda: True)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="tailrace"):
            rc = cli.main(["cluster", "--port", "0", "--replicas", "1",
                           "--replica-ports", str(port)])
    assert rc == 1
    assert f"cannot listen on http://127.0.0.1:{port} for replica 0" in caplog.text


@pytest.mark.skipif(not cluster.router_installed(), reason="vllm-router is not installed")
def test_a_replica_that_dies_while_starting_stops_the_cluster(tmp_path):
    """Both replicas fail (no such model): the launcher names the one that died, stops the
    other, never starts the router, and exits 1."""
    r = subprocess.run([sys.executable, "-m", "web.cli", "cluster", "--port", "0",
                        "--replicas", "2", str(tmp_path / "no-such-model.gguf")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "does not exist" in r.stderr
    assert "exited with status 1" in r.stderr
    assert "a replica died while the cluster was starting: stopping the cluster" in r.stderr
    assert "router: pid" not in r.stderr and "cluster stopped" in r.stderr
    assert r.stdout == ""                 # no listening line
