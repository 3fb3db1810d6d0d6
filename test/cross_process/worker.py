"""One OS process of test/cross_process/shared_bucket_test.exs, in Python:

    python3 worker.py HOST:PORT DURATION_MS

Once connected it prints "ready" and waits for a line on stdin; then it checks one bucket
(capacity 5, 20/s) through the bourse_daemon at HOST:PORT for DURATION_MS, sleeping the
delays it is told, and prints
"admitted=N start_us=S end_us=E" with the wall-clock times of its first and last check.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))

from bourse_client import BourseClient  # noqa: E402

LIMIT = {"capacity": 5, "refill_per_sec": 20}


def main() -> None:
    address, duration_ms = sys.argv[1:]
    host, port = address.rsplit(":", 1)
    with BourseClient((host, int(port))) as limiter:
        print("ready", flush=True)
        sys.stdin.readline()
        start = time.time()
        deadline = time.monotonic() + int(duration_ms) / 1000
        admitted = 0
        while (left := deadline - time.monotonic()) > 0:
            decision = limiter.check("binance", "shared-key", LIMIT, axis="request")
            if decision.admitted:
                admitted += 1
            else:
                time.sleep(min(decision.ms / 1000, left))
        end = time.time()
    print(f"admitted={admitted} start_us={int(start * 1e6)} end_us={int(end * 1e6)}")


if __name__ == "__main__":
    main()
