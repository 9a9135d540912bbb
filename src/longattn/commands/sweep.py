"""The papers' LRA grids as ``longattn paper`` entries: SKTformer Table 5 (uniform input noise on the Image task)
and the shipped sweep files (SKTformer Tables 6-7, Skeinformer Table 1, FSAT Table 3), each a
``longattn compare sweep`` of its file."""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

from longattn.commands._args import (add_attentions_argument, add_data_dir_argument, add_list_argument,
                                    add_resume_argument, add_set_argument, add_workers_argument)
from longattn.commands.compare import _data_dir, _sweep, sweep_arguments
from longattn.experiment.analyses import register_paper

NOISE_LEVELS = (0, 2, 4, 8)
NOISE_ATTENTIONS = ("softmax", "skeleton", "nystrom", "linformer", "performer")


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
    from longattn.experiment.grid import run_sweep

    spec = noise_spec(args.attentions, args.levels)
    summary = run_sweep(spec, args.out, preset=args.preset, extra_overrides=_data_dir(args) + args.overrides,
                        seeds=args.seeds, resume=args.resume, reference=args.reference, workers=args.workers,
                        overwrite=args.overwrite)
    return 1 if any(cell["error"] for cell in summary["cells"]) else 0


def _noise_arguments(parser: argparse.ArgumentParser) -> None:
    from longattn.experiment.grid import DEMO_SEEDS, PAPER_SEEDS

    add_attentions_argument(parser, default=list(NOISE_ATTENTIONS), help="the mechanisms (rows)")
    add_list_argument(parser, "--levels", item=float, kind="level", default=list(NOISE_LEVELS),
                      help="noise amplitudes a of U(-a, a) added to every pixel, train and test (columns)")
    parser.add_argument("--preset", default="skt_noise", help="Image preset (skt_noise: 5k steps as in the paper; "
                        "demo for a quick check) or a YAML file")
    add_data_dir_argument(parser, help="the CIFAR-10 folder (same as --set data.data_dir=DIR)")
    add_set_argument(parser, help="override for every run (repeatable)")
    add_list_argument(parser, "--seeds", item=int, kind="seed", help=f"seeds per cell (default: {PAPER_SEEDS}, the "
                      f"paper's replicates; {DEMO_SEEDS} with --preset demo)")
    parser.add_argument("--reference", help="mechanism the others are compared with (default: the first)")
    parser.add_argument("--out", required=True, help="output folder")
    add_resume_argument(parser)
    add_workers_argument(parser)


register_paper("sktformer-table5", "SKTformer", "Table 5", "robustness to uniform noise on the Image task: each "
               "mechanism trained and tested with U(-a, a) added to every pixel", _noise_arguments, _noise)

# The shipped sweep files that reproduce a paper's table: (entry, paper, table, sweep file, what).
PAPER_SWEEPS = (
    ("sktformer-table6", "SKTformer", "Table 6", "skt_table6_ablation", "removing one component at a time"),
    ("sktformer-table7a", "SKTformer", "Table 7a", "skt_table7_r", "r, the segment count of the Smoother"),
    ("sktformer-table7b", "SKTformer", "Table 7b", "skt_table7_s1", "s1, rows sampled in Row Attention"),
    ("sktformer-table7c", "SKTformer", "Table 7c", "skt_table7_s2", "s2, columns sampled in Column Attention"),
    ("skeinformer-table1", "Skeinformer", "Table 1", "skein_table1", "LRA accuracy of the mechanisms and the "
     "Skeinformer ablations"),
    ("fsat-table3", "FSAT", "Table 3", "fsat_table3", "number of predicted indices and component ablations"),
)
for name, paper, item, sweep, what in PAPER_SWEEPS:
    register_paper(name, paper, item, f"{what} (the sweep file {sweep}: `longattn compare sweep --config {sweep}`)",
                   partial(sweep_arguments, config=sweep), _sweep)
