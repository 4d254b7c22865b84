"""A 1B-parameter model on home links, on paper: per round, the upload, outer step and download
each codec costs against the compute of H inner steps, blocking (``--sync rounds``) and
overlapped (``--sync overlap``); and the smallest H at which each keeps compute utilisation
at 0.9 or more.

What is measured here: the bytes a pseudo-gradient (and a broadcast move) takes per parameter
in each codec's real file format — a ``gpt2-small`` delta (85.5M parameters) written with
``write_delta`` — and the outer step's seconds per parameter on this machine's CPU
(``bigmodel_codecs.json``, from ``bigmodel.py --part outer --codecs``; ternary takes int4's,
the same streaming path). What is assumed, and stated: the links (20 Mbit/s up, 100 down, each
trainer its own), a 1B model's step on a consumer GPU (``--tokens-per-s``, default 10k: a 4090
at 1B; ``--tokens-per-step`` 32k), a coordinator outer step as fast per parameter as this CPU's.
What it leaves out: per-task overhead (a few round trips at the link's RTT, measured in
``wan.py``), several trainers sharing the coordinator's downlink, and the evaluation (off the
critical path: the next round is queued before it).

Blocking: utilisation = C / (C + up + outer + down). Overlapped: round r+2 needs θ_{r+1}, whose
upload (of round r), outer step and download run while round r+1 trains, so utilisation =
min(1, C / (up + outer + down)) (the uplink then carries one round's upload per round's compute).

    python benchmarks/paper_1b.py [--params 1e9] [--up 20] [--down 100] [--tokens-per-s 10000]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from _common import RESULTS, machine, table, write_outputs

CODECS = ("fp32", "int8", "int4", "ternary", "int2")
# (uploaded pseudo-gradients, downloaded moves): each codec both ways, and ternary up with a
# finer codec down (`--codec ternary --broadcast-codec ...`)
PAIRS = [*((c, c) for c in CODECS), ("ternary", "int4"), ("ternary", "int2")]
HS = (25, 50, 100, 200, 500)


def bytes_per_param() -> dict[str, float]:
    """Each codec's pseudo-gradient file size per parameter, for gpt2-small's tensors."""
    import torch

    from tensorturn.recipes import resolve
    from tensorturn.store.tensorfile import write_delta
    from tensorturn.train.diloco import initial_state

    theta = initial_state(resolve("gpt2-small", {"context": 32}), 0)
    delta = {k: torch.randn_like(v) * 1e-3 for k, v in theta.items() if v.is_floating_point()}
    params = sum(v.numel() for v in delta.values())
    sizes = {}
    with tempfile.TemporaryDirectory(prefix="tt-paper-") as tmp:
        for codec in CODECS:
            path = Path(tmp) / codec
            write_delta(path, delta, codec, {"samples": "1", "loss": "0.0", "bytes_down": f"{0:015d}"})
            sizes[codec] = path.stat().st_size / params
            path.unlink()
    return sizes


def outer_s_per_param() -> dict[str, float]:
    doc = json.loads((RESULTS / "bigmodel_codecs.json").read_text())
    rates = {r["codec"]: r["seconds"] / r["params"] for r in doc["outer"] if r["how"] == "streaming"}
    rates.setdefault("ternary", rates["int4"])
    rates.setdefault("int2", rates["int4"])
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--up", type=float, default=20, help="Mbit/s up per trainer")
    ap.add_argument("--down", type=float, default=100, help="Mbit/s down per trainer")
    ap.add_argument("--tokens-per-s", type=float, default=10_000)
    ap.add_argument("--tokens-per-step", type=float, default=32_768)
    args = ap.parse_args()
    per_param, outer_rate = bytes_per_param(), outer_s_per_param()
    step_s = args.tokens_per_step / args.tokens_per_s
    rows = []
    for up_codec, down_codec in PAIRS:
        codec = up_codec if up_codec == down_codec else f"{up_codec} up, {down_codec} down"
        up = per_param[up_codec] * args.params * 8 / (args.up * 1e6)
        down = per_param[down_codec] * args.params * 8 / (args.down * 1e6)  # the broadcast move
        outer = outer_rate[down_codec] * args.params
        comm = up + outer + down
        both = per_param[up_codec] + per_param[down_codec]
        row = {"codec": codec, "bytes_per_param": both / 2, "fp32_over": 2 * per_param["fp32"] / both,
               "up_s": up, "outer_s": outer, "down_s": down}
        for h in HS:
            c = h * step_s
            row[f"blocking_H{h}"] = c / (c + comm)
            row[f"overlap_H{h}"] = min(1.0, c / comm)
        row["blocking_H_for_0.9"] = math.ceil(9 * comm / step_s)  # C ≥ 9 × comm
        row["overlap_H_for_0.9"] = math.ceil(0.9 * comm / step_s)
        rows.append(row)
    print(f"{args.params / 1e9:g}B parameters; links {args.up:g}/{args.down:g} Mbit/s; a step "
          f"{step_s:.2f} s ({args.tokens_per_step:,.0f} tokens at {args.tokens_per_s:,.0f} tokens/s)\n")
    print(table(["codec", "bytes/param (mean of up and down)", "fp32 ÷", "up s", "outer s", "down s",
                 *[f"blocking H={h}" for h in HS], *[f"overlap H={h}" for h in HS],
                 "H for 0.9 blocking", "H for 0.9 overlap"],
                [[r["codec"], f"{r['bytes_per_param']:.4f}", f"{r['fp32_over']:.1f}×", f"{r['up_s']:.0f}",
                  f"{r['outer_s']:.0f}", f"{r['down_s']:.0f}",
                  *[f"{r[f'blocking_H{h}']:.2f}" for h in HS], *[f"{r[f'overlap_H{h}']:.2f}" for h in HS],
                  r["blocking_H_for_0.9"], r["overlap_H_for_0.9"]] for r in rows]))
    from _common import figure

    fig = figure(7, 4)
    ax = fig.subplots()
    for r in rows:
        ax.plot(HS, [r[f"blocking_H{h}"] for h in HS], marker="o", label=f"{r['codec']} blocking")
        ax.plot(HS, [r[f"overlap_H{h}"] for h in HS], marker="s", linestyle="--", label=f"{r['codec']} overlap")
    ax.axhline(0.9, color="grey", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("H (inner steps per round)")
    ax.set_ylabel("compute utilisation (on paper)")
    ax.legend(fontsize=6, ncol=2)
    write_outputs("paper_1b", {"machine": machine(), "args": vars(args), "rows": rows}, fig)


if __name__ == "__main__":
    main()
