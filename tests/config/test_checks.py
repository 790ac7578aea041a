"""Checking configs: every refused value in one line naming its key (the rules of `raydiff.config.checks`), the
rules between keys, and the optional packages a setting needs."""

from __future__ import annotations

import pytest
from conftest import ROOT

from raydiff.config import ConfigError, all_keys, load_config
from raydiff.config.checks import parse_sigma_rels


@pytest.mark.parametrize("override, fragment", [
    ("train.lrr=1", "unknown key 'train.lrr' (did you mean 'train.lr'?)"),
    ("nosuch.key=1", "unknown key 'nosuch.key'"),
    ("train.lr=-1", "train.lr = -1.0: must be > 0"),
    ("train.lr=fast", "train.lr = 'fast': expected a finite number | null"),
    ("train.total_steps=1.5", "train.total_steps = 1.5: expected integer"),
    ("train.precision=fp8", "train.precision = 'fp8': expected auto | fp32 | bf16 | fp16"),
    ("diffusion.schedule=quadratic", "expected linear | cosine"),
    ("diffusion.prediction=score", "expected eps | v | x0"),
    ("scaling.use_gpu=maybe", "expected auto | true | false"),
    ("scaling.hang_timeout_s=5", "scaling.hang_timeout_s = 5.0: must be at least 10 seconds"),
    # Past what a timed wait takes (an OverflowError as the run's process group or its lease renewal began).
    ("scaling.hang_timeout_s=1e14", "scaling.hang_timeout_s = 100000000000000.0: must be at least 10 seconds, and at "
                                    "most 100,000,000 (about 3 years)"),
    ("run.lease_stale_s=1e30", "run.lease_stale_s = 1e+30: must be >= 4 seconds"),
    # Its timestep embedding divided by 0 (NaN outputs) at 2 or 3 channels, and ignored the timestep at 1.
    ("model.base_channels=2", "model.base_channels = 2: must be >= 4 (its sinusoidal timestep embedding needs two "
                              "frequencies)"),
    # No validation would ever run, silently.
    ("train.val_every=5", "train.val_every = 5: needs held-out images to measure on (data.val_images = 0): set "
                          "data.val_images, or train.val_every = 0"),
    ("scaling.node_wait_s=1e9", "scaling.node_wait_s = 1000000000.0: must be > 0 seconds, and at most 100,000,000"),
    # Ray refuses a resource finer than its 1/10,000th, when the run has started.
    ("scaling.cpus_per_worker=1e-8", "scaling.cpus_per_worker = 1e-08: must be at least 0.0001 (Ray counts CPUs in "
                                     "1/10,000ths), or null"),
    ("train.global_batch=1", "train.global_batch = 1: must be at least the number of workers (2)"),
    ("data.source=/no/such/folder", "data.source = '/no/such/folder': no such file or folder"),
    ("data.source=builtin:mnist", "builtin sources: builtin:digits"),
    ("data.source=ftp://host/images", "supported URI schemes: file://, s3://, gs://, gcs://, hf:// (or a local path)"),
    ("data.source=hf://datasets/uoft-cs", "data.source = 'hf://datasets/uoft-cs': a Hugging Face Hub source is "
                                          "hf://datasets/OWNER/NAME[@REVISION][/PATH]"),
    ("data.source=hf://uoft-cs/cifar10", "'hf://uoft-cs/cifar10': a Hugging Face Hub source is hf://datasets/"),
    ("data.source=hf://", "data.source = 'hf://': a Hugging Face Hub source is hf://datasets/"),
    ("run.storage=hf://datasets/me/runs", "run.storage = 'hf://datasets/me/runs': supported URI schemes: file://, "
                                          "s3://, gs://, gcs:// (or a local or NFS path)"),
    # An object store URI without its bucket: s3:// became a local folder named "s3:".
    ("run.storage=s3://", "run.storage = 's3://': an object store location is s3://BUCKET[/PREFIX]"),
    ("run.storage=gs:///runs", "run.storage = 'gs:///runs': an object store location is gs://BUCKET[/PREFIX]"),
    ("data.source=s3://", "data.source = 's3://': an object store location is s3://BUCKET[/PREFIX]"),
    ("eval.ref=gcs://", "eval.ref = 'gcs://': an object store location is gcs://BUCKET[/PREFIX]"),
    ("model.init_from=s3:///runs/a", "model.init_from = 's3:///runs/a': an object store location is "
                                     "s3://BUCKET[/PREFIX]"),
    ("data.resolution=10", "must be divisible by"),
    ("model.attention_resolutions=[5]", "each must be one of the model's resolutions [16, 8, 4]"),
    ("model.norm_groups=24", "must divide every channel count"),
    ("model.norm_eps=0", "model.norm_eps = 0.0: must be > 0"),
    ("model.dropout=1.0", "must be in [0, 1)"),
    ("train.compile=turbo", "train.compile = 'turbo': auto, true, false, or a torch.compile backend: "),
    ("train.channels_last=maybe", "train.channels_last"),
    ("train.keep_host_memory=maybe", "train.keep_host_memory = 'maybe': expected auto | true | false"),
    ("data.on_device=maybe", "data.on_device = 'maybe': expected auto | true | false"),
    ("train.ema_decay=1", "must be in [0, 1)"),
    ("train.ema_sigma_rels=[1e-200]", "train.ema_sigma_rels = [1e-200]: must be one or more different widths, each "
                                      "in [0.0001, 0.28)"),  # an exponent that overflowed in every worker
    ("run.name=a/b", "use letters, digits"),
    ("train.lr", "expected key=value"),
    ("eval.num=1", "eval.num = 1: must be >= 2"),
    # A class embedding of 10^12 rows was a memory error's traceback.
    ("model.num_classes=1000000000000", "model.num_classes = 1000000000000: must be 0 (unconditional), a number "
                                        "of classes up to 100,000, or auto"),
    ("eval.metrics=[fid,is]", "eval.metrics = ['fid', 'is']: must be a list of fid and/or kid, each once"),
    ("eval.metrics=[fid,fid]", "eval.metrics = ['fid', 'fid']: must be a list of fid and/or kid, each once"),
    ("eval.features=clip", "eval.features = 'clip': expected auto | inception | digits"),
    ("eval.inception_weights=/no/such.pth", "eval.inception_weights = '/no/such.pth': no such file"),
    ("eval.inception_weights=s3://b/inception.pth", "eval.inception_weights = 's3://b/inception.pth': a local copy is "
                                                    "read (a URI is not): download the file to this machine"),
    # Was found only when the run's first measurement read it, and told as data.source.
    ("eval.ref=/no/such/images", "eval.ref = '/no/such/images': no such file or folder"),
    ("eval.ref=/no/such/stats.npz", "eval.ref = '/no/such/stats.npz': no such file or folder"),
    ("eval.ref=ftp://host/images", "eval.ref = 'ftp://host/images': supported URI schemes: "),
    ("eval.sampler=euler", "expected ddim | ddpm"),
    ("train.loss_weighting=huber", "train.loss_weighting = 'huber': expected uniform | min_snr"),
    ("train.min_snr_gamma=0", "train.min_snr_gamma = 0.0: must be > 0"),
    ("train.lr_decay=linear", "train.lr_decay = 'linear': expected none | cosine | rsqrt"),
    ("train.lr_decay=rsqrt", "train.lr_decay_steps = 0: must be >= 1 with train.lr_decay = rsqrt (the step from "
                             "which the learning rate falls)"),
    ("train.lr_decay_steps=100", "train.lr_decay_steps = 100: only train.lr_decay = rsqrt reads it "
                                 "(train.lr_decay = none); leave it 0"),
])
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config("default", [override])
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_guidance_needs_a_model_that_learned_the_unconditional_prediction():
    conditional = ["data.labels=auto", "model.num_classes=auto", "train.label_dropout=0"]
    with pytest.raises(ConfigError) as info:
        load_config("default", conditional, check_source=False)  # eval.guidance 2, the default
    assert str(info.value).startswith("eval.guidance = 2.0: the unconditional prediction it needs is learned only "
                                      "from dropped labels, and train.label_dropout = 0: set train.label_dropout > 0")
    load_config("default", [*conditional, "eval.guidance=1"], check_source=False)  # conditional only: no null class
    load_config("default", ["train.label_dropout=0"], check_source=False)  # unconditional: no labels to drop


