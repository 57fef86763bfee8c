"""The named formats: one `Format` row per name a user can write, and every name table derived from it.

A row says what a config slot given the name quantizes (`weight`, `default_activation`), what the
name means as an activation (`activation`, for `quant_key(name, "activation")`), its other names
(`aliases`) and the SQNR floor verify holds it to. `ROLE_NAMES`, `SHORTHANDS` and
`DEFAULT_ACTIVATION` are views of `FORMATS`, rebuilt in place by `register_format`, so modules that
imported them see a registered format. Kernel tables stay with their backends, keyed by the same
`(weight key, activation key)` pairs (docs/design.md §10: adding a format).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import keys as k
from .keys import QuantKey

# Verify's SQNR floor by the narrowest quantized operand's bits (docs/design.md §8): far below what a
# working kernel gives (8-bit ~28-31 dB, 4-bit ~17-20 dB on Gaussian data), far above a broken one.
FLOOR_DB_BY_BITS = {8: 20.0, 4: 10.0}

_SAME = object()  # default_activation not given: the name's activation key


@dataclass(frozen=True)
class Format:
    """One named format.

    `activation`: the key the name means for activations (`quant_key("mxfp4", "activation")`); None:
    the name is no activation name. `default_activation`: what a config slot given the name gets
    (the shorthand's second key; defaults to `activation`; None: weight-only). The name is also a
    role-aware weight name only when it names an activation: a weight-only shorthand used as a weight
    name would get its weight key's default activation, not "none". `aliases`: more role-aware names
    for the same keys, not shorthands. `floor_db`: verify's floor (None: by `bits`).
    """

    name: str
    weight: QuantKey
    activation: QuantKey | None
    default_activation: QuantKey | None = _SAME  # type: ignore[assignment]
    aliases: tuple[str, ...] = ()
    floor_db: float | None = None

    def __post_init__(self):
        if self.default_activation is _SAME:
            object.__setattr__(self, "default_activation", self.activation)
        if not self.weight.static:
            raise ValueError(f"format {self.name!r}: weight key {self.weight} must have static scales")

    @property
    def pair(self) -> tuple[QuantKey, QuantKey | None]:
        """The (weight, activation) keys a config slot given this name gets."""
        return (self.weight, self.default_activation)

    @property
    def bits(self) -> int:
        """The narrowest quantized operand's bits."""
        return min(key.bits for key in self.pair if key is not None)

    @property
    def verify_floor_db(self) -> float:
        return self.floor_db if self.floor_db is not None else FLOOR_DB_BY_BITS[self.bits]

    def role_names(self) -> dict[str, tuple[QuantKey, QuantKey | None]]:
        names = [self.name] if self.activation is not None else []
        return dict.fromkeys([*names, *self.aliases], (self.weight, self.activation))


# Order matters: the first row with a given weight key supplies that key's default activation
# (`DEFAULT_ACTIVATION`), and the first row with a given pair is the pair's name (`QuantSpec.name`).
# fmt: off
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("fp8_per_tensor",    k.kFp8StaticTensorSym,    k.kFp8DynamicTensorSym),
    Format("fp8_per_channel",   k.kFp8StaticChannelSym,   k.kFp8DynamicTokenSym, aliases=("fp8_per_token",)),
    Format("fp8_per_block",     k.kFp8Static128BlockSym,  k.kFp8Dynamic128Sym),
    Format("mxfp8",             k.kMxfp8Static,           k.kMxfp8Dynamic),
    Format("nvfp4",             k.kNvfp4Static,           k.kNvfp4Dynamic),
    Format("int8_per_channel",  k.kInt8StaticChannelSym,  k.kInt8DynamicTokenSym, aliases=("int8_per_token",)),
    Format("mxfp4",             k.kMxfp4Static,           k.kMxfp4Dynamic, default_activation=None),
    Format("fp8_weight_only",   k.kFp8StaticChannelSym,   None),
    Format("int8_weight_only",  k.kInt8StaticChannelSym,  None),
    Format("int4_weight_only",  k.kInt4StaticGroup128Sym, None, aliases=("int4_per_group",)),
    Format("nvfp4_weight_only", k.kNvfp4Static,           None),
)}
# fmt: on

# Views of FORMATS (rebuilt in place by `_derive`):
# role-aware names: name -> (weight key, activation key); `quant_key(name, role)` reads this
ROLE_NAMES: dict[str, tuple[QuantKey, QuantKey | None]] = {}
# shorthands: a config slot given one of these strings gets both keys
SHORTHANDS: dict[str, tuple[QuantKey, QuantKey | None]] = {}
# weight key -> the activation a spec naming only that weight gets
DEFAULT_ACTIVATION: dict[QuantKey, QuantKey | None] = {}


def _derive() -> None:
    ROLE_NAMES.clear()
    SHORTHANDS.clear()
    DEFAULT_ACTIVATION.clear()
    for fmt in FORMATS.values():
        ROLE_NAMES.update(fmt.role_names())
        SHORTHANDS[fmt.name] = fmt.pair
        DEFAULT_ACTIVATION.setdefault(fmt.weight, fmt.default_activation)


def register_format(fmt: Format) -> Format:
    """Add a named format (its keys must be registered: `keys.register_key`); names must be new."""
    taken = {*SHORTHANDS, *ROLE_NAMES}
    clash = [n for n in (fmt.name, *fmt.aliases) if n in taken]
    if clash:
        raise ValueError(f"format name {clash[0]!r} is taken; taken names: {', '.join(sorted(taken))}")
    FORMATS[fmt.name] = fmt
    _derive()
    return fmt


def unregister_format(name: str) -> None:
    if name not in FORMATS:
        raise ValueError(f"invalid format {name!r}; valid: {', '.join(FORMATS)}")
    del FORMATS[name]
    _derive()


def format_for(pair: tuple[QuantKey | None, QuantKey | None]) -> Format | None:
    """The first named format with this (weight, activation) pair, if any."""
    return next((f for f in FORMATS.values() if f.pair == tuple(pair)), None)


def floor_db(weight: QuantKey, activation: QuantKey | None) -> float:
    """Verify's SQNR floor for a pair: its named format's, else by the narrowest operand's bits."""
    fmt = format_for((weight, activation))
    if fmt is not None:
        return fmt.verify_floor_db
    return FLOOR_DB_BY_BITS[min(key.bits for key in (weight, activation) if key is not None)]


_derive()
