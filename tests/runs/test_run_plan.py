"""What a train command means for an existing run directory: start, continue, finished, or refused when a key
that fixes what the checkpoints mean has changed."""

from __future__ import annotations

import json

import pytest
import yaml

from raydiff.config import Config, ConfigError, load_config
from raydiff.runs.run_plan import RunPlan, identity_changes, other_changes, plan_run
from raydiff.storage.rundir import RunDir

DATA = {"fingerprint": "f", "num_files": 1}


def write_run(run_dir, cfg: Config, *, steps=(10,), finished: bool = False) -> RunDir:
    run = RunDir(run_dir)
    run.write_text("config.yaml", yaml.safe_dump(cfg.to_dict()))
    run.write_text("data.json", json.dumps(DATA))
    for step in steps:
        run.write_bytes(f"checkpoint_{step:08d}/state.pt", b"")
    if finished:
        run.write_text("summary.json", json.dumps({"status": "finished"}))
    return run


def test_a_run_continues_from_its_newest_checkpoint_and_notes_what_changed(tmp_path):
    cfg = load_config("smoke")
    run = write_run(tmp_path / "run", cfg, steps=(10, 20))
    plan = plan_run(load_config("smoke", ["train.lr=0.01"]), run, DATA)
    assert (plan.action, plan.step) == ("continue", 20)
    assert any("train.lr" in note for note in plan.notes)
    assert plan_run(cfg, RunDir(tmp_path / "empty"), DATA).action == "start"


def test_a_cosine_run_extended_says_the_learning_rate_it_continues_at_and_an_rsqrt_one_keeps_it(tmp_path):
    cosine = ["train.lr=0.01", "train.warmup_steps=0", "train.lr_decay=cosine", "train.total_steps=40"]
    run = write_run(tmp_path / "cosine", load_config("smoke", cosine), steps=(20,))
    plan = plan_run(load_config("smoke", [*cosine, "train.total_steps=80"]), run, DATA)
    assert plan.action == "continue"
    assert "the learning rate continues at 0.00854 (0.005 before the change, at step 20)" in plan.notes, plan.notes

    before = load_config("smoke", ["train.lr=0.01", "train.warmup_steps=0", "train.total_steps=40"])
    run = write_run(tmp_path / "old", before, steps=(20,))
    old = before.to_dict()
    del old["train"]["lr_decay"], old["train"]["lr_decay_steps"]  # a run from before there was a decay
    run.write_text("config.yaml", yaml.safe_dump(old))
    plan = plan_run(load_config("smoke", cosine), run, DATA)
    assert "the learning rate continues at 0.005 (0.01 before the change, at step 20)" in plan.notes, plan.notes

    rsqrt = ["train.lr=0.01", "train.lr_decay=rsqrt", "train.lr_decay_steps=10", "train.total_steps=40"]
    run = write_run(tmp_path / "rsqrt", load_config("smoke", rsqrt), steps=(20,))
    plan = plan_run(load_config("smoke", [*rsqrt, "train.total_steps=80"]), run, DATA)
    assert plan.notes == ("changed since the last start: train.total_steps 40 -> 80",)


def test_a_finished_run_is_not_trained_again(tmp_path):
    cfg = load_config("smoke")
    run = write_run(tmp_path / "run", cfg, steps=(20,), finished=True)
    assert plan_run(cfg, run, DATA).action == "finished"


@pytest.mark.parametrize("override", ["train.seed=1", "train.global_batch=32", "train.ema=posthoc",
                                      "model.base_channels=8"])
def test_a_changed_identity_key_is_refused_in_one_line(tmp_path, override):
    run = write_run(tmp_path / "run", load_config("smoke"))
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"holds a run trained with {key} = .*; continuing it would be meaningless"):
        plan_run(load_config("smoke", [override]), run, DATA)


