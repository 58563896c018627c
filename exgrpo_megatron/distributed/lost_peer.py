"""A rank that dies mid-run shows up on the others as gloo's transport error ("Connection closed by peer",
"Connection reset by peer", a broken pipe) raised from whatever collective they were in, usually followed by a
second one from the clean-up's barrier. `lost_peer_message` turns such an exception into one line that says what
happened and what to do; train.main prints it instead of the traceback and exits 1.

Which rank died is not in gloo's message (it names a socket address, not a rank): in a world of two it is the other
one; otherwise the launcher's summary (torchrun) or the dead rank's own log (srun --label) names it.
"""

from __future__ import annotations

# what gloo's TCP transport says when the process at the other end of a pair is gone
_LOST_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _chain(exc: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and all(exc is not seen for seen in out):
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def lost_peer_message(exc: BaseException, rank: int, world_size: int) -> str | None:
    """The message for `exc` when it (or an exception it arose from) is gloo losing a peer process, else None."""
    for err in _chain(exc):
        text = str(err)
        marker = next((m for m in _LOST_PEER_MARKERS if m in text), None)
        if isinstance(err, RuntimeError) and "gloo" in text and marker is not None:
            detail = text[text.index(marker):].split(". ")[0]
            peer = f"rank {1 - rank}" if world_size == 2 else "another rank"
            return (f"exgrpo-train: rank {rank} lost its connection to {peer} ({detail}): that rank's process "
                    "died (a signal, the OOM killer, an error: its own log, or torchrun's failure summary, names the "
                    "rank and the reason). This rank stops too (exit 1). Fix what ended that rank, then relaunch: the "
                    "run resumes from its last checkpoint (checkpoint.resume=auto).")
    return None
