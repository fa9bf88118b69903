"""What speculative decoding buys on hardware that is not here: the cost model prices a verification step (each
of the batch's sequences runs k+1 tokens, its last token and k drafts, with logits at every position) against a
plain decode step (one token a sequence), and an acceptance rate `a` (each draft token accepted with
probability a, independently, the first rejection ending the run) gives the tokens a sequence gains per
verification step, in expectation: 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) (the accepted drafts and the
bonus or replacement token). So tokens per second with speculation = batch x that / the verification step's
time, and the speedup = that x decode step / verification step: where a step reads its weights once for the
batch (memory bound: a small batch) the k extra tokens are nearly free and speculation pays; where it is
compute bound (a large batch) they cost what they add, and it stops paying.

Priced in expectation, one step shape at a time: the proposer's own time (prompt lookup, on the host) and the
verification steps' spread around the mean are left out. `price_speculation` takes a CostModel;
`speculation_sweep` builds the cost model of a config on a Simulation's hardware (the simulated engine's, no
weights) and prices a grid of k, acceptance rates and batch sizes.
"""

from __future__ import annotations

from itertools import product

from runner_core.config import RunnerConfig
from runner_core.simulator.cost_model import CostModel
from runner_core.simulator.engine import build_simulated_engine
from runner_core.simulator.simulation import Simulation


def expected_tokens_per_step(acceptance_rate: float, k: int) -> float:
    """The tokens a verified sequence gains per step in expectation: (1 - a^(k+1)) / (1 - a); k + 1 at a = 1."""
    a = acceptance_rate
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance_rate must be from 0 to 1, got {a!r}")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k (num_speculative_tokens) must be an int >= 0, got {k!r}")
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def price_speculation(cost_model: CostModel, batch: int, context: int, k: int, acceptance_rate: float) -> dict:
    """One decode step of `batch` sequences holding `context` tokens each, against its verification step with k
    drafts a sequence: {"batch", "context", "k", "acceptance_rate", "decode_step_s", "verify_step_s",
    "tokens_per_step" (a sequence's, expected), "plain_tokens_per_s", "spec_tokens_per_s", "speedup"}."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    starts = [context] * batch
    plain = cost_model.step_time(starts, [1] * batch, batch)
    verify = cost_model.step_time(starts, [k + 1] * batch, batch * (k + 1)) if k else plain
    gained = expected_tokens_per_step(acceptance_rate, k)
    return {"batch": batch, "context": context, "k": k, "acceptance_rate": acceptance_rate,
            "decode_step_s": plain, "verify_step_s": verify, "tokens_per_step": gained,
            "plain_tokens_per_s": batch / plain, "spec_tokens_per_s": batch * gained / verify,
            "speedup": gained * plain / verify}


def speculation_sweep(config: RunnerConfig | dict, simulate: Simulation | str = "cpu", *, ks=(1, 2, 4, 8),
                      acceptance_rates=(0.5, 0.7, 0.9), batch_sizes=(1, 8, 64), context: int = 512) -> list[dict]:
    """`price_speculation` over every k, acceptance rate and batch size for `config`'s model on `simulate`'s
    hardware (a Simulation or a device name such as "h100-sxm"); its rows, with "hardware" and "model"."""
    config = RunnerConfig.coerce(config).replace(speculative_config=None)
    simulation = Simulation.coerce(simulate)
    engine = build_simulated_engine(config, simulation)
    try:
        cost_model = engine.cost_model
        rows = [price_speculation(cost_model, b, context, k, a)
                for k, a, b in product(ks, acceptance_rates, batch_sizes)]
    finally:
        engine.shutdown()
    name = cost_model.hardware.name
    return [{"model": config.model, "hardware": name, **row} for row in rows]
