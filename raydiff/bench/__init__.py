"""Benchmarks (`python -m raydiff.bench`): each prints numbers against a baseline measured in the same run."""

from __future__ import annotations

from raydiff.config import Config, ConfigError, load_config


def load_model_config(config: str, overrides: list[str], bench: str) -> Config:
    """The config of a bench that builds the model before (or without) reading any data: the data need not be at
    hand, and so a class-conditional model's `model.num_classes: auto` cannot be counted; refused in one line."""
    cfg = load_config(config, overrides, check_source=False)
    if cfg.model.num_classes == "auto":
        raise ConfigError(f"model.num_classes = auto: `bench {bench}` builds the model without counting the data's "
                          "classes; set model.num_classes to their number (--set model.num_classes=N)")
    return cfg
