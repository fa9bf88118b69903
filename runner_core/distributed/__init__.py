"""What the layers and the worker see of the active ranks: process groups, the pipeline stage and the
collectives (`parallel_state`); in one process, the identity. The launcher that starts the ranks is
`runner_core.parallel`, above the engine."""

from runner_core.distributed.parallel_state import COMM_STATS, PipelineStage, get_pp_stage, get_tp_rank, get_tp_size

__all__ = ["COMM_STATS", "PipelineStage", "get_pp_stage", "get_tp_rank", "get_tp_size"]
