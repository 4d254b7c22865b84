"""Codecs at equal samples: ``charlm`` fused runs with each ``--codec`` (and each ``--sync``
given), the same seed, shards, H and rounds — final validation and test loss, and the bytes
the shard tasks moved (pseudo-gradients up, weights or broadcast moves down) against fp32's.

On an embedded pool of real agents on this machine (loopback: no link is emulated — the bytes
are the figure here; ``wan.py`` puts them on links). Several seeds, since one run's loss moves
by about a percent with the seed alone.

    python benchmarks/codecs.py [--codecs fp32,int8,int4,ternary] [--syncs rounds] [--seeds 0,1]
                                [--rounds 8] [--sync-every 50] [--shards 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _common import figure, machine, run_job, table, write_outputs

from tensorturn.pool.embedded import LocalPool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codecs", default="fp32,int8,int4,ternary")
    ap.add_argument("--syncs", default="rounds")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--extra", action="append", default=[], metavar="FIELD=VALUE",
                    help="another run field for every run (outer_momentum=0.6, ...)")
    ap.add_argument("--name", default="codecs")
    args = ap.parse_args()
    extra = {k: float(v) if v.replace(".", "", 1).isdigit() else v
             for k, v in (e.split("=", 1) for e in args.extra)}
    runs = []
    with tempfile.TemporaryDirectory(prefix="tt-codecs-") as tmp, \
            LocalPool(args.agents, (Path(tmp) / "store").as_uri(), workdir=Path(tmp) / "pool") as pool:
        for sync in args.syncs.split(","):
            for codec in args.codecs.split(","):
                for seed in (int(s) for s in args.seeds.split(",")):
                    doc = run_job(pool, pool.store_url, timeout_s=3600, mode="fused", recipe="charlm",
                                  rounds=args.rounds, shards=args.shards, sync_every=args.sync_every,
                                  codec=codec, sync=sync, seed=seed, threads_per_task=1, **extra)
                    run = {"sync": sync, "codec": codec, "seed": seed,
                           "val_loss": doc["rounds"][-1]["val_loss"], "test_loss": doc["metrics"]["test_loss"],
                           "bytes_up": doc["bytes_up"], "bytes_down": doc["bytes_down"],
                           "curve": [r["val_loss"] for r in doc["rounds"]]}
                    runs.append(run)
                    print({k: v for k, v in run.items() if k != "curve"}, flush=True)
    rows = []
    for sync in args.syncs.split(","):
        base = [r for r in runs if r["sync"] == sync and r["codec"] == "fp32"] or \
               [r for r in runs if r["codec"] == "fp32"]
        base_val = statistics.mean(r["val_loss"] for r in base) if base else None
        base_up = statistics.mean(r["bytes_up"] for r in base) if base else None
        for codec in args.codecs.split(","):
            mine = [r for r in runs if r["sync"] == sync and r["codec"] == codec]
            val = statistics.mean(r["val_loss"] for r in mine)
            up = statistics.mean(r["bytes_up"] for r in mine)
            rows.append({"sync": sync, "codec": codec, "seeds": len(mine), "val_loss": val,
                         "val_vs_fp32": val / base_val - 1 if base_val else None,
                         "test_loss": statistics.mean(r["test_loss"] for r in mine),
                         "bytes_up": up, "fp32_over_codec_up": base_up / up if base_up else None,
                         "bytes_down": statistics.mean(r["bytes_down"] for r in mine)})
    print(f"\ncharlm, {args.rounds} rounds × {args.shards} shards × H = {args.sync_every}, "
          f"{args.agents} agents, seeds {args.seeds}; loss and bytes: means over seeds\n")
    print(table(["sync", "codec", "seeds", "val loss", "vs fp32 (same sync)", "test loss", "bytes up MB",
                 "fp32 ÷ codec (up)", "bytes down MB"],
                [[r["sync"], r["codec"], r["seeds"], r["val_loss"],
                  f"{r['val_vs_fp32']:+.2%}" if r["val_vs_fp32"] is not None else "—", r["test_loss"],
                  r["bytes_up"] / 1e6, f"{r['fp32_over_codec_up']:.1f}×" if r["fp32_over_codec_up"] else "—",
                  r["bytes_down"] / 1e6] for r in rows]))
    fig = figure(7, 4)
    ax = fig.subplots()
    for sync in args.syncs.split(","):
        for codec in args.codecs.split(","):
            mine = [r["curve"] for r in runs if r["sync"] == sync and r["codec"] == codec]
            ax.plot(range(args.rounds), [statistics.mean(c[i] for c in mine) for i in range(args.rounds)],
                    label=f"{sync} {codec}", marker="o", markersize=3)
    ax.set_xlabel("round")
    ax.set_ylabel("validation loss (mean over seeds)")
    ax.legend(fontsize=7)
    write_outputs(args.name, {"machine": machine(), "args": vars(args), "runs": runs, "rows": rows}, fig)


if __name__ == "__main__":
    main()
