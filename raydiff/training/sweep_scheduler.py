"""Early stopping for a sweep: ASHA, comparing each trial only with the trials of its own batch size and scaling
rule.

Why not one ASHA over the whole grid: the trials are compared at equal images seen, where a larger batch has
taken fewer optimizer steps and so trails. One pool let ASHA stop every trial of a large batch size, and the
sweep, whose question is the best learning rate at each batch size, had no answer for it. Within a group the
trials differ only in their learning rate, which is what early stopping is to rank.
"""

from __future__ import annotations

from typing import Any

from ray.tune.schedulers import AsyncHyperBandScheduler


class GroupedASHA(AsyncHyperBandScheduler):
    """`AsyncHyperBandScheduler` with brackets of their own for each (batch, rule) of a trial's config: ASHA's
    rungs, and so its cutoffs, hold the results of that group's trials only."""

    def __init__(self, **asha: Any) -> None:
        super().__init__(**asha)
        self._asha = asha
        self._group_brackets: dict[tuple[Any, Any], list] = {}

    def on_trial_add(self, tune_controller, trial) -> None:
        group = (trial.config.get("batch"), trial.config.get("rule"))
        if group not in self._group_brackets:  # the brackets a new ASHA of the same settings starts with
            self._group_brackets[group] = AsyncHyperBandScheduler(**self._asha)._brackets
        self._brackets = self._group_brackets[group]  # where the parent places the trial (its `_trial_info`)
        super().on_trial_add(tune_controller, trial)

    def debug_string(self) -> str:
        return "\n".join(f"batch {batch}, {rule} rule:\n" + "\n".join(b.debug_str() for b in brackets)
                         for (batch, rule), brackets in self._group_brackets.items())
