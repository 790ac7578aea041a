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

import argparse
import copy
import difflib
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from raydiff import cli
from raydiff.config import Config, ConfigError, load_config, preset_names
from raydiff.kuberay_schema import KUBERAY_SCHEMAS, MIN_KUBERAY, NEWER
from raydiff.storage.fs import REMOTE_SCHEMES

PRESET_COMMENT = re.compile(r"#\s*raydiff-preset:\s*(\S+)\s*$")
PRESET_ANNOTATION = "raydiff.dev/preset"
AUTH_DISABLED = re.compile(r"RAY_AUTH_MODE\s*=\s*['\"]?disabled")
DASHBOARD_EXPOSED = re.compile(r"--dashboard-host[= ]+['\"]?0\.0\.0\.0")
DASHBOARD_PORT = 8265
# GCE machine types that come with GPUs (accelerator-optimized A2, A3, A4, A4X, G2, G4).
GCP_GPU_MACHINES = re.compile(r"(a2|a3|a4|a4x|g2|g4)-")
# OAuth scopes of a GCE VM that let it write Cloud Storage (the default one is devstorage.read_only).
GCS_WRITE_SCOPES = tuple(f"https://www.googleapis.com/auth/{scope}"
                         for scope in ("cloud-platform", "devstorage.read_write", "devstorage.full_control"))
# KubeRay's ray-operator/controllers/ray/utils/validation.go (v1.5.1 to v1.7.0): token auth needs Ray 2.52.0.
MIN_TOKEN_RAY = (2, 52, 0)
TOKEN_VERSION = re.compile(r"\s*v?((?:0|[1-9][0-9]*)(?:\.[0-9]+)+)")


class ClusterFileError(ValueError):
    """What is wrong with a cluster file, in one line naming the field and what is allowed."""


def _where(path: Any) -> str:
    """A JSON path as YAML people read it: spec.workerGroupSpecs[0].minReplicas."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][\w-]*", part):
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out or "(top level)"


def _schema_message(error: jsonschema.ValidationError, hint: str = "") -> str:
    """One line for a schema error: the field, the bad value or key, and what is allowed."""
    where, kind, value = _where(error.absolute_path), error.validator, error.instance
    if kind == "additionalProperties" and isinstance(value, dict):
        allowed = list(error.schema.get("properties", {}))
        bad = min(set(value) - set(allowed))
        newer = error.schema.get(NEWER, {}).get(bad)
        if newer:  # a real KubeRay field, but the supported operators' CRDs lack it
            return (f"{where}: '{bad}' needs KubeRay {newer} or newer; the manifests support KubeRay {MIN_KUBERAY}, "
                    f"whose CRD lacks it (the API server would drop it): remove it")
        close = difflib.get_close_matches(bad, allowed, n=1)
        suggestion = f" (did you mean '{close[0]}'?)" if close else ""
        return f"{where}: unknown key '{bad}'{suggestion}; allowed: {', '.join(allowed)}"
    if kind == "required":
        missing = [key for key in error.validator_value if key not in value]
        return f"{where}: missing required key '{missing[0]}'"
    if kind == "const":
        return f"{where} = {json.dumps(value)}: must be {json.dumps(error.validator_value)}{hint}"
    if kind == "enum":
        return f"{where} = {json.dumps(value)}: allowed: {', '.join(json.dumps(a) for a in error.validator_value)}"
    if kind == "minimum":
        return f"{where} = {value}: must be >= {error.validator_value}"
    if kind == "type":
        number_for_string = error.validator_value == "string" and isinstance(value, (int, float))
        quote = f' (quote it: "{value}")' if number_for_string else ""
        return f"{where} = {json.dumps(value)}: expected {error.validator_value}{quote}"
    return f"{where}: {error.message}"


# Presets and storage.
def _preset(name: str | None, source: str, how: str) -> tuple[str, Config]:
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


def _worker_range(cfg: Config) -> tuple[int, ...]:
    """A cluster preset's [min, max] workers (`_preset` has checked that it is a range)."""
    workers = cfg.scaling.num_workers
    assert isinstance(workers, tuple), "_preset refuses presets that are not elastic"
    return workers


def _check_shared_storage(name: str, cfg: Config, pods: dict[str, set[str]] | None = None) -> None:
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
                                   f"PersistentVolumeClaim (defined in this file) at the same path in the head and "
                                   f"every worker group, or use s3://BUCKET/PATH or gs://BUCKET/PATH")


