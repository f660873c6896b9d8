"""The ``echelon3`` command: train / finetune / evaluate / run / export / predict, and
``profiles install``.

Heavy imports (torch, the tasks) happen inside the commands, so ``--help`` is
instant. Exit codes: 0 success, 2 a user error (one line naming the config key
or file), 130 Ctrl-C, 75 preempted (resubmit), 3 one rank of a torchrun / srun job that
stopped because another rank failed (that one says why), 1 anything else. ``ECHELON3_DEBUG=1`` adds the full
traceback to a user error or an interruption; the exit code stays the same.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback

from echelon3.tasks import profiles

# Sections only another task builds; their components are not imported up front.
OTHER_TASKS_ONLY = {"train": ("evaluator", "runner", "export"),
                    "finetune": ("evaluator", "runner", "export"),
                    "evaluate": ("runner", "trainer", "mlops", "export"),
                    "run": ("evaluator", "trainer", "mlops", "export"),
                    "export": ("evaluator", "runner", "dataloaders", "loss", "metrics", "optimizer",
                               "scheduler", "trainer", "mlops"),
                    "predict": ("net", "evaluator", "runner", "loss", "optimizer", "scheduler",
                                "trainer", "mlops")}

TASKS = {
    "train": ("echelon3.tasks.train", "train", "train a network (resumes when target.path holds "
              "checkpoints)"),
    "finetune": ("echelon3.tasks.train", "finetune", "train starting from another run's weights "
                 "(init_from; finetune: freeze_patterns, param_groups)"),
    "evaluate": ("echelon3.tasks.evaluate", "evaluate", "compute metrics of a checkpoint over the "
                 "test set(s) and write them as JSON"),
    "run": ("echelon3.tasks.run", "run", "run inference with a checkpoint and write predictions "
            "as CSV"),
    "export": ("echelon3.tasks.export", "export", "write a checkpoint's network as ONNX and/or "
               "safetensors weights"),
    "predict": ("echelon3.tasks.predict", "predict", "score the exported model.onnx on the test "
                "set(s) with the configured metrics, fed raw inputs as its user would"),
}

EPILOG = """overrides (OmegaConf grammar):
  key=value        set a value (typed: 3, 0.1, true, null, [0,1], text)
  +key=value       add a key (same effect)
  ++key=value      add or override (same effect)
  ~key             delete a key and its subtree
  hydra.*          accepted and ignored

