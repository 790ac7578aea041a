"""Diffusion math: noise schedules, the forward process, training targets and loss, and samplers.

Notation follows Ho et al. (2020): `alpha_bar[t]` is the cumulative product of `1 - beta`,
`x_t = sqrt(alpha_bar) x0 + sqrt(1 - alpha_bar) eps`. The network predicts one of
eps, v = sqrt(alpha_bar) eps - sqrt(1 - alpha_bar) x0 (Salimans & Ho, 2022) or x0.
Samplers walk a (possibly respaced) decreasing sequence of timesteps; DDPM's ancestral step is the
posterior q(x_prev | x_t, x0), DDIM's is the deterministic (eta=0) or stochastic (eta>0) update.

Precision: every per-timestep table is computed once in float64; the training path indexes float32 copies
that live on the tensors' device (no host sync). The coefficients of a sampler step t -> t_prev (not
necessarily adjacent) are computed in float64 from alpha_bar and only then cast to float32, because
`1 - alpha_bar[t] / alpha_bar[t_prev]` cancels badly in float32 near t = 0.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import numpy as np
import torch

from raydiff.config.schema import Sampler
from raydiff.model.samplers import dpmpp_2m, heun, x0_from_output
from raydiff.seeds import image_generators

Schedule = Literal["linear", "cosine"]
Prediction = Literal["eps", "v", "x0"]
LossWeighting = Literal["uniform", "min_snr"]
DEFAULT_STEPS: dict[str, int | None] = {"ddpm": None, "ddim": 50, "dpmpp_2m": 20, "dpmpp_2m_sde": 20,
                                        "heun": 18}  # None: all T
Denoiser = Callable[..., torch.Tensor]  # model(x_t, t) or, class-conditional, model(x_t, t, labels)

# The linear schedule's largest beta is 0.02 * 1000 / T = 20 / T: T <= 20 gives a beta >= 1 and alpha_bar <= 0.
LINEAR_MIN_TIMESTEPS = 21


def steps_taken(sampler: str, steps: int | None, timesteps: int) -> int:
    """The steps `sampler` takes when asked for `steps` (None: its default) on a schedule of `timesteps`. More
    are capped: DDPM and DDIM visit each timestep at most once, and DPM-Solver++ steps between distinct timesteps
    (one more step would repeat a timestep: a step of zero length, whose update divides by zero). Heun
    interpolates between timesteps: no cap."""
    asked = steps or DEFAULT_STEPS[sampler] or timesteps
    most = {"ddpm": timesteps, "ddim": timesteps, "dpmpp_2m": timesteps - 1, "dpmpp_2m_sde": timesteps - 1}.get(sampler)
    return asked if most is None else min(asked, most)


def check_eta(eta: float) -> None:
    """ValueError unless DDIM's `eta` is in [0, 1]. Why: above 1 a step's noise, eta^2 times the posterior's
    variance, can exceed the 1 - alpha_bar_prev the next image may hold, and the step's eps coefficient, the square
    root of the difference, would be clamped to 0: images of the wrong spread, silently."""
    if not 0 <= eta <= 1:
        raise ValueError(f"eta {eta:g}: must be in [0, 1] (0: deterministic DDIM, 1: DDPM's posterior)")


def make_betas(schedule: Schedule, timesteps: int) -> torch.Tensor:
    """Betas in float64. Linear: Ho et al.'s 1e-4..0.02 at T=1000, rescaled by 1000/T for other T
    (as in improved-diffusion). Cosine: Nichol & Dhariwal's alpha_bar, betas clipped at 0.999."""
    if schedule == "linear":
        if timesteps < LINEAR_MIN_TIMESTEPS:
            raise ValueError(f"the linear schedule needs timesteps >= {LINEAR_MIN_TIMESTEPS} "
                             f"(its largest beta, 20/T, must be < 1), got {timesteps}")
        scale = 1000.0 / timesteps
        return torch.linspace(scale * 1e-4, scale * 0.02, timesteps, dtype=torch.float64)
    if schedule == "cosine":
        s = 0.008
        steps = torch.arange(timesteps + 1, dtype=torch.float64) / timesteps
        alpha_bar = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
        return (1 - alpha_bar[1:] / alpha_bar[:-1]).clamp(max=0.999)
    raise ValueError(f"unknown schedule {schedule!r}")


