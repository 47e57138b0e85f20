"""The main job: a 1P1D push-mode demo on this machine's CPUs.

Creates the tiny seeded model if missing, starts the kvpush scheduler, a prefill and a decode vLLM
(with KvPushConnector; every gRPC hop with mutual TLS, certificates from ``make certs``) and one
plain vLLM as the reference, sends a batch through ``Generate``,
prints per-request TTFT/TPOT and whether every output equals the reference, then shuts down.
Run it with ``make demo``.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvpush.services.common.vllm_server import complete
from scripts.cluster import REPO
from scripts.cluster.pd import Timed, pd_cluster
from scripts.cluster.vllm import make_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", type=Path, default=REPO / "models" / "tiny-llama")
    ap.add_argument("--log-dir", type=Path, default=REPO / "runs" / "demo")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument(
        "--cert-dir", type=Path, default=REPO / "certs", help="mTLS certificates (`make certs`; made if missing)"
    )
    args = ap.parse_args(argv)
    out = sys.stdout
    out.write(f"model: {make_model(args.model_dir)}\n")
    lengths = [129 + (i * 97) % 800 for i in range(args.requests)]
    prompts = [[(31 * j + 7 * i) % 1000 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    t0 = time.monotonic()
    out.write("starting scheduler, prefill, decode and a reference vLLM (1-2 minutes on 2 cores)...\n")
    out.flush()
    with pd_cluster(args.model_dir, args.log_dir, cert_dir=args.cert_dir) as c:
        out.write(f"cluster up in {time.monotonic() - t0:.0f} s; logs in {args.log_dir}\n")
        assert c.baseline is not None
        c.generate(prompts[0], 2)  # warm-up
        with ThreadPoolExecutor(args.concurrency) as pool:
            results: list[Timed] = list(pool.map(lambda p: c.generate_timed(p, args.max_tokens), prompts))
        refs = [complete(c.baseline.base_url, p, args.max_tokens)[0] for p in prompts]
        out.write(f"\n{'#':>3} {'prompt':>7} {'TTFT ms':>8} {'TPOT ms':>8}  same as single instance\n")
        same = 0
        for i, (r, ref) in enumerate(zip(results, refs, strict=True)):
            ok = r.tokens == ref
            same += ok
            out.write(
                f"{i:>3} {len(prompts[i]):>7} {r.ttft_s * 1e3:>8.1f} {r.tpot_s * 1e3:>8.2f}  {'yes' if ok else 'NO'}\n"
            )
        out.write(f"\n{same}/{len(prompts)} outputs token-identical to the single instance\n")
    out.write("shut down cleanly\n")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
