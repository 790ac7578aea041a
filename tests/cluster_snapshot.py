"""What a test cluster holds when a test that uses it fails: free CPUs, the live placement groups with their
creators' fates, and the live actors that hold resources, in a few lines, read straight from the GCS (no driver,
no dashboard). A test that waits on resources someone left held times out with nothing else to go on: CI shows only
the end of the output, so conftest prints these lines at the end of the run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
from ray._private.authentication.grpc_authentication_client_interceptor import _get_authentication_metadata_tuple
from ray.core.generated import gcs_pb2, gcs_service_pb2, gcs_service_pb2_grpc

TIMEOUT_S = 10


@contextlib.contextmanager
def gcs(address: str) -> Iterator[tuple[grpc.Channel, dict]]:
    """A channel to the GCS at `address`, and the keyword arguments of a request on it (this process's token, a
    timeout): for what the tests read or ask of the GCS that Ray's Python API does not offer."""
    with grpc.insecure_channel(address) as channel:
        yield channel, {"metadata": _get_authentication_metadata_tuple(), "timeout": TIMEOUT_S}


def _cpus(resources_list, field: str) -> float:
    return sum(getattr(node, field).get("CPU", 0.0) for node in resources_list)


def _short(binary: bytes) -> str:
    return binary.hex()[:8]


def snapshot(address: str) -> str:
    """The cluster at `address` in a few lines, or why it could not be read: it never raises (it runs in a pytest
    hook, where an exception ends the run)."""
    try:
        return _snapshot(address)
    except Exception as exc:  # noqa: BLE001
        return f"could not read the cluster at {address}: {exc!r}"[:300]


def _snapshot(address: str) -> str:
    with gcs(address) as (channel, call):
        resources = gcs_service_pb2_grpc.NodeResourceInfoGcsServiceStub(channel)
        free = _cpus(resources.GetAllAvailableResources(gcs_service_pb2.GetAllAvailableResourcesRequest(),
                                                        **call).resources_list, "resources_available")
        total = _cpus(resources.GetAllTotalResources(gcs_service_pb2.GetAllTotalResourcesRequest(),
                                                     **call).resources_list, "resources_total")
        jobs = gcs_service_pb2_grpc.JobInfoGcsServiceStub(channel).GetAllJobInfo(
            gcs_service_pb2.GetAllJobInfoRequest(skip_submission_job_info_field=True,
                                                 skip_is_running_tasks_field=True), **call).job_info_list
        groups = gcs_service_pb2_grpc.PlacementGroupInfoGcsServiceStub(channel).GetAllPlacementGroup(
            gcs_service_pb2.GetAllPlacementGroupRequest(), **call).placement_group_table_data
        actors = gcs_service_pb2_grpc.ActorInfoGcsServiceStub(channel).GetAllActorInfo(
            gcs_service_pb2.GetAllActorInfoRequest(), **call).actor_table_data
    ended = {job.job_id for job in jobs if job.is_dead}
    actor_state = {a.actor_id: gcs_pb2.ActorTableData.ActorState.Name(a.state) for a in actors}
    lines = [f"CPU {free:g}/{total:g} free; jobs ended {len(ended)} of {len(jobs)}"]
    for group in groups:
        if group.state == gcs_pb2.PlacementGroupTableData.REMOVED:
            continue
        cpus = sum(bundle.unit_resources.get("CPU", 0.0) for bundle in group.bundles)
        creator = group.creator_actor_id
        by = (f"actor {_short(creator)} {actor_state.get(creator, 'unknown')}" if creator.strip(b"\xff")
              else "its driver")
        lines.append(f"group {_short(group.placement_group_id)} "
                     f"{gcs_pb2.PlacementGroupTableData.PlacementGroupState.Name(group.state)} {cpus:g} CPU"
                     f"{' detached' if group.is_detached else ''}, made by {by} of job {_short(group.creator_job_id)}"
                     f"{' (ended)' if group.creator_job_id in ended else ''}; flags job_dead={group.creator_job_dead} "
                     f"actor_dead={group.creator_actor_dead}")
    for actor in actors:
        held = actor.required_resources.get("CPU", 0.0)
        if actor.state == gcs_pb2.ActorTableData.ALIVE and held:
            lines.append(f"actor {actor.class_name} {_short(actor.actor_id)} of job {_short(actor.job_id)}"
                         f"{' (ended)' if actor.job_id in ended else ''} holds {held:g} CPU")
    return "\n".join(lines)
