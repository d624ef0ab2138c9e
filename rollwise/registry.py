"""One lazy registry for every seam of the loop: a name resolves to a built-in implementation or
to a user's `package.module:attr`, imported on first use, so heavy backends (vLLM) stay optional.

    from rollwise import registry
    registry.resolve("selector", "dps")          # -> the DPSSelector factory
    registry.resolve("selector", "mypkg.sel:Top")  # -> mypkg.sel.Top
    registry.register("selector", "top", "mypkg.sel:Top")  # a plugin adds a name

What a name resolves to is called by the part that owns the seam; each kind's line below says
with what (cfg is the run's whole Config). Config validation calls `check`, which accepts a
known name or a dotted path and rejects anything else with the list of known names.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from typing import Any

BUILTIN: dict[str, dict[str, str]] = {
    # factory(task_cfg) -> Task (rollwise.tasks.base); 'name:variant' resolves 'name'
    "task": {"arith": "rollwise.tasks.arith:ArithTask", "calc": "rollwise.tasks.calc:CalcTask",
             "packs": "rollwise.tasks.packs:PacksTask", "gym": "rollwise.tasks.gym:GymTask",
             "file": "rollwise.tasks.files:FileTask",
             "worked": "rollwise.tasks.worked:WorkedTask"},
    # fn(AdvantageInputs) -> AdvantageOutput
    "advantage": {n: "rollwise.training.advantages:" + f for n, f in (
        ("grpo", "grpo"), ("dr_grpo", "dr_grpo"), ("rloo", "rloo"),
        ("reinforce_pp", "reinforce_pp"), ("reinforce_pp_baseline", "reinforce_pp_baseline"),
        ("mc_grpo", "mc_grpo"), ("gdpo", "gdpo"), ("cod", "cod"), ("trace", "trace"),
        ("trace_tree", "trace_tree"), ("xrpo", "xrpo"), ("mssr", "mssr"),
        ("nudge", "nudge"))},
    # fn(token_advantages (B, T), batch) -> (B, T)
    "token_shaping": {"none": "rollwise.training.advantages:no_shaping",
                      "echo": "rollwise.training.confidence:echo_shaping",
                      "entropy": "rollwise.training.advantages:entropy_shaping"},
    # fn(logprobs, old_logprobs, advantages, mask, LossParams) -> (per-token loss, metrics)
    "policy_loss": {n: "rollwise.training.losses:" + n for n in ("ppo_clip", "dual_clip", "gspo",
                                                                 "rec_oneside")},
    # fn(token_loss, mask, num_tokens=, num_seqs=, norm_length=) -> scalar
    "aggregation": {"token-mean": "rollwise.training.losses:token_mean",
                    "seq-mean-token-mean": "rollwise.training.losses:seq_mean_token_mean",
                    "seq-mean-token-sum-norm": "rollwise.training.losses:seq_mean_token_sum_norm"},
    # fn(logprobs, ref_logprobs) -> per-token estimate
    "kl": {n: "rollwise.training.losses:kl_" + n for n in ("k1", "k2", "k3")},
    # factory(name, filter_cfg, task) -> Verifier; a dotted path is a user reward function
    "verifier": {n: "rollwise.stages.filter.stage:build_" + m for n, m in (
        ("exact", "exact"), ("math", "math"), ("math_verify", "math"), ("gym", "gym"),
        ("code", "code"), ("format", "format"), ("length", "length"), ("judge", "judge"),
        ("majority", "majority"), ("env", "env"))},
    # factory(cfg) -> ProcessVerifier: the first wrong step of a response and its correction
    "process_verifier": {"columns": "rollwise.stages.filter.process:ColumnSteps",
                         "equations": "rollwise.stages.filter.process:EquationSteps",
                         "worked": "rollwise.tasks.worked:WorkedSteps"},
    # factory(cfg) -> Selector
    "selector": {"uniform": "rollwise.stages.control.select_uniform:UniformSelector.build",
                 "thompson": "rollwise.stages.control.select_thompson:ThompsonSelector.build",
                 "dps": "rollwise.stages.control.select_dps:DPSSelector.build",
                 "vade": "rollwise.stages.control.select_vade:VadeSelector.build",
                 "insight": "rollwise.stages.control.select_insight:InsightSelector.build",
                 "cures": "rollwise.stages.control.alloc_cures:CuresSelector.build"},
    # factory(cfg, tokenizer) -> Generator
    "generator": {"group": "rollwise.stages.generate.group:GroupGenerator",
                  "latr": "rollwise.stages.generate.latr:LatrGenerator",
                  "echo": "rollwise.stages.generate.echo:EchoGenerator",
                  "episode": "rollwise.agents.episode:EpisodeGenerator",
                  "trace": "rollwise.agents.trace_rollout:TraceGenerator",
                  "cod": "rollwise.agents.pack_play:CoDGenerator",
                  "agent": "rollwise.serve.agent:AgentGenerator",
                  "nudge": "rollwise.stages.generate.nudge:NudgeGenerator"},
    # function(problem, client) -> reward or final answer: an agent written against the OpenAI
    # client (generate.strategy=agent; rollwise.serve.agent). No built-in ones.
    "agent": {},
    # factory(cfg, problem) -> Environment (rollwise.agents.env), one per episode
    "env": {"tools": "rollwise.agents.env:ToolEnv"},
    # factory(cfg, problem) -> PackEnvironment (rollwise.agents.pack_play), one per pack play
    "pack": {"remap": "rollwise.tasks.packs:RemapPack"},
    # factory(cfg) -> InflightController
    "inflight": {"none": "rollwise.stages.control.inflight:RunToEnd",
                 "april": "rollwise.stages.control.april:April",
                 "arrol": "rollwise.stages.control.prune_arrol:Arrol",
                 "duet": "rollwise.stages.control.abort_duet:Duet"},
    # factory(cfg) -> GroupSizer
    "group_size": {"fixed": "rollwise.stages.control.group_size:FixedSize",
                   "sgpo": "rollwise.stages.control.alloc_sgpo:SGPO",
                   "dars": "rollwise.stages.control.alloc_dars:DARS",
                   "xrpo": "rollwise.stages.control.alloc_xrpo:XRPO",
                   "cures": "rollwise.stages.control.alloc_cures:Cures",
                   "v0": "rollwise.stages.control.value_v0:V0"},
    # factory(cfg) -> Replay
    "replay": {"none": "rollwise.stages.replay.buffer:NoReplay",
               "buffer": "rollwise.stages.replay.buffer:BufferReplay"},
    # a typed Python function: its signature and docstring are the schema (rollwise.agents)
    "tool": {"calculator": "rollwise.agents.builtin_tools:calculator",
             "python": "rollwise.agents.builtin_tools:python"},
    # factory(cfg, model, tokenizer, run_dir) -> Engine
    "engine": {"builtin": "rollwise.engine.backends:builtin",
               "vllm": "rollwise.engine.backends:vllm"},
}

_added: dict[str, dict[str, Any]] = {k: {} for k in BUILTIN}
_cache: dict[tuple[str, str], Any] = {}
DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def kinds() -> list[str]:
    return list(BUILTIN)


def names(kind: str) -> list[str]:
    """The names `kind` knows (built-in and registered)."""
    _known_kind(kind)
    return [*BUILTIN[kind], *(n for n in _added[kind] if n not in BUILTIN[kind])]


def register(kind: str, name: str, target: Any) -> None:
    """Add `name` to `kind`: target is the object itself or its 'package.module:attr'."""
    _known_kind(kind)
    if not name or ":" in name:
        raise ValueError(f"registry name {name!r}: give a plain name (no ':')")
    _added[kind][name] = target
    _cache.pop((kind, name), None)


def is_dotted(name: str) -> bool:
    return bool(DOTTED.match(name))


def check(kind: str, name: str, key: str) -> str:
    """`name` if it is a known name, or a dotted path that imports to a class or function;
    else a ValueError naming the config `key` and what is wrong (what config validation
    raises, so a misspelt plugin stops before any work)."""
    if name in names(kind):
        return name
    if not is_dotted(name):
        raise ValueError(f"{key} = {name!r}: unknown {kind}; choose from "
                         f"{', '.join(names(kind))} or give 'package.module:attr'")
    obj = resolve(kind, name, key)
    if not callable(obj):
        raise ValueError(f"{key} = {name!r} is {type(obj).__name__} {obj!r:.40}, not a class "
                         f"or function; name the {kind} factory")
    return name


def resolve(kind: str, name: str, key: str | None = None) -> Any:
    """The object `name` stands for, imported on first use."""
    key = key or kind
    if (kind, name) in _cache:
        return _cache[(kind, name)]
    if name not in names(kind) and not is_dotted(name):
        check(kind, name, key)  # raises, listing the known names
    target = _added[kind].get(name, BUILTIN[kind].get(name, name))
    obj = _import(target, key, name) if isinstance(target, str) else target
    _cache[(kind, name)] = obj
    return obj


def _import(path: str, key: str, name: str) -> Any:
    module, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{key} = {name!r}: cannot import {path} ({type(e).__name__}: {e})"
                         ) from None
    return obj


def _known_kind(kind: str) -> None:
    if kind not in BUILTIN:
        raise KeyError(f"registry kind {kind!r}: one of {', '.join(BUILTIN)}")


def conform(obj: Any, base: type, key: str) -> Any:
    """`obj` as a `base` (a part's protocol class with defaults): an instance is returned as
    it is; a plugin's object that does not subclass it must have base's abstract methods and
    gets base's default for every other public method or attribute it lacks. This is the one
    place that asks what an object has, so callers call protocol methods without probing."""
    if isinstance(obj, base):
        return obj
    missing = [n for n in sorted(getattr(base, "__abstractmethods__", ()))
               if not callable(getattr(obj, n, None))]
    if missing:
        raise TypeError(f"{key}: {type(obj).__name__} lacks {', '.join(missing)}; subclass "
                        f"{base.__module__}.{base.__qualname__} and implement it")
    for name, default in inspect.getmembers(base):
        if name.startswith("_") or hasattr(obj, name):
            continue
        value = types.MethodType(default, obj) if inspect.isfunction(default) else default
        try:
            setattr(obj, name, value)
        except AttributeError:  # __slots__ or a read-only object
            raise TypeError(f"{key}: {type(obj).__name__} lacks {name} and cannot take "
                            f"the default; subclass {base.__module__}.{base.__qualname__}"
                            ) from None
    return obj