def min_snr_weights(alpha_bar: torch.Tensor, prediction: Prediction, gamma: float) -> torch.Tensor:
    """Min-SNR-gamma loss weights (Hang et al. 2023), in alpha_bar's dtype: the weight on each target's squared
    error that makes it min(SNR, gamma) times the x0 error it implies, SNR = alpha_bar / (1 - alpha_bar). Since
    the eps error is sqrt(SNR) times the x0 error and the v error sqrt(SNR + 1) times, the weight is
    min(SNR, gamma) / SNR for eps, min(SNR, gamma) / (SNR + 1) for v, and min(SNR, gamma) for x0. Written so that
    it stays finite where SNR is 0 (alpha_bar 0) or infinite (alpha_bar 1): gamma / SNR clamped at 1 for eps."""
    snr = alpha_bar / (1 - alpha_bar)  # inf at alpha_bar 1, 0 at alpha_bar 0
    clipped = snr.clamp(max=gamma)
    if prediction == "eps":
        return (gamma / snr).clamp(max=1.0)  # = min(SNR, gamma) / SNR, 1 at SNR 0, 0 at SNR inf
    if prediction == "v":
        return clipped / (snr + 1)
    return clipped


PIXELS_PER_PASS = 64 * 64 * 64  # sampling without a batch size: as many images per forward pass as make this


