"""QuantSpec and QuantizationConfig: the one readable config, and how names become QuantKeys.

A config slot (`linear`, `moe`, a `targets` value) takes a shorthand string (both keys), a bare
key name (the weight key; activation left to the method's default), a dict, or a `QuantSpec`.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence

from .keys import KEYS, STATIC_ACTIVATION_KEYS, QuantKey
from .named_formats import DEFAULT_ACTIVATION, ROLE_NAMES, SHORTHANDS  # views of the one format table
from .names import BACKEND_NAMES, Kind

KINDS = tuple(Kind)
ROLES = ("weight", "activation")


class WeightFormatConflict(ValueError):
    """A config asks a pre-quantized layer for another weight format (without requantize)."""


def _invalid(field: str, value, valid: Iterable[str]) -> ValueError:
    return ValueError(f"invalid {field} {value!r}; valid: {', '.join(sorted(set(valid)))}")


def quant_key(name: str | QuantKey, role: str = "weight") -> QuantKey:
    """A QuantKey from a role-aware name (`"mxfp8"`), a constant name (`"kMxfp8Static"`) or a key."""
    if role not in ROLES:
        raise _invalid("role", role, ROLES)
    if isinstance(name, QuantKey):
        key = name
    elif name in ROLE_NAMES and ROLE_NAMES[name][ROLES.index(role)] is not None:
        return ROLE_NAMES[name][ROLES.index(role)]
    elif name in KEYS:
        key = KEYS[name]
    else:
        valid = [n for n, keys in ROLE_NAMES.items() if keys[ROLES.index(role)] is not None]
        raise _invalid(f"{role} quantization", name, [*valid, *KEYS])
    # static activation keys (a checkpoint's calibrated `input_scale`) are named by their constants
    if key.static != (role == "weight") and not (role == "activation" and key in STATIC_ACTIVATION_KEYS):
        need = "static" if role == "weight" else "dynamic"
        raise ValueError(f"invalid {role} key {key}: a {role} key must have {need} scales")
    return key


_UNSET = object()


class QuantSpec:
    """What to do to one layer: a weight key and an activation key.

    `activation` left unset means "the weight format's default" (`DEFAULT_ACTIVATION`); an explicit
    `None` means "do not quantize activations". `fields_set` says which fields were given.
    """

    __slots__ = ("_activation", "fields_set", "weight")

    def __init__(self, weight: str | QuantKey | None = None, activation=_UNSET):
        fields = {"weight"} if weight is not None else set()
        self.weight = None if weight is None else quant_key(weight, "weight")
        if activation is _UNSET:
            self._activation = None
        else:
            fields.add("activation")
            self._activation = None if activation is None else quant_key(activation, "activation")
        self.fields_set = frozenset(fields)

    @property
    def activation(self) -> QuantKey | None:
        """The activation key in effect (the weight format's default when unset)."""
        if "activation" in self.fields_set or self.weight is None:
            return self._activation
        return DEFAULT_ACTIVATION.get(self.weight)

    @property
    def pair(self) -> tuple[QuantKey | None, QuantKey | None]:
        return (self.weight, self.activation)

    @classmethod
    def from_name(cls, name: str) -> QuantSpec:
        """A shorthand gives both keys; any other name is a weight key."""
        if name in SHORTHANDS:
            return cls(*SHORTHANDS[name])
        try:
            return cls(weight=name)
        except ValueError:
            raise _invalid("quantization", name, [*SHORTHANDS, *ROLE_NAMES, *KEYS]) from None

    @classmethod
    def coerce(cls, value, field: str = "spec") -> QuantSpec | None:
        if value is None or isinstance(value, QuantSpec):
            return value
        if isinstance(value, QuantKey):
            return cls(weight=value)
        if isinstance(value, str):
            return cls.from_name(value)
        if isinstance(value, Mapping):
            unknown = set(value) - set(ROLES)
            if unknown:
                raise _invalid(f"{field} field", sorted(unknown)[0], ROLES)
            return cls(**{k: _none_if_null(v) for k, v in value.items()})
        raise ValueError(f"invalid {field} {value!r}: expected a name, a dict with {ROLES}, or a QuantSpec")

    def merged_with(self, override: QuantSpec | None) -> QuantSpec:
        if override is None:
            return self
        weight = override.weight if "weight" in override.fields_set else self.weight
        fields = {}
        for spec in (self, override):
            if "activation" in spec.fields_set:
                fields["activation"] = spec._activation
        return QuantSpec(weight, **fields)

    def to_dict(self) -> dict:
        out = {"weight": None if self.weight is None else str(self.weight)}
        if "activation" in self.fields_set:
            out["activation"] = None if self._activation is None else str(self._activation)
        return out

    def name(self) -> str:
        """The shorthand for this pair if there is one, else 'weight/activation'."""
        for shorthand, pair in SHORTHANDS.items():
            if pair == self.pair:
                return shorthand
        return f"{self.weight}/{self.activation}"

    def __eq__(self, other) -> bool:
        return isinstance(other, QuantSpec) and (self.weight, self._activation, self.fields_set) == (
            other.weight,
            other._activation,
            other.fields_set,
        )

    def __hash__(self) -> int:
        return hash((self.weight, self._activation, self.fields_set))

    def __repr__(self) -> str:
        activation = "unset" if "activation" not in self.fields_set else self._activation
        return f"QuantSpec(weight={self.weight}, activation={activation})"


def _none_if_null(value):
    return None if isinstance(value, str) and value.lower() in ("none", "null") else value


def pattern_matches(pattern: str, fqn: str) -> bool:
    """`re:<regex>` (full match), a glob (`*.gate`), or a name matching the FQN or a dotted suffix."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], fqn) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(fqn, pattern)
    return fqn == pattern or fqn.endswith("." + pattern)


def _check_pattern(pattern, field: str) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"invalid {field} pattern {pattern!r}: expected a non-empty string")
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"invalid {field} pattern {pattern!r}: {e}") from None
    return pattern


class QuantizationConfig:
    """Per-kind specs, per-layer `targets` overrides, `ignore` patterns and backend choices."""

    FIELDS = ("linear", "moe", "targets", "ignore", "backend")

    def __init__(self, linear=None, moe=None, targets=None, ignore=None, backend=None, *, _fields_set=None):
        given = {"linear": linear, "moe": moe, "targets": targets, "ignore": ignore, "backend": backend}
        self.fields_set = frozenset(
            _fields_set if _fields_set is not None else (k for k, v in given.items() if v is not None)
        )
        self.linear = QuantSpec.coerce(linear, "linear")
        self.moe = QuantSpec.coerce(moe, "moe")
        if targets is not None and not isinstance(targets, Mapping):
            raise ValueError(f"invalid targets {targets!r}: expected a dict of layer pattern -> spec")
        self.targets = {
            _check_pattern(p, "targets"): QuantSpec.coerce(_none_if_null(s), f"targets[{p!r}]")
            for p, s in (targets or {}).items()
        }
        if isinstance(ignore, str):
            ignore = [ignore]
        self.ignore = tuple(_check_pattern(p, "ignore") for p in (ignore or ()))
        self.backend = _coerce_backend(backend)

    # -- resolution ---------------------------------------------------------------------------
    def resolve(self, fqn: str, kind: str) -> QuantSpec | None:
        """The spec for one layer; an activation without a weight format raises (use the pass's
        `resolve_with_reason` for models that mix pre-quantized and full-precision layers)."""
        return self._resolve(fqn, kind)[0]

    def resolve_with_reason(
        self, fqn: str, kind: str, declared: QuantSpec | None = None, source: str = "checkpoint", requantize=False
    ) -> tuple[QuantSpec | None, str]:
        """The spec for one layer and where it came from. Ignore wins over targets.

        `declared`: the spec the layer's weights already have (a pre-quantized checkpoint: `source`).
        It is the default; the config may change its activation (the user's wins), not its weight
        format, unless `requantize` (from the dequantized weights)."""
        if declared is None:  # an activation-only slot is for pre-quantized layers: not this one
            spec, reason = self._resolve(fqn, kind, allow_activation_only=True)
            if spec is not None and spec.weight is None:
                return None, f"{reason} sets only an activation, for pre-quantized layers; this one is not"
            return spec, reason
        if any(pattern_matches(pattern, fqn) for pattern in self.ignore):
            return self._resolve(fqn, kind)
        spec, reason = self._resolve(fqn, kind, allow_activation_only=True)
        if spec is None:
            return declared, source
        if "weight" in spec.fields_set and spec.weight != declared.weight:
            if requantize:
                return spec, f"{reason} (re-quantized from the {source} weights)"
            raise WeightFormatConflict(
                f"layer {fqn!r}: the {source} weights are {declared.weight}; {reason} asks for {spec.weight}: "
                "drop it, or pass requantize=True to quantize again from the dequantized weights"
            )
        merged = declared.merged_with(spec)
        return merged, source if merged == declared else f"{source}, activation from {reason}"

    def _resolve(self, fqn: str, kind: str, allow_activation_only: bool = False) -> tuple[QuantSpec | None, str]:
        if kind not in KINDS:
            raise _invalid("kind", kind, KINDS)
        for pattern in self.ignore:
            if pattern_matches(pattern, fqn):
                return None, f"ignored by {pattern!r}"
        hits = {}  # distinct (weight, activation) pair -> first pattern giving it
        for pattern, spec in self.targets.items():
            if pattern_matches(pattern, fqn):
                hits.setdefault(None if spec is None else spec.pair, pattern)
        if len(hits) > 1:
            p1, p2 = list(hits.values())[:2]
            raise ValueError(f"layer {fqn!r} matches targets {p1!r} and {p2!r}, which give different specs")
        if hits:
            pattern = next(iter(hits.values()))
            spec, reason = self.targets[pattern], f"targets[{pattern!r}]"
        else:
            spec, reason = getattr(self, kind), f"config.{kind}"
        if spec is not None and spec.weight is None and not allow_activation_only:
            if spec.activation is not None:
                raise ValueError(f"{reason} sets activation {spec.activation} but no weight format for {fqn!r}")
            spec = None
        return spec, reason if spec is not None else f"no {kind} quantization configured"

    def matches_target(self, fqn: str) -> bool:
        return any(pattern_matches(p, fqn) for p in self.targets)

    def backend_for(self, kind: str) -> str:
        return self.backend.get(kind, "auto")

    @property
    def is_empty(self) -> bool:
        return self.linear is None and self.moe is None and not any(self.targets.values())

    # -- merging and (de)serialisation --------------------------------------------------------
    def merged_with(self, override: QuantizationConfig | None) -> QuantizationConfig:
        """Field by field; only fields the override set explicitly win (specs merge per key)."""
        if override is None:
            return self
        fields = {f: getattr(self, f) for f in self.FIELDS}
        for f in override.fields_set:
            value = getattr(override, f)
            if f in ("linear", "moe") and fields[f] is not None and value is not None:
                value = fields[f].merged_with(value)
            elif f == "backend":
                value = {**fields["backend"], **value}
            fields[f] = value
        return QuantizationConfig(**fields, _fields_set=self.fields_set | override.fields_set)

    def to_dict(self) -> dict:
        out = {}
        for f in sorted(self.fields_set, key=self.FIELDS.index):
            value = getattr(self, f)
            if f in ("linear", "moe"):
                value = None if value is None else value.to_dict()
            elif f == "targets":
                value = {p: None if s is None else s.to_dict() for p, s in value.items()}
            elif f == "ignore":
                value = list(value)
            out[f] = value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping) -> QuantizationConfig:
        if isinstance(data, QuantizationConfig):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(f"invalid quantization config {data!r}: expected a dict")
        unknown = set(data) - set(cls.FIELDS)
        if unknown:
            raise _invalid("quantization config field", sorted(unknown)[0], cls.FIELDS)
        return cls(**data, _fields_set=set(data))

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> QuantizationConfig:
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            with open(text) as f:
                text = f.read()
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid quantization config JSON: {e}") from None

    @classmethod
    def from_cli(cls, argv: Sequence[str]) -> QuantizationConfig:
        config, rest = parse_cli(argv)
        if rest:
            raise ValueError(f"unknown flag {rest[0]!r}; valid: --quantization, --quantization-config[.FIELD...]")
        return config

    def __eq__(self, other) -> bool:
        return isinstance(other, QuantizationConfig) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.to_json())

    def __repr__(self) -> str:
        return f"QuantizationConfig({self.to_json()})"


def _coerce_backend(backend) -> dict[str, str]:
    if backend is None:
        return {}
    if isinstance(backend, str):
        backend = dict.fromkeys(KINDS, backend)
    if not isinstance(backend, Mapping):
        raise ValueError(f"invalid backend {backend!r}: expected a name or a dict {{'linear': ..., 'moe': ...}}")
    for kind, name in backend.items():
        if kind not in KINDS:
            raise _invalid("backend kind", kind, KINDS)
        if name not in BACKEND_NAMES:
            raise _invalid(f"backend for {kind}", name, BACKEND_NAMES)
    return dict(backend)


_CLI_PREFIX = "--quantization-config"


def parse_cli(argv: Sequence[str]) -> tuple[QuantizationConfig, list[str]]:
    """Parse `--quantization NAME` and dotted `--quantization-config.a.b VALUE` flags.

    Returns the config and the arguments that are not quantization flags. `--quantization NAME`
    sets both `linear` and `moe`; later dotted flags override single fields on top of it.
    """
    config, rest, args = QuantizationConfig(), [], list(argv)
    while args:
        arg = args.pop(0)
        flag, eq, value = arg.partition("=")
        if flag != "--quantization" and not flag.startswith(_CLI_PREFIX):
            rest.append(arg)
            continue
        if not eq:
            if not args:
                raise ValueError(f"flag {flag} needs a value")
            value = args.pop(0)
        if flag == "--quantization":
            override = QuantizationConfig(linear=value, moe=value)
        elif flag == _CLI_PREFIX:
            override = QuantizationConfig.from_json(value)
        elif flag.startswith(_CLI_PREFIX + "."):
            override = QuantizationConfig.from_dict(_dotted(flag[len(_CLI_PREFIX) + 1 :], value, config))
        else:
            rest.append(arg)
            continue
        config = config.merged_with(override)
    return config, rest


def _dotted(path: str, value: str, current: QuantizationConfig) -> dict:
    field, _, sub = path.partition(".")
    if field not in QuantizationConfig.FIELDS:
        raise _invalid("flag", f"{_CLI_PREFIX}.{path}", [f"{_CLI_PREFIX}.{f}" for f in QuantizationConfig.FIELDS])
    value = _none_if_null(value)
    if field == "ignore":
        return {"ignore": [*current.ignore, *value.split(",")] if value else []}
    if field == "targets":
        if not sub:
            raise ValueError(f"flag {_CLI_PREFIX}.targets needs a pattern: {_CLI_PREFIX}.targets.PATTERN VALUE")
        return {"targets": {**current.targets, sub: value}}
    if not sub:
        return {field: value}
    if field == "backend":
        return {"backend": {sub: value}}
    if sub not in ROLES:
        raise _invalid("flag", f"{_CLI_PREFIX}.{path}", [f"{_CLI_PREFIX}.{field}.{r}" for r in ROLES])
    return {field: {sub: value}}
