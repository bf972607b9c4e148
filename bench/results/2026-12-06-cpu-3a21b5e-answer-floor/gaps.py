"""How a notified call's cost grows with the time the tenant works between two calls (--gap-us): cmp.py's tenant and
answerers, for gaps of 50, 200, 800 and 2600 us (a CUDA context's start on the H200 spent about 2.6 ms a notified
call), 4 rounds, the order of the answerers alternating. Prints the mean time of one call, per answerer and gap.

    python3 gaps.py /tmp/csup /tmp/fastcall.so     (from this folder, as root)
"""

import statistics
import sys

from cmp import run

KINDS = ("product", "python", "native-thread", "c")
GAPS = (50, 200, 800, 2600)


def main(csup: str, fastcall: str) -> None:
    got: dict[tuple[str, int], list[float]] = {}
    for rnd in range(4):
        for gap in GAPS:
            for kind in KINDS if rnd % 2 == 0 else KINDS[::-1]:
                per, _ = run(kind, csup, fastcall, contexts=10 if gap > 800 else 20, gap_us=gap)
                got.setdefault((kind, gap), []).append(per["cuda"])
                print(f"round {rnd + 1}, gap {gap} us, {kind}: us per call cuda {per['cuda']:.1f}, egl {per['egl']:.1f}",
                      flush=True)
    print("\nmedian of the rounds, a CUDA context's call (us):")
    print("answerer | " + " | ".join(f"gap {g} us" for g in GAPS))
    for kind in KINDS:
        print(kind + " | " + " | ".join(f"{statistics.median(got[(kind, g)]):.1f}" for g in GAPS))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
