"""What-if: the engine's real Scheduler and MemoryManager on a virtual clock, the forward pass replaced by a
step time predicted from a readable cost model, so a model and a configuration can be planned for hardware
that is not here.

* `hardware`: the named devices (datasheet peaks, memory, links, efficiency bands) and this CPU's spec;
* `cost_model`: one step's predicted time from its shape (linear layers as a roofline, attention, TP/PP
  communication, the pipeline bubble, fixed costs per step, layer and sequence) and the least-squares fit;
* `runner`, `engine`, `simulation`: the simulated runner (`SimulatedRunner(config, simulate)`, a ModelRunner);
* `calibrate`, `validate`: fitting this CPU's coefficients on measured steps, and the errors against real runs;
* `speculation`: what speculative decoding buys, a verification step priced against a decode step at an
  acceptance rate;
* `published`, `backend`: published GPU figures, what-if sweeps; the models they plan are the catalogue's
  (runner_core.models.catalogue: `catalogue_names`, `resolve_model`, config-only models included).
"""

from runner_core.models.catalogue import catalogue_names, resolve_model
from runner_core.simulator.backend import SimulatorBackend, whatif
from runner_core.simulator.calibrate import calibrate, measure_cpu
from runner_core.simulator.calibration import Calibration, load_calibration
from runner_core.simulator.cost_model import CostModel, fit_coefficients
from runner_core.simulator.hardware import HARDWARE, Coefficients, HardwareSpec, get_hardware
from runner_core.simulator.published import PUBLISHED, compare_published
from runner_core.simulator.run import simulate_workload
from runner_core.simulator.runner import SimulatedRunner
from runner_core.simulator.simulation import Simulation
from runner_core.simulator.speculation import expected_tokens_per_step, price_speculation, speculation_sweep
from runner_core.simulator.validate import validate_steps, validate_workloads

__all__ = ["HARDWARE", "PUBLISHED", "Calibration", "Coefficients", "CostModel", "HardwareSpec",
           "SimulatedRunner", "Simulation",
           "SimulatorBackend", "calibrate", "catalogue_names", "compare_published", "expected_tokens_per_step",
           "fit_coefficients", "get_hardware", "load_calibration", "measure_cpu", "price_speculation", "resolve_model",
           "simulate_workload", "speculation_sweep", "validate_steps", "validate_workloads", "whatif"]
