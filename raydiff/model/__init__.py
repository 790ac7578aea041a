"""The model and its math: the DDPM UNet, diffusion schedules and samplers, EMA, per-position noise."""
