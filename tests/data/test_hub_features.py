"""What raydiff reads from the metadata of Parquet files that Hugging Face's `datasets` wrote (no Ray)."""

from __future__ import annotations

import json

import pyarrow as pa

from raydiff.data.hub_features import class_label_names, image_columns


def _schema(features, columns=("img", "label")) -> pa.Schema:
    metadata = None if features is None else {"huggingface": features if isinstance(features, str) else
                                              json.dumps({"info": {"features": features}})}
    return pa.schema([(name, pa.int64()) for name in columns], metadata=metadata)


NOT_OF_DATASETS = (None, "{not json", json.dumps({"info": []}), json.dumps({"info": {"features": ["img"]}}))


def test_class_names_come_from_a_class_label_feature_and_nothing_else():
    assert class_label_names(_schema({"label": {"names": ["cat", "dog"], "_type": "ClassLabel"}}), "label") == (
        "cat", "dog")
    for features in (*NOT_OF_DATASETS, {"label": {"dtype": "int64", "_type": "Value"}}, {"other": {}},
                     {"label": {"names": "cat", "_type": "ClassLabel"}},
                     {"label": {"names": ["cat", "cat"], "_type": "ClassLabel"}}):  # names that tell no id apart
        assert class_label_names(_schema(features), "label") == (), features


def test_image_columns_are_those_an_image_feature_describes_in_the_files_order():
    features = {"label": {"_type": "ClassLabel", "names": ["a"]}, "thumb": {"_type": "Image"},
                "img": {"_type": "Image"}, "caption": {"_type": "Value", "dtype": "string"}}
    assert image_columns(_schema(features, ("img", "label", "caption", "thumb"))) == ["img", "thumb"]
    assert image_columns(_schema({"img": {"_type": "Image"}}, ("label",))) == []  # a feature of no column
    for features in (*NOT_OF_DATASETS, {"img": "Image"}):
        assert image_columns(_schema(features)) == [], features
