"""The variants the ExGRPO-vs-GRPO grid runs (bench/exgrpo_vs_grpo.py): each is a list of config overrides on the
protocol's preset, never a code fork. The settings follow the paper and the sources named beside them, not an
outcome of this task."""

from __future__ import annotations

import functools

ARMS: dict[str, list[str]] = {"exgrpo": [], "grpo": ["algo.name=grpo"]}
# The paper's Tab. 6 / Tab. 3 ablations (ExGRPO arm, rho = 0.5 is the full method).
ABLATIONS: dict[str, list[str]] = {
    "no_question_selection": ["experience.bucket_manager=uniform"],
    "random_trajectory": ["experience.metric=random"],
    "highest_entropy_trajectory": ["experience.select_mode=argmax"],
    "no_policy_shaping": ["algo.settings.policy_shaping=false"],
    "no_is_correction": ["algo.settings.replay_is_correction=false"],
    "rho_0.25": ["experience.ratio=0.25"],
    "rho_0.75": ["experience.ratio=0.75"],
    "sigma_0.5": ["experience.bucket_sigma=0.5"],  # Tab. 3: narrower bucket weights (count units, as the code)
    "sigma_1.5": ["experience.bucket_sigma=1.5"],  # Tab. 3: closer to uniform
    "mu_0.25": ["experience.bucket_mu=0.25"],  # Tab. 3: centred on harder questions (k = K/4)
}
# Paper Tab. 5 / Fig. 4 (Llama-3.1-8B base): a weak start, delayed start off as the paper runs it for Llama.
WEAK_START_OVERRIDES = ["trainer.sft_warm_start_steps=150", "experience.delayed_start_pass_rate=0"]
WEAK_START: dict[str, list[str]] = {f"weak_{arm}": [*ov, *WEAK_START_OVERRIDES] for arm, ov in
                                    (("exgrpo", []), ("grpo", ["algo.name=grpo"]))}
# Beyond the paper: the recipes the literature and the ExGRPO authors now use, each at the rate the sweep chose for
# its algorithm, on --seeds. Their settings follow the sources, not this task's outcome:
# * append: replayed questions on top of the B fresh ones, not in their place (rollout-level replay gains only when
#   appended, arXiv 2606.04560); rho 0.5 (the paper's) and 0.25 (the authors' current);
# * su01: the authors' Megatron port (arXiv 2605.13301; conf/exgrpo_su01.yaml): rho 0.25, enter at exactly 1 of 8,
#   retire above 4 of 8, replayed tokens by truncated IS against their recorded log-probs (cap 2, the cap of Yao et
#   al. 2025, slime's --tis-clip default and verl's rollout correction), no policy shaping;
# * exgrpo_age_200: the paper's recipe with an age bound (prioritised replay without one degrades, FreshPER arXiv
#   2604.16918): 200 steps, the length of the authors' own ExGRPO stage in SU-01 (the oldest trajectory their current
#   recipe can replay); this protocol's steps are the paper's (720 ~ 700, 2 updates each);
# * grpo_b12 / grpo_b10: on-policy GRPO generating what append does per mixed step (B = 8: append rho 0.5 generates
#   8 x 8 + 4 x 7 = 92 trajectories, GRPO at B = 12 96; rho 0.25: 78, GRPO at B = 10 80), 2 updates per step;
# * grpo_same_code / exgrpo_same_code: the two arms again at this code version (their records above were made at an
#   earlier one; one code version per comparison), the baselines the analysis pairs the recipes with;
# * weak_<recipe>: each replay recipe and the same-code baselines from the weak start (WEAK_START_OVERRIDES).
TIS_REPLAY = ["algo.settings.policy_shaping=false", "algo.settings.replay_tis_cap=2"]
RECIPES: dict[str, list[str]] = {
    "append_rho_0.5": ["experience.placement=append", "experience.ratio=0.5"],
    "append_rho_0.25": ["experience.placement=append", "experience.ratio=0.25"],
    "su01": ["experience=su01", *TIS_REPLAY],
    "exgrpo_age_200": ["experience.max_age_steps=200"],
    "grpo_b12": ["algo.name=grpo", "trainer.train_batch_size=12", "trainer.ppo_mini_batch_size=6"],
    "grpo_b10": ["algo.name=grpo", "trainer.train_batch_size=10", "trainer.ppo_mini_batch_size=5"],
    **{f"{arm}_same_code": ov for arm, ov in ARMS.items()},
}
# the on-policy arm generating as much per step as each append recipe (the analysis pairs them)
MATCHED_GRPO = {"append_rho_0.5": "grpo_b12", "append_rho_0.25": "grpo_b10"}
# Beyond the paper: ExGRPO with its fresh tokens clipped in the mixed phase as the GRPO arm's are
# throughout, at GRPO's best rate and the stability rate, where unclipped ExGRPO falls behind.
DIAGNOSES: dict[str, list[str]] = {"exgrpo_mixed_clip": ["algo.settings.mixed_phase_clip=true"]}
WEAK_RECIPES: dict[str, list[str]] = {f"weak_{name}": [*ov, *WEAK_START_OVERRIDES] for name, ov in RECIPES.items()
                                      if not name.startswith("grpo_b")}
