"""Placement rules: which module of the model runs where, and on which operator.

Rule file format (KTransformers' ``optimize_rules`` format), a YAML list of::

    - match:
        name: "^model\\.layers\\.\\d+\\.mlp$"     # re.search'ed against the full dotted module path
        class: transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE   # isinstance check
      replace:
        class: engines.kt.placement.operators.MoEWithCPUExperts   # an operator, or `default` (keep the module)
        kwargs: {device: "cuda:0", method: AMXINT8}
      recursive: false                                  # default true

- ``match`` needs ``name`` and/or ``class``; when both are given both must hold. The model itself has
  the empty path, so ``name: "^$"`` matches it.
- Modules are visited top-down and the FIRST matching rule wins for each module.
- ``replace.class: default`` (or no class) keeps the module and puts it on ``kwargs.device``; without a
  device it stays where its parent is. An operator class replaces the module through its
  ``from_module(module, name, config, **kwargs)``; ``device`` is always passed (inherited if not given).
- Children are matched too and inherit their parent's device unless a rule matches them;
  ``recursive: false`` stops matching below a module (its children still inherit its device).
- Routed experts run in kt-kernel on the CPU whatever ``device`` says (``device`` is where their output
  goes), so their weights are planned on ``cpu``.
- Operators may not nest, except KTransformers' usual ``KTransformersExperts`` rule below a
  ``KDeepseekV2MoE`` rule: that experts rule's kwargs (``method``, ``gpu_experts`` ...) are folded into the
  enclosing MoEWithCPUExperts.

KTransformers' class names and kwargs (``generate_device``, ``backend: AMXInt8``, ``transfer_map`` ...)
are translated by the tables in ``engines.kt.placement.aliases``. Every mistake a user can make raises RuleError
naming the file, the rule index (0-based, plus its line) and the offending key.
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import yaml
from torch import nn

from engines.kt.placement.aliases import (DEFAULT, MATCH_CLASS_ALIASES, MOE_WITH_CPU_EXPERTS, OPERATOR_CLASSES,
                                          ROUTED_EXPERTS_CPU, KwargError, normalize_device, resolve_replace_class,
                                          translate_kwargs)
from engines.kt.experts.methods import ExpertsUnsupportedError
from engines.kt.placement.operators import OperatorOptions

log = logging.getLogger("ktserve.kt.rules")

# Submodule (relative to the replaced module) whose weights kt-kernel keeps in host memory.
_CPU_EXPERTS = {ROUTED_EXPERTS_CPU: "", MOE_WITH_CPU_EXPERTS: "experts"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")
# Where hidden states enter a decoder layer: its device is the layer's device for the transfer map.
_LAYER_ENTRY = ("input_layernorm", "self_attn")
_DEVICE_KWARGS = {"device", "generate_device", "prefill_device", "out_device"}


class RuleError(ValueError):
    """A rule file that cannot be honoured; the message names file, rule index and key."""

    def __init__(self, source: str, problem: str, index: int | None = None, key: str | None = None,
                 line: int | None = None):
        where = f"{source}:{line}" if line else str(source)
        if index is not None:
            where += f": rule {index}"
        if key:
            where += f": {key}"
        super().__init__(f"{where}: {problem}")
        self.source, self.index, self.key = source, index, key


def import_dotted(path: str) -> object:
    """``"package.module.Name"`` -> the object; ImportError/AttributeError if it is not there."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(prefix)
        except ModuleNotFoundError as e:
            # Only "this prefix is not a module" means try a shorter one; a broken import inside it is real.
            if e.name and (prefix == e.name or prefix.startswith(e.name + ".")):
                continue
            raise
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot import {path!r}")


def resolve_operator(name: str) -> object:
    """The operator class a rule names: a family's through the alias table (aliases.py: OPERATOR_CLASSES), which
    keeps placement from importing any family; the others as named."""
    return import_dotted(OPERATOR_CLASSES.get(name, name))


