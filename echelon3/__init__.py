"""echelon3: config-driven PyTorch training whose tasks are also Snakemake rules.

Module paths from before the package was grouped into wings (``echelon3.dist``,
``echelon3.mlops``, ``echelon3.export``, ...) still import, with a ``FutureWarning``
naming the new home: a config or a script written for 0.5 keeps working.

The Python API (:mod:`echelon3.api`): ``echelon3.load(run_dir)`` gives a trained run's
network with its preprocessing, ``echelon3.predict(run_dir, inputs)`` its outputs. They
are imported on first use, so ``import echelon3`` (and ``echelon3 --help``) imports no
torch.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.5.0"

# old path -> new modules, looked up in this order for each name.
MOVED = {
    "dist": ("distributed.ranks", "distributed.launch"),
    "ddp": ("distributed.ddp",), "fsdp": ("distributed.fsdp",),
    "runtime": ("distributed.runtime",), "preemption": ("distributed.preemption",),
    "interrupt": ("distributed.interrupt",), "precision": ("distributed.precision",),
    "build": ("config.build", "tasks.components"), "arguments": ("config.arguments",),
    "sections": ("config.sections",), "preflight": ("config.preflight",),
    "errors": ("config.errors",),
    "checkpoint": ("checkpoints.files",), "lock": ("checkpoints.lock",),
    "sharded": ("checkpoints.sharded", "checkpoints.consolidate",
                "checkpoints.optimizer_layout"),
    "extension": ("checkpoints.extension",),
    "train_data": ("data.train_data",), "splits": ("data.splits",),
    "batches": ("data.batches",), "samples": ("data.samples",), "rng": ("data.rng",),
    "schedulers": ("trainers.schedulers",), "validation": ("trainers.evaluation",),
    "train": ("tasks.train", "tasks.identity"), "evaluate": ("tasks.evaluate",),
    "run": ("tasks.run",), "predict": ("tasks.predict",), "export": ("tasks.export",),
    "finetune": ("tasks.finetune",), "contract": ("tasks.contract",),
    "summary": ("tasks.summary",), "profiles": ("tasks.profiles",),
    "bottleneck": ("observe.bottleneck",), "profiling": ("observe.profiler",),
    "mlops": ("observe.loggers",), "mlops.base": ("observe.loggers",),
    "mlops.mlflow": ("observe.mlflow",), "mlops.mlflow_config": ("observe.mlflow_config",),
    "mlops.mlflow_run": ("observe.mlflow_run",),
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``echelon3.<old>`` as a module whose names are those of its new homes."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.partition(".")[2]
        if fullname.startswith(f"{__name__}.") and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        old = module.__name__.partition(".")[2]
        homes = [f"{__name__}.{new}" for new in MOVED[old]]
        warnings.warn(f"{module.__name__} moved to {' and '.join(homes)}; the old path will "
                      "go in a later release", FutureWarning, stacklevel=2)
        modules = [importlib.import_module(home) for home in homes]

        def __getattr__(name):
            for new in modules:
                if hasattr(new, name):
                    return getattr(new, name)
            raise AttributeError(f"module {module.__name__!r} (now {' and '.join(homes)}) has "
                                 f"no attribute {name!r}")

        module.__getattr__ = __getattr__
        module.__dir__ = lambda: sorted({n for new in modules for n in dir(new)})
        module.__path__ = []  # echelon3.mlops had modules of its own
        if old in LAZY:  # importing it makes it the package's attribute of that name
            module.__class__ = _CallableModule


class _CallableModule(type(sys)):
    """An old module path that shares its name with a function of the API
    (``echelon3.predict``): called, it is that function."""

    def __call__(self, *args, **kwargs):
        api = importlib.import_module(f"{__name__}.{LAZY[self.__name__.partition('.')[2]]}")
        return getattr(api, self.__name__.partition(".")[2])(*args, **kwargs)


sys.meta_path.append(_OldPaths())

# name -> the module that defines it, imported on first use (it imports torch)
LAZY = {"load": "api", "predict": "api", "Model": "api"}


def __getattr__(name):
    if name in LAZY:
        return getattr(importlib.import_module(f"{__name__}.{LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *LAZY})
