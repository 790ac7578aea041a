"""What the checks of both kinds of cluster file share: the error they raise, a schema error in one line, and the
preset a file names (loaded, elastic, on storage that every node shares).

A cluster file is judged against the preset it runs, so that `ray up` or `kubectl apply` never starts a cluster
that the run cannot use: too few GPUs for the preset's `scaling.num_workers` max, or a run directory on one
node's disk.
"""

from __future__ import annotations

import datetime
import difflib
import importlib.metadata
import json
import re
from typing import Any

import jsonschema
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from raydiff.cluster.files.kuberay_schema import MIN_KUBERAY, NEWER
from raydiff.config import Config, ConfigError, load_config, preset_names
from raydiff.storage.fs import REMOTE_SCHEMES

# An image of Ray's own (Docker Hub rayproject/ray), its tag, and the release a tag or rayVersion starts with.
RAY_IMAGE = re.compile(r"(?:docker\.io/)?rayproject/ray:([^\s@]+)(?:@\S+)?")
RAY_RELEASE = re.compile(r"v?(\d+(?:\.\d+){0,2})")


class ClusterFileError(ValueError):
    """What is wrong with a cluster file, in one line naming the field and what is allowed."""


def as_json(value: Any) -> str:
    """A value of the file as a message shows it: JSON, with a YAML date as its text (JSON has no dates); Python's
    text of what JSON cannot show (a mapping with a date for a key, a YAML alias that contains itself)."""
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return str(value)


