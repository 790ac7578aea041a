"""What a Parquet file written by Hugging Face's `datasets` says of its columns, in its schema's `huggingface`
metadata: which columns hold images (an `Image` feature), and the name of each id of a `ClassLabel` column.

Any other Parquet file has no such metadata, and both answers are empty: raydiff then reads the columns that the
config names, as it does for every Parquet file.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa


def _features(schema: pa.Schema) -> dict[str, Any]:
    """{column: its feature} as `datasets` wrote them; {} when the file is not of its making."""
    try:
        features = json.loads((schema.metadata or {})[b"huggingface"])["info"]["features"]
    except (KeyError, TypeError, ValueError):  # no such metadata, or not the shape `datasets` writes
        return {}
    return features if isinstance(features, dict) else {}


def class_label_names(schema: pa.Schema, column: str) -> tuple[str, ...]:
    """The name of each id of `column` as a `ClassLabel` feature gives them; () when the file names none."""
    feature = _features(schema).get(column)
    names = feature.get("names") if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" else None
    unique = [str(n) for n in names] if isinstance(names, list) else []
    return tuple(unique) if len(set(unique)) == len(unique) else ()


def image_columns(schema: pa.Schema) -> list[str]:
    """The columns an `Image` feature describes, in the file's order."""
    features = _features(schema)
    return [name for name in schema.names
            if isinstance(features.get(name), dict) and features[name].get("_type") == "Image"]
