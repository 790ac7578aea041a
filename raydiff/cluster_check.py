"""Check raydiff's cluster files offline, before anything is launched.

    python -m raydiff.cluster_check FILE [FILE ...]

Each FILE is a Ray cluster-launcher config (cluster/aws.yaml, cluster/gcp.yaml), a KubeRay manifest (apiVersion
ray.io/v1, kind RayCluster or RayJob), or a file of the PersistentVolumeClaims such manifests mount
(cluster/kuberay/volume.yaml, read beside each manifest of its folder). Launcher configs go through Ray's own
validation (`prepare_config`, then `validate_config`); KubeRay manifests through a schema of the fields raydiff
uses (real KubeRay names, no unknown keys) and the names KubeRay accepts. Then both must hold what raydiff needs:
a head that takes no work (CPU 0) and runs the autoscaler, GPU workers that advertise what a Ray Train worker asks
(CPU and GPU; KubeRay: as the operator builds `ray start`), token auth on (KubeRay: with a rayVersion it accepts
for it), a dashboard that is not exposed, one Ray release in every rayproject/ray image (KubeRay: rayVersion's),
GPU VMs that GCE will create (onHostMaintenance TERMINATE), and agreement with the preset the file names
(`# raydiff-preset: NAME`, or the annotation raydiff.dev/preset): elastic `scaling.num_workers: [min, max]` that
the GPU workers can hold, storage that every node shares, and (launcher configs) worker nodes that may read and
write its bucket.
Prints `OK FILE` per good file, and below it the placeholders the file and its preset still hold (`YOUR-BUCKET`,
`ami-YOUR-DLAMI-ID`: the files ship with them, and launch nothing until they are replaced); a bad file is one line
on stderr, and the exit code is 2.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from raydiff import cli
from raydiff.cluster.files import ClusterFileError, check_file


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="python -m raydiff.cluster_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE",
                        help="cluster-launcher YAML, KubeRay manifest or PersistentVolumeClaims")
    args = parser.parse_args(argv)
    failed = False
    for path in args.files:
        try:
            check_file(path)
            print(f"OK {path}")
            left = placeholders(path)
            if left:
                print(f"  before launching, replace: {', '.join(left)}")
        except ClusterFileError as exc:
            print(f"raydiff: error: {path}: {exc}", file=sys.stderr)
            failed = True
    return 2 if failed else 0


PLACEHOLDER = re.compile(r"[\w.-]*YOUR-[A-Z0-9-]*[A-Z0-9]")
PRESET_NAMED = re.compile(r"(?:raydiff-preset|raydiff\.dev/preset):\s*['\"]?([\w.-]+)")


def placeholders(path: Path) -> list[str]:
    """The placeholders a good file and the preset it names still hold, each with where it is."""
    from raydiff.config import resolve_config_path

    text = path.read_text()
    found = [f"{word} ({path.name})" for word in dict.fromkeys(PLACEHOLDER.findall(_uncommented(text)))]
    named = PRESET_NAMED.search(text)
    if named:
        preset = resolve_config_path(named.group(1))
        found += [f"{word} ({named.group(1)})"
                  for word in dict.fromkeys(PLACEHOLDER.findall(_uncommented(Path(preset).read_text())))]
    return found


def _uncommented(text: str) -> str:
    """YAML without its comments (which name placeholders in their instructions)."""
    return "\n".join(line.split(" #", 1)[0] for line in text.splitlines() if not line.lstrip().startswith("#"))


def _entry() -> None:
    cli.exit_with(main)


if __name__ == "__main__":
    _entry()
