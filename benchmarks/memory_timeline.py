"""Where the main job's memory goes: resident memory (and CUDA memory on a GPU) sampled through one `trl-isopo real`
run and tagged by phase.

The run is exactly `trl-isopo real <args>` (`trl_isopo.scripts.real.main`, in this process), with the methods of the
training loop wrapped so that a stack of phase names says what the process is doing:

    load / setup       everything outside the phases below (imports, model conversion and load, trainer build)
    step (rest)        `training_step` outside its nested phases (what outlives the backward until the step returns)
    generation         `_generate_and_score_completions` (sampling, rewards, advantages) minus its nested phases
    rollout log-probs  TRL's `_get_per_token_logps_and_entropies` inside generation (pi_old / reference; TPO's p_old)
    loss forward       `compute_loss` (the method's loss forward, TPO's group softmax and target q)
    backward           `Accelerator.backward` (ISOPO's / PROMA's per-layer work runs in its hooks)
    optimizer          `AcceleratedOptimizer.step`
    evaluation         the held-out accuracy (`held_out_accuracy`) and the KL probe (`sequence_kl`)

A thread reads the process's resident set (`/proc/self/statm`) every `--interval` seconds, and every phase entry and
exit reads it too, so a phase shorter than the interval still shows its level at both ends. Per phase it prints the
peak resident memory seen while it was the innermost phase, the largest rise over the level at which it was entered
and the largest live heap (glibc's `mallinfo2`, read with every sample: bytes in use, without the free memory malloc
holds); the process's peak is `ru_maxrss`. On CUDA, every phase transition reads `torch.cuda.max_memory_allocated`
into the phase that ends and resets it, so each phase's CUDA peak is exact.

With `--malloc cached` (the job's default on CPU) glibc keeps freed memory, so resident memory only grows and a phase's
rise shows where the peak is first reached; `--malloc system` gives memory back and shows each phase's own rise.

    python benchmarks/memory_timeline.py -- --method grpo --steps 2 --eval-size 16 --malloc system
    python benchmarks/memory_timeline.py --json /tmp/t.json -- --method isopo --micro-batch 32 --steps 2
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import threading
import time

from trl_isopo.cpu_alloc import malloc_stats

PHASES = ("load / setup", "step (rest)", "generation", "rollout log-probs", "loss forward", "backward", "optimizer",
          "evaluation")
GIB = 1024**3


def rss_bytes() -> int:
    """This process's resident set size now (Linux `/proc/self/statm`; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def rss_parts() -> dict:
    """Resident memory by kind now (`/proc/self/status`: anonymous, file-backed, shared; bytes) and glibc's heap."""
    parts = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon", "RssFile", "RssShmem")):
                    key, value = line.split(":")
                    parts[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    stats = malloc_stats()
    if stats is not None:
        parts.update(heap=stats.heap, heap_in_use=stats.in_use, heap_free=stats.free, mmapped=stats.mmapped)
    return parts


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (`ru_maxrss`: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PhaseMemory:
    """A stack of phase names and, per phase, its seconds, entries, peak resident memory and largest rise over the
    level it was entered at (and CUDA peaks when `cuda`). `enter`/`exit` are called from the training thread; the
    sampler thread only calls `sample`."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self.lock = threading.Lock()
        self.stack: list[tuple[str, int, float]] = [(PHASES[0], rss_bytes(), time.perf_counter())]
        self.stats = {name: {"seconds": 0.0, "entries": 0, "peak_rss": 0, "max_rise": 0, "peak_heap": 0,
                             "cuda_peak": 0} for name in PHASES}
        self.samples: list[tuple[float, int, str]] = []
        self.row_tokens: list[int] = []  # padded prompt + completion length of every loss forward's micro-batch
        self.t0 = time.perf_counter()
        self.stats[PHASES[0]]["entries"] = 1

    def sample(self) -> None:
        rss, heap = rss_bytes(), malloc_stats()
        with self.lock:
            name, entry_rss, _ = self.stack[-1]
            s = self.stats[name]
            s["peak_rss"] = max(s["peak_rss"], rss)
            if heap is not None:
                s["peak_heap"] = max(s["peak_heap"], heap.in_use)
            s["max_rise"] = max(s["max_rise"], rss - entry_rss)
            self.samples.append((time.perf_counter() - self.t0, rss, name))

    def _close(self) -> None:
        """On CUDA, at a transition: the peak since the last transition into the innermost phase, then reset."""
        if self.cuda:
            import torch

            s = self.stats[self.stack[-1][0]]
            s["cuda_peak"] = max(s["cuda_peak"], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def enter(self, name: str) -> None:
        self.sample()
        self._close()
        now = time.perf_counter()
        with self.lock:
            outer, entry_rss, since = self.stack[-1]
            self.stats[outer]["seconds"] += now - since
            self.stack[-1] = (outer, entry_rss, now)
            self.stack.append((name, rss_bytes(), now))
            self.stats[name]["entries"] += 1

    def exit(self) -> None:
        self.sample()
        self._close()
        now = time.perf_counter()
        with self.lock:
            name, _, since = self.stack.pop()
            self.stats[name]["seconds"] += now - since
            outer, entry_rss, _ = self.stack[-1]
            self.stack[-1] = (outer, entry_rss, now)

    def finish(self) -> None:
        self.sample()
        self._close()
        with self.lock:
            name, _, since = self.stack[-1]
            self.stats[name]["seconds"] += time.perf_counter() - since

    def wrap(self, fn, name):
        """`fn` run as phase `name` (a nested call of the same phase stays one phase)."""

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if self.stack[-1][0] == name:  # e.g. a subclass's method calling its base's
                return fn(*args, **kwargs)
            self.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        return wrapped


def instrument(memory: PhaseMemory) -> None:
    """Wrap the training loop's methods (on every trainer class that defines them) and the job's evaluation."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from trl import GRPOTrainer

    import trl_isopo.real.evaluate as evaluate
    from trl_isopo.isopo.trainer import ISOPOTrainer
    from trl_isopo.proma.trainer import PROMATrainer
    from trl_isopo.tpo.trainer import TPOTrainer

    # every class on the trainers' MROs that defines a method (mixins included); a nested call is one phase
    trainers = {cls for trainer in (ISOPOTrainer, PROMATrainer, TPOTrainer) for cls in trainer.__mro__}
    for attr, name in (("training_step", "step (rest)"), ("_generate_and_score_completions", "generation"),
                       ("compute_loss", "loss forward")):
        for cls in trainers:
            if attr in cls.__dict__:
                setattr(cls, attr, memory.wrap(cls.__dict__[attr], name))
    loss = GRPOTrainer.compute_loss  # wrapped above

    @functools.wraps(loss)
    def counted_loss(self, model, inputs, *args, **kwargs):
        if isinstance(inputs, dict) and "completion_ids" in inputs:
            memory.row_tokens.append(int(inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]))
        return loss(self, model, inputs, *args, **kwargs)

    GRPOTrainer.compute_loss = counted_loss
    logps = GRPOTrainer._get_per_token_logps_and_entropies

    @functools.wraps(logps)
    def tagged_logps(self, *args, **kwargs):
        # inside generation: TRL's pi_old / reference pass; inside compute_loss it stays the loss forward
        if memory.stack[-1][0] != "generation":
            return logps(self, *args, **kwargs)
        return memory.wrap(logps, "rollout log-probs")(self, *args, **kwargs)

    GRPOTrainer._get_per_token_logps_and_entropies = tagged_logps
    Accelerator.backward = memory.wrap(Accelerator.backward, "backward")
    AcceleratedOptimizer.step = memory.wrap(AcceleratedOptimizer.step, "optimizer")
    for attr in ("held_out_accuracy", "sequence_kl"):  # imported by the job at call time: the module's attribute
        setattr(evaluate, attr, memory.wrap(getattr(evaluate, attr), "evaluation"))


def run_job(real_args: list[str], interval: float) -> dict:
    """Run `trl-isopo real <real_args>` here under the phase sampler; return the phases and the peaks."""
    import torch

    from trl_isopo.scripts import real

    memory = PhaseMemory(cuda=torch.cuda.is_available())
    instrument(memory)
    done = threading.Event()

    def sampler():
        while not done.wait(interval):
            memory.sample()

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    try:
        rc = real.main(real_args)
    finally:
        done.set()
        thread.join()
        memory.finish()
    thin = memory.samples[:: max(1, len(memory.samples) // 4000)]
    return {"args": real_args, "rc": rc, "wall_seconds": time.perf_counter() - t0, "peak_rss": peak_rss_bytes(),
            "end": rss_parts(), "row_tokens": memory.row_tokens, "cuda": memory.cuda, "phases": memory.stats,
            "timeline": [(round(t, 3), rss, name) for t, rss, name in thin]}


def table(result: dict) -> str:
    peak = result["peak_rss"]
    cuda = result["cuda"]
    lines = [f"{'phase':<18} {'seconds':>8} {'entries':>7} {'peak RSS GiB':>12} {'max rise GiB':>12} "
             f"{'live heap GiB':>13}"
             + (f" {'CUDA peak GiB':>13}" if cuda else "")]
    for name in PHASES:
        s = result["phases"][name]
        if not s["entries"]:
            continue
        mark = " <- peak" if s["peak_rss"] >= 0.99 * peak else ""
        cuda_peak = f" {s['cuda_peak'] / GIB:>13.2f}" if cuda else ""
        lines.append(f"{name:<18} {s['seconds']:>8.1f} {s['entries']:>7} {s['peak_rss'] / GIB:>12.2f} "
                     f"{s['max_rise'] / GIB:>12.2f} {s['peak_heap'] / GIB:>13.2f}{cuda_peak}{mark}")
    tokens = sorted(result["row_tokens"])
    rows = f", rows of {tokens[len(tokens) // 2]} tokens (median padded prompt + completion)" if tokens else ""
    lines.append(f"process peak RSS (ru_maxrss) {peak / GIB:.2f} GiB, wall {result['wall_seconds']:.0f} s{rows}")
    if result["end"]:
        lines.append("at the end, GiB: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in result["end"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [--interval S] [--json PATH] -- <trl-isopo real arguments>")
    p.add_argument("--interval", type=float, default=0.05, help="seconds between resident-memory samples")
    p.add_argument("--json", help="also write the phases, peaks and the (thinned) timeline here")
    argv = sys.argv[1:] if argv is None else argv
    ours, real_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = p.parse_args(ours)
    if "--no-progress" not in real_args:
        real_args = [*real_args, "--no-progress"]
    result = run_job(real_args, args.interval)
    print("\nmemory by phase: trl-isopo real " + " ".join(real_args))
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return result["rc"]


if __name__ == "__main__":
    sys.exit(main())
