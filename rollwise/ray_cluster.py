"""Ray for loop.backend=ray: started on this machine, or joined at loop.ray_address."""

from __future__ import annotations

import os

import ray

from rollwise.waits import NoAnswer, PeerDied


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


def answers(refs: list, names: list[str], what: str, timeout_s: float) -> list:
    """Each ref's value within one deadline, by rollwise.waits's rule for Ray actors: an actor
    that died raises PeerDied naming it (at once, not at the deadline), refs unfinished at the
    deadline NoAnswer naming their actors; an exception inside the call passes through as
    Ray's RayTaskError."""
    _, unready = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    out = []
    for ref, name in zip(refs, names):
        if ref in unready:
            continue
        try:
            out.append(ray.get(ref))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
            raise PeerDied(name, "its Ray actor died") from None
    if unready:
        raise NoAnswer([n for r, n in zip(refs, names) if r in unready], what, timeout_s)
    return out
