"""Reads a foldmoe run's TensorBoard event files with TensorBoard's own
reader and with tbparse, and checks them against the run's metrics.jsonl.

Not run in CI (it needs Python packages); run once by hand:

    python3 -m venv /tmp/tbv && /tmp/tbv/bin/pip install tensorboard tbparse
    cargo run --release -- train --steps 12 --out /tmp/tbrun --sample-tokens 0
    /tmp/tbv/bin/python scripts/tensorboard_check.py /tmp/tbrun

It prints the tags, their step counts and first/last values, and exits
non-zero when a file does not parse or a value differs from metrics.jsonl
by more than float32 rounding.
"""

import json
import math
import sys
from pathlib import Path

from tbparse import SummaryReader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main(run_dir: Path) -> int:
    tb = run_dir / "tb"
    files = sorted(p.name for p in tb.iterdir() if "tfevents" in p.name)
    print(f"event files in {tb}: {files}")

    # TensorBoard's loader: verifies every record's CRCs as it reads, and
    # applies the session-start purge of a resumed run.
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    print(f"tensorboard: {len(tags)} scalar tags")
    for tag in sorted(tags):
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        print(f"  {tag:<32} {len(events):>4} points, steps {steps[0]}..{steps[-1]}, "
              f"first {events[0].value:.6g}, last {events[-1].value:.6g}")

    df = SummaryReader(str(tb)).scalars
    print(f"tbparse: {len(df)} rows, {df['tag'].nunique()} tags")

    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l]
    failures = []

    def check(tag, want_by_step):
        got = {e.step: e.value for e in acc.Scalars(tag)}
        if sorted(got) != sorted(want_by_step):
            failures.append(f"{tag}: steps {sorted(got)} vs {sorted(want_by_step)}")
            return
        for step, want in want_by_step.items():
            if not math.isclose(got[step], want, rel_tol=1e-6, abs_tol=1e-30):
                failures.append(f"{tag} step {step}: {got[step]} vs {want}")

    check("lm loss", {l["step"]: l["loss"] for l in lines})
    check("learning-rate", {l["step"]: l["lr"] for l in lines})
    check("grad-norm", {l["step"]: l["grad_norm"] for l in lines})
    check("throughput", {l["step"]: l["tokens_per_s"] for l in lines})
    check("lm loss validation", {l["step"]: l["val_loss"] for l in lines if l["val_loss"] is not None})
    for key, counts in lines[-1].get("expert_load", {}).items():
        for e in range(len(counts)):
            check(f"moe/load/{key}/expert_{e}",
                  {l["step"]: l["expert_load"][key][e] for l in lines})
    # tbparse sees the same points as TensorBoard's loader.
    loss_rows = df[df["tag"] == "lm loss"]
    if len(loss_rows) != len(lines):
        failures.append(f"tbparse: {len(loss_rows)} lm loss rows vs {len(lines)} steps")
    for f in failures:
        print("MISMATCH", f)
    print("ok" if not failures else f"{len(failures)} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
