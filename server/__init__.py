"""ResNet18 image classification over gRPC: dynamic batching, temperature softmax, Prometheus metrics."""

__version__ = "0.1.0"
