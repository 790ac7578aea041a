"""Check raydiff's cluster files offline, before anything is launched.

    python -m raydiff.cluster_check FILE [FILE ...]

Each FILE is a Ray cluster-launcher config (cluster/aws.yaml, cluster/gcp.yaml) or a KubeRay manifest
(apiVersion ray.io/v1, kind RayCluster or RayJob, optionally with the PersistentVolumeClaims it mounts).
Launcher configs go through Ray's own validation (`prepare_config`, then `validate_config`); KubeRay manifests
through a schema of the fields raydiff uses (real KubeRay names, no unknown keys). Then both must hold what
raydiff needs: a head that takes no work (CPU 0), GPU workers, token auth on (KubeRay: with a rayVersion it
accepts for it), a dashboard that is not exposed, GPU VMs that GCE will create (onHostMaintenance TERMINATE), and
agreement with the preset the file names (`# raydiff-preset: NAME`, or the annotation raydiff.dev/preset):
elastic `scaling.num_workers: [min, max]` that the GPU workers can hold, storage that every node shares, and
(launcher configs) worker nodes that may read and write its bucket.
Prints `OK FILE` per good file; a bad file is one line on stderr, and the exit code is 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from raydiff import cli
from raydiff.cluster.files import ClusterFileError, check_file


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="python -m raydiff.cluster_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="cluster-launcher YAML or KubeRay manifest")
    args = parser.parse_args(argv)
    failed = False
    for path in args.files:
        try:
            check_file(path)
            print(f"OK {path}")
        except ClusterFileError as exc:
            print(f"raydiff: error: {path}: {exc}", file=sys.stderr)
            failed = True
    return 2 if failed else 0


def _entry() -> None:
    cli.exit_with(main)


if __name__ == "__main__":
    _entry()
