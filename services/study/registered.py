"""`spopp study compare`: does one arm beat the other on *this* model and task? A pre-registered,
paired comparison that refuses a design which cannot answer and writes its own conclusions.

1. **prior**: the config must name an offline prior (checked before anything runs).
2. **pilot**: both arms on the pilot seeds (never main seeds), with the main runs' config, in
   `<out>/pilot/runs/<arm>-s<seed>/`. From them: version-0 success, the last point, outcomes per
   prompt (the design checks, services/study/design.py) and the paired s.d. of the primary metric.
3. **size**: n for 80 % power of the paired t test against the planned effect at the pilot's s.d.,
   never under 6 pairs (spopp.compare.stats.pairs_for_power); a budget that cannot pay for n pairs at the
   pilot's mean run time is refused, naming n. A refusal after the pilot (a design check or the
   budget) is the study's result: study.json and README.md say why, with the pilot's numbers, the
   n it would need and the command that runs it.
4. **register**: `<out>/protocol.json` (services/study/registration.py), before the first main run.
5. **main**: both arms on seeds first_seed .. first_seed + n - 1 into `<out>/runs/`, every run
   carrying the protocol's hash; common random numbers (the arms of one seed share their study).
6. **page**: `<out>/study.json` (every number) and `<out>/README.md` (services/study/study_page.py).

Every run must record its code, and one code for them all (spopp.files.provenance). Each stage is
skipped when its output is there, so a stopped study resumes where it stopped; a resumed study is
checked against its protocol first.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from services.config.launch import LaunchSettings
from spopp.compare.stats import pairs_for_power
from spopp.files import provenance

from . import conclusions, design, registration, same_code
from .analysis import analyse, heldout_usable, metrics_planned
from .compare import arm_settings, run_in_turn
from .measures import RunMeasures, StudyDataError, measure

STUDY_FILE = "study.json"
PAGE_FILE = "README.md"


class StudyRefused(RuntimeError):
    """The study stops before its main runs: a design check failed, the budget cannot pay for n,
    or what is asked does not fit the registered protocol. The message names what to change."""


@dataclass
class Request:
    """What the user asked of one study."""

    base: LaunchSettings
    out: Path
    arms: tuple[str, str] = ("spo", "spopp")  # (control, treatment)
    pilot_seeds: list[int] = field(default_factory=lambda: [1000, 1001, 1002])
    first_seed: int = 0
    effect: float = 2.5  # points: the paper's Math-TIR Δ area, SPO++ − SPO
    power: float = 0.8
    primary: str = "trapezoid"
    budget_s: float | None = None
    force: bool = False
    config: Path | None = None  # the config's path as given, for the command a refusal's page names

    def options(self) -> dict:
        values = self.base.model_dump(mode="json", exclude={"run", "run_dir", "api_token"})
        return {
            "config_sha256": registration.config_sha256(values), "arms": list(self.arms), "primary": self.primary,
            "effect": self.effect, "power": self.power, "pilot_seeds": self.pilot_seeds, "first_seed": self.first_seed,
        }  # fmt: skip


def _settings(
    req: Request, seeds: list[int], out: Path, protocol: str | None = None
) -> list[tuple[str, LaunchSettings]]:
    return [("", arm_settings(req.base, arm, seed, out, protocol)) for seed in seeds for arm in req.arms]


def _one_code(req: Request, planned: list[tuple[str, LaunchSettings]], what: str) -> None:
    """Before any of `planned` starts: this checkout's code and that of the runs there are one."""
    try:
        same_code.check([s.run_dir for _label, s in planned], req.out, "refuse", what)
    except provenance.MixedCode as exc:
        raise StudyRefused(str(exc)) from None


def _measured(planned: list[tuple[str, LaunchSettings]], what: str) -> list[RunMeasures]:
    """The finished runs' measures; every one must record its code, and one code for all of them."""
    runs = [measure(s.run_dir) for _label, s in planned]
    missing = [r.folder.name for r in runs if r.code is None]
    if missing:
        raise StudyRefused(f"{what}: runs without a recorded code ({', '.join(missing)}): a study compares only "
                           "runs whose code is known; run them again from a clean checkout")  # fmt: skip
    try:
        provenance.check({r.folder.name: r.code for r in runs}, "refuse", what)
    except provenance.MixedCode as exc:
        raise StudyRefused(str(exc)) from None
    return runs


