"""Worker for tests/test_lite_ppo.py: lite_ppo.compute_advantages on this rank's share of a fixed rollout.

    python -m torch.distributed.run --nproc_per_node 2 --master_port PORT tests/lite_ppo_dist_worker.py OUT_FILE

Every rank builds the same rewards (6 groups of 4), keeps its own contiguous half of whole groups, as main()
does, and computes the advantages on that half only; the batch std must still be the whole batch's. Rank 0 saves
all ranks' advantages, the world size and what each rank would get without the gather (its local std).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rewards_of_the_rollout() -> torch.Tensor:
    # rank 0's half is mostly right, rank 1's half mostly wrong, so their local stds differ from the global one
    return torch.tensor(
        [1, 1, 1, 0, 1, 1, 1, 1, 1, 0.5, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0.25, 0], dtype=torch.float64
    )


def main() -> None:
    import lite_ppo

    out_file = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args = lite_ppo.Args(group_size=4)
    rewards = rewards_of_the_rollout()
    n = rewards.numel()
    share = rewards[rank * n // world : (rank + 1) * n // world]
    adv = lite_ppo.compute_advantages(share, args)
    r = share.view(-1, args.group_size)
    local = ((r - r.mean(1, keepdim=True)) / (share.std(correction=0) + args.adv_eps)).view(-1)  # no gather
    gathered = [torch.empty_like(adv) for _ in range(world)]
    dist.all_gather(gathered, adv)
    locals_ = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(locals_, local)
    if rank == 0:
        torch.save(
            {"world_size": world, "advantages": torch.cat(gathered), "local": torch.cat(locals_), "rewards": rewards},
            out_file,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
