"""GPU check of the data plane (``make gpu-check``): VRAM KV caches, the compute fence, NIXL over
UCX's CUDA transports, bytes verified. At most a few minutes on one GPU.

For each GPU layout (K/V-split NHD, K/V-split HND with decode TP2, MLA) a decode process and a
prefill process register VRAM KV tensors through the connector's real worker halves, on the same
GPU (UCX cuda_ipc / cuda_copy). For each transfer the prefill process zeroes the source blocks,
then on the current stream queues a long sleep kernel and the *producer kernel* that writes the
blocks' pattern, and calls ``wait_for_save`` at once, as vLLM does right after launching a
forward. With the CUDA event the writer must wait for both kernels: decode's bytes must match,
block by block and head by head. The negative control runs the same with the fence replaced by
a no-op: the WRITE then overtakes the producer and decode must see wrong bytes; if it does not,
the check cannot tell a missing fence from a present one and says so.

Exit codes: 0 passed, or skipped (no CUDA device: a message says so); 1 a transfer failed or bytes
differ with the fence; 2 the negative control did not fail (inconclusive); 3 set-up error.
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Connection

EXIT_OK, EXIT_FAILED, EXIT_INCONCLUSIVE, EXIT_SETUP = 0, 1, 2, 3
CASES = [("kv_split_nhd", 1, 1), ("kv_split_hnd", 1, 2), ("mla", 1, 1)]
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of GPU time in front of the producer kernel


def _say(msg: str) -> None:
    sys.stdout.write(f"gpu-check: {msg}\n")
    sys.stdout.flush()


def prefill_gpu_node(conn: Connection, case: str, engine_id: str, rank: int, tp: int, decode_engine: str) -> None:
    """A prefill rank with VRAM caches; ``done`` runs the producer right before ``wait_for_save``."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import torch

    from kvpush.connector.compute_fence import NoFence
    from kvpush.connector.messages import FinishedPrefill, PushMetadata
    from kvpush.connector.workers import PrefillWorker
    from tests.layout_cases import build, heads_of, logical, pattern
    from tests.layout_nodes import BLOCKS, _as_rank, _config, heads_per_rank

    torch.cuda.set_device(0)
    heads = heads_per_rank(case, tp)
    caches = build(case, BLOCKS, heads, "cuda:0")
    _as_rank(rank, tp)
    worker = PrefillWorker(_config(engine_id, "prefill"), "gpu-check")
    worker.register_kv_caches(caches)
    real_fence = worker._fence
    hs = worker.handshake()
    assert hs is not None
    conn.send({"endpoint": hs.endpoint, "incarnation": hs.incarnation})
    while True:
        cmd, *args = conn.recv()
        if cmd == "done":
            tid, src_ids, num_tokens, fenced = args
            worker._fence = real_fence if fenced else NoFence
            idx = torch.as_tensor(src_ids, device="cuda:0")
            views = [logical(case, t) for t in caches.values()]
            wants = [
                pattern(layer, src_ids, heads_of(case, rank, heads), v.shape[1], v.shape[4]).to("cuda:0")
                for layer, v in enumerate(views)
            ]
            for v in views:
                v[idx] = 0
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)  # the forward is still running...
            for v, want in zip(views, wants, strict=True):
                v[idx] = want  # ...and the producer kernel fills the blocks after it
            meta = PushMetadata(
                finished_prefills=[FinishedPrefill(tid, f"req-{tid}", (tuple(src_ids),), num_tokens, decode_engine)]
            )
            worker.wait_for_save(meta)  # right after the launch, as vLLM calls it
            conn.send(None)
        elif cmd == "stop":
            torch.cuda.synchronize()
            worker.shutdown()
            conn.send("stopped")
            return


def _run_case(case: str, p_tp: int, d_tp: int) -> int:
    from scripts.cluster.node import Node
    from tests.layout_cases import TOKENS
    from tests.layout_nodes import decode_layout_node

    tag = f"gpu-{case}-{p_tp}{d_tp}"
    pe, de = f"prefill-{tag}", f"decode-{tag}"
    decode = Node(decode_layout_node, case, de, d_tp, "cuda:0")
    prefill = [Node(prefill_gpu_node, case, pe, r, p_tp, de) for r in range(p_tp)]
    status = EXIT_OK
    try:
        leg = {
            "epoch": 1,
            "prefill_engine_id": pe,
            "prefill_incarnation": "",
            "prefill_tp_size": p_tp,
            "prefill_agent_endpoints": [n.info["endpoint"] for n in prefill],
            "prefill_rank_incarnations": [n.info["incarnation"] for n in prefill],
        }
        src, dst = [3, 4, 5, 40, 12], [50, 2, 3, 4, 61]
        for fenced in (True, False):
            tid = f"{tag}-{'fenced' if fenced else 'unfenced'}"
            decode.call("clear")
            decode.call("reserve", tid, {**leg, "transfer_id": tid}, dst, len(src) * TOKENS)
            start = time.monotonic()
            for n in prefill:
                n.call("done", tid, src, len(src) * TOKENS, fenced)
            ranks = decode.call("wait", [tid], 60.0, timeout=90)[tid]
            took = time.monotonic() - start
            bad = decode.call("verify", dst, src)
            ok = bool(ranks) and all(v == ("ok", "") for v in ranks.values())
            if fenced:
                if not ok or bad:
                    _say(f"FAIL {case} P{p_tp}->D{d_tp} with the CUDA event: ranks={ranks} bad heads={bad[:8]}")
                    status = EXIT_FAILED
                else:
                    _say(f"ok   {case} P{p_tp}->D{d_tp} with the CUDA event: bytes exact ({took:.2f}s)")
            elif ok and not bad:
                _say(f"INCONCLUSIVE {case}: without the event the bytes still matched (the race was not observed)")
                status = status or EXIT_INCONCLUSIVE
            else:
                _say(f"ok   {case}: without the event the WRITE overtook the producer ({len(bad)} wrong heads)")
    finally:
        for n in [*prefill, decode]:
            n.stop()
    return status


def main() -> int:
    try:
        import torch
    except ImportError:
        _say("SKIPPED: torch is not installed")
        return EXIT_OK
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        _say("SKIPPED: no CUDA device (this check needs one GPU; nothing was run)")
        return EXIT_OK
    _say(f"device: {torch.cuda.get_device_name(0)}; UCX_TLS={os.environ.get('UCX_TLS', '(default)')}")
    deadline = time.monotonic() + 270
    results = []
    for case in CASES:
        if time.monotonic() > deadline:
            _say(f"FAIL: out of time before {case[0]}")
            return EXIT_FAILED
        try:
            result = _run_case(*case)
        except Exception as exc:  # a set-up problem (NIXL without CUDA support, UCX) is reported, not raised
            _say(f"ERROR {case[0]}: {type(exc).__name__}: {exc}")
            return EXIT_SETUP
        results.append(result)
    status = EXIT_FAILED if EXIT_FAILED in results else max(results, default=EXIT_OK)
    _say("PASSED" if status == EXIT_OK else "FAILED" if status == EXIT_FAILED else "INCONCLUSIVE")
    return status


if __name__ == "__main__":
    sys.exit(main())
