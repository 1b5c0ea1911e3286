"""The quality report of a cartridge: how well it stands in for its document on held-out
synthetic conversations that training never saw.

Self-study synthesizes `TrainConfig.quality_samples` conversations beyond the training ones,
from their own random stream (`selfstudy.synthesize.held_out_rng`), and never trains on them.
On those conversations the report compares three figures, all in the training loss's unit:

- `loss`: the trained cartridge's distillation loss;
- `init_loss`: the same loss of the untrained initialization (the prefix `train()` started from);
- `teacher_floor`: the loss the teacher itself gets (see `teacher_floor`).

The loss is the one training minimizes (`cartridges_core.distillation_loss_sum`): at every
answer token, -sum_k p_teacher(k) * log p_student(k) over the teacher's top-k tokens, where
the student is the model with the cartridge in front and no document in context, and
p_teacher = exp(top-k log-probabilities), not renormalized. Figures are means over all
answer tokens of the held-out conversations (each token weighs the same, as in training).
"""

from __future__ import annotations

import math
from typing import Any

import torch

import cartridges_core

from .cartridge import Cartridge, native_model
from .selfstudy.chunking import PARTS

Params = Cartridge | cartridges_core.CartridgeParams


def _as_params(prefix: Params) -> cartridges_core.CartridgeParams:
    return prefix.to_params() if isinstance(prefix, Cartridge) else prefix


def copy_params(params: cartridges_core.CartridgeParams) -> cartridges_core.CartridgeParams:
    """A copy of `params` that training `params` in place leaves untouched."""
    return cartridges_core.CartridgeParams(
        list(params.frozen_keys), list(params.frozen_values), list(params.trainable_keys), list(params.trainable_values)
    )


def held_out_loss(model: Any, prefix: Params, data: cartridges_core.TrainingData, batch_size: int = 4,
                  rows: list[int] | None = None) -> float:
    """Mean distillation loss per answer token of `prefix` (a `Cartridge` or trainable
    `CartridgeParams`) on `data` (on its `rows`, all by default): the loss training minimizes,
    without training."""
    native = native_model(model)
    params = _as_params(prefix)
    rows = list(range(int(data.tokens.shape[0]))) if rows is None else rows
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(rows), max(1, batch_size)):
            loss_sum, targets = cartridges_core.distillation_loss_sum(native, params, data, rows[start:start + batch_size])
            total += float(loss_sum)
            count += int(targets)
    if count == 0:
        raise ValueError("held-out data without answer tokens")
    return total / count


def teacher_floor(data: cartridges_core.TrainingData, rows: list[int] | None = None) -> float:
    """The loss the teacher itself gets: a student whose distribution equals the teacher's has,
    at every answer token, the top-k entropy -sum_k p_k * log p_k (p_k = exp(top-k
    log-probability)); this is its mean over the answer tokens. A student that copies the
    teacher reaches it; nothing trained toward the teacher is expected to go below it (the
    only lower value, by at most the log of the mass outside the top k, comes from a student
    that moves that mass into the top k)."""
    lp = data.topk_logprobs.to(torch.float64)
    if rows is not None:  # the targets are those of every row, in row order
        ends = data.target_mask.sum(1).cumsum(0).tolist()
        lp = torch.cat([lp[(ends[r - 1] if r else 0):ends[r]] for r in rows])
    return float(-(lp.exp() * lp).sum(-1).mean())


def quality_report(
    model: Any, trained: Params, init: Params, held_out: cartridges_core.TrainingData, batch_size: int = 4,
    parts: list[int] | None = None,
) -> dict[str, Any]:
    """The quality report (JSON-serializable) of cartridge `trained`, whose training started
    from `init`, on the held-out conversations `held_out`:

    - `held_out_conversations`: how many held-out conversations were scored;
    - `held_out_tokens`: their answer tokens (the figures below are means over them);
    - `loss`: the trained cartridge's mean distillation loss on them (`held_out_loss`);
    - `init_loss`: the same for the untrained initialization;
    - `teacher_floor`: the teacher's own loss (`teacher_floor`), the best to hope for;
    - `recovered`: (init_loss - loss) / (init_loss - teacher_floor), the share of the gap
      between the initialization and the teacher that training closed (1: as good as the
      document in context; 0: no better than the initialization; negative: worse); null when
      init_loss is not above teacher_floor (no gap to close);
    - `better_than_init`: loss < init_loss. False means training did not help on questions it
      did not see: more conversations (num_samples) usually do.
    - `by_part` (with `parts`, each held-out row's tenth of the corpus): per tenth, in order,
      the same figures on its own held-out conversations (`held_out_conversations`, `loss`,
      `init_loss`, `teacher_floor`, `recovered`), or null for a tenth none was drawn from. A
      part far below the others is a part of the corpus the cartridge did not learn.

    A figure that is not finite (a diverged cartridge) is null, and then better_than_init is false.
    """
    report = {
        "held_out_conversations": int(held_out.tokens.shape[0]),
        "held_out_tokens": int(held_out.topk_ids.shape[0]),
        **_figures(model, trained, init, held_out, batch_size, None),
    }
    report["better_than_init"] = (report["loss"] is not None and report["init_loss"] is not None
                                  and report["loss"] < report["init_loss"])
    if parts is not None:
        report["by_part"] = [None] * PARTS
        for p in range(PARTS):
            rows = [r for r, q in enumerate(parts) if q == p]
            if rows:
                report["by_part"][p] = {"held_out_conversations": len(rows),
                                        **_figures(model, trained, init, held_out, batch_size, rows)}
    return report


def _figures(model: Any, trained: Params, init: Params, data: cartridges_core.TrainingData, batch_size: int,
             rows: list[int] | None) -> dict[str, float | None]:
    """loss, init_loss, teacher_floor and recovered on `rows` of `data` (all by default)."""
    loss = _finite(held_out_loss(model, trained, data, batch_size, rows))
    init_loss = _finite(held_out_loss(model, init, data, batch_size, rows))
    floor = _finite(teacher_floor(data, rows))
    recovered = None
    if None not in (loss, init_loss, floor) and init_loss - floor > 0:
        recovered = _finite((init_loss - loss) / (init_loss - floor))
    return {"loss": loss, "init_loss": init_loss, "teacher_floor": floor, "recovered": recovered}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def describe(report: dict[str, Any]) -> list[str]:
    """The report as lines for a terminal: the figures, then a WARNING when the cartridge is no
    better than its initialization."""
    def num(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    recovered = report.get("recovered")
    share = f"{recovered:.0%} of the gap to the teacher recovered" if recovered is not None else "gap recovered: n/a"
    lines = [
        f"quality on {report['held_out_conversations']} held-out conversations: loss {num(report['loss'])} "
        f"(untrained {num(report['init_loss'])}, teacher {num(report['teacher_floor'])}); {share}"
    ]
    if report.get("by_part"):
        lines.append("gap recovered by tenth of the corpus: " + " ".join(
            "n/a" if part is None or part["recovered"] is None else f"{part['recovered']:.0%}"
            for part in report["by_part"]))
    if not report.get("better_than_init"):
        lines.append(
            "WARNING: the cartridge is no better than its untrained initialization on held-out questions; "
            "train on more conversations (--num-samples) or for more epochs (--epochs)."
        )
    return lines
