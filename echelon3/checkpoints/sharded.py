"""Sharded resume checkpoints (``torch.distributed.checkpoint``) for ``strategy: fsdp``.

Under FSDP a rolling or preemption checkpoint is a folder,
``checkpoint-<epoch>.dcp/`` or ``checkpoint-<epoch>-step<step>.dcp/``: every rank
writes its own shard (``__<rank>_0.distcp``, ``.metadata``) of the optimizer state
and of every entry shaped like the network's weights (``model_state_dict``, and
any other such as averaged weights); rank 0 adds ``state.pt``, the rest of the
checkpoint as plain data (epoch, step, metrics, every rank's RNG states, mid-epoch
state, which entries are sharded). The folder
is written as ``.<name>.tmp/`` and renamed when every rank has finished, so a torn
save is never taken as the latest (leftovers go at the next start, as files do);
retention is that of files. It loads at any world size: each rank reads the
parts of the saved shards that its own shard covers.

``best.tar`` stays one consolidated rank-0 file without prefixes: every
weight-shaped entry is gathered one tensor at a time and moved to rank 0's CPU, so
no rank's GPU holds the whole network. It carries no optimizer state
(``optimizer_state_dict: None``); evaluate, run, export and finetune read only the
weights.

Under ``ddp`` the manager writes files as before but still reads these folders, so
a run whose strategy changed (``on_config_change: resume``) continues either way.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from echelon3.checkpoints import aside
from echelon3.checkpoints.consolidate import consolidated
from echelon3.checkpoints.files import CheckpointManager, atomic_save
from echelon3.config.errors import CheckpointError, write_error
from echelon3.distributed.ranks import all_gather_object, barrier, is_main, unwrap

log = logging.getLogger(__name__)

STATE = "state.pt"
SHARDED = "sharded"  # in a loaded state: the folder whose shards are still to be read
KEYS = "sharded_keys"  # in state.pt: the weight-shaped entries written as shards
WEIGHTS, OPTIMIZER = "model_state_dict", "optimizer_state_dict"
_FOLDER = re.compile(r"^checkpoint-(\d+)(?:-step(\d+))?\.dcp$")


@dataclass
class Pending:
    """A sharded save in flight: the shards' future, the temp folder, its final name."""

    future: Any
    tmp: Path
    final: Path
    step: bool = False  # a step checkpoint: the step checkpoints' retention applies


def weight_keys(state: dict[str, Any]) -> list[str]:
    """The entries shaped like the network's weights (same names, all tensors)."""
    names = set(state[WEIGHTS])
    return [k for k, v in state.items() if isinstance(v, dict) and v and set(v) == names
            and all(torch.is_tensor(t) for t in v.values())]


def _rest(state: dict[str, Any]) -> dict[str, Any]:
    sharded = weight_keys(state)
    return {**{k: v for k, v in state.items() if k not in sharded and k != OPTIMIZER},
            KEYS: sharded}


