"""model.init_from naming a raydiff run or checkpoint folder, local or on an object store: a fine-tune starts
from its EMA weights (the newest checkpoint's, a chosen checkpoint's, or a post-hoc average's), checked against
the run's model before anything starts, without diffusers."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
import yaml
from conftest import run_cli, write_checkpoint

from raydiff import cli, train
from raydiff.config import ConfigError, load_config
from raydiff.runs.checkpoint import list_checkpoints, read_state, write_state
from raydiff.runs.init_from import load_init_weights
from raydiff.storage.rundir import RunDir

SMOKE = ["diffusion.timesteps=50"]


def same(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return weights.keys() == expected.keys() and all(torch.equal(weights[k], v) for k, v in expected.items())


def test_a_run_folder_gives_its_newest_checkpoint_s_ema_and_a_checkpoint_folder_its_own(tmp_path):
    cfg = load_config("smoke", SMOKE, check_source=False)
    older = write_checkpoint(tmp_path / "run", cfg, step=10, seed=1)
    newer = write_checkpoint(tmp_path / "run", cfg, step=20, seed=2)
    run = load_config("smoke", [*SMOKE, f"model.init_from={tmp_path / 'run'}"], check_source=False)
    assert same(load_init_weights(run).weights, read_state(newer)["ema"])
    chosen = load_init_weights(run.replaced("model", init_from=str(older))).weights
    assert same(chosen, read_state(older)["ema"]) and not same(chosen, read_state(newer)["ema"])
    # What shapes no weight may differ (dropout, the diffusion keys); the run's own config is the one trained.
    run = load_config("smoke", [f"model.init_from={older}", "model.dropout=0.1", "diffusion.timesteps=100"],
                      check_source=False)
    assert same(load_init_weights(run).weights, read_state(older)["ema"])


def test_a_post_hoc_ema_average_is_a_checkpoint_to_start_from(tmp_path):
    from conftest import write_posthoc_run

    from raydiff.runs.ema_snapshots import rebuild

    cfg, _, _ = write_posthoc_run(tmp_path / "run")
    average = rebuild(RunDir(tmp_path / "run"), [0.07])[0]
    write_state(tmp_path / "sigma_rel-0.070", average.state)
    run = cfg.replaced("model", init_from=str(tmp_path / "sigma_rel-0.070"))
    assert same(load_init_weights(run).weights, average.state["ema"])


def test_a_gpu_run_s_ema_saved_as_one_buffer_gives_weights_that_pickle_alone(tmp_path):
    """The driver sends the weights to its workers through Ray's object store, which pickles each tensor with all
    of its storage: weights that were views of a GPU run's one EMA buffer would carry it whole, each of them."""
    cfg = load_config("smoke", SMOKE, check_source=False)
    folder = write_checkpoint(tmp_path / "run", cfg, flat_ema=True)
    saved = read_state(folder)["ema"]
    assert len({v.untyped_storage().data_ptr() for v in saved.values() if v.is_floating_point()}) == 1  # as saved
    weights = load_init_weights(cfg.replaced("model", init_from=str(tmp_path / "run"))).weights
    assert same(weights, saved)
    nbytes = sum(v.numel() * v.element_size() for v in weights.values())
    assert len(pickle.dumps(weights)) < 1.1 * nbytes + 100_000


@pytest.mark.parametrize("overrides, line", [
    (["model.base_channels=32"], "model.base_channels = 32 here, but the run there has 16"),
    (["model.channel_mult=[1,2,2]"], "model.channel_mult = [1, 2, 2] here, but the run there has [1, 2]"),
    (["data.resolution=16", "model.attention_resolutions=[8]"], "data.resolution = 16 here, but the run there has 8"),
    (["model.norm_eps=1e-5"], "model.norm_eps = 1e-05 here, but the run there has 1e-06"),
])
def test_a_model_that_does_not_fit_is_refused_naming_the_key_and_both_values(overrides, line, tmp_path):
    write_checkpoint(tmp_path / "run", load_config("smoke", SMOKE, check_source=False))
    cfg = load_config("smoke", [*SMOKE, *overrides, f"model.init_from={tmp_path / 'run'}"], check_source=False)
    with pytest.raises(ConfigError) as refused:
        load_init_weights(cfg)
    assert str(refused.value) == f"model.init_from = '{tmp_path / 'run'}': {line}"


def test_classes_must_match_and_auto_takes_a_class_conditional_run(tmp_path):
    conditional = [*SMOKE, "data.labels=auto", "model.num_classes=3"]
    write_checkpoint(tmp_path / "run", load_config("smoke", conditional, check_source=False),
                     classes={"names": ["a", "b", "c"], "counts": [1, 1, 1]})
    init_from = f"model.init_from={tmp_path / 'run'}"
    assert load_init_weights(load_config("smoke", [*conditional, init_from], check_source=False)).weights
    auto = load_config("smoke", [*SMOKE, "data.labels=auto", "model.num_classes=auto", init_from], check_source=False)
    assert load_init_weights(auto).weights  # the classes the data has are compared once it is read (check_classes)
    for classes, line in [("0", "model.num_classes = 0 (unconditional) here, but the run there has 3 classes"),
                          ("5", "model.num_classes = 5 here, but the run there has 3 classes")]:
        labels = ["data.labels=auto"] if classes != "0" else []
        cfg = load_config("smoke", [*SMOKE, *labels, f"model.num_classes={classes}", init_from], check_source=False)
        with pytest.raises(ConfigError, match=rf"^model\.init_from = '.*': {re.escape(line)}$"):
            load_init_weights(cfg)