def test_images_kept_on_the_device_need_them_in_memory():
    with pytest.raises(ConfigError) as info:
        load_config("default", ["data.cache=stream", "data.on_device=true"], check_source=False)
    assert str(info.value) == ("data.on_device = True: true needs the images in memory, and data.cache is stream: "
                               "use auto or false")
    for allowed in (["data.cache=stream"], ["data.cache=memory", "data.on_device=true"]):
        load_config("default", allowed, check_source=False)


def test_a_hung_worker_needs_a_second_worker_and_local_storage():
    for refused in (["debug.hang_at_step=-1"], ["debug.hang_at_step=5", "scaling.num_workers=1"],
                    ["debug.hang_at_step=5", "run.storage=s3://bucket/runs"]):
        with pytest.raises(ConfigError) as info:
            load_config("default", refused, check_source=False)
        assert str(info.value).startswith("debug.hang_at_step = ")
    load_config("default", ["debug.hang_at_step=5"], check_source=False)


@pytest.mark.parametrize("timesteps", [2, 20])
def test_linear_schedule_refuses_too_few_timesteps(timesteps):
    """The linear schedule's largest beta is 20/T: T <= 20 would give alpha_bar <= 0 and NaN."""
    with pytest.raises(ConfigError) as info:
        load_config("smoke", [f"diffusion.timesteps={timesteps}"])
    message = str(info.value)
    assert f"diffusion.timesteps = {timesteps}: must be >= 21 with diffusion.schedule = linear" in message
    assert "\n" not in message
    assert load_config("smoke", ["diffusion.schedule=cosine", f"diffusion.timesteps={timesteps}"])


