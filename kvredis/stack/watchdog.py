"""The watchdog a :class:`~kvredis.stack.supervisor.Supervisor` starts so that its children die with it.

Run as ``python -m kvredis.stack.watchdog GRACE_S`` with a pipe from the supervisor on its standard input, in
a session of its own (so a Ctrl-C in the terminal, or a kill of the supervisor's process group, does not
reach it). The supervisor writes ``+PGID`` for each process group it starts and ``-PGID`` once a group is
gone. The pipe's write end is held by the supervisor alone, so its end of file means the supervisor has
exited, however it died (SIGKILL included): the watchdog then sends SIGTERM to every group still listed,
SIGKILL to what is left after ``GRACE_S`` seconds, and exits. A whole group, not just its leader: vLLM's
engine core and workers are in their server's group.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterable, Sequence

from kvredis.stack.supervisor import group_alive, signal_group


def watch(lines: Iterable[bytes]) -> set[int]:
    """The process groups still listed when ``lines`` (``+PGID`` / ``-PGID``) end."""
    groups: set[int] = set()
    for line in lines:
        text = line.strip()
        if text[:1] == b"+" and text[1:].isdigit():
            groups.add(int(text[1:]))
        elif text[:1] == b"-" and text[1:].isdigit():
            groups.discard(int(text[1:]))
    return groups


def stop_groups(groups: Iterable[int], grace_s: float) -> list[int]:
    """SIGTERM to each group, SIGKILL after ``grace_s`` to those still running; the groups killed."""
    pending = [pgid for pgid in groups if group_alive(pgid)]
    for pgid in pending:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        pending = [pgid for pgid in pending if group_alive(pgid)]
    for pgid in pending:
        signal_group(pgid, signal.SIGKILL)
    return pending


def main(argv: Sequence[str] | None = None) -> int:
    """Watch standard input until it ends, then stop the groups still listed."""
    args = sys.argv[1:] if argv is None else list(argv)
    grace_s = float(args[0]) if args else 5.0
    # Only the end of the pipe ends the watch; SIGTERM still stops the watchdog itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop_groups(watch(sys.stdin.buffer), grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
