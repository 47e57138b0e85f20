"""Every RPC's request messages, fuzzed with hypothesis against the real servers in this process: a
PrefillAgent's reservations stream, a DecodeRank, and the Scheduler (legs answered by a stand-in
OpenAI client). Random field values include huge counts and strings, within a size budget.

Each example must end in an expected status, leave the server answering its health check, and
leave no state behind (streams, open transfers, pending barriers, in-flight calls, subscribers).
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kvpush.services.common import transfer_params
from kvpush.services.common.aio_thread import LoopThread
from kvpush.services.decode_agent.barrier import BarrierState
from kvpush.services.decode_agent.rank import DecodeRank, DecodeRankConfig
from kvpush.services.prefill_agent.agent import PrefillAgent, PrefillAgentConfig
from kvpush.services.scheduler.first_tokens import FirstTokenRelay
from kvpush.services.scheduler.generate import Chunk, OpenAIClient
from kvpush.services.scheduler.local_prefill import LocalPrefillConfig
from kvpush.services.scheduler.registry import LeaseConfig
from kvpush.services.scheduler.server import SchedulerConfig, SchedulerServer
from kvpush.v1 import kvpush_pb2 as pb
from kvpush.v1 import kvpush_pb2_grpc as pb_grpc
from tests.security_support import FakeEngine, decode_layout, hello, regions, serving
from tests.transfer_nodes import shape

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.ABORTED,
}
ALLOWED_VALUES = {c.value[0] for c in ALLOWED}

FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,  # nothing written to the working tree
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ----- value strategies -----------------------------------------------------------------------

_big_text = st.integers(min_value=100, max_value=300_000).map(lambda n: "x" * n)
TEXT = st.one_of(st.text(max_size=10), st.text(max_size=10), st.text(max_size=10), _big_text)
IDS = st.one_of(st.sampled_from(["t0", "t1", "t2"]), TEXT)
U32 = st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1))
U64 = st.one_of(st.integers(0, 4), st.integers(0, 2**64 - 1))
_big_ids = st.integers(min_value=0, max_value=300_000).map(lambda n: [1] * n)
BLOCK_IDS = st.one_of(st.lists(U32, max_size=8), st.lists(st.integers(0, 63), max_size=8), _big_ids)
GROUPS = st.one_of(st.lists(BLOCK_IDS, max_size=3), st.integers(0, 40).map(lambda n: [[1]] * n))


def _call_code(fn: Callable[[], Any]) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _until(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"state left behind: {what}")
        time.sleep(0.005)  # a bounded poll of another thread's state


# ----- PrefillAgent.Reservations --------------------------------------------------------------


@st.composite
def hellos(draw: st.DrawFn) -> pb.Hello:
    """Valid Hellos (so what follows them is fuzzed too) and Hellos with a few fields mutated."""
    h = hello(engine_id=draw(st.sampled_from(["fz-d0", "fz-d1"])), incarnation=draw(st.sampled_from(["i1", "i2"])))
    if draw(st.sampled_from([True, True, False])):
        return h

    def mutate() -> bool:
        return draw(st.sampled_from([False, False, False, True]))

    d = h.decode
    if mutate():
        d.engine_id = draw(IDS)
    if mutate():
        d.incarnation = draw(IDS)
    if mutate():
        d.role = draw(st.integers(0, 5))
    if mutate():
        d.tp_size = draw(U32)
    if mutate():
        d.compatibility_hash = draw(TEXT)
    if mutate():
        del h.decode_ranks[:]
        n = draw(st.integers(0, 4))
        h.decode_ranks.extend(decode_layout(rank=r) for r in range(n))
    for r in h.decode_ranks:
        if mutate():
            r.tp_rank = draw(U32)
        if mutate():
            r.block_bytes = draw(U64)
        if mutate():
            del r.regions[draw(st.integers(0, len(r.regions))) :]
            r.regions.extend([pb.LayerRegion(num_blocks=draw(U32), block_stride=draw(U64))] * draw(st.integers(0, 3)))
        if mutate():
            r.nixl_agent_metadata = draw(st.binary(max_size=16))
        if mutate():
            r.completion_endpoint = draw(TEXT)
    if mutate():
        h.expected_prefill_engine_id = draw(st.one_of(st.just("fz-prefill"), IDS))
    if mutate():
        h.expected_prefill_incarnation = draw(IDS)
    if mutate():
        h.auth_token = draw(TEXT)
    return h


@st.composite
def decode_messages(draw: st.DrawFn) -> pb.DecodeMessage:
    kind = draw(st.sampled_from(["reservation", "reservation", "cancel", "drain", "hello", "empty"]))
    if kind == "reservation":
        return pb.DecodeMessage(
            reservation=pb.Reservation(
                transfer_id=draw(IDS),
                epoch=draw(U64),
                block_ids=[pb.BlockIds(ids=g) for g in draw(GROUPS)],
                num_tokens=draw(U32),
                num_skip_blocks=draw(U32),
                lease_ms=draw(U32),
            )
        )
    if kind == "cancel":
        return pb.DecodeMessage(cancel=pb.Cancel(transfer_id=draw(IDS), epoch=draw(U64), reason=draw(TEXT)))
    if kind == "drain":
        return pb.DecodeMessage(drain=pb.Drain(reason=draw(TEXT)))
    if kind == "hello":
        return pb.DecodeMessage(hello=draw(hellos()))
    return pb.DecodeMessage()


@pytest.fixture(scope="module")
def prefill() -> Iterator[PrefillAgent]:
    cfg = PrefillAgentConfig(engine_id="fz-prefill", rank=0, tp_size=1, shape=shape(), hello_timeout_s=2.0)
    agent = PrefillAgent(cfg, FakeEngine(), regions()).start()  # type: ignore[arg-type]
    yield agent
    agent.stop()


def _stream(prefill: PrefillAgent, messages: list[pb.DecodeMessage]) -> None:
    stub = pb_grpc.PrefillAgentStub(grpc.insecure_channel(prefill.endpoint))
    replies: list[pb.PrefillMessage] = []

    def run() -> None:
        replies.extend(stub.Reservations(iter(messages), timeout=15))

    code = _call_code(run)
    event(f"stream {code.name}, {len(replies)} replies")
    assert code in ALLOWED
    assert all(m.rejected.code in ALLOWED_VALUES | {grpc.StatusCode.DEADLINE_EXCEEDED.value[0]} for m in replies)
    assert serving(prefill.endpoint)

    def quiet() -> bool:
        return prefill.writer.call(
            lambda: not prefill.writer._sessions and prefill.writer.table.active_count() == 0
        ).result(5)

    _until(quiet, "prefill sessions or open transfers")


def _huge_tp_hello() -> pb.DecodeMessage:
    h = hello()
    h.decode.tp_size = 2**32 - 1  # once sized a list on the event loop
    return pb.DecodeMessage(hello=h)


@FUZZ
@given(
    first=st.one_of(hellos().map(lambda h: pb.DecodeMessage(hello=h)), decode_messages()),
    rest=st.lists(decode_messages(), max_size=3),
)
@example(first=_huge_tp_hello(), rest=[])
def test_fuzz_reservations_stream_opening(
    prefill: PrefillAgent, first: pb.DecodeMessage, rest: list[pb.DecodeMessage]
) -> None:
    _stream(prefill, [first, *rest])


@FUZZ
@given(engine=st.sampled_from(["fz-d0", "fz-d1"]), rest=st.lists(decode_messages(), min_size=1, max_size=8))
def test_fuzz_reservations_stream_after_a_valid_hello(
    prefill: PrefillAgent, engine: str, rest: list[pb.DecodeMessage]
) -> None:
    _stream(prefill, [pb.DecodeMessage(hello=hello(engine_id=engine)), *rest])


# ----- DecodeRank -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rank() -> Iterator[DecodeRank]:
    cfg = DecodeRankConfig(engine_id="fz-decode", rank=0, tp_size=1, shape=shape(), expect_wait_s=0.02)
    r = DecodeRank(cfg, FakeEngine(), regions()).start()  # type: ignore[arg-type]
    yield r
    r.stop()


_expectations = st.builds(
    pb.Expectation,
    transfer_id=IDS,
    epoch=U64,
    request_id=IDS,
    prefill_ranks=st.one_of(st.lists(st.integers(0, 3), max_size=4), st.lists(U32, max_size=4), _big_ids),
    prefill_engine_id=st.sampled_from(["P", "Q"]) | IDS,
)
_expect_calls = st.one_of(
    st.lists(_expectations, max_size=5), st.integers(0, 6000).map(lambda n: [pb.Expectation(transfer_id="t0")] * n)
).map(lambda es: ("Expect", pb.ExpectRequest(expectations=es)))
_complete_calls = st.builds(
    pb.Completion,
    transfer_id=IDS,
    epoch=U64,
    prefill_rank=U32,
    decode_rank=st.one_of(st.just(0), U32),
    status=st.one_of(st.sampled_from([pb.TRANSFER_STATUS_OK, pb.TRANSFER_STATUS_FAILED]), st.integers(0, 5)),
    reason=TEXT,
    prefill=st.builds(pb.EngineIdentity, engine_id=st.sampled_from(["P", "Q"]) | IDS),
    bytes_written=U64,
    descriptors=U32,
    write_seconds=st.floats(allow_nan=True, allow_infinity=True),
).map(lambda c: ("Complete", c))
_settle_calls = st.builds(pb.Settlement, transfer_id=IDS, epoch=U64, status=st.integers(0, 5), reason=TEXT).map(
    lambda s: ("Settle", s)
)


@FUZZ
@given(calls=st.lists(st.one_of(_expect_calls, _complete_calls, _settle_calls), min_size=1, max_size=5))
def test_fuzz_decode_rank(rank: DecodeRank, calls: list[tuple[str, Any]]) -> None:
    stub = pb_grpc.DecodeRankStub(grpc.insecure_channel(rank.endpoint))
    for method, request in calls:
        got: list[Any] = []
        code = _call_code(lambda m=method, r=request, got=got: got.append(getattr(stub, m)(r, timeout=10)))
        event(f"{method} {code.name}")
        assert code in ALLOWED, (method, code)
        if method == "Expect" and got:
            assert {r.code for r in got[0].results} <= ALLOWED_VALUES | {0}
    assert serving(rank.endpoint)
    # Settle whatever this example left waiting, as the agent would; then nothing is pending.
    for tid, epoch in [
        (b.transfer_id, b.epoch) for b in rank.table._barriers.values() if b.state is not BarrierState.RELEASED
    ]:
        stub.Settle(pb.Settlement(transfer_id=tid, epoch=epoch, status=pb.TRANSFER_STATUS_FAILED), timeout=10)
    rank.take_released()
    assert rank.table.pending_count() == 0
    _until(lambda: not rank._expected, "completions waiting for an expectation")


# ----- Scheduler ------------------------------------------------------------------------------


class _InstantClient(OpenAIClient):
    """Both legs succeed at once: one token, then done. A hand-off's prefill leg reports its first
    token to the scheduler as a prefill engine does (``relay`` is set once the server exists)."""

    relay: FirstTokenRelay | None = None

    async def prefill(self, endpoint: str, p: Any, params: Any) -> None:
        leg = transfer_params.parse(params)
        if self.relay is not None and isinstance(leg, transfer_params.PrefillLeg) and leg.first_token:
            ft = pb.FirstToken(transfer_id=leg.transfer_id, decode_engine_id=leg.decode_engine_id, token_id=7)
            self.relay.relay(pb.FirstTokenReport(engine_id=leg.prefill_engine_id, first_tokens=[ft]))

    async def decode(self, endpoint: str, p: Any, params: Any, max_tokens: int | None = None) -> AsyncIterator[Chunk]:
        yield Chunk([7], "length")


@pytest.fixture(scope="module")
def sched() -> Iterator[tuple[SchedulerServer, pb_grpc.SchedulerStub]]:
    loop = LoopThread("fuzz-scheduler")
    loop.start()

    async def start() -> SchedulerServer:
        s = SchedulerServer(
            SchedulerConfig(
                listen="127.0.0.1:0",
                lease=LeaseConfig(interval_s=60.0, misses=3, settle_s=0.05),
                # Local prefill on: short prompts, and any prompt once the prefill queue's speed is
                # known (the instant client's reports), go to decode for callers that allow it.
                local_prefill=LocalPrefillConfig(max_tokens=10, wait_ms=0.001),
            )
        )
        s.servicer.client = client = _InstantClient()
        client.relay = s.servicer._first_tokens
        await s.start()
        return s

    server = loop.run(start())
    stub = pb_grpc.SchedulerStub(grpc.insecure_channel(server.address))
    for engine_id, role in (("fixed-d", pb.ROLE_DECODE), ("fixed-p", pb.ROLE_PREFILL)):
        stub.Register(
            pb.RegisterRequest(
                instance=pb.InstanceInfo(
                    engine_id=engine_id,
                    role=role,
                    incarnation="fixed",
                    tp_size=1,
                    agent_endpoints=["127.0.0.1:1"],
                    total_kv_blocks=1 << 20,
                    tokens_per_block=16,
                    http_endpoint="http://127.0.0.1:1",
                    first_token_handoff=role == pb.ROLE_DECODE,
                )
            ),
            timeout=10,
        )
    yield server, stub
    loop.run(server.stop(1.0))
    loop.stop()


_endpoints = st.one_of(st.lists(st.just("127.0.0.1:1"), max_size=3), st.lists(TEXT, max_size=3))
_instances = st.builds(
    pb.InstanceInfo,
    engine_id=st.sampled_from(["fz-0", "fz-1", "fz-2"]) | IDS,
    role=st.integers(0, 3),
    incarnation=st.sampled_from(["a", "b"]) | IDS,
    tp_size=st.one_of(st.integers(0, 3), U32),
    agent_endpoints=_endpoints,
    total_kv_blocks=U32,
    tokens_per_block=st.one_of(st.just(16), U32),
    http_endpoint=st.one_of(st.just("http://127.0.0.1:1"), TEXT),
    agent_incarnations=st.lists(IDS, max_size=3),
    first_token_handoff=st.booleans(),
)
_register = _instances.map(lambda i: ("Register", pb.RegisterRequest(instance=i)))
_first_token = st.builds(
    pb.FirstToken,
    transfer_id=IDS,
    decode_engine_id=st.sampled_from(["fixed-d", "fz-0"]) | IDS,
    prefill_engine_id=IDS,
    token_id=U32,
    stopped=st.booleans(),
)
_reports = st.lists(
    st.builds(
        pb.LoadReport,
        engine_id=st.sampled_from(["fz-0", "fz-1"]) | IDS,
        incarnation=st.sampled_from(["a", "b"]) | IDS,
        free_blocks=U32,
        reserved_unfilled_blocks=U32,
        running_requests=U32,
        waiting_requests=U32,
        write_bytes_in_flight=U64,
        draining=st.booleans(),
        first_tokens=st.lists(_first_token, max_size=3),
    ),
    max_size=3,
).map(lambda rs: ("ReportLoad", rs))
_first_token_report = st.builds(
    pb.FirstTokenReport,
    engine_id=st.sampled_from(["fz-0", "fz-1"]) | IDS,
    incarnation=st.sampled_from(["a", "b"]) | IDS,
    first_tokens=st.lists(_first_token, max_size=3),
).map(lambda r: ("ReportFirstTokens", r))
_assign = st.builds(
    pb.AssignRequest,
    prompt_tokens=st.just(10) | U32,  # half of them within the fixed decode's capacity
    prefix_hint=TEXT,
    transfer_id=st.just("") | IDS,
    max_tokens=U32,
    first_token_from_prefill=st.booleans(),
    allow_prefill_on_decode=st.booleans(),
).map(lambda r: ("Assign", r))
_release = st.builds(pb.ReleaseRequest, transfer_id=IDS, epoch=U64, outcome=st.integers(0, 4), reason=TEXT).map(
    lambda r: ("Release", r)
)
_assign_stream = st.lists(
    st.builds(
        pb.AssignStreamRequest,
        batch_id=U64,
        assigns=st.lists(_assign.map(lambda m: m[1]), max_size=4),
        releases=st.lists(_release.map(lambda m: m[1]), max_size=4),
        max_wait_ms=st.sampled_from([0, 1, 20]),  # waits stay short: the run is bounded
        compact=st.booleans(),
        first_tokens=st.booleans(),
    ),
    max_size=3,
).map(lambda bs: ("AssignStream", bs))
_generate = st.builds(
    pb.GenerateRequest,
    prompt_token_ids=st.one_of(st.lists(U32, max_size=20), _big_ids),
    max_tokens=U32,
    temperature=st.floats(width=32, allow_nan=True, allow_infinity=True),
    ignore_eos=st.booleans(),
    request_id=IDS,
    seed=U64,
).map(lambda r: ("Generate", r))
_watch = st.builds(pb.WatchRequest, include_current=st.booleans()).map(lambda r: ("Watch", r))
_list = st.just(("ListInstances", pb.ListInstancesRequest()))
_leg_failure = st.builds(
    pb.LegFailure, transfer_id=IDS, prefill_engine_id=IDS, reason=TEXT, leg=st.integers(-1, 5)
).map(lambda r: ("ReportLegFailure", r))


def _assign_stream_call(stub: pb_grpc.SchedulerStub, batches: list[pb.AssignStreamRequest]) -> None:
    """The batches, then (once they are answered) one that releases every assignment they made,
    on the same stream: first-token waits end only with their assignments. Every wait a batch
    asked for ends with exactly one result on the stream."""
    answered = threading.Event()
    made: list[pb.Assignment | pb.CompactAssignment] = []
    waited: list[str] = []

    def requests() -> Iterator[pb.AssignStreamRequest]:
        yield from batches
        answered.wait(10)
        releases = [pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_OK) for a in made]
        yield pb.AssignStreamRequest(batch_id=1 << 63, releases=releases)

    answers: list[pb.AssignStreamResponse] = []
    results: list[pb.FirstTokenResult] = []
    if not batches:
        answered.set()
    for msg in stub.AssignStream(requests(), timeout=10):
        results.extend(msg.first_tokens)
        if msg.tokens_only:
            assert not msg.assigns and not msg.releases and msg.first_tokens
            continue
        answers.append(msg)
        if len(answers) == len(batches):
            for batch, answer in zip(batches, answers, strict=True):
                assert answer.batch_id == batch.batch_id
                assert len(answer.assigns) == len(batch.assigns) and len(answer.releases) == len(batch.releases)
                for result in answer.assigns:
                    kind = "compact" if batch.compact else "assignment"
                    assert (result.code == 0) == result.HasField(kind)
                    if result.code == 0:
                        a = getattr(result, kind)
                        made.append(a)
                        if batch.first_tokens and a.first_token_from_prefill:
                            waited.append(a.transfer_id)
            answered.set()
    assert answered.is_set() and len(answers) == len(batches) + 1
    assert sorted(r.transfer_id for r in results) == sorted(waited)
    event(f"AssignStream first-token results: {min(len(results), 2)}")
    assert all(r.code != 0 for r in results)  # no prefill reported: each closed or was refused


def _scheduler_call(stub: pb_grpc.SchedulerStub, method: str, request: Any) -> grpc.StatusCode:
    def run() -> None:
        if method == "ReportLoad":
            list(stub.ReportLoad(iter(request), timeout=10))
        elif method == "Generate":
            list(stub.Generate(request, timeout=10))
        elif method == "Watch":
            call = stub.Watch(request, timeout=0.05)
            try:
                list(call)
            except grpc.RpcError as exc:  # the client's own deadline ends a healthy Watch
                if exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
        elif method == "Assign":
            a = stub.Assign(request, timeout=10)
            stub.Release(pb.ReleaseRequest(transfer_id=a.transfer_id, epoch=a.epoch, outcome=pb.OUTCOME_OK), timeout=10)
        elif method == "AssignStream":
            _assign_stream_call(stub, request)
        else:
            getattr(stub, method)(request, timeout=10)

    return _call_code(run)


@FUZZ
@given(
    calls=st.lists(
        st.one_of(
            _register,
            _reports,
            _first_token_report,
            _assign,
            _release,
            _assign_stream,
            _generate,
            _watch,
            _list,
            _leg_failure,
        ),
        min_size=1,
        max_size=5,
    )
)
def test_fuzz_scheduler(sched: tuple[SchedulerServer, pb_grpc.SchedulerStub], calls: list[tuple[str, Any]]) -> None:
    server, stub = sched
    for method, request in calls:
        code = _scheduler_call(stub, method, request)
        event(f"{method} {code.name}")
        assert code in ALLOWED, (method, code)
    assert serving(server.address)
    s = server.servicer

    def idle() -> bool:
        left = (s._inflight, getattr(s, "_generating", 0), s._queued, len(s._lost), len(s._subscribers))
        # No load stream is open after the calls: no outbox for leg failures may remain either.
        return left == (0, 0, 0, 0, 0) and not server.registry.open and not s._outboxes and not s._first_tokens.waiters

    _until(idle, "scheduler calls, subscribers or open assignments")
