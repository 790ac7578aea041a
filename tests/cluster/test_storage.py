"""A local folder the nodes of a multi-node cluster use must be on every node (`raydiff.cluster.storage`): a
local run.storage shared, a local data.source that Ray Data reads seen by every node."""

from __future__ import annotations

import pytest

from raydiff.cluster import storage
from raydiff.cluster.storage import check_shared_storage, check_source_on_every_node, unreachable_nodes
from raydiff.config import ConfigError, load_config

TWO_NODES = [{"Alive": True, "NodeID": "a", "NodeManagerAddress": "10.0.0.1"},
             {"Alive": True, "NodeID": "b", "NodeManagerAddress": "10.0.0.2"}]


def seen_on_node_a_only(under: str = ""):
    """A probe for the two nodes above: node b does not see paths under `under` (any path when it is empty)."""
    return lambda path, node_ids: [n == "a" or not path.startswith(under) for n in node_ids]


@pytest.mark.ray
def test_local_storage_on_a_multi_node_cluster_is_refused_up_front(ray_session, tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "alive_nodes", lambda: TWO_NODES)
    with pytest.raises(ConfigError, match=r"run.storage = .* is not shared: node\(s\) 10.0.0.2 cannot see it.*s3://"):
        check_shared_storage(str(tmp_path), probe=seen_on_node_a_only())
    check_shared_storage(str(tmp_path), probe=lambda path, ids: [True] * len(ids))  # NFS: every node sees it
    check_shared_storage("s3://bucket/runs")  # object stores are shared by nature
    assert not list(tmp_path.iterdir())  # the probe's marker file is gone


@pytest.mark.ray
def test_the_probe_really_runs_on_every_node(ray_session, tmp_path):
    assert unreachable_nodes(str(tmp_path)) == []  # the session cluster shares this disk
    assert storage.nodes_without(str(tmp_path / "absent")) == [storage.alive_nodes()[0]["NodeManagerAddress"]]


@pytest.mark.ray
def test_a_local_source_is_checked_on_every_node(ray_session, tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "alive_nodes", lambda: TWO_NODES)
    file = str(tmp_path / "a.png")
    with pytest.raises(ConfigError, match=(r"^data.source = '/data/x' is not on every node: node\(s\) 10.0.0.2 cannot "
                                           rf"see {file}\. .*s3:// or gs:// URI, or an NFS path")):
        check_source_on_every_node("/data/x", file, probe=seen_on_node_a_only())
    check_source_on_every_node("/data/x", file, probe=lambda path, ids: [True] * len(ids))
    monkeypatch.setattr(storage, "alive_nodes", lambda: TWO_NODES[:1])
    check_source_on_every_node("/data/x", file, probe=seen_on_node_a_only())  # one node: nothing to ask


@pytest.mark.ray
@pytest.mark.parametrize("cache", ["memory", "stream"])
def test_a_run_refuses_a_source_other_nodes_cannot_read_before_it_writes_anything(ray_session, tmp_path,
                                                                                 monkeypatch, cache):
    """Through `run_training`, on a cluster whose second node does not see the image folder (it sees the run's
    storage): one line naming the node and what to use instead, before decoding or preparing anything. A folder
    small enough to decode in the driver alone is read nowhere else, so it passes."""
    from raydiff.data import image_store
    from raydiff.data.builtin import write_synthetic
    from raydiff.training.driver import run_training

    folder = tmp_path / "images"
    write_synthetic(folder, num=24, resolution=8)
    monkeypatch.setattr(storage, "alive_nodes", lambda: TWO_NODES)
    monkeypatch.setattr(storage, "nodes_seeing", seen_on_node_a_only(str(folder)))
    monkeypatch.setattr(image_store, "DRIVER_DECODE_BYTES", 0)  # decoded by Ray Data's tasks, on any node
    cfg = load_config("smoke", [f"data.source={folder}", f"data.cache={cache}", f"run.storage={tmp_path / 'runs'}",
                                "data.resolution=8", "data.val_images=0", "scaling.num_workers=1"])
    with pytest.raises(ConfigError, match=rf"^data.source = '{folder}' is not on every node: node\(s\) 10.0.0.2 "):
        run_training(cfg)
    assert not (tmp_path / "runs" / ".raydiff-stream").exists()  # no prepared copy begun

    monkeypatch.setattr(image_store, "DRIVER_DECODE_BYTES", 2 ** 20)
    store = image_store.load_data(cfg.data)  # small and local: decoded here, by nobody else
    assert store.decoded_by == "the driver" and store.num_good == 24