def test_smallest_linear_schedule_gives_finite_tables():
    import torch

    from raydiff.model.diffusion import build_diffusion

    diffusion = build_diffusion(load_config("smoke", ["diffusion.timesteps=21"]))
    assert diffusion.betas.max().item() < 1 and diffusion.alpha_bar.min().item() > 0
    tables = diffusion.tables_on(torch.device("cpu"))
    assert all(torch.isfinite(table).all() for table in tables.values()) and tables["alpha_bar"].min().item() > 0


def test_digits_features_need_the_digits_and_dashboards_need_their_package(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="eval.features = 'digits': digits features apply to data.source = builtin"):
        load_config("default", ["eval.features=digits", f"data.source={tmp_path}"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    needs = r"log.wandb_project = 'p': needs the wandb package: pip install 'raydiff\[wandb\]'"
    with pytest.raises(ConfigError, match=needs):
        load_config("default", ["log.wandb_project=p"])


def test_an_optional_package_older_than_raydiff_needs_is_refused(monkeypatch):
    """wandb older than 0.19.10 has no reinit="create_new" (it would fail in the middle of a run)."""
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.18.7" if name == "wandb" else real(name))
    with pytest.raises(ConfigError) as info:
        load_config("default", ["log.wandb_project=p"])
    assert str(info.value) == ("log.wandb_project = 'p': needs wandb >= 0.19.10 (installed: 0.18.7): pip install -U "
                               "'raydiff[wandb]'")


def test_pyproject_declares_the_package_floors_raydiff_checks():
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11's; CI runs 3.11

    from raydiff.config.checks import PACKAGE_FLOORS

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = [Requirement(r) for group in extras.values() for r in group if not r.startswith("raydiff")]
    for package, floor in PACKAGE_FLOORS.items():
        specifiers = [str(r.specifier) for r in declared if r.name == package]
        assert specifiers and set(specifiers) == {f">={floor}"}, (package, specifiers)


def test_every_rule_names_a_key_of_the_schema():
    from raydiff.config.checks import LATER_RULES, RULES

    keys = set(all_keys())
    assert {rule.key for rule in (*RULES, *LATER_RULES)} <= keys
    assert len(RULES) + len(LATER_RULES) >= 70  # the table holds the rules (none left behind in code)


def test_cuda_graphs_need_the_step_compiled():
    with pytest.raises(ConfigError) as info:
        load_config("default", ["train.compile=false", "train.cuda_graphs=true"])
    assert str(info.value) == ("train.cuda_graphs = True: needs train.compile = true or auto (CUDA graphs are "
                               "torch.compile's reduce-overhead mode)")


def test_torch_compiles_debugging_backends_are_taken_and_those_of_packages_not_installed_refused():
    assert load_config("default", ["train.compile=aot_eager"]).train.compile == "aot_eager"  # the docs' example
    with pytest.raises(ConfigError) as info:  # apache-tvm is not installed: its import failed at the first step
        load_config("default", ["train.compile=tvm"])
    assert str(info.value) == "train.compile = 'tvm': needs the tvm package, which is not installed here"


def test_the_builtin_digits_as_the_reference_stay_a_builtin_name():
    """It was made a local path (<cwd>/builtin:digits), which then did not exist."""
    assert load_config("default", ["eval.ref=builtin:digits"]).eval.ref == "builtin:digits"


def test_a_file_uri_as_run_storage_is_the_folder_it_names(tmp_path):
    """A sweep gathers its trials' files by path: it refused file:// as remote."""
    assert load_config("default", [f"run.storage=file://{tmp_path}"]).run.storage == str(tmp_path)


def test_widths_are_read_in_order_and_bad_ones_refused():
    assert parse_sigma_rels("0.1,0.05") == [0.1, 0.05]
    for text in ("0", "0.28", "nan", "0.05,0.05", "a"):
        with pytest.raises(ConfigError, match=f"--sigma-rel = '{text}': must be"):
            parse_sigma_rels(text)


def test_a_source_may_be_a_glob_in_an_existing_folder(tmp_path):
    load_config("default", [f"data.source={tmp_path}/train-*.parquet"])  # what matches is listed later
    with pytest.raises(ConfigError, match="no such file or folder"):
        load_config("default", [f"data.source={tmp_path}/missing/train-*.parquet"])
    load_config("default", ["data.source=hf://datasets/owner/name/train-*.parquet"])  # listed when the run starts


def test_a_seed_is_one_that_torch_can_take():
    """torch.manual_seed takes a 64-bit unsigned seed: a larger one passed --dry-run and failed in every worker."""
    assert load_config("default", [f"train.seed={2**64 - 1}"]).train.seed == 2**64 - 1
    for seed in (2**64, 99999999999999999999999, -1):
        with pytest.raises(ConfigError) as info:
            load_config("default", [f"train.seed={seed}"])
        assert str(info.value) == f"train.seed = {seed}: must be in [0, 2^64) (torch.manual_seed's range)"


@pytest.mark.parametrize("preset, overrides, line", [
    ("cifar10-aws", [], "data.source = 's3://YOUR-BUCKET/cifar10/train/': bucket names are lowercase; replace "
                        "YOUR-BUCKET with your bucket"),
    ("cifar10-aws", ["data.source=s3://mine/cifar10"], "run.storage = 's3://YOUR-BUCKET/raydiff-runs': bucket names "
                                                       "are lowercase; replace YOUR-BUCKET with your bucket"),
    ("cifar10-gcp", [], "data.source = 'gs://YOUR-BUCKET/cifar10/train/': bucket names are lowercase; replace "
                        "YOUR-BUCKET with your bucket"),
    ("default", ["eval.ref=gs://Refs/cifar10.npz"], "eval.ref = 'gs://Refs/cifar10.npz': bucket names are lowercase "
                                                    "('Refs' has capitals)"),
])
def test_a_bucket_placeholder_left_in_a_preset_is_refused_before_the_store_is_asked(preset, overrides, line):
    """It passed, and the run failed only after the store's client had retried for a while. (S3 keeps a few old
    buckets with capitals: only its placeholder is refused.)"""
    with pytest.raises(ConfigError) as info:
        load_config(preset, overrides)
    assert str(info.value) == line
    load_config(preset, overrides, check_source=False)  # as cluster_check reads the presets: they ship so
    load_config(preset, [*overrides, "data.source=s3://mine/cifar10", "run.storage=s3://mine/runs", "eval.ref=null"])
    load_config(preset, [*overrides, "data.source=s3://Legacy/cifar10", "run.storage=s3://mine/runs", "eval.ref=null"])


def test_a_run_name_too_long_for_a_folder_is_refused_as_run_name_before_anything_is_made(tmp_path):
    cfg = load_config("default", [f"run.name={'a' * 200}", f"run.storage={tmp_path}"])  # the bound itself
    assert len(cfg.run.name) == 200
    with pytest.raises(ConfigError) as info:  # was refused only when made, and blamed on run.storage
        load_config("default", [f"run.name={'b' * 201}", f"run.storage={tmp_path}"])
    assert str(info.value) == (f"run.name = '{'b' * 40}'...: 201 characters; at most 200 (it names a folder, and "
                               f"file systems take 255 bytes a name, less what raydiff adds to it)")
    assert not any(tmp_path.iterdir())
