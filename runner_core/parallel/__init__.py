"""ParallelManager: tensor x pipeline parallel ranks on torch.distributed.

* `state`: what the layers and the worker see of the active ranks (groups, the pipeline stage,
  collectives; the identity in one process);
* `manager.ParallelManager`: process groups, start (spawned or torchrun), the one `call(method,
  *args)` rank 0 broadcasts per step or command, faults and shutdown;
* `supervisor.WorkerSupervisor`: rank 0's watch over spawned workers (death, hangs);
* `worker_proc`: building every rank's Worker in step, the worker process and its call loop;
* `plan`: which layouts a model allows (`validate_parallel_config`) and which to use
  (`suggest_parallel_config`).

Only `state`, `manager` and `supervisor` are exported here: the layers import `state`, and
`plan` and `worker_proc` depend on the memory planner and the engine that sit above the layers,
so their users import them from their modules.
"""

from runner_core.parallel.manager import ParallelManager, in_torchrun, shutdown_all
from runner_core.parallel.state import COMM_STATS, PipelineStage, get_pp_stage, get_tp_rank, get_tp_size
from runner_core.parallel.supervisor import WorkerSupervisor

__all__ = ["COMM_STATS", "ParallelManager", "PipelineStage", "WorkerSupervisor", "get_pp_stage", "get_tp_rank",
           "get_tp_size", "in_torchrun", "shutdown_all"]
