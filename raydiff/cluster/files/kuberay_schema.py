"""A JSON schema of the KubeRay (ray.io/v1) fields raydiff's manifests use, with KubeRay's own field names.

Unknown keys are refused at every level defined here (`additionalProperties: false`); deeper Kubernetes objects
(probes, affinity, security contexts) are only checked to be objects. The pod template's `spec`, its containers
and its volumes allow every key that the CRDs of KubeRay v1.5.1 (the oldest release the manifests support:
`authOptions` came in it) define, so a valid pod spec is never refused. Fields that only newer KubeRay releases
know are refused with the release that brings them (`x-newer-kuberay`), since an older operator's CRD drops
them and the manifest would silently do less than it says. Used by `kuberay.py`.
"""

from __future__ import annotations

from typing import Any

# The KubeRay release the manifests and docs/clusters.md require.
MIN_KUBERAY = "v1.5.1"
NEWER = "x-newer-kuberay"  # key -> the KubeRay release whose CRD first has it (ignored by jsonschema)


def _obj(properties: dict[str, Any], required: tuple[str, ...] = (),
         newer: dict[str, str] | None = None) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}
    return {**schema, NEWER: newer} if newer else schema


def _list(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


STR, INT, BOOL, NUM = {"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "boolean"}, {"type": "number"}
OBJ, STRS, STR_MAP = {"type": "object"}, _list({"type": "string"}), {"type": "object", "additionalProperties": STR}
OBJS = _list(OBJ)
PULL = {"enum": ["Always", "IfNotPresent", "Never"]}
QUANTITIES = {"type": "object", "additionalProperties": {"type": ["string", "integer", "number"]}}
RESOURCES = _obj({"limits": QUANTITIES, "requests": QUANTITIES, "claims": OBJS})
ENV = _list(_obj({"name": STR, "value": STR, "valueFrom": OBJ}, ("name",)))
MOUNTS = _list(_obj({"name": STR, "mountPath": STR, "readOnly": BOOL, "subPath": STR, "subPathExpr": STR,
                     "mountPropagation": STR, "recursiveReadOnly": STR}, ("name", "mountPath")))
# Every key of a Container in the v1.5.1 CRDs (Kubernetes core/v1 Container).
CONTAINER = _obj({
    "name": STR, "image": STR, "imagePullPolicy": PULL, "command": STRS, "args": STRS, "workingDir": STR,
    "env": ENV, "envFrom": OBJS, "resources": RESOURCES, "volumeMounts": MOUNTS, "volumeDevices": OBJS,
    "ports": _list(_obj({"containerPort": INT, "name": STR, "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
                         "hostPort": INT, "hostIP": STR}, ("containerPort",))),
    "lifecycle": OBJ, "livenessProbe": OBJ, "readinessProbe": OBJ, "startupProbe": OBJ, "securityContext": OBJ,
    "resizePolicy": OBJS, "restartPolicy": STR, "restartPolicyRules": OBJS, "stdin": BOOL, "stdinOnce": BOOL,
    "tty": BOOL, "terminationMessagePath": STR, "terminationMessagePolicy": STR,
}, ("name", "image"))
# Every volume source of the v1.5.1 CRDs; only a persistentVolumeClaim's fields matter to raydiff's checks.
VOLUME_SOURCES = ("awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi",
                  "downwardAPI", "emptyDir", "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk",
                  "gitRepo", "glusterfs", "hostPath", "image", "iscsi", "nfs", "photonPersistentDisk",
                  "portworxVolume", "projected", "quobyte", "rbd", "scaleIO", "secret", "storageos",
                  "vsphereVolume")
VOLUME = _obj({"name": STR, "persistentVolumeClaim": _obj({"claimName": STR, "readOnly": BOOL}, ("claimName",)),
               **{source: OBJ for source in VOLUME_SOURCES}}, ("name",))
TOLERATION = _obj({"key": STR, "operator": {"enum": ["Exists", "Equal"]}, "value": STR,
                   "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]}, "tolerationSeconds": INT})
# Every key of a PodSpec in the v1.5.1 CRDs (Kubernetes core/v1 PodSpec); later CRDs add the `newer` ones.
POD_SPEC = _obj({
    "containers": {**_list(CONTAINER), "minItems": 1}, "initContainers": _list(CONTAINER),
    "ephemeralContainers": OBJS, "volumes": _list(VOLUME), "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]},
    "nodeSelector": STR_MAP, "nodeName": STR, "affinity": OBJ, "tolerations": _list(TOLERATION),
    "topologySpreadConstraints": OBJS, "schedulerName": STR, "schedulingGates": OBJS, "priorityClassName": STR,
    "priority": {"type": "integer"}, "preemptionPolicy": STR, "runtimeClassName": STR, "overhead": QUANTITIES,
    "resources": RESOURCES, "resourceClaims": OBJS, "readinessGates": OBJS, "os": OBJ,
    "serviceAccountName": STR, "serviceAccount": STR, "automountServiceAccountToken": BOOL,
    "imagePullSecrets": OBJS, "securityContext": OBJ, "terminationGracePeriodSeconds": INT,
    "activeDeadlineSeconds": INT, "hostNetwork": BOOL, "hostPID": BOOL, "hostIPC": BOOL, "hostUsers": BOOL,
    "shareProcessNamespace": BOOL, "dnsPolicy": STR, "dnsConfig": OBJ, "hostAliases": OBJS, "hostname": STR,
    "hostnameOverride": STR, "subdomain": STR, "setHostnameAsFQDN": BOOL, "enableServiceLinks": BOOL,
}, ("containers",), newer={"workloadRef": "v1.6.0", "schedulingGroup": "v1.7.0"})
POD_TEMPLATE = _obj({"metadata": _obj({"name": STR, "namespace": STR, "labels": STR_MAP, "annotations": STR_MAP,
                                       "finalizers": STRS}),
                     "spec": POD_SPEC}, ("spec",))
# A Kubernetes Service: only the fields raydiff reads have their shapes checked (every other key passes).
SERVICE = {"type": "object", "properties": {"spec": {"type": "object", "properties": {
    "type": STR, "externalIPs": STRS}}}}
HEAD_GROUP = _obj({"rayStartParams": STR_MAP, "template": POD_TEMPLATE, "resources": STR_MAP, "labels": STR_MAP,
                   "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}, "headService": SERVICE,
                   "enableIngress": BOOL}, ("rayStartParams", "template"), newer={"ingressOptions": "v1.7.0"})
WORKER_GROUP = _obj({"groupName": STR, "replicas": INT, "minReplicas": INT, "maxReplicas": INT,
                     "numOfHosts": {"type": "integer", "minimum": 1}, "idleTimeoutSeconds": INT,
                     "rayStartParams": STR_MAP, "template": POD_TEMPLATE, "resources": STR_MAP, "labels": STR_MAP,
                     "scaleStrategy": _obj({"workersToDelete": STRS}), "suspend": BOOL},
                    ("groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"),
                    newer={"priority": "v1.7.0"})
CLUSTER_SPEC = _obj({
    "rayVersion": STR, "enableInTreeAutoscaling": {"const": True},
    "autoscalerOptions": _obj({"upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                               "idleTimeoutSeconds": INT, "version": {"enum": ["v1", "v2"]}, "resources": RESOURCES,
                               "image": STR, "imagePullPolicy": PULL, "env": ENV, "envFrom": OBJS,
                               "volumeMounts": MOUNTS, "securityContext": OBJ},
                              newer={"command": "v1.7.0", "args": "v1.7.0"}),
    "authOptions": _obj({"mode": {"enum": ["disabled", "token"]}},
                        newer={"secretName": "v1.6.0", "enableK8sTokenAuth": "v1.6.0"}),
    "headGroupSpec": HEAD_GROUP, "workerGroupSpecs": {**_list(WORKER_GROUP), "minItems": 1},
    "headServiceAnnotations": STR_MAP, "suspend": BOOL, "managedBy": STR, "gcsFaultToleranceOptions": OBJ,
}, ("rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec", "workerGroupSpecs"),
    newer={"upgradeStrategy": "v1.6.0", "historyServerOptions": "v1.7.0", "networkPolicy": "v1.7.0",
           "tlsOptions": "v1.7.0"})
JOB_SPEC = _obj({
    "entrypoint": STR, "runtimeEnvYAML": STR, "rayClusterSpec": CLUSTER_SPEC, "clusterSelector": STR_MAP,
    "metadata": STR_MAP, "jobId": STR,
    "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
    "shutdownAfterJobFinishes": BOOL, "ttlSecondsAfterFinished": INT, "activeDeadlineSeconds": INT,
    "backoffLimit": INT, "entrypointNumCpus": NUM, "entrypointNumGpus": NUM, "entrypointResources": STR,
    "submitterPodTemplate": POD_TEMPLATE, "submitterConfig": _obj({"backoffLimit": INT}), "suspend": BOOL,
    "deletionStrategy": OBJ, "managedBy": STR,
}, ("entrypoint",), newer={"preRunningDeadlineSeconds": "v1.6.0"})  # rayClusterSpec or clusterSelector: kuberay.py
METADATA = _obj({"name": STR, "namespace": STR, "labels": STR_MAP, "annotations": STR_MAP}, ("name",))
KUBERAY_SCHEMAS = {kind: _obj({"apiVersion": {"const": "ray.io/v1"}, "kind": {"const": kind}, "metadata": METADATA,
                               "spec": spec}, ("apiVersion", "kind", "metadata", "spec"))
                   for kind, spec in (("RayCluster", CLUSTER_SPEC), ("RayJob", JOB_SPEC))}