@dataclass
class Rule:
    """One parsed rule; ``replace`` and ``kwargs`` are already translated to our operators' terms."""

    index: int
    name: str | None
    cls: str | None
    replace: str  # "default" or one of engines.kt.placement.aliases.OPERATORS
    kwargs: dict
    recursive: bool = True
    source: str = "<rules>"
    line: int | None = None
    _pattern: re.Pattern | None = field(init=False, repr=False, compare=False, default=None)
    _classes: tuple[type, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self):
        if self.name is None and self.cls is None:
            raise self.error("match", "needs `name` and/or `class`")
        if self.name is not None:
            if not isinstance(self.name, str):
                raise self.error("match.name", "must be a string (a regular expression)")
            try:
                self._pattern = re.compile(self.name)
            except re.error as e:
                raise self.error("match.name", f"bad regular expression {self.name!r}: {e}") from None
        if self.cls is not None:
            self._classes = self._resolve_classes()

    def _resolve_classes(self) -> tuple[type, ...]:
        if not isinstance(self.cls, str):
            raise self.error("match.class", "must be a dotted class path")
        classes = []
        for path in MATCH_CLASS_ALIASES.get(self.cls, (self.cls,)):
            try:
                obj = import_dotted(path)
            except (ImportError, AttributeError) as e:
                raise self.error("match.class", f"unknown class {self.cls!r} ({e})") from None
            if not isinstance(obj, type):
                raise self.error("match.class", f"{self.cls!r} is not a class")
            classes.append(obj)
        return tuple(classes)

    def matches(self, path: str, module: nn.Module) -> bool:
        if self._classes and not isinstance(module, self._classes):
            return False
        return self._pattern is None or self._pattern.search(path) is not None

    def error(self, key: str, problem: str) -> RuleError:
        return RuleError(self.source, problem, self.index, key, self.line)


def load_rules(path: str | Path) -> list[Rule]:
    """Parse a rule file, translate KTransformers names, and check everything that needs no model."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text)
        nodes = yaml.compose(text, Loader=yaml.SafeLoader)
    except OSError as e:
        raise RuleError(source, f"cannot read rule file ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise RuleError(source, f"not valid YAML: {e}") from None
    if not isinstance(data, list) or not data:
        raise RuleError(source, "must be a non-empty YAML list of rules")
    lines = [node.start_mark.line + 1 for node in nodes.value]
    return [_parse_rule(item, index, source, lines[index]) for index, item in enumerate(data)]


def _parse_rule(item: object, index: int, source: str, line: int) -> Rule:
    def fail(key: str, problem: str) -> RuleError:
        return RuleError(source, problem, index, key, line)

    if not isinstance(item, dict):
        raise fail("rule", "must be a mapping with `match` and `replace`")
    _check_keys(item, {"match", "replace", "recursive"}, "", fail)
    match, replace = item.get("match"), item.get("replace")
    if not isinstance(match, dict):
        raise fail("match", "required: a mapping with `name` and/or `class`")
    _check_keys(match, {"name", "class"}, "match.", fail)
    if not isinstance(replace, dict):
        raise fail("replace", "required: a mapping with `class` and `kwargs`")
    _check_keys(replace, {"class", "kwargs", "device"}, "replace.", fail)
    recursive = item.get("recursive", True)
    if not isinstance(recursive, bool):
        raise fail("recursive", f"must be true or false, not {recursive!r}")
    raw_kwargs = replace.get("kwargs") or {}
    if not isinstance(raw_kwargs, dict):
        raise fail("replace.kwargs", "must be a mapping")
    if "device" in replace and not _DEVICE_KWARGS & raw_kwargs.keys():
        # first-generation KTransformers files: `replace.device` is where the module is built; it places the
        # module only when no kwarg says where it runs
        raw_kwargs = {**raw_kwargs, "device": replace["device"]}
    try:
        target = resolve_replace_class(str(replace.get("class", DEFAULT)))
        kwargs, notes = translate_kwargs(raw_kwargs, target)
    except KwargError as e:
        key = e.key if e.key.startswith("replace.") else f"replace.kwargs.{e.key}"
        raise fail(key, str(e)) from None
    if target == DEFAULT:
        # `default` keeps the transformers module: there is nothing to hand any other setting to.
        for key in sorted(kwargs.keys() - {"device", "transfer_map"}):
            raise fail(f"replace.kwargs.{key}", "not accepted by default, which only takes device and transfer_map")
    elif "transfer_map" in kwargs:
        raise fail("replace.kwargs.transfer_map", f"belongs on the model rule (class default), not on {target}")
    for note in notes:
        log.info("%s: rule %d: %s", source, index, note)
    return Rule(index, match.get("name"), match.get("class"), target, kwargs, recursive, source, line)


def _check_keys(mapping: dict, allowed: set[str], prefix: str, fail) -> None:
    for key in mapping:
        if key not in allowed:
            raise fail(f"{prefix}{key}", f"unknown key; expected {' / '.join(sorted(allowed))}")


@dataclass
class Placement:
    """The outcome of planning: nothing in the model has changed yet."""

    devices: dict[str, str]  # module path -> device holding its weights (every module, inherited included)
    replacements: dict[str, tuple[Rule, dict]]  # module path -> (rule, kwargs for from_module)
    unused_rules: list[Rule]
    transfer_map: dict[int, str]  # layer index -> device the hidden states move to before that layer
    default_device: str  # the model's own device (the root module)

    @property
    def uses_gpu(self) -> bool:
        """Whether any module's weights lie on a CUDA device."""
        return any(d.startswith("cuda") for d in self.devices.values())

    def device_of_param(self, param_name: str) -> str:
        """Device for a parameter or buffer named as in the original model's state dict."""
        path = param_name
        while path:
            path = path.rpartition(".")[0]
            if path in self.devices:
                return self.devices[path]
        return self.default_device


