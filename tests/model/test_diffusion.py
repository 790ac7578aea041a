"""Diffusion math against closed forms."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from raydiff.model.diffusion import GaussianDiffusion, full_fp32, make_betas
from raydiff.seeds import GRID_NOISE, image_generators


def test_linear_schedule_matches_ddpm():
    betas = make_betas("linear", 1000)
    assert betas[0].item() == pytest.approx(1e-4) and betas[-1].item() == pytest.approx(0.02)
    d = GaussianDiffusion(schedule="linear", timesteps=1000, prediction="eps")
    assert torch.allclose(d.alpha_bar, torch.cumprod(1 - betas, 0))
    assert d.alpha_bar[-1].item() == pytest.approx(4.04e-5, rel=0.01)  # nearly pure noise at T


def test_cosine_schedule_matches_improved_ddpm():
    T, s = 1000, 0.008
    d = GaussianDiffusion(schedule="cosine", timesteps=T, prediction="eps")

    def f(t):
        return math.cos((t / T + s) / (1 + s) * math.pi / 2) ** 2

    for t in (0, 10, 500, 900):
        assert d.alpha_bar[t].item() == pytest.approx(f(t + 1) / f(0), rel=1e-6)
    assert make_betas("cosine", T).max().item() <= 0.999


def test_q_sample_statistics():
    d = GaussianDiffusion(schedule="linear", timesteps=1000, prediction="eps")
    g = torch.Generator().manual_seed(0)
    x0 = torch.full((20000, 1), 0.5)
    t = torch.full((20000,), 300)
    x_t = d.q_sample(x0, t, torch.randn(x0.shape, generator=g))
    ab = d.alpha_bar[300].item()
    assert x_t.mean().item() == pytest.approx(math.sqrt(ab) * 0.5, abs=0.02)
    assert x_t.var().item() == pytest.approx(1 - ab, rel=0.05)


@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
def test_targets_invert_to_x0_and_eps(prediction):
    """Feeding the exact target back as the network output recovers x0 and eps."""
    d = GaussianDiffusion(schedule="cosine", timesteps=100, prediction=prediction)
    g = torch.Generator().manual_seed(1)
    x0 = torch.rand((8, 3, 4, 4), generator=g) * 1.8 - 0.9
    eps = torch.randn(x0.shape, generator=g)
    t = torch.randint(0, 100, (8,), generator=g)
    x_t = d.q_sample(x0, t, eps)
    x0_hat, eps_hat = d.predict_x0_eps(d.target(x0, t, eps), x_t, t, clip=False)
    assert torch.allclose(x0_hat, x0, atol=1e-4)
    assert torch.allclose(eps_hat, eps, atol=1e-3)


def test_loss_is_zero_for_a_perfect_model():
    d = GaussianDiffusion(schedule="linear", timesteps=50, prediction="eps")
    noise = torch.randn(4, 1, 2, 2)
    loss = d.loss_per_sample(lambda x, t: noise, torch.zeros(4, 1, 2, 2), torch.arange(4), noise)
    assert loss.shape == (4,) and torch.all(loss == 0)


def test_ddim_with_eta_one_is_the_ddpm_posterior():
    d = GaussianDiffusion(schedule="linear", timesteps=1000, prediction="eps")
    g = torch.Generator().manual_seed(2)
    x0 = torch.rand((4, 2), generator=g) * 2 - 1
    x_t = torch.randn((4, 2), generator=g)
    noise = torch.randn((4, 2), generator=g)
    t, t_prev = torch.full((4,), 600), torch.full((4,), 550)  # a respaced pair
    ab = d.alpha_bar[600].float()
    eps = (x_t - ab.sqrt() * x0) / (1 - ab).sqrt()
    ddpm = d.ddpm_step(x0, x_t, t, t_prev, noise)
    ddim = d.ddim_step(x0, eps, t, t_prev, 1.0, noise)
    assert torch.allclose(ddpm, ddim, atol=1e-5)


def test_ddpm_step_is_the_closed_form_posterior():
    d = GaussianDiffusion(schedule="linear", timesteps=1000, prediction="eps")
    x0, x_t, t = torch.tensor([[0.3]]), torch.tensor([[-0.2]]), 400
    b, ab, ab_prev = d.betas[t].item(), d.alpha_bar[t].item(), d.alpha_bar[t - 1].item()
    mean = math.sqrt(ab_prev) * b / (1 - ab) * 0.3 + math.sqrt(1 - b) * (1 - ab_prev) / (1 - ab) * -0.2
    var = b * (1 - ab_prev) / (1 - ab)
    out = d.ddpm_step(x0, x_t, torch.tensor([t]), torch.tensor([t - 1]), torch.tensor([[1.0]]))
    assert out.item() == pytest.approx(mean + math.sqrt(var), rel=1e-5)


def test_respaced_timesteps():
    d = GaussianDiffusion(schedule="linear", timesteps=1000, prediction="eps")
    assert d.sample_timesteps(None) == list(range(999, -1, -1))
    steps = d.sample_timesteps(10)
    assert len(steps) == 10 and steps[0] == 999 and steps[-1] == 0 and steps == sorted(steps, reverse=True)
    assert d.sample_timesteps(1) == [999]  # one step starts from pure noise
    for n in (2, 3, 7, 999):
        steps = d.sample_timesteps(n)
        assert len(steps) == n and steps[0] == 999 and steps[-1] == 0 and steps == sorted(set(steps), reverse=True)


@pytest.mark.parametrize("timesteps", [1000, 250])
def test_respaced_timesteps_are_diffusers_linspace_ones_at_every_step_count(timesteps):
    """The exported scheduler (`timestep_spacing: linspace`) visits the same timesteps as raydiff at any number of
    steps: rounding i (T-1) / (n-1) exactly would differ by one where numpy's linspace lands a hair off a half
    (T=1000: at 92 step counts, 27 among them)."""
    from diffusers import DDPMScheduler

    d = GaussianDiffusion(schedule="linear", timesteps=timesteps, prediction="eps")
    scheduler = DDPMScheduler(num_train_timesteps=timesteps, timestep_spacing="linspace")
    for n in range(2, timesteps + 1):
        scheduler.set_timesteps(n)
        assert d.sample_timesteps(n) == scheduler.timesteps.tolist(), n


@pytest.mark.parametrize("sampler, eta", [("ddpm", 0.0), ("ddim", 0.0), ("ddim", 1.0)])
def test_samplers_recover_a_single_point_dataset(sampler, eta):
    """With an oracle denoiser for a one-image dataset, every sampler must end exactly on that image."""
    d = GaussianDiffusion(schedule="linear", timesteps=200, prediction="eps")
    target = torch.tensor([0.5, -0.25, 0.0, 0.75]).view(1, 1, 2, 2)

    def oracle(x_t, t):
        ab = d.alpha_bar.float()[t].view(-1, 1, 1, 1)
        return (x_t - ab.sqrt() * target) / (1 - ab).sqrt()

    out = d.sample(oracle, (3, 1, 2, 2), sampler=sampler, steps=20, eta=eta, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(out, target.expand(3, -1, -1, -1), atol=1e-5)


def test_sampling_is_deterministic_for_a_seed():
    d = GaussianDiffusion(schedule="linear", timesteps=50, prediction="eps")

    def model(x, t):
        return 0.1 * x

    a = d.sample(model, (2, 1, 3, 3), sampler="ddpm", generator=torch.Generator().manual_seed(7))
    b = d.sample(model, (2, 1, 3, 3), sampler="ddpm", generator=torch.Generator().manual_seed(7))
    c = d.sample(model, (2, 1, 3, 3), sampler="ddpm", generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


# Sampler steps against closed forms in float64 (python math on the float64 schedule): adjacent pairs, respaced
# pairs, the last steps near t = 0 (where float32 `1 - ab_t / ab_prev` cancels) and the final t = 0 -> -1.
STEP_PAIRS = [(400, 399), (1, 0), (2, 1), (600, 550), (999, 888), (120, 0), (0, -1), (7, -1)]
X0, X_T, NOISE = [0.3, 0.9, 0.05], [0.7, 0.2, 1.5], [0.5, 1.2, 0.1]  # positive: no cancellation in the sums


def _pair(d: GaussianDiffusion, t: int, t_prev: int) -> tuple[float, float, float]:
    """(alpha_bar[t], alpha_bar[t_prev], beta of the pair); alpha_bar[-1] = 1. Adjacent pairs use the schedule's
    beta directly, so the oracle does not share the sampler's `1 - ab_t / ab_prev`."""
    ab, ab_prev = d.alpha_bar[t].item(), d.alpha_bar[t_prev].item() if t_prev >= 0 else 1.0
    beta = d.betas[t].item() if t_prev == t - 1 else 1 - ab / ab_prev
    return ab, ab_prev, beta


