"""A run that cannot continue: checkpoints exist and none restores.

Why a module of its own: the commands tell a user's problem from a bug by this class (`raydiff.cli`) without
importing torch, which the checkpoint code needs (`raydiff.runs.state` raises it).
"""

from __future__ import annotations


class Unresumable(RuntimeError):
    """Checkpoints exist but none can be restored; the message names each one and why."""
