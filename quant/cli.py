"""Handler for ``genrec quantize`` (parsing lives in ``genrec.cli``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from genrec.quant.ann import IndexConfig
from genrec.quant.convert import QuantizeConfig, export, format_report


def cmd_quantize(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise SystemExit(f"genrec quantize takes no config overrides: {overrides}")
    index = IndexConfig(factory=args.index, shortlist=args.index_shortlist, target=args.index_recall)
    qcfg = QuantizeConfig(embeddings=args.embeddings, dense=args.dense, row_alignment=args.row_alignment, index=index)
    report = export(args.checkpoint, args.out, qcfg, eval_data=args.eval, progress=not args.no_progress,
                    measure_accuracy=not args.no_eval)
    (Path(args.out) / "quantization_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out} ({sum(report['sizes']['files'].values()) / 1e6:.2f} MB on disk)")
    print(format_report(report))
    return 0