def images_per_pass(resolution: int, most: int = 64) -> int:
    """How many images one sampling forward pass generates when the user names no batch size: a fixed number of
    pixels, so that a 256x256 model on a small GPU does not hold many images' activations at once (64 at up to
    64x64, 4 at 256x256, at least 1)."""
    return max(1, min(most, PIXELS_PER_PASS // (resolution * resolution)))


class GaussianDiffusion:
    """Holds a schedule's constants and does all the arithmetic that depends on it.

    :param schedule: "linear" or "cosine".
    :param timesteps: number of diffusion steps T.
    :param prediction: what the network predicts: "eps", "v" or "x0".
    :param loss_weighting: "uniform" (the plain squared error, as DDPM) or "min_snr" (`min_snr_weights`).
    :param min_snr_gamma: min-SNR's gamma.
    """

    def __init__(self, *, schedule: Schedule, timesteps: int, prediction: Prediction,
                 loss_weighting: LossWeighting = "uniform", min_snr_gamma: float = 5.0) -> None:
        self.timesteps = timesteps
        self.prediction = prediction
        self.loss_weighting = loss_weighting
        # Float64 tables, indexed by t in [0, T).
        self.betas = make_betas(schedule, timesteps)
        self.alpha_bar = torch.cumprod(1 - self.betas, dim=0)
        self.alpha_bar_prev = torch.cat([torch.ones(1, dtype=torch.float64), self.alpha_bar[:-1]])
        self.sqrt_alpha_bar = self.alpha_bar.sqrt()
        self.sqrt_one_minus_alpha_bar = (1 - self.alpha_bar).sqrt()
        self.posterior_coef_x0 = self.betas * self.alpha_bar_prev.sqrt() / (1 - self.alpha_bar)
        self.posterior_coef_xt = (1 - self.alpha_bar_prev) * (1 - self.betas).sqrt() / (1 - self.alpha_bar)
        self.posterior_variance = self.betas * (1 - self.alpha_bar_prev) / (1 - self.alpha_bar)
        self.loss_weight = (min_snr_weights(self.alpha_bar, prediction, min_snr_gamma) if loss_weighting == "min_snr"
                            else torch.ones_like(self.alpha_bar))
        self._device_tables: dict[torch.device, dict[str, torch.Tensor]] = {}

    def tables_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Float32 copies of the tables on `device`, made on first use."""
        if device.type == "cuda" and device.index is None:  # one entry per GPU, however it is named
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._device_tables:
            names = ("betas", "alpha_bar", "alpha_bar_prev", "sqrt_alpha_bar", "sqrt_one_minus_alpha_bar",
                     "posterior_coef_x0", "posterior_coef_xt", "posterior_variance", "loss_weight")
            # Cast on the CPU first: some devices (MPS) have no float64.
            self._device_tables[device] = {n: getattr(self, n).float().to(device) for n in names}
        return self._device_tables[device]

    def _at(self, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Table `name` at timesteps t, indexed on t's device, shaped to broadcast over `like`."""
        return self.tables_on(t.device)[name][t].view(-1, *([1] * (like.dim() - 1)))

    # Forward process and training.
    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return self._at("sqrt_alpha_bar", t, x0) * x0 + self._at("sqrt_one_minus_alpha_bar", t, x0) * noise

    def target(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The regression target for the configured prediction type."""
        if self.prediction == "eps":
            return noise
        if self.prediction == "x0":
            return x0
        return self._at("sqrt_alpha_bar", t, x0) * noise - self._at("sqrt_one_minus_alpha_bar", t, x0) * x0

    def loss_per_sample(
        self, model: Denoiser, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean squared error between the network output and the target, one value per sample, weighted by the
        loss weighting (min-SNR: `min_snr_weights`); `labels`: the class ids a class-conditional model sees (the
        null class where dropped)."""
        x_t = self.q_sample(x0, t, noise)
        out = model(x_t, t) if labels is None else model(x_t, t, labels)
        losses = (out.float() - self.target(x0, t, noise)).square().mean(dim=tuple(range(1, x0.dim())))
        return losses if self.loss_weighting == "uniform" else losses * self._at("loss_weight", t, losses)

    # Converting a network output to the quantities samplers need.
    def predict_x0_eps(
        self, out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, clip: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x0, eps) implied by the network output. With `clip`, x0 is clamped to [-1, 1] and eps
        recomputed from it so that the two stay consistent with x_t."""
        a, s = self._at("sqrt_alpha_bar", t, x_t), self._at("sqrt_one_minus_alpha_bar", t, x_t)
        if self.prediction == "eps":
            x0 = (x_t - s * out) / a
        elif self.prediction == "x0":
            x0 = out
        else:
            x0 = a * x_t - s * out
        if clip:
            x0 = x0.clamp(-1, 1)
        return x0, (x_t - a * x0) / s

    # Sampling.
    def sample_timesteps(self, steps: int | None) -> list[int]:
        """Decreasing timesteps to visit: all T, or `steps` evenly spaced ones from T-1 down to 0 (respacing), rounded
        as diffusers' "linspace" spacing rounds them (numpy's linspace, whose last bits decide some halves)."""
        if steps is None or steps >= self.timesteps:
            return list(range(self.timesteps - 1, -1, -1))
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if steps == 1:
            return [self.timesteps - 1]  # a single step still has to start from pure noise
        return [int(t) for t in np.linspace(0, self.timesteps - 1, steps).round()[::-1]]

    def _step_coefs(self, t: torch.Tensor, t_prev: torch.Tensor, eta: float) -> dict[str, torch.Tensor]:
        """Float64 coefficients of the steps t -> t_prev (CPU long tensors; t_prev = -1 means alpha_bar = 1)."""
        ab = torch.cat([self.alpha_bar, torch.ones(1, dtype=torch.float64)])  # so that index -1 gives 1
        ab_t, ab_prev = ab[t], ab[t_prev]
        beta = 1 - ab_t / ab_prev  # the beta of the (respaced) pair, exact in float64
        var = beta * (1 - ab_prev) / (1 - ab_t)
        sigma = eta * var.sqrt()
        return {
            "coef_x0": beta * ab_prev.sqrt() / (1 - ab_t),
            "coef_xt": (1 - ab_prev) * (1 - beta).sqrt() / (1 - ab_t),
            "std": var.sqrt(),
            "sqrt_ab_prev": ab_prev.sqrt(),
            "coef_eps": (1 - ab_prev - sigma**2).clamp(min=0).sqrt(),
            "sigma": sigma,
        }

    @staticmethod
    def _on(coefs: dict[str, torch.Tensor], like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Float32 copies on `like`'s device, shaped to broadcast over it (one value per sample)."""
        shape = (-1, *([1] * (like.dim() - 1)))
        return {k: v.float().to(like.device).view(shape) for k, v in coefs.items()}

    @staticmethod
    def _ddpm(c: dict[str, torch.Tensor], x0: torch.Tensor, x_t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return c["coef_x0"] * x0 + c["coef_xt"] * x_t + c["std"] * noise

    @staticmethod
    def _ddim(c: dict[str, torch.Tensor], x0: torch.Tensor, eps: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return c["sqrt_ab_prev"] * x0 + c["coef_eps"] * eps + c["sigma"] * noise

    def ddpm_step(
        self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, t_prev: torch.Tensor, noise: torch.Tensor
    ) -> torch.Tensor:
        """Ancestral step: a draw from the posterior q(x_prev | x_t, x0) of the (respaced) chain."""
        return self._ddpm(self._on(self._step_coefs(t.cpu(), t_prev.cpu(), 0.0), x_t), x0, x_t, noise)

    def ddim_step(
        self, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, t_prev: torch.Tensor, eta: float,
        noise: torch.Tensor,
    ) -> torch.Tensor:
        """DDIM update (Song et al. 2021, eq. 12). eta=0 is deterministic; eta=1 equals the DDPM posterior."""
        check_eta(eta)
        return self._ddim(self._on(self._step_coefs(t.cpu(), t_prev.cpu(), eta), x0), x0, eps, noise)

    def sample_in_chunks(self, model: Denoiser, indices: range, shape: tuple[int, ...], *, batch: int, seed: int,
                         tag: int, device: torch.device | str, sampler: Sampler = "ddim",
                         steps: int | None = None, eta: float = 0.0, labels: Sequence[int] | None = None,
                         guidance: float = 1.0) -> Iterator[torch.Tensor]:
        """Images `indices` of one image `shape`, generated at most `batch` per forward pass (what fits the device).
        Image i draws its noise from its own generator, seeded by (seed, i, tag): the images do not depend on
        `batch`. `labels`: the class of each image of `indices`, in order (class-conditional models; see
        `sample` for `guidance`)."""
        if labels is not None and len(labels) != len(indices):
            raise ValueError(f"{len(labels)} labels for {len(indices)} images")
        for start in range(indices.start, indices.stop, batch):
            part = range(start, min(start + batch, indices.stop))
            part_labels = None
            if labels is not None:
                offset = start - indices.start
                part_labels = torch.as_tensor(list(labels[offset:offset + len(part)]), dtype=torch.long, device=device)
            yield self.sample(model, (len(part), *shape), sampler=sampler, steps=steps, eta=eta,
                              generator=image_generators(seed, part, device, tag), device=device,
                              labels=part_labels, guidance=guidance)

    @torch.no_grad()
    def sample(
        self,
        model: Denoiser,
        shape: tuple[int, ...],
        *,
        sampler: Sampler = "ddim",
        steps: int | None = None,
        eta: float = 0.0,
        generator: torch.Generator | list[torch.Generator],
        device: torch.device | str = "cpu",
        labels: torch.Tensor | None = None,
        guidance: float = 1.0,
        clip: bool = True,
    ) -> torch.Tensor:
        """Generate images in [-1, 1], in full fp32 (no TF32). Noise is drawn where `generator` lives: give
        generators on `device` (`raydiff.seeds.image_generators`), so that nothing crosses from the host at
        each step. A list holds one generator per image (as EDM does): each image is then a pure function of its
        own generator, whatever the batch. Draws that a step multiplies by zero (every step of DDIM with eta 0,
        the last step of every sampler) are skipped.

        Class-conditional models: `labels` (one class id per image, on `device`) and classifier-free `guidance` w
        in diffusers' convention, out = out_uncond + w (out_cond - out_uncond): w = 1 is conditional sampling
        without guidance, w = 0 unconditional (so are labels None). Both branches run in one batched forward.

        `sampler`: "ddpm" (ancestral), "ddim" (`eta`), or the fast "dpmpp_2m" and "heun" (deterministic) and
        "dpmpp_2m_sde" (`raydiff.model.samplers`; `steps` of them, at most 2 `steps` - 1 network evaluations for
        Heun).
        `clip` clamps each predicted x0 to [-1, 1] (as DDPM's reference does; diffusers' DPM-Solver++ and Heun do
        not by default). More `steps` than a sampler can take are capped (`steps_taken`). ValueError for an `eta`
        outside [0, 1] (`check_eta`)."""
        check_eta(eta)
        if sampler in ("dpmpp_2m", "dpmpp_2m_sde", "heun"):
            return self._sample_with_solver(model, shape, sampler, steps_taken(sampler, steps, self.timesteps),
                                            generator, device, labels, guidance, clip)
        timesteps = self.sample_timesteps(steps_taken(sampler, steps, self.timesteps))
        # All steps' coefficients at once, in float64, then moved to the device: no host sync in the loop.
        pairs = torch.tensor(timesteps), torch.tensor(timesteps[1:] + [-1])  # the last step lands on x0
        coefs64 = self._step_coefs(*pairs, eta)
        noisy = (coefs64["std" if sampler == "ddpm" else "sigma"] > 0).tolist()  # on the host, before the loop
        with full_fp32():
            x = _randn(shape, generator).to(device)
            coefs, no_noise = self._on(coefs64, x), torch.zeros_like(x)
            for i, step in enumerate(timesteps):
                t = torch.full((shape[0],), step, dtype=torch.long, device=x.device)
                x0, eps = self.predict_x0_eps(guided(model, x, t, labels, guidance).float(), x, t, clip=clip)
                noise = _randn(shape, generator).to(device) if noisy[i] else no_noise
                c = {k: v[i] for k, v in coefs.items()}
                x = self._ddpm(c, x0, x, noise) if sampler == "ddpm" else self._ddim(c, x0, eps, noise)
        return x


    def _sample_with_solver(self, model: Denoiser, shape: tuple[int, ...], sampler: str, steps: int,
                            generator: torch.Generator | list[torch.Generator], device: torch.device | str,
                            labels: torch.Tensor | None, guidance: float, clip: bool) -> torch.Tensor:
        """DPM-Solver++ (2M, ODE or SDE) or Heun from the same initial noise as the other samplers, in full fp32."""
        with full_fp32():
            x = _randn(shape, generator).to(device)

            def denoise(x: torch.Tensor, t: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
                x0 = x0_from_output(self.prediction, guided(model, x, t, labels, guidance).float(), x, alpha, sigma)
                return x0.clamp(-1, 1) if clip else x0

            if sampler == "heun":
                return heun(denoise, x, self.alpha_bar, steps)
            draw_noise = (lambda: _randn(shape, generator).to(device)) if sampler == "dpmpp_2m_sde" else None
            return dpmpp_2m(denoise, x, self.alpha_bar, steps, draw_noise)


def guided(model: Denoiser, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None,
           guidance: float) -> torch.Tensor:
    """The network output with classifier-free guidance (see `GaussianDiffusion.sample`). The output is linear
    in eps for every prediction type, so guiding it guides eps."""
    if labels is None or guidance == 0:
        return model(x, t)  # a conditional model reads no labels as the null class
    if guidance == 1:
        return model(x, t, labels)
    null = torch.full_like(labels, model_classes(model))
    out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([labels, null]))
    out_cond, out_uncond = out.chunk(2)
    return out_uncond + guidance * (out_cond - out_uncond)


def model_classes(model: Denoiser) -> int:
    """The number of classes of a class-conditional model (its null class's id); 0 for an unconditional one."""
    return int(getattr(model, "num_classes", 0) or 0)


def _randn(shape: tuple[int, ...], generator: torch.Generator | list[torch.Generator]) -> torch.Tensor:
    """Standard normal noise of `shape` drawn on the generator's device."""
    if isinstance(generator, torch.Generator):
        return torch.randn(shape, generator=generator, device=generator.device)
    if len(generator) != shape[0]:
        raise ValueError(f"{len(generator)} generators for a batch of {shape[0]} images")
    return torch.stack([torch.randn(shape[1:], generator=g, device=g.device) for g in generator])


def matmul_precision() -> str:
    """fp32 matmuls' precision as `torch.set_float32_matmul_precision` takes it ("highest": IEEE, "high": TF32):
    torch 2.9's flag where it is set (something may have set it directly, and the old getter then answers what it
    was before, or raises), else the old getter."""
    flag = getattr(getattr(torch.backends.cuda, "matmul", None), "fp32_precision", "none")
    if flag in ("ieee", "tf32", "bf16"):
        return {"ieee": "highest", "tf32": "high", "bf16": "medium"}[flag]
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return "highest"


CudnnFlags = tuple[str, str] | bool  # (convolutions', RNNs' fp32_precision) on torch >= 2.9; allow_tf32 before


def _by_precision() -> bool:
    """Whether this torch has cuDNN's `fp32_precision` flags (torch 2.9 on) beside the floor's `allow_tf32`."""
    return hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision")


def cudnn_tf32_flags(on: bool) -> CudnnFlags:
    """cuDNN's flags for TF32 on or off, in the form `tf32_flags` reads."""
    if not _by_precision():
        return on
    return ("tf32", "tf32") if on else ("ieee", "ieee")


def tf32_flags() -> tuple[str, CudnnFlags]:
    """fp32 matmuls' and cuDNN's precision settings as they are now (for `restore_tf32_flags`)."""
    cudnn = torch.backends.cudnn
    flags = (cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision) if _by_precision() else cudnn.allow_tf32  # type: ignore[attr-defined]
    return matmul_precision(), flags


def restore_tf32_flags(saved: tuple[str, CudnnFlags]) -> None:
    """Put back what `tf32_flags` read, through the old setters first: the old getters, which inductor's autotuning
    reads (TORCHINDUCTOR_MAX_AUTOTUNE), raise where torch 2.9's flags were set without them."""
    matmul, flags = saved
    cudnn = torch.backends.cudnn
    if isinstance(flags, tuple):
        cudnn.allow_tf32 = flags[0] == "tf32"
        cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = flags  # type: ignore[attr-defined]
    else:
        cudnn.allow_tf32 = flags
    torch.set_float32_matmul_precision(matmul)


@contextlib.contextmanager
def full_fp32() -> Iterator[None]:
    """Convolutions and matmuls in IEEE fp32 while the block runs. On Ampere and newer GPUs cuDNN convolutions
    use TF32 (10-bit mantissas) unless told not to; sampling and evaluation promise fp32."""
    saved = tf32_flags()
    restore_tf32_flags(("highest", cudnn_tf32_flags(False)))
    try:
        yield
    finally:
        restore_tf32_flags(saved)


def build_diffusion(cfg) -> GaussianDiffusion:
    """The diffusion process described by a `raydiff.config.Config`."""
    d, t = cfg.diffusion, cfg.train
    return GaussianDiffusion(schedule=d.schedule, timesteps=d.timesteps, prediction=d.prediction,
                             loss_weighting=t.loss_weighting, min_snr_gamma=t.min_snr_gamma)
