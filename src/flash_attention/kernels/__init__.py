"""Kernel configs: the single source of truth for what a kernel is, one module per kind.

Every kind module exports the same names: ``KIND``, ``Config`` (its frozen dataclass),
``parse`` (name -> config), ``SETS`` (named tuples of configs), ``ROWS`` (its default table,
:class:`base.Row`) and ``select`` (the kernel of that kind for a :class:`base.Call` among built
ones). The kinds, in build order:

- ``fwd_sm80``: the sm80 family's forward (every GPU from sm_80)
- ``fwd_sm90``: the Hopper forward (sm_90a)
- ``bwd_sm80``: the sm80 family's backward
- ``bwd_sm90``: the Hopper backward (sm_90a)
- ``dec_sm80``: the sm80 family's decode kernels (KV caches, paged or not; split-KV)

and the helper kernels of the backward and decode kinds (helpers), compiled into their units.
A kernel's name starts with its kind (base.py says the scheme); legacy.py maps the names of the
old scheme. Code generation (flash_attention.codegen) reads these modules; nothing here imports
torch or the build.

A build's selection (FLASH_ATTENTION_KERNELS, :func:`resolve`) is comma-separated items: a set
name (``ci``, ``default``: that set of every kind that has one), a set of one kind or direction
(``fwd_sm90:tune``, ``bwd:default``), ``none``, or kernel names.
"""

from __future__ import annotations

from types import ModuleType

from . import bwd_sm80, bwd_sm90, dec_sm80, fwd_sm80, fwd_sm90, helpers
from .base import Call, ConfigError, KernelConfig, Row
from .helpers import HelperKernel
from .legacy import current_name, old_form

KINDS: dict[str, ModuleType] = {m.KIND: m for m in (fwd_sm80, fwd_sm90, bwd_sm80, bwd_sm90,
                                                    dec_sm80)}
DIRECTIONS = ("fwd", "bwd", "dec")

__all__ = ["DIRECTIONS", "KINDS", "Call", "ConfigError", "HelperKernel", "KernelConfig", "Row",
           "bwd_sm80", "bwd_sm90", "dec_sm80", "fwd_sm80", "fwd_sm90", "helpers", "kinds_of",
           "parse", "parse_kernel", "resolve", "set_names"]


def kinds_of(scope: str) -> list[ModuleType]:
    """The kind modules of a scope: a kind (``fwd_sm90``), a direction (``bwd``) or ``""``
    (all)."""
    if scope in KINDS:
        return [KINDS[scope]]
    if scope in DIRECTIONS or not scope:
        return [m for k, m in KINDS.items() if k.startswith(scope)]
    raise ConfigError(f"unknown kernel kind or direction {scope!r}; known: "
                      f"{', '.join([*KINDS, *DIRECTIONS])}")


def parse(name: str) -> KernelConfig:
    """The config of a main kernel's name, of any kind. An old-scheme name is refused with its
    new name (legacy.current_name)."""
    text = name.strip()
    try:
        for kind, module in KINDS.items():
            if text.startswith(kind + "_"):
                return module.parse(text)
    except ConfigError:
        if not old_form(text):  # an old bwd_sm90 name starts with the kind bwd_sm90_ too
            raise
    if old_form(text):
        raise ConfigError(f"{text!r} is a kernel name of the old scheme; its name now is "
                          f"{current_name(text)} (docs/kernel-names.md)")
    raise ConfigError(f"cannot parse kernel name {text!r}: a name starts with its kind, one of "
                      f"{', '.join(KINDS)} (e.g. {fwd_sm80.Config.EXAMPLE})")


def parse_kernel(name: str) -> KernelConfig | HelperKernel:
    """A main kernel's config (any kind) or a backward helper kernel's."""
    if HelperKernel.matches(name):
        return HelperKernel.parse(name)
    return parse(name)


def set_names(scope: str = "") -> list[str]:
    """The set names of a scope's kinds, once each, in kind order."""
    return list(dict.fromkeys(s for m in kinds_of(scope) for s in m.SETS))


def resolve(spec: str) -> tuple[KernelConfig, ...]:
    """The configs a selection names (see the module docstring), in order, without duplicates:
    a set's kinds in KINDS order. ``all`` is every set of its scope; ``none`` nothing. Raises
    ConfigError naming the bad item."""
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise ConfigError("empty kernel selection: name a set (" + ", ".join(
            [*set_names(), "all", "none"]) + "), a scoped set such as fwd_sm90:tune, or "
            "kernel names")
    out: list[KernelConfig] = []
    for item in items:
        scope, _, set_name = item.rpartition(":")
        if set_name == "none":
            kinds_of(scope)
            continue
        if set_name == "all" or set_name in set_names(scope):
            for module in kinds_of(scope):
                sets = module.SETS.values() if set_name == "all" else [module.SETS.get(set_name,
                                                                                       ())]
                for configs in sets:
                    out.extend(configs)
        elif scope:
            raise ConfigError(f"no set {set_name!r} in {scope}; its sets: "
                              f"{', '.join(set_names(scope))}")
        else:
            try:
                out.append(parse(item))
            except ConfigError as exc:
                raise ConfigError(f"{exc}; or name a set: "
                                  f"{', '.join([*set_names(), 'all', 'none'])}") from None
    return tuple(dict.fromkeys(out))
