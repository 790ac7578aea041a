"""raydiff.cluster_check: every file under cluster/ validates through the CLI, and broken copies of them are
refused with one clear line on stderr and exit code 2. Nothing here starts Ray."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from raydiff import cli, config, train
from raydiff.cluster_check import main

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cluster").rglob("*.yaml"))
CLUSTER_PRESETS = ("cifar10-aws", "cifar10-gcp", "cifar10-k8s")


def test_every_cluster_file_validates():
    assert len(CLUSTER_FILES) == 5, CLUSTER_FILES
    result = subprocess.run([sys.executable, "-m", "raydiff.cluster_check", *CLUSTER_FILES], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("OK ")] == [
        f"OK {name}" for name in CLUSTER_FILES]
    assert result.stderr == ""


def test_a_good_file_that_still_holds_placeholders_says_which_and_where():
    """The shipped files pass with their placeholders in place, and launch nothing until they are replaced: "OK"
    alone read as ready to launch."""
    from raydiff.cluster_check import placeholders

    assert placeholders(ROOT / "cluster" / "aws.yaml") == ["ami-YOUR-DLAMI-ID (aws.yaml)", "YOUR-BUCKET (cifar10-aws)"]
    assert placeholders(ROOT / "cluster" / "gcp.yaml") == ["YOUR-PROJECT-ID (gcp.yaml)", "YOUR-BUCKET (cifar10-gcp)"]
    assert placeholders(ROOT / "cluster" / "kuberay" / "rayjob.yaml") == ["YOUR-ORG (rayjob.yaml)"]
    assert placeholders(ROOT / "cluster" / "kuberay" / "raycluster.yaml") == []  # its volume holds the data


# What Ray's images (rayproject/ray:2.60.0-*) have already: ray[data,default] and its own requirements.
IN_RAY_IMAGES = {"ray", "numpy", "pyarrow", "pyyaml", "packaging", "jsonschema"}


def test_job_dependency_lists_match_pyproject():
    """The RayJob and the documented job commands (README.md and docs/, where docs/clusters.md has them) list by
    hand what Ray's images lack: every other dependency of pyproject.toml (a job imports them all: TensorBoard
    and the digits' distance are on by default), with the same bounds."""
    tomllib = pytest.importorskip("tomllib")
    declared = {r.name: r.specifier for r in map(Requirement, tomllib.loads(
        (ROOT / "pyproject.toml").read_text())["project"]["dependencies"])}
    job = next(d for d in yaml.safe_load_all((ROOT / "cluster" / "kuberay" / "rayjob.yaml").read_text())
               if d["kind"] == "RayJob")
    readme = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    # A job command's pip list (its env_vars, if any, first).
    runtime_env = r"(?:--runtime-env-json |RUNTIME_ENV=)'(\{(?:\"env_vars\": \{[^}]*\}, )?\"pip\": \[\".*?\})'"
    lists = {"rayjob.yaml": yaml.safe_load(job["spec"]["runtimeEnvYAML"])["pip"],
             **{f"README runtime env {i}": json.loads(found)["pip"]
                for i, found in enumerate(re.findall(runtime_env, readme))},
             "README prose": re.findall(r"`([a-z][a-z0-9_-]*(?:>=|==|~=)[0-9][^`]*)`", readme)}
    assert len(lists) == 3
    for where, requirements in lists.items():
        parsed = [Requirement(r) for r in requirements]
        assert {r.name for r in parsed} == set(declared) - IN_RAY_IMAGES, where
        for requirement in parsed:
            assert requirement.specifier == declared[requirement.name], (where, str(requirement))


@pytest.mark.parametrize("preset", CLUSTER_PRESETS)
def test_cluster_presets_dry_run(preset, capsys):
    assert cli.run(train.main, ["--config", preset, "--dry-run"]) == 0
    assert "# model parameters: 35,746,307" in capsys.readouterr().out
    cfg = config.load_config(preset, check_source=False)
    assert cfg.scaling.num_workers == (2, 8) and cfg.scaling.use_gpu is True
    assert cfg.train.grad_compression == "bf16"  # half the gradient bytes on node links (docs/training.md, Performance)
    assert cfg.run.max_failures == 20  # GPU workers on spot nodes: each one reclaimed is a failure


def _refused(capsys, *paths: Path) -> str:
    """Run the CLI on `paths`; it must exit 2 with exactly one error line (for the last path), no traceback."""
    assert cli.run(main, [str(p) for p in paths]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"raydiff: error: {paths[-1]}: "), lines[0]
    assert "Traceback" not in err
    return lines[0]


