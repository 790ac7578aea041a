"""Ray cluster-launcher configs (`ray up`): Ray's own validation, then what raydiff needs of the cluster and of
the preset named in the file's first comment lines (`# raydiff-preset: NAME`).

Ray validates the schema (`prepare_config`, `validate_config`), not what a raydiff run needs: a head that takes
no work, GPU node types that hold a Ray Train worker, an autoscaler, token auth, a dashboard on loopback, one
Ray release in every image, GPU VMs that GCE will create, and worker nodes that may read and write the preset's
bucket (Ray gives its IAM profile or service account to the head only).
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import re
from importlib import resources
from typing import Any

import jsonschema

from raydiff.cluster.files.shared import (
    ClusterFileError,
    as_json,
    check_ray_images,
    check_shared_storage,
    field_path,
    load_preset,
    schema_message,
    worker_range,
)
from raydiff.config import Config

PRESET_COMMENT = re.compile(r"#\s*raydiff-preset:\s*(\S+)\s*$")
AUTH_DISABLED = re.compile(r"RAY_AUTH_MODE\s*=\s*['\"]?disabled")
DASHBOARD_HOST = re.compile(r"--dashboard-host(?:=|\s+)(['\"]?)([^\s'\";]*)\1")
LOOPBACK = re.compile(r"localhost|127(\.\d+){3}|::1|\[::1\]")  # the hosts that keep the dashboard on the machine
DASHBOARD_PORT = 8265
GPUS_OPTION = re.compile(r"--gpus(\s|=|$)")  # docker run's request for the node's GPUs
# GCE machine types that come with GPUs (accelerator-optimized A2, A3, A4, A4X, G2, G4).
GCP_GPU_MACHINES = re.compile(r"(a2|a3|a4|a4x|g2|g4)-")
# OAuth scopes of a GCE VM that let it write Cloud Storage (the default one is devstorage.read_only).
GCS_WRITE_SCOPES = tuple(f"https://www.googleapis.com/auth/{scope}"
                         for scope in ("cloud-platform", "devstorage.read_write", "devstorage.full_control"))
# The provider-specific fields raydiff's checks read, which Ray's schema leaves free (`provider` and `node_config`
# take any keys): their shapes, so that a wrong one is refused by name, not met as a Python error.
SECURITY_GROUP_READ = {"type": "object", "properties": {"security_group": {"type": "object", "properties": {
    "IpPermissions": {"type": "array", "items": {"type": "object", "properties": {
        "IpProtocol": {"type": ["string", "integer"]}, "FromPort": {"type": "integer"}, "ToPort": {"type": "integer"},
        "IpRanges": {"type": ["array", "null"]}, "Ipv6Ranges": {"type": ["array", "null"]}}}}}}}}
GCP_NODE_READ = {"type": "object", "properties": {
    "scheduling": {"type": ["object", "array", "null"], "items": {"type": "object"}},
    "serviceAccounts": {"type": ["array", "null"], "items": {"type": "object", "properties": {
        "scopes": {"type": ["array", "null"], "items": {"type": "string"}}}}}}}


def check_launcher(raw: dict[str, Any], text: str) -> None:
    """Ray's validation of a cluster-launcher config, then raydiff's checks and the preset's."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    if not isinstance(raw.get("provider"), dict):
        close = difflib.get_close_matches("provider", [str(k) for k in raw], n=1)
        found = f" (found '{close[0]}': misspelt?)" if close else ""
        raise ClusterFileError(f"provider: missing required key{found}; set provider.type (aws, gcp, azure, ...) "
                               f"and its region")
    _check_as_written(raw)
    logging.getLogger("ray.autoscaler").setLevel(logging.WARNING)  # prepare_config narrates its defaults
    try:
        cfg = prepare_config(copy.deepcopy(raw))
        validate_config(cfg)
    except jsonschema.ValidationError as exc:
        raise ClusterFileError(schema_message(exc)) from None
    except (ValueError, RuntimeError, AssertionError, LookupError, TypeError) as exc:  # what Ray raises
        raise ClusterFileError(f"Ray rejects the config: {str(exc).strip().splitlines()[0]}") from None

    _check_fields_read(cfg)
    _check_launcher_rules(cfg)
    check_ray_images(raw)  # the file as written: its fields, not the ones Ray's defaults fill in
    _check_launcher_preset(cfg, text)