# Ray cluster launcher configs.
def check_launcher(raw: dict[str, Any], text: str) -> None:
    """Ray's validation of a cluster-launcher config, then raydiff's checks and the preset's."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    if not isinstance(raw.get("provider"), dict):
        close = difflib.get_close_matches("provider", [str(k) for k in raw], n=1)
        found = f" (found '{close[0]}': misspelt?)" if close else ""
        raise ClusterFileError(f"provider: missing required key{found}; set provider.type (aws, gcp, azure, ...) "
                               f"and its region")
    logging.getLogger("ray.autoscaler").setLevel(logging.WARNING)  # prepare_config narrates its defaults
    try:
        cfg = prepare_config(copy.deepcopy(raw))
        validate_config(cfg)
    except jsonschema.ValidationError as exc:
        raise ClusterFileError(_schema_message(exc)) from None
    except (ValueError, RuntimeError, AssertionError, LookupError, TypeError) as exc:  # what Ray raises
        raise ClusterFileError(f"Ray rejects the config: {str(exc).strip().splitlines()[0]}") from None

    _check_launcher_rules(cfg)
    _check_launcher_preset(cfg, text)


def _check_launcher_rules(cfg: dict[str, Any]) -> None:
    """What raydiff needs of any cluster: a head without work, GPU workers, token auth, no exposed dashboard."""
    types, head = cfg["available_node_types"], cfg["head_node_type"]
    if types[head]["resources"].get("CPU") != 0:
        raise ClusterFileError(f"{_where(['available_node_types', head, 'resources', 'CPU'])} = "
                               f"{types[head]['resources'].get('CPU')}: the head must advertise CPU: 0 (no training "
                               f"or data work on the head)")
    if not any(t["resources"].get("GPU", 0) > 0 for name, t in types.items() if name != head):
        raise ClusterFileError("available_node_types: no worker type advertises GPUs; give the GPU worker type "
                               "resources: {GPU: N} (the autoscaler only scales what it is told a node holds)")
    if any(DASHBOARD_EXPOSED.search(command) for command in cfg["head_start_ray_commands"]):
        raise ClusterFileError("head_start_ray_commands: --dashboard-host=0.0.0.0 exposes the dashboard; "
                               "leave it on 127.0.0.1 and reach it with `ray dashboard CLUSTER.yaml`")
    for rule in cfg["provider"].get("security_group", {}).get("IpPermissions", []):
        protocol, low, high = str(rule.get("IpProtocol")), rule.get("FromPort", 0), rule.get("ToPort", 0)
        from_outside = rule.get("IpRanges") or rule.get("Ipv6Ranges")
        if from_outside and (protocol == "-1" or protocol in ("tcp", "6") and low <= DASHBOARD_PORT <= high):
            raise ClusterFileError(f"provider.security_group.IpPermissions: a rule opens port {DASHBOARD_PORT} (the "
                                   f"dashboard); remove it and use `ray dashboard CLUSTER.yaml` (an SSH port-forward)")
    if AUTH_DISABLED.search(json.dumps(cfg)):
        raise ClusterFileError("RAY_AUTH_MODE=disabled: raydiff clusters keep Ray's token auth on")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        if not any("RAY_AUTH_MODE=token" in command for command in cfg[key]):
            raise ClusterFileError(f"{key}: Ray token auth is off; start Ray with `RAY_AUTH_MODE=token ray start ...`"
                                   f" and mount the token (file_mounts: ~/.ray/auth_token: ~/.ray/auth_token)")
    if cfg["provider"]["type"] == "gcp":
        _check_gcp_gpu_maintenance(types)


def _node_config(types: dict[str, Any], name: str) -> tuple[str, dict[str, Any]]:
    """A node type's node_config, and where it is, for messages."""
    return _where(["available_node_types", name, "node_config"]), types[name].get("node_config") or {}


