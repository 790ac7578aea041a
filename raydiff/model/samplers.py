"""Fast samplers: DPM-Solver++ (2M), on the diffusion ODE or SDE, and Heun's method (EDM), which approach or pass
the quality of DDPM's 1,000 steps in 10 to 35 network evaluations.

Why apart from `raydiff.model.diffusion`: both work in the noise level sigma = sqrt((1 - alpha_bar) / alpha_bar)
of raydiff's discrete schedule, not on its table of timesteps, and both are written as diffusers writes them
(`DPMSolverMultistepScheduler` with `algorithm_type="dpmsolver++"` or `"sde-dpmsolver++"`, `solver_order=2`,
`final_sigmas_type="zero"`; `HeunDiscreteScheduler`), each with "linspace" timesteps, so that the tests can hold
them to diffusers' results in float32. The step coefficients are computed in float64 before the loop; the loop
itself never reads a value back from the device. The ODE solvers are deterministic (an image depends only on its
initial noise); the SDE solver draws its fresh noise through the caller's `draw_noise`, from the image's own
generator too.

Heun departs from diffusers in one place: a first step that lowers sigma more than tenfold is an Euler step
(`EULER_FIRST_RATIO`). Why: the cosine schedule's last beta is clipped at 0.999, which puts its largest sigma near
20,000 while the next of 18 steps is near 11; over so long a step the trapezoid's second evaluation multiplies the
network's error at sigma 11 by half the ratio of the two sigmas, over 900, and even an exact denoiser of Gaussian
data gave images far wider than the data (diffusers' `HeunDiscreteScheduler` does the same with
`squaredcos_cap_v2`). The linear schedule's first step (T = 1000) falls less than tenfold from 5 steps on, where
Heun is diffusers' step for step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# (x, timesteps (a float tensor, one per image), alpha, sigma) -> the x0 the network predicts, where
# x = alpha * x0 + sigma * eps (alpha and sigma broadcast over x).
Denoise = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def x0_from_output(prediction: str, out: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor,
                   sigma: torch.Tensor) -> torch.Tensor:
    """The clean image a network output implies, for x = alpha x0 + sigma eps (alpha^2 + sigma^2 = 1)."""
    if prediction == "eps":
        return (x - sigma * out) / alpha
    if prediction == "x0":
        return out
    return alpha * x - sigma * out  # v = alpha eps - sigma x0


def dpmpp_2m_timesteps(timesteps: int, steps: int) -> list[int]:
    """The timesteps DPM-Solver++ evaluates the network at: `steps` of them, evenly spaced from T-1 down, then a
    last step to the clean image (diffusers' "linspace" spacing)."""
    return [int(t) for t in np.linspace(0, timesteps - 1, steps + 1).round()[::-1][:-1]]


def dpmpp_2m(denoise: Denoise, x: torch.Tensor, alpha_bar: torch.Tensor, steps: int,
             draw_noise: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """DPM-Solver++ (2M) (Lu et al. 2022): the multistep second-order solver of the diffusion ODE in data
    prediction, its first and last steps first-order. `x`: the initial noise; `alpha_bar`: the schedule's float64
    table; `steps` network evaluations.

    With `draw_noise` (standard normal noise like `x`, one draw per step but the last), the SDE variant
    (diffusers' "sde-dpmsolver++", midpoint): each step forgets part of its image and draws fresh noise for it, as
    DDPM's ancestral steps do, which corrects the network's own errors instead of carrying them along."""
    ts = dpmpp_2m_timesteps(len(alpha_bar), steps)
    ab = torch.cat([alpha_bar[ts], torch.ones(1, dtype=torch.float64)])  # ... then the clean image, alpha_bar 1
    alpha, sigma = ab.sqrt(), (1 - ab).sqrt()
    lam = alpha.log() - sigma.log()  # log SNR / 2: +inf at the clean image
    h = lam[1:] - lam[:-1]
    r = torch.cat([torch.ones(1, dtype=torch.float64), h[:-1] / h[1:]])  # the previous step's h over this one's
    first_order = [i == 0 or i == len(ts) - 1 for i in range(len(ts))]
    # ODE: x_next = (sigma_next / sigma) x - alpha_next (exp(-h) - 1) D, D = m0 + (m0 - m1) / (2 r) at second
    # order; SDE: x_next = (sigma_next / sigma) exp(-h) x - alpha_next (exp(-2h) - 1) D
    #                      + sigma_next sqrt(1 - exp(-2h)) z.
    stochastic = draw_noise is not None
    keep = sigma[1:] / sigma[:-1] * (torch.exp(-h) if stochastic else 1)
    add = -alpha[1:] * torch.expm1(-2 * h if stochastic else -h)
    fresh = sigma[1:] * (-torch.expm1(-2 * h)).sqrt()  # 0 at the last step: nothing drawn there
    on = {k: v.float().to(x.device) for k, v in {
        "keep": keep, "add": add, "fresh": fresh, "extrapolate": 1 / (2 * r),
        "alpha": alpha[:-1], "sigma": sigma[:-1], "t": torch.tensor(ts, dtype=torch.float64)}.items()}
    previous = None
    for i in range(len(ts)):
        t = on["t"][i].expand(len(x))
        x0 = denoise(x, t, on["alpha"][i], on["sigma"][i])
        d = x0 if first_order[i] or previous is None else x0 + on["extrapolate"][i] * (x0 - previous)
        x = on["keep"][i] * x + on["add"][i] * d
        if draw_noise is not None and i < len(ts) - 1:
            x = x + on["fresh"][i] * draw_noise()
        previous = x0
    return x


# A first step that lowers sigma by more than this factor is taken by Euler (see the module's docstring).
EULER_FIRST_RATIO = 10.0


def heun_timesteps(timesteps: int, steps: int) -> np.ndarray:
    """Heun's noise levels are taken at `steps` timesteps evenly spaced from T-1 to 0 (fractional ones between the
    schedule's: diffusers' "linspace"). One step is taken at T-1: it still has to start from pure noise."""
    if steps == 1:
        return np.array([timesteps - 1.0])
    return np.linspace(0, timesteps - 1, steps, dtype=np.float64)[::-1].copy()


def heun_sigmas(alpha_bar: torch.Tensor, steps: int) -> tuple[np.ndarray, torch.Tensor]:
    """(Heun's timesteps, its float64 noise levels at them followed by sigma 0)."""
    T = len(alpha_bar)
    ts = heun_timesteps(T, steps)
    train_sigmas = ((1 - alpha_bar) / alpha_bar).sqrt().numpy()
    return ts, torch.from_numpy(np.append(np.interp(ts, np.arange(T), train_sigmas), 0.0))


def euler_first(sigmas: torch.Tensor) -> bool:
    """Whether Heun's first step is Euler's: it lowers sigma more than `EULER_FIRST_RATIO`-fold (and does not end
    at sigma 0, which the last step's Euler covers)."""
    return len(sigmas) > 2 and bool(sigmas[0] > EULER_FIRST_RATIO * sigmas[1])


def heun(denoise: Denoise, noise: torch.Tensor, alpha_bar: torch.Tensor, steps: int) -> torch.Tensor:
    """Heun's second-order method on the probability-flow ODE in sigma (Karras et al. 2022, Algorithm 1 without
    churn), sigma interpolated linearly between the schedule's timesteps as diffusers does; Euler at the last
    step, to sigma 0, and at a first step that lowers sigma more than tenfold (`euler_first`). `noise`: standard
    normal; 2 `steps` - 1 network evaluations, one fewer with an Euler first step."""
    ts, sigmas = heun_sigmas(alpha_bar, steps)
    first_euler = euler_first(sigmas)
    vp_alpha = 1 / (sigmas**2 + 1).sqrt()  # the network sees x * vp_alpha = vp_alpha x0 + vp_sigma eps
    on = {k: v.float().to(noise.device) for k, v in {
        "sigma": sigmas, "alpha": vp_alpha, "vp_sigma": sigmas * vp_alpha,
        "t": torch.from_numpy(np.append(ts, 0.0))}.items()}

    def derivative(x: torch.Tensor, i: int) -> torch.Tensor:
        a = on["alpha"][i]
        x0 = denoise(x * a, on["t"][i].expand(len(x)), a, on["vp_sigma"][i])
        return (x - x0) / on["sigma"][i]

    x = noise * on["sigma"][0]
    for i in range(steps):
        dt = on["sigma"][i + 1] - on["sigma"][i]
        d = derivative(x, i)
        if i == steps - 1 or (i == 0 and first_euler):  # to sigma 0, or a first step too long for the trapezoid
            x = x + d * dt
        else:
            x = x + (d + derivative(x + d * dt, i + 1)) / 2 * dt
    return x
