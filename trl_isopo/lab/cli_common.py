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
