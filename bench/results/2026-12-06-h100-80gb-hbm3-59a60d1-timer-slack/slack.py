"""Per weight group of the two N=48 runs in cgs.tar.xz (players under the daemon with the default timer slack, and
with 1 ms): the FPS owed by weight, the lowest and highest player's FPS, CPU ms a frame, the median player's 1% low
over its mean FPS, and the worst player's distance from its owed FPS (the suite's `weight_error`).

    python3 slack.py cgs.tar.xz
"""
import json
import sys
import tarfile


def main(path: str) -> None:
    with tarfile.open(path) as tar:
        for name, what in (("cg-48-slack-0", "default timer slack (50 us)"), ("cg-48-slack-1000000", "timer slack 1 ms")):
            per = json.load(tar.extractfile(f"./{name}/report.json"))["per_instance"]
            total, weights = sum(p["fps_mean"] for p in per), sum(p["weight"] for p in per)
            worst = max(abs(p["fps_mean"] / (total * p["weight"] / weights) - 1) for p in per)
            cells = []
            for w in sorted({p["weight"] for p in per}):
                ps = [p for p in per if p["weight"] == w]
                fps = sorted(p["fps_mean"] for p in ps)
                cpu_ms = sum(p["cpu_cores"] for p in ps) / sum(fps) * 1000
                lows = sorted(p["fps_1pct_low"] / p["fps_mean"] for p in ps)
                cells.append(f"weight {w // 100}: owed {total * w / weights:.1f}, got {fps[0]:.1f}-{fps[-1]:.1f}, "
                             f"{cpu_ms:.1f} CPU ms a frame, 1% low {lows[len(lows) // 2]:.2f} of the mean")
            print(f"{what}: {total:.0f} FPS in all, worst player {worst:.1%} off its weight; " + "; ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1])
