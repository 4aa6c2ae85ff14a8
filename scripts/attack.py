"""Attacks on the server's aggregation through real Flower runs: one of five clients forges its
update (scripts/attack_client.py: ``scale`` Delta x 1e4, ``flip`` -10 x Delta, ``push`` a step toward
a fixed target model) under each aggregation rule, against the clean run.

    python scripts/attack.py                                    # docs/ROBUSTNESS.md's table
    python scripts/attack.py --attacks flip --aggregations median --rounds 3

Every run is FedACT on digits with 5 clients, all of them training in every round
(``fraction_train=1.0``), so the clean run and every attacked one train the same clients from
the same seed; only partition 0's update differs. ``mean`` runs with the default bounds
(``max_update_ratio``), the robust rules with them too. Each row prints the final test accuracy,
its difference to the clean run under the same rule, and the replies the server rejected.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]
if str(APP_DIR) not in sys.path:
    sys.path.insert(0, str(APP_DIR))

from fedact_app.cli.engine import LocalEngine  # noqa: E402

SETTING = ("num_clients=5 fraction_train=1.0 min_train_nodes=2 local_steps=20 device=cpu "
           "algorithm.lr=3e-3 eval_every=100")
ATTACKS = ("scale", "flip", "push")  # scripts/attack_client.py
AGGREGATIONS = ("mean", "trimmed_mean", "median")


def attack_app(folder: Path, attack: str) -> Path:
    """An app folder whose ClientApp is scripts/attack_client.py with ``ATTACK = attack``."""
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}: allowed {', '.join(ATTACKS)}")
    client = (APP_DIR / "scripts" / "attack_client.py").read_text()
    return app_with_client(folder, "attack_client", client.replace('ATTACK = "scale"', f'ATTACK = "{attack}"', 1))


def app_with_client(folder: Path, module: str, source: str) -> Path:
    """An app folder (made here) whose ClientApp is ``module:app``, written from ``source``: the
    project's pyproject.toml with its clientapp and its FAB's files (``fab-include``) replaced, the
    module, and conf/. The ServerApp and the ClientApp's own imports come from the installed
    ``fedact_app``."""
    folder.mkdir(parents=True)
    pyproject = (APP_DIR / "pyproject.toml").read_text()
    pyproject = re.sub(r'clientapp = "[^"]+"', f'clientapp = "{module}:app"', pyproject)
    pyproject = re.sub(r"fab-include = \[[^\]]*\]", f'fab-include = ["/{module}.py", "conf/**/*.yaml"]', pyproject)
    (folder / "pyproject.toml").write_text(pyproject)
    (folder / f"{module}.py").write_text(source)
    shutil.copytree(APP_DIR / "conf", folder / "conf")
    return folder


def run_case(engine: LocalEngine, workdir: Path, attack: str | None, aggregation: str, rounds: int,
             extra: str = "", timeout: float = 400.0) -> dict:
    """One run: ``attack`` None is the clean run (the project's own app). Returns its final
    ``test_accuracy``, the replies rejected over the run, its status and its log. ``extra``:
    overrides after ``SETTING``'s."""
    name = f"{attack or 'clean'}-{aggregation}"
    app = APP_DIR if attack is None else attack_app(workdir / name / "app", attack)
    output = workdir / name / "out"
    overrides = f"{SETTING} {extra} num_rounds={rounds} aggregation={aggregation} output_dir={output}"
    result = engine.run(app, overrides=overrides, num_supernodes=5, num_cpus_per_client=engine.num_cpus,
                        timeout=timeout)
    case = {"attack": attack or "clean", "aggregation": aggregation, "completed": result.completed,
            "status": result.status, "log": result.log, "accuracy": None, "rejected": None}
    if result.completed:
        (folder,) = list(output.iterdir())
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        case.update(accuracy=rows[-1]["test_accuracy"], rejected=sum(r.get("rejected", 0) for r in rows[1:]),
                    update_norm_ratio=max((r["update_norm_ratio"] for r in rows[1:] if "update_norm_ratio" in r),
                                          default=None))
    return case


def table(cases: list[dict]) -> str:
    """Final accuracy per case, with its difference to the clean run of the same rule."""
    clean = {c["aggregation"]: c["accuracy"] for c in cases if c["attack"] == "clean"}
    lines = [f"{'attack':<8}{'aggregation':<14}{'accuracy':>10}{'vs clean':>10}{'rejected':>10}"]
    for c in cases:
        if c["accuracy"] is None:
            lines.append(f"{c['attack']:<8}{c['aggregation']:<14}  {c['status']}")
            continue
        diff = "" if clean.get(c["aggregation"]) is None else f"{100 * (c['accuracy'] - clean[c['aggregation']]):+.1f}"
        lines.append(f"{c['attack']:<8}{c['aggregation']:<14}{100 * c['accuracy']:>10.1f}{diff:>10}{c['rejected']:>10}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    parser.add_argument("--aggregations", nargs="+", default=list(AGGREGATIONS), choices=AGGREGATIONS)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--overrides", default="", help="more config overrides for every run, e.g. local_steps=10")
    args = parser.parse_args(argv)
    cases = []
    with tempfile.TemporaryDirectory(prefix="fedact-attack-") as tmp, LocalEngine.for_sweep(1, num_cpus=2) as engine:
        for aggregation in args.aggregations:
            for attack in (None, *args.attacks):
                cases.append(run_case(engine, Path(tmp), attack, aggregation, args.rounds, args.overrides))
                print(table(cases).splitlines()[-1], flush=True)
    print(f"\nFedACT on digits, partition 0 of 5 forging: {SETTING} {args.overrides} num_rounds={args.rounds}")
    print(table(cases))


if __name__ == "__main__":
    main(sys.argv[1:])
