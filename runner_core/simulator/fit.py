"""The cost model's coefficients from measured steps: non-negative least squares on its regressors.

Each row is (CostModel.features(...), measured seconds). The step time is linear in the regressors with weights
1/compute_efficiency, 1/memory_efficiency, 1/attention_efficiency (prefill chunks), 1/decode_attention_efficiency
(decode rows), step_s, layer_s, seq_s and token_s (comm_s is known and comes off the measured time), so an
active-set NNLS (Lawson and Hanson) finds them, all >= 0.

Each efficiency is at most 1: the fit's weight is 1/efficiency - 1 >= 0 (a part the rows give no extra weight runs
at its peak, never beyond it). The fit minimises relative error: each row is divided by its measured time, so a
2 ms decode step weighs as much as a 200 ms prefill; absolute least squares would fit the long prefills and leave
the decode steps, which make TPOT, far off. With rows of one model only (the layer count never changes) layer_s
cannot be told from step_s: it is folded into step_s (layer_s = 0).
"""

from __future__ import annotations

import numpy as np

from runner_core.simulator.hardware import Coefficients

# regressor -> (coefficient, whether the regressor's weight is its reciprocal)
FEATURES = {
    "linear_compute_s": ("compute_efficiency", True),
    "linear_memory_s": ("memory_efficiency", True),
    "attention_s": ("attention_efficiency", True),
    "decode_attention_s": ("decode_attention_efficiency", True),
    "one": ("step_s", False),
    "layers": ("layer_s", False),
    "seqs": ("seq_s", False),
    "tokens": ("token_s", False),
}
_SHAPES_HINT = ("decode batches of several sizes and KV lengths, prefill chunks long enough to be compute-bound, "
                "and mixed steps")


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson-Hanson active set), columns scaled to unit norm first."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    m, n = a.shape
    x, active = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(1.0, np.abs(a).sum(axis=0).max())
    for _ in range(3 * n):
        w = a.T @ (b - a @ x)
        if active.all() or w[~active].max() <= tol:
            break
        active[np.argmax(np.where(active, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
            if (z[active] > tol).all():
                x = z
                break
            shrink = active & (z <= tol)
            alpha = np.min(x[shrink] / (x[shrink] - z[shrink]))
            x = x + alpha * (z - x)
            active &= x > tol
            x[~active] = 0.0
    return x / scale


def fit_coefficients(rows: list[tuple[dict[str, float], float]]) -> Coefficients:
    """Coefficients that best explain `rows` of (features, measured seconds), in relative error. ValueError when
    the rows cannot determine them (too few distinct shapes, a regressor never present or always proportional to
    another, a non-positive time)."""
    names = list(FEATURES)
    if any(t <= 0 for _, t in rows):
        raise ValueError("every measured step time must be > 0 seconds")
    x = np.array([[f[name] for name in names] for f, _ in rows], dtype=float)
    t = np.array([t for _, t in rows], dtype=float)
    comm = np.array([f.get("comm_s", 0.0) for f, _ in rows], dtype=float)
    distinct = len({tuple(r) for r in np.round(x, 12).tolist()})
    folded = distinct > 0 and np.ptp(x[:, names.index("layers")]) == 0
    if folded:  # one model: layers is a constant multiple of one, its cost part of step_s
        x = np.delete(x, names.index("layers"), axis=1)
        names.remove("layers")
    if distinct < len(names):
        raise ValueError(f"fit_coefficients needs at least {len(names)} distinct step shapes ({_SHAPES_HINT}); "
                         f"got {distinct}")
    missing = [n for i, n in enumerate(names) if not x[:, i].any()]
    if missing:
        raise ValueError(f"no row has {', '.join(missing)}: the rows cannot determine "
                         f"{', '.join(FEATURES[n][0] for n in missing)}; add {_SHAPES_HINT}")
    # each efficiency is at most 1 (no step beats the peak): its reciprocal is 1 + a non-negative weight, so the
    # roofline times at 100% come off the measured time first
    roofline = x[:, [i for i, n in enumerate(names) if FEATURES[n][1]]].sum(axis=1)
    a, b = x / t[:, None], (t - comm - roofline) / t
    unit = a / np.linalg.norm(a, axis=0)
    if np.linalg.matrix_rank(unit, tol=1e-9 * np.linalg.norm(unit, 2)) < len(names):
        raise ValueError(f"the rows determine fewer than the {len(names)} coefficients (some regressors move "
                         f"together, e.g. seqs and tokens in decode-only steps); add {_SHAPES_HINT}")
    solution = dict(zip(names, nnls(a, b)))
    values = {"layer_s": 0.0}
    for name, weight in solution.items():
        coefficient, reciprocal = FEATURES[name]
        values[coefficient] = float(1.0 / (1.0 + weight) if reciprocal else weight)
    return Coefficients(**values)
