"""CPU times of processes and threads, read from /proc (Linux): what `serve_overhead` measures
the server, its engine and the client with. Not an instrument itself."""

from __future__ import annotations

import os
import resource
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def spawned_children(pid: int) -> list[int]:
    """Pids of `pid`'s children started by multiprocessing's spawn (the server's engine
    process)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"spawn_main" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def process_cpu_s(pids: list[int]) -> float:
    """CPU seconds of every thread of these processes."""
    return sum(sum(thread_cpu_s(pid).values()) for pid in pids)


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process `pid`, by native thread id."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        times[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS_PER_S
    return times


def runqueue_wait_s(pid: int, tid: int) -> float:
    """Seconds thread `tid` of process `pid` has waited, runnable, for a CPU (schedstat)."""
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1]) / 1e9


def children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
