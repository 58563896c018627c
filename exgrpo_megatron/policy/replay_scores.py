"""The experience pool's scorer: candidate statistics under the CURRENT policy, one batched forward.

mean_entropy[j] = (1/|o_j|) sum_t H(pi_theta(.|q, o_j,<t)) over the response tokens of candidate j,
EOS included, at temperature 1 (paper section 4.1 / Alg. 1 l.11, "lowest-entropy trajectory");
mean_nll[j] = -(1/|o_j|) sum_t log pi_theta(o_j,t | q, o_j,<t) (the `ppl` option).
With `logprob_temperature` (the rollout temperature, which the loss uses), the same logits also give every
candidate's token log-probs at that temperature (`token_logprobs`): the chosen one's are its pi_old in this
step's loss, so a replayed row needs no second forward pass (policy/old_logprobs.py). The scorer runs before
any update of the step, so these are the weights pi_old is defined on.
"""

from __future__ import annotations

import numpy as np
import torch

from exgrpo_megatron.data.datasets import PromptDataset
from exgrpo_megatron.experience.selection import Scorer, mean_token_entropy, mean_token_nll
from exgrpo_megatron.experience.types import CandidateScores, Trajectory
from exgrpo_megatron.policy.policy import Policy
from exgrpo_megatron.policy.train_batch import token_stats

SELECTION_TEMPERATURE = 1.0  # the selection metrics are defined at T = 1 (the original's compute_log_prob_ents)


def make_scorer(policy: Policy, max_tokens: int, dataset: PromptDataset,
                logprob_temperature: float | None = None) -> Scorer:
    def scorer(qids: list[int], candidates: list[list[Trajectory]]) -> list[CandidateScores]:
        seqs, plens, owner = [], [], []
        for i, (q, cands) in enumerate(zip(qids, candidates, strict=True)):
            prompt = dataset[q].prompt_ids
            for traj in cands:
                seqs.append(list(prompt) + traj.token_ids.tolist())
                plens.append(len(prompt))
                owner.append(i)
        stats = token_stats(policy, seqs, plens, site="replay_scores", temperature=SELECTION_TEMPERATURE,
                            with_entropy=True, max_tokens=max_tokens, logprob_temperature=logprob_temperature)
        out_ent: list[list[float]] = [[] for _ in qids]
        out_nll: list[list[float]] = [[] for _ in qids]
        out_lp: list[list[np.ndarray]] = [[] for _ in qids]
        kept = stats.logprobs_at if stats.logprobs_at is not None else [None] * len(seqs)
        entropies = stats.entropy if stats.entropy is not None else []
        for i, lp, h, at in zip(owner, stats.logprobs, entropies, kept, strict=True):
            response = torch.ones_like(h, dtype=torch.float64)  # every scattered token is a response token
            out_ent[i].append(float(mean_token_entropy(h.double(), response)))
            out_nll[i].append(float(mean_token_nll(lp.double(), response)))
            if at is not None:
                out_lp[i].append(at.float().cpu().numpy())
        keep = logprob_temperature is not None
        return [CandidateScores(np.array(e), np.array(n), lp if keep else None)
                for e, n, lp in zip(out_ent, out_nll, out_lp, strict=True)]

    return scorer
