"""One torchrun worker of bench/ep_trials.py: exgrpo-train's own entry point (`exgrpo_megatron.train.main`), its
return code then written to EXIT_DIR/rank{RANK} (a rank killed by a signal writes nothing), and exited with.
torchrun reports no worker's exit code once it was itself signalled; this file does.

    torchrun --nproc_per_node 2 -m bench.ep_rank EXIT_DIR --config-name demo_moe_cpu OVERRIDES...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> None:
    exit_dir = Path(sys.argv[1])
    from exgrpo_megatron.train import main as train_main

    code: int | str = "raised"
    try:
        code = train_main(sys.argv[2:])
    finally:
        exit_dir.mkdir(parents=True, exist_ok=True)
        (exit_dir / f"rank{os.environ.get('RANK', '0')}").write_text(str(code))
    sys.exit(code)


if __name__ == "__main__":
    main()
