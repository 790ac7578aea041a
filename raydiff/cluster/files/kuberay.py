"""KubeRay manifests (a RayCluster or RayJob) and the files of PersistentVolumeClaims beside them
(cluster/kuberay/volume.yaml): a schema of the fields raydiff uses (`kuberay_schema`), then what raydiff needs of
the cluster and of the preset in the annotation `raydiff.dev/preset`.

Kubernetes' API server drops what a CRD does not know, and KubeRay refuses some settings only when it reconciles
(no pods, no error where `kubectl apply` ran): both are found here, offline, with the field named. What a group's
pods advertise to Ray is worked out as KubeRay v1.5.1 builds their `ray start` (controllers/ray/common/pod.go).
"""

from __future__ import annotations

import json
import re
from decimal import ROUND_UP, Decimal
from typing import Any

import jsonschema

from raydiff.cluster.files.kuberay_schema import KUBERAY_SCHEMAS, MIN_KUBERAY, STR, STRS
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

PRESET_ANNOTATION = "raydiff.dev/preset"
# KubeRay's ray-operator/controllers/ray/utils/validation.go (v1.5.1 to v1.7.0): token auth needs Ray 2.52.0.
MIN_TOKEN_RAY = (2, 52, 0)
TOKEN_VERSION = re.compile(r"\s*v?((?:0|[1-9][0-9]*)(?:\.[0-9]+)+)")
# The fields of a PersistentVolumeClaim that raydiff reads (its name, its access modes), with their shapes.
CLAIM_READ = {"type": "object", "required": ["metadata", "spec"], "properties": {
    "metadata": {"type": "object", "required": ["name"], "properties": {"name": STR}},
    "spec": {"type": "object", "properties": {"accessModes": STRS}}}}
# KubeRay's names (utils/constant.go, validation.go): a DNS-1035 label, at most 53 characters for a RayCluster
# (its longest Service suffix, "-serve-svc", must fit in 63) and 6 fewer for a RayJob (its cluster adds "-xxxxx").
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME = {"RayCluster": 53, "RayJob": 47}
# The rayStartParams that KubeRay refuses beside a group's `resources` (validateRayGroupResources).
RESOURCE_PARAMS = ("num-cpus", "num-gpus", "memory", "resources")
CLUSTER_SELECTOR_KEY = "ray.io/cluster"  # the RayCluster a RayJob's clusterSelector names
DASHBOARD_HINT = "reach the dashboard with `kubectl port-forward svc/CLUSTER-head-svc 8265:8265` (on 127.0.0.1)"
# A (Kubernetes) claim, as read here: (the file beside the manifest that holds it, or None for its own file, doc).
Claim = tuple[str | None, dict[str, Any]]


def is_kuberay(doc: dict[str, Any]) -> bool:
    return str(doc.get("apiVersion", "")).startswith("ray.io") or str(doc.get("kind")) in KUBERAY_SCHEMAS


def _rwx_mounts(template: dict[str, Any], rwx_claims: set[str]) -> set[str]:
    """Paths where the pod's Ray container (the first one) mounts a ReadWriteMany claim."""
    volumes = {v["name"] for v in template["spec"].get("volumes", [])
               if v.get("persistentVolumeClaim", {}).get("claimName") in rwx_claims}
    ray_container = template["spec"]["containers"][0]
    return {m["mountPath"] for m in ray_container.get("volumeMounts", []) if m["name"] in volumes}


def _rwx_claims(claims: list[Claim]) -> set[str]:
    """The names of the ReadWriteMany PersistentVolumeClaims; a claim without the shape Kubernetes requires of
    these fields is refused, by name and field (`kubectl apply` would refuse it too), and by its file where it is
    not the manifest's own."""
    names = set()
    for source, doc in claims:
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(CLAIM_READ).iter_errors(doc))
        if error is not None:
            name = doc["metadata"].get("name") if isinstance(doc.get("metadata"), dict) else None
            which = f"PersistentVolumeClaim {name}" if isinstance(name, str) else "a PersistentVolumeClaim"
            raise ClusterFileError(f"{f'{source}: ' if source else ''}{which}: {schema_message(error)}")
        if "ReadWriteMany" in doc["spec"].get("accessModes", []):
            names.add(doc["metadata"]["name"])
    return names


