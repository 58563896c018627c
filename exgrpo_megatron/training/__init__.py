"""The training loop: the trainer and what it is built from (components.py), the per-run state (run_state.py), the
rollout service (generation + grading, rollout_service.py), step metrics and observer hooks, held-out accuracy during
training, and generating ahead (async_generation/). docs/architecture.md."""
