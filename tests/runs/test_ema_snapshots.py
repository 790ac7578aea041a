"""The post-hoc EMA's snapshots in a run directory: listing, what they cost on storage, and which weights a
rebuilt average stands for (the rebuild itself: tests/test_ema.py and tests/model/test_weight_averages.py)."""

from __future__ import annotations

import pytest

from raydiff.config import load_config
from raydiff.model.unet import build_model, count_parameters
from raydiff.runs.ema_snapshots import (
    describe_snapshots,
    list_snapshots,
    snapshot_name,
    snapshot_size,
    weights_of,
)
from raydiff.storage.rundir import RunDir


def test_snapshots_are_listed_by_step_and_nothing_else_counts(tmp_path):
    run = RunDir(tmp_path)
    assert list_snapshots(run) == []
    for step in (200, 100, 1400):
        run.write_bytes(snapshot_name(step), b"x")
    run.write_bytes("ema_snapshots/notes.txt", b"mine")
    assert list_snapshots(run) == [100, 200, 1400]


def test_the_storage_cost_is_four_bytes_per_parameter_per_width_per_snapshot():
    cfg = load_config("smoke", ["train.ema=posthoc", "train.ema_sigma_rels=[0.05,0.1,0.2]"])
    size, count = snapshot_size(cfg)
    assert size == 4 * count_parameters(build_model(cfg)) * 3
    assert count == 2  # 20 steps, every checkpoint (10), the last included
    uneven = load_config("smoke", ["train.ema=posthoc", "train.ema_snapshot_every=7"])
    assert snapshot_size(uneven)[1] == 3  # steps 7, 14 and the end, 20
    assert describe_snapshots(cfg).startswith("post-hoc EMA sigma_rel 0.05, 0.1, 0.2: a snapshot every 10 steps, ")


def test_a_rebuilt_average_is_named_and_has_no_online_weights():
    assert weights_of({"ema": {}}, "run", use_ema=True) == "EMA"
    assert weights_of({"ema": {}}, "run", use_ema=False) == "online"
    rebuilt = {"ema": {}, "posthoc": {"sigma_rel": 0.07, "snapshots": 28}}
    assert weights_of(rebuilt, "out/sigma_rel-0.070", use_ema=True) == "post-hoc EMA sigma_rel 0.07"
    with pytest.raises(ValueError, match="--no-ema: out/sigma_rel-0.070 is a post-hoc EMA average"):
        weights_of(rebuilt, "out/sigma_rel-0.070", use_ema=False)


FOREIGN_SNAPSHOTS = {  # what is wrong: (how the snapshot is changed, the reason given)
    "a model's state_dict": (lambda s: s["profiles"][0],
                             "no 'step', 'images_seen', 'sigma_rels', 'profiles', 'config'"),
    "profiles not a list": (lambda s: {**s, "profiles": {}},
                            "its 'profiles' is not a list of mappings of names to tensors"),
    "profiles of ints": (lambda s: {**s, "profiles": [{k: 1 for k in p} for p in s["profiles"]]},
                         "its 'profiles' is not a list of mappings of names to tensors"),
    "profiles of lists": (lambda s: {**s, "profiles": [[1, 2] for _ in s["profiles"]]},
                          "its 'profiles' is not a list of mappings of names to tensors"),
    "sigma_rels of words": (lambda s: {**s, "sigma_rels": ["a", "b"]}, "its 'sigma_rels' is not a list of numbers"),
    "step a word": (lambda s: {**s, "step": "10"}, "its 'step' is not an int >= 0"),
    "one profile short": (lambda s: {**s, "profiles": s["profiles"][:1]},
                          "its 'sigma_rels' and 'profiles' are not lists of one length"),
}


@pytest.mark.parametrize("foreign", list(FOREIGN_SNAPSHOTS))
def test_a_snapshot_raydiff_did_not_write_is_refused_in_one_line(tmp_path, capsys, foreign):
    """torch loads it with its safe loader; raydiff.ema then met a KeyError's traceback ('sigma_rels'), an
    AttributeError's (profiles of ints or lists: 'is_floating_point', 'items') or float()'s ValueError, unnamed."""
    import torch
    from conftest import write_posthoc_run

    from raydiff import cli, ema

    write_posthoc_run(tmp_path / "run", steps=20)
    run = RunDir(tmp_path / "run")
    snapshot = torch.load(run.open_binary(snapshot_name(10)), weights_only=True)
    change, reason = FOREIGN_SNAPSHOTS[foreign]
    torch.save(change(snapshot), tmp_path / "run" / snapshot_name(10))
    code = cli.run(ema.main, ["--checkpoint", str(tmp_path / "run"), "--sigma-rel", "0.07",
                              "--out", str(tmp_path / "out")])
    assert code == 2 and capsys.readouterr().err == (
        f"raydiff: config error: {run / snapshot_name(10)}: not a raydiff snapshot ({reason}); move it out of "
        f"ema_snapshots/, where each step_NNNNNNNN.pt is read as a snapshot\n")
    assert not (tmp_path / "out").exists()
