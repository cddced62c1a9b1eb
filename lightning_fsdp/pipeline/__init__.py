"""Pipeline parallelism composed with sharding: stages over pipeline ranks, each stage sharded over its data ranks
(docs/pipeline.md; its "How a step runs" maps the modules)."""

from lightning_fsdp.pipeline.runtime import PipelineLayout, PipelineRuntime, pipelined_loss, runtime_of
from lightning_fsdp.pipeline.split import AbsentPiece, pipeline_pieces, plan_stages

__all__ = [
    "AbsentPiece",
    "PipelineLayout",
    "PipelineRuntime",
    "pipeline_pieces",
    "pipelined_loss",
    "plan_stages",
    "runtime_of",
]
