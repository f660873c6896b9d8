"""``echelon3 profiles install``: make ``snakemake --profile slurm`` work by name.

Snakemake looks a profile *name* up in the working directory, then in its user
and site config folders (``~/.config/snakemake`` or ``$XDG_CONFIG_HOME/snakemake``,
then ``/etc/xdg/snakemake``), never in ``profiles/``. This command links each
folder of the project's ``profiles/`` (those holding a ``config.yaml``) into
the user folder, so the project stays the one source: an edit to
``profiles/slurm/config.yaml`` is what the next ``snakemake --profile slurm``
reads. ``--copy`` copies instead (a machine where the project folder moves).

A profile of that name which is not already this link (a site's own profile,
or a link elsewhere) is left alone and named, exit 2; ``--force`` moves it
aside to ``<name>.replaced-<time>`` first, never deletes it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from echelon3.config.errors import UserError


class ProfileError(UserError):
    """A profile that cannot be installed; the message names the path."""


def user_profile_dir() -> Path:
    """Snakemake's own user config folder (it honours XDG_CONFIG_HOME)."""
    from snakemake.cli import get_appdirs

    return Path(get_appdirs().user_config_dir)


def default_source() -> Path:
    """``profiles/`` of the working directory (the project root), else of the project
    echelon3 was installed from (an editable install)."""
    here = Path.cwd() / "profiles"
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[1] / "profiles"


def profiles_in(source: Path) -> list[Path]:
    if not source.is_dir():
        raise ProfileError(str(source), "no such folder (run from the project root, or "
                           "pass --source profiles/)")
    # profiles/default is Snakemake's workflow profile, read from the project itself on
    # every run: installing it by name would add nothing
    found = sorted(p for p in source.iterdir()
                   if (p / "config.yaml").is_file() and p.name != "default")
    if not found:
        raise ProfileError(str(source), "holds no profile (a folder with a config.yaml)")
    return found


def _is_link_to(target: Path, profile: Path) -> bool:
    return target.is_symlink() and Path(os.readlink(target)).resolve() == profile.resolve()


def _taken(target: Path, profile: Path, copy: bool) -> bool:
    """Something of that name is there and is not this project's link."""
    return (target.exists() or target.is_symlink()) and (copy or not _is_link_to(target,
                                                                                 profile))


def install_one(profile: Path, dest_dir: Path, *, force: bool, copy: bool) -> str:
    """Install one profile folder; -> what was done, one line."""
    target = dest_dir / profile.name
    if not copy and _is_link_to(target, profile):
        return f"{profile.name}: already installed ({target} -> {profile.resolve()})"
    note = ""
    if _taken(target, profile, copy):
        if not force:
            raise ProfileError(str(target), "a profile of that name exists and is not this "
                               "project's; keep it, or pass --force (moves it aside)")
        aside = target.with_name(f"{target.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        target.rename(aside)
        note = f" (the previous one moved to {aside})"
    dest_dir.mkdir(parents=True, exist_ok=True)
    if copy:
        shutil.copytree(profile, target, symlinks=False)
        return f"{profile.name}: copied to {target}{note}"
    target.symlink_to(profile.resolve(), target_is_directory=True)
    return f"{profile.name}: {target} -> {profile.resolve()}{note}"


def install(source: Path | None = None, *, force: bool = False, copy: bool = False,
            dest_dir: Path | None = None) -> list[str]:
    """Install every profile of ``source``; checks them all before touching any."""
    profiles = profiles_in(source or default_source())
    dest_dir = dest_dir or user_profile_dir()
    if not force:
        for profile in profiles:
            if _taken(dest_dir / profile.name, profile, copy):
                install_one(profile, dest_dir, force=False, copy=copy)  # raises, naming it
    return [install_one(p, dest_dir, force=force, copy=copy) for p in profiles]


def add_parser(sub) -> None:
    """``echelon3 profiles install [--force] [--copy] [--source DIR]``."""
    p = sub.add_parser("profiles", help="install the project's Snakemake profiles by name",
                       description=__doc__.split("\n\n")[0])
    actions = p.add_subparsers(dest="action", metavar="{install}", required=True)
    inst = actions.add_parser(
        "install", help="link profiles/* into Snakemake's user config folder",
        description="Link (or copy) each profile of profiles/ into Snakemake's user config "
        "folder, so that `snakemake --profile <name>` finds it from any directory.")
    inst.add_argument("--force", action="store_true",
                      help="move a different profile of the same name aside first")
    inst.add_argument("--copy", action="store_true", help="copy instead of linking")
    inst.add_argument("--source", type=Path, default=None,
                      help="folder of profiles (default: ./profiles, else the project's)")


def main(args: argparse.Namespace) -> None:
    for line in install(args.source, force=args.force, copy=args.copy):
        print(line)
