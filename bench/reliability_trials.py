"""Hostile-user scenarios for bench/fault_trials.py (`--scenarios`): each runs the tiny trainer of
tests/test_trainer_resume.py, reports what it expected and what it observed, and checks that nothing is lost
(the run ends bitwise equal to the uninterrupted reference: metrics, weights, Adam, scheduler, trainer state, pool).

two_launches     a second launch on the run dir while the first trains -> exit 2 naming the holder, written nothing;
                 the first finishes bitwise
disk_full        the run dir on a small tmpfs; another writer fills it while checkpoint 4 is written -> the save fails
                 naming the path and "no space left", no partial save left, checkpoint 2 intact; after freeing the
                 space the requeued run resumes from 2 and ends bitwise
corrupted_cache  the tokenised-prompt cache entry has a flipped byte -> named, rebuilt, the run ends bitwise
config_change    a run stopped after step 2 resumed with algo.name=grpo -> exit 2 naming algo.name, nothing written;
                 resumed with optim.lr x0.5 -> the logged lr is the new one; resumed unchanged -> bitwise
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.test_trainer_resume import N_STEPS, _overrides

RUN_TIMEOUT_S = 900
LR = 1e-3  # tests/test_trainer_resume.py's optim.lr


def _tree(run_dir: Path) -> list[str]:
    """Every path under the run dir except the launch logs (which the bench writes)."""
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if not p.name.endswith(".log"))


def _log(run_dir: Path, tag: str) -> str:
    return (run_dir / f"{tag}.log").read_text(errors="replace")


def _verdict(name: str, expected: str, observed: str, ok: bool, nothing_lost: tuple[bool, str], **extra) -> dict:
    return {"scenario": name, "expected": expected, "observed": observed, "as_expected": ok,
            "nothing_lost": nothing_lost[0], "detail": nothing_lost[1], **extra}


def two_launches(h, work: Path, data: str) -> dict:
    run_dir = _fresh(work / "two_launches")
    overrides = _overrides(data, N_STEPS)
    first = h.launch(run_dir, overrides, "first", ("--make-init", str(run_dir / "init")))
    lock = run_dir / "run.lock"
    while first.poll() is None and not (lock.exists() and lock.read_text().strip()):
        time.sleep(0.05)
    while first.poll() is None and not h.metrics(run_dir):
        time.sleep(0.05)  # the second launch comes while the first trains
    t0 = time.perf_counter()
    second = h.launch(run_dir, [*overrides, f"checkpoint.init_from={run_dir / 'init'}"], "second")
    code2 = h.reap(second, RUN_TIMEOUT_S)
    refused_s = time.perf_counter() - t0
    log2 = _log(run_dir, "second")
    code1 = h.reap(first, RUN_TIMEOUT_S)
    named = f"pid {first.pid}" in log2
    built_anything = "resumed from" in log2 or "saved checkpoint" in log2
    observed = (f"second launch exit {code2} after {refused_s:.1f} s, holder pid named: {named}; "
                f"built or saved anything: {built_anything}; first launch exit {code1}")
    lost = h.same_final_state(run_dir, work / "reference", run_dir) if code1 == 0 else (False, f"exit {code1}")
    return _verdict("two_launches", "second launch exits 2 naming the holder's pid; first exits 0", observed,
                    code2 == 2 and named and not built_anything and code1 == 0, lost,
                    second_refused_s=round(refused_s, 1))


def disk_full(h, work: Path, data: str) -> dict:
    run_dir = work / "disk_full"
    if run_dir.is_mount():
        subprocess.run(["umount", str(run_dir)], check=False)
    _fresh(run_dir)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(run_dir)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        return _verdict("disk_full", "-", f"skipped: cannot mount a tmpfs ({mounted.stderr.strip()})", False,
                        (False, "not run"))
    try:
        overrides = _overrides(data, N_STEPS)
        make_init = ("--make-init", str(run_dir / "init"))
        killed = h.launch(run_dir, overrides, "filled", (*make_init, "--fill-disk-in-save", "4"))
        code = h.reap(killed, RUN_TIMEOUT_S)
        log = _log(run_dir, "filled")
        message = next((line for line in log.splitlines() if "saving checkpoint" in line and "failed" in line), "")
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        (run_dir / "filler.bin").unlink(missing_ok=True)  # the user frees the space; the job is requeued
        resumed = h.launch(run_dir, overrides, "resumed", make_init)
        code2 = h.reap(resumed, RUN_TIMEOUT_S)
        found = re.search(r"resumed from \S+ at step (\d+)", _log(run_dir, "resumed"))
        lost = h.same_final_state(run_dir, work / "reference", run_dir) if code2 == 0 else (False, f"exit {code2}")
        observed = (f"exit {code}; message: {message.strip()[:400]}; checkpoints after: {ckpts}; requeued run exit "
                    f"{code2}, resumed from step {found.group(1) if found else None}")
        ok = (code == 1 and "no space left on device" in message and "checkpoints/.tmp_step_00000004" in message
              and ckpts == ["latest", "step_00000002"] and code2 == 0)
        return _verdict("disk_full", "exit 1 naming checkpoints/.tmp_step_00000004 and 'no space left on device'; "
                        "only step_00000002 (+ latest) left; the requeued run resumes from 2 and exits 0", observed,
                        ok, lost)
    finally:
        subprocess.run(["umount", str(run_dir)], check=False)


def corrupted_cache(h, work: Path, data: str) -> dict:
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.data.tokenizer import load_tokenizer
    from exgrpo_megatron.training.components import build_datasets

    run_dir = _fresh(work / "corrupted_cache")
    cache = run_dir / "token_cache"
    overrides = [*_overrides(data, N_STEPS), f"data.token_cache_dir={cache}"]
    cfg = load_config("demo_cpu", overrides)
    build_datasets(cfg, load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path))  # the entry a previous run left
    (entry,) = cache.glob("*.npz")
    raw = bytearray(entry.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    entry.write_bytes(bytes(raw))
    proc = h.launch(run_dir, overrides, "run", ("--make-init", str(run_dir / "init")))
    code = h.reap(proc, RUN_TIMEOUT_S)
    named = f"token cache entry {entry} is damaged" in _log(run_dir, "run")
    lost = h.same_final_state(run_dir, work / "reference", run_dir) if code == 0 else (False, f"exit {code}")
    return _verdict("corrupted_cache", "the damaged entry is named and rebuilt; exit 0",
                    f"exit {code}; damaged entry named and rebuilt: {named}", code == 0 and named, lost)


def config_change(h, work: Path, data: str) -> dict:
    run_dir = _fresh(work / "config_change")
    make_init = ("--make-init", str(run_dir / "init"))
    code0 = h.reap(h.launch(run_dir, _overrides(data, 2), "first_two_steps", make_init), RUN_TIMEOUT_S)
    before = _tree(run_dir)
    code_grpo = h.reap(h.launch(run_dir, [*_overrides(data, N_STEPS), "algo.name=grpo"], "grpo", make_init),
                       RUN_TIMEOUT_S)
    grpo_log = _log(run_dir, "grpo")
    grpo_named = "algo.name: checkpoint 'exgrpo' -> config 'grpo'" in grpo_log
    unchanged = _tree(run_dir) == before
    lr_dir = work / "config_change_lr"
    if lr_dir.exists():
        shutil.rmtree(lr_dir)
    shutil.copytree(run_dir, lr_dir)
    new_lr = LR / 2
    code_lr = h.reap(h.launch(lr_dir, [*_overrides(data, 3), f"optim.lr={new_lr}"], "lr", make_init), RUN_TIMEOUT_S)
    lr_logged = [r["lr"] for r in h.metrics(lr_dir) if r["step"] == 3]
    lr_line = f"optim.lr: {LR} -> {new_lr}" in _log(lr_dir, "lr")
    code_same = h.reap(h.launch(run_dir, _overrides(data, N_STEPS), "resumed", make_init), RUN_TIMEOUT_S)
    lost = h.same_final_state(run_dir, work / "reference", run_dir) if code_same == 0 else (False, f"exit {code_same}")
    observed = (f"2-step run exit {code0}; algo.name=grpo: exit {code_grpo}, key named: {grpo_named}, run dir "
                f"unchanged: {unchanged}; optim.lr={new_lr}: exit {code_lr}, change line: {lr_line}, step-3 lr "
                f"logged {lr_logged}; unchanged config: exit {code_same}")
    ok = (code0 == 0 and code_grpo == 2 and grpo_named and unchanged and code_lr == 0 and lr_line
          and lr_logged == [new_lr] and code_same == 0)
    return _verdict("config_change", f"algo.name=grpo refused with exit 2 naming the key, nothing written; "
                    f"optim.lr={new_lr} announced and logged as the step-3 lr; the unchanged resume exits 0",
                    observed, ok, lost, lr_logged_step3=lr_logged)


def _process_start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else int(fields[19])  # a zombie has died; starttime tells reused pids apart


def run_processes(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of `root` and every live process below it (the run's processes, followed across sessions:
    torchrun starts each worker in a session of its own)."""
    out: set[tuple[int, int]] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        start = _process_start(pid)
        if start is None:
            continue
        out.add((pid, start))
        for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            try:
                todo += [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
            except OSError:
                pass
    return out


def _session_members(sessions: set[int]) -> set[int]:
    """Live processes (zombies excluded) whose session is one of `sessions`."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                    fields = fh.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[3]) in sessions and fields[0] not in "ZX":
                out.add(int(entry))
    return out


def orphans_within(seen: set[tuple[int, int]], sessions: list[int], seconds: float) -> tuple[list[int], float]:
    """The processes of `seen` and of the `sessions` still alive `seconds` after the run's leader exited (or [] as
    soon as none is), and how long it took for the last one to go."""
    t0 = time.monotonic()
    while True:
        left = sorted({pid for pid, start in seen if _process_start(pid) == start} | _session_members(set(sessions)))
        if not left or time.monotonic() - t0 > seconds:
            return left, time.monotonic() - t0
        time.sleep(0.05)


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint `path` does not verify against its manifest (sizes and sha256 of every file), or None."""
    from exgrpo_megatron.checkpoint.integrity import digests_problem, read_root_manifest

    try:
        problem = digests_problem(path, read_root_manifest(path), "manifest", 0, 1)
    except Exception as err:  # noqa: BLE001 -- any failure to read it is the finding
        return f"{type(err).__name__}: {err}"
    return None if problem is None else f"{problem[0]}: {problem[1]}"


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


SCENARIOS: dict[str, Callable] = {"two_launches": two_launches, "disk_full": disk_full,
                                  "corrupted_cache": corrupted_cache, "config_change": config_change}


def run_scenarios(names: list[str], helpers, work: Path, data: str, table: dict[str, Callable] | None = None
                  ) -> list[dict]:
    """Run the scenarios `names` of `table` (default: this module's) one after another."""
    out = []
    for name in names:
        t0 = time.perf_counter()
        result = (table or SCENARIOS)[name](helpers, work, data)
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(result), flush=True)
        out.append(result)
    return out

