"""raydiff's cluster files checked offline, before anything is launched: Ray cluster-launcher configs
(`launcher`) and KubeRay manifests (`kuberay`), each against Ray's or KubeRay's own rules, raydiff's needs and
the preset it runs (`shared`), and files of the PersistentVolumeClaims that KubeRay manifests mount
(cluster/kuberay/volume.yaml). `python -m raydiff.cluster_check` is the command over `check_file`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from raydiff.cluster.files.kuberay import Claim, check_claims, check_kuberay, is_kuberay
from raydiff.cluster.files.launcher import check_launcher
from raydiff.cluster.files.shared import ClusterFileError, as_json, field_path
from raydiff.config.values import YAML_ERRORS

__all__ = ["ClusterFileError", "check_file"]

TAGGED = re.compile(r"(&\S+\s+)?!")  # a node's text that starts with a tag (after its anchor, if any)


def check_file(path: Path) -> None:
    """Raise ClusterFileError if `path` is not a valid raydiff cluster file."""
    try:
        text = path.read_text()
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except FileNotFoundError:
        raise ClusterFileError("no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ClusterFileError(f"cannot read it ({exc})") from None
    except yaml.YAMLError as exc:
        raise ClusterFileError(f"not valid YAML ({str(exc).splitlines()[0]})") from None
    except YAML_ERRORS as exc:  # a value PyYAML cannot build (`lr: !!float x`): ValueError, KeyError, ...
        raise ClusterFileError(_unbuildable(text, exc)) from None
    if not docs or not all(isinstance(d, dict) for d in docs):
        raise ClusterFileError("expected YAML mappings: a cluster-launcher config or KubeRay manifests")
    if any(is_kuberay(d) for d in docs):
        check_kuberay(docs, _claims_beside(path))
    elif all(d.get("kind") == "PersistentVolumeClaim" for d in docs):
        check_claims(docs)
    elif len(docs) == 1 and {"cluster_name", "provider", "available_node_types"} & set(docs[0]):
        check_launcher(docs[0], text)
    else:
        raise ClusterFileError("neither a Ray cluster-launcher config (cluster_name, provider, available_node_types) "
                               "nor a KubeRay manifest (apiVersion: ray.io/v1, kind: RayCluster or RayJob) nor "
                               "PersistentVolumeClaims")


def _claims_beside(path: Path) -> list[Claim]:
    """The PersistentVolumeClaims of the other YAML files in `path`'s folder, with their file names: a manifest's
    volume lives in a file of its own (cluster/kuberay/volume.yaml), so that deleting the cluster keeps it. A file
    that cannot be read is left out here (checked on its own, it is refused)."""
    claims: list[Claim] = []
    for other in sorted([*path.parent.glob("*.yaml"), *path.parent.glob("*.yml")]):
        if other.resolve() == path.resolve():
            continue
        try:
            docs = list(yaml.safe_load_all(other.read_text()))
        except (OSError, UnicodeDecodeError, *YAML_ERRORS):
            continue
        claims += [(other.name, d) for d in docs if isinstance(d, dict) and d.get("kind") == "PersistentVolumeClaim"]
    return claims



def _unbuildable(text: str, exc: Exception) -> str:
    """Where the value is that PyYAML cannot build, and what it must be: its constructor's error names neither."""
    try:
        documents = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError:
        documents = []
    for i, document in enumerate(documents):
        found = _first_unbuildable(document, [])
        if found is None:
            continue
        path, node = found
        where = field_path(path) if len(documents) == 1 else f"document {i + 1}: {field_path(path)}"
        kind = node.tag.rpartition(":")[2]  # tag:yaml.org,2002:float -> float
        if TAGGED.match(text, node.start_mark.index):  # a tag the file wrote, not one YAML read into a plain value
            return (f"not valid YAML: {where} = !!{kind} {as_json(node.value)} is not a valid {kind}; write one, or "
                    f"remove the !!{kind} tag")
        return (f"not valid YAML: {where} = {node.value}: YAML reads it as a {kind} and it is not a valid one; quote "
                f"it if it is text")
    return f"not valid YAML (a tagged value it cannot build: {(str(exc).splitlines() or [type(exc).__name__])[0]})"


def _first_unbuildable(node: yaml.Node, path: list[Any], seen: set[int] | None = None,
                       ) -> tuple[list[Any], yaml.ScalarNode] | None:
    """The path and node of the first scalar under `node` that PyYAML cannot build; None where every one builds.
    An alias is the node it names: each node is looked at once (`&a [*a]` contains itself)."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return None
    seen.add(id(node))
    if isinstance(node, yaml.ScalarNode):
        try:
            yaml.SafeLoader("").construct_object(node)
        except YAML_ERRORS:
            return path, node
        return None
    children: list[tuple[Any, yaml.Node]] = []
    if isinstance(node, yaml.SequenceNode):
        children = list(enumerate(node.value))
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else "?"
            children += [(name, key), (name, value)]
    for part, child in children:
        found = _first_unbuildable(child, [*path, part], seen)
        if found is not None:
            return found
    return None
