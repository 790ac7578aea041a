"""Evaluation that cannot run as configured: missing weights or metrics package, a bad reference.

Why a module of its own: the commands tell a user's problem from a bug by this class (`raydiff.cli`) without
importing torch, which the feature extractors need (`raydiff.quality.features` raises it).
"""

from __future__ import annotations


class QualityError(RuntimeError):
    """Evaluation cannot run as configured (missing weights, a bad reference); the message is one line."""
