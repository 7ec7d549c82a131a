"""ALFWorld-format games of our own: a PDDL problem per game, in the package's on-disk layout.

Why: the canonical ALFWorld games come from a download that offline machines and CI cannot count
on, and they are too big for a CPU demo. This generator draws games of the six ALFWorld task types
in four room kinds, writes them exactly as `alfworld-download` lays the canonical ones out, and
checks each with the same fast-downward planner `alfworld-generate` uses, so the package's loader
(`AlfredTWEnv`), its engine and this project's `games` module read them unchanged:

    OUT/json_2.1.1/<split>/<task_type>-<Obj>-None-<Parent|Toggle>-<scene>/trial_G<sha1[:12]>/
        traj_data.json       task_type, pddl_params, scene, turk_annotations, generator
        initial_state.pddl   the PDDL problem against the shipped alfred.pddl domain
        game.tw-pddl         JSON: pddl_domain, grammar (goal text filled in), pddl_problem,
                             solvable, walkthrough (the planner's plan, as the agent types it)
    OUT/<split>_seed<S>.txt  the set: one `<split>/<folder>/<trial>` a line

Rooms and splits. Each room kind (kitchen, living room, bedroom, bathroom) has three "seen" layout
variants and one held-out "unseen" variant (`LAYOUTS`). train and valid_seen draw from the seen
layouts, valid_unseen from the unseen ones (`layouts=` overrides: "seen", "unseen" or "all"). On
top of that a game's content hash puts it in one of eight buckets: train keeps only games outside
bucket 0, the valid splits only games in it, so train never shares a game with a valid split,
whatever the seeds and layout choices. Within a task type, layouts are taken round-robin, room
kinds interleaved, in an order shuffled per (split, seed, task type): every feasible layout is
used and no two are used more than one time apart.

Determinism. Every draw comes from `random.Random` keyed by (split, seed, task type, game index,
attempt), so the same arguments give byte-identical files and list, and `per_type=N` gives, per
task type, the first N games of `per_type=N+1`. The trial id is the sha1 of everything written
about the game except the walkthrough (problem, goal text, traj record): one game, one id, wherever
it is generated.

Imports. The problem text is plain Python. Generation reads the package's shipped files (the
domain, the grammar, `gen/constants.py`, `gen/goal_library.py`) by path, without importing the
`alfworld` package: its `__init__` imports `alfworld.info`, which creates `~/.cache/alfworld` and
sets `$ALFWORLD_DATA`. Only the plan check loads the engine (textworld, and alfworld's demangler,
imported with `$ALFWORLD_DATA` and that folder put back as they were). The engine is not
thread-safe: its calls hold the engine's process-wide lock (`engine.ENGINE_LOCK`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from .games import DATA_DIR, TASK_TYPES

__all__ = [
    "LAYOUTS",
    "LAYOUT_CHOICES",
    "SPLITS",
    "TASK_TYPES",
    "GenerationError",
    "Layout",
    "generate_games",
    "planner_walkthrough",
]

# The splits ALFWorld ships layouts for (games.SPLITS adds valid_train, a split of played games).
SPLITS = ("train", "valid_seen", "valid_unseen")
LAYOUT_CHOICES = ("all", "seen", "unseen")
GENERATOR = "spopp.alfworld.generate"
GENERATOR_VERSION = 1

# The appliance each task type needs; its type is never the goal's parent (that would be trivial).
APPLIANCE = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
# The object property each task type needs, by its `VAL_ACTION_OBJECTS` key.
PROPERTY = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
# The demangler names an entity by the id's text before the first "_bar_", and appends "basin" to
# ids holding "basin": so a basin's id is `Sink_bar_01_bar_SinkBasin` ("sinkbasin 1"), as in the
# canonical data; `SinkBasin_bar_01` would read "sinkbasinbasin 1".
BASIN_PREFIX = {"SinkBasin": "Sink", "BathtubBasin": "Bathtub"}
# Games split by content hash: bucket 0 of 8 is for the valid splits, the rest for train.
HASH_BUCKETS = 8
# How likely a target instance starts inside a closed receptacle when it could go either way.
HIDDEN_TARGET_P = 0.4
MAX_EXTRA_TARGETS = 2
# Draws per game before giving up (a valid split keeps one draw in eight; duplicates are rare
# except with very small limits).
MAX_ATTEMPTS = 400
# `movable` and `Sliced` in a path make AlfredTWEnv skip the game.
_FORBIDDEN_IN_PATHS = ("movable", "Sliced")


class GenerationError(ValueError):
    """Bad arguments, or settings too tight to draw the games asked for; the message says which."""


@dataclass(frozen=True)
class Layout:
    """One room: its receptacle types and counts, and the lamps in it (lamp type, host type)."""

    room: str
    variant: int
    scene: int
    heldout: bool
    receptacles: tuple[tuple[str, int], ...]
    lamps: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.room}-{self.variant}"


def _layout(room: str, variant: int, receptacles: dict[str, int], lamps=(), heldout=False) -> Layout:
    base = {"kitchen": 500, "livingroom": 600, "bedroom": 700, "bathroom": 800}[room]
    return Layout(room, variant, base + variant, heldout, tuple(sorted(receptacles.items())), tuple(lamps))


# Scene numbers are ours (5xx-8xx), not AI2-THOR floor plans. Variant 4 of each room is held out.
LAYOUTS: tuple[Layout, ...] = (
    _layout("kitchen", 1, {"CounterTop": 2, "Cabinet": 4, "Drawer": 3, "Fridge": 1, "Microwave": 1,
                           "SinkBasin": 1, "StoveBurner": 2, "DiningTable": 1, "GarbageCan": 1,
                           "CoffeeMachine": 1}),
    _layout("kitchen", 2, {"CounterTop": 1, "Cabinet": 6, "Drawer": 3, "Fridge": 1, "Microwave": 1,
                           "SinkBasin": 1, "StoveBurner": 4, "Shelf": 2, "GarbageCan": 1}),
    _layout("kitchen", 3, {"CounterTop": 3, "Cabinet": 2, "Drawer": 2, "Fridge": 1, "Microwave": 1,
                           "SinkBasin": 1, "StoveBurner": 2, "DiningTable": 1, "SideTable": 1,
                           "GarbageCan": 1}),
    _layout("kitchen", 4, {"CounterTop": 2, "Cabinet": 5, "Drawer": 4, "Fridge": 1, "Microwave": 1,
                           "SinkBasin": 2, "StoveBurner": 4, "DiningTable": 1, "Shelf": 1,
                           "GarbageCan": 1, "CoffeeMachine": 1}, heldout=True),
    _layout("livingroom", 1, {"Sofa": 1, "ArmChair": 1, "CoffeeTable": 1, "SideTable": 2, "TVStand": 1,
                              "Drawer": 2, "Shelf": 2, "GarbageCan": 1},
            lamps=[("FloorLamp", "SideTable")]),
    _layout("livingroom", 2, {"Sofa": 2, "CoffeeTable": 1, "SideTable": 1, "Dresser": 1, "Cabinet": 2,
                              "Ottoman": 1, "GarbageCan": 1},
            lamps=[("DeskLamp", "SideTable")]),
    _layout("livingroom", 3, {"Sofa": 1, "ArmChair": 2, "CoffeeTable": 2, "SideTable": 1, "Drawer": 4,
                              "Shelf": 3, "TVStand": 1, "Safe": 1, "GarbageCan": 1},
            lamps=[("FloorLamp", "SideTable")]),
    _layout("livingroom", 4, {"Sofa": 1, "ArmChair": 1, "CoffeeTable": 1, "Dresser": 1, "Drawer": 3,
                              "Cabinet": 3, "Shelf": 1, "SideTable": 1, "GarbageCan": 1},
            lamps=[("DeskLamp", "Dresser"), ("FloorLamp", "SideTable")], heldout=True),
    _layout("bedroom", 1, {"Bed": 1, "Desk": 1, "SideTable": 2, "Dresser": 1, "Drawer": 3, "Shelf": 2,
                           "GarbageCan": 1},
            lamps=[("DeskLamp", "SideTable")]),
    _layout("bedroom", 2, {"Bed": 1, "Desk": 2, "Drawer": 5, "Safe": 1, "ArmChair": 1, "GarbageCan": 1},
            lamps=[("DeskLamp", "Desk")]),
    _layout("bedroom", 3, {"Bed": 1, "Dresser": 1, "SideTable": 1, "Drawer": 4, "Shelf": 3, "Cabinet": 1,
                           "LaundryHamper": 1, "GarbageCan": 1},
            lamps=[("DeskLamp", "Dresser")]),
    _layout("bedroom", 4, {"Bed": 2, "Desk": 1, "SideTable": 2, "Drawer": 6, "Dresser": 1, "Shelf": 1,
                           "GarbageCan": 1},
            lamps=[("DeskLamp", "Desk"), ("FloorLamp", "SideTable")], heldout=True),
    _layout("bathroom", 1, {"SinkBasin": 1, "CounterTop": 1, "Cabinet": 2, "Toilet": 1, "BathtubBasin": 1,
                            "TowelHolder": 1, "HandTowelHolder": 1, "GarbageCan": 1}),
    _layout("bathroom", 2, {"SinkBasin": 2, "CounterTop": 1, "Cabinet": 4, "Drawer": 2, "Toilet": 1,
                            "Shelf": 1, "ToiletPaperHanger": 1, "GarbageCan": 1}),
    _layout("bathroom", 3, {"SinkBasin": 1, "Cabinet": 3, "Drawer": 4, "Toilet": 1, "Shelf": 2,
                            "TowelHolder": 1, "Cart": 1, "ToiletPaperHanger": 1, "GarbageCan": 1}),
    _layout("bathroom", 4, {"SinkBasin": 2, "CounterTop": 1, "Cabinet": 4, "Drawer": 2, "Toilet": 1,
                            "BathtubBasin": 1, "HandTowelHolder": 2, "TowelHolder": 1, "GarbageCan": 1},
            heldout=True),
)  # fmt: skip

# The objects a room kind holds (each needs a receptacle of the layout that accepts it).
ROOM_OBJECTS = {
    "kitchen": ("Apple", "Bread", "Egg", "Potato", "Tomato", "Lettuce", "Mug", "Cup", "Plate", "Bowl",
                "Fork", "Spoon", "Spatula", "Knife", "ButterKnife", "Ladle", "Pan", "Pot", "SaltShaker",
                "PepperShaker", "DishSponge", "Kettle", "WineBottle", "SoapBottle"),
    "livingroom": ("RemoteControl", "KeyChain", "CreditCard", "Newspaper", "Book", "Laptop", "Pillow",
                   "Statue", "Vase", "Box", "Watch", "Candle", "TissueBox", "CellPhone"),
    "bedroom": ("AlarmClock", "Book", "CellPhone", "CD", "Pen", "Pencil", "KeyChain", "CreditCard",
                "Laptop", "Pillow", "BaseballBat", "TennisRacket", "BasketBall", "Mug", "Bowl", "Watch",
                "Cloth"),
    "bathroom": ("SoapBar", "SoapBottle", "Cloth", "DishSponge", "HandTowel", "ToiletPaper",
                 "SprayBottle", "Candle", "TissueBox", "Towel", "Plunger"),
}  # fmt: skip


# -- the package's shipped files, read by path ------------------------------------------------


@dataclass(frozen=True)
class _Shipped:
    domain: str
    grammar: str
    accepts: dict[str, frozenset[str]]  # receptacle type -> object types it may hold
    actions: dict[str, frozenset[str]]  # "Cleanable" ... -> object types
    openable: frozenset[str]
    goals: dict[str, Any]  # goal_library.gdict


def _exec_file(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def _shipped() -> _Shipped:
    """The domain, grammar, type constants and goal library that alfworld 0.4.2 ships.

    Read by file path (`find_spec` locates the package without running its `__init__`), so
    generating games leaves `$ALFWORLD_DATA` and `~/.cache/alfworld` alone (see the module doc).
    """
    spec = importlib.util.find_spec("alfworld")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "generating ALFWorld games needs the alfworld package: pip install 'spopp[alfworld]'"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    constants = _exec_file(root / "gen" / "constants.py", "_spopp_alfworld_constants")
    goals = _exec_file(root / "gen" / "goal_library.py", "_spopp_alfworld_goal_library")
    return _Shipped(
        domain=(root / "data" / "alfred.pddl").read_text(encoding="utf-8"),
        grammar=(root / "data" / "alfred.twl2").read_text(encoding="utf-8"),
        accepts={k: frozenset(v) for k, v in constants.VAL_RECEPTACLE_OBJECTS.items()},
        actions={k: frozenset(v) for k, v in constants.VAL_ACTION_OBJECTS.items()},
        openable=frozenset(constants.OPENABLE_CLASS_LIST),
        goals=goals.gdict,
    )


# -- drawing one game ----------------------------------------------------------------------------


def _recep_ids(layout: Layout) -> list[tuple[str, str]]:
    """(mangled id, type) of every receptacle, in the canonical id style."""
    out = []
    for rtype, count in layout.receptacles:
        for i in range(1, count + 1):
            rid = (
                f"{BASIN_PREFIX[rtype]}_bar_{i:02d}_bar_{rtype}"
                if rtype in BASIN_PREFIX
                else f"{rtype}_bar_{i:02d}"
            )
            out.append((rid, rtype))
    return out


def _targets(task_type: str, layout: Layout, sh: _Shipped) -> list[tuple[str, str | None]]:
    """(object type, parent type) pairs that make a solvable game not won at the start.

    The parent accepts the object and is not the task's appliance; the object has a starting place
    of another type than the parent. Look-at tasks have no parent (None) and need a lamp.
    """
    rtypes = [rt for rt, _ in layout.receptacles]
    if task_type == "look_at_obj_in_light" and not any(host in rtypes for _, host in layout.lamps):
        return []
    appliance = APPLIANCE.get(task_type)
    if appliance is not None and appliance not in rtypes:
        return []
    needed = sh.actions[PROPERTY[task_type]] if task_type in PROPERTY else None
    out: list[tuple[str, str | None]] = []
    for obj in ROOM_OBJECTS[layout.room]:
        if needed is not None and obj not in needed:
            continue
        homes = {rt for rt in rtypes if obj in sh.accepts.get(rt, ())}
        if task_type == "look_at_obj_in_light":
            if homes:
                out.append((obj, None))
            continue
        for parent in sorted(homes):
            if parent != appliance and homes - {parent}:
                out.append((obj, parent))
    return out


def _feasible(task_type: str, layout: Layout) -> bool:
    return bool(_targets(task_type, layout, _shipped()))


@dataclass(frozen=True)
class _Game:
    task_type: str
    folder: str
    trial: str
    traj: dict[str, Any]
    problem: str
    goal: str

    def game_json(self, walkthrough: list[str] | None, sh: _Shipped) -> dict[str, Any]:
        return {
            "pddl_domain": sh.domain,
            "grammar": sh.grammar.replace("UNKNOWN GOAL", self.goal),
            "pddl_problem": self.problem,
            "solvable": True,
            "walkthrough": walkthrough,
        }


def _draw(
    task_type: str,
    layout: Layout,
    rng: random.Random,
    max_receptacles: int | None,
    max_distractors: int | None,
) -> _Game | None:
    """One game of `task_type` in `layout`, or None when this draw cannot fit the limits.

    The steps draw from `rng` in a fixed order (target, needed receptacles, kept receptacles,
    placements, goal text): a seed gives the same games, so keep that order when changing them.
    """
    sh = _shipped()
    candidates = _targets(task_type, layout, sh)
    if not candidates:
        return None
    obj, parent = rng.choice(candidates)
    all_receps = _recep_ids(layout)
    required, lamp, lamp_host = _required(task_type, layout, rng, all_receps, parent)
    receps = _kept_receptacles(obj, parent, required, all_receps, rng, max_receptacles, sh)
    if receps is None:
        return None
    placer = _Placer(rng, receps, sh)
    # What the task needs: the target(s), never inside the parent's type; the lamp for look-at.
    target_homes = placer.homes_of(obj, avoid=parent)
    for _ in range(2 if task_type == "pick_two_obj_and_place" else 1):
        placer.put(obj, placer.hidden_or_not(target_homes))
    if lamp is not None and lamp_host is not None:
        placer.put(lamp[0], lamp_host)
    for otype, rid in _extras(obj, lamp, layout, placer, max_distractors):
        if rid:
            placer.put(otype, rid)
        elif otype == obj:
            placer.put(otype, placer.hidden_or_not(target_homes))
        else:
            placer.put(otype, rng.choice(placer.homes_of(otype))[0])
    problem = _problem(receps, placer.placed, task_type, obj, parent, lamp[0] if lamp else None, sh)
    template = rng.choice(sh.goals[task_type]["templates"])
    toggle = lamp[0] if lamp else ""
    goal = template.format(obj=obj.lower(), recep=(parent or "").lower(), toggle=toggle.lower(), mrecep="")
    limits = {"max_receptacles": max_receptacles, "max_distractors": max_distractors}
    return _game(
        task_type, layout, obj, parent, toggle, goal, problem, limits, len(receps), len(placer.placed)
    )


def _required(
    task_type: str, layout: Layout, rng: random.Random, all_receps: list[tuple[str, str]], parent: str | None
) -> tuple[list[str], tuple[str, str] | None, str | None]:
    """The receptacles the task needs (appliance, one parent, the lamp's host), the lamp and its host."""

    def instance(rtype: str) -> str:
        return rng.choice([rid for rid, rt in all_receps if rt == rtype])

    required: list[str] = []
    lamp: tuple[str, str] | None = None
    lamp_host: str | None = None
    appliance = APPLIANCE.get(task_type)
    if appliance is not None:
        required.append(instance(appliance))
    if parent is not None:
        required.append(instance(parent))
    if task_type == "look_at_obj_in_light":
        lamp = rng.choice([lp for lp in layout.lamps if any(rt == lp[1] for rt, _ in layout.receptacles)])
        lamp_host = instance(lamp[1])
        required.append(lamp_host)
    return required, lamp, lamp_host


def _kept_receptacles(
    obj: str,
    parent: str | None,
    required: list[str],
    all_receps: list[tuple[str, str]],
    rng: random.Random,
    max_receptacles: int | None,
    sh: _Shipped,
) -> list[tuple[str, str]] | None:
    """Every receptacle, or under `max_receptacles` the required ones, a home for the target and
    a random rest; None when the required ones alone are too many."""
    if max_receptacles is None:
        return all_receps
    keep = set(required)
    homes = [rid for rid, rt in all_receps if obj in sh.accepts.get(rt, ()) and rt != parent]
    if not keep.intersection(homes):
        keep.add(rng.choice(homes))
    if len(keep) > max_receptacles:
        return None
    rest = [rid for rid, _ in all_receps if rid not in keep]
    keep.update(rng.sample(rest, min(len(rest), max_receptacles - len(keep))))
    return [(rid, rt) for rid, rt in all_receps if rid in keep]


class _Placer:
    """Objects put into the game's receptacles, numbered per type in the order they are put."""

    def __init__(self, rng: random.Random, receps: list[tuple[str, str]], sh: _Shipped) -> None:
        self.rng, self.receps, self.sh = rng, receps, sh
        self.counts: Counter[str] = Counter()
        self.placed: list[tuple[str, str, str]] = []  # (object id, type, receptacle id)

    def homes_of(self, otype: str, avoid: str | None = None) -> list[tuple[str, str]]:
        return [(rid, rt) for rid, rt in self.receps if otype in self.sh.accepts.get(rt, ()) and rt != avoid]

    def hidden_or_not(self, homes: list[tuple[str, str]]) -> str:
        closed = [rid for rid, rt in homes if rt in self.sh.openable]
        open_ = [rid for rid, rt in homes if rt not in self.sh.openable]
        if closed and open_:
            return self.rng.choice(closed if self.rng.random() < HIDDEN_TARGET_P else open_)
        return self.rng.choice(closed or open_)

    def put(self, otype: str, rid: str) -> None:
        self.counts[otype] += 1
        self.placed.append((f"{otype}_bar_{self.counts[otype]:02d}", otype, rid))


def _extras(
    obj: str, lamp: tuple[str, str] | None, layout: Layout, placer: _Placer, max_distractors: int | None
) -> list[tuple[str, str]]:
    """(type, receptacle id or "" for any home): more instances of the target's class, the room's
    other lamps, distractors; at most `max_distractors` of them."""
    rng, receps = placer.rng, placer.receps
    extras: list[tuple[str, str]] = [(obj, "") for _ in range(rng.randint(0, MAX_EXTRA_TARGETS))]
    for lamp_type, host_type in layout.lamps:
        if (lamp_type, host_type) != lamp and any(rt == host_type for _, rt in receps):
            extras.append((lamp_type, rng.choice([rid for rid, rt in receps if rt == host_type])))
    others = [o for o in ROOM_OBJECTS[layout.room] if o != obj and placer.homes_of(o)]
    for otype in rng.sample(others, k=min(len(others), rng.randint(3, 7))):
        extras.extend((otype, "") for _ in range(rng.randint(1, 2)))
    if max_distractors is not None and len(extras) > max_distractors:
        extras = [extras[i] for i in sorted(rng.sample(range(len(extras)), max_distractors))]
    return extras


def _game(
    task_type: str,
    layout: Layout,
    obj: str,
    parent: str | None,
    toggle: str,
    goal: str,
    problem: str,
    limits: dict[str, int | None],
    n_receptacles: int,
    n_objects: int,
) -> _Game:
    """The game with its traj_data; its trial name is a hash of what it holds."""
    traj = {
        "task_type": task_type,
        "pddl_params": {
            "object_target": obj,
            "parent_target": parent or "",
            "toggle_target": toggle,
            "mrecep_target": "",
            "object_sliced": False,
        },
        "scene": {
            "scene_num": layout.scene,
            "floor_plan": f"gen_{layout.room}_{layout.variant}",
            "room_kind": layout.room,
            "layout": layout.name,
            "heldout_layout": layout.heldout,
        },
        "turk_annotations": {"anns": [{"task_desc": goal, "high_descs": [], "votes": []}]},
        "generator": {
            "name": GENERATOR,
            "version": GENERATOR_VERSION,
            **limits,
            "receptacles": n_receptacles,
            "objects": n_objects,
        },
    }
    content = json.dumps({"traj": traj, "problem": problem, "goal": goal}, sort_keys=True)
    trial = "trial_G" + hashlib.sha1(content.encode("utf-8")).hexdigest()[:12]
    traj["task_id"] = trial
    folder = f"{task_type}-{obj}-None-{toggle or parent}-{layout.scene}"
    return _Game(task_type, folder, trial, traj, problem, goal)


def _problem(
    receps: list[tuple[str, str]],
    placed: list[tuple[str, str, str]],
    task_type: str,
    obj: str,
    parent: str | None,
    toggle: str | None,
    sh: _Shipped,
) -> str:
    """The PDDL problem. The domain uses KnifeType, ButterKnifeType, SinkBasinType, MicrowaveType and
    FridgeType without declaring them, so every problem declares them. The agent starts at a
    location of its own, so the opening is the canonical "You are in the middle of a room"."""
    locs = {rid: f"loc_bar_{k}" for k, (rid, _) in enumerate(receps, start=1)}
    start = "loc_bar_start"
    otypes = sorted({ot for _, ot, _ in placed} | {"Knife", "ButterKnife"})
    rtypes = sorted({rt for _, rt in receps} | {"SinkBasin", "Microwave", "Fridge"})
    objects = ["agent1 - agent"]
    objects += [f"{t}Type - otype" for t in otypes]
    objects += [f"{t}Type - rtype" for t in rtypes]
    objects += [f"{oid} - object" for oid, _, _ in placed]
    objects += [f"{rid} - receptacle" for rid, _ in receps]
    objects += [f"{loc} - location" for loc in [*locs.values(), start]]
    init = [f"(atLocation agent1 {start})"]
    for rid, rt in receps:
        init.append(f"(receptacleType {rid} {rt}Type)")
        init.append(f"(receptacleAtLocation {rid} {locs[rid]})")
        if rt in sh.openable:
            init.append(f"(openable {rid})")
    for oid, ot, rid in placed:
        init.append(f"(objectType {oid} {ot}Type)")
        init.append(f"(inReceptacle {oid} {rid})")
        init.append(f"(objectAtLocation {oid} {locs[rid]})")
        init.append(f"(toggleable {oid})" if ot in sh.actions["Toggleable"] else f"(pickupable {oid})")
        for prop, key in (("cleanable", "Cleanable"), ("heatable", "Heatable"), ("coolable", "Coolable"),
                          ("sliceable", "Sliceable")):  # fmt: skip
            if ot in sh.actions[key]:
                init.append(f"({prop} {oid})")
    for rt in sorted({rt for _, rt in receps}):
        for ot in otypes:
            if ot in sh.accepts.get(rt, ()):
                init.append(f"(canContain {rt}Type {ot}Type)")
    goal = sh.goals[task_type]["pddl"].format(obj=obj, recep=parent or "", toggle=toggle or "", mrecep="")
    goal = "\n".join(line.rstrip() for line in goal.replace("#", "-").strip().splitlines())
    sep = "\n        "
    return (
        "(define (problem plan_spopp_generated)\n    (:domain alfred)\n"
        f"    (:objects{sep}{sep.join(objects)}\n    )\n"
        f"    (:init{sep}{sep.join(init)}\n    )\n"
        f"    {goal}\n"
    )


# -- the planner check -----------------------------------------------------------------------------


class _Planner:
    """One engine, reused from game to game (building one copies fast-downward's library)."""

    def __init__(self) -> None:
        from .engine import import_engine

        eng = import_engine()
        # shuffle=False: entity numbers as the environment shows them, so the plan replays verbatim.
        self._env = eng.AlfredDemangler(
            eng.PddlEnv(eng.textworld.EnvInfos(won=True, policy_commands=True)), shuffle=False
        )

    def plan(self, game: str | os.PathLike | Mapping[str, Any]) -> list[str] | None:
        from .engine import ENGINE_LOCK

        argv = list(sys.argv)
        with ENGINE_LOCK:
            try:
                self._env.load(dict(game) if isinstance(game, Mapping) else str(game))
                state = self._env.reset()
            finally:
                sys.argv[:] = argv  # fast-downward's translator leaves its own argv behind
        if state["won"]:
            return []
        return list(state["policy_commands"] or ()) or None

    def close(self) -> None:
        self._env.close()


def planner_walkthrough(gamefile: str | os.PathLike | Mapping[str, Any]) -> list[str] | None:
    """The fast-downward plan of a game, as the agent types it; None when it has none; [] if won at start.

    This is how `alfworld-generate` decides `solvable` and fills `walkthrough`. `gamefile` is a
    `game.tw-pddl` path or its loaded JSON. Loads the engine (about 0.5 s a game).
    """
    planner = _Planner()
    try:
        return planner.plan(gamefile)
    finally:
        planner.close()


# -- the set -------------------------------------------------------------------------------------


def _layout_pool(split: str, layouts: str | None) -> tuple[str, list[Layout]]:
    mode = layouts or ("unseen" if split == "valid_unseen" else "seen")
    return mode, [lay for lay in LAYOUTS if mode == "all" or lay.heldout == (mode == "unseen")]


def _layout_cycle(task_type: str, pool: list[Layout], split: str, seed: int) -> list[Layout]:
    """The feasible layouts in the order games take them: room kinds interleaved, each kind's
    variants in turn, both shuffled per (split, seed, task type); a cycle uses each layout once."""
    rng = random.Random(f"spopp-alfworld-layouts:{split}:{seed}:{task_type}")
    by_room: dict[str, list[Layout]] = {}
    for lay in pool:
        if _feasible(task_type, lay):
            by_room.setdefault(lay.room, []).append(lay)
    rooms = sorted(by_room)
    rng.shuffle(rooms)
    for variants in by_room.values():
        rng.shuffle(variants)
    cycle: list[Layout] = []
    longest = max((len(v) for v in by_room.values()), default=0)
    for turn in range(longest):
        cycle += [by_room[r][turn] for r in rooms if turn < len(by_room[r])]
    return cycle


def _heldout_game(trial: str) -> bool:
    return int(trial[len("trial_G") :][:8], 16) % HASH_BUCKETS == 0


def _check_args(out, seed, per_type, split, layouts, max_receptacles, max_distractors) -> Path:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise GenerationError(f"seed must be an integer >= 0, got {seed!r}")
    if isinstance(per_type, bool) or not isinstance(per_type, int) or per_type < 1:
        raise GenerationError(f"per_type must be an integer >= 1, got {per_type!r}")
    if split not in SPLITS:
        raise GenerationError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    if layouts is not None and layouts not in LAYOUT_CHOICES:
        raise GenerationError(f"unknown layouts {layouts!r}; expected one of {', '.join(LAYOUT_CHOICES)}")
    if max_receptacles is not None and (not isinstance(max_receptacles, int) or max_receptacles < 2):
        raise GenerationError(
            f"max_receptacles must be >= 2 (a task needs two places), got {max_receptacles!r}"
        )
    if max_distractors is not None and (not isinstance(max_distractors, int) or max_distractors < 0):
        raise GenerationError(f"max_distractors must be >= 0, got {max_distractors!r}")
    out = Path(out)
    for path in (out, out / DATA_DIR, out / DATA_DIR / split):
        if path.exists() and not path.is_dir():
            raise GenerationError(f"{path} exists and is not a folder")
    if (out / f"{split}_seed{seed}.txt").is_dir():
        raise GenerationError(f"{out / f'{split}_seed{seed}.txt'} is a folder, not a list file")
    return out


def _write(trial_dir: Path, game: _Game, walkthrough: list[str] | None, sh: _Shipped) -> None:
    trial_dir.mkdir(parents=True, exist_ok=True)
    (trial_dir / "traj_data.json").write_text(
        json.dumps(game.traj, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    (trial_dir / "initial_state.pddl").write_text(game.problem, encoding="utf-8")
    (trial_dir / "game.tw-pddl").write_text(
        json.dumps(game.game_json(walkthrough, sh), sort_keys=True), encoding="utf-8"
    )


def _cycles(mode: str, pool: list[Layout], split: str, seed: int) -> dict[str, list[Layout]]:
    """Each task type's layouts, in the order its games take them; GenerationError for a type
    that no layout of the pool supports."""
    cycles = {tt: _layout_cycle(tt, pool, split, seed) for tt in TASK_TYPES}
    for tt, cycle in cycles.items():
        if not cycle:
            raise GenerationError(f"no {mode} layout supports {tt}")
    return cycles


class _Drawing:
    """The games of one generate_games call: drawn, plan-checked, written and listed."""

    def __init__(
        self,
        out: Path,
        split: str,
        seed: int,
        max_receptacles: int | None,
        max_distractors: int | None,
        sh: _Shipped,
        planner: _Planner | None,
    ) -> None:
        self.out, self.split, self.seed, self.sh, self.planner = out, split, seed, sh, planner
        self.max_receptacles, self.max_distractors = max_receptacles, max_distractors
        self.want_heldout = split != "train"
        self.rels: list[str] = []
        self.seen: set[str] = set()

    def one(self, tt: str, i: int, layout: Layout, per_type: int, stats: Counter[str]) -> None:
        """Game `i` of type `tt` in `layout`: the first of up to MAX_ATTEMPTS seeded draws that fits
        the limits, belongs to this split, is new and (when checked) has a plan; written and listed.
        Each draw is counted in `stats` by why it was dropped."""
        for attempt in range(MAX_ATTEMPTS):
            rng = random.Random(f"spopp-alfworld:{self.split}:{self.seed}:{tt}:{i}:{attempt}")
            game = _draw(tt, layout, rng, self.max_receptacles, self.max_distractors)
            if game is None:
                stats["too tight"] += 1
                continue
            if _heldout_game(game.trial) != self.want_heldout:
                continue  # the other split's game
            rel = f"{self.split}/{game.folder}/{game.trial}"
            if rel in self.seen:
                stats["duplicate"] += 1
                continue
            walkthrough = None
            if self.planner is not None:
                walkthrough = self.planner.plan(game.game_json(None, self.sh))
                if not walkthrough:
                    stats["unsolvable"] += 1
                    continue
            assert not any(s in rel for s in _FORBIDDEN_IN_PATHS), rel
            _write(self.out / DATA_DIR / rel, game, walkthrough, self.sh)
            self.seen.add(rel)
            self.rels.append(rel)
            return
        raise GenerationError(
            f"{tt}: drew only {i} distinct games of {per_type} in layout {layout.name} "
            f"(max_receptacles={self.max_receptacles}, max_distractors={self.max_distractors}); "
            "ask for fewer games or relax the limits"
        )


def generate_games(
    out: str | os.PathLike,
    *,
    seed: int,
    per_type: int,
    split: str,
    layouts: str | None = None,
    max_receptacles: int | None = None,
    max_distractors: int | None = None,
    check: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[str]:
    """Write `per_type` games of each task type under `out` and their list; answer the list.

    The list (`<split>/<folder>/<trial>` paths, task types in `TASK_TYPES` order) is also written
    to `out/<split>_seed<seed>.txt`. `layouts` is "seen", "unseen" or "all" (default: seen for train
    and valid_seen, unseen for valid_unseen). `max_receptacles` (>= 2) keeps at most that many
    receptacles of a layout, always those the task needs (sink, microwave, fridge, a lamp's host,
    the goal's receptacle, a starting place); `max_distractors` caps the objects beyond what the
    task needs. Smaller games mean shorter admissible-action lists, so shorter prompts.

    `check` plans every game with fast-downward, stores the plan as `walkthrough` and drops draws
    without one (counted in the progress lines). Without it `walkthrough` is null and `solvable`
    is still true: the construction makes every game solvable, the check proves it.
    `progress` receives one line per task type and a summary. Arguments are checked before
    anything is written (GenerationError); the engine runs in this thread only.
    """
    out = _check_args(out, seed, per_type, split, layouts, max_receptacles, max_distractors)
    mode, pool = _layout_pool(split, layouts)
    sh = _shipped()
    cycles = _cycles(mode, pool, split, seed)
    say = progress or (lambda _line: None)
    draw = _Drawing(out, split, seed, max_receptacles, max_distractors, sh, _Planner() if check else None)
    dropped: Counter[str] = Counter()
    t_start = time.perf_counter()
    try:
        for tt in TASK_TYPES:
            t0 = time.perf_counter()
            stats: Counter[str] = Counter()
            for i in range(per_type):
                draw.one(tt, i, cycles[tt][i % len(cycles[tt])], per_type, stats)
            dt = time.perf_counter() - t0
            dropped.update(stats)
            notes = ", ".join(f"{n} {why}" for why, n in sorted(stats.items())) or "none"
            say(f"{tt}: {per_type} games in {dt:.2f} s ({per_type / dt:.2f} games/s); dropped draws: {notes}")
    finally:
        if draw.planner is not None:
            draw.planner.close()
    rels = draw.rels
    list_file = out / f"{split}_seed{seed}.txt"
    list_file.write_text("".join(rel + "\n" for rel in rels), encoding="utf-8")
    dt = time.perf_counter() - t_start
    say(
        f"wrote {len(rels)} games ({split}, {mode} layouts, "
        f"{'plan-checked' if check else 'not plan-checked'}) under {out / DATA_DIR} in {dt:.2f} s "
        f"({len(rels) / dt:.2f} games/s; {dropped['unsolvable']} unsolvable dropped); list: {list_file}"
    )
    return rels