def check_claims(docs: list[dict[str, Any]]) -> None:
    """A file of PersistentVolumeClaims alone (cluster/kuberay/volume.yaml): the fields raydiff reads of each."""
    _rwx_claims([(None, doc) for doc in docs])


def _quantity(value: Any, where: str) -> Decimal:
    """A Kubernetes quantity ("4", "500m", 1) as Ray's autoscaler reads it; refused where it is none."""
    from ray.autoscaler._private.kuberay.utils import parse_quantity

    try:
        number = parse_quantity(value)
    except (ValueError, ArithmeticError):
        number = Decimal("NaN")
    if not number.is_finite() or number < 0:
        raise ClusterFileError(f"{where} = {as_json(value)}: not a Kubernetes quantity of 0 or more (e.g. \"4\", "
                               f"\"500m\")")
    return number


def _is_gpu_key(key: str) -> bool:
    """KubeRay's IsGPUResourceKey (utils/resources.go): nvidia.com/gpu, amd.com/gpu, ..., and NVIDIA MIG slices."""
    return key.endswith("gpu") or re.search(r"nvidia\.com/mig-\d+g\.\d+gb$", key) is not None


def _gpu_limits(container: dict[str, Any], where: str) -> Decimal:
    """The GPUs a container asks Kubernetes for (limits: an extended resource has no request of its own)."""
    limits = container.get("resources", {}).get("limits", {})
    return sum((_quantity(value, f"{where}.{field_path(['resources', 'limits', key])}")
                for key, value in limits.items() if _is_gpu_key(key)), Decimal(0))


def _whole(number: Decimal) -> int:
    """A quantity as KubeRay passes it to `ray start` (Quantity.Value()): rounded up."""
    return int(number.to_integral_value(rounding=ROUND_UP))


def _advertised(group: dict[str, Any], where: str) -> dict[str, tuple[str, Any, int]]:
    """The CPUs and GPUs that Ray advertises on a group's pods, each with the field that says it and its value as
    written, as KubeRay builds `ray start`: the group's `resources` (KubeRay refuses them beside rayStartParams'
    resource fields), else rayStartParams num-cpus / num-gpus, else the Ray container's (containers[0]) limits (CPU:
    else its requests), Kubernetes quantities rounded up. A CPU count that nothing says is missing from the result
    (Ray's autoscaler cannot read the group); a GPU count that nothing says is 0 (the container has no GPU)."""
    params, own = group["rayStartParams"], group.get("resources") or {}
    written = [key for key in RESOURCE_PARAMS if params.get(key)]
    if own and written:
        raise ClusterFileError(f"{where}: resources and rayStartParams.{written[0]} are both set; KubeRay refuses a "
                               f"group that sets its Ray resources in both, and starts no pods: use one")
    found: dict[str, tuple[str, Any, int]] = {}
    for name, value in own.items():  # updateRayStartParamsResources: names read in lower case
        kind = "CPU" if name.lower() == "cpu" else "GPU" if _is_gpu_key(name.lower()) else None
        if kind:
            field = f"{where}.{field_path(['resources', name])}"
            found[kind] = (field, value, _whole(_quantity(value, field)))
    for kind, param in (("CPU", "num-cpus"), ("GPU", "num-gpus")):
        if kind not in found and param in params:
            field, value = f"{where}.rayStartParams.{param}", params[param]
            if not re.fullmatch(r"\s*\d+\s*", value):
                raise ClusterFileError(f"{field} = {json.dumps(value)}: `ray start --{param}` takes a whole number "
                                       f"of 0 or more")
            found[kind] = (field, value, int(value))
    container, container_where = group["template"]["spec"]["containers"][0], f"{where}.template.spec.containers[0]"
    resources = container.get("resources", {})
    if "CPU" not in found:
        for part in ("limits", "requests"):
            if "cpu" in resources.get(part, {}):
                field = f"{container_where}.resources.{part}.cpu"
                value = resources[part]["cpu"]
                number = _quantity(value, field)
                if number > 0:
                    found["CPU"] = (field, value, _whole(number))
                    break
    if "GPU" not in found:
        found["GPU"] = (f"{container_where}.resources.limits", None, 0)
        for key in sorted(resources.get("limits", {})):
            field = f"{container_where}.{field_path(['resources', 'limits', key])}"
            value = resources["limits"][key]
            if _is_gpu_key(key) and _quantity(value, field) > 0:
                found["GPU"] = (field, value, _whole(_quantity(value, field)))
                break
    return found


