"""The trainer's FSDP2 ranks as Ray actors (train.world_size > 1 with loop.backend=ray):
rank 0's node and port host the process group; a GPU each where the cluster has them. Each
actor builds its rank and runs its commands with rollwise.training.sharded, as a spawned
process does on one machine."""

from __future__ import annotations

import socket

import ray

from rollwise import ray_cluster
from rollwise.training.sharded import TrainerRankError, build_rank, handle, rank_failed
from rollwise.waits import STARTUP_S, NoAnswer, PeerDied


class TrainerRank:
    """One FSDP2 trainer rank in a Ray actor (rollwise.training.sharded's build_rank and
    commands)."""

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it: rank 0's, for the process group."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, rank: int, init: dict) -> None:
        self.rank, self.trainer = rank, build_rank(rank, init)

    def run(self, cmd: str, *args):
        return handle(self.trainer, self.rank, cmd, *args)


class RayRanks:
    """Trainer ranks as Ray actors (train.world_size with loop.backend=ray): rank 0's node and
    port host the process group; a GPU each where the cluster has them."""

    def __init__(self, init: dict, world: int, timeout_s: float):
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= world else 0
        cls = ray.remote(num_cpus=1, num_gpus=gpus)(TrainerRank)
        self.timeout, self.actors = timeout_s, [cls.remote() for _ in range(world)]
        addr, port = self._get([self.actors[0].address.remote()], "start", STARTUP_S)[0]
        init = {**init, "addr": addr, "port": port}
        self._get([a.setup.remote(r, init) for r, a in enumerate(self.actors)], "start",
                  max(self.timeout, STARTUP_S))

    def call(self, messages: list[tuple]) -> list:
        refs = [a.run.remote(*m) for a, m in zip(self.actors, messages)]
        return self._get(refs, messages[0][0], self.timeout)

    def _get(self, refs: list, cmd: str, timeout: float) -> list:
        names = [f"trainer rank {rank}" for rank in range(len(refs))]
        try:
            return ray_cluster.answers(refs, names, f"finish '{cmd}'", timeout)
        except (NoAnswer, PeerDied) as e:
            raise rank_failed(e, cmd) from None
        except ray.exceptions.RayTaskError as e:
            raise TrainerRankError(f"a trainer rank failed in '{cmd}': "
                                   f"{getattr(e, 'cause', e)}") from None

    def close(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        self.actors = []
