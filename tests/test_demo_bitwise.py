"""ExGRPO and on-policy GRPO are bitwise unchanged by refactoring: a few steps of a tiny warm-started demo run
(ExGRPO with replays at DP=1 and DP=2, GRPO at DP=1) log exactly the metrics and end with exactly the weights
that the code before the algorithm protocol produced (commit a102ee4, recorded with
`python -m tests.helpers.demo_digest tests/fixtures/demo_digest_reference_<cpu>.json` on that commit).

Floats are exact only on one kind of CPU: the GEMM kernels round differently per vendor and instruction set (an
AMD EPYC with AVX512-BF16 and an Intel Xeon with AMX give different step-1 entropies from the same code), so the
reference is kept per CPU (`cpu_key`); on a CPU without one the test is skipped, naming the command that records it
on the reference code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.demo_digest import ARMS, digest_arms

FIXTURES = Path(__file__).parent / "fixtures"


def cpu_key() -> str:
    """The CPU's vendor and its widest matrix instruction set (what decides how fp32/bf16 GEMMs round here)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    vendor = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")),
                  "unknown")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    isa = "amx" if "amx_tile" in flags else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "base"
    return f"{vendor}_{isa}"


REFERENCE = FIXTURES / f"demo_digest_reference_{cpu_key()}.json"


@pytest.fixture(scope="module")
def digests(tmp_path_factory, sft_cache_dir) -> dict[str, dict]:
    if not REFERENCE.exists():
        pytest.skip(f"no digest reference for this CPU ({cpu_key()}): record one on the reference code with "
                    f"`python -m tests.helpers.demo_digest {REFERENCE.relative_to(FIXTURES.parent.parent)}`")
    return digest_arms(str(tmp_path_factory.mktemp("digest")), sft_cache_dir)


@pytest.mark.parametrize("arm", [name for name, _, _ in ARMS])
def test_metrics_and_weights_equal_the_reference_exactly(digests, arm):
    ref = json.loads(REFERENCE.read_text())[arm]
    got = digests[arm]
    assert len(got["metrics"]) == len(ref["metrics"])
    if arm.startswith("exgrpo"):  # the arm exercises replay
        assert sum(m["experience/n_replayed"] for m in ref["metrics"]) > 0
    for step, (g, r) in enumerate(zip(got["metrics"], ref["metrics"], strict=True), start=1):
        for key, value in r.items():  # today's metrics may add keys; the reference's must be equal
            if arm.startswith("grpo") and key.startswith("replay/"):  # an on-policy loss has no replay term: the
                assert value == 0.0 and key not in g, (arm, step, key)  # reference logged zeros, today none
                continue
            assert g[key] == value, (arm, step, key, g[key], value)
    assert got["weights"] == ref["weights"], arm
