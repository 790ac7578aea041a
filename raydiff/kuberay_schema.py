"""A JSON schema of the KubeRay (ray.io/v1) fields raydiff's manifests use, with KubeRay's own field names.

Unknown keys are refused at every level defined here (`additionalProperties: false`); deeper Kubernetes objects
(probes, affinity, security contexts) are only checked to be objects. Used by `raydiff.cluster_check`.
"""

from __future__ import annotations

from typing import Any


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def _list(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


STR, INT, BOOL, NUM = {"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "boolean"}, {"type": "number"}
OBJ, STRS, STR_MAP = {"type": "object"}, _list({"type": "string"}), {"type": "object", "additionalProperties": STR}
PULL = {"enum": ["Always", "IfNotPresent", "Never"]}
QUANTITIES = {"type": "object", "additionalProperties": {"type": ["string", "integer", "number"]}}
RESOURCES = _obj({"limits": QUANTITIES, "requests": QUANTITIES, "claims": _list(OBJ)})
ENV = _list(_obj({"name": STR, "value": STR, "valueFrom": OBJ}, ("name",)))
MOUNTS = _list(_obj({"name": STR, "mountPath": STR, "readOnly": BOOL, "subPath": STR, "subPathExpr": STR,
                     "mountPropagation": STR, "recursiveReadOnly": STR}, ("name", "mountPath")))
CONTAINER = _obj({
    "name": STR, "image": STR, "imagePullPolicy": PULL, "command": STRS, "args": STRS, "workingDir": STR,
    "env": ENV, "envFrom": _list(OBJ), "resources": RESOURCES, "volumeMounts": MOUNTS, "lifecycle": OBJ,
    "ports": _list(_obj({"containerPort": INT, "name": STR, "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
                         "hostPort": INT, "hostIP": STR}, ("containerPort",))),
    "livenessProbe": OBJ, "readinessProbe": OBJ, "startupProbe": OBJ, "securityContext": OBJ,
}, ("name", "image"))
VOLUME = _obj({"name": STR, "persistentVolumeClaim": _obj({"claimName": STR, "readOnly": BOOL}, ("claimName",)),
               **{source: OBJ for source in ("emptyDir", "configMap", "secret", "hostPath", "nfs", "csi",
                                             "projected", "downwardAPI", "ephemeral")}}, ("name",))
TOLERATION = _obj({"key": STR, "operator": {"enum": ["Exists", "Equal"]}, "value": STR,
                   "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]}, "tolerationSeconds": INT})
POD_TEMPLATE = _obj({"metadata": _obj({"labels": STR_MAP, "annotations": STR_MAP}), "spec": _obj({
    "containers": {**_list(CONTAINER), "minItems": 1}, "initContainers": _list(CONTAINER), "volumes": _list(VOLUME),
    "nodeSelector": STR_MAP, "tolerations": _list(TOLERATION), "affinity": OBJ, "serviceAccountName": STR,
    "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]}, "imagePullSecrets": _list(OBJ),
    "securityContext": OBJ, "priorityClassName": STR, "terminationGracePeriodSeconds": INT, "schedulerName": STR,
}, ("containers",))}, ("spec",))
HEAD_GROUP = _obj({"rayStartParams": STR_MAP, "template": POD_TEMPLATE, "resources": STR_MAP, "labels": STR_MAP,
                   "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}, "headService": OBJ,
                   "enableIngress": BOOL}, ("rayStartParams", "template"))
WORKER_GROUP = _obj({"groupName": STR, "replicas": INT, "minReplicas": INT, "maxReplicas": INT,
                     "numOfHosts": {"type": "integer", "minimum": 1}, "idleTimeoutSeconds": INT,
                     "rayStartParams": STR_MAP, "template": POD_TEMPLATE, "resources": STR_MAP, "labels": STR_MAP,
                     "scaleStrategy": _obj({"workersToDelete": STRS}), "suspend": BOOL},
                    ("groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"))
CLUSTER_SPEC = _obj({
    "rayVersion": STR, "enableInTreeAutoscaling": {"const": True},
    "autoscalerOptions": _obj({"upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                               "idleTimeoutSeconds": INT, "version": {"enum": ["v1", "v2"]}, "resources": RESOURCES,
                               "image": STR, "imagePullPolicy": PULL, "env": ENV, "envFrom": _list(OBJ),
                               "volumeMounts": MOUNTS, "securityContext": OBJ, "command": STRS, "args": STRS}),
    "authOptions": _obj({"mode": {"enum": ["disabled", "token"]}, "secretName": STR, "enableK8sTokenAuth": BOOL}),
    "headGroupSpec": HEAD_GROUP, "workerGroupSpecs": {**_list(WORKER_GROUP), "minItems": 1},
    "headServiceAnnotations": STR_MAP, "suspend": BOOL, "managedBy": STR, "gcsFaultToleranceOptions": OBJ,
}, ("rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec", "workerGroupSpecs"))
JOB_SPEC = _obj({
    "entrypoint": STR, "runtimeEnvYAML": STR, "rayClusterSpec": CLUSTER_SPEC, "metadata": STR_MAP, "jobId": STR,
    "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
    "shutdownAfterJobFinishes": BOOL, "ttlSecondsAfterFinished": INT, "activeDeadlineSeconds": INT,
    "backoffLimit": INT, "entrypointNumCpus": NUM, "entrypointNumGpus": NUM, "entrypointResources": STR,
    "submitterPodTemplate": POD_TEMPLATE, "submitterConfig": _obj({"backoffLimit": INT}), "suspend": BOOL,
    "deletionStrategy": OBJ, "managedBy": STR,
}, ("entrypoint", "rayClusterSpec"))
METADATA = _obj({"name": STR, "namespace": STR, "labels": STR_MAP, "annotations": STR_MAP}, ("name",))
KUBERAY_SCHEMAS = {kind: _obj({"apiVersion": {"const": "ray.io/v1"}, "kind": {"const": kind}, "metadata": METADATA,
                               "spec": spec}, ("apiVersion", "kind", "metadata", "spec"))
                   for kind, spec in (("RayCluster", CLUSTER_SPEC), ("RayJob", JOB_SPEC))}