def _check_as_written(raw: dict[str, Any]) -> None:
    """Ray's schema over the file as written, before `prepare_config` fills in its defaults: Ray's preparation
    reads some sections without checking their type (a `docker:` left empty, `file_mounts` written as a list) and
    fails with Python's error. What the defaults fill in or drop (a missing key, a legacy top-level one) is left to
    the validation after them."""
    schema = json.loads((resources.files("ray.autoscaler") / "ray-schema.json").read_text())
    # Ray reads each file mount as a local path (a file mount of a docker cluster is checked with Path(local)).
    schema["properties"]["file_mounts"]["additionalProperties"] = {"type": "string"}
    errors = [e for e in jsonschema.Draft7Validator(schema).iter_errors(raw)
              if e.absolute_path or e.validator not in ("required", "additionalProperties")]
    error = jsonschema.exceptions.best_match(errors)
    if error is not None:
        raise ClusterFileError(schema_message(error))


def _check_fields_read(cfg: dict[str, Any]) -> None:
    """The provider-specific fields that raydiff's checks read have the shapes they are read with."""
    checks = [(["provider"], cfg["provider"], SECURITY_GROUP_READ)]
    if cfg["provider"]["type"] == "gcp":
        checks += [(["available_node_types", name, "node_config"], node_type["node_config"], GCP_NODE_READ)
                   for name, node_type in cfg["available_node_types"].items()]
    for path, value, schema in checks:
        error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(schema).iter_errors(value))
        if error is not None:
            error.path.extendleft(reversed(path))  # named from the top of the file
            raise ClusterFileError(schema_message(error))


def _check_launcher_rules(cfg: dict[str, Any]) -> None:
    """What raydiff needs of any cluster: a head without work, GPU workers, an autoscaler, token auth, no exposed
    dashboard."""
    types, head = cfg["available_node_types"], cfg["head_node_type"]
    if types[head]["resources"].get("CPU") != 0:
        raise ClusterFileError(f"{field_path(['available_node_types', head, 'resources', 'CPU'])} = "
                               f"{types[head]['resources'].get('CPU')}: the head must advertise CPU: 0 (no training "
                               f"or data work on the head)")
    if not any(t["resources"].get("GPU", 0) > 0 for name, t in types.items() if name != head):
        raise ClusterFileError("available_node_types: no worker type advertises GPUs; give the GPU worker type "
                               "resources: {GPU: N} (the autoscaler only scales what it is told a node holds)")
    for command in cfg["head_start_ray_commands"]:
        for found in DASHBOARD_HOST.finditer(str(command)):
            if not LOOPBACK.fullmatch(found.group(2)):
                raise ClusterFileError(f"head_start_ray_commands: --dashboard-host={found.group(2)} exposes the "
                                       f"dashboard; leave it on 127.0.0.1 and reach it with `ray dashboard "
                                       f"CLUSTER.yaml`")
    if not any("ray start" in str(c) and "--autoscaling-config" in str(c) for c in cfg["head_start_ray_commands"]):
        raise ClusterFileError("head_start_ray_commands: no `ray start --head ... --autoscaling-config=~/ray_bootstrap_"
                               "config.yaml`; without it no autoscaler runs, and no worker node is ever added for the "
                               "preset's scaling.num_workers")
    for rule in cfg["provider"].get("security_group", {}).get("IpPermissions", []):
        protocol, low, high = str(rule.get("IpProtocol")), rule.get("FromPort", 0), rule.get("ToPort", 0)
        from_outside = rule.get("IpRanges") or rule.get("Ipv6Ranges")
        if from_outside and (protocol == "-1" or protocol in ("tcp", "6") and low <= DASHBOARD_PORT <= high):
            raise ClusterFileError(f"provider.security_group.IpPermissions: a rule opens port {DASHBOARD_PORT} (the "
                                   f"dashboard); remove it and use `ray dashboard CLUSTER.yaml` (an SSH port-forward)")
    if AUTH_DISABLED.search(json.dumps(cfg, default=str)):  # anywhere in the file, as text
        raise ClusterFileError("RAY_AUTH_MODE=disabled: raydiff clusters keep Ray's token auth on")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):  # on the `ray start` itself
        if not any("RAY_AUTH_MODE=token" in str(command) and "ray start" in str(command) for command in cfg[key]):
            raise ClusterFileError(f"{key}: Ray token auth is off; start Ray with `RAY_AUTH_MODE=token ray start ...`"
                                   f" and mount the token (file_mounts: ~/.ray/auth_token: ~/.ray/auth_token)")
    if not any(str(target).rstrip("/").endswith(".ray/auth_token") for target in cfg.get("file_mounts") or {}):
        raise ClusterFileError("file_mounts: no ~/.ray/auth_token: the nodes would start Ray with token auth and no "
                               "token (mount it: file_mounts: {~/.ray/auth_token: ~/.ray/auth_token})")
    if cfg.get("docker"):
        _check_container_gpus(cfg)
    if cfg["provider"]["type"] == "gcp":
        _check_gcp_gpu_maintenance(types)
        _check_gcp_disk_zones(types, cfg["provider"].get("availability_zone"))


