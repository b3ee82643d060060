"""Process setup shared by `trl-isopo demo` and `trl-isopo compare`: offline env, threads, quiet libraries."""

from __future__ import annotations

import warnings

from ..tiny import set_offline_env


def setup_process(threads: int | None) -> None:
    """Offline env vars (kept if already set), torch thread count, and no library progress bars or warnings."""
    set_offline_env()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    import torch
    import transformers
    import datasets

    if threads:
        torch.set_num_threads(threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def parse_seeds(text: str) -> list[int]:
    """"0,1,5" -> [0, 1, 5]; "0-3" -> [0, 1, 2, 3]; combinations like "0-2,7" work too."""
    seeds: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-")
            seeds.extend(range(int(lo), int(hi) + 1))
        else:
            seeds.append(int(part))
    return seeds


def make_progress(total: int, enabled: bool, desc: str):
    """A tqdm bar on stderr (or a no-op object) with `update`, `set_postfix_str` and `close`."""
    if enabled:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="ep", dynamic_ncols=True)

    class _Null:
        def update(self, n=1):
            pass

        def set_postfix_str(self, s):
            pass

        def close(self):
            pass

    return _Null()


_TICKS = None  # in a worker process: the queue its per-episode progress ticks go to


def _worker_init(threads, ticks) -> None:
    global _TICKS
    setup_process(threads)
    _TICKS = ticks


def _worker_run(job):
    from .runner import train_one

    method, seed, setting = job
    return train_one(method, seed, setting, on_episode=lambda _: _TICKS.put(1))


def run_jobs(jobs, threads: int | None, workers: int, bar):
    """Train (method, seed, Setting) jobs; yield ((method, seed, setting), result) as each finishes.

    workers <= 0: in this process, in order. workers >= 1: each run in a fresh process (forked from a server that has
    imported the libraries once), up to `workers` at a time, with `threads` torch threads each; results come in
    completion order. A fresh process per run makes every result independent of scheduling and of what ran before:
    in one long-lived process, a run can differ at float-rounding level from the same run in a fresh process after
    other runs trained there (observed for ISOPO after GRPO + REINFORCE runs), and these tasks amplify rounding.
    `bar` receives one update per trained episode either way.
    """
    jobs = list(jobs)
    if workers <= 0:
        from .runner import train_one

        for method, seed, setting in jobs:
            bar.set_postfix_str(f"{method} seed {seed}")
            yield (method, seed, setting), train_one(method, seed, setting, on_episode=lambda _: bar.update(1))
        return
    import multiprocessing as mp
    import threading
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["trl_isopo.lab.runner", "trl", "trl_isopo"])
    ticks = ctx.Queue()

    def drain():
        while ticks.get() is not None:
            bar.update(1)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx, initializer=_worker_init,
                                 initargs=(threads, ticks), max_tasks_per_child=1) as pool:
            futures = {pool.submit(_worker_run, job): job for job in jobs}
            for future in as_completed(futures):
                yield futures[future], future.result()
    finally:
        ticks.put(None)
        reader.join(timeout=5)