# Ray cluster-launcher configs.
def _launcher(tmp_path: Path, change: Callable[[dict[str, Any]], Any], preset: str | None = None,
              cloud: str = "aws") -> Path:
    """A copy of cluster/CLOUD.yaml with `change(config)` applied, naming `preset` (default: cifar10-CLOUD)."""
    cfg = yaml.safe_load((ROOT / "cluster" / f"{cloud}.yaml").read_text())
    change(cfg)
    path = tmp_path / f"{cloud}.yaml"
    path.write_text(f"# raydiff-preset: {preset or f'cifar10-{cloud}'}\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path


def _rename(mapping: dict[str, Any], old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


GPU, HEAD = "ray.worker.gpu", "ray.head.default"
LAUNCHER_BROKEN = {
    "misspelt key": (lambda c: _rename(c["available_node_types"][GPU], "min_workers", "min_worker"),
                     "available_node_types['ray.worker.gpu']: unknown key 'min_worker' (did you mean 'min_workers'?)"),
    "missing provider": (lambda c: c.pop("provider"), "provider: missing required key"),
    "misspelt provider": (lambda c: _rename(c, "provider", "provder"), "(found 'provder': misspelt?)"),
    "head takes work": (lambda c: c["available_node_types"][HEAD].update(resources={"CPU": 4}),
                        "resources.CPU = 4: the head must advertise CPU: 0"),
    "no GPU workers": (lambda c: c["available_node_types"][GPU].update(resources={"CPU": 8}),
                       "no worker type advertises GPUs"),
    "dashboard on 0.0.0.0": (lambda c: c["head_start_ray_commands"].append("ray start --dashboard-host=0.0.0.0"),
                             "--dashboard-host=0.0.0.0 exposes the dashboard"),
    "dashboard on every IPv6 address": (
        lambda c: c["head_start_ray_commands"].append("ray start --dashboard-host '::'"),
        "head_start_ray_commands: --dashboard-host=:: exposes the dashboard; leave it on 127.0.0.1"),
    "no autoscaler": (
        lambda c: c.update(head_start_ray_commands=[
            "ray stop", "RAY_AUTH_MODE=token ray start --head --port=6379 --dashboard-host=127.0.0.1"]),
        "head_start_ray_commands: no `ray start --head ... --autoscaling-config=~/ray_bootstrap_config.yaml`"),
    "GPU node type without CPUs": (
        lambda c: c["available_node_types"][GPU].update(resources={"CPU": 0, "GPU": 1}),
        ("available_node_types['ray.worker.gpu'].resources.CPU = 0: each Ray Train worker asks {CPU: 1, GPU: 1}, so "
         "ray.worker.gpu (GPU: 1) must advertise CPU: 1 or more")),
    "a Ray release raydiff does not run on": (
        lambda c: c["docker"].update(image="rayproject/ray:2.55.0-py311-gpu",
                                     worker_image="rayproject/ray:2.55.0-py311-gpu"),
        ("docker.image = rayproject/ray:2.55.0-py311-gpu: Ray 2.55.0, which raydiff does not run on (it needs "
         "ray<3,>=2.60, pyproject.toml)")),
    "two Ray releases": (
        lambda c: c["docker"].update(worker_image="rayproject/ray:2.59.0-py311-gpu"),
        ("docker.image = rayproject/ray:2.60.0-py311-gpu and docker.worker_image = rayproject/ray:2.59.0-py311-gpu: "
         "two Ray releases in one cluster")),
    "security group opens 8265": (
        lambda c: c["provider"].update(security_group={"IpPermissions": [
            {"IpProtocol": "tcp", "FromPort": 8265, "ToPort": 8265, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]}),
        "a rule opens port 8265"),
    "auth disabled": (lambda c: c["setup_commands"].append("export RAY_AUTH_MODE=disabled"),
                      "RAY_AUTH_MODE=disabled"),
    "auth off": (lambda c: c.update(worker_start_ray_commands=["ray start --address=$RAY_HEAD_IP:6379"]),
                 "worker_start_ray_commands: Ray token auth is off"),
    "auth only on ray stop": (lambda c: c.update(worker_start_ray_commands=[
                                  "RAY_AUTH_MODE=token ray stop", "ray start --address=$RAY_HEAD_IP:6379"]),
                              "worker_start_ray_commands: Ray token auth is off"),
    "token not mounted": (lambda c: c["file_mounts"].pop("~/.ray/auth_token"),
                          "file_mounts: no ~/.ray/auth_token"),
    "too few GPU nodes": (lambda c: c["available_node_types"][GPU].update(max_workers=4),
                          "the GPU workers hold at most 4 GPUs"),
    "GPU containers not asking for the GPU": (
        lambda c: c["available_node_types"][GPU].pop("docker"),
        "docker.worker_run_options: no --gpus for ray.worker.gpu: its containers may start without the node's GPU"),
    "GPU containers asking for something else": (
        lambda c: c["available_node_types"][GPU]["docker"].update(worker_run_options=["--gpus-ish"]),
        "available_node_types['ray.worker.gpu'].docker.worker_run_options: no --gpus for ray.worker.gpu"),
    "--gpus for every node": (lambda c: c["docker"]["run_options"].append("--gpus=all"),
                              "docker.run_options: --gpus goes to every node"),
    "--gpus for the head": (lambda c: c["docker"].update(head_run_options=["--gpus all"]),
                            "docker.head_run_options: --gpus, but the head (ray.head.default) has no GPUs"),
    "a docker section on the head's node type": (
        lambda c: c["available_node_types"][HEAD].update(docker={"worker_run_options": ["--shm-size=1g"]}),
        "available_node_types['ray.head.default'].docker: `ray up` starts the head with the global docker section "
        "only"),
    "--gpus for the CPU workers": (
        lambda c: c["docker"].update(worker_run_options=["--gpus all"]),
        "docker.worker_run_options: --gpus for ray.worker.cpu, which has no GPUs"),
    "worker without an instance profile": (
        lambda c: c["available_node_types"]["ray.worker.cpu"]["node_config"].pop("IamInstanceProfile"),
        ("available_node_types['ray.worker.cpu'].node_config: no IamInstanceProfile, so these nodes have no access "
         "to the preset's bucket (cifar10-aws: run.storage = s3://YOUR-BUCKET/raydiff-runs)")),
    # Sections of the wrong shape, which Ray's own preparation of the config read as Python errors (tracebacks).
    "docker section left empty": (lambda c: c.update(docker=None), "docker = null: expected object"),
    "docker section as an image name": (lambda c: c.update(docker="rayproject/ray:2.60.0-py311-gpu"),
                                        'docker = "rayproject/ray:2.60.0-py311-gpu": expected object'),
    "GPU node type's docker left empty": (lambda c: c["available_node_types"][GPU].update(docker=None),
                                          "available_node_types['ray.worker.gpu'].docker = null: expected object"),
    "file_mounts as a list": (lambda c: c.update(file_mounts=["~/raydiff: ."]),
                              'file_mounts = ["~/raydiff: ."]: expected object'),
    "file mount without a local path": (lambda c: c["file_mounts"].update({"~/data": None}),
                                        "file_mounts['~/data'] = null: expected string"),
    "setup_commands left empty": (lambda c: c.update(setup_commands=None), "setup_commands = null: expected array"),
    "security group rule as text": (
        lambda c: c["provider"].update(security_group={"IpPermissions": ["tcp 8265"]}),
        'provider.security_group.IpPermissions[0] = "tcp 8265": expected object'),
    "security group port as text": (
        lambda c: c["provider"].update(security_group={"IpPermissions": [
            {"IpProtocol": "tcp", "FromPort": "8000", "ToPort": 9000, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]}),
        'provider.security_group.IpPermissions[0].FromPort = "8000": expected integer'),
}


@pytest.mark.parametrize("case", LAUNCHER_BROKEN)
def test_broken_launcher_config_is_refused(case, tmp_path, capsys):
    change, expected = LAUNCHER_BROKEN[case]
    assert expected in _refused(capsys, _launcher(tmp_path, change))


def _gcp_node(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return cfg["available_node_types"][name]["node_config"]


T4 = [{"acceleratorType": "nvidia-tesla-t4", "acceleratorCount": 1}]
GCP_BROKEN = {
    "worker without a service account": (
        lambda c: _gcp_node(c, "ray_worker_cpu").pop("serviceAccounts"),
        ("available_node_types.ray_worker_cpu.node_config.serviceAccounts: missing, so these nodes cannot write the "
         "preset's bucket (cifar10-gcp: run.storage = gs://YOUR-BUCKET/raydiff-runs)")),
    "read-only storage scope": (
        lambda c: _gcp_node(c, "ray_worker_gpu")["serviceAccounts"][0].update(
            scopes=["https://www.googleapis.com/auth/devstorage.read_only"]),
        ('ray_worker_gpu.node_config.serviceAccounts: scopes = ["https://www.googleapis.com/auth/devstorage.read_only"]'
         ", so these nodes cannot write")),
    "GPU worker that live-migrates": (
        lambda c: _gcp_node(c, "ray_worker_gpu")["scheduling"].pop("onHostMaintenance"),
        ('available_node_types.ray_worker_gpu.node_config.scheduling.onHostMaintenance = null (g2-standard-8 has '
         'GPUs): must be "TERMINATE"')),
    "machine type with built-in GPUs that migrates": (
        lambda c: _gcp_node(c, "ray_worker_cpu").update(machineType="a2-highgpu-1g"),
        "ray_worker_cpu.node_config.scheduling.onHostMaintenance = null (a2-highgpu-1g has GPUs)"),
    "attached GPU that migrates": (
        lambda c: _gcp_node(c, "ray_worker_cpu").update(machineType="n1-standard-8", guestAccelerators=T4,
                                                        scheduling={"onHostMaintenance": "MIGRATE"}),
        'ray_worker_cpu.node_config.scheduling.onHostMaintenance = "MIGRATE" (n1-standard-8 has GPUs)'),
    "GPU node type without a CPU count": (
        lambda c: c["available_node_types"]["ray_worker_gpu"].update(resources={"GPU": 1}),
        "available_node_types.ray_worker_gpu.resources.CPU = null: each Ray Train worker asks {CPU: 1, GPU: 1}"),
    "scheduling as text": (
        lambda c: _gcp_node(c, "ray_worker_gpu").update(scheduling="TERMINATE"),
        'available_node_types.ray_worker_gpu.node_config.scheduling = "TERMINATE": expected object or array or null'),
    "scheduling list of text": (
        lambda c: _gcp_node(c, "ray_worker_gpu").update(scheduling=["onHostMaintenance: TERMINATE"]),
        'ray_worker_gpu.node_config.scheduling[0] = "onHostMaintenance: TERMINATE": expected object'),
    "service accounts as a mapping": (
        lambda c: _gcp_node(c, "ray_worker_cpu").update(serviceAccounts={"email": "sa@p.iam.gserviceaccount.com"}),
        ('ray_worker_cpu.node_config.serviceAccounts = {"email": "sa@p.iam.gserviceaccount.com"}: expected array or '
         'null')),
    "availability zone changed, disk types not": (
        lambda c: c["provider"].update(availability_zone="europe-west4-a"),
        ('available_node_types.ray_head_default.node_config.disks[0].initializeParams.diskType = '
         '"zones/us-central1-a/diskTypes/pd-balanced": its zone is not provider.availability_zone (europe-west4-a)')),
    "scopes as text": (
        lambda c: _gcp_node(c, "ray_worker_cpu")["serviceAccounts"][0].update(
            scopes="https://www.googleapis.com/auth/cloud-platform"),
        'ray_worker_cpu.node_config.serviceAccounts[0].scopes = "https://www.googleapis.com/auth/cloud-platform": '
        'expected array or null'),
}


@pytest.mark.parametrize("case", GCP_BROKEN)
def test_broken_gcp_launcher_config_is_refused(case, tmp_path, capsys):
    change, expected = GCP_BROKEN[case]
    assert expected in _refused(capsys, _launcher(tmp_path, change, cloud="gcp"))


def test_gcp_scheduling_is_read_in_the_list_form_of_rays_examples(tmp_path, capsys):
    def attached_gpu(cfg: dict[str, Any]) -> None:
        _gcp_node(cfg, "ray_worker_cpu").update(machineType="n1-standard-8", guestAccelerators=T4, scheduling=[
            {"provisioningModel": "SPOT"}, {"onHostMaintenance": "TERMINATE"}])
    path = _launcher(tmp_path, attached_gpu, cloud="gcp")
    assert cli.run(main, [str(path)]) == 0, capsys.readouterr().err


def test_a_preemptible_gpu_node_may_leave_its_maintenance_to_gces_default(tmp_path, capsys):
    # Ray's own GCP examples' shape (scheduling: [preemptible: true]) with a GPU: GCE stops a preemptible VM for
    # maintenance by default, it never live-migrates.
    def preemptible_gpu(cfg: dict[str, Any]) -> None:
        _gcp_node(cfg, "ray_worker_cpu").update(machineType="n1-standard-8", guestAccelerators=T4,
                                                 scheduling=[{"preemptible": True}])
    path = _launcher(tmp_path, preemptible_gpu, cloud="gcp")
    assert cli.run(main, [str(path)]) == 0, capsys.readouterr().err


def test_aws_reads_a_gpu_nodes_cpus_from_its_instance_type(tmp_path, capsys):
    # The AWS node provider fills in the CPUs of a node type that leaves them out, from its instance type.
    path = _launcher(tmp_path, lambda c: c["available_node_types"][GPU].update(resources={"GPU": 1}))
    assert cli.run(main, [str(path)]) == 0, capsys.readouterr().err


def test_gpu_node_types_need_the_cpus_the_preset_gives_each_worker(tmp_path, monkeypatch, capsys):
    _presets_with(tmp_path, monkeypatch, "cifar10-aws", lambda t: t["scaling"].update(cpus_per_worker=12))
    assert ("resources.CPU = 8: each Ray Train worker asks {CPU: 12, GPU: 1}, so ray.worker.gpu (GPU: 1) must "
            "advertise CPU: 12 or more") in _refused(capsys, _launcher(tmp_path, lambda c: None))


def test_buckets_behind_an_endpoint_need_no_instance_profile(tmp_path, monkeypatch, capsys):
    """A MinIO or test server takes its credentials another way: the nodes' IAM profile is not judged."""
    def at_endpoint(tree: dict[str, Any]) -> None:
        tree["run"]["endpoint"] = tree["data"]["endpoint"] = "http://minio.internal:9000"
    _presets_with(tmp_path, monkeypatch, "cifar10-aws", at_endpoint)
    path = _launcher(tmp_path, lambda c: [t["node_config"].pop("IamInstanceProfile", None)
                                          for t in c["available_node_types"].values()])
    assert cli.run(main, [str(path)]) == 0, capsys.readouterr().err


def test_a_value_yaml_cannot_build_is_named_by_its_field(tmp_path, capsys):
    """PyYAML raises a plain ValueError or KeyError for a tagged value it cannot build, naming neither the field
    nor the file: the refusal names both, and what to write instead."""
    path = _launcher(tmp_path, lambda c: None)
    path.write_text(path.read_text() + "metadata:\n  lr: !!float x\n")
    assert _refused(capsys, path).endswith(': not valid YAML: metadata.lr = !!float "x" is not a valid float; write '
                                           'one, or remove the !!float tag')
    path.write_text(path.read_text().replace("!!float x", "2024-13-45"))  # read as a date without a tag
    assert _refused(capsys, path).endswith(": not valid YAML: metadata.lr = 2024-13-45: YAML reads it as a timestamp "
                                           "and it is not a valid one; quote it if it is text")
    manifest = _kuberay(tmp_path, "raycluster.yaml", lambda p, o: None)
    manifest.write_text(manifest.read_text() + "---\nmetadata:\n  labels: {x: !!bool maybe}\n")
    assert _refused(capsys, manifest).endswith(': not valid YAML: document 2: metadata.labels.x = !!bool "maybe" is '
                                               'not a valid bool; write one, or remove the !!bool tag')


def test_a_date_where_text_belongs_is_named_not_a_traceback(tmp_path, capsys):
    # YAML reads 2024-01-01 unquoted as a date, which JSON (the messages' notation) has no form for.
    path = _launcher(tmp_path, lambda c: c.update(cluster_name="DATE"))
    path.write_text(path.read_text().replace("cluster_name: DATE", "cluster_name: 2024-01-01"))
    assert 'cluster_name = "2024-01-01": expected string (quote it: "2024-01-01")' in _refused(capsys, path)


def test_launcher_needs_a_preset_line(tmp_path, capsys):
    path = _launcher(tmp_path, lambda c: None)
    path.write_text(path.read_text().split("\n", 1)[1])
    assert "# raydiff-preset: missing" in _refused(capsys, path)
    assert "'nope' is not a preset" in _refused(capsys, _launcher(tmp_path, lambda c: None, preset="nope"))
    assert "must be elastic" in _refused(capsys, _launcher(tmp_path, lambda c: None, preset="cifar10"))


def _presets_with(tmp_path: Path, monkeypatch, name: str, change: Callable[[dict[str, Any]], Any]) -> None:
    """A presets folder where preset `name` is changed, in place of configs/."""
    presets = tmp_path / "configs"
    presets.mkdir()
    tree = yaml.safe_load((config.PRESETS_DIR / f"{name}.yaml").read_text())
    change(tree)
    (presets / f"{name}.yaml").write_text(yaml.safe_dump(tree))
    monkeypatch.setattr(config.load, "PRESETS_DIR", presets)  # where loading reads it


def test_launcher_refuses_local_run_storage(tmp_path, monkeypatch, capsys):
    _presets_with(tmp_path, monkeypatch, "cifar10-aws", lambda t: t["run"].update(storage="/home/ubuntu/runs"))
    line = _refused(capsys, _launcher(tmp_path, lambda c: None))
    assert "run.storage = '/home/ubuntu/runs' is a path on each node's own disk" in line
    assert "use s3://BUCKET/PATH or gs://BUCKET/PATH" in line


def test_launcher_refuses_local_data_source(tmp_path, monkeypatch, capsys):
    _presets_with(tmp_path, monkeypatch, "cifar10-aws", lambda t: t["data"].update(source="/data/cifar10"))
    assert "data.source = '/data/cifar10'" in _refused(capsys, _launcher(tmp_path, lambda c: None))


# KubeRay manifests.
def _kuberay(tmp_path: Path, name: str, change: Callable[[dict[str, Any], dict[str, Any]], Any]) -> Path:
    """A copy of cluster/kuberay/NAME, and beside it of volume.yaml (the claim it mounts), with `change(pvc,
    ray_object)` applied."""
    folder = ROOT / "cluster" / "kuberay"
    (obj,) = [d for d in yaml.safe_load_all((folder / name).read_text()) if d]
    (pvc,) = [d for d in yaml.safe_load_all((folder / "volume.yaml").read_text()) if d]
    change(pvc, obj)
    (tmp_path / "volume.yaml").write_text(yaml.safe_dump(pvc, sort_keys=False))
    path = tmp_path / name
    path.write_text(yaml.safe_dump(obj, sort_keys=False))
    return path


def _group(obj: dict[str, Any], i: int) -> dict[str, Any]:
    spec = obj["spec"] if obj["kind"] == "RayCluster" else obj["spec"]["rayClusterSpec"]
    return spec["workerGroupSpecs"][i]


def _head(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["headGroupSpec"]


def _containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    return group["template"]["spec"]["containers"]


def _gpu_in_a_sidecar(group: dict[str, Any]) -> None:
    """The GPU limit moved from the Ray container to a second one."""
    ray_container = _containers(group)[0]
    for part in ("limits", "requests"):
        ray_container["resources"][part].pop("nvidia.com/gpu")
    _containers(group).append({"name": "sidecar", "image": "busybox:1.36",
                               "resources": {"limits": {"nvidia.com/gpu": 1}}})


KUBERAY_BROKEN = {
    "unknown key": (lambda p, o: _group(o, 0).update(minReplica=2),
                    "spec.workerGroupSpecs[0]: unknown key 'minReplica' (did you mean 'minReplicas'?)"),
    "unknown container key": (lambda p, o: _head(o)["template"]["spec"]["containers"][0].update(imagePullPolice="x"),
                              "containers[0]: unknown key 'imagePullPolice' (did you mean 'imagePullPolicy'?)"),
    "minReplicas > maxReplicas": (lambda p, o: _group(o, 1).update(minReplicas=3),
                                  "spec.workerGroupSpecs[1].minReplicas = 3 > maxReplicas = 2"),
    "replicas out of range": (lambda p, o: _group(o, 1).update(replicas=5),
                              "spec.workerGroupSpecs[1].replicas = 5 (cpu-workers): must be between"),
    "autoscaling off": (lambda p, o: o["spec"].update(enableInTreeAutoscaling=False),
                        "spec.enableInTreeAutoscaling = false: must be true"),
    "autoscaling missing": (lambda p, o: o["spec"].pop("enableInTreeAutoscaling"),
                            "spec: missing required key 'enableInTreeAutoscaling'"),
    "bad upscalingMode": (lambda p, o: o["spec"]["autoscalerOptions"].update(upscalingMode="Fast"),
                          'spec.autoscalerOptions.upscalingMode = "Fast": allowed: "Default", "Aggressive"'),
    "bad imagePullPolicy": (lambda p, o: _head(o)["template"]["spec"]["containers"][0].update(imagePullPolicy="Now"),
                            'imagePullPolicy = "Now": allowed: "Always", "IfNotPresent", "Never"'),
    "bad restartPolicy": (lambda p, o: _group(o, 0)["template"]["spec"].update(restartPolicy="Sometimes"),
                          'restartPolicy = "Sometimes": allowed: "Always", "OnFailure", "Never"'),
    "wrong apiVersion": (lambda p, o: o.update(apiVersion="ray.io/v1alpha1"),
                         'apiVersion = "ray.io/v1alpha1": must be "ray.io/v1"'),
    "head takes work": (lambda p, o: _head(o)["rayStartParams"].update({"num-cpus": "4"}),
                        'rayStartParams.num-cpus = "4": must be "0"'),
    "unquoted num-cpus": (lambda p, o: _head(o)["rayStartParams"].update({"num-cpus": 0}),
                          'rayStartParams.num-cpus = 0: expected string (quote it: "0")'),
    "exposed dashboard": (lambda p, o: _head(o).update(serviceType="LoadBalancer"),
                          "serviceType LoadBalancer / enableIngress expose the dashboard"),
    "auth disabled": (lambda p, o: o["spec"]["authOptions"].update(mode="disabled"),
                      "spec.authOptions.mode: Ray token auth is off"),
    "auth mode left to KubeRay": (lambda p, o: o["spec"]["authOptions"].pop("mode"),
                                  "spec.authOptions.mode: Ray token auth is off"),
    "literal token": (lambda p, o: _group(o, 0)["template"]["spec"]["containers"][0].update(
                          env=[{"name": "RAY_AUTH_TOKEN", "value": "not-a-secret"}]),
                      "RAY_AUTH_TOKEN has a literal value"),
    "two GPUs per pod": (lambda p, o: _group(o, 0)["template"]["spec"]["containers"][0]["resources"]["limits"].update(
                             {"nvidia.com/gpu": 2}), "nvidia.com/gpu = 2 per pod"),
    "replicas not the preset's": (lambda p, o: _group(o, 0).update(maxReplicas=4),
                                  ("minReplicas/maxReplicas = [0, 4]: minReplicas must be at most 2 and "
                                   "maxReplicas 8, the preset's scaling.num_workers = [2, 8] (cifar10-k8s)")),
    "more pods kept than the preset's fewest": (lambda p, o: _group(o, 0).update(minReplicas=3, replicas=3),
                                                "minReplicas/maxReplicas = [3, 8]: minReplicas must be at most 2"),
    "storage not in every pod": (lambda p, o: _group(o, 1)["template"]["spec"]["containers"][0].pop("volumeMounts"),
                                 ("run.storage = '/mnt/raydiff/runs' is not on a ReadWriteMany volume in every Ray "
                                  "pod (missing in cpu-workers)")),
    "storage not ReadWriteMany": (lambda p, o: p["spec"].update(accessModes=["ReadWriteOnce"]),
                                  "(missing in head, gpu-workers, cpu-workers)"),
    "no preset annotation": (lambda p, o: o["metadata"].pop("annotations"),
                             "metadata.annotations.raydiff.dev/preset: missing"),
    "Ray too old for token auth": (lambda p, o: o["spec"].update(rayVersion="2.50.0"),
                                   ('spec.rayVersion = "2.50.0": KubeRay refuses authOptions.mode token below Ray '
                                    '2.52.0 and starts no pods')),
    "unreadable rayVersion": (lambda p, o: o["spec"].update(rayVersion="latest"),
                              'spec.rayVersion = "latest": not a version KubeRay can read'),
    "auth field of KubeRay 1.6": (lambda p, o: o["spec"]["authOptions"].update(secretName="my-token"),
                                  ("spec.authOptions: 'secretName' needs KubeRay v1.6.0 or newer; the manifests "
                                   "support KubeRay v1.5.1")),
    "autoscaler field of KubeRay 1.7": (lambda p, o: o["spec"]["autoscalerOptions"].update(command=["ray"]),
                                        "spec.autoscalerOptions: 'command' needs KubeRay v1.7.0 or newer"),
    # What the GPU pods advertise to Ray, as KubeRay builds their `ray start`: each Ray Train worker asks for
    # {CPU: 1, GPU: 1}, so a pod that advertises no GPU or no CPU never holds one.
    "GPU pods that advertise no GPU": (lambda p, o: _group(o, 0)["rayStartParams"].update({"num-gpus": "0"}),
                                       ('spec.workerGroupSpecs[0].rayStartParams.num-gpus = "0": Ray would count 0 '
                                        "GPUs in each pod, which holds 1")),
    "GPU pods that advertise no CPU": (lambda p, o: _group(o, 0)["rayStartParams"].update({"num-cpus": "0"}),
                                       ('spec.workerGroupSpecs[0].rayStartParams.num-cpus = "0": Ray would count 0 '
                                        "CPUs in each pod of spec.workerGroupSpecs[0] (gpu-workers), and each Ray "
                                        "Train worker asks {CPU: 1, GPU: 1}")),
    "GPU group's resources without the GPU": (lambda p, o: _group(o, 0).update(resources={"GPU": "0"}),
                                              'spec.workerGroupSpecs[0].resources.GPU = "0": Ray would count 0 GPUs'),
    "GPU in a container Ray does not run in": (
        lambda p, o: _gpu_in_a_sidecar(_group(o, 0)),
        ("spec.workerGroupSpecs[0] (gpu-workers): containers[1] (sidecar) asks for GPUs; KubeRay gives Ray the first "
         "container's only")),
    "resources said twice": (lambda p, o: _group(o, 1).update(resources={"CPU": "15"},
                                                              rayStartParams={"num-cpus": "15"}),
                             ("spec.workerGroupSpecs[1]: resources and rayStartParams.num-cpus are both set; KubeRay "
                              "refuses")),
    "group without a CPU count": (lambda p, o: [_containers(_group(o, 1))[0]["resources"][part].pop("cpu")
                                                for part in ("limits", "requests")],
                                  ("spec.workerGroupSpecs[1] (cpu-workers): no CPU count for Ray (rayStartParams."
                                   "num-cpus, resources.CPU, or cpu in containers[0]'s limits or requests); Ray's "
                                   "autoscaler cannot read the group")),
    "num-gpus not a whole number": (lambda p, o: _group(o, 0)["rayStartParams"].update({"num-gpus": "0.5"}),
                                    ('rayStartParams.num-gpus = "0.5": `ray start --num-gpus` takes a whole number')),
    "group resources that are not quantities": (
        lambda p, o: _group(o, 1).update(resources={"CPU": "lots"}),
        'spec.workerGroupSpecs[1].resources.CPU = "lots": not a Kubernetes quantity'),
    "head takes work through its group resources": (
        lambda p, o: _head(o).update(rayStartParams={}, resources={"CPU": "4"}),
        'spec.headGroupSpec.resources.CPU = "4": must be "0"'),
    # The dashboard reached from outside the cluster (the dashboard listens on 0.0.0.0 in the head pod).
    "head service of type LoadBalancer": (
        lambda p, o: _head(o).update(headService={"spec": {"type": "LoadBalancer"}}),
        ('spec.headGroupSpec.headService.spec.type = "LoadBalancer": exposes the dashboard (KubeRay keeps the type a '
         "headService sets); remove it and reach the dashboard with `kubectl port-forward")),
    "head service on external addresses": (
        lambda p, o: _head(o).update(headService={"spec": {"externalIPs": ["203.0.113.7"]}}),
        "spec.headGroupSpec.headService.spec.externalIPs: exposes the dashboard on those addresses"),
    "head service spec as text": (lambda p, o: _head(o).update(headService={"spec": "LoadBalancer"}),
                                  'spec.headGroupSpec.headService.spec = "LoadBalancer": expected object'),
    "head on the node's network": (
        lambda p, o: _head(o)["template"]["spec"].update(hostNetwork=True),
        ("spec.headGroupSpec.template.spec.hostNetwork = true: the dashboard would listen on the node's own "
         "addresses; remove it and reach the dashboard with `kubectl port-forward")),
    "dashboard port on the node": (
        lambda p, o: _containers(_head(o))[0]["ports"][1].update(hostPort=8265),
        ("spec.headGroupSpec.template.spec.containers[0].ports[1].hostPort = 8265: publishes the head's port 8265 on "
         "the node's address")),
    # One Ray release in every image, and the one rayVersion names.
    "two Ray releases": (
        lambda p, o: _containers(_group(o, 0))[0].update(image="rayproject/ray:2.59.0-py311-gpu"),
        ("spec.headGroupSpec.template.spec.containers[0].image = rayproject/ray:2.60.0-py311 and "
         "spec.workerGroupSpecs[0].template.spec.containers[0].image = rayproject/ray:2.59.0-py311-gpu: two Ray "
         "releases in one cluster")),
    "rayVersion not the images'": (
        lambda p, o: o["spec"].update(rayVersion="2.61.0"),
        ('spec.rayVersion = "2.61.0", but spec.headGroupSpec.template.spec.containers[0].image = '
         "rayproject/ray:2.60.0-py311: set rayVersion to the images' Ray version")),
    "name KubeRay refuses": (lambda p, o: o["metadata"].update(name="Raydiff"),
                             ('metadata.name = "Raydiff": KubeRay refuses a RayCluster name that is not a DNS-1035 '
                              "label")),
    "name too long for KubeRay": (lambda p, o: o["metadata"].update(name="r" * 54),
                                  "54 characters; KubeRay refuses a RayCluster name longer than 53"),
    # A claim whose fields raydiff reads have the wrong shape (was: TypeError, a traceback).
    "claim's access modes as text": (lambda p, o: p["spec"].update(accessModes="ReadWriteMany"),
                                     'PersistentVolumeClaim raydiff-shared: spec.accessModes = "ReadWriteMany": '
                                     'expected array'),
    "claim's name as a list": (lambda p, o: p["metadata"].update(name=["raydiff-shared"]),
                               'a PersistentVolumeClaim: metadata.name = ["raydiff-shared"]: expected string'),
    "claim without a spec": (lambda p, o: p.update(spec=None),
                             "PersistentVolumeClaim raydiff-shared: spec = null: expected object"),
}


@pytest.mark.parametrize("case", KUBERAY_BROKEN)
def test_broken_raycluster_is_refused(case, tmp_path, capsys):
    change, expected = KUBERAY_BROKEN[case]
    assert expected in _refused(capsys, _kuberay(tmp_path, "raycluster.yaml", change))


def _ray_version(obj: dict[str, Any], version: str) -> None:
    """rayVersion and every image's tag set to `version`."""
    obj["spec"]["rayVersion"] = version
    for group in [_head(obj), *obj["spec"]["workerGroupSpecs"]]:
        for container in _containers(group):
            container["image"] = container["image"].replace("2.60.0", version)


@pytest.mark.parametrize("version", ["2.60", "v2.60.0", "2.60.0rc1", "2.61.3"])
def test_token_auth_takes_every_ray_version_kuberay_takes(version, tmp_path, capsys):
    path = _kuberay(tmp_path, "raycluster.yaml", lambda p, o: _ray_version(o, version))
    assert cli.run(main, [str(path)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("version", ["2.52.0", "3.0.0"])
def test_images_of_a_ray_release_raydiff_does_not_run_on_are_refused(version, tmp_path, capsys):
    """Token auth takes them (KubeRay: 2.52 or later), but the job's driver and workers run on the images' Ray."""
    line = _refused(capsys, _kuberay(tmp_path, "raycluster.yaml", lambda p, o: _ray_version(o, version)))
    assert (f"spec.headGroupSpec.template.spec.containers[0].image = rayproject/ray:{version}-py311: Ray {version}, "
            f"which raydiff does not run on (it needs ray<3,>=2.60, pyproject.toml)") in line


def test_the_gpu_pods_may_say_their_resources_as_kuberay_allows(tmp_path, capsys):
    """rayStartParams or the group's resources may say what the pods hold, where they say it right."""
    for change in (lambda p, o: _group(o, 0).update(rayStartParams={"num-cpus": "7", "num-gpus": "1"}),
                   lambda p, o: _group(o, 0).update(resources={"CPU": "7", "GPU": "1", "memory": "24Gi"}),
                   lambda p, o: _head(o).update(rayStartParams={}, resources={"CPU": "0"})):
        path = _kuberay(tmp_path, "raycluster.yaml", change)
        assert cli.run(main, [str(path)]) == 0, capsys.readouterr().err


def test_gpu_pods_need_the_cpus_the_preset_gives_each_worker(tmp_path, monkeypatch, capsys):
    _presets_with(tmp_path, monkeypatch, "cifar10-k8s", lambda t: t["scaling"].update(cpus_per_worker=8))
    line = _refused(capsys, _kuberay(tmp_path, "raycluster.yaml", lambda p, o: None))
    assert ('spec.workerGroupSpecs[0].template.spec.containers[0].resources.limits.cpu = "7": Ray would count 7 CPUs '
            "in each pod of spec.workerGroupSpecs[0] (gpu-workers), and each Ray Train worker asks {CPU: 8, GPU: 1}, "
            "so none would ever be placed") in line


def test_the_volume_outlives_the_cluster(tmp_path, capsys):
    """`kubectl delete -f` of a manifest deletes what the file holds: the claim is in a file of its own, which the
    checker reads beside the manifest, and which it checks on its own."""
    folder = ROOT / "cluster" / "kuberay"
    for name in ("raycluster.yaml", "rayjob.yaml"):
        assert [d["kind"] for d in yaml.safe_load_all((folder / name).read_text()) if d] in (["RayCluster"], ["RayJob"])
    assert [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all((folder / "volume.yaml").read_text())
            ] == [("PersistentVolumeClaim", "raydiff-shared")]
    path = _kuberay(tmp_path, "raycluster.yaml", lambda p, o: None)
    (tmp_path / "volume.yaml").unlink()
    assert ("run.storage = '/mnt/raydiff/runs' is not on a ReadWriteMany volume in every Ray pod (missing in head, "
            "gpu-workers, cpu-workers)") in _refused(capsys, path)
    _kuberay(tmp_path, "raycluster.yaml", lambda p, o: p["spec"].update(accessModes="ReadWriteMany"))
    assert ('volume.yaml: PersistentVolumeClaim raydiff-shared: spec.accessModes = "ReadWriteMany": expected array'
            in _refused(capsys, tmp_path / "volume.yaml"))


def test_raycluster_accepts_pod_spec_and_container_keys_of_the_crd(tmp_path, capsys):
    """Keys the CRD's PodSpec and Container define pass, however rarely raydiff's own files use them."""
    def gpu_pod_options(p: dict[str, Any], o: dict[str, Any]) -> None:
        pod = _group(o, 0)["template"]["spec"]
        pod.update(runtimeClassName="nvidia", hostNetwork=False, hostIPC=False, dnsPolicy="ClusterFirst",
                   topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                               "whenUnsatisfiable": "ScheduleAnyway"}])
        pod["containers"][0].update(tty=True, stdin=True, volumeDevices=[{"name": "raw", "devicePath": "/dev/xvda"}])
    path = _kuberay(tmp_path, "raycluster.yaml", gpu_pod_options)
    assert cli.run(main, [str(path)]) == 0, capsys.readouterr().err


RAYJOB_BROKEN = {
    "bad submissionMode": (lambda p, o: o["spec"].update(submissionMode="Http"),
                           'spec.submissionMode = "Http": allowed: "K8sJobMode", "HTTPMode"'),
    "unknown key": (lambda p, o: o["spec"].update(shutdownAfterJobFinish=True),
                    "spec: unknown key 'shutdownAfterJobFinish' (did you mean 'shutdownAfterJobFinishes'?)"),
    "autoscaling off": (lambda p, o: o["spec"]["rayClusterSpec"].update(enableInTreeAutoscaling=False),
                        "spec.rayClusterSpec.enableInTreeAutoscaling = false: must be true"),
    "another preset": (lambda p, o: o["spec"].update(entrypoint="python -m raydiff.train --config cifar10"),
                       ("spec.entrypoint runs --config cifar10, but metadata.annotations.raydiff.dev/preset is "
                        "cifar10-k8s")),
    "replicas not the preset's": (lambda p, o: _group(o, 0).update(maxReplicas=4),
                                  ("spec.rayClusterSpec.workerGroupSpecs[0] (gpu-workers): minReplicas/maxReplicas "
                                   "= [2, 4]")),
    "Ray too old for token auth": (lambda p, o: o["spec"]["rayClusterSpec"].update(rayVersion="2.46.0"),
                                   'spec.rayClusterSpec.rayVersion = "2.46.0": KubeRay refuses authOptions.mode token'),
    "name too long for KubeRay": (lambda p, o: o["metadata"].update(name="r" * 48),
                                  "48 characters; KubeRay refuses a RayJob name longer than 47"),
    "no cluster": (lambda p, o: o["spec"].pop("rayClusterSpec"),
                   ("spec: missing required key 'rayClusterSpec'; a RayJob needs rayClusterSpec (the cluster it "
                    "creates) or clusterSelector: {ray.io/cluster: NAME}")),
    "two clusters": (lambda p, o: o["spec"].update(clusterSelector={"ray.io/cluster": "raydiff"}),
                     ("spec: clusterSelector and rayClusterSpec are both set; KubeRay runs the job on the selected "
                      "RayCluster and ignores rayClusterSpec")),
    "cluster selected by another label": (
        lambda p, o: [o["spec"].pop("rayClusterSpec"), o["spec"].update(clusterSelector={"app": "raydiff"})],
        "spec.clusterSelector: missing 'ray.io/cluster'; KubeRay finds the RayCluster by that key only"),
}


@pytest.mark.parametrize("case", RAYJOB_BROKEN)
def test_broken_rayjob_is_refused(case, tmp_path, capsys):
    change, expected = RAYJOB_BROKEN[case]
    assert expected in _refused(capsys, _kuberay(tmp_path, "rayjob.yaml", change))


def test_a_rayjob_may_run_on_a_raycluster_that_exists(tmp_path, capsys):
    def selected(p: dict[str, Any], o: dict[str, Any]) -> None:
        o["spec"].pop("rayClusterSpec")
        o["spec"]["clusterSelector"] = {"ray.io/cluster": "raydiff"}
    path = _kuberay(tmp_path, "rayjob.yaml", selected)
    assert cli.run(main, [str(path)]) == 0, capsys.readouterr().err


def test_kuberay_refuses_storage_off_the_volume(tmp_path, monkeypatch, capsys):
    _presets_with(tmp_path, monkeypatch, "cifar10-k8s", lambda t: t["run"].update(storage="/tmp/runs"))
    line = _refused(capsys, _kuberay(tmp_path, "raycluster.yaml", lambda p, o: None))
    assert "run.storage = '/tmp/runs' is not on a ReadWriteMany volume in every Ray pod" in line


def test_kuberay_accepts_bucket_storage(tmp_path, monkeypatch, capsys):
    _presets_with(tmp_path, monkeypatch, "cifar10-k8s", lambda t: t["run"].update(storage="gs://YOUR-BUCKET/runs"))
    path = _kuberay(tmp_path, "raycluster.yaml", lambda p, o: None)
    assert cli.run(main, [str(path)]) == 0
    assert capsys.readouterr().out == f"OK {path}\n  before launching, replace: YOUR-BUCKET (cifar10-k8s)\n"


# Files that are neither.
def test_other_files_are_refused(tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    assert _refused(capsys, missing).endswith(": no such file")
    other = tmp_path / "other.yaml"
    other.write_text("foo: 1\n")
    assert "neither a Ray cluster-launcher config" in _refused(capsys, other)
    broken = tmp_path / "broken.yaml"
    broken.write_text("foo: [1\n")
    assert "not valid YAML" in _refused(capsys, broken)
    listed_kind = tmp_path / "kind.yaml"  # was: TypeError, unhashable type 'list'
    listed_kind.write_text("kind: [RayJob]\n")
    assert "neither a Ray cluster-launcher config" in _refused(capsys, listed_kind)


def test_good_and_bad_files_together(tmp_path, capsys):
    bad = _kuberay(tmp_path, "raycluster.yaml", lambda p, o: o["spec"].update(enableInTreeAutoscaling=False))
    assert cli.run(main, [str(ROOT / "cluster" / "gcp.yaml"), str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == (f"OK {ROOT / 'cluster' / 'gcp.yaml'}\n  before launching, replace: YOUR-PROJECT-ID (gcp.yaml), "
                   f"YOUR-BUCKET (cifar10-gcp)\n")
    assert err.count("\n") == 1 and str(bad) in err