def _tensors(t: int, t_prev: int) -> tuple[torch.Tensor, ...]:
    n = len(X0)
    return (torch.tensor(X0).view(n, 1), torch.tensor(X_T).view(n, 1), torch.full((n,), t), torch.full((n,), t_prev),
            torch.tensor(NOISE).view(n, 1))


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("t, t_prev", STEP_PAIRS)
def test_ddpm_step_matches_the_float64_posterior(schedule, t, t_prev):
    d = GaussianDiffusion(schedule=schedule, timesteps=1000, prediction="eps")
    ab, ab_prev, beta = _pair(d, t, t_prev)
    x0, x_t, tt, tp, noise = _tensors(t, t_prev)
    out = d.ddpm_step(x0, x_t, tt, tp, noise).flatten().tolist()
    for got, a, b, n in zip(out, X0, X_T, NOISE, strict=True):
        mean = math.sqrt(ab_prev) * beta / (1 - ab) * a + math.sqrt(1 - beta) * (1 - ab_prev) / (1 - ab) * b
        assert got == pytest.approx(mean + math.sqrt(beta * (1 - ab_prev) / (1 - ab)) * n, rel=1e-6)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("eta", [0.0, 0.5])
@pytest.mark.parametrize("t, t_prev", STEP_PAIRS)
def test_ddim_step_matches_the_float64_update(schedule, eta, t, t_prev):
    d = GaussianDiffusion(schedule=schedule, timesteps=1000, prediction="eps")
    ab, ab_prev, beta = _pair(d, t, t_prev)
    x0, eps, tt, tp, noise = _tensors(t, t_prev)
    out = d.ddim_step(x0, eps, tt, tp, eta, noise).flatten().tolist()
    sigma = eta * math.sqrt((1 - ab_prev) / (1 - ab) * beta)
    for got, a, e, n in zip(out, X0, X_T, NOISE, strict=True):
        expected = math.sqrt(ab_prev) * a + math.sqrt(1 - ab_prev - sigma**2) * e + sigma * n
        assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_final_step_lands_exactly_on_x0(sampler):
    d = GaussianDiffusion(schedule="linear", timesteps=1000, prediction="eps")
    x0, x_t, t, t_prev, noise = _tensors(0, -1)
    out = d.ddpm_step(x0, x_t, t, t_prev, noise) if sampler == "ddpm" else d.ddim_step(x0, x_t, t, t_prev, 0.5, noise)
    assert torch.equal(out, x0)


