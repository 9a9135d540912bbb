"""``longattn sweep`` (a config grid or named ablations, e.g. SKTformer Tables 6-7) and
``longattn noise`` (SKTformer Table 5: uniform input noise on the Image task)."""

from __future__ import annotations

import argparse
from typing import Any

from longattn.commands._args import add_workers_argument, attention_list, seed_list
from longattn.experiment.grid import DEMO_SEEDS, PAPER_SEEDS, load_sweep, run_sweep

NOISE_LEVELS = (0, 2, 4, 8)


def _split(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def _sweep(args: argparse.Namespace) -> int:
    spec = load_sweep(args.config)
    seeds = seed_list(args.seeds) if args.seeds else None
    summary = run_sweep(spec, args.out, preset=args.preset, tasks=_split(args.tasks), extra_overrides=args.overrides,
                        seeds=seeds, resume=args.resume, reference=args.reference, workers=args.workers)
    return 1 if any(cell["error"] for cell in summary["cells"]) else 0


def noise_spec(attentions: list[str], levels: list[float]) -> dict[str, Any]:
    """Rows = mechanisms, columns = noise amplitude a of U(-a, a) added to every pixel (train and test)."""
    return {
        "title": "Image task with uniform noise U(-a, a) (SKTformer Table 5)",
        "tasks": ["image"],
        "variants": [{"name": name, "attention": name} for name in attentions],
        "columns": {"key": "data.options.noise_amplitude", "values": levels},
        "average": False,
        "paper": {
            "softmax": {"noise_amplitude=0": 41.39, "noise_amplitude=2": 40.29, "noise_amplitude=4": 28.56,
                        "noise_amplitude=8": 28.12},
            "skeleton": {"noise_amplitude=0": 57.47, "noise_amplitude=2": 57.06, "noise_amplitude=4": 55.32,
                         "noise_amplitude=8": 54.70},
            "nystrom": {"noise_amplitude=0": 41.52, "noise_amplitude=2": 40.89, "noise_amplitude=4": 38.39,
                        "noise_amplitude=8": 37.84},
            "linformer": {"noise_amplitude=0": 38.43, "noise_amplitude=2": 37.99, "noise_amplitude=4": 37.04,
                          "noise_amplitude=8": 36.65},
            "performer": {"noise_amplitude=0": 42.66, "noise_amplitude=2": 41.95, "noise_amplitude=4": 39.61,
                          "noise_amplitude=8": 38.86},
        },
    }


def _noise(args: argparse.Namespace) -> int:
    try:
        levels = [float(v) if "." in v else int(v) for v in _split(args.levels) or []]
    except ValueError:
        raise ValueError(f"--levels must be comma-separated numbers, got {args.levels!r}") from None
    spec = noise_spec(attention_list(args.attentions), levels)
    seeds = seed_list(args.seeds) if args.seeds else None
    summary = run_sweep(spec, args.out, preset=args.preset, extra_overrides=args.overrides, seeds=seeds,
                        resume=args.resume, reference=args.reference, workers=args.workers)
    return 1 if any(cell["error"] for cell in summary["cells"]) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sweep", help="train over a config grid / ablation list and write a result table",
                              description="Run every row (grid point or named variant) of a sweep file on every "
                              "task; write table.md and results.json (see docs/lra.md for the file format).")
    p.add_argument("--config", required=True, help="sweep file, or the name of a shipped one: configs/lra/sweeps/skt_table7_r.yaml or skt_table7_r")
    p.add_argument("--preset", help="task preset to use instead of the sweep file's (e.g. demo for a quick check)")
    p.add_argument("--tasks", help="comma-separated subset of the sweep's tasks")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every run (repeatable)")
    p.add_argument("--seeds", help=f"comma-separated seeds (default: the sweep file's, else {DEMO_SEEDS} for the "
                   f"demo preset and {PAPER_SEEDS} for the papers')")
    p.add_argument("--reference", help="row the others are compared with, paired by seed (default: the sweep "
                   "file's `reference`, else its first row)")
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true", help="reuse finished runs, resume interrupted ones")
    add_workers_argument(p)
    p.set_defaults(func=_sweep)

    n = subparsers.add_parser("noise", help="noise robustness on Image (SKTformer Table 5)",
                              description="Train each mechanism on Image with U(-a, a) noise added to every pixel "
                              "(dataset option noise_amplitude) for each level a; write table.md.")
    n.add_argument("--attentions", default="softmax,skeleton,nystrom,linformer,performer")
    n.add_argument("--levels", default=",".join(str(v) for v in NOISE_LEVELS))
    n.add_argument("--preset", default="skt_noise", help="Image preset (default: 5k steps as in the paper)")
    n.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    n.add_argument("--seeds", help=f"comma-separated seeds (default: {PAPER_SEEDS}, the paper's replicates; "
                   f"{DEMO_SEEDS} with --preset demo)")
    n.add_argument("--reference", help="mechanism the others are compared with (default: the first)")
    n.add_argument("--out", required=True)
    n.add_argument("--resume", action="store_true")
    add_workers_argument(n)
    n.set_defaults(func=_noise)
