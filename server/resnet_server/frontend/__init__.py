"""The front-end processes: gRPC (both APIs), validation and decoding, and the engines' handles."""
