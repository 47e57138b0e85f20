"""kvpush's vLLM KV connector. Importing this package is cheap: no NIXL, gRPC or worker code."""
