"""What an exported ``model.onnx`` takes and returns, written where its user looks.

The same description goes into the graph's ``metadata_props`` (flat string keys:
``input_name``, ``input_shape``, ``input_dtype``, ``preprocess``, ``output_is``...,
readable with ``onnxruntime.InferenceSession(...).get_modelmeta().custom_metadata_map``)
and into ``model.json`` beside it. Names, shapes and dtypes are read back from the
written graph, so they say what the file does, not what was asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from echelon3.config.build import to_plain


def tensor_info(value) -> dict[str, Any]:
    """``{name, shape, dtype}`` of a graph input or output; a symbolic axis is its name."""
    from onnx.helper import tensor_dtype_to_np_dtype

    tensor = value.type.tensor_type
    shape = [d.dim_param or d.dim_value for d in tensor.shape.dim]
    return {"name": value.name, "shape": shape,
            "dtype": tensor_dtype_to_np_dtype(tensor.elem_type).name}


def graph_io(path: Path) -> tuple[dict, dict]:
    """(first input, first output) of the graph at ``path``."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return tensor_info(graph.input[0]), tensor_info(graph.output[0])


def _loss_types(cfg) -> set[str]:
    node = to_plain(cfg.get("loss")) or []
    entries = node if isinstance(node, list) else [node]
    specs = [spec for entry in entries if isinstance(entry, dict) for spec in entry.values()]
    return {str(spec.get("type")) for spec in specs if isinstance(spec, dict)}


def output_meaning(cfg, post: nn.Module | None, shape: list) -> str:
    """What one output row is, in words: logits or probabilities over N classes, or else."""
    classes = shape[-1] if len(shape) == 2 and isinstance(shape[-1], int) else None
    logits = classes and classes > 1 and "CrossEntropyLoss" in _loss_types(cfg)
    net_out = f"logits over {classes} classes" if logits else "the network's output"
    if post is None:
        return net_out
    if logits and isinstance(post, nn.Softmax):
        return f"probabilities over {classes} classes ({post!r} of the logits)"
    return f"{post!r} applied to {net_out}"


def input_meaning(dataset, pre: nn.Module | None, declared: nn.Module | None) -> str:
    """What the graph expects, relative to what the test set gives the network."""
    name = type(dataset).__name__ if dataset is not None else None
    if pre is None and declared is not None:
        return (f"inputs already transformed as the test set ({name}) transforms them: "
                f"{declared!r} of its raw inputs")
    if pre is not None and declared is not None:
        return f"raw inputs, as the test set ({name}) holds them before its preprocess"
    if pre is not None:
        return "raw inputs, transformed inside the graph by its preprocess"
    return "the network's inputs" + (f", as the test set ({name}) gives them" if name else "")


def describe(path: Path, *, cfg, dataset, pre, pre_from: str | None, declared, post, source,
             exporter: str) -> dict[str, Any]:
    """The contract of the graph at ``path`` (the content of ``model.json``)."""
    import onnx

    from echelon3 import __version__

    inputs, outputs = graph_io(path)
    opsets = {o.domain or "ai.onnx": o.version for o in onnx.load(
        str(path), load_external_data=False).opset_import}
    return {
        "file": "model.onnx",
        "input": {**inputs, "is": input_meaning(dataset, pre, declared)},
        "preprocess": None if pre is None else f"{pre!r} (from {pre_from}), inside the graph",
        "output": {**outputs, "is": output_meaning(cfg, post, outputs["shape"])},
        "postprocess": None if post is None else f"{post!r}, inside the graph",
        # The entry a PickOutput postprocess kept of a network returning a mapping.
        "output_key": getattr(post, "key", None) if type(post).__name__ == "PickOutput" else None,
        "source": str(source),
        "exporter": exporter,
        "opset": opsets.get("ai.onnx"),
        "echelon3_version": __version__,
    }


def flat(contract: dict[str, Any]) -> dict[str, str]:
    """``{"input": {"name": ...}}`` -> ``{"input_name": "..."}``, every value a string."""
    out = {}
    for key, value in contract.items():
        if isinstance(value, dict):
            out.update({f"{key}_{k}": v for k, v in flat(value).items()})
        else:
            out[key] = value if isinstance(value, str) else json.dumps(value)
    return out


def write_metadata(path: Path, contract: dict[str, Any]) -> None:
    """Add the contract to the graph's ``metadata_props`` (in place)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    onnx.helper.set_model_props(model, {**props, **flat(contract)})
    onnx.save(model, str(path))
