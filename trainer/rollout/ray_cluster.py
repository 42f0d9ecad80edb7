"""Joining Ray for the rollout workers: the cluster at `distributed.ray_address` or a small
local instance, the capture endpoint's URL as other nodes reach it, and Ray's errors in one
line."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit, urlunsplit

from masenvs.trainer.config import DistributedConfig


class WorkerError(RuntimeError):
    """Rollout workers kept failing (or never started); the message names the cause."""


def start_ray(dist: DistributedConfig) -> None:
    """Join the cluster at `dist.ray_address`, or start a small local Ray instance."""
    import ray

    if dist.ray_address is None:
        ray.init(
            num_cpus=dist.rollout_workers + 1,  # room for a replacement
            include_dashboard=False,
            object_store_memory=200 * 2**20,
            log_to_driver=False,
        )
        return
    try:
        _check_reachable(dist.ray_address)  # Ray itself retries for minutes
        ray.init(address=dist.ray_address, log_to_driver=False)
    except (OSError, RuntimeError, ValueError) as exc:
        raise WorkerError(
            f"could not join the Ray cluster at distributed.ray_address={dist.ray_address!r} "
            f"({ray_reason(exc)}); start it (`ray start --head`) or set distributed.ray_address: "
            "null for a local Ray instance"
        ) from exc


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """Fail fast on a `host:port` (or `ray://host:port`) nobody listens on; 'auto' is Ray's."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
        pass


def ray_reason(exc: BaseException) -> str:
    """The first line of a Ray error, which names the cause without its traceback."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def reachable_url(root_url: str) -> str:
    """`root_url` as other nodes reach it: a wildcard bind address becomes this node's IP."""
    parts = urlsplit(root_url)
    if parts.hostname not in ("0.0.0.0", "::"):
        return root_url
    import ray.util

    return urlunsplit(parts._replace(netloc=f"{ray.util.get_node_ip_address()}:{parts.port}"))
