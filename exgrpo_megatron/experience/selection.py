"""Which stored trajectory of a sampled question to replay (docs/exgrpo.md).

ExGRPO replays, per sampled question, the stored correct trajectory with the LOWEST mean token
entropy under the CURRENT policy ([P] §4.1, Alg. 1 l.11):
    H(o; pi_theta) = (1/|o|) sum_{t in response, EOS included} H_t,   H_t = -sum_v pi(v|.) log pi(v|.)

The pool cannot run the model, so it asks a `Scorer` for per-candidate statistics (the trainer
implements it with one batched forward of prompt + candidate) and applies the pure selection below.

Original-code bug (docs/exgrpo.md, LUFFY issue #57): `experience_helpers.compute_postcal_metrics`
(1) inverts the mask (`~(responses != pad)` selects pad positions), (2) reads entropies from the
left-padded prompt+response layout with a right-padded response mask, and (3) takes the mask from
`responses[i % 8]` of the last 8-row batch. The result is about the TOTAL response entropy (plus some
prompt entropies) over a constant, which favours short trajectories. This module computes the
documented quantity, the masked MEAN over response tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from exgrpo_megatron.experience.types import CandidateScores, Trajectory

SELECTION_METRICS = ("ent", "ppl", "random")
SELECT_MODES = ("argmin", "argmax")  # argmin: the paper's lowest score; argmax: Tab. 6 "highest entropy" ablation

# scorer(qids, candidates) -> one CandidateScores per question, each holding one value per candidate
# in the order given (see CandidateScores for what each metric needs).
Scorer = Callable[[list[int], list[list[Trajectory]]], list[CandidateScores]]


def masked_token_mean(values: torch.Tensor | np.ndarray, mask: torch.Tensor | np.ndarray) -> torch.Tensor:
    """sum_t mask_t * v_t / sum_t mask_t along the last dim; rows with an empty mask give NaN."""
    values_t = torch.as_tensor(values)
    mask_t = torch.as_tensor(mask).to(values_t.dtype)
    return (values_t * mask_t).sum(-1) / mask_t.sum(-1)


def mean_token_entropy(token_entropies: torch.Tensor | np.ndarray, mask: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Per-sequence mean token entropy over the response tokens (mask = 1 on response tokens incl. EOS).

    token_entropies [..., T]: H_t of the current policy at each position; mask [..., T]. Returns [...].
    """
    return masked_token_mean(token_entropies, mask)


def mean_token_nll(token_logprobs: torch.Tensor | np.ndarray, mask: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Per-sequence mean negative log-likelihood of the response tokens: -(1/|o|) sum_t log pi(o_t)."""
    return -masked_token_mean(token_logprobs, mask)


def select_trajectory_index(scores: CandidateScores | None, metric: str, num_candidates: int,
                            rng: np.random.Generator | None = None, mode: str = "argmin") -> int:
    """Index of the candidate to replay.

    ent: argmin mean_entropy; ppl: argmin exp(mean_nll) (= argmin mean_nll, exp is monotone);
    random: uniform (needs rng). mode="argmax" takes the highest score instead (the original's
    `exp_select_mode`). Ties go to the earliest (oldest) candidate; NaN (empty mask) never wins.
    """
    if mode not in SELECT_MODES:
        raise ValueError(f"unknown selection mode {mode!r}; expected one of {SELECT_MODES}")
    if num_candidates <= 0:
        raise ValueError("no candidates")
    if metric == "random":
        if rng is None:
            raise ValueError("metric 'random' needs an rng")
        return int(rng.integers(num_candidates))
    if num_candidates == 1:
        return 0
    if scores is None:
        raise ValueError(f"metric {metric!r} needs scores")
    if metric == "ent":
        values = scores.mean_entropy
    elif metric == "ppl":
        values = None if scores.mean_nll is None else np.exp(np.asarray(scores.mean_nll, dtype=np.float64))
    else:
        raise ValueError(f"unknown selection metric {metric!r}; expected one of {SELECTION_METRICS}")
    if values is None:
        raise ValueError(f"metric {metric!r}: the scorer did not return the needed field")
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if values.shape[0] != num_candidates:
        raise ValueError(f"scorer returned {values.shape[0]} scores for {num_candidates} candidates")
    if mode == "argmax":
        return int(np.where(np.isnan(values), -np.inf, values).argmax())
    return int(np.where(np.isnan(values), np.inf, values).argmin())


def choose_trajectories(qids: Sequence[int], candidates: Sequence[list[Trajectory]], metric: str,
                        scorer: Scorer | None, rng: np.random.Generator, mode: str = "argmin"
                        ) -> list[tuple[Trajectory, np.ndarray | None]]:
    """One (trajectory, current log-probs or None) per question. The questions with >= 2 candidates are sent to
    the scorer in one call -- made whenever the metric needs scores, even with no such question here: the scorer is
    a model pass, which under expert parallelism every rank joins (distributed/lockstep.py), so no rank may skip it on
    its own draw. With metric 'random' the scorer is not called. The log-probs are the scorer's `token_logprobs` of
    the chosen candidate (None when it was not scored or returned none).
    `mode`: argmin (lowest metric, the paper's rule) or argmax (the highest-entropy ablation)."""
    if metric not in SELECTION_METRICS:
        raise ValueError(f"unknown selection metric {metric!r}; expected one of {SELECTION_METRICS}")
    scored: dict[int, CandidateScores] = {}
    if metric != "random":
        multi = [i for i, c in enumerate(candidates) if len(c) > 1]
        if scorer is None:
            if multi:
                raise ValueError(f"metric {metric!r} needs a scorer")
        else:
            results = scorer([qids[i] for i in multi], [candidates[i] for i in multi])
            if len(results) != len(multi):
                raise ValueError(f"scorer returned {len(results)} results for {len(multi)} questions")
            scored = dict(zip(multi, results, strict=True))
    out = []
    for i, c in enumerate(candidates):
        j = select_trajectory_index(scored.get(i), metric, len(c), rng, mode)
        lps = scored[i].token_logprobs if i in scored else None
        out.append((c[j], None if lps is None else lps[j]))
    return out
