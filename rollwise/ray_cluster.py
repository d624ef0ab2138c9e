"""Ray for loop.backend=ray: started on this machine, or joined at loop.ray_address."""

from __future__ import annotations

import os

import ray


def start(cfg) -> None:
    """Ray on this machine, or joined at loop.ray_address (once per process)."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if cfg.loop.ray_address:
        ray.init(address=cfg.loop.ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 2,
                              cfg.loop.rollout_workers + cfg.train.world_size + 1),
                 include_dashboard=False, log_to_driver=False)


def shutdown() -> None:
    """Stop the Ray this process started (its workers with it)."""
    if ray.is_initialized():
        ray.shutdown()
