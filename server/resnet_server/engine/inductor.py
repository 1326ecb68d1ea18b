"""What the engine asks of inductor (``torch.compile``): compiling a model for static batch sizes, what its
cache gave, and the per-thread state its CUDA graphs need. Kept apart from the runner, which only chooses when
to compile; everything here reaches into torch's compiler modules, imported only when compiling.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import NamedTuple, cast

import torch

# torch.compile's modes that record each static shape as a CUDA graph (recorded on the second call, replayed from
# the third).
REPLAYS_CUDA_GRAPHS = ("reduce-overhead", "max-autotune")


def compile_model(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """The model compiled by inductor for static shapes: one graph per batch size it is called with."""
    # Freezing folds the weights into the graph as constants (conv+batch-norm folding, prepacked
    # weights on the CPU), the most of compiling's gain there. It needs inference mode, which every call here
    # runs under.
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    # A module compiles to a module (OptimizedModule); torch.compile is typed for any callable.
    return cast(torch.nn.Module, torch.compile(model, mode=mode, dynamic=False))


def pin_cpu_threads(count: int) -> None:
    """CPU kernels compiled from now on run with ``count`` OpenMP threads, whichever thread compiles them. Left
    alone, inductor writes the compiling thread's own torch thread count into each kernel: a model compiled again
    for new weights on a one-thread background thread would serve every later batch on one core."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.threads = count


def cuda_graph_state_for_this_thread() -> None:
    """Inductor keeps its CUDA graph trees in thread-locals. Before torch 2.13 only the thread that imported
    the module (and autograd's threads) had them, and any other thread failed an assertion on its first
    compiled call (pytorch/pytorch#123177); replicas compile and run on worker threads of their own, so each
    sets its state up, as newer torch does by itself."""
    from torch._inductor import cudagraph_trees

    local = cudagraph_trees.local
    if hasattr(local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    local.tree_manager_containers = {}
    local.tree_manager_locks = collections.defaultdict(threading.Lock)


class CacheUse(NamedTuple):
    """Graphs inductor's FX graph cache gave (loaded), missed (compiled and stored) and could not hold (on the
    CPU, frozen graphs keep oneDNN's prepacked weights, which cannot be saved; the C++ kernels they call are
    still cached, as files by their source)."""

    loaded: int
    compiled: int
    uncacheable: int

    @classmethod
    def now(cls) -> CacheUse:
        """The process's counts so far."""
        from torch._dynamo.utils import counters

        inductor = counters["inductor"]
        return cls(inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"], inductor["fxgraph_cache_bypass"])

    def since(self, before: CacheUse) -> CacheUse:
        return CacheUse(*(now - then for now, then in zip(self, before, strict=True)))


def use_cache_dir(path: str) -> None:
    """Keep what inductor compiles under ``path`` (read as it compiles: one engine, so one runner, a process)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


def cache_dir() -> str:
    """Where inductor keeps what it compiles: ``use_cache_dir``'s folder, or its own default."""
    from torch._inductor.runtime.runtime_utils import cache_dir as inductor_cache_dir

    return inductor_cache_dir()


def allow_recompiles(shapes: int) -> None:
    """Each static batch size is one compiled graph: let dynamo keep them all (its default is 8)."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), shapes + 1))
