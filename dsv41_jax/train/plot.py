"""``python -m dsv41_jax.train.plot LOG.jsonl OUT.png``: the loss curve of a training log (matplotlib, from the
``train`` extra): the target's training loss every 10 steps and its held-out loss at each evaluation, then the
DSpark stages' draft cross-entropy against the frozen target."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(log: Path, out: Path) -> None:
    import matplotlib  # noqa: PLC0415 - the train extra's, only for this command

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    target = [e for e in entries if e["phase"] == "target"]
    stages = [e for e in entries if e["phase"] == "dspark"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 1.3]})
    a.plot([e["step"] for e in target], [e["lm"] for e in target], label="training batch", lw=1)
    held = [e for e in target if "held_out" in e]
    a.plot([e["step"] for e in held], [e["held_out"] for e in held], "o-", label="held-out", ms=3)
    a.set(xlabel="target step", ylabel="next-token loss (nats)", title="target model", ylim=(3, 9))
    a.grid(alpha=0.3)
    a.legend()
    b.plot([e["step"] for e in stages], [e["draft_xent"] for e in stages], lw=1, color="C2")
    b.set(xlabel="DSpark step", ylabel="draft cross-entropy (nats)", title="DSpark stages")
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m dsv41_jax.train.plot LOG.jsonl OUT.png", file=sys.stderr)
        sys.exit(2)
    plot(Path(sys.argv[1]), Path(sys.argv[2]))
