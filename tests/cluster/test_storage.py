"""A local run.storage on a multi-node cluster must be shared by every node (`raydiff.cluster.storage`)."""

from __future__ import annotations

import pytest

from raydiff.cluster.storage import check_shared_storage, unreachable_nodes
from raydiff.config import ConfigError


@pytest.mark.ray
def test_local_storage_on_a_multi_node_cluster_is_refused_up_front(ray_session, tmp_path, monkeypatch):
    import ray

    nodes = [{"Alive": True, "NodeID": "a", "NodeManagerAddress": "10.0.0.1"},
             {"Alive": True, "NodeID": "b", "NodeManagerAddress": "10.0.0.2"}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    with pytest.raises(ConfigError, match=r"run.storage = .* is not shared: node\(s\) 10.0.0.2 cannot see it.*s3://"):
        check_shared_storage(str(tmp_path), probe=lambda path, node: node == "a")
    check_shared_storage(str(tmp_path), probe=lambda path, node: True)  # NFS: every node sees it
    check_shared_storage("s3://bucket/runs")  # object stores are shared by nature
    assert not list(tmp_path.iterdir())  # the probe's marker file is gone


@pytest.mark.ray
def test_the_probe_really_runs_on_every_node(ray_session, tmp_path):
    assert unreachable_nodes(str(tmp_path)) == []  # the session cluster shares this disk
