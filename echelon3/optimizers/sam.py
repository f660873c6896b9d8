"""Sharpness-aware minimisation (Foret et al., 2021), stepped with a closure.

``step(closure)`` evaluates the closure for the gradient at ``w``, climbs to
``w + e(w)`` within radius ``rho``, evaluates the closure again there, returns to ``w`` and lets
the base optimizer step with that sharpness-aware gradient: two
forward/backward passes per step. ``adaptive=True`` scales the climb per
parameter by ``|w|`` (ASAM).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from echelon3.config.build import instantiate, is_spec, resolve_type


class SAMOptimizer(torch.optim.Optimizer):
    lazy_specs = ("base_optimizer",)  # built here, with params=
    needs_closure = True  # the trainer steps it with a closure (echelon3.optimizers.closure)

    def __init__(self, params, base_optimizer: Any = "torch.optim.SGD", rho: float = 0.05,
                 adaptive: bool = False, **base_kwargs):
        if rho < 0:
            raise ValueError(f"rho must be non-negative, got {rho}")
        super().__init__(params, dict(rho=rho, adaptive=adaptive, **base_kwargs))
        if is_spec(base_optimizer):
            if base_kwargs:
                raise ValueError(f"{', '.join(sorted(base_kwargs))} belong(s) in "
                                 "base_optimizer.config when base_optimizer is a "
                                 "module/type/config triple")
            self.base_optimizer = instantiate(base_optimizer, "optimizer.config.base_optimizer",
                                              params=self.param_groups)
        else:
            if isinstance(base_optimizer, str):
                module, _, name = base_optimizer.rpartition(".")
                base_optimizer = resolve_type({"module": module, "type": name},
                                              "optimizer.config.base_optimizer")
            self.base_optimizer = base_optimizer(self.param_groups, **base_kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def _grad_norm(self) -> torch.Tensor:
        norms = [((p.abs() if g["adaptive"] else 1.0) * p.grad).norm(p=2)
                 for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not norms:
            return torch.tensor(0.0)
        return torch.norm(torch.stack([n.to(norms[0].device) for n in norms]), p=2)

    @torch.no_grad()
    def first_step(self) -> None:
        scale_base = self._grad_norm() + 1e-12
        for group in self.param_groups:
            scale = group["rho"] / scale_base
            for p in group["params"]:
                if p.grad is None:
                    continue
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)
                self.state[p]["e_w"] = e_w

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if "e_w" in self.state[p]:
                    p.sub_(self.state[p].pop("e_w"))
        self.base_optimizer.step()

    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        if closure is None:
            raise RuntimeError("SAMOptimizer needs a closure that recomputes the loss")
        with torch.enable_grad():
            loss = closure()  # gradient at w
        self.first_step()
        with torch.enable_grad():
            closure()  # gradient at w + e(w)
        self.second_step()
        return loss

    def state_dict(self):
        return self.base_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.base_optimizer.load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups
