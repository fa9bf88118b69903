"""What-if: the engine's real Scheduler and MemoryManager on a virtual clock, the forward pass replaced by a
step time predicted from a readable cost model, so a model and a configuration can be planned for hardware
that is not here.

* `hardware`: the named devices (datasheet peaks, memory, links, efficiency bands) and this CPU's spec;
* `cost_model`: one step's predicted time from its shape (linear layers as a roofline, attention, TP/PP
  communication, the pipeline bubble, fixed costs per step, layer and sequence) and the least-squares fit;
* `engine`, `simulation`: the simulated runner (`ModelRunner(config, simulate=...)`);
* `calibrate`, `validate`: fitting this CPU's coefficients on measured steps, and the errors against real runs;
* `model_configs`, `published`, `backend`: models by their config alone, published GPU figures, what-if sweeps.
"""
