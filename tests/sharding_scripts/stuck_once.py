"""Harness check for tests/test_sharding.py's _run: the first call fails the way XLA reports a
stuck CPU collective (with --hang: it hangs until common.setup's faulthandler dump ends it; with
--other: it fails some other way), later calls succeed.

python tests/sharding_scripts/stuck_once.py --marker /tmp/m [--hang | --other]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default=None)
    ap.add_argument("--marker", required=True)
    ap.add_argument("--other", action="store_true", help="fail with an unrelated error instead")
    ap.add_argument("--hang", action="store_true", help="hang instead (MASKAHEAD_DUMP_AFTER_S ends it)")
    a = ap.parse_args()
    calls = int(open(a.marker).read()) + 1 if os.path.exists(a.marker) else 1
    with open(a.marker, "w") as f:
        f.write(str(calls))
    if calls == 1 and a.hang:
        from common import setup

        setup()
        time.sleep(3600)
    if calls == 1:
        print("ValueError: a real bug" if a.other else
              "[id=2] Termination timeout for `all reduce` of 240 seconds exceeded. Exiting to "
              "ensure a consistent program state.", file=sys.stderr)
        sys.exit(1 if a.other else 134)
    print(json.dumps({"calls": calls}))


if __name__ == "__main__":
    main()