def _check_container_gpus(cfg: dict[str, Any]) -> None:
    """The containers of GPU nodes ask Docker for the GPUs (`--gpus all`), and no other node's container does.

    Ray adds `--runtime=nvidia` only where the VM image registered that runtime with Docker; elsewhere the
    container starts without the GPU, the node still advertises it, and the Ray Train worker placed there finds
    no CUDA. `--gpus all` asks in every case (the NVIDIA container toolkit answers it, or the container fails to
    start, loudly); on a node without GPUs it fails the same way. A node type's `docker.worker_run_options`
    replace the global ones (Ray updates the docker section with the node type's); `run_options` go to every
    node.
    """
    docker, types, head = cfg["docker"], cfg["available_node_types"], cfg["head_node_type"]

    def asks(options: list[Any]) -> bool:
        return any(GPUS_OPTION.search(str(option)) for option in options)

    shared = docker.get("run_options") or []
    if asks(shared):
        raise ClusterFileError("docker.run_options: --gpus goes to every node, and the containers of nodes without "
                               "GPUs (the head, CPU workers) would not start: move it to the GPU node types' "
                               "docker: {worker_run_options: [--gpus all]}")
    if types[head].get("docker"):
        raise ClusterFileError(f"{field_path(['available_node_types', head, 'docker'])}: `ray up` starts the head "
                               f"with the global docker section only and ignores this one: use docker.head_image and "
                               f"docker.head_run_options")
    if asks(docker.get("head_run_options") or []) and not types[head]["resources"].get("GPU", 0) > 0:
        raise ClusterFileError(f"docker.head_run_options: --gpus, but the head ({head}) has no GPUs (its container "
                               f"would not start): remove it")
    for name, node_type in types.items():
        if name == head:
            continue
        own = "worker_run_options" in (node_type.get("docker") or {})
        options = (node_type["docker"] if own else docker).get("worker_run_options") or []
        where = (field_path(["available_node_types", name, "docker", "worker_run_options"]) if own
                 else "docker.worker_run_options")
        has_gpus = node_type["resources"].get("GPU", 0) > 0
        if has_gpus and not asks(options):
            raise ClusterFileError(f"{where}: no --gpus for {name}: its containers may start without the node's "
                                   f"GPU (Ray adds --runtime=nvidia only where the VM image registered it with "
                                   f"Docker; torch would find no CUDA): give this node type docker: "
                                   f"{{worker_run_options: [--gpus all]}}")
        if not has_gpus and asks(options):
            raise ClusterFileError(f"{where}: --gpus for {name}, which has no GPUs (its containers would not "
                                   f"start): ask for GPUs only in the GPU node types' docker.worker_run_options")


def _node_config(types: dict[str, Any], name: str) -> tuple[str, dict[str, Any]]:
    """A node type's node_config, and where it is, for messages."""
    return field_path(["available_node_types", name, "node_config"]), types[name].get("node_config") or {}


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
                                   f"{as_json(scheduling.get('onHostMaintenance'))} ({node.get('machineType')} "
                                   f"has GPUs): must be \"TERMINATE\"; GCE creates no GPU VM that live-migrates")


