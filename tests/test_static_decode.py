"""The static-shape decode step and the continuous loop over it (rollout/static_decode.py, continuous.py,
cuda_graph_step.py): device uniforms equal the host's bit for bit; continuous batching gives the chunked loop's
samples (fresh and replayed group sizes, left padding there, rows finishing at every step, stop ids / strings, any
stop-check interval); the compiled step compiles fullgraph once per bucket and never recompiles; a planted `.item()`
fails the compile; the loop and step are selected by config (CUDA graphs refused off CUDA)."""

from __future__ import annotations

import pytest
import torch

from exgrpo_megatron.rollout.sampling import row_seed, uniform
from exgrpo_megatron.rollout.static_decode import as_int64, bucket_for, decode_buckets, uniform_tensor
from exgrpo_megatron.rollout.types import SamplingParams
from tests.helpers.multirank import run_on_ranks
from tests.test_rollout import VOCAB, LetterTokenizer, _as_lists, _build

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [7], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 1]]
COUNTS = [3, 2, 3, 2, 3]  # fresh groups of 3, replayed groups of 2 (one slot taken by the pool's trajectory)
SEEDS = [40, 41, 42, 43, 44]


def _seeds() -> list[int]:
    edge = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
    return edge + [row_seed(s, r, j) for s in (0, 7) for r in (1, 99) for j in range(3)]


def test_device_uniforms_equal_the_host_formula_bit_for_bit():
    seeds = _seeds()
    steps = list(range(0, 40, 3)) + [1 << 20]
    pairs = [(s, t) for s in seeds for t in steps]
    seed_t = torch.tensor([as_int64(s) for s, _ in pairs])
    step_t = torch.tensor([t for _, t in pairs])
    expected = torch.tensor([uniform(s, t) for s, t in pairs], dtype=torch.float64)
    assert torch.equal(uniform_tensor(seed_t, step_t), expected)


def test_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(4) == [1, 2, 4]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert [bucket_for(r, decode_buckets(6)) for r in range(1, 7)] == [1, 2, 4, 4, 6, 6]


def _engine(model, **kw):
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine

    return MegatronRolloutEngine(model, LetterTokenizer(), vocab_size=VOCAB, max_batch_sequences=4, **kw)


CASES = {
    "plain": SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3),
    "greedy": SamplingParams(max_new_tokens=6, temperature=0.0, seed=3),
    "top_k": SamplingParams(max_new_tokens=7, temperature=1.0, top_k=5, seed=5),
    "one_token": SamplingParams(max_new_tokens=1, seed=5),
}


def equality_checks() -> dict:
    """Chunked vs continuous (eager) samples, every case; stops derived so rows end at every step."""
    model = _build(1, 1)
    chunked, out = _engine(model), {}
    free = chunked.generate(PROMPTS, COUNTS, CASES["plain"], request_seeds=SEEDS)
    # stop ids: the tokens that end rows at steps 0..11 of the free run (each is the row's first stop)
    stop_ids = sorted({g[j].response_ids[(i * 3 + j) % 12] for i, g in enumerate(free) for j in range(len(g))})
    cases = {**CASES, "stop_ids": SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3,
                                                 stop_token_ids=stop_ids[:6]),
             "stop_strings": SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3,
                                            stop_strings=[LetterTokenizer().decode(free[2][0].response_ids[3:5]),
                                                          "q"])}
    for every in (1, 3):
        continuous = _engine(model, decode_loop="continuous", stop_check_every=every)
        for name, params in cases.items():
            out[f"{name}/{every}"] = (_as_lists(chunked.generate(PROMPTS, COUNTS, params, request_seeds=SEEDS)),
                                      _as_lists(continuous.generate(PROMPTS, COUNTS, params, request_seeds=SEEDS)))
        out[f"buffers_reused/{every}"] = continuous.continuous.slots is not None
    reported: list[int] = []
    _engine(model, decode_loop="continuous").generate(PROMPTS, COUNTS, CASES["plain"], request_seeds=SEEDS,
                                                      on_prompts_done=lambda done, groups: reported.extend(done))
    out["reported"] = reported
    return out


@pytest.fixture(scope="module")
def equality():
    return run_on_ranks(equality_checks, world_size=1)[0]


def _same(chunked, continuous, tol=1e-5):
    assert [[(s[0], s[2]) for s in g] for g in chunked] == [[(s[0], s[2]) for s in g] for g in continuous]
    for g_a, g_b in zip(chunked, continuous, strict=True):
        for a, b in zip(g_a, g_b, strict=True):
            assert max((abs(x - y) for x, y in zip(a[1], b[1], strict=True)), default=0.0) < tol


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("case", [*CASES, "stop_ids", "stop_strings"])
def test_continuous_batching_gives_the_chunked_loops_samples(equality, case, every):
    chunked, continuous = equality[f"{case}/{every}"]
    _same(chunked, continuous)
    assert [len(g) for g in continuous] == COUNTS