def test_the_post_hoc_widths_are_part_of_a_post_hoc_run_only(tmp_path):
    """A classic run tracks no post-hoc averages, so its widths mean nothing: changing them was refused as a change
    of the run, also for the runs written before (their config.yaml records the default widths)."""
    classic = write_run(tmp_path / "classic", load_config("smoke"))
    assert "ema_sigma_rels" in yaml.safe_load(classic.read_text("config.yaml"))["train"]
    for widths in ("[0.05]", "[0.1,0.15,0.2]"):
        assert plan_run(load_config("smoke", [f"train.ema_sigma_rels={widths}"]), classic, DATA).action == "continue"

    posthoc = write_run(tmp_path / "posthoc", load_config("smoke", ["train.ema=posthoc"]))
    assert plan_run(load_config("smoke", ["train.ema=posthoc"]), posthoc, DATA).action == "continue"
    with pytest.raises(ConfigError, match=r"holds a run trained with train.ema_sigma_rels = \[0.05, 0.1\], now "
                                          r"\[0.05\]; continuing it would be meaningless"):
        plan_run(load_config("smoke", ["train.ema=posthoc", "train.ema_sigma_rels=[0.05]"]), posthoc, DATA)
    # Switching the kind is the change named, whatever the widths.
    with pytest.raises(ConfigError, match=r"trained with train.ema = 'classic', now 'posthoc'; continuing"):
        plan_run(load_config("smoke", ["train.ema=posthoc", "train.ema_sigma_rels=[0.05]"]), classic, DATA)


@pytest.mark.parametrize("records", [True, False], ids=["with its records", "checkpoint folders only"])
def test_a_run_whose_newest_checkpoint_is_past_train_total_steps_is_refused_in_one_line(tmp_path, records):
    """It continued: the workers restored the checkpoint, trained nothing, and the run ended past its
    train.total_steps, which is no finished run; every re-run failed so, with no reason given. The step is the
    checkpoint folder's: the run's records may be gone (a run killed before its first records)."""
    run = write_run(tmp_path / "run", load_config("smoke", ["train.total_steps=2000"]), steps=(1000, 1500))
    if records:
        run.write_text("summary.json", json.dumps({"status": "stopped"}))
    else:
        run.remove("config.yaml")
        run.remove("data.json")
    with pytest.raises(ConfigError) as refused:
        plan_run(load_config("smoke", ["train.total_steps=1400"]), run, DATA)
    # With its records the checkpoint is known to be cut short of its start's 2000 steps: one step more at least.
    asked = 1501 if records else 1500
    assert str(refused.value) == (
        f"run.name = 'smoke': the newest checkpoint in {run} is at step 1500, past train.total_steps = 1400. Use "
        f"--set train.total_steps={asked} (or more) to continue it, --set run.name=NEW for a new run, or --set "
        f"run.resume=false to start this one over (the old run is moved aside, not deleted)")
    assert plan_run(load_config("smoke", ["train.total_steps=1400", "run.resume=false"]), run, DATA).replace
    assert plan_run(load_config("smoke", [f"train.total_steps={asked}"]), run, DATA).action == "continue"
    run.write_text("summary.json", json.dumps({"status": "finished", "steps": 1500}))  # a finished run says so
    assert plan_run(load_config("smoke", ["train.total_steps=1400"]), run, DATA).action == "finished"
    # A run finished at 1000, trained on towards 2000 and stopped at 1500 keeps its summary of step 1000 until it
    # ends again: it is not finished at 1500.
    run.write_text("summary.json", json.dumps({"status": "finished", "steps": 1000}))
    with pytest.raises(ConfigError, match="is at step 1500, past train.total_steps = 1200"):
        plan_run(load_config("smoke", ["train.total_steps=1200"]), run, DATA)


