"""Stand-ins for the files and directories a GPU preset names, so its start-up validation and dry run run here."""

from __future__ import annotations

from pathlib import Path


def preset_inputs(tmp_path: Path) -> tuple[dict[str, str], list[str]]:
    """Stand-ins for the paths a GPU preset reads (validated at start-up; the dry run only lists them): an HF dir
    through EXGRPO_HF_DIR, and data files as overrides. Returns (env, overrides)."""
    hf = tmp_path / "hf_model"
    hf.mkdir(exist_ok=True)
    files = []
    for name in ("openr1.parquet", "valid.parquet"):
        (tmp_path / name).touch()
        files.append(str(tmp_path / name))
    return {"EXGRPO_HF_DIR": str(hf)}, [f"data.train_files=[{files[0]}]", f"data.val_files=[{files[1]}]"]
