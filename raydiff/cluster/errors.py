"""The cluster failures a command reports in one line: no cluster to join, none that can start here, no node to
train on.

Why a module of its own: the commands tell a user's problem from a bug by these classes (`raydiff.cli`), and a
mistake found before Ray is imported (a bad `--set`) is reported at once only if the classes need no Ray.
"""

from __future__ import annotations


class RayUnreachable(RuntimeError):
    """The Ray cluster to join does not answer or refuses this client; the message is one line."""


class RayCannotStart(RuntimeError):
    """A local Ray instance cannot start on this machine (its temp directory is full, read-only or too long a
    path); the message is one line."""


class NoWorkerNode(RuntimeError):
    """No node that can run a training worker joined the cluster in time; the message is one line."""


class GpuNotVisible(RuntimeError):
    """A training worker that Ray gave a GPU cannot use one (its container was started without the GPU, or its
    torch has no CUDA); the message is one line."""
