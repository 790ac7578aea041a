"""The fast samplers, DPM-Solver++ (2M, and its SDE variant) and Heun, against diffusers' schedulers in float32, for
every prediction target; guided and per image."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydiff.config import load_config
from raydiff.model.diffusion import GaussianDiffusion, build_diffusion
from raydiff.model.samplers import euler_first, heun_sigmas
from raydiff.model.unet import build_model
from raydiff.seeds import GRID_NOISE, image_generators

DIFFUSERS_PREDICTION = {"eps": "epsilon", "v": "v_prediction", "x0": "sample"}
SHAPE = (3, 1, 8, 8)


def _model(prediction: str, *extra: str):
    cfg = load_config("smoke", [f"diffusion.prediction={prediction}", *extra], check_source=False)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    for p in model.parameters():  # a network with a real output, not the reference init's near zero
        torch.nn.init.normal_(p, std=0.05)
    return model, build_diffusion(cfg), cfg


def _noise() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))


def _diffusers_loop(scheduler, model, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    with torch.no_grad():
        for t in scheduler.timesteps:
            model_input = scheduler.scale_model_input(x, t)
            noise = {"generator": generator} if generator is not None else {}  # the SDE solver's fresh noise
            x = scheduler.step(model(model_input, t.float().expand(len(x))), t, x, **noise).prev_sample
    return x


@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
@pytest.mark.parametrize("steps", [5, 20])
def test_dpm_solver_pp_2m_is_diffusers_multistep_dpm_solver(prediction, steps):
    from diffusers import DPMSolverMultistepScheduler

    model, diffusion, cfg = _model(prediction)
    scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear",
        prediction_type=DIFFUSERS_PREDICTION[prediction], algorithm_type="dpmsolver++", solver_order=2,
        final_sigmas_type="zero", timestep_spacing="linspace", lower_order_final=True)
    scheduler.set_timesteps(steps)
    theirs = _diffusers_loop(scheduler, model, _noise())
    ours = diffusion.sample(model, SHAPE, sampler="dpmpp_2m", steps=steps, clip=False,
                            generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
@pytest.mark.parametrize("steps", [5, 20])
def test_dpm_solver_pp_2m_sde_is_diffusers_sde_dpm_solver_with_the_same_noise(prediction, steps):
    """Fresh noise at every step but the last, drawn in order from the image's generator after its initial noise
    (diffusers draws one more at the last step and multiplies it by zero)."""
    from diffusers import DPMSolverMultistepScheduler

    model, diffusion, cfg = _model(prediction)
    scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear",
        prediction_type=DIFFUSERS_PREDICTION[prediction], algorithm_type="sde-dpmsolver++", solver_order=2,
        solver_type="midpoint", final_sigmas_type="zero", timestep_spacing="linspace", lower_order_final=True)
    scheduler.set_timesteps(steps)
    generator = torch.Generator().manual_seed(3)
    theirs = _diffusers_loop(scheduler, model, torch.randn(SHAPE, generator=generator), generator)
    ours = diffusion.sample(model, SHAPE, sampler="dpmpp_2m_sde", steps=steps, clip=False,
                            generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    deterministic = diffusion.sample(model, SHAPE, sampler="dpmpp_2m", steps=steps, clip=False,
                                     generator=torch.Generator().manual_seed(3))
    assert (ours - deterministic).abs().max() > 1e-2  # the fresh noise shows


@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
def test_heun_is_diffusers_heun_discrete(prediction):
    from diffusers import HeunDiscreteScheduler

    model, diffusion, cfg = _model(prediction)
    scheduler = HeunDiscreteScheduler(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02,
                                      beta_schedule="linear", prediction_type=DIFFUSERS_PREDICTION[prediction],
                                      timestep_spacing="linspace")
    scheduler.set_timesteps(6)
    theirs = _diffusers_loop(scheduler, model, _noise() * scheduler.init_noise_sigma)
    ours = diffusion.sample(model, SHAPE, sampler="heun", steps=6, clip=False,
                            generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("sampler", ["dpmpp_2m", "dpmpp_2m_sde", "heun"])
def test_fast_samplers_draw_each_image_from_its_own_generator_and_guide(sampler):
    """Image i is the same in a batch of 3 and alone; a class-conditional model samples guided (both branches in
    one pass) and its guidance moves the images."""
    model, diffusion, _ = _model("eps", "data.labels=auto", "model.num_classes=10")
    labels = torch.tensor([1, 2, 3])

    def images(indices, guidance, clip=True):
        return diffusion.sample(model, (len(indices), 1, 8, 8), sampler=sampler, steps=4, clip=clip,
                                generator=image_generators(0, indices, "cpu", GRID_NOISE),
                                labels=labels[list(indices)], guidance=guidance)

    together = images(range(3), 2.0)
    torch.testing.assert_close(images(range(2, 3), 2.0), together[2:], atol=1e-5, rtol=0)
    assert together.abs().max() <= 1.0 + 1e-6  # x0 clipped to [-1, 1] by default, so the images are too
    # This random network's images saturate once clipped: the guidance shows in the unclipped ones.
    assert (images(range(3), 1.0, clip=False) - images(range(3), 2.0, clip=False)).abs().max() > 1e-3


@pytest.mark.parametrize("sampler", ["dpmpp_2m", "dpmpp_2m_sde", "ddim"])
def test_more_steps_than_the_schedule_has_are_capped_not_a_step_of_zero_length(sampler):
    # T = 30: DPM-Solver++ takes at most T - 1 steps (T would repeat a timestep, and its images were NaN); DDIM T.
    model, diffusion, _ = _model("eps", "diffusion.timesteps=30")
    most = 29 if sampler.startswith("dpmpp") else 30

    def sample(steps: int) -> torch.Tensor:
        with torch.no_grad():
            return diffusion.sample(model, SHAPE, sampler=sampler, steps=steps,
                                    generator=image_generators(0, range(3), "cpu", GRID_NOISE))

    capped = sample(1000)
    assert torch.isfinite(capped).all()
    assert torch.equal(capped, sample(most))


@pytest.mark.parametrize(("sampler", "default"), [("ddim", 50), ("ddpm", 100), ("dpmpp_2m", 20)])
def test_a_sample_without_steps_takes_the_sampler_s_default(sampler, default):
    """DDIM without `steps` ran every timestep of the schedule (20 times its default of 50 at T = 1000): the
    commands always gave steps; an API caller did not."""
    model, diffusion, _ = _model("eps", "diffusion.timesteps=100")
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(1))
    with torch.no_grad():
        diffusion.sample(model, SHAPE, sampler=sampler, generator=image_generators(0, range(3), "cpu", GRID_NOISE))
    assert len(calls) == default


MU, S = 0.3, 0.5  # the Gaussian data N(MU, S^2) of `gaussian_model`


def gaussian_model(diffusion: GaussianDiffusion, seen: list[float] | None = None):
    """The exact eps predictor of N(MU, S^2) data: the posterior mean of x0, at the noise level of any (fractional)
    timestep, sigma interpolated between the schedule's as Heun does. `seen`: the timesteps it was asked at."""
    T = diffusion.timesteps
    sigmas = ((1 - diffusion.alpha_bar) / diffusion.alpha_bar).sqrt().numpy()

    def model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if seen is not None:
            seen.append(float(t[0]))
        sigma = torch.from_numpy(np.interp(t.double().numpy(), np.arange(T), sigmas)).view(-1, 1, 1, 1)
        alpha = 1 / (sigma**2 + 1).sqrt()  # x = alpha x0 + vp_sigma eps
        vp_sigma, x = sigma * alpha, x.double()
        x0 = MU + alpha * S**2 / (alpha**2 * S**2 + vp_sigma**2) * (x - alpha * MU)
        return ((x - alpha * x0) / vp_sigma).float()

    return model


