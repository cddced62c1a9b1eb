"""``PipelineOptions``: the pipeline-parallel options of ``FSDPStrategy`` (docs/pipeline.md, "Options"), validated on
every rank before any group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Schedule name -> (torch class name, several stages per rank). Only schedules whose backward is one autograd call
# per microbatch: the zero-bubble ones split backward into input and weight parts, which the engine's per-unit
# reduction does not follow.
SCHEDULES: dict[str, tuple[str, bool]] = {
    "GPipe": ("ScheduleGPipe", False),
    "1F1B": ("Schedule1F1B", False),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", True),
}


@dataclass(frozen=True)
class PipelineOptions:
    size: int = 1
    schedule: str = "1F1B"
    microbatches: int | None = None  # None: one per stage (the fewest every schedule accepts)
    stages_per_rank: int = 1
    split: tuple[str, ...] | None = None
    module: str = "model"

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def num_stages(self) -> int:
        return self.size * self.stages_per_rank

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else self.num_stages

    @classmethod
    def parse(
        cls,
        size: Any = 1,
        schedule: Any = "1F1B",
        microbatches: Any = None,
        stages_per_rank: Any = None,
        split: Any = None,
        module: Any = "model",
    ) -> PipelineOptions:
        size = _positive_int(size, "pipeline_parallel_size")
        if schedule not in SCHEDULES:
            raise ValueError(
                f"pipeline_schedule={schedule!r} is not supported; choose one of {sorted(SCHEDULES)} (the zero-bubble "
                "schedules split backward in two, which the sharded gradient reduction does not follow)."
            )
        interleaved = SCHEDULES[schedule][1]
        if stages_per_rank is None:
            stages_per_rank = 2 if interleaved else 1
        stages_per_rank = _positive_int(stages_per_rank, "pipeline_stages_per_rank")
        if interleaved and stages_per_rank < 2:
            raise ValueError(
                f"pipeline_stages_per_rank={stages_per_rank} with pipeline_schedule={schedule!r}: an interleaved "
                "schedule places at least 2 stages on each pipeline rank; pass 2 or more, or use 'GPipe' / '1F1B'."
            )
        if not interleaved and stages_per_rank != 1:
            raise ValueError(
                f"pipeline_stages_per_rank={stages_per_rank} with pipeline_schedule={schedule!r}: this schedule runs "
                "one stage per pipeline rank; use 'Interleaved1F1B' for several."
            )
        if microbatches is not None:
            microbatches = _positive_int(microbatches, "pipeline_microbatches")
        if not isinstance(module, str) or not module:
            raise TypeError(f"pipeline_module={module!r} must be the name of the LightningModule's attribute to split.")
        if split is not None:
            if isinstance(split, str) or not all(isinstance(name, str) for name in split):
                raise TypeError(f"pipeline_split={split!r} must be a list of module names or None (balanced).")
            split = tuple(split)
        options = cls(size, schedule, microbatches, stages_per_rank, split, module)
        if size > 1:
            options._check_microbatches()
            if split is not None and len(split) != options.num_stages - 1:
                raise ValueError(
                    f"pipeline_split={list(split)} names {len(split)} cut points; {options.num_stages} stages "
                    f"(pipeline_parallel_size={size} x {stages_per_rank} per rank) need {options.num_stages - 1}."
                )
        return options

    def _check_microbatches(self) -> None:
        # torch's own rules, checked here so that they raise before any collective rather than when the schedule is
        # built at the first step.
        m, stages = self.num_microbatches, self.num_stages
        if self.schedule == "1F1B" and m < stages:
            raise ValueError(
                f"pipeline_microbatches={m} with pipeline_schedule='1F1B' and {stages} stages: 1F1B needs at least "
                f"one microbatch per stage ({stages} or more); GPipe accepts fewer."
            )
        if self.schedule == "Interleaved1F1B":
            rounds = max(1, m // self.size)
            if m % rounds:
                raise ValueError(
                    f"pipeline_microbatches={m} with pipeline_schedule='Interleaved1F1B' on {self.size} pipeline "
                    f"ranks: it must be a multiple of the number of rounds ({rounds} = {m} // {self.size}); "
                    f"for example {self.size * rounds}."
                )

    def check_world(self, world_size: int) -> int:
        """The data-parallel size D = world_size / P; a clear error when P does not divide the world."""
        if world_size % self.size:
            raise ValueError(
                f"pipeline_parallel_size={self.size} does not divide the {world_size} processes (devices x "
                f"num_nodes); choose a P that divides {world_size}, e.g. "
                f"{[p for p in range(1, world_size + 1) if world_size % p == 0]}."
            )
        return world_size // self.size


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int.")
    return value


def check_pipeline_composition(options: PipelineOptions, sharding: Any, process_group: Any, device_mesh: Any) -> None:
    """The strategy options that do not compose with pipeline parallelism, refused when the strategy is built."""
    if not options.enabled:
        return
    strategy = sharding.sharding_strategy
    if strategy.is_hybrid:
        raise ValueError(
            f"sharding_strategy={strategy.value!r} with pipeline_parallel_size={options.size}: each stage is sharded "
            "over its data-parallel group; hybrid sharding inside a stage is not supported. Use 'FULL_SHARD', "
            "'SHARD_GRAD_OP' or 'NO_SHARD'."
        )
    if process_group is not None or device_mesh is not None:
        raise ValueError(
            f"process_group / device_mesh with pipeline_parallel_size={options.size}: the strategy builds the "
            "(pipeline, data) mesh itself (strategy.pipeline.layout.mesh); leave both unset."
        )


def check_pipeline_precision(options: PipelineOptions, precision: str) -> None:
    """16-mixed scales the loss in Lightning's backward, which a pipelined step does not call: refused."""
    if options.enabled and precision.startswith("16"):
        raise ValueError(
            f"precision={precision!r} with pipeline_parallel_size={options.size}: the fp16 loss scaler scales the "
            "loss in Lightning's backward, but the pipeline runs each microbatch's backward itself. Use "
            "'bf16-mixed', 'bf16-true' or '32-true'."
        )
