"""echelon3.config.arguments: keyword names and value types checked against a signature."""

from __future__ import annotations

from typing import Literal, Optional, Sequence, Union

import pytest
import torch

from echelon3.config.arguments import check_arguments
from echelon3.config.errors import BuildError


class Component:
    def __init__(self, count: int = 1, rate: Union[float, torch.Tensor] = 0.1,
                 mode: Literal["a", "b"] = "a", name: Optional[str] = None,
                 sizes: tuple[int, int] = (1, 2), sets: str | Sequence[str] | None = None,
                 flag: bool = False, untyped=3, anything=None):
        pass


@pytest.mark.parametrize("kwargs", [
    {"count": 3, "rate": 1, "mode": "b", "name": None, "sizes": [3, 4], "sets": ["x"],
     "flag": True, "untyped": 0.5, "anything": {"k": 1}},
    {"rate": torch.tensor(0.1), "sets": "x", "name": "n"},
])
def test_values_that_fit_pass(kwargs):
    check_arguments(Component, kwargs, "part")


@pytest.mark.parametrize("kwargs, message", [
    ({"count": "abc"}, "part.config.count: expected an integer, got 'abc'"),
    ({"count": 2.5}, "part.config.count: expected an integer, got 2.5"),
    ({"count": True}, "part.config.count: expected an integer, got True"),
    ({"rate": "abc"}, "part.config.rate: expected a number or a Tensor, got 'abc'"),
    ({"mode": "c"}, "part.config.mode: expected one of 'a', 'b', got 'c'"),
    ({"name": 3}, "part.config.name: expected a string or null, got 3"),
    ({"flag": "yes"}, "part.config.flag: expected true or false, got 'yes'"),
    ({"untyped": "x"}, "part.config.untyped: expected a number, got 'x'"),
    ({"coutn": 1}, "part.config.coutn: Component does not accept 'coutn' (did you mean "
                   "'count'?)"),
])
def test_a_value_of_the_wrong_type_names_the_key_and_what_was_expected(kwargs, message):
    with pytest.raises(BuildError) as caught:
        check_arguments(Component, kwargs, "part")
    assert str(caught.value).startswith(message), str(caught.value)