@dataclass
class _Owner:
    """The nearest enclosing module an operator replaces; rules below it may not replace again."""

    path: str
    rule: Rule
    kwargs: dict


class _Planner:
    def __init__(self, rules: list[Rule], fold: dict[str, str]):
        self.rules = rules
        self.fold = fold
        self.used: set[int] = set()
        self.devices: dict[str, str] = {}
        self.replacements: dict[str, tuple[Rule, dict]] = {}
        self.transfer_maps: list[Rule] = []

    def visit(self, path: str, module: nn.Module, device: str, owner: _Owner | None, matching: bool) -> None:
        rule = next((r for r in self.rules if r.matches(path, module)), None) if matching else None
        if rule is not None:
            self.used.add(id(rule))
            device = self.fold.get(rule.kwargs.get("device", device), rule.kwargs.get("device", device))
            if rule.replace != DEFAULT:
                owner = self._replace(path, rule, device, owner)
            elif "transfer_map" in rule.kwargs:
                self.transfer_maps.append(rule)
        self.devices[path] = "cpu" if _holds_cpu_experts(path, owner) else device
        matching = matching and (rule is None or rule.recursive)
        for name, child in module.named_children():
            self.visit(f"{path}.{name}" if path else name, child, device, owner, matching)

    def _replace(self, path: str, rule: Rule, device: str, owner: _Owner | None) -> _Owner:
        kwargs = {**rule.kwargs, "device": device}
        if owner is None:
            if not path:
                raise rule.error("replace.class", "the model itself cannot be replaced; match a submodule")
            self.replacements[path] = (rule, kwargs)
            return _Owner(path, rule, kwargs)
        if owner.rule.replace == MOE_WITH_CPU_EXPERTS and rule.replace == ROUTED_EXPERTS_CPU:
            _fold_experts(rule, kwargs, owner)
            return owner
        raise rule.error("replace.class", f"{path} lies inside {owner.path}, which rule {owner.rule.index} "
                                          f"already replaces with {owner.rule.replace}")

    def transfer_map(self, start: str) -> dict[int, str]:
        """Layers before which the hidden states change device, checked against any declared map.

        KTransformers' files declare only the hops between GPUs: the move from the embeddings' device into
        the first layer is implied, and a declared hop that folding made a no-op is dropped."""
        derived, entries, previous = {}, {}, start
        for path, device in self.devices.items():
            found = _LAYER.search(path)
            if found is None:
                continue
            index = int(found.group(1))
            entry = next((self.devices[f"{path}.{n}"] for n in _LAYER_ENTRY if f"{path}.{n}" in self.devices),
                         device)
            entries[index] = entry
            if entry != previous:
                derived[index] = entry
            previous = entry
        first = min(entries, default=None)
        for rule in self.transfer_maps:
            declared = {k: self.fold.get(v, v) for k, v in rule.kwargs["transfer_map"].items() if k in entries}
            declared = {k: v for k, v in declared.items() if v != entries.get(k - 1, start)}
            expected = {k: v for k, v in derived.items() if k != first or k in declared}
            if declared != expected:
                raise rule.error("replace.kwargs.transfer_map",
                                 f"says {declared}, but the rules move hidden states at {expected}")
        return derived


def _fold_experts(rule: Rule, kwargs: dict, owner: _Owner) -> None:
    """KTransformers splits one MoE block over two rules (the block, then its experts); we run it as one
    operator, so the experts rule's settings join the block's."""
    for key, value in kwargs.items():
        if key == "device" and "device" not in rule.kwargs:
            continue
        if key in owner.kwargs and owner.kwargs[key] != value:
            raise rule.error(f"replace.kwargs.{key}", f"{value!r} conflicts with {owner.kwargs[key]!r} from rule "
                                                      f"{owner.rule.index}, whose MoE operator runs these experts")
        owner.kwargs[key] = value