def test_a_stopped_run_is_not_ended_at_exactly_its_newest_checkpoint_s_step(tmp_path):
    """It would train no step, so the end's validation, evaluation, samples, snapshot and final checkpoint never
    came, under a summary that said finished. A checkpoint at the end its start trained towards (a run killed
    before its summary) finishes there; without the run's records, so does any."""
    stopped = write_run(tmp_path / "stopped", load_config("smoke", ["train.total_steps=2000"]), steps=(1000, 1500))
    stopped.write_text("summary.json", json.dumps({"status": "stopped"}))
    with pytest.raises(ConfigError) as refused:
        plan_run(load_config("smoke", ["train.total_steps=1500"]), stopped, DATA)
    assert str(refused.value) == (
        f"run.name = 'smoke': the newest checkpoint in {stopped} is at step 1500, before the end its run trained "
        f"towards (2000): ending it at train.total_steps = 1500 would train nothing and skip the end's validation, "
        f"evaluation, samples and final checkpoint. Use --set train.total_steps=1501 (or more) to continue it, --set "
        f"run.name=NEW for a new run, or --set run.resume=false to start this one over (the old run is moved aside, "
        f"not deleted)")
    ended = write_run(tmp_path / "ended", load_config("smoke", ["train.total_steps=1500"]), steps=(1000, 1500))
    assert plan_run(load_config("smoke", ["train.total_steps=1500"]), ended, DATA).action == "continue"
    # Ended at 1500, extended towards 2000 and failed before its first new checkpoint: its last config.yaml says
    # 2000, its start events say that 1500 was an end.
    extended = write_run(tmp_path / "extended", load_config("smoke", ["train.total_steps=2000"]), steps=(1000, 1500))
    extended.write_text("summary.json", json.dumps({"status": "failed", "steps": 1500}))
    extended.write_text("events.jsonl", "".join(json.dumps({"event": "start", "step": step, "total_steps": end}) + "\n"
                                                for step, end in ((0, 1500), (1500, 2000))))
    assert plan_run(load_config("smoke", ["train.total_steps=1500"]), extended, DATA).action == "continue"
    # The start that wrote the checkpoint decides, not another start's end at the same step: stopped at 700 of
    # 1500, continued towards 2000 and failed after its checkpoint at 1500 (a line not JSON passed over).
    extended.write_text("events.jsonl", "".join(json.dumps({"event": "start", "step": step, "total_steps": end}) + "\n"
                                                for step, end in ((0, 1500), (700, 2000))) + "{not json\n")
    with pytest.raises(ConfigError, match="before the end its run trained towards \\(2000\\)"):
        plan_run(load_config("smoke", ["train.total_steps=1500"]), extended, DATA)
    stopped.remove("config.yaml")
    stopped.remove("data.json")
    assert plan_run(load_config("smoke", ["train.total_steps=1500"]), stopped, DATA).action == "continue"


def test_keys_added_since_an_old_run_count_as_their_defaults():
    old = load_config("default").to_dict()
    del old["train"]["ema"], old["train"]["ema_sigma_rels"]
    assert identity_changes(old, load_config("default").to_dict()) == []
    assert other_changes(old, load_config("default", ["train.ema_decay=0.9"]).to_dict()) == [
        "train.ema_decay 0.995 -> 0.9"]