def test_stops_end_rows_at_every_step(equality):
    lengths = {len(s[0]) for g in equality["stop_ids/1"][1] for s in g}
    assert {s[2] for g in equality["stop_ids/1"][1] for s in g} >= {"stop", "length"}
    assert len(lengths) >= 6, lengths  # rows of 1..12 tokens: slots freed and refilled at many different steps
    assert {s[2] for g in equality["stop_strings/3"][1] for s in g} >= {"stop"}


def test_every_prompt_is_reported_once_when_its_samples_are_done(equality):
    assert sorted(equality["reported"]) == list(range(len(PROMPTS)))
    assert equality["buffers_reused/1"]


def compile_checks() -> dict:
    """The compiled step: fullgraph, once per bucket, no recompilation across calls, steps and buckets."""
    import torch._dynamo

    from exgrpo_megatron.rollout.decode_loop import continuous_settings

    model = _build(1, 1)
    out: dict = {}
    params = CASES["plain"]
    eager = _engine(model, decode_loop="continuous").generate(PROMPTS, COUNTS, params, request_seeds=SEEDS)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _engine(model, decode_loop="continuous", compile_decode=True, stop_check_every=2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = compiled.generate(PROMPTS, COUNTS, params, request_seeds=SEEDS)
        again = compiled.generate(PROMPTS[1:2], 2, params, request_seeds=SEEDS[1:2])  # 2 rows: bucket 2 too
    out["eager"], out["compiled"] = _as_lists(eager), _as_lists(first)
    out["again_eager"] = _as_lists(_engine(model, decode_loop="continuous").generate(
        PROMPTS[1:2], 2, params, request_seeds=SEEDS[1:2]))
    out["again"] = _as_lists(again)
    out["copies"] = sorted(b for b, _ in compiled.continuous.step.copies)
    out["unique_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    out["compile_seconds"] = compiled.continuous.step.compile_seconds
    out["mode"] = compiled.continuous.step.mode

    class ReadsAScalar(torch.nn.Module):  # a planted host read: x * (x.sum().item() != 0)
        def __init__(self, norm) -> None:
            super().__init__()
            self.norm = norm

        def forward(self, x):
            return self.norm(x) * float(x.sum().item() != 0.0)

    model.decoder.final_layernorm = ReadsAScalar(model.decoder.final_layernorm)
    try:
        _engine(model, decode_loop="continuous", compile_decode=True).generate(PROMPTS[:1], 1, params)
        out["planted_item"] = "compiled"
    except Exception as exc:  # noqa: BLE001 - the backend's HostReadInStep as torch.compile raises it
        out["planted_item"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    settings = {}
    for name, kw in {"cpu_default": {}, "auto": {"decode_loop": "auto"}, "compile": {"compile_decode": True},
                     "graphs_true": {"cuda_graphs": "true"}, "graphs_off": {"cuda_graphs": "false"},
                     "megatron_impl": {"decode_impl": "megatron"}}.items():
        args = {"decode_loop": "continuous", "compile_decode": False, "cuda_graphs": "auto", "decode_impl": "kv_cache"}
        try:
            settings[name] = continuous_settings(model, **{**args, **kw})
        except ValueError as exc:
            settings[name] = f"refused: {exc}"
    out["settings"] = settings
    return out


@pytest.fixture(scope="module")
def compiled():
    return run_on_ranks(compile_checks, world_size=1)[0]


def test_compiled_step_is_one_fullgraph_per_bucket_and_never_recompiles(compiled):
    assert compiled["mode"] == "compile"
    assert compiled["graph_breaks"] == 0
    assert compiled["copies"] == [1, 2, 4]  # 13 rows over 4 slots (4, then the tail's 1), then a 2-row call
    assert compiled["unique_graphs"] == len(compiled["copies"])  # the second call reused them (error_on_recompile)
    assert compiled["compile_seconds"] > 0
    _same(compiled["eager"], compiled["compiled"])
    _same(compiled["again_eager"], compiled["again"])


def test_a_planted_item_fails_the_fullgraph_compile(compiled):
    assert compiled["planted_item"] != "compiled"
    assert "HostReadInStep: the decode step calls item" in compiled["planted_item"], compiled["planted_item"]


def test_loop_and_step_are_selected_by_config(compiled):
    s = compiled["settings"]
    assert s["cpu_default"] == "eager" and s["graphs_off"] == "eager" and s["compile"] == "compile"
    assert s["auto"] is None  # auto on CPU: the chunked loop
    assert s["graphs_true"].startswith("refused") and "CUDA" in s["graphs_true"]
    assert s["megatron_impl"].startswith("refused") and "megatron" in s["megatron_impl"]
