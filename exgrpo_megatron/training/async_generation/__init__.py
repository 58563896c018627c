"""Generating ahead of training (`rollout.max_staleness` > 0): the schedule and the in-flight state (schedule.py),
the generator process (generator.py) and the link between them (link.py). docs/async_generation.md."""
