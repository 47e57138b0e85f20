"""Shared pytest set-up: real-vLLM fixtures (``tiny_model_dir``, server pools)."""

pytest_plugins = ["vllm_fixtures"]
