"""ExGRPO and on-policy GRPO are bitwise unchanged by refactoring: a few steps of a tiny warm-started demo run
(ExGRPO with replays at DP=1 and DP=2, GRPO at DP=1) log exactly the metrics and end with exactly the weights
that the code before the algorithm protocol produced (commit a102ee4, recorded with
`python -m tests.helpers.demo_digest tests/fixtures/demo_digest_reference.json` on that commit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.demo_digest import ARMS, digest_arms

REFERENCE = Path(__file__).parent / "fixtures" / "demo_digest_reference.json"


@pytest.fixture(scope="module")
def digests(tmp_path_factory) -> dict[str, dict]:
    return digest_arms(str(tmp_path_factory.mktemp("digest")))


@pytest.mark.parametrize("arm", [name for name, _, _ in ARMS])
def test_metrics_and_weights_equal_the_reference_exactly(digests, arm):
    ref = json.loads(REFERENCE.read_text())[arm]
    got = digests[arm]
    assert len(got["metrics"]) == len(ref["metrics"])
    if arm.startswith("exgrpo"):  # the arm exercises replay
        assert sum(m["experience/n_replayed"] for m in ref["metrics"]) > 0
    for step, (g, r) in enumerate(zip(got["metrics"], ref["metrics"], strict=True), start=1):
        for key, value in r.items():  # today's metrics may add keys; the reference's must be equal
            assert g[key] == value, (arm, step, key, g[key], value)
    assert got["weights"] == ref["weights"], arm
