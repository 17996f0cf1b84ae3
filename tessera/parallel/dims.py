"""Parallel degrees and how they factor the world. Torch-free, so configs are checked before launch."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, p, world_size: int) -> "ParallelDims":
        """Resolve `data_parallel_shard_degree = -1` and check the product; raises ValueError."""
        fixed = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree \
            * p.pipeline_parallel_degree
        shard = p.data_parallel_shard_degree
        if shard == -1:
            if world_size % fixed:
                raise ValueError(
                    f"parallelism: replicate {p.data_parallel_replicate_degree} x cp {p.context_parallel_degree} "
                    f"x tp {p.tensor_parallel_degree} x pp {p.pipeline_parallel_degree} = {fixed} does not divide "
                    f"the world size {world_size} (processes: NGPU x nodes)")
            shard = world_size // fixed
        if shard < 1:
            raise ValueError(f"parallelism.data_parallel_shard_degree: {shard} must be -1 or >= 1")
        if shard * fixed != world_size:
            raise ValueError(
                f"parallelism: degrees multiply to {shard * fixed} (replicate {p.data_parallel_replicate_degree} x "
                f"shard {shard} x cp {p.context_parallel_degree} x tp {p.tensor_parallel_degree} x pp "
                f"{p.pipeline_parallel_degree}) but the world size is {world_size}; set "
                f"data_parallel_shard_degree = -1 to use all remaining ranks")
        ep, cp, tp = p.expert_parallel_degree, p.context_parallel_degree, p.tensor_parallel_degree
        if ep > 1 and (ep % (cp * tp) or (shard * cp * tp) % ep):
            raise ValueError(f"parallelism.expert_parallel_degree: {ep} must be a multiple of context_parallel x "
                             f"tensor_parallel degrees ({cp} x {tp}) and divide data_parallel_shard x context x "
                             f"tensor degrees ({shard} x {cp} x {tp}): the ranks that route their own tokens, which "
                             f"experts are split over; pick such a degree")
        return cls(p.data_parallel_replicate_degree, shard, cp, tp, p.pipeline_parallel_degree, ep, world_size)

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_in_ep(self) -> int:
        """Data-parallel shard ranks inside one EP group (with all its context- and tensor-parallel ranks)."""
        return self.ep // (self.cp * self.tp)

    @property
    def fsdp(self) -> bool:
        return self.dp_shard * self.cp > 1
