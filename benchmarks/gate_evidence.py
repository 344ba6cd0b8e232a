"""Evidence for the regression gate (``benchmarks/gate.py``): it fails a commit that makes
the training step 15% slower and passes an unchanged one, and how often it misfires here.

    python -m genrec.benchmarks.gate_evidence [--runs 5] [--share 0.15]

1. Injected slowdown: a scratch worktree of HEAD gets a real commit whose
   ``Trainer.train_step`` runs the original step (kept as ``_train_step``) and then GEMMs for
   ``--share`` of the step's own CPU time (INJECTION below). Standalone, the gate's workers
   time that commit's new step against its original method in the same rounds
   (``--train-method``): the injection's own cost. Then the gate, full length, with
   base = HEAD and head = that commit: it must fail.
2. Unchanged: the gate ``--runs`` times with base = head = HEAD: each failure is a misfire.

Writes ``results/gate.json`` (the figures, the machine and its CPU model, the load) and
regenerates RESULTS.md; the section is rendered by :func:`gate` below.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from genrec.benchmarks.common import machine, today, update_results_md, write_json
from genrec.benchmarks.gate import (
    FIGURES,
    ROOT,
    GateConfig,
    GateError,
    git,
    remove_worktree,
    run_gate,
    summary_line,
)

ANCHOR = "    def train_step(self, batch: Any) -> dict[str, float]:\n"
INJECTION = '''    def train_step(self, batch: Any) -> dict[str, float]:
        """An injected slowdown (benchmarks/gate_evidence.py): the step, then GEMMs for
        {share} of the step's own CPU time."""
        c0 = time.process_time()
        out = self._train_step(batch)
        until = time.process_time() + {share} * (time.process_time() - c0)
        a = torch.full((64, 64), 1 / 64)
        while time.process_time() < until:
            a = a @ a
        return out

