"""A local folder the nodes of a multi-node cluster use must be on every node (`raydiff.cluster.storage`): a
local run.storage shared, a local data.source that Ray Data reads seen by every node
(`raydiff.data.sources.check_on_every_node`)."""

from __future__ import annotations

import os

import pytest

from raydiff.cluster import storage
from raydiff.cluster.storage import check_shared_storage, nodes_seeing, unreachable_nodes
from raydiff.config import ConfigError, load_config
from raydiff.data.errors import DataError

TWO_NODES = [{"Alive": True, "NodeID": "a", "NodeManagerAddress": "10.0.0.1"},
             {"Alive": True, "NodeID": "b", "NodeManagerAddress": "10.0.0.2"}]


def seen_on_node_a_only(under: str = ""):
    """A probe for the two nodes above: node b does not see paths under `under` (any path when it is empty)."""
    return lambda path, node_ids: [n == "a" or not path.startswith(under) for n in node_ids]


def two_nodes(monkeypatch) -> None:
    monkeypatch.setattr(storage, "alive_nodes", lambda: TWO_NODES)


@pytest.mark.ray
def test_local_storage_on_a_multi_node_cluster_is_refused_up_front(ray_session, tmp_path, monkeypatch):
    two_nodes(monkeypatch)
    with pytest.raises(ConfigError, match=r"run.storage = .* is not shared: node\(s\) 10.0.0.2 cannot see it.*s3://"):
        check_shared_storage(str(tmp_path), probe=seen_on_node_a_only())
    check_shared_storage(str(tmp_path), probe=lambda path, ids: [True] * len(ids))  # NFS: every node sees it
    check_shared_storage("s3://bucket/runs")  # object stores are shared by nature
    assert not list(tmp_path.iterdir())  # the probe's marker file is gone


@pytest.mark.ray
def test_the_probe_really_runs_on_every_node_and_a_node_that_cannot_answer_is_not_judged(ray_session, tmp_path,
                                                                                          monkeypatch, capsys):
    assert unreachable_nodes(str(tmp_path)) == []  # the session cluster shares this disk
    assert storage.nodes_without(str(tmp_path / "absent")) == [storage.alive_nodes()[0]["NodeManagerAddress"]]
    here = storage.alive_nodes()[0]["NodeID"]
    gone = os.urandom(28).hex()  # a node that left the cluster: its probe cannot be placed
    assert nodes_seeing(str(tmp_path), [here, gone]) == [True, None]
    monkeypatch.setattr(storage, "alive_nodes", lambda: [*TWO_NODES, {"NodeID": "c", "NodeManagerAddress": "10.0.0.3"}])
    assert storage.nodes_without(str(tmp_path), probe=lambda path, ids: [True, False, None]) == ["10.0.0.2"]
    assert f"node(s) 10.0.0.3 did not answer within 60 s whether they see {tmp_path}: not checked there" in (
        capsys.readouterr().out)


@pytest.mark.ray
def test_a_local_source_is_checked_on_every_node(ray_session, tmp_path, monkeypatch):
    from raydiff.data.builtin import write_synthetic
    from raydiff.data.sources import check_on_every_node, open_source

    write_synthetic(tmp_path / "images", num=2, resolution=8)
    source = open_source(str(tmp_path / "images"))
    two_nodes(monkeypatch)
    with pytest.raises(DataError, match=(rf"^data.source = '{source.uri}' is not on every node: node\(s\) 10.0.0.2 "
                                         rf"cannot see {source.files[0]}\. .*s3:// or gs:// URI, or an NFS path.*"
                                         r"`RAY_ADDRESS=local python -m raydiff.prepare FOLDER s3://BUCKET/PREFIX")):
        check_on_every_node(source, probe=seen_on_node_a_only())
    asked: list[list[str]] = []

    def everywhere(path: str, ids: list[str]) -> list[bool]:
        asked.append(ids)
        return [True] * len(ids)

    check_on_every_node(source, probe=everywhere)
    check_on_every_node(source, probe=everywhere)  # a stream's preparation, then Ray Data's read: asked once
    assert asked == [["a", "b"]]
    three = [*TWO_NODES, {"NodeID": "c", "NodeManagerAddress": "10.0.0.3"}]
    monkeypatch.setattr(storage, "alive_nodes", lambda: three)
    check_on_every_node(source, probe=lambda path, ids: [True, True, None])  # c joined, and did not answer
    check_on_every_node(source, probe=everywhere)  # so c is asked again
    check_on_every_node(source, probe=everywhere)
    assert asked == [["a", "b"], ["a", "b", "c"]]
    monkeypatch.setattr(storage, "alive_nodes", lambda: TWO_NODES[:1])
    check_on_every_node(source, probe=seen_on_node_a_only())  # one node: nothing to ask


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
    two_nodes(monkeypatch)
    monkeypatch.setattr(storage, "nodes_seeing", seen_on_node_a_only(str(folder)))
    monkeypatch.setattr(image_store, "DRIVER_DECODE_BYTES", 0)  # decoded by Ray Data's tasks, on any node
    cfg = load_config("smoke", [f"data.source={folder}", f"data.cache={cache}", f"run.storage={tmp_path / 'runs'}",
                                "data.resolution=8", "data.val_images=0", "scaling.num_workers=1"])
    with pytest.raises(DataError, match=rf"^data.source = '{folder}' is not on every node: node\(s\) 10.0.0.2 "):
        run_training(cfg)
    assert not (tmp_path / "runs" / ".raydiff-stream").exists()  # no prepared copy begun

    monkeypatch.setattr(image_store, "DRIVER_DECODE_BYTES", 2 ** 20)
    store = image_store.load_data(cfg.data)  # small and local: decoded here, by nobody else
    assert store.decoded_by == "the driver" and store.num_good == 24