def test_an_init_from_run_on_an_object_store_is_read_from_there(s3_server, tmp_path):
    endpoint, client = s3_server
    client.create_bucket(Bucket="init-from")
    cfg = load_config("smoke", SMOKE, check_source=False)
    local = write_checkpoint(tmp_path / "run", cfg, step=20)
    client.put_object(Bucket="init-from", Key="cifar/checkpoint_00000020/state.pt",
                      Body=(local / "state.pt").read_bytes())
    run = load_config("smoke", [*SMOKE, "model.init_from=s3://init-from/cifar", f"run.endpoint={endpoint}"],
                      check_source=False)
    assert same(load_init_weights(run).weights, read_state(local)["ema"])


def test_a_folder_that_holds_no_model_is_refused_when_the_config_is_read(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    code = cli.run(train.main, ["--set", f"model.init_from={tmp_path / 'notes'}", "--set",
                                f"run.storage={tmp_path / 'runs'}"])
    assert code == 2 and capsys.readouterr().err == (
        f"raydiff: config error: model.init_from = '{tmp_path / 'notes'}': must be a raydiff run or checkpoint "
        f"folder (local, s3:// or gs://), a diffusers pipeline folder (with unet/config.json), a UNet2DModel folder "
        f"(with config.json) or a Hugging Face hub id such as google/ddpm-cifar10-32\n")
    assert not (tmp_path / "runs").exists()


@pytest.mark.ray
def test_a_fine_tune_starts_from_a_trained_run(tmp_path):
    run_dir = tmp_path / "trained"  # a run's two checkpoints, as training writes them (no Ray needed for that)
    write_checkpoint(run_dir, load_config("smoke", check_source=False), step=10, seed=1)
    write_checkpoint(run_dir, load_config("smoke", check_source=False), step=20, seed=2)
    # lr 1e-12: two steps move no weight measurably, so the run's final weights show where it started.
    proc = run_cli("raydiff.train", "--config", "smoke", "--set", f"model.init_from={run_dir}",
                   "--set", "train.total_steps=2", "--set", "train.lr=1e-12", "--set", "scaling.num_workers=1",
                   "--set", "train.sample_num=1", "--set", "train.sample_steps=1", "--set", "run.name=fine-tune",
                   "--set", f"run.storage={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    newest = list_checkpoints(run_dir)[-1]
    assert f"model.init_from: starting from {run_dir} ({newest.name}, step 20, EMA weights)" in proc.stdout
    fine_tune = tmp_path / "fine-tune"
    assert yaml.safe_load((fine_tune / "config.yaml").read_text())["model"]["init_from"] == str(run_dir)
    trained = read_state(list_checkpoints(fine_tune)[-1])["model"]
    assert all(torch.allclose(trained[k], v, atol=1e-8) for k, v in read_state(newest)["ema"].items())


def test_an_init_from_checkpoint_raydiff_did_not_write_is_refused_in_one_line(tmp_path):
    """A model's bare state_dict saved as state.pt: torch loads it, and state["config"] was a KeyError's
    traceback."""
    folder = write_checkpoint(tmp_path / "run", load_config("smoke", SMOKE, check_source=False), step=10)
    torch.save(read_state(folder)["ema"], folder / "state.pt")
    cfg = load_config("smoke", [*SMOKE, f"model.init_from={folder}"], check_source=False)
    with pytest.raises(FileNotFoundError) as refused:
        load_init_weights(cfg)
    assert str(refused.value) == (f"{folder}: no checkpoint can be read: checkpoint_00000010 (not a raydiff "
                                  f"checkpoint (no 'config', 'ema', 'step'))")
    assert isinstance(refused.value, cli.USER_ERRORS)  # one line, exit 2, from every command


def test_an_init_from_checkpoint_whose_config_has_an_unknown_key_is_refused_naming_it(tmp_path):
    folder = write_checkpoint(tmp_path / "run", load_config("smoke", SMOKE, check_source=False), step=10)
    state = read_state(folder)
    state["config"]["model"]["wings"] = 2
    write_state(folder, state)
    cfg = load_config("smoke", [*SMOKE, f"model.init_from={folder}"], check_source=False)
    with pytest.raises(ConfigError) as refused:
        load_init_weights(cfg)
    assert str(refused.value).startswith(f"model.init_from = '{folder}': the config in {folder} cannot be read "
                                         f"(unknown key 'model.wings'")
