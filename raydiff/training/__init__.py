"""Training: the driver (Ray + TorchTrainer), the per-worker loop, one optimizer step, and what it needs."""