class ShardedCheckpoints(CheckpointManager):
    """A :class:`CheckpointManager` that writes resume state sharded (``sharded=True``)
    and reads both layouts. :meth:`attach` gives it the network and the optimizer."""

    def __init__(self, path, checkpoints_to_keep: int = 2, sharded: bool = True, **settings):
        super().__init__(path, checkpoints_to_keep, **settings)
        self.sharded, self.model, self.optimizer = sharded, None, None
        self._pending: Pending | None = None  # the async save of the shards in flight
        self._group = None  # the process group of the background writes

    @classmethod
    def like(cls, manager: CheckpointManager, sharded: bool) -> "ShardedCheckpoints":
        return cls(manager.path, sharded=sharded, **manager.settings())

    def attach(self, model, optimizer) -> None:
        self.model, self.optimizer = unwrap(model), optimizer

    # ------------------------------------------------------------------ reading

    def rolling(self) -> list[Path]:
        found = [((_key(p), p)) for p in super().rolling()]
        if self.path.is_dir():
            found += [((int(m.group(1)), int(m.group(2) or 0)), p) for p in self.path.iterdir()
                      if (m := _FOLDER.match(p.name)) and p.is_dir()]
        return [p for _, p in sorted(found, key=lambda kp: kp[0], reverse=True)]

    def load(self, path: Path) -> dict[str, Any]:
        if not path.is_dir():
            return super().load(path)
        if not (path / ".metadata").is_file():
            raise CheckpointError(str(path), "cannot load checkpoint (no .metadata: incomplete)")
        try:
            state = torch.load(path / STATE, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(str(path / STATE), f"cannot load checkpoint ({e})") from e
        return {**state, SHARDED: str(path)}

    # ------------------------------------------------------------------ writing

    def save_checkpoint(self, state: dict[str, Any], epoch: int, best: bool = False) -> None:
        if not self.sharded:
            return super().save_checkpoint(state, epoch, best)
        if self.async_save:
            return self._write_async(state, f"checkpoint-{epoch}.dcp", best)
        written = self._write(state, f"checkpoint-{epoch}.dcp")
        if is_main():
            aside.drop_passed(self.path, written)
        if best:
            self.save_best(state)
        if is_main():
            for old in self.rolling():  # mid-epoch ones are superseded by a full epoch
                if "-step" in old.name:
                    _remove(old)
            for old in self.rolling()[self.checkpoints_to_keep:]:
                _remove(old)

    def save_preempted(self, state: dict[str, Any]) -> Path:
        if not self.sharded:
            return super().save_preempted(state)
        self.wait()
        return self._write(state, f"checkpoint-{state['epoch']}-step{state['global_step']}.dcp")

    def save_step(self, state: dict[str, Any]) -> Path:
        if not self.sharded:
            return super().save_step(state)
        name = f"checkpoint-{state['epoch']}-step{state['global_step']}.dcp"
        if self.async_save:
            self._write_async(state, name, best=False, step=True)
            return self.path / name
        self.wait()
        path = self._write(state, name)
        if is_main():
            self._retain_steps(path)
        return path

    def save_best(self, state: dict[str, Any]) -> None:
        """Consolidate on rank 0's CPU (a collective under FSDP), write ``best.tar``."""
        if not self.sharded:
            return super().save_best(state)
        best = _best(state)
        if not is_main():
            return
        if self.async_save:
            best = self.writer.copy(best)
            self.writer.submit(lambda: self._write_best(best))
        else:
            self._write_best(best)

    def _prepare(self, state: dict[str, Any], name: str):
        """(final folder, its temp folder, made empty, every rank's shards of ``state``)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        final, tmp = self.path / name, self.path / f".{name}.tmp"
        if is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        shards = {k: state[k] for k in weight_keys(state)}
        shards[OPTIMIZER] = get_optimizer_state_dict(self.model, self.optimizer)
        return final, tmp, shards

    def _write(self, state: dict[str, Any], name: str) -> Path:
        """Every rank its shard, rank 0 the rest; renamed into place once all are done."""
        import torch.distributed.checkpoint as dcp

        final, tmp, shards = self._prepare(state, name)
        try:
            dcp.save(shards, checkpoint_id=tmp)
            if is_main():
                atomic_save(_rest(state), tmp / STATE)
                _remove(final)
                os.replace(tmp, final)
                _fsync_dir(self.path)
        except OSError as e:
            raise write_error(final, e) from e
        barrier()
        return final

    # ------------------------------------------------------------------ async_save

    def _write_async(self, state: dict[str, Any], name: str, best: bool,
                     step: bool = False) -> None:
        """The shards by ``dcp.async_save`` (staged to the CPU before it returns), rank 0's
        ``state.pt`` (and ``best.tar``) by its writer; renamed into place at :meth:`wait`."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        final = self.path / name
        try:
            final, tmp, shards = self._prepare(state, name)
            winner = _best(state) if best else None
            future = dcp.async_save(shards, checkpoint_id=tmp,
                                    process_group=self._background_group())
        except OSError as e:
            raise write_error(final, e) from e
        self._pending = Pending(future, tmp, final, step)
        if is_main():
            copied = self.writer.copy({"rest": _rest(state), "best": winner})
            self.writer.submit(lambda: self._write_rest(copied, tmp))

    def _write_rest(self, copied: dict[str, Any], tmp: Path) -> None:
        atomic_save(copied["rest"], tmp / STATE)
        if copied["best"] is not None:
            self._write_best(copied["best"])

    def _background_group(self):
        """A gloo group of its own for the background writes' collectives: on the default
        group they would interleave with training's, in another order on each rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def wait(self, alone: bool = False) -> None:
        """Wait for the save in flight; when every rank's shards are written, rename the
        folder into place and apply retention. Every rank calls it, unless ``alone``
        (stopping on an error): then the folder stays ``.<name>.tmp`` (removed at the next
        start) and a failure is logged, not raised."""
        pending, self._pending = self._pending, None
        failure = None
        if pending is not None:
            try:
                pending.future.result()
            except Exception as e:
                failure = write_error(pending.final, e) or e
        try:
            self.writer.wait()
        except Exception as e:
            failure = failure or e
        if alone or pending is None:
            if failure is not None and alone:
                log.error("the checkpoint written in the background failed: %s", failure)
            elif failure is not None:
                raise failure
            return
        said = all_gather_object(None if failure is None else str(failure))
        if failure is not None:
            raise failure
        if any(said):
            raise CheckpointError(str(pending.final), "not written: another rank failed "
                                  f"({next(m for m in said if m)})")
        if is_main():
            try:
                _remove(pending.final)
                os.replace(pending.tmp, pending.final)
                _fsync_dir(self.path)
            except OSError as e:
                raise write_error(pending.final, e) from e
            if pending.step:
                self._retain_steps(pending.final)
            else:
                aside.drop_passed(self.path, pending.final)
                self._retain()

    def remove_leftovers(self) -> list[Path]:
        stale = super().remove_leftovers()
        if not is_main() or not self.path.is_dir():
            return stale
        for path in self.path.iterdir():
            if path.is_dir() and path.name.startswith(".checkpoint-") and \
                    path.name.endswith(".dcp.tmp"):
                shutil.rmtree(path, ignore_errors=True)
                stale.append(path)
        return stale


def _best(state: dict[str, Any]) -> dict[str, Any] | None:
    """``best.tar``'s content, consolidated on rank 0 (a collective under FSDP; None elsewhere)."""
    full = {k: consolidated(state[k]) for k in weight_keys(state)}
    if not is_main():
        return None
    rest = {k: v for k, v in _rest(state).items() if k != KEYS}
    return {**rest, **full, OPTIMIZER: None}


def read_sharded(state: dict[str, Any], model, optimizer) -> None:
    """Fill a sharded checkpoint's weight-shaped entries (laid out as ``model``'s own
    weights) and put its optimizer state into ``optimizer``; then
    ``state["optimizer_state_dict"]`` is what the trainer loads, as from a file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    net = unwrap(model)
    own = net.state_dict()
    shards = {k: {name: torch.empty_like(v) for name, v in own.items()} for k in state[KEYS]}
    shards[OPTIMIZER] = get_optimizer_state_dict(net, optimizer)
    try:
        dcp.load(shards, checkpoint_id=state[SHARDED])
    except Exception as e:
        raise CheckpointError(state[SHARDED], "does not fit the configured network and "
                              f"optimizer: {str(e).strip().splitlines()[0]}") from e
    set_optimizer_state_dict(net, optimizer, optim_state_dict=shards.pop(OPTIMIZER))
    state.update(shards)
    state[OPTIMIZER] = optimizer.state_dict()


def _key(path: Path) -> tuple[int, int]:
    numbers = [int(n) for n in re.findall(r"\d+", path.name)]
    return numbers[0], numbers[1] if len(numbers) > 1 else 0


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
