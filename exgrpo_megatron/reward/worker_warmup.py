"""Warm-up of Math-Verify for grader workers, and their lifetime.

The first ``parse``/``verify`` of a process costs ~0.2 s (lazy imports, parser construction). The
``GraderPool`` fork server imports this module (``set_forkserver_preload``), which runs the warm-up
once, so every worker forked from it starts warm; each worker also calls ``scoring.warm_up_math_verify``
before reporting ready (a no-op cost when already warm, the real warm-up under ``spawn``). Importing it also
makes the server and every worker it forks die with their trainer (below).
"""

from __future__ import annotations

import threading

from exgrpo_megatron.distributed.lifetime import die_with_parent, install_fork_hooks
from exgrpo_megatron.reward.grader_worker import ignore_preemption_signals
from exgrpo_megatron.reward.scoring import warm_up_math_verify

if threading.current_thread() is threading.main_thread():  # importing it in a fork server warms the server
    ignore_preemption_signals()  # only the fork server and workers import this module
    # The server exits when its starter's end of its pipe closes, and also polls for its parent (the thread that
    # started it may not be the main one, so no kernel signal); every worker it forks is killed by the kernel when
    # the server ends, even one busy with an answer or stopped. No grader process outlives the trainer.
    die_with_parent(kernel=False)
    install_fork_hooks()
    warm_up_math_verify()
