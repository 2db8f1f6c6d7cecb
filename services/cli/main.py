"""The `pcpstack` command: serve a service, check a config, inspect the cluster, run benchmarks.

Each service ships `pcpstack.<name>.main` (folder `services/<name>/`) with `add_arguments(parser)` and
`run(args) -> int`; this module only wires them into subcommands, importing a service's code when its
subcommand is used. `bench` runs the checkout's benchmarks (`python -m bench`), which are not installed.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from pcpstack.common import security
from pcpstack.common.config import ROLE_SECTIONS, ConfigError, load_config_file, parse_overrides, role_config
from pcpstack.common.models import hf_cache_dir, local_models, resolve_model

SERVICES = ("registry", "prefill", "decode", "kvstore", "gateway")
# The source checkout this package was installed from (editable install): bench/ lives there.
CHECKOUT = Path(__file__).resolve().parent.parent.parent


def version() -> str:
    """The installed pcpstack's version."""
    try:
        return importlib.metadata.version("pcpstack")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def has_default(action: argparse.Action) -> bool:
    """Whether an option has a default worth telling (not None, False, an empty string or list). A lone flag
    that takes no value (`--no-prefix-cache`, a store_false) has none: its default is only "not given", and
    "(default: True)" after `--no-X` reads as if X were off. A --X/--no-X pair does: which one holds."""
    if not action.option_strings or action.default is argparse.SUPPRESS:
        return False
    if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
        return False
    return action.default is not None and action.default is not False and action.default not in ("", [])


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already says it in its own words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if not has_default(action) or "default" in help_text.lower():
            return help_text
        return f"{help_text} (default: %(default)s)"

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and has_default(action):
            # argparse prints no help line at all for an option without help; give it its default.
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