def test_last_ddpm_step_is_float64_accurate():
    """t = 1 -> 0 against a float64 reference: float32 `1 - ab_1 / ab_0` was off by ~1e-4 here."""
    d = GaussianDiffusion(schedule="linear", timesteps=1000, prediction="eps")
    x0, x_t, t, t_prev, noise = _tensors(1, 0)
    b, ab, ab_prev = d.betas[1], d.alpha_bar[1], d.alpha_bar[0]
    ref = ((ab_prev.sqrt() * b * x0.double() + (1 - b).sqrt() * (1 - ab_prev) * x_t.double()) / (1 - ab)
           + (b * (1 - ab_prev) / (1 - ab)).sqrt() * noise.double())
    assert (d.ddpm_step(x0, x_t, t, t_prev, noise).double() - ref).abs().max().item() < 1e-6


def test_step_coefficients_are_per_sample():
    """A batch mixing pairs gets each sample's own coefficients."""
    d = GaussianDiffusion(schedule="cosine", timesteps=1000, prediction="eps")
    x0, x_t, noise = torch.tensor([[0.3], [0.3]]), torch.tensor([[0.7], [0.7]]), torch.tensor([[0.5], [0.5]])
    both = d.ddpm_step(x0, x_t, torch.tensor([600, 1]), torch.tensor([550, 0]), noise)
    first = d.ddpm_step(x0[:1], x_t[:1], torch.tensor([600]), torch.tensor([550]), noise[:1])
    second = d.ddpm_step(x0[:1], x_t[:1], torch.tensor([1]), torch.tensor([0]), noise[:1])
    assert torch.equal(both, torch.cat([first, second]))