def _heun_images(schedule: str, steps: int, seen: list[float] | None = None) -> torch.Tensor:
    diffusion = GaussianDiffusion(schedule=schedule, timesteps=1000, prediction="eps")
    return diffusion.sample(gaussian_model(diffusion, seen), (512, 1, 4, 4), sampler="heun", steps=steps,
                            clip=False, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("steps", [10, 18])
def test_heun_on_the_cosine_schedule_gives_the_spread_of_the_data(steps):
    """The cosine schedule's first step falls from sigma 20,291 to 11 at 18 steps: Heun's trapezoid there
    multiplied the denoiser's error by the ratio, and even an exact one gave three times the data's spread."""
    images = _heun_images("cosine", steps)
    assert images.std().item() == pytest.approx(S, rel=0.05)
    assert images.mean().item() == pytest.approx(MU, abs=0.02)


def test_heun_takes_a_first_step_that_lowers_sigma_tenfold_by_euler():
    # Linear, 2 steps: from sigma 157 to 0.01 in one step (the trapezoid gave images of spread 79), then to 0.
    assert euler_first(heun_sigmas(GaussianDiffusion(schedule="linear", timesteps=1000, prediction="eps").alpha_bar,
                                   2)[1])
    images = _heun_images("linear", 2)
    assert images.mean().item() == pytest.approx(MU, abs=0.02) and images.std().item() < S


def test_heun_starts_from_pure_noise_with_one_step():
    """One step is Euler's from the largest sigma to 0: the denoiser's x0 from pure noise (it started at sigma(0),
    0.01, and gave back the noise's grey)."""
    seen: list[float] = []
    images = _heun_images("linear", 1, seen)
    assert seen == [999.0]
    assert images.mean().item() == pytest.approx(MU, abs=0.01)  # the posterior mean from pure noise: nearly MU
