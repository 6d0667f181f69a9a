#!/usr/bin/env python3
"""Print the executables in `cargo ... --no-run --message-format=json` output (stdin).

Used by scripts/gpu-check.sh and scripts/gpu-run.sh to find the test binaries they carry to
the GPU machine.
"""
import json
import sys

for line in sys.stdin:
    try:
        message = json.loads(line)
    except json.JSONDecodeError:
        continue
    if message.get("reason") == "compiler-artifact" and message.get("executable"):
        print(message["executable"])
