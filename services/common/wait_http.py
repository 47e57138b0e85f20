"""Waits until an HTTP endpoint answers 200, e.g. a vLLM server's /health (systemd ExecStartPost).

``python -m kvpush.services.common.wait_http [--timeout S] [--interval S] URL``: exit 0 once a GET of URL
returns 200, exit 1 when ``--timeout`` passes first. Standard library only.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request


def wait(url: str, timeout_s: float, interval_s: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=max(0.1, min(5.0, interval_s * 5))) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() + interval_s > deadline:
            return False
        time.sleep(interval_s)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("url")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between attempts")
    args = p.parse_args(argv)
    if not wait(args.url, args.timeout, args.interval):
        sys.stderr.write(f"wait_http: {args.url} did not answer 200 within {args.timeout:g}s\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
