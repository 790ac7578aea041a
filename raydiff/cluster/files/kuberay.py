"""KubeRay manifests (a RayCluster or RayJob, with the PersistentVolumeClaims it mounts): a schema of the fields
raydiff uses (`kuberay_schema`), then what raydiff needs of the cluster and of the preset in the annotation
`raydiff.dev/preset`.

Kubernetes' API server drops what a CRD does not know, and KubeRay refuses some settings only when it reconciles
(no pods, no error where `kubectl apply` ran): both are found here, offline, with the field named.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from raydiff.cluster.files.kuberay_schema import KUBERAY_SCHEMAS, MIN_KUBERAY, STR, STRS
from raydiff.cluster.files.shared import (
    ClusterFileError,
    as_json,
    check_shared_storage,
    load_preset,
    schema_message,
    worker_range,
)

PRESET_ANNOTATION = "raydiff.dev/preset"
# KubeRay's ray-operator/controllers/ray/utils/validation.go (v1.5.1 to v1.7.0): token auth needs Ray 2.52.0.
MIN_TOKEN_RAY = (2, 52, 0)
TOKEN_VERSION = re.compile(r"\s*v?((?:0|[1-9][0-9]*)(?:\.[0-9]+)+)")
# The fields of a PersistentVolumeClaim that raydiff reads (its name, its access modes), with their shapes.
CLAIM_READ = {"type": "object", "required": ["metadata", "spec"], "properties": {
    "metadata": {"type": "object", "required": ["name"], "properties": {"name": STR}},
    "spec": {"type": "object", "properties": {"accessModes": STRS}}}}


def is_kuberay(doc: dict[str, Any]) -> bool:
    return str(doc.get("apiVersion", "")).startswith("ray.io") or str(doc.get("kind")) in KUBERAY_SCHEMAS


def _rwx_mounts(template: dict[str, Any], rwx_claims: set[str]) -> set[str]:
    """Paths where the pod's Ray container (the first one) mounts a ReadWriteMany claim."""
    volumes = {v["name"] for v in template["spec"].get("volumes", [])
               if v.get("persistentVolumeClaim", {}).get("claimName") in rwx_claims}
    ray_container = template["spec"]["containers"][0]
    return {m["mountPath"] for m in ray_container.get("volumeMounts", []) if m["name"] in volumes}


def _rwx_claims(docs: list[dict[str, Any]]) -> set[str]:
    """The names of the file's ReadWriteMany PersistentVolumeClaims; a claim without the shape Kubernetes requires
    of these fields is refused, by name and field (`kubectl apply` would refuse it too)."""
    claims = set()
    for doc in docs:
        if doc.get("kind") != "PersistentVolumeClaim":
            continue
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(CLAIM_READ).iter_errors(doc))
        if error is not None:
            name = doc["metadata"].get("name") if isinstance(doc.get("metadata"), dict) else None
            which = f"PersistentVolumeClaim {name}" if isinstance(name, str) else "a PersistentVolumeClaim"
            raise ClusterFileError(f"{which}: {schema_message(error)}")
        if "ReadWriteMany" in doc["spec"].get("accessModes", []):
            claims.add(doc["metadata"]["name"])
    return claims


def _gpus(template: dict[str, Any]) -> float:
    """GPUs a pod asks for (nvidia.com/gpu limits of its containers)."""
    try:
        return sum(float(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
                   for c in template["spec"]["containers"])
    except ValueError:
        raise ClusterFileError("nvidia.com/gpu limits must be whole numbers of GPUs") from None


def check_kuberay(docs: list[dict[str, Any]]) -> None:
    """Schema of the RayCluster or RayJob, then raydiff's checks and the preset's."""
    ray_docs = [d for d in docs if is_kuberay(d)]
    if len(ray_docs) != 1:
        raise ClusterFileError(f"expected one RayCluster or RayJob per file, found {len(ray_docs)}")
    doc = ray_docs[0]
    schema = KUBERAY_SCHEMAS.get(str(doc.get("kind")))
    if schema is None:
        raise ClusterFileError(f"kind = {as_json(doc.get('kind'))}: allowed: RayCluster, RayJob")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    if error is not None:
        hint = (" (raydiff's elastic training needs Ray's autoscaler to add worker pods)"
                if list(error.absolute_path)[-1:] == ["enableInTreeAutoscaling"] else "")
        raise ClusterFileError(schema_message(error, hint))
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
    name, preset = load_preset(annotations.get(PRESET_ANNOTATION), f"metadata.annotations.{PRESET_ANNOTATION}",
                           f"metadata.annotations: {{{PRESET_ANNOTATION}: NAME}}")
    replicas = [gpu_group["minReplicas"], gpu_group["maxReplicas"]]
    if replicas != list(worker_range(preset)):
        raise ClusterFileError(f"{group_where}: minReplicas/maxReplicas = {replicas}: must equal the preset's "
                               f"scaling.num_workers = {list(worker_range(preset))} ({name})")
    if doc["kind"] == "RayJob":
        named = re.search(r"--config[= ]+(\S+)", doc["spec"]["entrypoint"])
        if named and named.group(1) != name:
            raise ClusterFileError(f"spec.entrypoint runs --config {named.group(1)}, but "
                                   f"metadata.annotations.{PRESET_ANNOTATION} is {name}: make them the same preset")
    rwx_claims = _rwx_claims(docs)
    pods = {"head": _rwx_mounts(head["template"], rwx_claims),
            **{g["groupName"]: _rwx_mounts(g["template"], rwx_claims) for g in groups}}
    check_shared_storage(name, preset, pods)
