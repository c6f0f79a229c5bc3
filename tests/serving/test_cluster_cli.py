"""`tercel serve --replicas N` refuses what cannot run before loading anything: without Ray Serve
installed, more than one replica exits 2 with the install hint; bad replica flags exit 2 too."""
from __future__ import annotations

import pytest

import serving.cluster.flags
from serving.cli import main


def test_replicas_without_ray_exit_2_with_the_install_hint(monkeypatch, capsys):
    """No `cluster` extra: --replicas 2 is exit status 2 and names `pip install -e ".[cluster]"`."""
    monkeypatch.setattr(serving.cluster.flags, "ray_serve_available", lambda: False)
    assert main(["serve", "--replicas", "2"]) == 2
    assert 'pip install -e ".[cluster]"' in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [(["--replicas", "0"], "--replicas must be >= 1"),
                                            (["--replicas", "2", "--affinity-chunk-chars", "0"], "chunk_chars"),
                                            (["--replicas", "2", "--affinity-imbalance", "-1"], "imbalance")])
def test_bad_replica_flags_exit_2(monkeypatch, capsys, flags, message):
    """Checked whether or not Ray is installed, before a model loads."""
    monkeypatch.setattr(serving.cluster.flags, "ray_serve_available", lambda: True)
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err
