"""The schema: the keys the interface promises, and a config that survives the plain-dict round trip it makes to
checkpoints and workers."""

from __future__ import annotations

from raydiff.config import Config, all_keys, load_config

INTERFACE_KEYS = [
    "data.source", "data.resolution", "data.channels", "model.base_channels", "model.channel_mult",
    "model.num_res_blocks", "model.attention_resolutions", "model.dropout", "diffusion.timesteps",
    "diffusion.schedule", "diffusion.prediction", "train.global_batch", "train.micro_batch", "train.lr",
    "train.warmup_steps", "train.total_steps", "train.grad_clip", "train.precision", "train.ema_decay",
    "train.ema_warmup_steps", "train.checkpoint_every", "train.sample_every", "train.log_every", "train.seed",
    "scaling.num_workers", "scaling.use_gpu", "run.name", "run.storage", "run.max_failures",
    "run.keep_checkpoints",
]


def test_interface_keys_exist():
    assert set(INTERFACE_KEYS) <= set(all_keys())


def test_round_trip_through_plain_dict():
    cfg = load_config("default", ["model.channel_mult=[1,2]", "model.attention_resolutions=[]"])
    tree = cfg.to_dict()
    assert tree["model"]["channel_mult"] == [1, 2]
    assert Config.from_dict(tree) == cfg
