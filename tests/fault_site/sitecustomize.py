"""Fault injection for real vLLM processes in tests: on ``PYTHONPATH`` of an engine started by a
test, Python imports this module at start-up. ``KVPUSH_TEST_FAULT`` names the fault; without it
nothing is patched. The patch is applied when the module it changes is first imported, so the
engine starts as usual.

``handoff_release_early``: a decode engine's workers stop holding a first-token hand-off request's
KV release for its token, and its scheduler half drops every token that reaches it (relayed, or
carried by a completion): vLLM then schedules hand-off requests before their token is in, the state
the connector's veto exists for (``PushMetadata.veto_blocks``).

``relay_lost``: a decode engine's scheduler half drops every relayed first token; only the tokens
the completions carry reach it (connector/completion_tokens.py).

``relay_and_completion_rpcs_lost``: as ``relay_lost``, and the decode ranks also lose every
``Complete`` RPC before they see it (UNAVAILABLE): only the completion notices, NIXL notifications
(services/common/completion_notice.py), release the KV and bring prefill's token."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

FAULT = os.environ.get("KVPUSH_TEST_FAULT", "")


def _patch_workers(mod: ModuleType) -> None:
    original = mod.DecodeWorker.wait_for_save

    def wait_for_save(self: Any, meta: Any) -> None:
        if meta is not None:
            meta.awaiting_first_token = []  # release the KV without waiting for the token
        original(self, meta)

    mod.DecodeWorker.wait_for_save = wait_for_save


def _patch_relay(mod: ModuleType) -> None:
    mod.DecodeScheduler._first_tokens = lambda self, tokens: None  # every relayed token is lost


def _patch_decode_scheduler(mod: ModuleType) -> None:
    _patch_relay(mod)
    mod.DecodeScheduler._completion_token = lambda self, token: None  # ... and every carried one


def _patch_rank(mod: ModuleType) -> None:
    import grpc

    async def complete(self: Any, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "test fault: completion lost")

    mod.DecodeRank.Complete = complete


PATCHES = {
    "handoff_release_early": {
        "kvpush.connector.workers": _patch_workers,
        "kvpush.connector.decode_scheduler": _patch_decode_scheduler,
    },
    "relay_lost": {"kvpush.connector.decode_scheduler": _patch_relay},
    "relay_and_completion_rpcs_lost": {
        "kvpush.connector.decode_scheduler": _patch_relay,
        "kvpush.services.decode_agent.rank": _patch_rank,
    },
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict[str, Any]) -> None:
        self.patches = dict(patches)

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                exec_module = loader.exec_module

                def exec_and_patch(module: ModuleType, exec_module: Any = exec_module, patch: Any = patch) -> None:
                    exec_module(module)
                    patch(module)
                    sys.stderr.write(f"kvpush test fault {FAULT}: patched {name}\n")

                loader.exec_module = exec_and_patch  # type: ignore[method-assign]
                return spec
        return None


if FAULT in PATCHES:
    sys.meta_path.insert(0, _PatchOnImport(PATCHES[FAULT]))
elif FAULT:
    sys.stderr.write(f"kvpush test fault {FAULT!r} is unknown\n")