def _holds_cpu_experts(path: str, owner: _Owner | None) -> bool:
    if owner is None:
        return False
    child = _CPU_EXPERTS.get(owner.rule.replace)
    if child is None:
        return False
    root = f"{owner.path}.{child}" if child else owner.path
    return path == root or path.startswith(root + ".")


def device_folding(rules: list[Rule], gpus: int) -> dict[str, str]:
    """The CUDA devices the rules name beyond the `gpus` this machine has -> where they run instead:
    cuda:k -> cuda:(k mod gpus), so a 4-GPU file on 2 GPUs keeps its balance; every GPU -> cpu without GPUs."""
    named = set()
    for rule in rules:
        named.update(d for d in [rule.kwargs.get("device"), *rule.kwargs.get("transfer_map", {}).values()] if d)
    fold = {}
    for device in sorted(named):
        if device.startswith("cuda:") and int(device.partition(":")[2]) >= gpus:
            fold[device] = f"cuda:{int(device.partition(':')[2]) % gpus}" if gpus else "cpu"
    return fold


def plan_placement(model: nn.Module, rules: list[Rule], default_device: str = "cuda:0",
                   fold: dict[str, str] | None = None) -> Placement:
    """Decide every module's rule, device and operator without touching the model.

    ``default_device`` places the model itself when no rule matches the empty path; ``fold`` maps devices
    the rules name to the ones they run on (``device_folding``)."""
    fold = fold or {}
    default_device = normalize_device(default_device, "default_device")
    planner = _Planner(rules, fold)
    planner.visit("", model, fold.get(default_device, default_device), None, True)
    unused = [rule for rule in rules if id(rule) not in planner.used]
    for rule in unused:
        log.warning("%s:%s: rule %d matched no module (name=%r, class=%r)",
                    rule.source, rule.line, rule.index, rule.name, rule.cls)
    root = planner.devices[""]
    placement = Placement(planner.devices, planner.replacements, unused, planner.transfer_map(root), root)
    log.info("placement: %d modules replaced by operators, model on %s, transfer map %s",
             len(placement.replacements), root, placement.transfer_map or "{}")
    return placement


def apply_placement(model: nn.Module, placement: Placement, config, options=None,
                    operator_resolver: Callable[[str], object] | None = None) -> None:
    """Swap in the planned operators, each built with ``from_module(module, path, config, options, **kwargs)``
    (``options``: engines.kt.placement.operators.OperatorOptions; its defaults when None). Every operator is resolved
    and its kwargs checked against its ``KWARGS`` before the first swap, so an unknown operator or kwarg leaves
    the model untouched; an operator that refuses its module or a kwarg's value stops the swaps there, with
    an error naming the rule. New modules are built under ``torch.device("meta")``: no weights move here; the loader
    streams them in afterwards."""
    if options is None:
        options = OperatorOptions()
    swaps = []
    for path, (rule, kwargs) in placement.replacements.items():
        swaps.append((path, rule, _operator_class(rule, kwargs, operator_resolver), kwargs))
    with torch.device("meta"):
        for path, rule, cls, kwargs in swaps:
            model.set_submodule(path, _build(rule, cls, model.get_submodule(path), path, config, options, kwargs))


def _build(rule: Rule, cls: type, module: nn.Module, path: str, config, options, kwargs: dict) -> nn.Module:
    """`cls.from_module(...)`; an operator that cannot take the module the rule matched, or refuses a kwarg's
    value, is an error naming the rule. Errors about this machine (an experts method its kt-kernel build
    lacks) stay as they are: they are not the rule file's."""
    try:
        return cls.from_module(module, path, config, options, **kwargs)
    except (RuleError, ExpertsUnsupportedError):
        raise
    except (AttributeError, TypeError, ValueError) as exc:
        raise rule.error("replace", f"{cls.__name__} cannot replace {path} ({type(module).__name__}): "
                                    f"{exc}") from exc


def _operator_class(rule: Rule, kwargs: dict, resolver) -> type:
    try:
        cls = (resolver or resolve_operator)(rule.replace)
    except (ImportError, AttributeError) as e:
        raise rule.error("replace.class", f"cannot import {rule.replace}: {e}") from None
    accepted = getattr(cls, "KWARGS", None)
    if not isinstance(accepted, (set, frozenset)) or not hasattr(cls, "from_module"):
        raise rule.error("replace.class", f"{rule.replace} is not an operator (needs KWARGS and from_module)")
    for key in sorted(set(kwargs) - accepted):
        raise rule.error(f"replace.kwargs.{key}",
                         f"not accepted by {cls.__name__} (accepts {', '.join(sorted(accepted))})")
    return cls
