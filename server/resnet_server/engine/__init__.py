"""The engine process, one per device: batching, the runner, the model on its device. No asyncio, no gRPC."""
