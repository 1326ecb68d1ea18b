"""ResNet18 image classification over gRPC: dynamic batching, temperature softmax, Prometheus metrics."""

from resnet_server.common.memory import keep_freed_memory

__version__ = "0.1.0"

# Here, so that it runs before torch is imported in every process that serves or times the model (the
# supervisor, its engines and front-ends, bench-model): set later, glibc has already placed blocks it goes on
# faulting in (resnet_server.common.memory).
KEPT_FREED_MEMORY = keep_freed_memory()
