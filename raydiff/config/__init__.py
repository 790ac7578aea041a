"""Run configuration: the schema (`schema`), the rules between keys (`checks`), the learning-rate scaling rule
(`learning_rate`) and loading presets, YAML files and `key=value` overrides (`load`).

Config flows one way: preset YAML + overrides -> `Config` (validated) -> driver -> typed worker arguments -> workers.
"""

from raydiff.config.load import PRESETS_DIR, load_config, preset_names, resolve_config_path
from raydiff.config.schema import (
    Config,
    ConfigError,
    DataSection,
    DebugSection,
    DiffusionSection,
    EvalSection,
    LogSection,
    ModelSection,
    RunSection,
    ScalingSection,
    TrainSection,
    all_keys,
    parse_override,
    sections_problem,
    set_key,
)

__all__ = ["PRESETS_DIR", "Config", "ConfigError", "DataSection", "DebugSection", "DiffusionSection", "EvalSection",
           "LogSection", "ModelSection", "RunSection", "ScalingSection", "TrainSection", "all_keys", "load_config",
           "parse_override", "preset_names", "resolve_config_path", "sections_problem", "set_key"]
