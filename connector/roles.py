"""The two halves each role of ``KvPushConnector`` implements, as vLLM splits a connector:

- :class:`SchedulerHalf` runs in the EngineCore next to vLLM's scheduler (``DecodeScheduler``:
  reserves and publishes blocks; ``PrefillScheduler``: flags finished prefills, holds their blocks);
- :class:`WorkerHalf` runs in each worker process, one per TP rank (``DecodeWorker``: the rank's
  completion barrier; ``PrefillWorker``: the rank's push writer).

``KvPushConnector`` holds one half of its role and delegates every vLLM hook to it, so a reader
sees here which hooks each side implements (compare SGLang's ``BaseKVSender``/``BaseKVReceiver``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpush.connector.messages import PushMetadata, RankHandshake


class SchedulerHalf(Protocol):
    def set_handshakes(self, handshakes: dict[int, RankHandshake], kv_cache_manager: Any) -> None:
        """Every worker rank's handshake, once at start-up: start the agents, register."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the request will get from a remote engine, and whether they load asynchronously."""

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Blocks were allocated for the request (decode: reserve and publish them)."""

    def build_connector_meta(self, scheduler_output: Any) -> PushMetadata:
        """What this step's workers must do (prefill: the transfers whose KV this step completes)."""

    def update_connector_output(self, finished: set[str], failed: set[str] | None = None) -> None:
        """Requests the workers finished (decode: received; prefill: sent); decode: `failed`, those whose
        load failed."""

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """The request ended: whether its blocks stay held, and params for the response."""

    def has_pending_push_work(self) -> bool: ...

    def shutdown(self) -> None: ...


@dataclass
class TransferResults:
    """A worker's report for one step, in kvpush terms (mapped to vLLM's by the connector)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)  # vLLM fails the requests holding them


class WorkerHalf(Protocol):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """The rank's KV tensors: describe them, register them with NIXL once, start the agent."""

    def handshake(self) -> RankHandshake | None: ...

    def step_started(self, meta: PushMetadata | None) -> None:
        """A step's metadata was bound, before its forward: the previous step's output is out."""

    def wait_for_save(self, meta: PushMetadata | None) -> None:
        """After the step's forward was launched (prefill: hand the step's transfers to the writer)."""

    def transfer_results(self, finished_req_ids: set[str]) -> TransferResults | None:
        """This step's report; None when there is nothing to report (the common step)."""

    def shutdown(self) -> None: ...
