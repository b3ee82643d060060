"""Per-step process counters for the step-time benchmarks: wall and CPU time (user / system), page faults, context
switches, time in Python's garbage collector, and, where Linux exposes them, the time the process's threads waited for a
CPU while runnable, the machine's steal time and its free page reporting to a hypervisor. A step that is slow for a
reason outside the method shows up here: system time and faults (memory handed back to the OS and faulted in again),
run-queue wait or steal (other work on the CPUs), gc time."""

from __future__ import annotations

import gc
import os
import resource
import time

__all__ = ["COUNTERS", "Meter"]

COUNTERS = ("wall_s", "cpu_s", "user_s", "sys_s", "minflt", "majflt", "nvcsw", "nivcsw", "gc_s", "runq_wait_s",
            "steal_s", "reported_kib")
# Machine-wide KiB of free memory a guest kernel has handed back to its hypervisor (free page reporting), where exposed.
PAGE_REPORTING = "/sys/module/page_reporting/parameters/reported_kib"


class Meter:
    """Process counters (wall, CPU user/system, page faults, context switches), the time spent in Python's gc and the
    machine's free page reporting (`PAGE_REPORTING`, 0 where absent)."""

    def __init__(self):
        self.gc_s, self._gc_t0 = 0.0, None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase, info):
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.gc_s += time.perf_counter() - self._gc_t0

    def close(self):
        gc.callbacks.remove(self._on_gc)

    def read(self):
        r = resource.getrusage(resource.RUSAGE_SELF)
        return {"wall_s": time.perf_counter(), "cpu_s": r.ru_utime + r.ru_stime, "user_s": r.ru_utime,
                "sys_s": r.ru_stime, "minflt": r.ru_minflt, "majflt": r.ru_majflt, "nvcsw": r.ru_nvcsw,
                "nivcsw": r.ru_nivcsw, "gc_s": self.gc_s, **_linux_counters()}

    def since(self, begin):
        """Counter differences since `begin`, plus the peak RSS and glibc heap size so far (MiB)."""
        from trl_isopo.cpu_alloc import malloc_stats

        end = self.read()
        heap = malloc_stats()
        diff = {k: end[k] - begin[k] for k in COUNTERS if k != "runq_wait_s"}
        # threads alive at the end (a thread that exited meanwhile takes its wait with it; a new one started at 0)
        diff["runq_wait_s"] = sum(w - begin["runq_wait_s"].get(t, 0.0) for t, w in end["runq_wait_s"].items())
        return diff | {
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "heap_mib": None if heap is None else (heap.heap + heap.mmapped) / 2**20}


def _linux_counters():
    """Where Linux exposes them (else 0): per thread, the time it spent runnable but waiting for a CPU (contention with
    other work); the machine's steal time (a hypervisor running other guests on its CPUs) and `PAGE_REPORTING`."""
    out = {"runq_wait_s": {}, "steal_s": 0.0, "reported_kib": 0}
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out["runq_wait_s"][tid] = int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            pass  # a thread that just exited, or a kernel without schedstats
    try:
        with open("/proc/stat") as f:
            out["steal_s"] = int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
        with open(PAGE_REPORTING) as f:
            out["reported_kib"] = int(f.read())
    except (OSError, ValueError, IndexError):
        pass
    return out
