"""Run directories: files on local or object storage, logs, checkpoints, the training state, resume decisions."""