def check_kuberay(docs: list[dict[str, Any]], beside: list[Claim] | None = None) -> None:
    """Schema of the RayCluster or RayJob, then raydiff's checks and the preset's.

    :param beside: the PersistentVolumeClaims of the files beside this one (volume.yaml), with their file names.
    """
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
    _check_name(doc)
    name, preset = _preset(doc)
    if doc["kind"] == "RayCluster":
        where, spec = "spec", doc["spec"]
    elif _runs_on_existing_cluster(doc["spec"]):
        return  # the RayCluster it names is checked in its own file
    else:
        where, spec = "spec.rayClusterSpec", doc["spec"]["rayClusterSpec"]
    _check_kuberay_rules(where, spec)
    check_ray_images(doc, (f"{where}.rayVersion", spec["rayVersion"]))  # the submitter's image too
    claims = [(None, d) for d in docs if d.get("kind") == "PersistentVolumeClaim"] + (beside or [])
    _check_kuberay_preset(where, spec, name, preset, claims)


def _check_name(doc: dict[str, Any]) -> None:
    """KubeRay refuses a RayCluster or RayJob whose name its Services cannot carry, and creates nothing."""
    kind, name = doc["kind"], doc["metadata"]["name"]
    if len(name) > MAX_NAME[kind]:
        raise ClusterFileError(f"metadata.name = {json.dumps(name)}: {len(name)} characters; KubeRay refuses a {kind} "
                               f"name longer than {MAX_NAME[kind]} (the names of its Services must fit in 63) and "
                               f"creates nothing: shorten it")
    if not DNS_1035.fullmatch(name):
        raise ClusterFileError(f"metadata.name = {json.dumps(name)}: KubeRay refuses a {kind} name that is not a "
                               f"DNS-1035 label (lowercase letters, digits and '-', starting with a letter, ending "
                               f"with a letter or digit) and creates nothing: rename it")


def _preset(doc: dict[str, Any]) -> tuple[str, Config]:
    """The preset of the annotation, loaded; a RayJob's entrypoint runs that preset, if it names one."""
    annotations = doc["metadata"].get("annotations", {})
    name, preset = load_preset(annotations.get(PRESET_ANNOTATION), f"metadata.annotations.{PRESET_ANNOTATION}",
                               f"metadata.annotations: {{{PRESET_ANNOTATION}: NAME}}")
    if doc["kind"] == "RayJob":
        named = re.search(r"--config[= ]+(\S+)", doc["spec"]["entrypoint"])
        if named and named.group(1) != name:
            raise ClusterFileError(f"spec.entrypoint runs --config {named.group(1)}, but "
                                   f"metadata.annotations.{PRESET_ANNOTATION} is {name}: make them the same preset")
    return name, preset


def _runs_on_existing_cluster(spec: dict[str, Any]) -> bool:
    """Whether a RayJob runs on a RayCluster that exists (clusterSelector) rather than one it creates
    (rayClusterSpec); KubeRay takes exactly one of them (validation.go) and ignores rayClusterSpec beside a
    clusterSelector."""
    selector = spec.get("clusterSelector") or {}
    if not selector and "rayClusterSpec" not in spec:
        raise ClusterFileError("spec: missing required key 'rayClusterSpec'; a RayJob needs rayClusterSpec (the "
                               f"cluster it creates) or clusterSelector: {{{CLUSTER_SELECTOR_KEY}: NAME}} (a "
                               f"RayCluster that exists)")
    if selector and "rayClusterSpec" in spec:
        raise ClusterFileError("spec: clusterSelector and rayClusterSpec are both set; KubeRay runs the job on the "
                               "selected RayCluster and ignores rayClusterSpec: keep one")
    if selector and not selector.get(CLUSTER_SELECTOR_KEY):
        raise ClusterFileError(f"spec.clusterSelector: missing '{CLUSTER_SELECTOR_KEY}'; KubeRay finds the RayCluster "
                               f"by that key only: clusterSelector: {{{CLUSTER_SELECTOR_KEY}: NAME}}")
    return bool(selector)