def _check_gcp_gpu_maintenance(types: dict[str, Any]) -> None:
    """GCE refuses to create a VM with GPUs that would live-migrate (the default): it must stop for maintenance.
    A preemptible VM stops by default ("the default and only possible behavior is TERMINATE", GCE's API), so it
    may leave the field out."""
    for name, node_type in types.items():
        where, node = _node_config(types, name)
        has_gpus = (bool(node.get("guestAccelerators")) or bool(GCP_GPU_MACHINES.match(str(node.get("machineType"))))
                    or node_type["resources"].get("GPU", 0) > 0)
        scheduling = node.get("scheduling") or {}
        if isinstance(scheduling, list):  # Ray's GCP examples write it as a list of one-key mappings
            scheduling = {k: v for item in scheduling if isinstance(item, dict) for k, v in item.items()}
        maintenance = scheduling.get("onHostMaintenance", "TERMINATE" if scheduling.get("preemptible") else None)
        if has_gpus and maintenance != "TERMINATE":
            raise ClusterFileError(f"{where}.scheduling.onHostMaintenance = "
                                   f"{json.dumps(scheduling.get('onHostMaintenance'))} ({node.get('machineType')} "
                                   f"has GPUs): must be \"TERMINATE\"; GCE creates no GPU VM that live-migrates")


def _check_launcher_preset(cfg: dict[str, Any], text: str) -> None:
    """The preset named at the top of the file: its max workers fit the GPU nodes; its storage is shared."""
    header = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            break
        header.append(line)
    names = [m.group(1) for m in map(PRESET_COMMENT.match, header) if m]
    name, preset = _preset(names[0] if names else None, "# raydiff-preset",
                           "a top-of-file comment line '# raydiff-preset: NAME'")
    types, most = cfg["available_node_types"], _worker_range(preset)[1]
    gpu_types = {n: t for n, t in types.items() if n != cfg["head_node_type"] and t["resources"].get("GPU", 0) > 0}
    per_node = max(t["resources"]["GPU"] for t in gpu_types.values())
    capacity = min(sum(t["max_workers"] * t["resources"]["GPU"] for t in gpu_types.values()),
                   cfg["max_workers"] * per_node)
    if capacity < most:
        limits = ", ".join(f"{n}: max_workers {t['max_workers']} x GPU {t['resources']['GPU']}"
                           for n, t in gpu_types.items())
        raise ClusterFileError(f"available_node_types: the GPU workers hold at most {capacity} GPUs ({limits}; "
                               f"max_workers {cfg['max_workers']} in all), below the preset's scaling.num_workers "
                               f"max {most} ({name})")
    _check_shared_storage(name, preset)
    _check_bucket_access(cfg, name, preset)


def _check_bucket_access(cfg: dict[str, Any], name: str, preset: Config) -> None:
    """Every worker node type can read and write the preset's bucket on AWS (s3://) and Google Cloud (gs://).

    Ray gives its own IAM instance profile (AWS) or service account (GCP) to the head only; a worker without one
    gets no S3 credentials, or the default service account's read-only storage scope. Buckets behind an
    endpoint (MinIO, a test server) take their credentials another way and are not judged.
    """
    provider, types, head = cfg["provider"]["type"], cfg["available_node_types"], cfg["head_node_type"]
    scheme = {"aws": "s3://", "gcp": "gs://"}.get(provider)
    buckets = [f"{key} = {value}" for key, value, endpoint in
               (("run.storage", preset.run.storage, preset.run.endpoint),
                ("data.source", preset.data.source, preset.data.endpoint))
               if scheme and value and value.startswith(scheme) and endpoint is None]
    if not buckets:
        return
    for node_name in (n for n in types if n != head):
        where, node = _node_config(types, node_name)
        if provider == "aws" and not node.get("IamInstanceProfile"):
            raise ClusterFileError(f"{where}: no IamInstanceProfile, so these nodes have no access to the preset's "
                                   f"bucket ({name}: {buckets[0]}): Ray gives its profile to the head only; add "
                                   f"IamInstanceProfile: {{Name: ray-autoscaler-v1}} or a profile that may read and "
                                   f"write the bucket")
        if provider == "gcp":
            accounts = node.get("serviceAccounts") or []
            scopes = [scope for account in accounts if isinstance(account, dict)
                      for scope in account.get("scopes") or []]
            if not any(scope in GCS_WRITE_SCOPES for scope in scopes):
                found = f"scopes = {json.dumps(scopes)}" if accounts else "missing"
                raise ClusterFileError(f"{where}.serviceAccounts: {found}, so these nodes cannot write the preset's "
                                       f"bucket ({name}: {buckets[0]}): Ray gives its service account to the head "
                                       f"only; add serviceAccounts with ray-autoscaler-sa-v1@PROJECT."
                                       f"iam.gserviceaccount.com and a scope of: {', '.join(GCS_WRITE_SCOPES)}")


# KubeRay manifests.
def _is_kuberay(doc: dict[str, Any]) -> bool:
    return str(doc.get("apiVersion", "")).startswith("ray.io") or str(doc.get("kind")) in KUBERAY_SCHEMAS


