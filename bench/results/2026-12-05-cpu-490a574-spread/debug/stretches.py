"""How long the players of a debug stand-in run sat out at a stretch, per weight group: runs of consecutive rationed
steps (12.5 ms each) a player was chosen to sit out, from the daemon's "rationed slice" debug lines, and each tick's
charge on the resource per player; with each player's mean FPS and 1% low over its mean.

    python3 stretches.py 490a574-raw.tar.xz
"""
import io
import json
import statistics
import sys
import tarfile
from collections import defaultdict


def main(path: str) -> None:
    with tarfile.open(path) as tar:
        for n in (6, 12):
            report = json.load(tar.extractfile(f"raw/round-1/unisched-{n}/report.json"))
            group = {p["tenant"]: p["weight"] // 100 for p in report["per_instance"]}
            steps, charges = [], defaultdict(list)
            for line in io.TextIOWrapper(tar.extractfile(f"raw/round-1/unisched-{n}-daemon.log")):
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("event") == "rationed slice":
                    steps += [set(s) for s in e["steps"]] if e["steps"] else [set()] * 4
                    for name, ch in e["charged"].items():
                        if name in group:
                            charges[group[name]].append((ch[0] if isinstance(ch, list) else ch) * 1000)
            runs = defaultdict(list)
            for name, w in group.items():
                k = 0
                for s in steps:
                    if name in s:
                        k += 1
                    elif k:
                        runs[w].append(k)
                        k = 0
            print(f"N={n}")
            for w in sorted(runs):
                r, c = sorted(runs[w]), sorted(charges[w])
                if len(r) < 10:
                    continue
                out = sum(r) / (len(steps) * sum(1 for x in group.values() if x == w))
                print(f"  weight {w}: {len(r)} stretches out, mean {statistics.mean(r):.2f} steps, p90 {r[int(.9 * len(r))]}, "
                      f"p99 {r[int(.99 * len(r))]}, longest {r[-1]}; out of {out:.2f} of the steps; charge a tick (ms) "
                      f"p50 {c[len(c) // 2]:.2f}, p90 {c[int(.9 * len(c))]:.2f}, p99 {c[int(.99 * len(c))]:.2f}")
            players = sorted(report["per_instance"], key=lambda p: p["weight"])
            print("  weight, FPS, 1% low over mean:", [(p["weight"] // 100, round(p["fps_mean"], 1),
                  round(p["fps_1pct_low"] / p["fps_mean"], 2)) for p in players])


if __name__ == "__main__":
    main(sys.argv[1])
