"""Pipeline parallelism composed with sharding: stages over pipeline ranks, each stage sharded over its data ranks.

See docs/pipeline.md. ``options.py`` validates the strategy's ``pipeline_*`` options, ``split.py`` cuts a model into
stages, ``runtime.py`` runs torch.distributed.pipelining's schedules over them and holds ``pipelined_loss``, and
``role.py`` is what ``FSDPStrategy`` calls wherever a pipelined run differs.
"""

from lightning_fsdp.pipeline.options import SCHEDULES, PipelineOptions
from lightning_fsdp.pipeline.runtime import PipelineLayout, PipelineRuntime, pipelined_loss, runtime_of
from lightning_fsdp.pipeline.split import AbsentPiece, pipeline_pieces, plan_stages

__all__ = [
    "SCHEDULES",
    "AbsentPiece",
    "PipelineLayout",
    "PipelineOptions",
    "PipelineRuntime",
    "pipeline_pieces",
    "pipelined_loss",
    "plan_stages",
    "runtime_of",
]
