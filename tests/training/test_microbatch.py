"""Finding the largest micro-batch that fits (the search), and the CPU behaviour."""

from __future__ import annotations

import pytest
import torch

from raydiff import cli
from raydiff.data.order import micro_batches, rank_share
from raydiff.training import microbatch
from raydiff.training.microbatch import (
    NothingFits,
    largest_fitting,
    largest_that_fits,
    measure_micro_batch,
    plan_memory,
    probe_share,
)


@pytest.mark.parametrize("limit, upper, expected", [(37, 128, 37), (1, 64, 1), (0, 64, 0), (500, 64, 64),
                                                    (64, 64, 64), (63, 64, 63)])
def test_largest_fitting_finds_the_limit_in_few_tries(limit, upper, expected):
    tried = []

    def fits(n):
        tried.append(n)
        return n <= limit

    assert largest_fitting(fits, upper) == expected
    assert len(tried) <= 2 * upper.bit_length() + 1 and max(tried) <= upper


def test_cpu_uses_the_whole_share_without_probing():
    model = torch.nn.Linear(2, 2)
    chosen = measure_micro_batch(model, None, torch.optim.AdamW(model.parameters()), share=48, shape=(1, 8, 8),
                                 device=torch.device("cpu"), autocast_dtype=None)
    assert chosen == 48


@pytest.mark.parametrize("global_batch, world_size", [(10, 3), (15, 2), (64, 5), (16, 2)])
def test_on_a_cpu_every_worker_trains_its_share_in_one_pass_where_shares_differ(global_batch, world_size):
    """Each worker measures up to the largest share, and the workers agree on the smallest measurement: a worker
    whose share is one image larger than another's is not left with a second pass of one image."""
    model = torch.nn.Linear(2, 2)
    measured = [measure_micro_batch(model, None, torch.optim.AdamW(model.parameters()),
                                    share=probe_share(global_batch, world_size), shape=(1, 8, 8),
                                    device=torch.device("cpu"), autocast_dtype=None) for _ in range(world_size)]
    agreed = min(measured)
    assert all(len(micro_batches(rank_share(global_batch, world_size, rank), agreed)) == 1
               for rank in range(world_size))


class _Model(torch.nn.Linear):
    activation_checkpointing = False


@pytest.mark.parametrize(("fits_plain", "fits_checkpointed", "micro_batch", "checkpointing", "expected"), [
    (48, 48, "auto", "auto", (48, False, "the whole share of 48 fits without it")),
    (10, 30, "auto", "auto", (30, True, "10 of the share of 48 fit without it, 30 with it")),
    (10, 10, "auto", "auto", (10, False, "10 images fit without it and no more with it")),
    (0, 5, "auto", "auto", (5, True, "0 of the share of 48 fit without it, 5 with it")),
    (10, 30, 8, "auto", (8, False, "train.micro_batch is fixed")),
    (10, 30, "auto", True, (30, True, "activation checkpointing on")),
    (10, 30, "auto", False, (10, False, "activation checkpointing off")),
])
def test_auto_checkpointing_is_on_where_the_share_does_not_fit_without_it(monkeypatch, fits_plain, fits_checkpointed,
                                                                           micro_batch, checkpointing, expected):
    """Measured with the setting it will train with: the measurement sees the model's checkpointing switch."""
    model = _Model(2, 2)
    monkeypatch.setattr(microbatch, "measure_micro_batch", lambda model, *a, share, **k: min(
        share, fits_checkpointed if model.activation_checkpointing else fits_plain))
    agreed = []
    chosen, on, why = plan_memory(model, None, None, fixed_micro_batch=None if micro_batch == "auto" else micro_batch,
                                  checkpointing=checkpointing, share=48, shape=(3, 256, 256),
                                  device=torch.device("cuda"), autocast_dtype=None,
                                  agree=lambda n: agreed.append(n) or n)
    assert (chosen, on) == expected[:2] and expected[2] in why and model.activation_checkpointing is on
    assert micro_batch != "auto" or agreed  # every measured number goes through the collective