def add_parser(sub: argparse._SubParsersAction, name: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand's parser, with the defaults in its help."""
    return sub.add_parser(name, formatter_class=DefaultsHelpFormatter, **kwargs)


def _first_sentence(text: str) -> str:
    """A docstring's first sentence, in one line, without its final period (a subcommand's help)."""
    joined = " ".join(text.split())
    sentence = joined.split(". ", 1)[0].split("; ", 1)[0].rstrip(".")
    return sentence[:1].lower() + sentence[1:]


def _module_or_none(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return None
        raise


def _config_check(args: argparse.Namespace) -> int:
    try:
        if args.role:  # as that role's service reads the file: its --set reaches its own section alone
            configs = {args.role: role_config(args.role, args.file, parse_overrides(args.set))}
        else:
            configs = load_config_file(args.file, parse_overrides(args.set))
    except (ConfigError, OSError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    for role, config in configs.items():
        problem = _model_shape_problem(role, config)
        if problem:
            print(f"config error: {problem}", file=sys.stderr)
            return 2
    resolved = {}
    for role, config in configs.items():
        # Only what the config decides: not the model's K/V heads, nor a decode worker's port (it picks one).
        unset = {"num_kv_heads", *(("master_port",) if role == "decode" else ())}
        resolved[role] = {
            **{k: v for k, v in vars(config).items() if k not in unset},
            "world_size": config.world_size,
            "pcp_ranks_per_node": config.pcp_ranks_per_node,
            "nodes_required": config.nodes_required,
        }
    print(json.dumps(resolved, indent=2))
    return 0


def _model_shape_problem(role: str, config) -> str:
    """Why the model a config names cannot run at its TP size (heads or intermediate size not divisible),
    read from the model's header; "" when it can, or when the model is not on this machine (a config is
    often checked away from the nodes that hold the weights: start-up checks it there)."""
    if config.tensor_parallel_size == 1:
        return ""
    from pcpstack.engine.parallel import TensorParallelShard
    from pcpstack.engine.weights import describe_model

    note = (
        f"config check: {role} model {config.model!r} is not on this machine; its heads are checked against "
        f"tensor_parallel_size={config.tensor_parallel_size} when a node starts"
    )
    try:
        resolve_model(config.model)
    except (ValueError, OSError):  # a path or repo id this machine does not have
        print(note, file=sys.stderr)
        return ""
    try:
        args = describe_model(config.model or None).args
    except OSError:  # the embedded default's package is not installed here
        print(note, file=sys.stderr)
        return ""
    except ValueError as exc:  # a model this engine cannot serve: start-up would refuse it too
        return f"{role}: model {config.model!r}: {exc}"
    try:
        TensorParallelShard(0, config.tensor_parallel_size).check(args)
        config.with_model_shape(args.n_kv_heads)  # DCP's GQA rule, now that the K/V heads are known
    except ValueError as exc:  # a ConfigError is one too
        return f"{role}: {exc}"
    return ""


def _models(args: argparse.Namespace) -> int:
    """Lists what --model can name on this machine without a download."""
    models = local_models()
    if args.json:
        print(json.dumps([vars(m) for m in models], indent=2))
        return 0
    print(f"Hugging Face cache: {hf_cache_dir()}")
    for model in models:
        name = model.name or "(default: no --model)"
        mark = "" if model.servable else "  [cannot serve]"
        print(f"{name:<48} {model.kind:<9} {model.detail}{mark}")
    return 0


def _bench(argv: list[str]) -> int:
    """Runs `python -m bench ARGS` in the checkout; benchmarks are a development tool, not installed."""
    if not (CHECKOUT / "bench" / "__main__.py").is_file():
        print(
            "pcpstack bench: the benchmarks live in a source checkout (bench/), not in the package; "
            "run it from an editable install (make venv)",
            file=sys.stderr,
        )
        return 2
    return subprocess.run([sys.executable, "-m", "bench", *argv], cwd=CHECKOUT).returncode


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The argument parser. A service's or benchmark's module (and so torch) is imported only when argv
    names it, so `pcpstack serve registry` stays light."""
    wanted = set(argv[:3])
    parser = argparse.ArgumentParser(
        prog="pcpstack", description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"pcpstack {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = add_parser(sub, "serve", help="run one service in the foreground")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    for name in SERVICES:
        service_parser = add_parser(serve_sub, name, help=f"run the {name} service")
        module = _module_or_none(f"pcpstack.{name}.main") if name in wanted else None
        if module is not None:
            module.add_arguments(service_parser)
            service_parser.set_defaults(handler=module.run)

    config = add_parser(sub, "config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = add_parser(
        config_sub, "check", help="validate a seed-style config file and print what it resolves to"
    )
    check.add_argument(
        "file", help="JSON file with motor_engine_prefill_config and/or motor_engine_decode_config"
    )
    check.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an engine_config key (of every section, or of --role's alone)",
    )
    check.add_argument(
        "--role",
        choices=tuple(ROLE_SECTIONS),
        default=None,
        help="check only this role's section, as its service reads the file (default: every section)",
    )
    check.set_defaults(handler=_config_check)

    models = add_parser(
        sub, "models", help="list the models this machine can serve (embedded, local Hugging Face cache)"
    )
    models.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    models.set_defaults(handler=_models)

    from pcpstack.cli import commands

    up = add_parser(
        sub, "up", help="start a local stack (registry, kvstore, prefill sets, decode) until Ctrl-C"
    )
    commands.add_up_arguments(up)
    up.set_defaults(handler=commands.run_up)
    generate = add_parser(sub, "generate", help="stream one answer from a decode worker or a local stack")
    commands.add_generate_arguments(generate)
    generate.set_defaults(handler=commands.run_generate)
    certs = add_parser(sub, "certs", help="make a development CA and service certificates for mutual TLS")
    if "certs" in wanted:
        from pcpstack.cli import certs as certs_module

        certs_module.add_arguments(certs)
        certs.set_defaults(handler=certs_module.run)

    for command, module_name in (("status", "pcpstack.cli.status"),):
        module = _module_or_none(module_name)
        if module is not None:
            command_parser = add_parser(sub, command, help=_first_sentence(module.__doc__ or command))
            module.add_arguments(command_parser)
            command_parser.set_defaults(handler=module.run)

    sub.add_parser(
        "bench",
        add_help=False,
        help="benchmarks of a source checkout (python -m bench); results in bench/results/",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pcpstack` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser(argv).parse_args(argv)
    if not hasattr(args, "handler"):
        print(f"pcpstack: {' '.join(argv[:2])} is not available in this build", file=sys.stderr)
        return 2
    try:
        return int(args.handler(args) or 0)
    except security.SecurityConfigError as error:  # PCPSTACK_TLS_*, PCPSTACK_TOKEN*: it names the variable
        print(f"pcpstack {argv[0]}: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        return 2
    except BrokenPipeError:
        # The reader left (`pcpstack status --watch | head`): stop quietly, as other command-line tools do;
        # stdout is pointed at /dev/null so that Python's flush at exit does not fail once more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
