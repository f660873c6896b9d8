"""``optimizer.no_decay``: the optimizer's groups against a split made by hand."""

from __future__ import annotations

import logging

import pytest
import torch
from omegaconf import OmegaConf

from echelon3.config.errors import ConfigError
from echelon3.tasks.components import build_optimizer
from echelon3.tasks.finetune import WarmStart, scale_group_lrs


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x):
        return self.head(self.body(self.norm(self.embed(x))))


class Norm(torch.nn.LayerNorm):
    """A subclass counts as the class it extends."""


def _cfg(no_decay, **extra):
    return OmegaConf.create({"optimizer": {
        "module": "torch.optim", "type": "AdamW",
        "config": {"lr": 0.01, "weight_decay": 0.1}, "no_decay": no_decay}, **extra})


def _names(net, optimizer):
    names = {id(p): n for n, p in net.named_parameters()}
    return [(sorted(names[id(p)] for p in g["params"]), g["weight_decay"], g["lr"])
            for g in optimizer.param_groups]


@pytest.mark.parametrize("rules, exempt", [
    ({"ndim_below": 2}, {"norm.weight", "norm.bias", "body.bias"}),
    ({"modules": ["LayerNorm", "Embedding"]}, {"norm.weight", "norm.bias", "embed.weight"}),
    ({"names": ["*.bias"]}, {"norm.bias", "body.bias"}),
    ({"ndim_below": 2, "modules": ["LayerNorm"], "names": ["body.*"]},
     {"norm.weight", "norm.bias", "body.bias", "body.weight"}),
])
def test_groups_equal_the_hand_split(rules, exempt, caplog):
    net = Small()
    with caplog.at_level(logging.INFO, logger="echelon3.tasks.components"):
        optimizer = build_optimizer(_cfg(rules), net.parameters(), net=net)
    everything = sorted(n for n, _ in net.named_parameters())
    decay = [n for n in everything if n not in exempt]
    assert _names(net, optimizer) == [(decay, 0.1, 0.01), (sorted(exempt), 0.0, 0.01)]
    values = sum(p.numel() for n, p in net.named_parameters() if n in exempt)
    assert (f"weight_decay 0: {len(exempt)} tensors, {values:,} values") in caplog.text


def test_a_subclass_matches_its_base():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), Norm(3))
    optimizer = build_optimizer(_cfg({"modules": ["LayerNorm"]}), net.parameters(), net=net)
    assert _names(net, optimizer)[1][0] == ["1.bias", "1.weight"]


def test_it_composes_with_finetune_groups_and_frozen_parameters():
    net = Small()
    cfg = _cfg({"ndim_below": 2}, finetune={"freeze_patterns": ["^norm\\.weight$"],
                                            "param_groups": [{"pattern": "^body\\.",
                                                              "lr_mult": 10.0}]})
    params = WarmStart(cfg).apply(net)
    optimizer = build_optimizer(cfg, params, net=net)
    scale_group_lrs(optimizer)
    assert _names(net, optimizer) == [
        (["body.weight"], 0.1, pytest.approx(0.1)), (["body.bias"], 0.0, pytest.approx(0.1)),
        (["embed.weight"], 0.1, 0.01), (["norm.bias"], 0.0, 0.01)]  # norm.weight: frozen


@pytest.mark.parametrize("rules, key", [
    ({"modules": ["BatchNorm1d"]}, "optimizer.no_decay.modules[0]"),
    ({"names": ["*.bias", "decoder.*"]}, "optimizer.no_decay.names[1]"),
    ({"ndim_below": 0}, "optimizer.no_decay.ndim_below"),
    ({"names": "*.bias"}, "optimizer.no_decay.names"),
    ({"ndmi_below": 2}, "optimizer.no_decay.ndmi_below"),
    ([2], "optimizer.no_decay"),
])
def test_a_rule_that_matches_nothing_or_is_misspelled_names_its_key(rules, key):
    net = Small()
    with pytest.raises(ConfigError) as info:
        build_optimizer(_cfg(rules), net.parameters(), net=net)
    assert info.value.key == key and str(info.value).startswith(f"{key}:")


def test_without_rules_the_params_go_as_given():
    net = Small()
    cfg = OmegaConf.create({"optimizer": {"module": "torch.optim", "type": "SGD",
                                          "config": {"lr": 0.1}}})
    optimizer = build_optimizer(cfg, net.parameters())
    assert len(optimizer.param_groups) == 1