def test_smallest_linear_schedule_is_finite():
    with pytest.raises(ValueError, match="timesteps >= 21"):
        GaussianDiffusion(schedule="linear", timesteps=20, prediction="eps")
    d = GaussianDiffusion(schedule="linear", timesteps=21, prediction="eps")
    assert d.betas.max().item() < 1 and d.alpha_bar.min().item() > 0
    tables = d.tables_on(torch.device("cpu"))
    assert all(torch.isfinite(v).all() for v in tables.values()) and tables["alpha_bar"].min().item() > 0
    for sampler in ("ddpm", "ddim"):
        out = d.sample(lambda x, t: 0.1 * x, (2, 1, 2, 2), sampler=sampler, generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
def test_training_path_stays_on_the_timesteps_device(prediction):
    """On the meta device any `.cpu()` / `.item()` (a host sync on a GPU) raises: the tables are indexed there."""
    d = GaussianDiffusion(schedule="linear", timesteps=100, prediction=prediction)
    x0, t = torch.zeros(4, 1, 2, 2, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")
    assert d.loss_per_sample(lambda x, t: x, x0, t, torch.zeros_like(x0)).shape == (4,)
    assert d.predict_x0_eps(x0, x0, t)[1].device.type == "meta"
    assert d.tables_on(t.device)["sqrt_alpha_bar"].dtype == torch.float32


class _RandomDraws(TorchDispatchMode):
    """Records the device of every normal draw (randn, normal_) dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in (torch.ops.aten.randn, torch.ops.aten.normal_):
            self.devices.append(str(out.device))
        return out


@pytest.mark.parametrize("sampler, eta, draws_per_image", [
    ("ddim", 0.0, 1),  # only x_T: every step multiplies its noise by 0
    ("ddim", 1.0, 1 + 9),  # x_T and every step but the last (which lands on x0)
    ("ddpm", 0.0, 1 + 9),
])
def test_sampling_draws_only_the_noise_it_uses(sampler, eta, draws_per_image):
    d = GaussianDiffusion(schedule="linear", timesteps=100, prediction="eps")
    generators = image_generators(0, range(3), "cpu", GRID_NOISE)
    with _RandomDraws() as draws:
        d.sample(lambda x, t: 0.1 * x, (3, 1, 2, 2), sampler=sampler, steps=10, eta=eta, generator=generators)
    assert len(draws.devices) == 3 * draws_per_image and set(draws.devices) == {"cpu"}


def test_image_i_is_a_function_of_seed_and_i_whatever_the_batch():
    d = GaussianDiffusion(schedule="linear", timesteps=100, prediction="eps")
    model = lambda x, t: 0.1 * x  # noqa: E731
    whole = d.sample(model, (5, 1, 2, 2), sampler="ddpm", steps=10, generator=image_generators(3, range(5), "cpu", 8))
    parts = [d.sample(model, (len(r), 1, 2, 2), sampler="ddpm", steps=10, generator=image_generators(3, r, "cpu", 8))
             for r in (range(0, 2), range(2, 5))]
    assert torch.equal(whole, torch.cat(parts))
    other_tag = d.sample(model, (5, 1, 2, 2), sampler="ddpm", steps=10,
                         generator=image_generators(3, range(5), "cpu", 7))
    assert not torch.equal(whole, other_tag)


def tf32_flags() -> tuple:
    """cuDNN's fp32 convolutions' TF32 and fp32 matmuls' precision ("highest" or "high") through the old getters,
    which inductor's autotuning reads and which raise where something set torch 2.9's flags apart from them;
    torch 2.9's own flag of convolutions (where this torch has it) says the same."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if hasattr(conv, "fp32_precision"):
        assert (conv.fp32_precision == "tf32") == torch.backends.cudnn.allow_tf32
    return torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()


def test_sampling_runs_in_full_fp32():
    """cuDNN convolutions use TF32 on Ampere and newer GPUs unless told not to: sampling turns it off, then back."""
    seen = []

    def model(x, t):
        seen.append(tf32_flags())
        return 0.1 * x

    before = tf32_flags()
    d = GaussianDiffusion(schedule="linear", timesteps=50, prediction="eps")
    d.sample(model, (1, 1, 2, 2), sampler="ddim", steps=3, generator=torch.Generator().manual_seed(0))
    assert seen and set(seen) == {(False, "highest")}
    assert tf32_flags() == before


def test_training_s_tf32_and_sampling_s_fp32_leave_torch_s_precision_getters_answering():
    """Training turns TF32 on, sampling inside it off and back on; torch's getters of the matmul precision and of
    cuDNN's TF32, which inductor's autotuning reads (TORCHINDUCTOR_MAX_AUTOTUNE), answer throughout: they raise
    once torch 2.9's matmul flag, or its cuDNN convolutions' flag, was set to "ieee" directly, as raydiff did, and a
    compile would have failed there (under compile: auto, run eagerly)."""
    from raydiff.training.speed import set_tf32

    try:
        set_tf32(True)
        assert tf32_flags() == (True, "high")
        with full_fp32():
            assert tf32_flags() == (False, "highest")
        assert tf32_flags() == (True, "high")
    finally:
        set_tf32(False)
    assert tf32_flags() == (False, "highest")


@pytest.mark.skipif(not hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision"),
                    reason="torch 2.9's fp32_precision flags")
def test_sampling_is_fp32_whatever_another_library_set_and_puts_its_settings_back_as_they_were():
    """TF32 asked for a level above cuDNN's convolutions (torch.backends.fp32_precision, which their "none"
    inherits), and RNNs set apart from convolutions: sampling's convolutions are IEEE, the old getter answers inside
    it, and each flag is as it was after it."""
    from raydiff.model.diffusion import tf32_flags as read_flags

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (torch.backends.fp32_precision, cudnn.fp32_precision, cudnn.conv.fp32_precision,
             cudnn.rnn.fp32_precision, torch.get_float32_matmul_precision())
    try:
        torch.set_float32_matmul_precision("highest")
        cudnn.allow_tf32 = False  # conv and rnn "none": they inherit from above
        torch.backends.fp32_precision = "tf32"
        assert cudnn.conv.fp32_precision == "tf32"  # inherited: TF32 convolutions
        with full_fp32():
            assert (cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision, cudnn.allow_tf32) == ("ieee", "ieee", False)
        assert cudnn.conv.fp32_precision == "tf32"

        cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = "ieee", "tf32"
        torch.set_float32_matmul_precision("high")
        matmul.fp32_precision = "ieee"  # set directly: the old getter still says "high"
        before = read_flags()
        with full_fp32():
            assert cudnn.allow_tf32 is False
        assert read_flags() == before == ("highest", ("ieee", "tf32"))
        assert matmul.fp32_precision == "ieee"  # IEEE matmuls after it, as before it
    finally:
        torch.backends.fp32_precision, cudnn.fp32_precision = saved[0], saved[1]
        cudnn.allow_tf32 = saved[2] == "tf32"
        cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = saved[2], saved[3]
        torch.set_float32_matmul_precision(saved[4])


# Loss weighting: min-SNR-gamma.
@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
def test_min_snr_weights_are_the_closed_forms(prediction):
    """The weight on each target's error makes it min(SNR, gamma) times the x0 error it implies."""
    from raydiff.model.diffusion import GaussianDiffusion

    d = GaussianDiffusion(schedule="linear", timesteps=1000, prediction=prediction, loss_weighting="min_snr",
                          min_snr_gamma=5.0)
    for t in (0, 10, 100, 500, 999):
        ab = float(d.alpha_bar[t])
        snr = ab / (1 - ab)
        expected = {"eps": min(snr, 5.0) / snr, "v": min(snr, 5.0) / (snr + 1), "x0": min(snr, 5.0)}[prediction]
        assert float(d.loss_weight[t]) == pytest.approx(expected, rel=1e-12)
    # The x0-equivalent error: eps error = sqrt(SNR) x0 error, v error = sqrt(SNR + 1) x0 error.
    snr = d.alpha_bar / (1 - d.alpha_bar)
    factor = {"eps": snr, "v": snr + 1, "x0": torch.ones_like(snr)}[prediction]
    assert torch.allclose(d.loss_weight * factor, snr.clamp(max=5.0), rtol=1e-12)


@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_min_snr_weights_match_diffusers_training_examples(prediction):
    """diffusers' text-to-image example: min(SNR, gamma) / SNR for epsilon, / (SNR + 1) for v_prediction. diffusers
    computes its schedule in float32, raydiff in float64: they agree to float32's accumulated rounding."""
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr

    from raydiff.model.diffusion import GaussianDiffusion

    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear")
    timesteps = torch.arange(1000)
    snr = compute_snr(scheduler, timesteps)
    weights = torch.stack([snr, 5.0 * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
    weights = weights / snr if prediction == "eps" else weights / (snr + 1)
    d = GaussianDiffusion(schedule="linear", timesteps=1000, prediction=prediction, loss_weighting="min_snr")
    assert torch.allclose(d.loss_weight.float(), weights.float(), rtol=5e-4)


@pytest.mark.parametrize("prediction,expected", [("eps", [1.0, 1.0, 0.0]), ("v", [0.0, 0.5, 0.0]),
                                                 ("x0", [0.0, 1.0, 5.0])])
def test_min_snr_weights_are_finite_where_the_snr_is_zero_or_infinite(prediction, expected):
    from raydiff.model.diffusion import min_snr_weights

    alpha_bar = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)  # SNR 0, 1 and infinite
    weights = min_snr_weights(alpha_bar, prediction, 5.0)
    assert torch.isfinite(weights).all() and weights.tolist() == expected


def test_min_snr_weighs_each_sample_of_the_training_loss():
    """Through the config, as training builds it: the weighted losses are the uniform ones times each sample's
    weight at its timestep."""
    from raydiff.config import load_config
    from raydiff.model.diffusion import build_diffusion

    uniform = build_diffusion(load_config("smoke", check_source=False))
    weighted = build_diffusion(load_config("smoke", ["train.loss_weighting=min_snr", "train.min_snr_gamma=2"],
                                           check_source=False))
    generator = torch.Generator().manual_seed(0)
    x0 = torch.rand(6, 1, 8, 8, generator=generator) * 2 - 1
    noise = torch.randn(6, 1, 8, 8, generator=generator)
    t = torch.tensor([0, 3, 50, 400, 800, 999])

    def model(x, _):
        return 0.5 * x

    plain = uniform.loss_per_sample(model, x0, t, noise)
    assert torch.allclose(weighted.loss_per_sample(model, x0, t, noise), plain * weighted.loss_weight[t].float())
    # eps: min(SNR, 2) / SNR, small at t = 0 (SNR about 1e4) and 1 where SNR < 2
    assert weighted.loss_weight[0] < 1e-3 and weighted.loss_weight[999] == 1.0


@pytest.mark.parametrize("eta", [1.5, -0.1, math.nan])
def test_ddim_refuses_an_eta_outside_0_to_1(eta):
    """Above 1 a step's noise could exceed what the next image may hold, and its eps coefficient was clamped to 0:
    images of the wrong spread, without a word."""
    d = GaussianDiffusion(schedule="linear", timesteps=100, prediction="eps")
    message = rf"eta {eta:g}: must be in \[0, 1\] \(0: deterministic DDIM, 1: DDPM's posterior\)"
    with pytest.raises(ValueError, match=message):
        d.sample(lambda x, t: 0.1 * x, (2, 1, 2, 2), sampler="ddim", steps=5, eta=eta,
                 generator=torch.Generator().manual_seed(0))
    x, t = torch.zeros(2, 1, 2, 2), torch.tensor([50, 50])
    with pytest.raises(ValueError, match=message):
        d.ddim_step(x, x, t, t - 10, eta, x)