@pytest.mark.parametrize("name, text, problem", [
    ("config.yaml", "model: {base_channels: 16", "not valid YAML (line 1, column 26: expected ',' or '}', but got "
                                                 "'<stream end>' (while parsing a flow mapping at line 1, column 8))"),
    ("config.yaml", "", "it holds nothing"),
    ("config.yaml", "- model\n", "it holds a list, not a mapping of keys to values"),
    ("config.yaml", "model: 16\n", "expected sections of key: value pairs (data:, model:, train:, ...)"),
    ("config.yaml", "train: {lr_decay_steps: x}\n", "train.lr_decay_steps = 'x': expected integer"),
    ("data.json", '{"fingerprint": "f", "num', "not valid JSON (Unterminated string starting at: line 1 column 22 "
                                               "(char 21))"),
    ("data.json", '{"num_files": 1}', "no 'fingerprint' in it"),
    ("summary.json", '{"status": "fin', "not valid JSON (Unterminated string starting at: line 1 column 12 "
                                        "(char 11))"),
    ("summary.json", "", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
], ids=["config cut short", "config empty", "config a list", "config of no sections", "config value of a wrong type",
        "data cut short",
        "data without its fingerprint", "summary cut short", "summary empty"])
def test_a_damaged_record_of_the_run_is_refused_in_one_line_naming_it(tmp_path, name, text, problem):
    """A re-run met the YAML or JSON parser's traceback; an empty config.yaml silently skipped the check that the
    run continues with its own settings (here it would continue with another seed)."""
    cfg = load_config("smoke")
    run = write_run(tmp_path / "run", cfg, steps=(20,), finished=True)
    run.write_text(name, text)
    with pytest.raises(ConfigError) as refused:
        plan_run(load_config("smoke", ["train.seed=1"] if name == "config.yaml" else []), run, DATA)
    fix = ("remove it to continue the run (it is written again when the run ends)" if name == "summary.json" else
           "fix it to continue the run")
    assert str(refused.value) == (
        f"run.name = 'smoke': {run / name} is damaged: {problem}; {fix}, or use --set run.name=NEW for a new run, or "
        f"--set run.resume=false to start this one over (the old run is moved aside, not deleted)")
    assert plan_run(load_config("smoke", ["run.resume=false"]), run, DATA).replace  # that way out is open


def test_a_recorded_config_is_read_as_a_config_file_is_and_keeps_keys_removed_since(tmp_path):
    """A hand-edited `lr: '0.01'` (a YAML string, read as a number from a config file) ended in a TypeError
    traceback; a key an older raydiff wrote and this one no longer knows is passed over."""
    cfg = load_config("smoke", ["train.lr=0.01"])
    run = write_run(tmp_path / "run", cfg, steps=(10,))
    recorded = cfg.to_dict()
    recorded["train"]["lr"], recorded["model"]["base_channels"] = "0.01", str(cfg.model.base_channels)
    recorded["train"]["a_key_removed_since"] = "anything"
    run.write_text("config.yaml", yaml.safe_dump(recorded))
    plan = plan_run(load_config("smoke", ["train.lr=0.02"]), run, DATA)
    assert plan.action == "continue"
    assert "the learning rate continues at 0.02 (0.01 before the change, at step 10)" in plan.notes, plan.notes


def test_the_records_of_a_run_without_checkpoints_are_neither_read_nor_refused(tmp_path):
    # Nothing to continue: they are not what the new start is checked against (an empty config.yaml was refused).
    run = RunDir(tmp_path / "run")
    run.write_text("config.yaml", "")
    run.write_text("data.json", "{cut")
    assert plan_run(load_config("smoke", ["train.seed=1"]), run, DATA).action == "start"


def test_a_run_moved_aside_twice_in_one_second_keeps_both(tmp_path, monkeypatch):
    """Named by the second alone, a second move failed (local) or merged into the first on an object store,
    overwriting its files."""
    from raydiff.runs import run_plan
    from raydiff.runs.run_plan import move_aside

    monkeypatch.setattr(run_plan.time, "strftime", lambda *args: "20261207-120000")  # one second for both

    for content in ("first", "second"):
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "config.yaml").write_text(content)
        move_aside(RunDir(tmp_path / "run"))
    moved = sorted(p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-"))
    assert len(moved) == 2 and {(p / "config.yaml").read_text() for p in moved} == {"first", "second"}


def test_a_finished_run_whose_checkpoints_are_gone_is_refused_not_started_over_on_its_records(tmp_path):
    """Checkpoints pruned to save space: a re-run started in place, emptied metrics.jsonl and overwrote the
    config, data and summary records (and logged into the old dashboards' run). A run that ended before its first
    checkpoint (no finished summary) starts over as before."""
    run = write_run(tmp_path / "run", load_config("smoke"), steps=())
    run.write_text("summary.json", json.dumps({"status": "finished", "steps": 20}))
    with pytest.raises(ConfigError) as refused:
        plan_run(load_config("smoke"), run, DATA)
    assert str(refused.value) == (
        f"run.name = 'smoke': {run} holds a run that finished 20 steps and whose checkpoints are gone: starting over "
        f"there would overwrite its records. Use --set run.name=NEW for a new run, or --set run.resume=false to start "
        f"this one over (the old run is moved aside, not deleted)")
    assert plan_run(load_config("smoke", ["run.resume=false"]), run, DATA).replace
    run.write_text("summary.json", json.dumps({"status": "failed", "steps": 3}))
    assert plan_run(load_config("smoke"), run, DATA) == RunPlan("start", 0)


@pytest.mark.parametrize(("layout", "problem"), [
    ("memory", 'its layout is "memory", not {"cache": "memory"} or a stream\'s'),
    ({"cache": "stream"}, "its stream layout's window_shards is null, not a number of shards"),
    ({"cache": "disk"}, 'its layout is {"cache": "disk"}, not {"cache": "memory"} or a stream\'s'),
])
def test_a_hand_edited_data_layout_is_refused_in_one_line_naming_the_file(tmp_path, layout, problem):
    """The docs promise one line for a record that is not what raydiff wrote: data.json's layout gave a
    KeyError or TypeError traceback."""
    run = write_run(tmp_path / "run", load_config("smoke"), steps=(10,))
    run.write_text("data.json", json.dumps({**DATA, "layout": layout}))
    with pytest.raises(ConfigError) as refused:
        plan_run(load_config("smoke"), run, DATA)
    assert str(refused.value).startswith(f"run.name = 'smoke': {run / 'data.json'} is damaged: {problem}; fix it to "
                                         f"continue the run, or use --set run.name=NEW")
    run.write_text("data.json", json.dumps({**DATA, "layout": {"cache": "stream", "window_shards": 8}}))
    assert plan_run(load_config("smoke", ["data.cache=auto"]), run, DATA).action == "continue"
