"""raydiff's cluster files checked offline, before anything is launched: Ray cluster-launcher configs
(`launcher`) and KubeRay manifests (`kuberay`), each against Ray's or KubeRay's own rules, raydiff's needs and
the preset it runs (`shared`). `python -m raydiff.cluster_check` is the command over `check_file`."""

from __future__ import annotations

from pathlib import Path

import yaml

from raydiff.cluster.files.kuberay import check_kuberay, is_kuberay
from raydiff.cluster.files.launcher import check_launcher
from raydiff.cluster.files.shared import ClusterFileError

__all__ = ["ClusterFileError", "check_file"]


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
    if not docs or not all(isinstance(d, dict) for d in docs):
        raise ClusterFileError("expected YAML mappings: a cluster-launcher config or KubeRay manifests")
    if any(is_kuberay(d) for d in docs):
        check_kuberay(docs)
    elif len(docs) == 1 and {"cluster_name", "provider", "available_node_types"} & set(docs[0]):
        check_launcher(docs[0], text)
    else:
        raise ClusterFileError("neither a Ray cluster-launcher config (cluster_name, provider, available_node_types) "
                               "nor a KubeRay manifest (apiVersion: ray.io/v1, kind: RayCluster or RayJob)")

