"""ParallelManager: the ranks of a tensor x pipeline parallel runner, started and driven from rank 0.

* `manager.ParallelManager`: process groups, start (spawned or torchrun), the one `call(method,
  *args)` rank 0 broadcasts per step or command, faults and shutdown;
* `supervisor.WorkerSupervisor`: rank 0's watch over spawned workers (death, hangs);
* `worker_proc`: building every rank's Worker in step, the worker process and its call loop;
* `plan`: which layouts a model allows (`validate_parallel_config`) and which to use
  (`suggest_parallel_config`).

What the layers see of the ranks (groups, the stage, collectives) is `runner_core.distributed`, below
the layers; this folder sits above the engine it launches.
"""

from runner_core.parallel.manager import ParallelManager, in_torchrun, shutdown_all
from runner_core.parallel.supervisor import WorkerSupervisor

__all__ = ["ParallelManager", "WorkerSupervisor", "in_torchrun", "shutdown_all"]