def _check_kuberay_rules(where: str, spec: dict[str, Any]) -> None:
    """What raydiff needs of any cluster: consistent replicas, groups whose CPUs Ray's autoscaler can read, a head
    without work, token auth, no exposed dashboard, no secrets."""
    head, groups = spec["headGroupSpec"], spec["workerGroupSpecs"]
    for i, group in enumerate(groups):
        low, high, group_where = group["minReplicas"], group["maxReplicas"], f"{where}.workerGroupSpecs[{i}]"
        if low > high:
            raise ClusterFileError(f"{group_where}.minReplicas = {low} > maxReplicas = {high} ({group['groupName']}): "
                                   f"minReplicas must be <= maxReplicas")
        if not low <= group.get("replicas", low) <= high:
            raise ClusterFileError(f"{group_where}.replicas = {group['replicas']} ({group['groupName']}): must be "
                                   f"between minReplicas {low} and maxReplicas {high}")
        if "CPU" not in _advertised(group, group_where):
            raise ClusterFileError(f"{group_where} ({group['groupName']}): no CPU count for Ray (rayStartParams."
                                   f"num-cpus, resources.CPU, or cpu in containers[0]'s limits or requests); Ray's "
                                   f"autoscaler cannot read the group and fails: set containers[0].resources.limits."
                                   f"cpu")
    head_where = f"{where}.headGroupSpec"
    head_cpus = _advertised(head, head_where).get("CPU")
    if head_cpus is None or head_cpus[2] != 0:  # said where the head says its resources
        if not head.get("resources"):
            field, value = f"{head_where}.rayStartParams.num-cpus", head["rayStartParams"].get("num-cpus")
        elif head_cpus and head_cpus[0].startswith(f"{head_where}.resources"):
            field, value = head_cpus[0], head_cpus[1]
        else:
            field, value = f"{head_where}.resources.CPU", None
        raise ClusterFileError(f"{field} = {json.dumps(value)}: must be \"0\" (no training or data work on the head)")
    _check_dashboard_hidden(head_where, head)
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


def _check_dashboard_hidden(where: str, head: dict[str, Any]) -> None:
    """Nothing publishes the head's ports (the dashboard and job server among them) beyond the cluster: KubeRay
    starts the dashboard on 0.0.0.0 in the head pod, so whatever reaches the pod reaches it."""
    if head.get("serviceType", "ClusterIP") != "ClusterIP" or head.get("enableIngress"):
        raise ClusterFileError(f"{where}: serviceType {head.get('serviceType')} / enableIngress expose "
                               f"the dashboard; keep serviceType ClusterIP and use kubectl port-forward")
    service = (head.get("headService") or {}).get("spec") or {}
    if service.get("type", "ClusterIP") != "ClusterIP":
        raise ClusterFileError(f"{where}.headService.spec.type = {json.dumps(service['type'])}: exposes the dashboard "
                               f"(KubeRay keeps the type a headService sets); remove it and {DASHBOARD_HINT}")
    if service.get("externalIPs"):
        raise ClusterFileError(f"{where}.headService.spec.externalIPs: exposes the dashboard on those addresses; "
                               f"remove it and {DASHBOARD_HINT}")
    pod = head["template"]["spec"]
    if pod.get("hostNetwork"):
        raise ClusterFileError(f"{where}.template.spec.hostNetwork = true: the dashboard would listen on the node's "
                               f"own addresses; remove it and {DASHBOARD_HINT}")
    for i, container in enumerate(pod["containers"]):
        for j, port in enumerate(container.get("ports", [])):
            if port.get("hostPort"):
                raise ClusterFileError(f"{where}.template.spec.containers[{i}].ports[{j}].hostPort = {port['hostPort']}"
                                       f": publishes the head's port {port['containerPort']} on the node's address; "
                                       f"remove it and {DASHBOARD_HINT}")


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