def pilot_design(req: Request, runs: list[RunMeasures]) -> dict:
    """What the pilot says of the design: its checks, the primary metric's paired s.d., n, the
    mean run time and whether held-out curves make a metric."""
    v0 = [r.v0_success for r in runs]
    checks = [
        design.prior_check(req.base.prior),
        design.headroom_check([v for v, _ in v0], v0[0][1]),
        design.ceiling_check([r.online[-1] for r in runs]),
        design.outcomes_check([r.outcomes_per_prompt for r in runs if r.outcomes_per_prompt is not None]),
    ]
    heldout, heldout_why = heldout_usable(runs)
    pilot = analyse(runs, req.arms, req.primary, heldout=False)
    sd = pilot["diffs"][pilot["primary"]]["sd"]
    n = pairs_for_power(req.effect, sd, req.power)
    seconds = [r.seconds for r in runs if r.seconds is not None]
    mean_s = math.fsum(seconds) / len(seconds) if seconds else None
    names = list(dict.fromkeys(k for r in runs for k in r.time_parts))
    time_parts = {k: math.fsum(r.time_parts.get(k, 0.0) for r in runs) / len(runs) for k in names}
    return {
        "checks": [c.as_dict() for c in checks], "pilot_sd": sd, "pilot_mean": pilot["diffs"][pilot["primary"]]["mean"],
        "n": n, "mean_run_s": mean_s, "pilot_s": math.fsum(seconds), "heldout": heldout, "heldout_why": heldout_why,
        "time_parts": time_parts,
        "pilot": pilot,
    }  # fmt: skip


def _refuse_design(req: Request, found: dict) -> list[dict]:
    """The failed checks (to be stated on the page under --force); StudyRefused without --force."""
    bad = [c for c in found["checks"] if not c["ok"]]
    if bad and not req.force:
        lines = "\n".join(design.Check(**c).line() for c in found["checks"])
        raise StudyRefused(
            f"the design cannot answer ({len(bad)} check{'s' if len(bad) > 1 else ''} failed):\n{lines}\n"
            f"change the settings named, or run it anyway with --force (the page will say which check failed)"
        )
    return bad


def _main_seconds(req: Request, found: dict) -> float | None:
    """The main runs' estimated seconds: n pairs of every arm at the pilot's mean run time."""
    if found["mean_run_s"] is None:
        return None
    return found["n"] * len(req.arms) * found["mean_run_s"]


