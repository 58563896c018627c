"""A bench run's committed record (bench/exgrpo_vs_grpo.py): which files it keeps, how they are kept, and the code
version every launch of the run was at (provenance.json)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# train_probe.json / start_train_probe.json: the weak-start runs of the data-scarce protocol (per-question
# correct-of-8 on the training questions at the end and at the warm start)
RECORD_FILES = ("config.yaml", "metrics.jsonl", "provenance.json", "start_eval.json", "start_train_probe.json",
                "train_probe.json", "test_eval.json")


def keep_record(run_dir: str, record_dir: str) -> None:
    """A run's record files into `record_dir`, metrics.jsonl gzip-compressed (~10x smaller; fidelity_analysis reads
    either), test_eval.json last: its presence marks the record complete. `run_dir` may be a run's directory or
    another record (import_records: its metrics.jsonl.gz is copied as it is)."""
    os.makedirs(record_dir, exist_ok=True)
    for name in RECORD_FILES:
        src = os.path.join(run_dir, name)
        if name == "metrics.jsonl" and not os.path.isfile(src) and os.path.isfile(src + ".gz"):
            shutil.copyfile(src + ".gz", os.path.join(record_dir, name + ".gz"))  # `run_dir` is itself a record
            continue
        if not os.path.isfile(src):  # provenance/start_eval: newer records only
            continue
        if name == "metrics.jsonl":
            with open(src, "rb") as fin, gzip.GzipFile(os.path.join(record_dir, name + ".gz"), "wb", mtime=0) as out:
                shutil.copyfileobj(fin, out)
        else:
            shutil.copyfile(src, os.path.join(record_dir, name))



def code_version() -> str:
    """The commit the run's code is at, with '+dirty' when tracked files other than the bench's own outputs
    (bench/results/, which the analysis at the end of a grid rewrites) differ from it."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    return git("rev-parse", "HEAD") + ("+dirty" if changed else "")


def note_provenance(run_dir: str) -> None:
    """Append this launch's code version to the run's provenance (a resumed run lists every launch)."""
    path = os.path.join(run_dir, "provenance.json")
    prov: dict = {"launches": []}
    if os.path.isfile(path):
        with open(path) as fh:
            prov = json.load(fh)
    prov["launches"].append({"code_version": code_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                     time.gmtime())})
    with open(path, "w") as fh:
        json.dump(prov, fh, indent=1)


def import_records(src_root: str, dst_root: str) -> list[str]:
    """The finished records (test_eval.json present) under `src_root` missing from `dst_root`, kept there."""
    added = []
    for name in sorted(os.listdir(src_root)):
        src, dst = os.path.join(src_root, name), os.path.join(dst_root, name)
        finished = os.path.isfile(os.path.join(src, "test_eval.json"))
        if finished and not os.path.isfile(os.path.join(dst, "test_eval.json")):
            keep_record(src, dst)
            added.append(name)
    return added