def _check_kuberay_preset(where: str, spec: dict[str, Any], name: str, preset: Config, claims: list[Claim]) -> None:
    """The preset of the annotation: one GPU group, whose pods Ray Train can place its workers on and whose replicas
    are its [min, max]; its storage is shared."""
    head, groups = spec["headGroupSpec"], spec["workerGroupSpecs"]
    gpu_groups = [(i, g) for i, g in enumerate(groups)
                  if any(_gpu_limits(c, f"{where}.workerGroupSpecs[{i}].template.spec.containers[{j}]") > 0
                         for j, c in enumerate(g["template"]["spec"]["containers"]))
                  or _advertised(g, f"{where}.workerGroupSpecs[{i}]")["GPU"][2] > 0]
    if len(gpu_groups) != 1:
        raise ClusterFileError(f"{where}.workerGroupSpecs: expected one GPU worker group (nvidia.com/gpu limits), "
                               f"found {len(gpu_groups)}")
    i, gpu_group = gpu_groups[0]
    group_where = f"{where}.workerGroupSpecs[{i}]"
    _check_gpu_group(group_where, gpu_group, preset.scaling.cpus_per_worker or 1.0)
    # minReplicas may be below the preset's fewest (0: no GPU pod idles between jobs; the autoscaler adds them as
    # Ray Train asks), maxReplicas is its most (more would never be used, fewer never reached).
    replicas, (fewest, most) = [gpu_group["minReplicas"], gpu_group["maxReplicas"]], worker_range(preset)
    if replicas[0] > fewest or replicas[1] != most:
        raise ClusterFileError(f"{group_where} ({gpu_group['groupName']}): minReplicas/maxReplicas = {replicas}: "
                               f"minReplicas must be at most {fewest} and maxReplicas {most}, the preset's "
                               f"scaling.num_workers = {[fewest, most]} ({name})")
    rwx_claims = _rwx_claims(claims)
    pods = {"head": _rwx_mounts(head["template"], rwx_claims),
            **{g["groupName"]: _rwx_mounts(g["template"], rwx_claims) for g in groups}}
    check_shared_storage(name, preset, pods)


def _check_gpu_group(where: str, group: dict[str, Any], cpus_per_worker: float) -> None:
    """Each pod of the GPU group holds one GPU in its Ray container and advertises it to Ray, with the CPUs that a
    Ray Train worker asks beside it ({CPU: scaling.cpus_per_worker or 1, GPU: 1}): else no worker is ever placed
    there, or one is placed on a GPU that the pod does not hold."""
    containers, label = group["template"]["spec"]["containers"], f"{where} ({group['groupName']})"
    for j, container in enumerate(containers[1:], 1):
        if _gpu_limits(container, f"{where}.template.spec.containers[{j}]") > 0:
            raise ClusterFileError(f"{label}: containers[{j}] ({container['name']}) asks for GPUs; KubeRay gives Ray "
                                   f"the first container's only (containers[0], the Ray container): put the GPU "
                                   f"limit there")
    gpus = _gpu_limits(containers[0], f"{where}.template.spec.containers[0]")
    if gpus != gpus.to_integral_value():
        raise ClusterFileError("nvidia.com/gpu limits must be whole numbers of GPUs")
    if gpus != 1:
        raise ClusterFileError(f"{label}: nvidia.com/gpu = {gpus:g} per pod: raydiff runs one worker per GPU, so "
                               f"give each pod 1 GPU")
    advertised = _advertised(group, where)
    field, value, count = advertised["GPU"]
    if count != 1:
        raise ClusterFileError(f"{field} = {json.dumps(value)}: Ray would count {count} GPUs in each pod, which "
                               f"holds 1 (nvidia.com/gpu), and Ray Train places each worker on GPU: 1: remove it "
                               f"(KubeRay takes the GPUs from the limits)")
    field, value, count = advertised["CPU"]
    if count < cpus_per_worker:
        raise ClusterFileError(f"{field} = {json.dumps(value)}: Ray would count {count} CPUs in each pod of {label}, "
                               f"and each Ray Train worker asks {{CPU: {cpus_per_worker:g}, GPU: 1}}, so none would "
                               f"ever be placed: give each pod at least {cpus_per_worker:g} CPU per GPU")