@pytest.mark.parametrize("checkpointing", ["auto", True, False])
def test_a_device_where_not_one_image_fits_refuses_the_run_in_one_line_on_every_worker(monkeypatch, checkpointing):
    """Decided after the collective (every worker alike: a worker raising before it would leave the others
    waiting), and said in a line the driver prints (exit 2), not a worker's traceback that Ray retries."""
    model = _Model(2, 2)
    monkeypatch.setattr(microbatch, "measure_micro_batch", lambda *a, **k: 0)
    with pytest.raises(microbatch.NothingFits, match=r"^train.micro_batch=auto: not even one 3x256x256 image fits"):
        plan_memory(model, None, None, fixed_micro_batch=None, checkpointing=checkpointing, share=48,
                    shape=(3, 256, 256), device=torch.device("cuda"), autocast_dtype=None, agree=lambda n: n)



class _RunsOutAbove:
    """A diffusion whose forward pass runs out of memory above `limit` images, as `error` says it."""
    timesteps = 10

    def __init__(self, limit: int, error: Exception) -> None:
        self.limit, self.error = limit, error

    def loss_per_sample(self, model, x, t, noise):
        if len(x) > self.limit:
            raise self.error
        return model(x.flatten(1)).square().mean(1)


@pytest.mark.parametrize("error", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),  # cuDNN's autotuning near the limit: not torch's OOM
    RuntimeError("Unable to find a valid cuDNN algorithm to run convolution"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),  # the driver's
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")])
def test_the_probe_reads_running_out_of_memory_in_each_of_its_forms_as_not_fitting(error):
    model = torch.nn.Linear(4, 1)
    found = largest_that_fits(model, _RunsOutAbove(5, error), torch.optim.AdamW(model.parameters()), share=48,
                              shape=(1, 2, 2), device=torch.device("cpu"), autocast_dtype=None)
    assert found == 5 and model.weight.grad is None  # and the probe's gradients are gone


def test_the_probe_raises_any_error_that_is_not_running_out_of_memory():
    model = torch.nn.Linear(4, 1)
    with pytest.raises(RuntimeError, match="^shape mismatch$"):
        largest_that_fits(model, _RunsOutAbove(5, RuntimeError("shape mismatch")),
                          torch.optim.AdamW(model.parameters()), share=48, shape=(1, 2, 2),
                          device=torch.device("cpu"), autocast_dtype=None)


@pytest.mark.parametrize("where", ["reserve", "input"])
def test_running_out_of_memory_outside_the_forward_pass_is_nothing_fits_not_a_worker_traceback(monkeypatch, where):
    """The optimizer's reserve or one image's input that does not fit is 0, as one image that does not: every
    worker then reaches the collective that agrees on it (an error escaping here left the others waiting)."""
    def runs_out(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "empty_like" if where == "reserve" else "randn", runs_out)
    model = torch.nn.Linear(4, 1)
    assert largest_that_fits(model, _RunsOutAbove(5, RuntimeError("unreached")),
                             torch.optim.AdamW(model.parameters()), share=48, shape=(1, 2, 2),
                             device=torch.device("cpu"), autocast_dtype=None) == 0


def test_nothing_fits_is_one_line_and_exit_2_from_any_command(capsys):
    # raydiff.lr_find plans memory in its own process (a run's workers report it to the driver instead).
    def main(argv):
        raise NothingFits("train.micro_batch=auto: not even one 3x256x256 image fits on cuda")

    assert cli.run(main) == 2
    assert capsys.readouterr().err == ("raydiff: config error: train.micro_batch=auto: not even one 3x256x256 image "
                                       "fits on cuda\n")


@pytest.mark.parametrize(("fits", "share", "expected_probe", "chosen"), [
    (16, 16, 18, 14),  # the share just fits: split with the margin (it trained at 100% of the measured peak)
    (18, 16, 18, 16),  # the share fits with the margin to spare: one pass
    (15, 16, 18, 13),
    (1, 1, 2, 1),
])
def test_auto_keeps_the_safety_margin_where_the_whole_share_just_fits(monkeypatch, fits, share, expected_probe,
                                                                       chosen):
    from raydiff.training import microbatch

    probed = []
    monkeypatch.setattr(microbatch, "largest_that_fits",
                        lambda *a, share, **k: probed.append(share) or min(fits, share))
    model = torch.nn.Linear(2, 2)
    assert measure_micro_batch(model, None, torch.optim.AdamW(model.parameters()), share=share, shape=(1, 8, 8),
                               device=torch.device("cuda"), autocast_dtype=None) == chosen
    assert probed == [expected_probe]