# The data-scarce regime (conf/scarce_<n>_cpu.yaml; docs/results.md, "Pre-registered: replay that costs no
# generation, with few questions and many epochs"): a fixed set of n questions over many epochs, every arm at GRPO's
# validated rate of the paper regime (not swept per arm), both starts, the settings the sources use:
# * grpo_extra_pass: GRPO with one more update pass over the same rollouts (verl's ppo_epochs = 2), so that more
#   updates cannot pass for replay;
# * ingroup_replay (RePO: 8 fresh + 8 replayed): each fresh group gains up to r = 8 of its question's own stored
#   responses, failures too (the enlarged group's advantages need both), truncated IS cap 2 (as su01 above), stored
#   responses older than 3 epochs' steps dropped (3 x n / B: 96 steps for 256 questions, 384 for 1,024);
# * rescue_replay (AR3PO): an all-failed fresh group gains one stored success of its question, truncated IS cap 2;
# * exgrpo_append: the current recommendation (conf/exgrpo_append.yaml: the paper's recipe, replayed questions
#   appended, rho 0.25 -- RECIPES' append_rho_0.25).
SCARCE_SET_SIZES = (256, 1024)
SCARCE_LR = 2.5e-5
SCARCE_BATCH = 8  # the presets' trainer.train_batch_size


def scarce_arms(questions: int) -> dict[str, list[str]]:
    """The five arms' overrides on conf/scarce_<questions>_cpu.yaml."""
    stale_steps = 3 * questions // SCARCE_BATCH
    return {
        "grpo": ["algo.name=grpo"],
        "grpo_extra_pass": ["algo.name=grpo", "trainer.update_epochs=2"],
        "ingroup_replay": ["algo.name=ingroup_replay", "experience.ingroup_size=8", "experience.ingroup_failures=true",
                           f"experience.max_age_steps={stale_steps}", "algo.settings.replay_tis_cap=2"],
        "rescue_replay": ["algo.name=rescue_replay", "algo.settings.replay_tis_cap=2"],
        "exgrpo_append": RECIPES["append_rho_0.25"],
    }


def scarce_variant(arm: str, questions: int, weak: bool) -> str:
    return f"{'weak_' if weak else ''}{arm}_q{questions}"


def scarce_config_name(variant: str) -> str:
    """The preset a data-scarce variant runs on (its set size is the name's `_q<n>` suffix)."""
    return f"scarce_{variant.rsplit('_q', 1)[1]}_cpu"


SCARCE: dict[str, list[str]] = {
    scarce_variant(arm, n, weak): [*ov, *(WEAK_START_OVERRIDES if weak else [])]
    for n in SCARCE_SET_SIZES for weak in (False, True) for arm, ov in scarce_arms(n).items()}


@functools.cache
def scarce_unavailable() -> dict[str, str]:
    """The data-scarce variants this code version cannot run (an arm's algorithm or keys not merged yet) -> why."""
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.config.validate import ConfigError, all_errors

    out = {}
    for name, overrides in SCARCE.items():
        try:  # what exgrpo-train checks before it builds anything else (exit 2)
            cfg = load_config(scarce_config_name(name), overrides)
            errors = all_errors(cfg, 1, check_paths=False)
            build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
        except ConfigError as err:
            errors = [str(err).splitlines()[-1].strip()]
        if errors:
            out[name] = errors[0]
    return out