def field_path(path: Any) -> str:
    """A JSON path as YAML people read it: spec.workerGroupSpecs[0].minReplicas."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and re.fullmatch(r"[A-Za-z_][\w-]*", part):
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out or "(top level)"


def schema_message(error: jsonschema.ValidationError, hint: str = "") -> str:
    """One line for a schema error: the field, the bad value or key, and what is allowed."""
    where, kind, value = field_path(error.absolute_path), error.validator, error.instance
    if kind == "additionalProperties" and isinstance(value, dict):
        allowed = list(error.schema.get("properties", {}))
        bad = min(set(value) - set(allowed), key=str)  # YAML keys may be numbers, dates or null too
        newer = error.schema.get(NEWER, {}).get(bad)
        if newer:  # a real KubeRay field, but the supported operators' CRDs lack it
            return (f"{where}: '{bad}' needs KubeRay {newer} or newer; the manifests support KubeRay {MIN_KUBERAY}, "
                    f"whose CRD lacks it (the API server would drop it): remove it")
        close = difflib.get_close_matches(str(bad), allowed, n=1)
        suggestion = f" (did you mean '{close[0]}'?)" if close else ""
        return f"{where}: unknown key '{bad}'{suggestion}; allowed: {', '.join(allowed)}"
    if kind == "required":
        missing = [key for key in error.validator_value if key not in value]
        return f"{where}: missing required key '{missing[0]}'"
    if kind == "const":
        return f"{where} = {as_json(value)}: must be {json.dumps(error.validator_value)}{hint}"
    if kind == "enum":
        return f"{where} = {as_json(value)}: allowed: {', '.join(json.dumps(a) for a in error.validator_value)}"
    if kind == "minimum":
        return f"{where} = {value}: must be >= {error.validator_value}"
    if kind == "type":
        # YAML reads 8, 1.5 and 2024-01-01 unquoted as a number or a date, not text
        unquoted = error.validator_value == "string" and isinstance(value, (int, float, datetime.date))
        quote = f' (quote it: "{value}")' if unquoted else ""
        types = error.validator_value
        expected = " or ".join(types) if isinstance(types, list) else types
        return f"{where} = {as_json(value)}: expected {expected}{quote}"
    return f"{where}: {error.message}"


def _ray_images(tree: Any, path: list[Any], seen: set[int]) -> list[tuple[str, str]]:
    """(field, image) of every rayproject/ray image named in `tree`, in file order."""
    if id(tree) in seen:  # a YAML alias that contains itself
        return []
    seen.add(id(tree))
    if isinstance(tree, str):
        return [(field_path(path), tree)] if RAY_IMAGE.fullmatch(tree.strip()) else []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    return [found for key, value in items for found in _ray_images(value, [*path, key], seen)]


def ray_release(text: str) -> str:
    """The Ray release a rayVersion or an image tag names, as major.minor.patch ("2.60" and "v2.60.0" are
    2.60.0); a tag that names none (latest, nightly) as written."""
    found = RAY_RELEASE.match(text)
    if found is None:
        return text
    return ".".join([*found.group(1).split("."), "0", "0"][:3])


def _image_release(image: str) -> str:
    """The Ray release of a rayproject/ray image: its tag up to the first '-' (2.60.0-py311-gpu: 2.60.0)."""
    found = RAY_IMAGE.fullmatch(image.strip())
    return ray_release((found.group(1) if found else image).split("-")[0])


def check_ray_images(tree: dict[str, Any], version: tuple[str, str] | None = None) -> None:
    """Every rayproject/ray image of one file is the same Ray release, and (KubeRay) the one `version` names.

    :param version: the field that names the images' Ray release, and its value (KubeRay's rayVersion).
    """
    images = _ray_images(tree, [], set())
    if not images:
        return
    first_where, first = images[0]
    release = _image_release(first)
    for where, image in images[1:]:
        if _image_release(image) != release:
            raise ClusterFileError(f"{first_where} = {first} and {where} = {image}: two Ray releases in one cluster; "
                                   f"a node of another release cannot join it: give every image the same Ray "
                                   f"version")
    if version is not None and RAY_RELEASE.match(release) and ray_release(version[1]) != release:
        raise ClusterFileError(f"{version[0]} = {json.dumps(version[1])}, but {first_where} = {first}: set "
                               f"rayVersion to the images' Ray version (KubeRay decides by it what the cluster "
                               f"supports, token auth included)")
    supported = supported_ray()
    if supported is not None and RAY_RELEASE.match(release) and not supported.contains(release):
        raise ClusterFileError(f"{first_where} = {first}: Ray {release}, which raydiff does not run on (it needs "
                               f"ray{supported}, pyproject.toml); use an image of such a release in every node type")


def supported_ray() -> SpecifierSet | None:
    """The Ray releases raydiff runs on, as its installed metadata says (pyproject.toml's `ray` requirement): the
    job's driver and workers run on the images' Ray. None where raydiff is not installed (its source alone)."""
    try:
        requirements = importlib.metadata.requires("raydiff") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for text in requirements:
        requirement = Requirement(text)
        if requirement.name == "ray" and requirement.marker is None:
            return requirement.specifier
    return None


def load_preset(name: str | None, source: str, how: str) -> tuple[str, Config]:
    """The preset a cluster file names, loaded; it must be elastic so that the autoscaler has a max to reach.

    :param source: where the file names it; :param how: how to name one, for the message when it does not.
    """
    if not name:
        raise ClusterFileError(f"{source}: missing; add {how} naming the configs/ preset this cluster runs")
    if name not in preset_names():
        raise ClusterFileError(f"{source}: '{name}' is not a preset in configs/; presets: {', '.join(preset_names())}")
    try:
        cfg = load_config(name, check_source=False)
    except ConfigError as exc:
        raise ClusterFileError(f"preset {name}: {exc}") from None
    if not cfg.scaling.elastic:
        raise ClusterFileError(f"preset {name}: scaling.num_workers = {cfg.scaling.num_workers}: a cluster preset "
                               f"must be elastic, [min, max], so that the autoscaler adds GPU nodes up to max")
    if cfg.scaling.use_gpu is False:
        raise ClusterFileError(f"preset {name}: scaling.use_gpu = false: the cluster's GPU workers would sit idle")
    return name, cfg


def worker_range(cfg: Config) -> tuple[int, ...]:
    """A cluster preset's [min, max] workers (`load_preset` has checked that it is a range)."""
    workers = cfg.scaling.num_workers
    assert isinstance(workers, tuple), "_preset refuses presets that are not elastic"
    return workers


def check_shared_storage(name: str, cfg: Config, pods: dict[str, set[str]] | None = None) -> None:
    """run.storage and data.source must hold the same files for every node: a bucket, or (KubeRay) a path on a
    ReadWriteMany volume that every Ray pod mounts there.

    :param pods: KubeRay only: each pod group's paths where a ReadWriteMany claim is mounted.
    """
    for key, value in (("run.storage", cfg.run.storage), ("data.source", cfg.data.source)):
        if value is None or value.startswith(("builtin:", *REMOTE_SCHEMES)):  # object stores: shared by nature
            continue
        path = value.removeprefix("file://")
        if pods is None:
            raise ClusterFileError(f"preset {name}: {key} = {value!r} is a path on each node's own disk; every node "
                                   f"must see the same files: use s3://BUCKET/PATH or gs://BUCKET/PATH")
        lacking = [pod for pod, mounts in pods.items()
                   if not any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)]
        if lacking:
            raise ClusterFileError(f"preset {name}: {key} = {value!r} is not on a ReadWriteMany volume in every Ray "
                                   f"pod (missing in {', '.join(lacking)}): mount one ReadWriteMany "
                                   f"PersistentVolumeClaim (defined in this file or a YAML file beside it, such as "
                                   f"volume.yaml) at the same path in the head and "
                                   f"every worker group, or use s3://BUCKET/PATH or gs://BUCKET/PATH")

