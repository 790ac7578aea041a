"""Diffusion math: noise schedules, the forward process, training targets and loss, and samplers.

Notation follows Ho et al. (2020): `alpha_bar[t]` is the cumulative product of `1 - beta`,
`x_t = sqrt(alpha_bar) x0 + sqrt(1 - alpha_bar) eps`. The network predicts one of
eps, v = sqrt(alpha_bar) eps - sqrt(1 - alpha_bar) x0 (Salimans & Ho, 2022) or x0.
Samplers walk a (possibly respaced) decreasing sequence of timesteps; DDPM's ancestral step is the
posterior q(x_prev | x_t, x0), DDIM's is the deterministic (eta=0) or stochastic (eta>0) update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

Schedule = Literal["linear", "cosine"]
Prediction = Literal["eps", "v", "x0"]
Denoiser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_betas(schedule: Schedule, timesteps: int) -> torch.Tensor:
    """Betas in float64. Linear: Ho et al.'s 1e-4..0.02 at T=1000, rescaled by 1000/T for other T
    (as in improved-diffusion). Cosine: Nichol & Dhariwal's alpha_bar, betas clipped at 0.999."""
    if schedule == "linear":
        scale = 1000.0 / timesteps
        return torch.linspace(scale * 1e-4, scale * 0.02, timesteps, dtype=torch.float64)
    if schedule == "cosine":
        s = 0.008
        steps = torch.arange(timesteps + 1, dtype=torch.float64) / timesteps
        alpha_bar = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
        return (1 - alpha_bar[1:] / alpha_bar[:-1]).clamp(max=0.999)
    raise ValueError(f"unknown schedule {schedule!r}")


class GaussianDiffusion:
    """Holds a schedule's constants and does all the arithmetic that depends on it.

    :param schedule: "linear" or "cosine".
    :param timesteps: number of diffusion steps T.
    :param prediction: what the network predicts: "eps", "v" or "x0".
    """

    def __init__(self, *, schedule: Schedule, timesteps: int, prediction: Prediction) -> None:
        self.timesteps = timesteps
        self.prediction = prediction
        self.betas = make_betas(schedule, timesteps)
        self.alpha_bar = torch.cumprod(1 - self.betas, dim=0)

    def _ab(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """alpha_bar at integer timesteps t (t = -1 means alpha_bar = 1), shaped to broadcast over `like`."""
        ab = torch.cat([torch.ones(1, dtype=torch.float64), self.alpha_bar])[t.cpu() + 1]
        return ab.to(device=like.device, dtype=torch.float32).view(-1, *([1] * (like.dim() - 1)))

    # Forward process and training.
    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        ab = self._ab(t, x0)
        return ab.sqrt() * x0 + (1 - ab).sqrt() * noise

    def target(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The regression target for the configured prediction type."""
        if self.prediction == "eps":
            return noise
        if self.prediction == "x0":
            return x0
        ab = self._ab(t, x0)
        return ab.sqrt() * noise - (1 - ab).sqrt() * x0

    def loss_per_sample(
        self, model: Denoiser, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor
    ) -> torch.Tensor:
        """Mean squared error between the network output and the target, one value per sample."""
        x_t = self.q_sample(x0, t, noise)
        out = model(x_t, t)
        return (out.float() - self.target(x0, t, noise)).square().mean(dim=tuple(range(1, x0.dim())))

    # Converting a network output to the quantities samplers need.
    def predict_x0_eps(
        self, out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, clip: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x0, eps) implied by the network output. With `clip`, x0 is clamped to [-1, 1] and eps
        recomputed from it so that the two stay consistent with x_t."""
        ab = self._ab(t, x_t)
        if self.prediction == "eps":
            x0 = (x_t - (1 - ab).sqrt() * out) / ab.sqrt()
        elif self.prediction == "x0":
            x0 = out
        else:
            x0 = ab.sqrt() * x_t - (1 - ab).sqrt() * out
        if clip:
            x0 = x0.clamp(-1, 1)
        eps = (x_t - ab.sqrt() * x0) / (1 - ab).sqrt()
        return x0, eps

    # Sampling.
    def sample_timesteps(self, steps: int | None) -> list[int]:
        """Decreasing timesteps to visit: all T, or `steps` evenly spaced ones (respacing)."""
        if steps is None or steps >= self.timesteps:
            return list(range(self.timesteps - 1, -1, -1))
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        return sorted({round(i * (self.timesteps - 1) / max(steps - 1, 1)) for i in range(steps)}, reverse=True)

    def ddpm_step(
        self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, t_prev: torch.Tensor, noise: torch.Tensor
    ) -> torch.Tensor:
        """Ancestral step: a draw from the posterior q(x_prev | x_t, x0) of the (respaced) chain."""
        ab_t, ab_prev = self._ab(t, x_t), self._ab(t_prev, x_t)
        beta = 1 - ab_t / ab_prev
        mean = (ab_prev.sqrt() * beta * x0 + (1 - beta).sqrt() * (1 - ab_prev) * x_t) / (1 - ab_t)
        var = beta * (1 - ab_prev) / (1 - ab_t)
        return mean + var.sqrt() * noise

    def ddim_step(
        self, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, t_prev: torch.Tensor, eta: float,
        noise: torch.Tensor,
    ) -> torch.Tensor:
        """DDIM update (Song et al. 2021, eq. 12). eta=0 is deterministic; eta=1 equals the DDPM posterior."""
        ab_t, ab_prev = self._ab(t, x0), self._ab(t_prev, x0)
        sigma = eta * ((1 - ab_prev) / (1 - ab_t) * (1 - ab_t / ab_prev)).sqrt()
        return ab_prev.sqrt() * x0 + (1 - ab_prev - sigma**2).clamp(min=0).sqrt() * eps + sigma * noise

    @torch.no_grad()
    def sample(
        self,
        model: Denoiser,
        shape: tuple[int, ...],
        *,
        sampler: Literal["ddpm", "ddim"] = "ddim",
        steps: int | None = None,
        eta: float = 0.0,
        generator: torch.Generator,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Generate images in [-1, 1]. All noise comes from `generator` on the CPU, so a seed gives the
        same starting point and the same per-step noise on every device."""
        x = torch.randn(shape, generator=generator).to(device)
        timesteps = self.sample_timesteps(steps)
        for i, step in enumerate(timesteps):
            t = torch.full((shape[0],), step, dtype=torch.long, device=device)
            t_prev = torch.full_like(t, timesteps[i + 1] if i + 1 < len(timesteps) else -1)
            x0, eps = self.predict_x0_eps(model(x, t).float(), x, t)
            noise = torch.randn(shape, generator=generator).to(device)
            if t_prev[0] < 0:
                x = x0
            elif sampler == "ddpm":
                x = self.ddpm_step(x0, x, t, t_prev, noise)
            else:
                x = self.ddim_step(x0, eps, t, t_prev, eta, noise)
        return x


def build_diffusion(cfg) -> GaussianDiffusion:
    """The diffusion process described by a `raydiff.config.Config`."""
    d = cfg.diffusion
    return GaussianDiffusion(schedule=d.schedule, timesteps=d.timesteps, prediction=d.prediction)