examples:
  echelon3 train -cd config/experiments -cn digits_cnn device=cpu
  echelon3 train -cd configs -cn my_experiment gpus=[0,1,2,3]
  echelon3 train -cd configs -cn my_experiment device=cpu nproc=2
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with a "did you mean" after an invalid choice (a mistyped subcommand)."""

    def error(self, message):
        import re

        from echelon3.config.errors import did_you_mean

        found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if found:
            message += did_you_mean(found.group(1), re.findall(r"'([^']*)'", found.group(2)))
        super().error(message)


def parser() -> argparse.ArgumentParser:
    from echelon3 import __version__

    top = _Parser(
        prog="echelon3", description="Config-driven PyTorch training: one YAML per run.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version", version=f"echelon3 {__version__}")
    sub = top.add_subparsers(dest="command", metavar="{" + ",".join([*TASKS, "profiles"]) + "}",
                             required=True, parser_class=_Parser)
    for name, (_, _, help_text) in TASKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("-cd", "--config-dir", default=".",
                       help="directory holding the YAML files (default: current directory)")
        p.add_argument("-cn", "--config-name", required=True,
                       help="the run's YAML file, with or without .yaml")
        p.add_argument("--print-config", action="store_true",
                       help="print the composed, resolved config and exit")
        p.add_argument("overrides", nargs="*", metavar="override",
                       help="key=value, +key=value, ++key=value or ~key")
    profiles.add_parser(sub)
    return top


def _debug() -> bool:
    return os.environ.get("ECHELON3_DEBUG", "") not in ("", "0", "false")


def _execute(args) -> None:
    import importlib

    if args.command == "profiles":
        profiles.main(args)
        return

    from echelon3.config.compose import to_yaml

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    rc = _load(args)
    if args.print_config:
        sys.stdout.write(to_yaml(rc.cfg))
        return
    from echelon3.checkpoints import lock
    from echelon3.config.preflight import check_specs
    from echelon3.config.sections import check_sections
    from echelon3.data import loaders
    from echelon3.distributed import runtime
    from echelon3.observe import mlflow_config, wandb_config
    from echelon3.tasks import early

    module, function, _ = TASKS[args.command]
    task_module = importlib.import_module(module)
    task = getattr(task_module, function)
    # trainer.config keys the task reads itself instead of passing them to the Trainer
    # (finetune is train from other weights: the same keys)
    consumed = {"trainer": tuple(getattr(task_module, "RUNTIME_KEYS", ()))}

    held = contextlib.ExitStack()  # target.path's lock, claimed once the checks pass

    def validate(plan) -> bool:
        check_sections(rc.cfg)
        mlflow_config.check(rc.cfg)
        wandb_config.check(rc.cfg)
        loaders.check_batch_sizes(rc.cfg.get("dataloaders"), plan.world_size)
        check_specs(rc.cfg, rc.config_dir, skip=OTHER_TASKS_ONLY[args.command],
                    consumed=consumed)
        here = early.launched_here()  # under torchrun / srun each rank's task decides
        if here:
            early.refuse(args.command, rc)
        held.enter_context(lock.for_launch(args.command, rc.cfg))
        return here and early.finished(args.command, rc)

    with held:
        runtime.launch(task, rc, validate)


def _load(args):
    """The composed config; a -cn that names no file gets the closest name in -cd."""
    from pathlib import Path

    from echelon3.config.compose import load_config
    from echelon3.config.errors import ConfigError, did_you_mean

    try:
        return load_config(args.config_dir, args.config_name, args.overrides)
    except ConfigError as e:
        if e.key != "--config-name" or "not found" not in e.message:
            raise
        folder = Path(args.config_dir or ".").expanduser()
        names = sorted(path.stem for path in folder.glob("*.yaml"))
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "") or "none"
        name = args.config_name.removesuffix(".yaml")
        raise ConfigError("--config-name", f"no {name}.yaml in {folder}"
                          f"{did_you_mean(name, names)}; configs there: {shown}") from None


def _user_error(e: BaseException):
    """The one-line form of an error the user caused, or None."""
    from echelon3.config.errors import UserError

    if isinstance(e, UserError):
        return str(e)
    if type(e).__name__ == "MissingMandatoryValue" and type(e).__module__.startswith("omegaconf"):
        key = getattr(e, "full_key", None) or "config"
        return f"{key}: has no value ('???'); set it in the YAML or with {key}=..."
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (``sys.argv[1:]`` when None) -> the exit code.

    Ctrl-C is handled by :mod:`echelon3.distributed.interrupt` from the first line on. Called
    without ``argv``, as the program itself, a later Ctrl-C only sets a flag (the
    interpreter is finishing); called with ``argv`` from other code, the caller's
    SIGINT handling comes back on return.
    """
    from echelon3.distributed import interrupt

    with interrupt.handling(keep=argv is None):
        try:
            return _run(argv)
        except KeyboardInterrupt:
            interrupt.disarm()  # no retry raises again while the notice is printed
            return _interrupted()


def _interrupted() -> int:
    if _debug():
        traceback.print_exc()
    if os.environ.get("RANK", "0") == "0":  # one notice per run, not per rank
        print("echelon3: interrupted", file=sys.stderr)
    return 130


def _run(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    try:
        _execute(args)
    except Exception as e:
        from echelon3.distributed import interrupt

        if interrupt.interrupted():  # a library that swallowed the KeyboardInterrupt failed on
            raise KeyboardInterrupt from e
        return _failed(e)
    return 0


def _failed(e: Exception) -> int:
    """The exit code of a failed command, after its one-line message; re-raises a bug."""
    message = _user_error(e)
    if message is not None:
        if _debug():
            traceback.print_exc()
        print(f"echelon3: error: {message}", file=sys.stderr)
        return 2
    from echelon3.distributed.launch import PEER_LOST, PEER_LOST_EXIT, WorkerFailed, peer_lost
    from echelon3.distributed.preemption import Preempted

    if isinstance(e, Preempted):
        from echelon3.distributed.preemption import before_exit

        before_exit()
        return e.exit_code  # the trainer logged where it stopped
    if isinstance(e, WorkerFailed):
        print(f"echelon3: {e}", file=sys.stderr)
        return e.exit_code
    if peer_lost(e):  # one rank of a torchrun / srun job; the failed one said why
        print(f"echelon3: [rank {os.environ.get('RANK', '?')}] {PEER_LOST}", file=sys.stderr)
        return PEER_LOST_EXIT
    from echelon3.config.errors import blamed

    named = blamed(e)  # a component's own code raised: its traceback, then its config key
    if named is None:
        raise e
    traceback.print_exception(e)
    print(f"echelon3: error: {named}", file=sys.stderr)
    return 1
