"""The forward pass on one device: the only code that touches the model after start-up.

On CUDA it uses pinned host staging, ``non_blocking`` copies both ways on a stream of its own, optional reduced
precision, and exactly one synchronisation per batch (when the results land in pinned CPU memory). On the CPU it
is a plain forward pass. On both, batch norms are folded into the convolutions before them, and the model runs
``channels_last`` unless told otherwise.

Every batch runs at a size warmed before the server reports SERVING (its *buckets*, ``bucket_sizes``): cuDNN
autotunes, inductor compiles and CUDA graphs record once per shape, and a shape first met while serving would
pay that on a user's batch. On CUDA a batch is padded with zero rows up to the next bucket (one launch; counted
in ``resnet_padded_images_total``); on the CPU, where a pass costs in proportion to its rows, it is split into
buckets instead. How batches run:

- ``cuda_graphs``: the model and the temperature softmax after it captured as one CUDA graph per bucket at
  warm-up (no compiler), so a batch is a copy in, one replay and the copy back: a handful of calls from Python,
  each a GIL round trip for the engine's one host thread, where an eager batch makes about 64;
- ``compiled``: ``torch.compile`` (inductor, weights frozen as constants) once per bucket, with static shapes;
  ``compile_mode="reduce-overhead"`` records each as a CUDA graph (``max-autotune`` too, after timing kernel
  choices); ``compile_cache`` is the folder where inductor keeps what it compiles for the next start;
- ``torchscript``: the model and softmax traced and frozen, a whole batch in C++ with the GIL released once;
- otherwise eager.

The figures behind each choice are in docs/performance.md.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch
from torch.nn.utils.fusion import fuse_conv_bn_eval

from resnet_server.common.device_decode import DeferredJpeg, decode_batch
from resnet_server.common.devices import to_device
from resnet_server.common.errors import InvalidInput
from resnet_server.common.postprocess import temperature_softmax
from resnet_server.common.preprocess import CroppedImage, RawImage, cropped_batch, raw_batch, whole_batch
from resnet_server.common.shapes import FLOAT_SHAPE
from resnet_server.common.work import ModelInput
from resnet_server.engine import inductor, onnx_runtime

Kind = TypeVar("Kind", DeferredJpeg, RawImage, CroppedImage)  # an input the runner converts a batch at a time

# Batches a CUDA batcher keeps launched and unanswered: one computing on the device, the next queued behind it.
CUDA_BATCHES_IN_FLIGHT = 2
# The dtype of each precision's inputs (int8: a quantized ONNX model, which takes float32 and quantizes inside).
PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.float32}


class ModelRunner:
    """Runs the batches of ``model``, or of ``network`` (a forward pass made elsewhere: an ONNX file's session) where
    there is no torch model."""

    def __init__(self, model: torch.nn.Module | None, device: torch.device, precision: str = "fp32",
                 channels_last: bool = True, compiled: bool = False, compile_mode: str = "default",
                 compile_cache: str | None = None, fold_batch_norms: bool = True, torchscript: bool = False,
                 cuda_graphs: bool = False, runtime: str = "torch", threads: int = 1,
                 network: onnx_runtime.OnnxNetwork | None = None, onnx_provider: str = "cpu") -> None:
        self.device = device
        # ``runtime`` onnxruntime: the model exported to ONNX and run by ONNX Runtime with ``threads`` intra-op
        # threads (resnet_server.engine.onnx_runtime) on ``onnx_provider``, on plain NCHW float32 batches.
        self.runtime, self.threads, self.onnx_provider = runtime, threads, onnx_provider
        self.runs_on = ""  # the runtime's own description, other than torch's
        channels_last = channels_last and runtime == "torch"
        self.precision = precision
        self.dtype = PRECISIONS[precision]
        self.cuda = device.type == "cuda"
        self.batches_in_flight = CUDA_BATCHES_IN_FLIGHT if self.cuda else 1  # see resnet_server.engine.batcher
        # Images a front-end preprocesses come as their uint8 crop, normalised here with the batch, on a GPU (a
        # quarter of the bytes through the slab, the host thread's copy and the upload; normalised on the device).
        # A CPU engine's thread runs the forward pass, the bound there: it takes the float input.
        self.takes_crops = self.cuda
        # channels_last speeds up convolutions on CUDA (tensor cores) and on the CPU too (oneDNN, eager; compiled,
        # inductor picks its own layouts): docs/performance.md, "Figures behind the code".
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.fold_batch_norms = fold_batch_norms  # off only to measure what it saves
        if model is not None:
            model = batch_norms_folded(model) if fold_batch_norms else model.eval()
            # Module.to takes memory_format (it converts 4-D parameters); torch's overloads leave it out.
            model = model.to(device=device, dtype=self.dtype, memory_format=self.memory_format)  # type: ignore[call-overload]
        self._model = model
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.compiled = compiled
        self.compile_mode = compile_mode if compiled else None
        if compiled and compile_cache:
            inductor.use_cache_dir(compile_cache)
        self.compile_cache = compile_cache
        self.graphs_cached = inductor.CacheUse(0, 0, 0)  # what warm_up's compiling found in inductor's cache
        self.torchscript = torchscript
        self.cuda_graphs = cuda_graphs and self.cuda
        self._graphs: dict[int, _CapturedBatch] = {}  # by bucket, captured by warm_up with cuda_graphs
        self._network: Callable[..., torch.Tensor] = self._graph() if network is None else self._runs_on(network)
        self.buckets: list[int] = []  # the batch sizes warmed up, filled by warm_up
        self.sizes_run: set[int] = set()  # every batch size the network has run since warm-up (tests check it)
        self._batch_buffer: torch.Tensor | None = None  # see _stack

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            raise RuntimeError("this runner runs a network with no torch model (an ONNX file's)")
        return self._model

    def _runs_on(self, network: onnx_runtime.OnnxNetwork) -> onnx_runtime.OnnxNetwork:
        self.runs_on = network.describe()
        return network

    @property
    def swaps_in_place(self) -> bool:
        """New weights can be copied into the tensors served now: eager and CUDA graphs (a captured graph reads
        them where they lie); a compiled or TorchScript network has the old ones frozen into its graph."""
        return not (self.compiled or self.torchscript or self.runtime != "torch")

    @torch.no_grad()
    def staged(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``model``'s tensors as this runner serves its own (folded, in its precision and memory format, on its
        device), by name: beside the served ones until ``load_staged``."""
        prepared = batch_norms_folded(model) if self.fold_batch_norms else model.eval()
        prepared = prepared.to(device=self.device, dtype=self.dtype, memory_format=self.memory_format)  # type: ignore[call-overload]  # as in __init__
        if self.cuda:  # made on this thread's stream: done before the runner's stream may read them
            torch.cuda.synchronize(self.device)
        return prepared.state_dict()

    @torch.no_grad()
    def load_staged(self, staged: dict[str, torch.Tensor]) -> None:
        """Copy staged tensors into the served ones, on the runner's stream: after every batch launched before."""
        with self._on_stream():
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(staged[name])
        if self.stream is not None:  # the staged tensors are freed next: the copies must have read them
            self.stream.synchronize()

    def describe(self) -> str:
        """How batches run, for the start-up log: '<device> runs fp16 as CUDA graphs at batch sizes 1, 2, ...'."""
        if self.cuda_graphs:
            how = "as CUDA graphs"
        elif self.runtime != "torch":
            how = self.runs_on
        elif self.compiled:
            how = f"compiled by inductor ({self.compile_mode})"
        else:
            how = "as a TorchScript graph" if self.torchscript else "eagerly"
        sizes = ", ".join(map(str, sorted(self._graphs) if self.cuda_graphs else self.buckets)) or \
            "any size (not warmed)"
        return f"{self.device} runs {self.precision} {how} at batch sizes {sizes}{self._cache_note()}"

    def _cache_note(self) -> str:
        if not (self.compiled and self.buckets):
            return ""
        loaded, compiled, uncacheable = self.graphs_cached
        return (f"; graphs from inductor's cache at {inductor.cache_dir()}: {loaded} loaded, {compiled} compiled, "
                f"{uncacheable} not cacheable (their kernels are)")

    def _graph(self) -> Callable[..., torch.Tensor]:
        """What runs the forward pass: the model itself, compiled, traced and frozen, or exported to ONNX."""
        if self.runtime == "onnxruntime":
            return self._runs_on(onnx_runtime.OnnxNetwork(onnx_runtime.exported(self.model, self.compile_cache),
                                                          self.threads, self.onnx_provider))
        if self.compile_mode is not None:  # compiled
            return inductor.compile_model(self.model, self.compile_mode)
        if self.torchscript:  # the softmax too: one call a batch
            example = torch.zeros((1, *FLOAT_SHAPE), dtype=self.dtype, device=self.device)
            temperatures = torch.ones(1, dtype=torch.float64, device=self.device)
            return _torchscript(_Scored(self.model), example.contiguous(memory_format=self.memory_format),
                                temperatures)
        return self.model

    @torch.inference_mode()
    def prepare(self, images: list[ModelInput]) -> tuple[torch.Tensor, dict[int, InvalidInput]]:
        """One batch's inputs as one tensor (on the device when anything was converted there), and the
        images that could not be decoded, by position in ``images``; those are left out of the tensor."""
        tensors = [image for image in images if isinstance(image, torch.Tensor)]
        if len(tensors) == len(images):
            return self._stack(tensors), {}
        with self._on_stream():
            batch = whole_batch(images, self.device)
            if batch is not None:
                return batch, {}
            converted = self._convert_deferred(images)
            errors = {i: result for i, result in converted.items() if isinstance(result, InvalidInput)}
            kept = [to_device(row, self.device) for i, image in enumerate(images)
                    if isinstance(row := converted.get(i, image), torch.Tensor)]  # all but the errors
            return (self._stack(kept) if kept else torch.empty((0, *FLOAT_SHAPE))), errors

    def _stack(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """The rows as one batch in the model's layout, one copy and no allocation the kernel sees: host rows
        for a GPU go into a fresh block of the caching pinned allocator (handed out again only once its upload
        is done), uploaded from as they are; otherwise into a buffer this runner keeps (a fresh batch-8 tensor
        is 4.8 MB, which glibc may hand back to the kernel after every batch and fault in again, page by page).
        The kept buffer is valid until the next ``prepare``: a device one is written on this runner's stream,
        so the next batch's stack waits for the forward pass still reading it."""
        first = rows[0]
        shape = (len(rows), *first.shape)
        if self.cuda and first.device.type == "cpu":  # a fresh pinned block, uploaded from as it is (to_device)
            return torch.stack(rows, out=torch.empty(shape, dtype=first.dtype, pin_memory=True,
                                                     memory_format=self.memory_format))
        buffer = self._batch_buffer
        if buffer is None or len(buffer) < len(rows) or (buffer.device, buffer.dtype) != (first.device, first.dtype):
            buffer = torch.empty(shape, dtype=first.dtype, device=first.device, memory_format=self.memory_format)
            self._batch_buffer = buffer
        return torch.stack(rows, out=buffer[: len(rows)])

    def _convert_deferred(self, images: list[ModelInput]) -> dict[int, torch.Tensor | InvalidInput]:
        """Deferred JPEGs, raw tensors and crops, each kind converted as one batch on this device, by position."""
        return {**self._each(images, DeferredJpeg, decode_batch), **self._each(images, RawImage, raw_batch),
                **self._each(images, CroppedImage, cropped_batch)}

    def _each(self, images: list[ModelInput], kind: type[Kind],
              convert: Callable[[list[Kind], torch.device], Sequence[torch.Tensor | InvalidInput]]
              ) -> dict[int, torch.Tensor | InvalidInput]:
        """The images of one kind, converted as one batch, by position."""
        chosen = [(i, image) for i, image in enumerate(images) if isinstance(image, kind)]
        if not chosen:
            return {}
        results = convert([image for _, image in chosen], self.device)
        return {i: result for (i, _), result in zip(chosen, results, strict=True)}

    def _on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def __call__(self, inputs: torch.Tensor, temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs [B, 3, 224, 224] (on the CPU, or already on the device) and temperatures [B] on the CPU
        -> (probabilities, logits) on the CPU."""
        return self.launch(inputs, temperatures).wait()

    @torch.inference_mode()
    def launch(self, inputs: torch.Tensor, temperatures: torch.Tensor) -> PendingScores:
        """Start a batch: on CUDA the upload, forward pass, scores and the copy back are queued on this
        runner's stream and this returns at once, so the host can gather the next batch while this one runs
        (the batcher keeps two in flight). On the CPU the pass runs here and the scores are ready."""
        if not self.cuda:
            both = self._forward(inputs, temperatures)  # already host memory: no copy
            return PendingScores(both[0], both[1])
        with torch.cuda.stream(self.stream):
            both = self._forward(to_device(inputs, self.device), to_device(temperatures, self.device))
            # A fresh pinned block: the host allocator does not hand it out again until this copy is done.
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        return PendingScores(host[0], host[1], landed)

    def _forward(self, inputs: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """[2, B, 1000] float32 on the device: the probabilities, then the logits (one tensor, one copy back)."""
        if self._graphs:  # the copy into the graph's own input converts the dtype and layout
            return self._replay(inputs, temperatures)
        inputs = inputs.to(dtype=self.dtype).contiguous(memory_format=self.memory_format)
        if self.torchscript:
            return self._run_scripted(inputs, temperatures)
        return _scores(self._run_network(inputs), temperatures)

    def _run_scripted(self, inputs: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """The traced network and scores at a warmed size: padded on CUDA as the eager network is (a size the
        executor and cuDNN had not seen would be optimised and autotuned on a user's batch)."""
        padding = self.padding_for(len(inputs))
        if padding:
            inputs = _fresh_batch(inputs, len(inputs) + padding, self.memory_format)
            temperatures = torch.cat([temperatures, temperatures.new_ones(padding)])
        if self.buckets:
            self.sizes_run.add(len(inputs))
        return self._network(inputs, temperatures)[:, : len(inputs) - padding]

    def _replay(self, inputs: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """The batch through its bucket's CUDA graph: into the graph's own input (zero rows after it), one
        replay, and a view of the graph's scores. Everything is queued on this runner's stream, so the next
        batch's copy in waits for this one's copy back."""
        count = len(inputs)
        captured = self._graphs[count + self.padding_for(count)]
        captured.inputs[:count].copy_(inputs)
        captured.inputs[count:].zero_()
        captured.temperatures[:count].copy_(temperatures)
        captured.temperatures[count:].fill_(1.0)
        captured.graph.replay()
        self.sizes_run.add(len(captured.inputs))
        return captured.scores[:, :count]

    @torch.inference_mode()
    def _capture(self) -> None:
        """One CUDA graph of the network and its scores per bucket, after each has run eagerly (cuDNN has
        autotuned it: a capture cannot). Largest first, into one memory pool: the graphs run one at a time on
        this runner's stream, so each reuses the larger one's memory for what it keeps no longer than a replay;
        each keeps its own input, temperatures and scores."""
        with torch.cuda.device(self.device):  # the pool and each capture are the current device's: make it ours
            pool = torch.cuda.graph_pool_handle()
            for size in sorted(self.buckets, reverse=True):
                self._graphs[size] = self._capture_one(size, pool)

    def graph_input(self, size: int) -> torch.Tensor:
        """A captured bucket's own input: zeros of the model's dtype on its device, in the layout the network
        runs in (zeros() takes no memory_format: empty, then zeroed). Made on the CPU too, where it is tested."""
        return torch.empty((size, *FLOAT_SHAPE), dtype=self.dtype, device=self.device,
                           memory_format=self.memory_format).zero_()

    def _capture_one(self, size: int, pool: torch.cuda._POOL_HANDLE) -> _CapturedBatch:
        inputs = self.graph_input(size)
        temperatures = torch.ones(size, dtype=torch.float64, device=self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls meanwhile (a second replica warming up) are no error.
        with torch.cuda.graph(graph, pool=pool, stream=self.stream, capture_error_mode="thread_local"):
            scores = _scores(self.model(inputs), temperatures)
        return _CapturedBatch(graph, inputs, temperatures, scores)

    def _run_network(self, inputs: torch.Tensor) -> torch.Tensor:
        if not self.buckets:  # warm-up itself, or a runner used without one
            return self._network(inputs)
        if self.compiled:  # A new batch: the last one's outputs are dead, so CUDA graphs may reuse their memory.
            torch.compiler.cudagraph_mark_step_begin()
        if self.cuda:
            padding = self.padding_for(len(inputs))
            if padding or self.compiled:
                inputs = _fresh_batch(inputs, len(inputs) + padding, self.memory_format)
            return self._run_bucket(inputs)[: len(inputs) - padding]
        outputs, start = [], 0
        for size in split_into_buckets(len(inputs), self.buckets):
            piece = inputs[start:start + size]
            outputs.append(self._run_bucket(_fresh_batch(piece, size, self.memory_format) if self.compiled else piece))
            start += size
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _run_bucket(self, batch: torch.Tensor) -> torch.Tensor:
        self.sizes_run.add(len(batch))
        return self._network(batch)

    def run_sizes(self, count: int) -> list[int]:
        """The bucket sizes a batch of ``count`` images runs at: the next bucket up on CUDA (padded), the greedy
        split into buckets on the CPU; ``[count]`` without buckets."""
        if not self.buckets:
            return [count]
        if self.cuda:
            return [count + self.padding_for(count)]
        return split_into_buckets(count, self.buckets)

    def padding_for(self, count: int) -> int:
        """Zero rows added to a batch of ``count`` images: up to the next bucket on CUDA, none on the CPU."""
        if not self.cuda or not self.buckets:
            return 0
        size = next((s for s in self.buckets if s >= count), None)
        if size is None:
            raise ValueError(f"batch of {count} is over the largest warmed size {self.buckets[-1]}")
        return size - count

    def warm_up(self, batch_sizes: list[int]) -> None:
        """Run every batch size, so autotuning (cudnn.benchmark) and compilation are paid before SERVING; from
        then on every batch runs at one of these sizes (its buckets). Call it on the thread that will run the
        batches: CUDA graphs are recorded per thread."""
        sizes = sorted({1, *batch_sizes})  # 1: any batch splits into them
        if self.compiled:
            inductor.allow_recompiles(len(sizes))
        if self.compile_mode in inductor.REPLAYS_CUDA_GRAPHS:
            inductor.cuda_graph_state_for_this_thread()  # the thread that warms up is the one that serves
        self.buckets = sizes  # warm-up batches take the path served ones will
        # CUDA graphs are recorded on a graph's second call (the first runs it plainly); a third call replays it.
        # TorchScript's executor profiles a graph's first call for a shape and optimises it for the second.
        repeats = 3 if self.compile_mode in inductor.REPLAYS_CUDA_GRAPHS else 2 if self.torchscript else 1
        graphs_before = inductor.CacheUse.now() if self.compiled else None  # only compiling uses inductor's cache
        for size in sizes:
            for _ in range(repeats):
                self(torch.zeros((size, *FLOAT_SHAPE)), torch.ones(size))
        if graphs_before is not None:
            self.graphs_cached = inductor.CacheUse.now().since(graphs_before)
        if self.cuda_graphs:
            self._capture()
            for size in sizes:  # each graph replayed once before a user's batch is
                self(torch.zeros((size, *FLOAT_SHAPE)), torch.ones(size))
        # Raw conversion too: its kernels load and its constants reach the device before SERVING, so no
        # served batch pays for them (on CUDA, placing the constants is a blocking copy).
        side = FLOAT_SHAPE[1]
        self.prepare([RawImage("uint8", (side, side, 3), bytes(side * side * 3))])
        self.sizes_run.clear()

    def memory(self) -> tuple[int, int]:
        """(allocated, reserved) bytes on the device; (0, 0) off CUDA."""
        if not self.cuda:
            return 0, 0
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)


class _CapturedBatch(NamedTuple):
    """One bucket's CUDA graph and the tensors it reads and writes: [B, 3, 224, 224] inputs in the model's dtype
    and layout, [B] float64 temperatures, [2, B, 1000] float32 scores."""

    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor
    temperatures: torch.Tensor
    scores: torch.Tensor


class PendingScores:
    """A batch's (probabilities, logits), [B, 1000] float32 on the host, or on their way there: ``landed`` is
    the CUDA event recorded after the copy back, and waiting on it is the one synchronisation of the batch
    (with the GIL released, so the engine's other threads run meanwhile)."""

    def __init__(self, probabilities: torch.Tensor, logits: torch.Tensor,
                 landed: torch.cuda.Event | None = None) -> None:
        self._scores = probabilities, logits
        self._landed = landed

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._landed is not None:
            self._landed.synchronize()
        return self._scores


def _scores(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) per row and the logits, as float32 [2, B, C]."""
    logits = logits.float()
    return torch.stack([temperature_softmax(logits, temperatures), logits])


class _Scored(torch.nn.Module):
    """The network and its scores as one module, so that a traced one runs a whole batch in one call."""

    def __init__(self, network: torch.nn.Module) -> None:
        super().__init__()
        self.network = network

    def forward(self, inputs: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        return _scores(self.network(inputs), temperatures)


def batch_norms_folded(model: torch.nn.Module) -> torch.nn.Module:
    """The model in eval mode with every batch norm folded into the convolution it follows: the same function
    (logits within 1e-5), one pass less over each activation and 20 fewer kernels per forward pass. On the CPU
    it is worth little; it is there for small GPU batches, where kernel launches dominate. Done in fp32, before
    any cast to reduced precision.

    Pairs are found by name, as torchvision's ResNets lay them out: ``bnN`` follows ``convN`` and a
    ``downsample`` is ``Sequential(conv, bn)``. (torch.fx would find them by tracing, but its tracer patches
    torch globals, which breaks the forward passes of replicas warming up on other threads.)"""
    model.eval()
    for module in list(model.modules()):
        for name, norm in list(module.named_children()):
            conv = getattr(module, _conv_name(name), None)
            if isinstance(norm, torch.nn.BatchNorm2d) and isinstance(conv, torch.nn.Conv2d):
                setattr(module, _conv_name(name), fuse_conv_bn_eval(conv, norm))
                setattr(module, name, torch.nn.Identity())
    return model


def _conv_name(norm_name: str) -> str:
    """bn2 -> conv2; in a Sequential, "1" -> "0"."""
    return str(int(norm_name) - 1) if norm_name.isdigit() else norm_name.replace("bn", "conv", 1)


def split_into_buckets(count: int, sizes: list[int]) -> list[int]:
    """Greedy largest-first split of a batch into available sizes (which include 1)."""
    parts = []
    while count:
        part = max(size for size in sizes if size <= count)
        parts.append(part)
        count -= part
    return parts


def _fresh_batch(inputs: torch.Tensor, size: int, memory_format: torch.memory_format) -> torch.Tensor:
    """A new tensor of ``size`` rows in the model's layout, the inputs first and zero rows after, made under
    inference mode: dynamo also guards on the input's dispatch keys and strides, and a caller's ordinary
    tensor would otherwise compile every graph a second time."""
    batch = torch.empty((size, *inputs.shape[1:]), dtype=inputs.dtype, device=inputs.device,
                        memory_format=memory_format)
    batch[: len(inputs)] = inputs
    batch[len(inputs):] = 0
    return batch


# Replicas load on threads of their own, at once; TorchScript's compilation unit and name mangling are
# process-wide, and two traces at a time fail their own check ("Graphs differed across invocations").
_TRACING = threading.Lock()


@torch.inference_mode()
def _torchscript(model: torch.nn.Module, *example: torch.Tensor) -> torch.jit.ScriptModule:
    """The model traced on ``example`` and frozen (weights as constants). Tracing records the operators one
    pass runs; ResNet's pass has no branch on its input, so the graph holds for any batch size."""
    # On CUDA TorchScript would also fuse pointwise operators into kernels it generates at run time (NNC);
    # it never does on the CPU, where this path is tested. What is wanted here is the GIL held once, not new
    # kernels: the GPU runs the same unfused graph. (Process-wide; nothing else here uses TorchScript.)
    torch._C._jit_override_can_fuse_on_gpu(False)
    with _TRACING, warnings.catch_warnings():
        # Newer torch warns that TorchScript is deprecated in favour of torch.compile and torch.export, which
        # need a C++ compiler at start-up; it still runs, and the tests run it on the torch this installs.
        warnings.simplefilter("ignore", FutureWarning)
        return torch.jit.freeze(torch.jit.trace(model.eval(), example))


def bucket_sizes(max_batch_size: int, cuda: bool) -> list[int]:
    """The batch sizes a device warms up and runs: 1, 2, 4, 8, then steps of a half or a third (16, 24, 32, 48, 64,
    96, 128 ...) up to the maximum, which is always one. Padding up to the next one adds under half as many rows
    again (17 -> 24 and 33 -> 48 at worst). The CPU splits instead of padding, so its buckets also hold every
    size up to 8 (its default maximum): a batch there never splits below that."""
    sizes, size = {max_batch_size}, 1
    while size < max_batch_size:
        sizes.add(size)
        size = size * 2 if size < 16 else size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    if not cuda:
        sizes.update(range(1, min(8, max_batch_size) + 1))
    return sorted(sizes)