def _refuse_budget(req: Request, found: dict) -> float | None:
    """The main runs' estimated seconds; StudyRefused when the budget left after the pilot cannot pay."""
    need = _main_seconds(req, found)
    if need is None:
        return None
    if req.budget_s is not None and need > req.budget_s - found["pilot_s"]:
        left = max(0.0, req.budget_s - found["pilot_s"])
        affordable = int(left // (len(req.arms) * found["mean_run_s"]))
        raise StudyRefused(
            f"the budget cannot pay for the study: n = {found['n']} pairs (80 % power against {req.effect:+g} points "
            f"at the pilot's s.d. {found['pilot_sd']:.3g}) need {need / 3600:.2f} h at the pilot's "
            f"{found['mean_run_s'] / 60:.1f} min a run, and {left / 3600:.2f} h are left after the pilot "
            f"({affordable} pairs). Give --budget-hours {math.ceil((need + found['pilot_s']) / 360) / 10:g} or more, "
            "a faster engine or smaller runs"
        )  # fmt: skip
    return need


def register(req: Request, found: dict, forced: list[dict], need: float | None) -> tuple[dict, str]:
    control, treatment = req.arms
    seeds = list(range(req.first_seed, req.first_seed + found["n"]))
    if clash := sorted(set(seeds) & set(req.pilot_seeds)):
        raise StudyRefused(f"main seeds {clash} are pilot seeds: give --first-seed past them")
    protocol = {
        "hypothesis": registration.hypothesis(control, treatment, req.primary),
        **req.options(), "metrics": metrics_planned(req.primary, found["heldout"]), "analysis": registration.ANALYSIS,
        "n": found["n"], "seeds": seeds, "stopping_rule": registration.STOPPING_RULE,
        "pilot": {k: found[k] for k in ("pilot_sd", "pilot_mean", "mean_run_s", "pilot_s", "heldout_why", "time_parts")},
        "design_checks": found["checks"], "forced": [c["name"] for c in forced],
        "budget_hours": None if req.budget_s is None else req.budget_s / 3600,
        "estimated_main_hours": None if need is None else need / 3600,
        "code": provenance.code(exclude=[req.out]),
    }  # fmt: skip
    return protocol, registration.write(req.out, protocol)


def _prepare(req: Request, echo) -> tuple[dict, str] | int:
    """The registered protocol (read back, or decided from the pilot and written); an exit code
    when the pilot stopped."""
    found = registration.read(req.out)
    if found is not None:
        registration.check_options(found[0], req.options(), req.out)
        return found
    prior = design.prior_check(req.base.prior)
    if not prior.ok and not req.force:
        raise StudyRefused(f"the design cannot answer:\n{prior.line()}\n(or run it anyway with --force)")
    pilot = _settings(req, req.pilot_seeds, req.out / "pilot")
    _one_code(req, pilot, f"the pilot of {req.out}")
    _launchers, code = run_in_turn(pilot, echo, "pilot")
    if code != 0:
        return code
    pilot_runs = _measured(pilot, f"the pilot of {req.out}")
    result = pilot_design(req, pilot_runs)
    (req.out / "pilot" / "design.json").write_text(json.dumps(result, indent=1) + "\n")
    for check in result["checks"]:
        echo(design.Check(**check).line())
    if result["time_parts"]:
        spent = ", ".join(f"{name} {s / 60:.1f} min" for name, s in result["time_parts"].items())
        echo(f"a pilot run's time, on average: {spent}")
    try:
        forced = _refuse_design(req, result)
        need = _refuse_budget(req, result)
    except StudyRefused as exc:  # the refusal is the study's result: its page says why, with its numbers
        write_study(req.out, refusal(req, result, str(exc), pilot_runs))
        echo(f"wrote the refusal's page {req.out / PAGE_FILE}")
        raise
    echo(
        f"n = {result['n']} pairs (pilot s.d. {result['pilot_sd']:.3g} points, effect {req.effect:+g}); registering"
    )
    return register(req, result, forced, need)


def run_study(req: Request, echo=print) -> int:
    """The whole study (resuming where it stopped); answers the exit code. StudyRefused,
    registration.ProtocolError and StudyDataError say why it stops before or after the main runs."""
    prepared = _prepare(req, echo)
    if isinstance(prepared, int):
        return prepared
    protocol, digest = prepared
    main = _settings(req, protocol["seeds"], req.out, digest)
    carried = {}
    for _label, s in main:
        try:
            carried[s.run_dir.name] = measure_protocol(s.run_dir)
        except FileNotFoundError:
            continue
    registration.check_runs(digest, carried, req.out)
    pilot = _settings(req, req.pilot_seeds, req.out / "pilot")
    _one_code(req, pilot + main, f"the study in {req.out}")
    _launchers, code = run_in_turn(main, echo, "study")
    if code != 0:
        return code
    runs = _measured(main, f"the main runs of {req.out}")
    write_study(req.out, summarize(protocol, digest, runs, _measured_pilot(req)))
    echo(f"wrote {req.out / STUDY_FILE} and {req.out / PAGE_FILE}")
    return 0


def measure_protocol(folder: Path) -> str | None:
    """The protocol hash a run folder's run.json carries (FileNotFoundError before it started)."""
    from spopp.files.records import RunRecord

    text = (folder / "run.json").read_text(encoding="utf-8")
    try:
        return RunRecord.model_validate_json(text).protocol
    except ValueError as exc:
        raise StudyDataError(f"{folder / 'run.json'}: unreadable ({str(exc).splitlines()[0]})") from None


def _measured_pilot(req: Request) -> list[RunMeasures]:
    return _measured(_settings(req, req.pilot_seeds, req.out / "pilot"), f"the pilot of {req.out}")


def summarize(protocol: dict, digest: str, runs: list[RunMeasures], pilot: list[RunMeasures]) -> dict:
    """study.json's content: the protocol, every run, the analysis and its sentences."""
    arms = (protocol["arms"][0], protocol["arms"][1])
    heldout = "held-out area" in protocol["metrics"] and heldout_usable(runs)[0]
    result = analyse(runs, arms, protocol["primary"], heldout)
    forced = [c for c in protocol["design_checks"] if c["name"] in protocol["forced"]]
    everything = pilot + runs
    return {
        "protocol": protocol, "protocol_sha256": digest, "result": result,
        "conclusions": conclusions.conclude(result, protocol["effect"], forced),
        "runs": [_run_row(r) for r in runs], "pilot_runs": [_run_row(r) for r in pilot],
        "machine_hours": math.fsum(r.seconds or 0.0 for r in everything) / 3600,
        "code": provenance.agree({f"{r.folder.parent.parent.name}/{r.folder.name}": r.code for r in everything}),
    }  # fmt: skip


def refusal(req: Request, found: dict, why: str, pilot: list[RunMeasures]) -> dict:
    """study.json of a study refused after its pilot: why, the pilot's numbers (found by
    pilot_design), the n a study that can answer needs, the hours it would take at the pilot's
    run time, and the sentences generated from them."""
    need = _main_seconds(req, found)
    need_h = None if need is None else (need + found["pilot_s"]) / 3600
    bad = [c["name"] for c in found["checks"] if not c["ok"]]
    return {
        "status": "refused", "refusal": why,
        "request": {**req.options(), "budget_hours": None if req.budget_s is None else req.budget_s / 3600,
                    "force": req.force, "config": None if req.config is None else str(req.config),
                    "out": str(req.out)},
        "design": found, "forced": bad if req.force else [], "needed_hours": need_h,
        "conclusions": conclusions.refused(found, req.effect, req.arms, need_h),
        "pilot_runs": [_run_row(r) for r in pilot],
        "machine_hours": found["pilot_s"] / 3600,
        "code": provenance.agree({f"pilot/{r.folder.name}": r.code for r in pilot}),
    }  # fmt: skip


def _run_row(r: RunMeasures) -> dict:
    return {
        "run": r.folder.name, "arm": r.arm, "seed": r.seed, "online": r.online, "heldout": r.heldout,
        "heldout_versions": r.heldout_versions, "outcomes_per_prompt": r.outcomes_per_prompt, "seconds": r.seconds,
        "time_parts": r.time_parts,
        "v0_success": r.v0_success[0],
    }  # fmt: skip


def write_study(out: Path, study: dict) -> None:
    from .study_page import render

    (out / STUDY_FILE).write_text(json.dumps(study, indent=1) + "\n")
    (out / PAGE_FILE).write_text(render(study))