def _rwx_mounts(template: dict[str, Any], rwx_claims: set[str]) -> set[str]:
    """Paths where the pod's Ray container (the first one) mounts a ReadWriteMany claim."""
    volumes = {v["name"] for v in template["spec"].get("volumes", [])
               if v.get("persistentVolumeClaim", {}).get("claimName") in rwx_claims}
    ray_container = template["spec"]["containers"][0]
    return {m["mountPath"] for m in ray_container.get("volumeMounts", []) if m["name"] in volumes}


def _gpus(template: dict[str, Any]) -> float:
    """GPUs a pod asks for (nvidia.com/gpu limits of its containers)."""
    try:
        return sum(float(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
                   for c in template["spec"]["containers"])
    except ValueError:
        raise ClusterFileError("nvidia.com/gpu limits must be whole numbers of GPUs") from None


def check_kuberay(docs: list[dict[str, Any]]) -> None:
    """Schema of the RayCluster or RayJob, then raydiff's checks and the preset's."""
    ray_docs = [d for d in docs if _is_kuberay(d)]
    if len(ray_docs) != 1:
        raise ClusterFileError(f"expected one RayCluster or RayJob per file, found {len(ray_docs)}")
    doc = ray_docs[0]
    schema = KUBERAY_SCHEMAS.get(str(doc.get("kind")))
    if schema is None:
        raise ClusterFileError(f"kind = {json.dumps(doc.get('kind'))}: allowed: RayCluster, RayJob")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    if error is not None:
        hint = (" (raydiff's elastic training needs Ray's autoscaler to add worker pods)"
                if list(error.absolute_path)[-1:] == ["enableInTreeAutoscaling"] else "")
        raise ClusterFileError(_schema_message(error, hint))
    where, spec = ("spec", doc["spec"]) if doc["kind"] == "RayCluster" else ("spec.rayClusterSpec",
                                                                            doc["spec"]["rayClusterSpec"])
    _check_kuberay_rules(where, spec)
    _check_kuberay_preset(doc, where, spec, docs)


def _check_kuberay_rules(where: str, spec: dict[str, Any]) -> None:
    """What raydiff needs of any cluster: consistent replicas, a head without work, token auth, no exposed
    dashboard, no secrets."""
    head, groups = spec["headGroupSpec"], spec["workerGroupSpecs"]
    for i, group in enumerate(groups):
        low, high, group_where = group["minReplicas"], group["maxReplicas"], f"{where}.workerGroupSpecs[{i}]"
        if low > high:
            raise ClusterFileError(f"{group_where}.minReplicas = {low} > maxReplicas = {high} ({group['groupName']}): "
                                   f"minReplicas must be <= maxReplicas")
        if not low <= group.get("replicas", low) <= high:
            raise ClusterFileError(f"{group_where}.replicas = {group['replicas']} ({group['groupName']}): must be "
                                   f"between minReplicas {low} and maxReplicas {high}")
    if head["rayStartParams"].get("num-cpus") != "0":
        raise ClusterFileError(f"{where}.headGroupSpec.rayStartParams.num-cpus = "
                               f"{json.dumps(head['rayStartParams'].get('num-cpus'))}: must be \"0\" (no training or "
                               f"data work on the head)")
    if head.get("serviceType", "ClusterIP") != "ClusterIP" or head.get("enableIngress"):
        raise ClusterFileError(f"{where}.headGroupSpec: serviceType {head.get('serviceType')} / enableIngress expose "
                               f"the dashboard; keep serviceType ClusterIP and use kubectl port-forward")
    if (spec.get("authOptions") or {}).get("mode") != "token":  # said, not left to KubeRay's default
        raise ClusterFileError(f"{where}.authOptions.mode: Ray token auth is off; set authOptions: {{mode: token}} "
                               f"(KubeRay {MIN_KUBERAY}+ generates the token into a Secret)")
    _check_token_ray_version(where, spec["rayVersion"])
    for template in [head["template"], *(g["template"] for g in groups)]:
        for container in template["spec"]["containers"]:
            for env in container.get("env", []):
                if env["name"] == "RAY_AUTH_MODE" and env.get("value") == "disabled":
                    raise ClusterFileError(f"container {container['name']}: RAY_AUTH_MODE=disabled: keep token auth "
                                           f"on")
                if env["name"] == "RAY_AUTH_TOKEN" and "value" in env:
                    raise ClusterFileError(f"container {container['name']}: RAY_AUTH_TOKEN has a literal value: no "
                                           f"secrets in manifests; use authOptions or valueFrom.secretKeyRef")


def _check_token_ray_version(where: str, ray_version: str) -> None:
    """KubeRay refuses a RayCluster with token auth and a rayVersion below 2.52.0 and creates no pods; it reads the
    version as Kubernetes' ParseGeneric does: an optional 'v', two or more dot-separated numbers, anything after."""
    parsed = TOKEN_VERSION.match(ray_version)
    least = ".".join(map(str, MIN_TOKEN_RAY))
    if parsed is None:
        raise ClusterFileError(f"{where}.rayVersion = {json.dumps(ray_version)}: not a version KubeRay can read; set "
                               f"the Ray version of the images (e.g. \"2.60.0\"), {least} or newer for token auth")
    numbers = [int(n) for n in parsed.group(1).split(".")]
    numbers += [0] * (len(MIN_TOKEN_RAY) - len(numbers))  # "2.52" is 2.52.0, as in KubeRay
    if tuple(numbers) < MIN_TOKEN_RAY:
        raise ClusterFileError(f"{where}.rayVersion = {json.dumps(ray_version)}: KubeRay refuses authOptions.mode "
                               f"token below Ray {least} and starts no pods; use Ray {least} or newer (images and "
                               f"rayVersion)")


def _check_kuberay_preset(doc: dict[str, Any], where: str, spec: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    """The preset of the annotation: the GPU group's replicas are its [min, max]; its storage is shared."""
    head, groups = spec["headGroupSpec"], spec["workerGroupSpecs"]
    gpu_groups = [(i, g) for i, g in enumerate(groups) if _gpus(g["template"]) > 0]
    if len(gpu_groups) != 1:
        raise ClusterFileError(f"{where}.workerGroupSpecs: expected one GPU worker group (nvidia.com/gpu limits), "
                               f"found {len(gpu_groups)}")
    i, gpu_group = gpu_groups[0]
    group_where = f"{where}.workerGroupSpecs[{i}] ({gpu_group['groupName']})"
    if _gpus(gpu_group["template"]) != 1:
        raise ClusterFileError(f"{group_where}: nvidia.com/gpu = {_gpus(gpu_group['template']):g} per pod: raydiff "
                               f"runs one worker per GPU, so give each pod 1 GPU")
    annotations = doc["metadata"].get("annotations", {})
    name, preset = _preset(annotations.get(PRESET_ANNOTATION), f"metadata.annotations.{PRESET_ANNOTATION}",
                           f"metadata.annotations: {{{PRESET_ANNOTATION}: NAME}}")
    replicas = [gpu_group["minReplicas"], gpu_group["maxReplicas"]]
    if replicas != list(_worker_range(preset)):
        raise ClusterFileError(f"{group_where}: minReplicas/maxReplicas = {replicas}: must equal the preset's "
                               f"scaling.num_workers = {list(_worker_range(preset))} ({name})")
    if doc["kind"] == "RayJob":
        named = re.search(r"--config[= ]+(\S+)", doc["spec"]["entrypoint"])
        if named and named.group(1) != name:
            raise ClusterFileError(f"spec.entrypoint runs --config {named.group(1)}, but "
                                   f"metadata.annotations.{PRESET_ANNOTATION} is {name}: make them the same preset")
    rwx_claims = {d["metadata"].get("name") for d in docs if d.get("kind") == "PersistentVolumeClaim"
                  and isinstance(d.get("metadata"), dict) and isinstance(d.get("spec"), dict)
                  and "ReadWriteMany" in (d["spec"].get("accessModes") or [])}
    pods = {"head": _rwx_mounts(head["template"], rwx_claims),
            **{g["groupName"]: _rwx_mounts(g["template"], rwx_claims) for g in groups}}
    _check_shared_storage(name, preset, pods)


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
    if any(_is_kuberay(d) for d in docs):
        check_kuberay(docs)
    elif len(docs) == 1 and {"cluster_name", "provider", "available_node_types"} & set(docs[0]):
        check_launcher(docs[0], text)
    else:
        raise ClusterFileError("neither a Ray cluster-launcher config (cluster_name, provider, available_node_types) "
                               "nor a KubeRay manifest (apiVersion: ray.io/v1, kind: RayCluster or RayJob)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raydiff.cluster_check", description=__doc__.split("\n\n")[0])
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