'''


def inject(base: str, share: float, work: Path, repo: Path = ROOT) -> str:
    """A commit on top of ``base`` (not on any branch) whose training step is ``share``
    slower in CPU time; its sha."""
    tree = work / "inject"
    git(repo, "worktree", "add", "--detach", "--quiet", str(tree), base)
    try:
        path = tree / "train" / "trainer.py"
        src = path.read_text()
        if src.count(ANCHOR) != 1:
            raise GateError(f"{path}: expected one `{ANCHOR.strip()}` to wrap; update gate_evidence.ANCHOR")
        path.write_text(src.replace(ANCHOR, INJECTION.format(share=share) + ANCHOR.replace("train_step", "_train_step")))
        git(tree, "-c", "user.name=genrec gate evidence", "-c", "user.email=gate-evidence@genrec.invalid",
            "commit", "--quiet", "--no-verify", "-am", f"Inject a {share:.0%} slower training step (gate evidence)")
        return git(tree, "rev-parse", "HEAD")
    finally:
        remove_worktree(repo, tree)


def brief(report: dict[str, Any]) -> dict[str, Any]:
    """What results/gate.json keeps of a gate report: the verdicts and per-round ratios."""
    return {"failed": report["failed"], "figures": report["figures"], "sides": report["sides"], "seconds": report["seconds"],
            "load_average": report["load_average"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="gate runs on the unchanged commit")
    ap.add_argument("--share", type=float, default=0.15, help="the injected slowdown of the training step")
    ap.add_argument("--rounds", type=int, default=GateConfig.rounds)
    args = ap.parse_args()
    cfg = replace(GateConfig(), rounds=args.rounds)
    base = git(ROOT, "rev-parse", "HEAD")  # fixed now: others may commit while this runs
    log = lambda m: print(m, flush=True)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="genrec-gate-evidence-"))
    try:
        slow = inject(base, args.share, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"injected {args.share:.0%} at {slow[:12]} on {base[:12]}; standalone: new step against the original")
    standalone = run_gate(slow, slow, cfg, log=log, side_args={"base": ("--train-method", "_train_step")})
    log(summary_line("standalone train_step_ms", standalone["figures"]["train_step_ms"]))
    caught = run_gate(base, slow, cfg, log=log)
    for k, f in caught["figures"].items():
        log(summary_line(f"injected {k}", f))
    unchanged = []
    for i in range(args.runs):
        unchanged.append(brief(run_gate(base, base, cfg, log=log)))
        log(f"unchanged run {i + 1}/{args.runs}: {'FAIL (a misfire)' if unchanged[-1]['failed'] else 'pass'}")
    payload = {
        "date": today(), "machine": {**machine(), "threads": cfg.threads}, "load_average_end": os.getloadavg(),
        "command": f"python -m genrec.benchmarks.gate_evidence --runs {args.runs} --share {args.share} "
                   f"--rounds {args.rounds}",
        "gate_command": "python -m genrec.benchmarks.gate --base REV [--head REV]",
        "config": asdict(cfg), "base": base, "share": args.share,
        "standalone": brief(standalone)["figures"]["train_step_ms"],
        "injected": brief(caught),
        "unchanged": unchanged,
        "misfires": sum(u["failed"] for u in unchanged),
    }
    print(f"wrote {write_json('gate', payload)}")
    update_results_md()


# -- the RESULTS.md section ------------------------------------------------------------------

def _cell(f: dict[str, Any]) -> str:
    return f"x{f['ratio']:.3f} ({f['low']:.3f}..{f['high']:.3f})"


def gate(d: dict) -> list[str]:
    from genrec.benchmarks.report import machine_text, table

    cfg, inj = d["config"], d["injected"]
    names = list(FIGURES)
    rows = [["injected slowdown of the training step", *(_cell(inj["figures"][k]) for k in names),
             "FAIL" if inj["failed"] else "pass (missed)"]]
    rows += [[f"unchanged commit, run {i + 1}", *(_cell(u["figures"][k]) for k in names),
              "FAIL (misfire)" if u["failed"] else "pass"] for i, u in enumerate(d["unchanged"])]
    st = d["standalone"]
    sd = {k: statistics.pstdev(math.log(x) for u in d["unchanged"] for x in u["figures"][k]["ratios"]) for k in names}
    top_low = max(u["figures"][k]["low"] for u in d["unchanged"] for k in names)
    return [
        "## Performance-regression gate (training step and engine call, base against head)", "",
        f"Target (issue 35): the gate fails a commit that makes the training step {d['share']:.0%} slower "
        "and passes an unchanged one. Each cell: the median over rounds of head / base CPU time, and its "
        f"interval (order statistics, {inj['figures'][names[0]]['coverage']:.0%} coverage); a figure fails "
        f"when the interval lies above x{1 + cfg['tolerance']:.2f}. {cfg['rounds']} rounds of fresh "
        f"processes, {cfg['blocks']} blocks of each kind a round, the sides taking turns; "
        f"{cfg['threads']} torch thread.", "",
        *table(["run", *names, "gate"], rows), "",
        f"Standalone, the injected step against the original it wraps (same commit, same rounds): "
        f"x{st['ratio']:.3f} ({st['low']:.3f}..{st['high']:.3f}). Misfires on the unchanged commit: "
        f"{d['misfires']} of {len(d['unchanged'])} runs.", "",
        "The noise the tolerance is set against: on the unchanged commit a round's ratio scatters by "
        + ", ".join(f"{sd[k]:.1%} ({k})" for k in names) + " (standard deviation of its log over "
        f"{sum(len(u['figures'][names[0]]['ratios']) for u in d['unchanged'])} rounds); the highest low end "
        f"of an unchanged interval was x{top_low:.3f}, the low end of the injected one "
        f"x{inj['figures'][names[0]]['low']:.3f}, the line x{1 + cfg['tolerance']:.2f}.", "",
        f"Machine: {machine_text(d['machine'])}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in d['load_average_end'])}; {d['date']}. Command: `{d['command']}` "
        f"(the gate itself: `{d['gate_command']}`).", "",
    ]


def gate_summary(d: dict) -> tuple[str, str]:
    inj = d["injected"]["figures"]["train_step_ms"]
    return (f"{d['share']:.0%} slower step {'caught' if d['injected']['failed'] else 'MISSED'} "
            f"(x{inj['ratio']:.2f}); {d['misfires']}/{len(d['unchanged'])} misfires unchanged",
            f"fail x{1 + d['share']:.2f}, pass unchanged")


if __name__ == "__main__":
    main()
