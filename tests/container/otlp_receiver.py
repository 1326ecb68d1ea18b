"""An OTLP/gRPC trace receiver on 0.0.0.0:4317 that prints one line a span it receives ("span TRACE_ID NAME"):
the container proof's stand-in for Jaeger where no Jaeger image can be had (no registry). It runs in the server's
own image, which has grpcio and opentelemetry-proto (the tracing extra).

Usage: python otlp_receiver.py [--port 4317]
"""

from __future__ import annotations

import argparse
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    print(f"span {span.trace_id.hex()} {span.name}", flush=True)
        return trace_service_pb2.ExportTraceServiceResponse()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4317, help="the OTLP/gRPC port (default 4317)")
    args = parser.parse_args(argv)
    server = grpc.server(ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    server.add_insecure_port(f"0.0.0.0:{args.port}")
    server.start()
    print(f"receiving OTLP traces on :{args.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.stop(0))
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
