"""The price of one engine step, read off the shape of its plan.

The real model runner groups a step the way the model's attention does (see
workers/model/attention.py): every single-token chunk (a decode) joins one group whose
K/V gather is padded to the longest decode context, and every multi-token chunk (a
prefill chunk) is a group of its own with causal attention over its context. So:

    step_s = intercept
           + per_prefill_token  * prefill tokens           projections and MLP per row
           + per_prefill_chunk  * prefill chunks           one attention group each
           + per_prefill_pair   * sum(chunk tokens x chunk context)     causal attention
           + per_decode         * decodes                  projections, MLP, sampling
           + per_decode_context * decodes x longest decode context      the padded gather
           + per_torch_step     * (1 if the step prefills)
           + per_mixed_decode   * decodes in a step that prefills

The last two are there because a step runs one of two paths (LlamaForCausalLM.forward,
workers/model/llama.py): a decode-only step is one native call through every layer, while
a step with any prefill runs the layers in torch, with its own fixed cost and its own cost
per decode row. Without them the fit prices every step as an average of the two paths: on
the engine of 2026-12-05 (ITL p50 1.2-1.3 ms in-process on the seed trace, against 5.4 ms
when the model it replaces was fitted, 2026-11-30) R^2 0.90 and a median step error
of 11%; with them 0.99 and 9%.

The coefficients are fitted by least squares to steps of the real engine timed one by
one (python -m loadtest.sim.fit); a fitted model is a JSON file, and the one for the
`tiny` preset on one CPU thread ships next to this module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from workers.engine.plan import StepPlan

DEFAULT_COST_MODEL = Path(__file__).with_name("cost_model_cpu_tiny.json")

FEATURES = (
    "intercept",
    "per_prefill_token",
    "per_prefill_chunk",
    "per_prefill_pair",
    "per_decode",
    "per_decode_context",
    "per_torch_step",
    "per_mixed_decode",
)


class StepShape(NamedTuple):
    """What a step's cost depends on; one field per non-intercept coefficient."""

    num_prefill_tokens: int
    num_prefill_chunks: int
    num_prefill_pairs: int  # sum over prefill chunks of num_tokens x context_len
    num_decodes: int
    num_decode_gather: int  # num_decodes x the longest decode context_len

    def features(self) -> tuple[float, ...]:
        """The value of each of FEATURES: the fields, then the two that tell the paths apart."""
        prefills = 1.0 if self.num_prefill_chunks else 0.0
        return (1.0, *map(float, self), prefills, prefills * self.num_decodes)


def shape_of(plan: StepPlan) -> StepShape:
    """The cost-relevant shape of a plan (grouped as the model runner groups it)."""
    prefill_tokens = prefill_chunks = prefill_pairs = decodes = longest_decode = 0
    for chunk in plan.chunks:
        n = len(chunk.token_ids)
        context = chunk.start_position + n
        if n == 1:
            decodes += 1
            if context > longest_decode:
                longest_decode = context
        else:
            prefill_tokens += n
            prefill_chunks += 1
            prefill_pairs += n * context
    return StepShape(prefill_tokens, prefill_chunks, prefill_pairs, decodes, decodes * longest_decode)


@dataclass(frozen=True)
class ModelFacts:
    """What the simulated engines must share with the measured one to be priced by it."""

    model: str
    device: str
    num_threads: int
    vocab_size: int
    max_model_len: int
    block_size: int
    block_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class CostModel:
    """Fitted step-time coefficients (seconds, per unit of each StepShape field)."""

    coefficients: tuple[float, ...]  # in FEATURES order
    facts: ModelFacts
    r2: float
    num_samples: int

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"CostModel.coefficients needs {len(FEATURES)} values, got {len(self.coefficients)}")
        if any(c < 0 for c in self.coefficients):
            raise ValueError(
                f"CostModel.coefficients must be >= 0 (more work never makes a step cheaper), got {self.coefficients}"
            )

    def step_seconds(self, shape: StepShape) -> float:
        return sum(c * f for c, f in zip(self.coefficients, shape.features()))

    def to_json(self) -> dict[str, Any]:
        return {
            "coefficients_s": dict(zip(FEATURES, self.coefficients)),
            "facts": asdict(self.facts),
            "r2": self.r2,
            "num_samples": self.num_samples,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        coefficients = data["coefficients_s"]
        missing = [name for name in FEATURES if name not in coefficients]
        if missing:
            raise ValueError(f"cost model: coefficients_s lacks {', '.join(missing)}")
        return cls(
            coefficients=tuple(float(coefficients[name]) for name in FEATURES),
            facts=ModelFacts(**data["facts"]),
            r2=float(data["r2"]),
            num_samples=int(data["num_samples"]),
        )


def load_cost_model(path: Path = DEFAULT_COST_MODEL) -> CostModel:
    return CostModel.from_json(json.loads(Path(path).read_text()))


class Fit(NamedTuple):
    coefficients: tuple[float, ...]
    r2: float
    predictions: list[float]


def fit_least_squares(shapes: Sequence[StepShape], seconds: Sequence[float]) -> Fit:
    """Non-negative least squares over the StepShape features, in relative error.

    Each step's residual is divided by its measured time, so a 4 ms decode step counts
    as much as a 1 s prefill: a serving run is mostly short steps, and plain least
    squares would fit the few long ones and get the common ones wrong. Coefficients are
    kept >= 0 (Lawson-Hanson active set): a negative one could buy a slightly better
    fit, and then price some step the fit never saw below zero. R^2 is on seconds.
    """
    if len(shapes) != len(seconds) or len(shapes) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} (shape, seconds) pairs of equal count, got {len(shapes)}")
    x = np.array([s.features() for s in shapes])  # [num_samples, num_features]
    y = np.array(seconds, dtype=float)  # [num_samples]
    if (y <= 0).any():
        raise ValueError("every measured step time must be positive")
    weighted = x / y[:, None]  # row i / y_i: residuals become relative errors
    # Columns span orders of magnitude (1 .. 10^6): solve in scaled units.
    scale = np.maximum(np.abs(weighted).max(axis=0), 1e-300)  # [num_features]
    coefficients = _nnls(weighted / scale, np.ones_like(y)) / scale
    predictions = x @ coefficients
    residual = float(((y - predictions) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - residual / total if total > 0 else 1.0
    return Fit(tuple(float(c) for c in coefficients), r2, [float(p) for p in predictions])


def _nnls(a: np.ndarray, b: np.ndarray, max_iterations: int = 200) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson, 1974)."""
    num_features = a.shape[1]
    passive = np.zeros(num_features, dtype=bool)  # features free to be positive
    x = np.zeros(num_features)
    for _ in range(max_iterations):
        gradient = a.T @ (b - a @ x)  # [num_features]
        candidates = ~passive & (gradient > 1e-12 * max(1.0, float(np.abs(gradient).max())))
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, gradient, -np.inf)))] = True
        while True:
            z = np.zeros(num_features)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step from x toward z until the first passive coefficient reaches zero.
            shrinking = passive & (z <= 0)
            alpha = float(np.min(x[shrinking] / (x[shrinking] - z[shrinking])))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x
