"""Which CPUs the kernels' thread pool should use.

Policy: on big.LITTLE boards (CPUs of unequal `cpu_capacity`, or failing that unequal
`cpufreq/cpuinfo_max_freq`) use only the biggest cores, one thread each, pinned (RK3588: the A76 cores
4-7). On uniform machines use every CPU this process may run on, unpinned. Every function takes the sysfs
root so tests run on a fake tree.
"""
from __future__ import annotations

import os

SYSFS_CPU = "/sys/devices/system/cpu"


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,5,7-8' -> [0, 1, 2, 3, 5, 7, 8]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def online_cpus(root: str = SYSFS_CPU) -> list[int]:
    try:
        with open(os.path.join(root, "online")) as f:
            return parse_cpu_list(f.read())
    except (OSError, ValueError):
        pass
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(int(n[3:]) for n in names if n.startswith("cpu") and n[3:].isdigit())


def cpu_scores(root: str, cpus: list[int]) -> dict[int, int] | None:
    """Relative core size per CPU: cpu_capacity if every CPU has one, else cpuinfo_max_freq, else None."""
    for rel in ("cpu_capacity", os.path.join("cpufreq", "cpuinfo_max_freq")):
        scores = {c: _read_int(os.path.join(root, f"cpu{c}", rel)) for c in cpus}
        if cpus and all(v is not None for v in scores.values()):
            return scores  # type: ignore[return-value]
    return None


def big_cores(root: str = SYSFS_CPU, allowed: set[int] | None = None) -> tuple[list[int], bool]:
    """(the biggest online cores among `allowed`, whether the machine is heterogeneous)."""
    cpus = online_cpus(root)
    if allowed is not None:
        cpus = [c for c in cpus if c in allowed] or sorted(allowed)
    scores = cpu_scores(root, cpus)
    if not scores or len(set(scores.values())) == 1:
        return cpus, False
    top = max(scores.values())
    return [c for c in cpus if scores[c] == top], True


def thread_plan(root: str = SYSFS_CPU, allowed: set[int] | None = None) -> tuple[int, list[int] | None]:
    """(thread count, CPUs to pin to or None). `allowed` defaults to this process's affinity mask."""
    if allowed is None and hasattr(os, "sched_getaffinity"):
        allowed = set(os.sched_getaffinity(0))
    cores, hetero = big_cores(root, allowed)
    if hetero:
        return len(cores), cores
    n = len(allowed) if allowed else (len(cores) or os.cpu_count() or 1)
    return n, None


def threads_plan_for(n: int | None, root: str = SYSFS_CPU, allowed: set[int] | None = None
                     ) -> tuple[int, list[int] | None]:
    """The plan for an explicit thread count (`--threads N`; None -> thread_plan). On big.LITTLE boards
    threads are pinned biggest cores first (N beyond the big cores spills onto the next biggest)."""
    if n is None:
        return thread_plan(root, allowed)
    n = max(1, int(n))
    if allowed is None and hasattr(os, "sched_getaffinity"):
        allowed = set(os.sched_getaffinity(0))
    cores, hetero = big_cores(root, allowed)
    if not hetero:
        return n, None
    cpus = online_cpus(root)
    if allowed is not None:
        cpus = [c for c in cpus if c in allowed]
    scores = cpu_scores(root, cpus) or {}
    order = sorted(cpus, key=lambda c: (-scores.get(c, 0), c))
    return n, order[:n] if n <= len(order) else order
