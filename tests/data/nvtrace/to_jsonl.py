"""A shim log (shim.c) -> the jsonl of tests/data: every call the memory hooks follow, in order, with the driver's answer.

usage: python3 tests/data/nvtrace/to_jsonl.py LOG > tests/data/NAME.jsonl
"""

from __future__ import annotations

import json
import sys
from typing import Any

CHANNELS = {0x906F, 0xA06F, 0xA16F, 0xB06F, 0xC06F, 0xC36F, 0xC46F, 0xC56F, 0xC86F, 0xC96F, 0xCA6F}
HANDLE_PROVIDED = 0x4000  # NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED: else hMemory is the driver's answer


def h(v: int) -> str:
    return f"{v:#x}"


def convert(line: str) -> dict[str, Any] | None:
    """One logged escape as the test's record; None for an escape the hooks do not follow."""
    p = line.split()
    enr = int(p[2], 16)
    b = [int(x, 16) for x in p[5][2:].split(",")]
    tags = dict(t.split("=", 1) for t in p[7:])
    d: dict[str, Any]
    if enr in (0x2B, 0x28, 0x27):
        d = {"esc": h(enr), "root": h(b[0]), "parent": h(b[1]), "new": h(b[2]), "cls": h(b[3])}
        if enr == 0x2B and b[3] in CHANNELS:
            d["ctx"] = h(int(tags["p"].split(",")[6], 16)) if "p" in tags else None  # hContextShare@24
        got = tags.get("s8")
    elif enr == 0x4A:
        x = [int(v, 16) for v in tags["x"].split(",")]  # the NVOS32 words from offset 40, after the call
        d = {"esc": "0x4a", "root": h(b[0]), "parent": h(b[1]), "function": b[2]}
        if b[2] == 2:
            d.update(handle=h(x[1] if x[3] & HANDLE_PROVIDED else 0), flags=h(x[3]), attr=h(x[4]),
                     bytes=x[12] | (x[13] << 32))
        else:
            d.update(words=[h(v) for v in x[:4]])
        got = tags.get("s44")
    elif enr == 0x29:
        return {"esc": "0x29", "root": h(b[0]), "free": h(b[2])}
    elif enr == 0x34:
        d = {"esc": "0x34", "root": h(b[0]), "parent": h(b[1]), "new": h(b[2]), "src_root": h(b[3]), "src": h(b[4])}
        got = tags.get("s8")
    else:
        return None
    if got:
        d["got"] = "0x" + got
    return d


def main() -> None:
    with open(sys.argv[1]) as log:
        for line in log:
            d = convert(line)
            if d is not None:
                print(json.dumps(d))


if __name__ == "__main__":
    main()