def _check_gcp_disk_zones(types: dict[str, Any], zone: str | None) -> None:
    """A disk type is named with its zone (`zones/ZONE/diskTypes/pd-balanced`): one of another zone than the VM's
    (provider.availability_zone, changed and the disks not) fails the VM's creation."""
    for name in types:
        where, node = _node_config(types, name)
        for i, disk in enumerate(node.get("disks") or []):
            named = str(((disk or {}).get("initializeParams") or {}).get("diskType", ""))
            found = re.search(r"(?:^|/)zones/([^/]+)/diskTypes/", named)
            if found and zone and found.group(1) != zone:
                raise ClusterFileError(f"{where}.disks[{i}].initializeParams.diskType = {as_json(named)}: its zone "
                                       f"is not provider.availability_zone ({zone}); name the same zone in both")


def _check_launcher_preset(cfg: dict[str, Any], text: str) -> None:
    """The preset named at the top of the file: its max workers fit the GPU nodes; its storage is shared."""
    header = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            break
        header.append(line)
    names = [m.group(1) for m in map(PRESET_COMMENT.match, header) if m]
    name, preset = load_preset(names[0] if names else None, "# raydiff-preset",
                           "a top-of-file comment line '# raydiff-preset: NAME'")
    types, most = cfg["available_node_types"], worker_range(preset)[1]
    gpu_types = {n: t for n, t in types.items() if n != cfg["head_node_type"] and t["resources"].get("GPU", 0) > 0}
    _check_gpu_types(cfg, gpu_types, preset.scaling.cpus_per_worker or 1.0)
    per_node = max(t["resources"]["GPU"] for t in gpu_types.values())
    capacity = min(sum(t["max_workers"] * t["resources"]["GPU"] for t in gpu_types.values()),
                   cfg["max_workers"] * per_node)
    if capacity < most:
        limits = ", ".join(f"{n}: max_workers {t['max_workers']} x GPU {t['resources']['GPU']}"
                           for n, t in gpu_types.items())
        raise ClusterFileError(f"available_node_types: the GPU workers hold at most {capacity} GPUs ({limits}; "
                               f"max_workers {cfg['max_workers']} in all), below the preset's scaling.num_workers "
                               f"max {most} ({name})")
    check_shared_storage(name, preset)
    _check_bucket_access(cfg, name, preset)


def _check_gpu_types(cfg: dict[str, Any], gpu_types: dict[str, Any], cpus_per_worker: float) -> None:
    """Each GPU node type holds a Ray Train worker, {CPU: scaling.cpus_per_worker or 1, GPU: 1}, per GPU in the
    resources it advertises (whole numbers, Ray's schema): the autoscaler launches a node type for a worker only
    where it fits, and the node advertises these resources (RAY_OVERRIDE_RESOURCES). A CPU count left out is read
    from the instance type on AWS only."""
    for name, node_type in gpu_types.items():
        resources = node_type["resources"]
        where = field_path(["available_node_types", name, "resources"])
        if "CPU" not in resources and cfg["provider"]["type"] == "aws":
            continue
        need = cpus_per_worker * resources["GPU"]
        if resources.get("CPU", 0) < need:
            raise ClusterFileError(f"{where}.CPU = {as_json(resources.get('CPU'))}: each Ray Train worker asks "
                                   f"{{CPU: {cpus_per_worker:g}, GPU: 1}}, so {name} (GPU: {resources['GPU']:g}) must "
                                   f"advertise CPU: {need:g} or more, or no worker is ever placed on it")


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
                found = f"scopes = {as_json(scopes)}" if accounts else "missing"
                raise ClusterFileError(f"{where}.serviceAccounts: {found}, so these nodes cannot write the preset's "
                                       f"bucket ({name}: {buckets[0]}): Ray gives its service account to the head "
                                       f"only; add serviceAccounts with ray-autoscaler-sa-v1@PROJECT."
                                       f"iam.gserviceaccount.com and a scope of: {', '.join(GCS_WRITE_SCOPES)}")
